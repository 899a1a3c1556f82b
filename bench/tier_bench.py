"""Where a host-tier reload's time goes, and the copy port before and after issue 30.

`python -m bench.tier_bench [--org d0] [--tokens 3584] [--reps 7]` on the tiny model
(models/falcon_h1_tiny): one cold request publishes its entries; then, alternating old and
new in one run (median of `reps`):

- restore: `HybridStateManager.restore_prefix` of the prompt's deepest held prefix into a
  reset device, with the copy port as it was (`LegacyCopier`: per-layer Python loops, every
  destination unit poisoned, the serving default then) and as it is (`ArenaCopier`: one
  indexed copy per region, no poisoning when serving), and the new port with poisoning on
  (the audits' setting);
- save on the engine thread: the old synchronous snapshot of the entry (per-layer stack and
  host copy) against the new engine-thread part (copy holds and hand-off to the worker), and
  the worker's copy itself;
- where one restore spends its time (cProfile, by function, old and new);
- in-process TTFT of cold requests with the tier off and on (two engines, alternating, each
  rep a new document), and of a reload (reset + request) against the device-reuse repeat of
  the same prompt on the same engine (same B), alternating.

The last line is JSON with every number. Measured side by side, never asserted in tests.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import statistics
import sys
import time

import numpy as np
import torch

from serving_core.executor.state_copy import ArenaCopier, ThreadCopier
from serving_core.host_tier import HostTier
from serving_core.state_manager import BLOCK, CHECKPOINT


class LegacyCopier:
    """The copy port before issue 30 (kept here only to measure against): a block's KV
    stacked layer by layer, a checkpoint read through the arena's per-layer gather, writes
    one layer at a time, every destination unit filled with NaN first."""

    def __init__(self, arena) -> None:
        self.arena = arena

    def nbytes(self, obj) -> int:
        return ArenaCopier(self.arena).nbytes(obj)

    def read(self, obj):
        arena = self.arena
        if not obj.kind:
            unit = obj.units[0]
            return torch.stack([arena.kv_view(layer)[unit] for layer in range(arena.layers)]
                               ).to("cpu", copy=True)
        return [(c.to(arena.dtype).cpu(), s.to(arena.dtype).cpu()) for c, s in arena.read(obj)]

    def poison(self, obj) -> int:
        arena = self.arena
        pool = arena.pools[obj.pool]
        for unit in obj.units:
            pool[:, unit].fill_(math.nan)
        if obj.kind and arena.mem.has_slabs:
            arena.conv_slot(arena.mem.conv_line(obj)).fill_(math.nan)
        return len(obj.units)

    def load_block(self, obj, data) -> int:
        arena, unit = self.arena, obj.units[0]
        for layer in range(arena.layers):
            arena.kv_view(layer)[unit] = data[layer].to(arena.device, copy=True)
        return data.numel() * data.element_size()

    def load_checkpoint(self, obj, states) -> int:
        device = self.arena.device
        self.arena.write(obj, [(c.to(device, copy=True), s.to(device, copy=True))
                               for c, s in states])
        return sum(c.numel() * c.element_size() + s.numel() * s.element_size()
                   for c, s in states)


def _engine(org: str, tier: bool):
    from experiments.studies.reload_study import server_spec
    from serving_core.builder import build_engine

    spec = server_spec("models/falcon_h1_tiny", "falcon_h1_tiny", org, "b63", tier, True)
    return build_engine(spec)


def _serve(engine, prompt, rid: int) -> float:
    """TTFT (s) of one request served alone on `engine`."""
    from experiments.workloads.workload import RequestSpec

    engine.submit(RequestSpec(rid, 0.0, np.asarray(prompt, dtype=np.int32), 2, -1, ""))
    t0, first = time.perf_counter(), None
    while engine.has_work():
        out = engine.step()
        if out is not None and first is None and any(r == rid for r, _ in out.produced):
            first = time.perf_counter() - t0
    if engine.host_tier is not None:
        engine.host_tier.flush(engine.sched.state)
    return first


def _profile(fn, top: int = 8) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, _line, name), (_, calls, tottime, _cum, _) in stats.stats.items():
        rows.append({"function": f"{path.rsplit('/', 1)[-1]}:{name}", "calls": calls,
                     "tottime_ms": 1e3 * tottime})
    rows.sort(key=lambda r: -r["tottime_ms"])
    return rows[:top]


def _restore_times(cold, spec_keys, tiers: dict, ports: dict, reps: int):
    """Restore seconds per tier (alternating), what each moved, and one profiled restore."""
    state = cold.sched.state

    def restore(name):
        cold.reset_prefix_cache()
        t0 = time.perf_counter()
        got = state.restore_prefix(spec_keys, tiers[name], ports[name])
        return time.perf_counter() - t0, got

    times = {name: [] for name in tiers}
    moved = {}
    for _ in range(reps):
        for name in tiers:
            dt, got = restore(name)
            times[name].append(dt)
            moved[name] = (got.prefix_tokens, got.bytes_h2d, len(got.blocks))
    profiles = {name: _profile(lambda n=name: restore(n)) for name in ("old", "new")}
    return times, moved, profiles


def _save_times(cold, new_port, old_port, reps: int):
    """Engine-thread seconds of saving every cached part: the old synchronous snapshot,
    the new hold and hand-off, and the new worker's copy to done."""
    state = cold.sched.state
    objs = [(BLOCK, k, o) for k, o in cold.mem.cache.attention.items()]
    objs += [(CHECKPOINT, k, o) for k, o in cold.mem.cache.checkpoints.items()]
    worker = ThreadCopier(new_port)
    save_old, save_new, copy_new = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _, _, obj in objs:
            old_port.read(obj)
        save_old.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for kind, key, obj in objs:
            worker.submit((kind, key, obj, state.hold_for_copy(obj)), obj)
        save_new.append(time.perf_counter() - t0)
        worker.wait()
        copy_new.append(time.perf_counter() - t0)
        for (_, _, obj, token), _ in worker.done():
            state.end_copy_hold(obj, token)
    worker.close()
    return len(objs), save_old, save_new, copy_new


def _served_times(org: str, tokens: int, prompt, reps: int):
    """Cold TTFT with the tier off and on, then reload against device-reuse repeat, all
    in process and alternating."""
    from experiments.studies.reload_study import prompt_ids

    warm = _engine(org, True)
    off = _engine(org, False)
    for engine in (warm, off):
        _serve(engine, prompt_ids(1024, -1, 0), 0)
    cold_on, cold_off = [], []
    rid = 10
    for i in range(reps):
        fresh = prompt_ids(tokens, 100 + i, 0)  # its own document: a cold request
        for engine in ((off, warm) if i % 2 == 0 else (warm, off)):
            rid += 1
            (cold_on if engine is warm else cold_off).append(_serve(engine, fresh, rid))

    reload_s, repeat_s = [], []
    _serve(warm, prompt, rid)
    for i in range(reps):
        order = ("repeat", "reload") if i % 2 == 0 else ("reload", "repeat")
        for what in order:
            rid += 1
            if what == "reload":
                warm.reset_prefix_cache()
                reload_s.append(_serve(warm, prompt, rid))
            else:
                repeat_s.append(_serve(warm, prompt, rid))
    warm.host_tier.close()
    return cold_on, cold_off, reload_s, repeat_s


def _print_medians(out: dict) -> None:
    print(f"{out['org']} N={out['tokens']}: restore B={out['restored_B']} "
          f"({out['restore_blocks']} blocks + checkpoint), {out['reps']} alternating reps, "
          "medians")
    for k, v in out["restore_ms"].items():
        print(f"  restore {k:>10}: {v:8.2f} ms  ({out['restore_bytes_h2d'][k]:,} B)")
    for k, v in out["save_engine_thread_ms"].items():
        print(f"  save {k}: {v:8.2f} ms for {out['save_entries']} parts")
    for k, v in out["ttft_s"].items():
        print(f"  TTFT {k}: {v:.3f}")
    for name, rows in out["profile_top_tottime"].items():
        print(f"  one restore, {name}, top functions by own time:")
        for r in rows:
            print(f"    {r['tottime_ms']:8.2f} ms {r['calls']:6d} calls  {r['function']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tier_bench", description=__doc__)
    p.add_argument("--org", default="d0")
    p.add_argument("--tokens", type=int, default=3584)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    from experiments.studies.reload_study import prompt_ids
    from serving_core.request import Request

    torch.manual_seed(0)
    prompt = prompt_ids(args.tokens, 0, 0)
    cold = _engine(args.org, False)
    cold.sched.state.log_publications()
    _serve(cold, prompt, 0)
    state = cold.sched.state
    arena = cold.executor.arena
    new_port, old_port = ArenaCopier(arena), LegacyCopier(arena)
    tiers = {"old": HostTier(1 << 31, poison=True), "new": HostTier(1 << 31),
             "new+poison": HostTier(1 << 31, poison=True)}
    ports = {"old": old_port, "new": new_port, "new+poison": new_port}
    log = list(state.publications or [])
    for name, tier in tiers.items():  # every tier gets the same entries
        state.publications = list(log)
        state.start_saves(tier, ports[name])
        tier.complete()
    spec_keys = Request(cold.requests[0].spec, cold.mem.block_tokens).lookup_keys()
    depth = tiers["new"].restorable_prefix(spec_keys, cold.mem.block_tokens,
                                           cold.mem.checkpoint_interval)

    times, moved, profiles = _restore_times(cold, spec_keys, tiers, ports, args.reps)

    # ----- save on the engine thread, alternating ----------------------------------------
    cold.reset_prefix_cache()
    _serve(cold, prompt, 1)  # publish again (the reset dropped them)
    n_objs, save_old, save_new, copy_new = _save_times(cold, new_port, old_port, args.reps)

    cold_on, cold_off, reload_s, repeat_s = _served_times(args.org, args.tokens, prompt,
                                                          args.reps)

    med = statistics.median
    out = {
        "org": cold.mem.org, "tokens": args.tokens, "restored_B": depth, "reps": args.reps,
        "restore_ms": {k: 1e3 * med(v) for k, v in times.items()},
        "restore_bytes_h2d": {k: v[1] for k, v in moved.items()},
        "restore_blocks": moved["new"][2],
        "save_engine_thread_ms": {"old (synchronous snapshot)": 1e3 * med(save_old),
                                  "new (hold + hand-off)": 1e3 * med(save_new),
                                  "new worker copy (hand-off to done)": 1e3 * med(copy_new)},
        "save_entries": n_objs,
        "ttft_s": {"cold, tier off": med(cold_off), "cold, tier on": med(cold_on),
                   "cold on / off (median of per-rep ratios)": med(
                       [a / b for a, b in zip(cold_on, cold_off, strict=True)]),
                   "repeat (device reuse)": med(repeat_s), "reload (host tier)": med(reload_s),
                   "reload / repeat (median of per-rep ratios)": med(
                       [a / b for a, b in zip(reload_s, repeat_s, strict=True)])},
        "profile_top_tottime": profiles,
    }
    _print_medians(out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
