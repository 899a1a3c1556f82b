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
  MLP, norms, LM head        the rest of FalconH1.forward (incl. the 128,256-wide projection)
  executor other             execute/commit outside the model (ids, argmax sampling, commit)

`--torch-profile` adds torch.profiler's top operators (self CPU time).
Prints a table and one JSON line; writes bench/results/profile.json. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np
import torch

from bench.kernel_bench import MODEL, ROOT
from bench.tiny import tiny_checkpoint
from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import Engine, serve
from serving_core.executor import torch_executor as tx
from serving_core.executor.state_arena import StateArena
from serving_core.geometry import load_geometry
from serving_core.model.falcon_h1 import FalconH1
from serving_core.server.runtime import ServedSpec

RESULTS = ROOT / "bench" / "results"


class _Timer:
    """Exclusive wall time per category over nested hooked calls."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []  # [category, start, child time]

    def wrap(self, owner, name: str, category) -> None:
        fn = getattr(owner, name)
        timer = self

        def hooked(*args, **kwargs):
            cat = category(*args, **kwargs) if callable(category) else category
            frame = [cat, time.thread_time(), 0.0]
            timer.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                timer.stack.pop()
                elapsed = time.thread_time() - frame[1]
                timer.totals[cat] += elapsed - frame[2]
                timer.calls[cat] += 1
                if timer.stack:
                    timer.stack[-1][2] += elapsed

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


def run(model, org: str, budget: str, requests: int, prompt: int, output: int,
        chunk: int, torch_profile: bool) -> dict:
    rng = np.random.default_rng(11)
    geometry = load_geometry(MODEL)
    spec = loaded_model_spec(model, geometry, org, budget,
                             {"cap": requests, "max_num_batched_tokens": chunk})
    engine = build_engine(spec, model=model)
    specs = [ServedSpec(i, 0.0, rng.integers(3, 128_000, prompt).astype(np.int32), output)
             for i in range(requests)]
    timer = _Timer()
    restore = install_hooks(timer)
    prof = None
    try:
        if torch_profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        cpu0, t0 = os.times(), time.perf_counter()
        res = serve(engine, specs)
        wall, cpu1 = time.perf_counter() - t0, os.times()
        if prof is not None:
            prof.__exit__(None, None, None)
    finally:
        for owner, name, fn in restore:
            setattr(owner, name, fn)
    total = sum(timer.totals.values())
    steps = int(res.summary.get("num_steps", engine.sched.step))
    rows = {k: {"s": v, "share": v / total, "calls": timer.calls[k]}
            for k, v in sorted(timer.totals.items(), key=lambda kv: -kv[1])}
    out = {
        "org": org, "budget": budget, "requests": requests, "prompt_tokens": prompt,
        "output_tokens": output, "max_num_batched_tokens": chunk,
        "threads": torch.get_num_threads(), "wall_s": wall, "steps": steps,
        "user_s": cpu1.user - cpu0.user, "system_s": cpu1.system - cpu0.system,
        "output_tok_s": requests * output / wall,
        "total_tok_s": requests * (prompt + output) / wall,
        "load_avg": os.getloadavg()[0], "categories": rows,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if prof is not None:
        out["top_ops"] = [
            {"op": e.key, "self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ]
    return out


def print_table(r: dict) -> None:
    print(f"{r['org']} {r['budget']}: {r['requests']} requests x ({r['prompt_tokens']} prompt + "
          f"{r['output_tokens']} output) tokens, {r['threads']} thread(s), "
          f"load avg {r['load_avg']:.2f}")
    print(f"wall {r['wall_s']:.2f} s ({r['steps']} steps), user {r['user_s']:.2f} s, system "
          f"{r['system_s']:.2f} s; {r['output_tok_s']:.1f} output tok/s, "
          f"{r['total_tok_s']:.1f} total tok/s")
    print(f"{'category':28} {'CPU s':>9} {'share':>7} {'calls':>8}")
    for name, row in r["categories"].items():
        print(f"{name:28} {row['s']:>9.3f} {100 * row['share']:>6.1f}% {row['calls']:>8}")
    for op in r.get("top_ops", []):
        print(f"  {op['op'][:40]:40} {op['self_cpu_s']:>8.3f} s {op['calls']:>8}")


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
    parser.add_argument("--torch-profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tiny_checkpoint(args.checkpoint) as checkpoint:
        model = FalconH1.load(checkpoint)
        r = run(model, args.org, args.budget, args.requests, args.prompt, args.output,
                args.max_num_batched_tokens, args.torch_profile)
        print_table(r)
        print(json.dumps({k: v for k, v in r.items() if k != "top_ops"}))
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "profile.json").write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
