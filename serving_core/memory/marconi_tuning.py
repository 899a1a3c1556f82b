"""Marconi's weight alpha chosen as Marconi chooses it: by replaying recent requests.

Marconi (Pan et al., MLSys 2025, section 4.2 "Managing the balance") runs alpha = 0 (LRU)
until the cache first evicts; it then logs a bootstrap window of requests (5 to 15 times
as many as arrived before that first eviction), replays the window on a shadow cache under
each alpha of a grid, and adopts the alpha with the highest token hit rate, tuning again
as the workload moves. Here (`engine.marconi_weight=tuned`, the default of
`engine.cache_policy=marconi`):

- the window is BOOTSTRAP_MULTIPLIER x the requests finished before the first eviction,
  its requests the most recent finished ones, in finishing order;
- the first tuning runs when the window has filled after that eviction, and again every
  window thereafter on the latest window (the workload's drift is followed window by
  window);
- the replay (`replay_hit_rate`) is a shadow checkpoint cache of `capacity` entries (the
  checkpoints the engine's cache holds when the tuning runs): each request in turn adopts
  the deepest cached grid boundary of its prompt (less its last token), then admits what
  Marconi admits (the branch point inside the prefix it shares with an earlier request of
  the window, and the end of its input plus output; CachePolicy.admitted_boundaries),
  evicting the entry of least recency' + alpha x efficiency' (min-max normalized; the
  efficiency of a checkpoint at boundary b is F(b) per byte, and every checkpoint holds
  the same bytes, so F(b) ranks them); ties go to the older entry;
- the hit rate is prompt tokens adopted over prompt tokens; among equal hit rates the
  smaller alpha wins (the nearest to LRU). Deterministic: no randomness, no clock.

Simplifications, stated: the replay is sequential (no concurrent requests holding states)
and assumes the attention prefix is cached (Marconi's radix tree keeps KV with states);
the tuning is instantaneous in simulated time (Marconi runs it asynchronously on CPUs).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_MULTIPLIER = 5  # the low end of Marconi's 5-15x bootstrap window
ALPHA_GRID = tuple(round(0.1 * i, 1) for i in range(21))  # 0, 0.1, ..., 2.0
MARCONI_WEIGHTS = ("tuned", "fixed")


@dataclass(frozen=True, slots=True)
class Replayed:
    """One finished request as the replay sees it: the chain key of every grid boundary
    of its tokens (boundary -> key), its block keys (for the shared prefix), its prompt
    length and the boundaries the engine's grid admits at its end (final tokens)."""

    grid_keys: tuple[tuple[int, int], ...]  # (boundary, key), ascending
    block_keys: tuple[int, ...]
    num_prompt: int
    final_tokens: int


def replayed(keys: list[int], num_prompt: int, final_tokens: int, block: int,
             interval: int) -> Replayed:
    """A request's record from its chain keys (one per full block of `block` tokens)."""
    step = interval // block
    grid = tuple((j * block, keys[j - 1]) for j in range(step, len(keys) + 1, step))
    return Replayed(grid, tuple(keys), num_prompt, final_tokens)


class _Shadow:
    """A checkpoint cache of `capacity` entries ranked by Marconi's utility (one slot per
    entry: its recency stamp and the FLOPs of its prefix)."""

    def __init__(self, capacity: int, alpha: float, flops) -> None:
        self.alpha, self.flops = alpha, flops
        self.entries: dict[int, int] = {}  # key -> slot
        self.keys: list[int] = []  # slot -> key
        self.stamp = np.zeros(capacity)
        self.eff = np.zeros(capacity)
        self.clock = 0

    def touch(self, key: int) -> None:
        self.clock += 1
        self.stamp[self.entries[key]] = self.clock

    def admit(self, key: int, boundary: int) -> None:
        if key in self.entries:
            self.touch(key)
            return
        if len(self.keys) < len(self.stamp):
            slot = len(self.keys)
            self.keys.append(key)
        else:
            slot = self.victim()
            del self.entries[self.keys[slot]]
            self.keys[slot] = key
        self.entries[key] = slot
        self.clock += 1
        self.stamp[slot], self.eff[slot] = self.clock, self.flops.prefix(boundary)

    def victim(self) -> int:
        """The slot of least recency' + alpha x efficiency' (the older stamp on a tie)."""
        score = normalized(self.stamp) + self.alpha * normalized(self.eff)
        tied = np.flatnonzero(score == score.min())
        return int(tied[np.argmin(self.stamp[tied])])


def normalized(values: np.ndarray) -> np.ndarray:
    """Min-max normalization to [0, 1] (all equal: zeros)."""
    low, span = values.min(), values.max() - values.min()
    return (values - low) / span if span > 0 else np.zeros_like(values)


def replay_hit_rate(window, capacity: int, alpha: float, flops, block: int, interval: int,
                    admitted) -> float:
    """Token hit rate of `window` (Replayed records, in order) on a shadow cache of
    `capacity` checkpoints under weight `alpha` (`block`, `interval`: the grid's block and
    checkpoint tokens; `admitted`: CachePolicy.admitted_boundaries)."""
    shadow = _Shadow(max(1, capacity), alpha, flops)
    seen: set[int] = set()
    hit_tokens = prompt_tokens = 0
    for r in window:
        hit = 0
        for boundary, key in reversed(r.grid_keys):
            if boundary <= r.num_prompt - 1 and key in shadow.entries:
                hit = boundary
                shadow.touch(key)
                break
        hit_tokens += hit
        prompt_tokens += r.num_prompt
        shared = 0
        while shared < len(r.block_keys) and r.block_keys[shared] in seen:
            shared += 1
        keys = dict(r.grid_keys)
        for boundary in sorted(admitted(shared * block, hit, r.num_prompt, r.final_tokens,
                                        interval)):
            if boundary in keys:
                shadow.admit(keys[boundary], boundary)
        seen.update(r.block_keys)
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


def best_alpha(window, capacity: int, flops, block: int, interval: int, admitted,
               grid=ALPHA_GRID) -> tuple[float, float]:
    """(alpha, hit rate): the grid's alpha of the highest replayed hit rate, the smallest
    among equals."""
    rates = [(replay_hit_rate(window, capacity, a, flops, block, interval, admitted), -a)
             for a in grid]
    rate, neg = max(rates)
    return -neg + 0.0, rate


class AlphaTuner:
    """When to tune and on which requests (module doc); `alpha` is the weight in force,
    `history` the tunings made: (requests finished, alpha, hit rate, window, capacity)."""

    def __init__(self, multiplier: int = BOOTSTRAP_MULTIPLIER, grid=ALPHA_GRID) -> None:
        self.multiplier, self.grid = multiplier, tuple(grid)
        self.alpha = 0.0
        self.finished = 0
        self.window_size: int | None = None  # known at the first eviction
        self.next_tuning: int | None = None
        self.recent: deque = deque()
        self.history: list[tuple[int, float, float, int, int]] = []

    def on_eviction(self) -> None:
        if self.window_size is None:
            self.window_size = self.multiplier * max(1, self.finished)
            self.next_tuning = self.finished + self.window_size
            self.recent = deque(self.recent, maxlen=self.window_size)

    def observe(self, record: Replayed) -> bool:
        """Log a finished request; True when a tuning is due now."""
        self.recent.append(record)
        self.finished += 1
        return self.next_tuning is not None and self.finished >= self.next_tuning

    def tune(self, capacity: int, flops, block: int, interval: int, admitted) -> float:
        window = list(self.recent)
        self.alpha, rate = best_alpha(window, capacity, flops, block, interval, admitted,
                                      self.grid)
        self.history.append((self.finished, self.alpha, round(rate, 6), len(window),
                             capacity))
        self.next_tuning = self.finished + self.window_size
        return self.alpha
