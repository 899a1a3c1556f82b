"""Where a saturating real-path run spends its time (tiny Falcon-H1, in process).

Method: the engine serves N requests that all arrive at t=0 (prompt P tokens, O output
tokens, exact lengths, greedy) on the torch executor with one intra-op thread, with timing
hooks wrapped around the functions that make up a step. Each hook charges its *exclusive*
CPU time (the thread's user + system time, so a busy shared machine does not inflate it;
its own time minus that of hooked functions it calls) to a category, so the table's rows
add up to the engine's CPU time. The HTTP/SSE path and detokenization are not in this
process; `python -m bench serve` measures them end to end.

Categories:
  scheduler + engine loop    Engine.step minus the executor (scheduling, publication, records)
  state gathers / scatters   StateArena gather / scatter / read / write / gather_kv / store_kv
                             and the IO classes' page lookups (locate, block tables)
  attention                  FalconH1._attention (projections, RoPE, scores, softmax, o_proj)
  mamba mixer (decode)       FalconH1._mamba in decode batches (projections, conv, state update)
  mamba mixer (prefill)      FalconH1._mamba in prefill chunks (projections, conv, SSD scan)
  MLP, norms, LM head        the rest of FalconH1.forward and FalconH1.head (the step's one
                             128,256-wide projection over the rows that sample)
  executor other             execute/commit outside the model (ids, argmax sampling, commit)

Each category also gets its system CPU seconds and the minor page faults taken on the
engine thread (getrusage RUSAGE_THREAD, exclusive like the CPU time): with glibc malloc the
large per-step tensors are mmapped, page-faulted and unmapped every step, and that kernel
time is the allocator's cost. The run's totals (process getrusage) give minor/major page
faults per step and per output token. `--allocator` (auto|tcmalloc|glibc, as in
`bench.serve_bench`) re-executes the benchmark with that malloc preloaded (or not).

`--split-workers 1` splits the large products over a worker thread (serving_core/model/
split.py) and runs decode layers' attention there beside the mixer (layer pairs): the
categories stay the engine thread's CPU (its critical path; shares are of it), hooked calls
run on the worker are listed after them as "worker: ..." rows, and the worker's CPU seconds
are printed apart (`split.worker_cpu_s`) and are in the process user time.

`--handoffs` times each hand-off to the split worker per call site (split.log_handoffs:
the engine thread's own side and its wait, the worker's wall and CPU time, and the worker's
idle time before the job; wall times, so read them on a quiet machine).

`--torch-profile` adds torch.profiler's top operators (self CPU time) and the number of
tensor allocations (profile_memory's [memory] events).
Prints a table and one JSON line; writes bench/results/profile.json. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from bench.kernel_bench import MODEL, ROOT
from bench.tiny import tiny_checkpoint
from experiments.runners.server_process import ALLOCATORS, allocator_env
from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import Engine, serve
from serving_core.executor import huge_pages
from serving_core.executor import torch_executor as tx
from serving_core.executor.state_arena import StateArena
from serving_core.geometry import load_geometry
from serving_core.model import packed_linear, paged_loops, split
from serving_core.model.falcon_h1 import FalconH1
from serving_core.model.handoff_log import HandoffLog
from serving_core.server.process_settings import keep_freed_memory, warm_engine
from serving_core.server.runtime import ServedSpec

RESULTS = ROOT / "bench" / "results"


def _thread_usage() -> tuple[float, float, int]:
    """(CPU s, system s, minor page faults) of the calling thread so far."""
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time(), ru.ru_stime, ru.ru_minflt


WORKER = "worker: "  # prefix of the categories charged on the split worker's thread


class _Timer:
    """Exclusive thread CPU time, system time and minor faults per category over nested
    hooked calls, one stack per thread; a call on another thread than the engine's (the split
    worker's layer pairs) is charged to WORKER + its category."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.sys: dict[str, float] = defaultdict(float)
        self.faults: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.engine = threading.get_ident()
        self._local = threading.local()

    @property
    def stack(self) -> list[list]:
        """This thread's open frames: [category, start usage, child usage]."""
        local = self._local
        if not hasattr(local, "stack"):
            local.stack = []
        return local.stack

    def _close(self, frame: list) -> None:
        end = _thread_usage()
        used = [e - s for e, s in zip(end, frame[1], strict=True)]
        cat, child = frame[0], frame[2]
        self.totals[cat] += used[0] - child[0]
        self.sys[cat] += used[1] - child[1]
        self.faults[cat] += used[2] - child[2]
        self.calls[cat] += 1
        if self.stack:
            parent = self.stack[-1][2]
            for i, u in enumerate(used):
                parent[i] += u

    def wrap(self, owner, name: str, category) -> None:
        fn = getattr(owner, name)
        timer = self

        def hooked(*args, **kwargs):
            cat = category(*args, **kwargs) if callable(category) else category
            if threading.get_ident() != timer.engine:
                cat = WORKER + cat
            frame = [cat, _thread_usage(), [0.0, 0.0, 0]]
            timer.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                timer._close(timer.stack.pop())

        setattr(owner, name, hooked)
        return fn


def _mixer_kind(self, i, x, io):
    return "mamba mixer (decode)" if x.shape[1] == 1 else "mamba mixer (prefill)"


def install_hooks(timer: _Timer) -> list[tuple]:
    """Wrap the step's functions; returns (owner, name, original) to restore."""
    hooks = [
        (Engine, "step", "scheduler + engine loop"),
        (tx.TorchExecutor, "execute", "executor other"),
        (tx.TorchExecutor, "commit", "executor other"),
        (FalconH1, "forward", "MLP, norms, LM head"),
        (FalconH1, "head", "MLP, norms, LM head"),  # the step's one head, from execute
        (FalconH1, "_attention", "attention"),
        (FalconH1, "_mamba", _mixer_kind),
    ]
    state = "state gathers / scatters"
    for name in ("gather", "scatter", "read", "write", "gather_kv", "store_kv", "locate",
                 "gather_conv", "scatter_conv", "ssm_views", "recurrent_views", "kv_pages"):
        if hasattr(StateArena, name):
            hooks.append((StateArena, name, state))
    for cls_name in ("_DecodeIO", "_SegmentIO", "PagedRecurrentIO"):
        cls = getattr(tx, cls_name, None)
        if cls is not None:
            hooks.append((cls, "__init__", state))
    return [(owner, name, timer.wrap(owner, name, cat)) for owner, name, cat in hooks]


def _serve_measured(engine, specs, timer: _Timer, torch_profile: bool,
                    handoffs: bool = False) -> dict:
    """Serve `specs` with the hooks installed; wall, process CPU and page faults, and the
    torch profiler's table and the split worker's hand-offs per site when asked for."""
    restore = install_hooks(timer)
    prof, log = None, HandoffLog() if handoffs else None
    split.log_handoffs(log)
    try:
        if torch_profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                          profile_memory=True)
            prof.__enter__()
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        res = serve(engine, specs)
        wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        if prof is not None:
            prof.__exit__(None, None, None)
    finally:
        split.log_handoffs(None)
        for owner, name, fn in restore:
            setattr(owner, name, fn)
    out = {"wall_s": wall, "user_s": ru1.ru_utime - ru0.ru_utime,
           "system_s": ru1.ru_stime - ru0.ru_stime,
           "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
           "major_faults": ru1.ru_majflt - ru0.ru_majflt,
           "steps": int(res.summary.get("num_steps", engine.sched.step))}
    if log is not None:
        out["handoffs"] = log.table()
    if prof is not None:
        events = prof.key_averages()
        out["tensor_allocations"] = sum(e.count for e in events if e.key == "[memory]")
        out["top_ops"] = [
            {"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
        ]
    return out


def run(model, org: str, budget: str, requests: int, prompt: int, output: int,
        chunk: int, torch_profile: bool, warm_up: str = "auto", handoffs: bool = False) -> dict:
    rng = np.random.default_rng(11)
    geometry = load_geometry(MODEL)
    spec = loaded_model_spec(model, geometry, org, budget,
                             {"cap": requests, "max_num_batched_tokens": chunk})
    engine = build_engine(spec, model=model)
    warmed = warm_engine(engine, warm_up)  # as the server does before it serves
    specs = [ServedSpec(i, 0.0, rng.integers(3, 128_000, prompt).astype(np.int32), output)
             for i in range(requests)]
    timer = _Timer()
    m = _serve_measured(engine, specs, timer, torch_profile, handoffs)
    total = sum(v for k, v in timer.totals.items() if not k.startswith(WORKER))
    rows = {k: {"s": v, "share": v / total, "sys_s": timer.sys[k], "minor_faults":
                timer.faults[k], "calls": timer.calls[k]}
            for k, v in sorted(timer.totals.items(),
                               key=lambda kv: (kv[0].startswith(WORKER), -kv[1]))}
    tokens = requests * output
    return {
        "org": org, "budget": budget, "requests": requests, "prompt_tokens": prompt,
        "output_tokens": output, "max_num_batched_tokens": chunk,
        "threads": torch.get_num_threads(), **m,
        "faults_per_step": m["minor_faults"] / max(m["steps"], 1),
        "faults_per_output_token": m["minor_faults"] / tokens,
        "output_tok_s": tokens / m["wall_s"],
        "total_tok_s": requests * (prompt + output) / m["wall_s"],
        "load_avg": os.getloadavg()[0], "categories": rows, "warmup": warmed,
        "allocator": "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "glibc",
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        # read back while the engine's arena is alive, as the server's runtime record does
        "paged_loops": paged_loops.settings(), "arena_huge_pages": huge_pages.settings(),
    }


def print_table(r: dict) -> None:
    print(f"{r['org']} {r['budget']}: {r['requests']} requests x ({r['prompt_tokens']} prompt + "
          f"{r['output_tokens']} output) tokens, {r['threads']} thread(s), {r['allocator']}, "
          f"load avg {r['load_avg']:.2f}")
    print(f"wall {r['wall_s']:.2f} s ({r['steps']} steps), user {r['user_s']:.2f} s, system "
          f"{r['system_s']:.2f} s; {r['output_tok_s']:.1f} output tok/s, "
          f"{r['total_tok_s']:.1f} total tok/s")
    if "split" in r:
        sp = r["split"]
        print(f"split workers {sp['workers']}: worker CPU {sp['worker_cpu_s']:.2f} s")
    w = r.get("warmup") or {}
    if w.get("ran"):
        print(f"warm-up before the serve: {w['tokens']} prefill tokens, {w['rows']} decode rows, "
              f"{w['s']:.2f} s, {w['minor_faults']} page faults")
    print(f"page faults: {r['minor_faults']} minor, {r['major_faults']} major; "
          f"{r['faults_per_step']:.0f} per step, {r['faults_per_output_token']:.1f} per output "
          f"token" + (f"; {r['tensor_allocations']} tensor allocations"
                      if "tensor_allocations" in r else ""))
    print(f"{'category':28} {'CPU s':>9} {'share':>7} {'sys s':>7} {'faults':>9} {'calls':>8}")
    for name, row in r["categories"].items():
        print(f"{name:28} {row['s']:>9.3f} {100 * row['share']:>6.1f}% {row['sys_s']:>7.2f} "
              f"{row['minor_faults']:>9} {row['calls']:>8}")
    if r.get("handoffs"):
        print(f"{'hand-off site':44} {'calls':>6} {'here s':>7} {'wait s':>7} {'worker s':>8} "
              f"{'wCPU s':>7} {'w idle s':>8}")
        for name, h in r["handoffs"].items():
            print(f"{name[:44]:44} {h['calls']:>6.0f} {h['here_s']:>7.3f} "
                  f"{h['engine_wait_s']:>7.3f} {h['worker_s']:>8.3f} {h['worker_cpu_s']:>7.3f} "
                  f"{h['worker_idle_before_s']:>8.3f}")
    for op in r.get("top_ops", []):
        print(f"  {op['op'][:40]:40} {op['self_cpu_s']:>8.3f} s {op['calls']:>8}")


def _reexec_with(allocator: str) -> None:
    """Re-execute this benchmark with `allocator`'s malloc preloaded (or with no tcmalloc
    preload for glibc) unless the process already runs it; exit 2 naming the field when the
    allocator is unknown or not installed."""
    try:
        env, _ = allocator_env(allocator)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if env.get("LD_PRELOAD", "") != os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, "-m", "bench.profile_bench", *sys.argv[1:]],
                  env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "models" / MODEL))
    parser.add_argument("--org", default="S2")
    parser.add_argument("--budget", default="b512")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--split-workers", type=int, default=0, choices=(0, 1),
                        help="worker threads taking half of each large product "
                             "(serving_core/model/split.py; its CPU time is reported apart)")
    parser.add_argument("--packed-linear", default="auto", choices=("auto", "off"),
                        help="oneDNN-prepacked linear weights (serving_core/model/"
                             "packed_linear.py)")
    parser.add_argument("--warm-up", default="auto", choices=("auto", "off"),
                        help="the server's warm-up before the measured serve (serving_core/"
                             "model/warmup.py)")
    parser.add_argument("--torch-profile", action="store_true")
    parser.add_argument("--allocator", default="auto", choices=ALLOCATORS,
                        help="malloc of the run (auto: tcmalloc when installed)")
    parser.add_argument("--malloc", default="keep", choices=("keep", "default"),
                        help="keep freed memory (glibc or tcmalloc; the server's default) or not")
    parser.add_argument("--handoffs", action="store_true",
                        help="time the split worker's hand-offs per call site (split.py)")
    parser.add_argument("--out", default=str(RESULTS / "profile.json"))
    args = parser.parse_args(argv)
    if argv is None:
        _reexec_with(args.allocator)
    torch.set_num_threads(args.threads)
    split.install(args.split_workers)
    packed_linear.install(args.packed_linear)
    kept = args.malloc == "keep" and keep_freed_memory()
    with tiny_checkpoint(args.checkpoint) as checkpoint:
        model = FalconH1.load(checkpoint)
        r = run(model, args.org, args.budget, args.requests, args.prompt, args.output,
                args.max_num_batched_tokens, args.torch_profile, args.warm_up, args.handoffs)
        r["malloc_keeps_freed"] = kept
        r["split"] = dict(split.settings(), worker_cpu_s=split.worker_cpu_s())
        r["packed_linear"] = packed_linear.settings()
        split.close()
        print_table(r)
        print(json.dumps({k: v for k, v in r.items() if k != "top_ops"}))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
