"""A serving benchmark like vLLM's `benchmark_serving`: our server against vLLM's.

Workload (defaults, the issue-24 setting): 64 requests sent at once, 1,000-token prompts
(random token ids, the same for every arm), 64 output tokens each, EOS ignored,
streamed; one warm-up request per server before the timed batch. Arms: our server on the
tiny Falcon-H1 with the torch executor (S2, then S0 and D0 next to it; budget b512, cap
64) and, when `.venv-vllm` exists, vLLM's OpenAI server on the same checkpoint (its own
N0 organization). Each server runs alone; arms alternate, round after round.

Allocator: `--allocator auto` preloads tcmalloc into every server (ours and vLLM's)
when a libtcmalloc is installed (Debian: libgoogle-perftools4 or libtcmalloc-minimal4),
`glibc` never does; the table says which ran. Large per-step temporaries under glibc
malloc are mmapped and page-faulted every step; tcmalloc keeps them (returning a free span
to the kernel now and then), and our servers keep them under either (glibc's mallopt or
tcmalloc's release rate 0 at start, serving_core/server/process_settings.py) unless
`--malloc default`; the table's alloc column then reads glibc+keep or tcmalloc+keep.

Per request, client side: TTFT (send to first token), TPOT ((last - first token) /
(tokens - 1)), end to end. Per arm: output and total (prompt + output) tokens per second
over the batch's wall time, TTFT / TPOT p50 and p99; server side, the server process
tree's CPU ms and minor page faults per output token over the batch and its warm-up
(bench/proc_usage.py; meaningful on a loaded machine where wall-clock rates are not).
Prints one table and a JSON line; writes bench/results/serve.json (serve_vllm_client.json
with --client vllm). Numbers, not assertions.

Clients: `--client ours` (default) is the client above (token-id prompts, greedy).
`--client vllm` measures every arm with vLLM's own benchmark client instead, unmodified
(bench/vllm_bench_client.py runs its `vllm bench serve` module with .venv-vllm's
interpreter): its random dataset (prompts of `--prompt` random tokens decoded to text with
the checkpoint's tokenizer, re-aligned to the server's /tokenize), `--ignore-eos
--temperature 0`, streamed, all at once, its own warm-up request; every server then
tokenizes text (ours with the llama3 encoding, vLLM with the checkpoint's files, no
--skip-tokenizer-init). The table then reads vLLM's result file (its TPOT is the same
per-request formula, its throughput its own duration) and says which client measured.
`--client guidellm` does the same with guidellm (`make setup-guidellm`): its openai_http
backend, synthetic text of `--prompt` tokens (the checkpoint's tokenizer), `--output`
tokens, all `--requests` at once (concurrent streams = requests, max_requests = requests),
its own sampling defaults (no temperature sent: both servers then sample at 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.proc_usage import thread_delta, thread_usage, tree_usage, usage_delta
from bench.tiny import tiny_checkpoint
from experiments.runners.server_process import ALLOCATORS, allocator_env
from ledgers.arms import ARMS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "falcon_h1_tiny"
OUR_ORGS = ("S2", "S0", "D0")
CLIENTS = ("ours", "vllm", "guidellm")
def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


async def _one(client, url, body, n_expected):
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            ids = choice.get("token_ids")
            n = len(ids) if ids is not None else int(choice.get("finish_reason") is None)
            now = time.perf_counter()
            times.extend([now] * n)
    if len(times) != n_expected:
        raise RuntimeError(f"got {len(times)} tokens, expected {n_expected}")
    return t0, times


async def _batch(url, model, prompts, output, extra):
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        warm = {"model": model, "prompt": prompts[0][:32], "max_tokens": 4,
                "ignore_eos": True, "temperature": 0.0, "stream": True, **extra}
        await _one(client, url, warm, 4)
        bodies = [{"model": model, "prompt": p, "max_tokens": output, "ignore_eos": True,
                   "temperature": 0.0, "stream": True, **extra} for p in prompts]
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, b, output) for b in bodies])
        wall = time.perf_counter() - t0
    ttft = [times[0] - s for s, times in results]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for _, times in results if len(times) > 1]
    e2e = [times[-1] - s for s, times in results]
    n_out = sum(len(t) for _, t in results)
    n_in = sum(len(p) for p in prompts)
    return {
        "wall_s": wall, "output_tok_s": n_out / wall, "total_tok_s": (n_out + n_in) / wall,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50),
    }


def _vllm_client(url, checkpoint, args, out_dir: Path) -> dict:
    """One batch measured by vLLM's own client (see the module docstring): its result."""
    import subprocess

    cmd = [str(args.vllm_python), str(ROOT / "bench" / "vllm_bench_client.py"),
           "--backend", "vllm", "--base-url", url, "--model", MODEL, "--tokenizer",
           str(checkpoint), "--dataset-name", "random", "--random-input-len", str(args.prompt),
           "--random-output-len", str(args.output), "--num-prompts", str(args.requests),
           "--ignore-eos", "--temperature", "0", "--num-warmups", "1", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", "result.json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({res.returncode}): {res.stderr[-1500:]}")
    r = json.loads((out_dir / "result.json").read_text())
    return {
        "wall_s": r["duration"], "output_tok_s": r["output_throughput"],
        "total_tok_s": r["total_token_throughput"],
        "ttft_p50_s": r["p50_ttft_ms"] / 1e3, "ttft_p99_s": r["p99_ttft_ms"] / 1e3,
        "tpot_p50_s": r["p50_tpot_ms"] / 1e3, "tpot_p99_s": r["p99_tpot_ms"] / 1e3,
        "e2e_p50_s": r["p50_e2el_ms"] / 1e3, "completed": r["completed"],
        "failed": r["failed"], "input_tokens": r["total_input_tokens"],
        "output_tokens": r["total_output_tokens"],
    }


def _guidellm_client(url, checkpoint, args, out_dir: Path) -> dict:
    """One batch measured by guidellm (see the module docstring): its result."""
    import subprocess

    path = out_dir / "guidellm.json"
    cmd = [str(args.guidellm), "run", "--backend",
           f"kind=openai_http,target={url},model={MODEL}",
           "--profile", f"kind=concurrent,streams={args.requests}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt},"
                     f"output_tokens={args.output}",
           "--tokenizer", f"kind=huggingface_auto,model={checkpoint}",
           "--output", f"kind=json,path={path}", "--disable-console-interactive"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=out_dir)
    if res.returncode != 0 or not path.exists():
        raise RuntimeError(f"guidellm failed ({res.returncode}): {res.stderr[-1500:]}")
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]

    def pct(name, q):
        return m[name]["successful"]["percentiles"][q] / 1e3

    totals = m["request_totals"]
    return {
        "wall_s": bench["duration"],
        "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
        "total_tok_s": m["tokens_per_second"]["successful"]["mean"],
        "ttft_p50_s": pct("time_to_first_token_ms", "p50"),
        "ttft_p99_s": pct("time_to_first_token_ms", "p99"),
        "tpot_p50_s": pct("time_per_output_token_ms", "p50"),
        "tpot_p99_s": pct("time_per_output_token_ms", "p99"),
        "e2e_p50_s": m["request_latency"]["successful"]["percentiles"]["p50"],
        "completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
        "output_tokens": m["output_token_count"]["successful"]["total_sum"],
    }


def _ours(checkpoint, org, args, records):
    """Our server on the checkpoint: the spec composed from run overrides, as `make serve`."""
    from experiments.runners.server_process import hsl_server_command
    from experiments.serve import server_spec

    spec = server_spec([f"model={MODEL}", "executor=torch", f"executor.checkpoint={checkpoint}",
                        f"org={org.lower()}", f"budget={args.budget}", f"engine.cap={args.cap}",
                        f"engine.max_num_batched_tokens={args.max_num_batched_tokens}"])
    path = Path(tempfile.mkdtemp(prefix="hsl-bench-")) / "spec.json"
    path.write_text(spec.to_json())
    return hsl_server_command(spec=str(path), records=records, threads=args.threads,
                              tokenizer="none" if args.client == "ours" else "llama3"
                              ) + ["--malloc", args.malloc, "--engine-core", args.engine_core,
                                   "--omp-wait", args.omp_wait,
                                   "--split-workers", args.split_workers]


def _vllm(checkpoint, args):
    from experiments.runners.vllm_arm import (
        VllmExecutorConfig,
        free_port,
        kv_cache_bytes,
        vllm_command,
    )
    from serving_core.geometry import load_geometry
    from serving_core.memory.n0 import N0_BLOCK_ALIGNMENT, N0_CPU_BLOCK_ALIGNMENT, n0_layout
    from serving_core.planner import plan_budget

    geometry = load_geometry(MODEL)
    plan = plan_budget(geometry, args.budget)
    vcfg = VllmExecutorConfig(checkpoint=checkpoint, python=str(args.vllm_python),
                              max_num_batched_tokens=args.max_num_batched_tokens)
    port = free_port()
    # vLLM's block on this device (CPU kernels align to 128 tokens, not 16), as the vLLM arm
    # computes it: the retention interval must be a multiple of vLLM's scheduler block.
    align = N0_CPU_BLOCK_ALIGNMENT if vcfg.device == "cpu" else N0_BLOCK_ALIGNMENT
    layout = n0_layout(geometry, align)
    cmd = vllm_command(vcfg, served_name=MODEL, port=port, cap=args.cap,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=geometry.max_model_len,
                       kv_bytes=kv_cache_bytes(plan.nominal_bytes, geometry.scope_layers),
                       block_tokens=layout.block_tokens)
    if args.client != "ours":  # text prompts: vLLM tokenizes with the checkpoint's files
        cmd.remove("--skip-tokenizer-init")
    return cmd, f"http://127.0.0.1:{port}", vcfg


def run_arm(arm, checkpoint, prompts, args, allocator) -> list[dict]:
    """One server start of `arm`, measured at each of `args.concurrency` (a batch of that
    many requests sent at once, each with its warm-up): one row per batch."""
    from experiments.runners.server_process import ServerProcess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if arm == "vllm":
            from experiments.runners.vllm_arm import vllm_env

            cmd, url, vcfg = _vllm(checkpoint, args)
            srv = ServerProcess(cmd, base_url=url, env=vllm_env(vcfg), health_timeout_s=900,
                                allocator=allocator)
            extra = {"return_token_ids": True}
        else:
            srv = ServerProcess(_ours(checkpoint, arm, args, str(Path(tmp) / "rec")),
                                health_timeout_s=300, allocator=allocator)
            extra = {}
        with srv:
            for n in args.concurrency:
                batch = argparse.Namespace(**{**vars(args), "requests": n})
                pid = srv.proc.pid if srv.proc else None
                usage0, threads0 = tree_usage(pid), args.per_thread and thread_usage(pid)
                row = _measure(srv.base_url, checkpoint, prompts[:n], batch, extra,
                               Path(tmp) / f"c{n}")
                usage = usage_delta(usage0, tree_usage(pid))
                if args.per_thread:  # the server tree's threads over the batch (JSON only)
                    row["server_threads"] = thread_delta(threads0, thread_usage(pid))
                # ours reads its settings back; vLLM's threads are its own (its CPU binding)
                settings = srv.runtime_config() or {"allocator": srv.allocator, "threads": None}
                rows.append({
                    "arm": "vllm" if arm == "vllm" else f"ours {arm}", "client": args.client,
                    "concurrency": n, "allocator": settings["allocator"] + (
                        "+keep" if settings.get("malloc_keeps_freed") else ""),
                    "threads": _threads_shown(settings),
                    "engine_core": settings.get("engine_core"),
                    "split_workers": (settings.get("split") or {}).get("workers"),
                    "load_avg": os.getloadavg()[0], **row,
                    **_per_token(usage, batch)})
    return rows


def _threads_shown(settings: dict):
    """The server's intra-op threads: a count, or prefill/decode counts under `auto`."""
    per_phase = (settings.get("threads_auto") or {}).get("per_phase")
    return f"{per_phase['prefill']}/{per_phase['decode']}" if per_phase else settings["threads"]


def _measure(url, checkpoint, prompts, args, extra, out_dir: Path) -> dict:
    """One batch of len(prompts) requests measured by `args.client`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.client == "vllm":
        return _vllm_client(url, checkpoint, args, out_dir)
    if args.client == "guidellm":
        return _guidellm_client(url, checkpoint, args, out_dir)
    return asyncio.run(_batch(url, MODEL, prompts, args.output, extra))


def _per_token(usage: dict, args) -> dict:
    """The server's CPU seconds and page faults over the batch (and its warm-up), in all and
    per output token (the process tree: vLLM's engine core is a child process)."""
    if not usage:
        return {}
    tokens = args.requests * args.output
    return {"server_" + k: v for k, v in usage.items()} | {
        "server_cpu_ms_per_token": 1e3 * usage["cpu_s"] / tokens,
        "faults_per_token": usage["minor_faults"] / tokens}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "models" / MODEL))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated batch sizes measured per server start, e.g. "
                             "1,16,64 (default: --requests)")
    parser.add_argument("--out", default=None,
                        help="result JSON (default bench/results/serve.json, "
                             "serve_<client>_client.json for another client)")
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--budget", default="b512")
    parser.add_argument("--cap", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--orgs", default=",".join(OUR_ORGS),
                        help="our organizations to serve (comma-separated)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds")
    parser.add_argument("--allocator", default="auto", choices=ALLOCATORS,
                        help="malloc of every server (auto: tcmalloc when installed)")
    parser.add_argument("--malloc", default="keep", choices=("keep", "default"),
                        help="our servers: keep freed memory (their default, glibc or "
                             "tcmalloc) or the allocator's defaults")
    parser.add_argument("--threads", type=int, default=0,
                        help="our servers' torch intra-op threads (0: the server's auto)")
    parser.add_argument("--engine-core", default="thread", choices=("thread", "process"),
                        help="where our servers' engine steps (serving_core.server "
                             "--engine-core)")
    parser.add_argument("--omp-wait", default="default", choices=("default", "passive"),
                        help="our servers' OpenMP waiting (serving_core.server --omp-wait)")
    parser.add_argument("--split-workers", default="auto", choices=("0", "1", "auto"),
                        help="our servers' split worker (serving_core.server --split-workers)")
    parser.add_argument("--per-thread", action="store_true",
                        help="also each server thread's CPU, faults, switches and run-queue "
                             "wait over each batch (bench/proc_usage.py), in the JSON rows")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                        help="vLLM's interpreter (the arm is skipped when it is absent)")
    parser.add_argument("--client", default="ours", choices=CLIENTS,
                        help="who measures: our client, vLLM's own (`vllm bench serve`) or "
                             "guidellm")
    parser.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"),
                        help="guidellm's command (--client guidellm)")
    return parser


def _print_table(rows: list[dict], args) -> None:
    """The arms side by side: throughput, TTFT and TPOT medians and p99s, load."""
    who = {"vllm": "vLLM's client (vllm bench serve, random dataset, greedy)",
           "guidellm": "guidellm (synthetic text, its sampling defaults)",
           "ours": "our client (token-id prompts, greedy)"}[args.client]
    print(f"{','.join(map(str, args.concurrency))} requests x ({args.prompt} prompt + "
          f"{args.output} output) tokens, "
          f"all at once, streamed, EOS ignored; measured by {who}; "
          f"{os.cpu_count()} CPUs")
    print(f"{'arm':9} {'client':6} {'alloc':13} {'thr':>3} {'conc':>4} {'ok':>5} {'out tok/s':>9} "
          f"{'total tok/s':>11} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>7} "
          f"{'load':>5} {'cpu ms/tok':>10} {'faults/tok':>10}")
    for row in rows:
        thr = "-" if row["threads"] is None else str(row["threads"])
        n = row["concurrency"]
        ok = f"{row.get('completed', n)}/{n}"
        print(f"{row['arm']:9} {row['client']:6} {row['allocator']:13} {thr:>3} {n:>4} {ok:>5} "
              f"{row['output_tok_s']:>9.1f} {row['total_tok_s']:>11.1f} "
              f"{row['ttft_p50_s']:>8.2f} {row['ttft_p99_s']:>7.2f} "
              f"{row['tpot_p50_s']:>8.3f} {row['tpot_p99_s']:>7.3f} {row['load_avg']:>5.1f} "
              f"{row.get('server_cpu_ms_per_token', float('nan')):>10.2f} "
              f"{row.get('faults_per_token', float('nan')):>10.1f}")


def _run_rounds(arms, checkpoint, prompts, args, path: Path) -> list[dict]:
    """Every arm, round after round (who goes first alternates); the result file is
    rewritten after each arm, so a run cut short keeps what it measured."""
    rows: list[dict] = []
    path.parent.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        for arm in order:
            print(f"round {r + 1}: {arm} ...", flush=True)
            rows += [dict(row, round=r + 1) for row in
                     run_arm(arm, checkpoint, prompts, args, args.allocator)]
            out = {"requests": args.requests, "concurrency": args.concurrency,
                   "prompt_tokens": args.prompt, "client": args.client,
                   "output_tokens": args.output, "budget": args.budget, "cap": args.cap,
                   "rows": rows}
            path.write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return rows


def concurrency_list(text: str | None, requests: int) -> list[int]:
    """Batch sizes of `--concurrency` ("1,16,64"; None: [requests]); ValueError names the
    field and the allowed values."""
    if text is None:
        return [requests]
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"concurrency={text!r}: allowed values are comma-separated whole "
                         "numbers >= 1 (e.g. 1,16,64)")
    return values


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # a `timeout` (bench/side_by_side.sh) ends the run through the servers' context managers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.client == "guidellm" and not Path(args.guidellm).exists():
        print(f"error: --client=guidellm: {args.guidellm} does not exist (make "
              "setup-guidellm); allowed without it: ours, vllm", file=sys.stderr)
        return 2
    if args.client == "vllm" and not Path(args.vllm_python).exists():
        print(f"error: --client=vllm: vLLM's client runs with {args.vllm_python}, which does "
              "not exist (make setup-vllm VLLM_DEVICE=cpu); allowed without it: ours",
              file=sys.stderr)
        return 2
    orgs = [o.strip().upper() for o in args.orgs.split(",") if o.strip()]
    allowed = [a.org for a in ARMS.values() if not a.retention and a.org != "N0"]
    bad = [o for o in orgs if o not in allowed]
    if bad:
        print(f"error: orgs={bad[0]!r}: allowed values are {', '.join(allowed)}",
              file=sys.stderr)
        return 2
    try:
        allocator_env(args.allocator)
        args.concurrency = concurrency_list(args.concurrency, args.requests)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with tiny_checkpoint(args.checkpoint) as checkpoint:
        rng = np.random.default_rng(24)
        prompts = [rng.integers(3, 128_000, args.prompt).tolist()
                   for _ in range(max(args.concurrency))]
        arms = list(orgs)
        if Path(args.vllm_python).exists():
            arms.insert(1, "vllm")
        else:
            print(f"vLLM arm skipped: no interpreter at {args.vllm_python} (make setup-vllm)")
        name = "serve.json" if args.client == "ours" else f"serve_{args.client}_client.json"
        rows = _run_rounds(arms, str(checkpoint), prompts, args,
                           Path(args.out) if args.out else RESULTS / name)
        _print_table(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
