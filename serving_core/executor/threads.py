"""Intra-op threads per phase, decided from a short measurement on the machine at hand.

`measure` times a prefill-sized and a decode-sized matrix product (best of a few runs each,
wall clock, a few ms per run) at each candidate thread count (`candidates`: 1, powers of
two, cores - 1) and the cost of switching the count between phases; `choose` is
the decision, a pure function of those timings: per phase, start from one thread and take a
larger count only when its product runs at least GAIN times faster than the count taken so
far (more threads cost CPU time the server's event loop and the rest of the machine could
use, so a few percent is not worth it). When the two phases get different counts and a
switch costs more than SWITCH_SHARE of the decode product, one count serves both (the one
with the least total time). The torch executor enters a phase's count before each forward
(`enter`), a no-op unless `install` set per-phase counts.

What auto does: counts up to cores - 1 are tried (one core stays with the front end), so
on 2 cores auto is one thread. On this 2-core machine, quiet, the products alone ran
>= 1.25x faster on two threads, yet served end to end two threads lost to one (`candidates`
gives the numbers); under load average ~18 the products themselves gave prefill 40.2 -> 35.7
and 27.9 -> 71.9 ms, decode 62.5 -> 85.9 and 38.3 -> 43.4 ms (1 -> 2 threads). vLLM's CPU
worker does the same on 2 cores: one OpenMP thread, the other core for its front end. On 8
cores the count climbs 1, 2, 4, 7 while each step pays 1.25x. On 64 cores it climbs
1 ... 32, 63 only while each step pays, so auto settles where these small products stop
scaling. The measurement takes a fraction of a second on a quiet machine, ~3 s under load.
"""

from __future__ import annotations

import os
import time

import torch

GAIN = 1.25  # a larger count must make the phase's product at least this much faster
SWITCH_SHARE = 0.05  # per-phase counts only when a switch costs under 5 % of a decode product
PHASES = ("prefill", "decode")
# (rows, inner, cols) of each phase's product: a 256-token chunk through a 256-wide model's
# 2,048-wide projection, and a 64-sequence decode batch through an 8,192-wide one (the
# weight-streaming shape of an LM head); ~0.27 GFLOP each, a few ms on one core.
SHAPES = {"prefill": (256, 256, 2048), "decode": (64, 256, 8192)}
REPEATS = 3

_phase: dict[str, int] | None = None  # per-phase counts in effect (install), None: one count


def candidates(cores: int) -> list[int]:
    """Thread counts tried on `cores` cores: 1, powers of two below cores - 1, and cores - 1.
    One core stays with the front end (event loop, tokenization, SSE, the client on a
    benchmark machine): served end to end on this 2-core machine, quiet (load 1.2-2.8,
    bench/side_by_side.sh, 64 x (1,000 + 64) tokens), the measured choice of 2 threads gave
    184.7 output tok/s and 1 thread 196.8 (at 16 concurrent 155.9 and 171.6), although the
    products alone ran >= 1.25x faster on two."""
    top = max(1, cores - 1)
    counts = {1, top}
    n = 2
    while n < top:
        counts.add(n)
        n *= 2
    return sorted(counts)


def choose(timings: dict[str, dict[int, float]], switch_s: float) -> dict[str, int]:
    """Per-phase thread counts from the products' seconds per count (see module docstring)."""
    pick = {}
    for phase, t in timings.items():
        best = min(t)
        for n in sorted(t):
            if t[n] * GAIN <= t[best]:
                best = n
        pick[phase] = best
    decode = min(timings["decode"].values())
    if len(set(pick.values())) > 1 and switch_s > SWITCH_SHARE * decode:
        common = set.intersection(*(set(t) for t in timings.values()))
        one = min(sorted(common), key=lambda n: sum(t[n] for t in timings.values()))
        pick = dict.fromkeys(pick, one)
    return pick


def _best_of(fn, repeats: int) -> float:
    fn()  # warm (and, after a switch, resize the thread pool)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(cores: int | None = None, repeats: int = REPEATS) -> dict:
    """Seconds of each phase's product per candidate count and of one count switch (a
    set_num_threads and the first small product after it), on this machine now."""
    cores = cores or os.cpu_count() or 1
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    ops = {}
    for phase, (m, k, n) in SHAPES.items():
        a, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        ops[phase] = lambda a=a, w=w: torch.nn.functional.linear(a, w)
    timings: dict[str, dict[int, float]] = {p: {} for p in PHASES}
    try:
        for count in candidates(cores):
            torch.set_num_threads(count)
            for phase in PHASES:
                timings[phase][count] = _best_of(ops[phase], repeats)
        small = torch.randn(64, 64, generator=gen)
        lo, hi = 1, candidates(cores)[-1]

        def switch():
            torch.set_num_threads(hi)
            small @ small
            torch.set_num_threads(lo)
            small @ small

        # small and cheap: many repeats, so one preemption on a busy machine does not count
        switch_s = max(0.0, (_best_of(switch, 5 * repeats)
                             - 2 * _best_of(lambda: small @ small, 5 * repeats)) / 2)
    finally:
        torch.set_num_threads(before)
    return {"timings": timings, "switch_s": switch_s}


def install(counts: dict[str, int] | None) -> None:
    """Per-phase counts for `enter` (None: one count, set by the caller, never switched)."""
    global _phase
    _phase = None if counts is None or len(set(counts.values())) == 1 else dict(counts)
    if counts:
        torch.set_num_threads(counts["decode"])


def enter(phase: str) -> None:
    """Set `phase`'s thread count when per-phase counts are installed."""
    if _phase is not None and torch.get_num_threads() != _phase[phase]:
        torch.set_num_threads(_phase[phase])
