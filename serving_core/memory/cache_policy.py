"""Cache policies: which checkpoints enter the prefix cache and which cached unit leaves it.

`engine.cache_policy` (CACHE_POLICIES):
- `lru` (default): every checkpoint the placement rule creates is published, and eviction
  takes the least recently released unit of a pool (memory.pool.UnitPool); nothing here
  runs, so every earlier table is reproduced byte for byte.
- `marconi`: Marconi's admission and eviction (Pan et al., "Marconi: Prefix Caching for
  the Era of Hybrid LLMs", MLSys 2025), on this project's checkpoint grid:
  * admission by reuse scenario: a request publishes a recurrent checkpoint only at the
    boundaries a later request is likely to hit, Marconi's two scenarios: the shared-input
    branch point (the deepest grid boundary inside the cached attention prefix the request
    found at admission: its prompt shares that much with an earlier sequence, so a third
    sequence sharing it will hit there) and the end of input plus output (the deepest grid
    boundary the request's last computed token reaches, where a conversation continues).
    Attention blocks are published as under `lru` (Marconi keeps every KV in its radix
    tree). A checkpoint not admitted is handled like one already cached: the destination
    composite is freed and the request computes on.
  * eviction by utility: among a pool's evictable units the victim minimizes
    S = recency' + alpha x efficiency', each min-max normalized over the candidates
    (Marconi section 4.2), recency being the unit's LRU stamp and efficiency the FLOPs a
    hit on a recurrent checkpoint saves per byte it holds (`FlopModel`). alpha = 0 is LRU
    order; under `engine.marconi_weight=tuned` (the default) alpha is chosen as Marconi
    chooses it, by replaying the recent requests under a grid of weights
    (memory.marconi_tuning); under `fixed` it is `engine.marconi_alpha`. Ties go to the
    older stamp, then the lower unit. Attention blocks carry no FLOP term (efficiency 0,
    recency order, tail first): Marconi evicts only radix nodes without children, so a
    shared shallow block that deeper hits need never goes before them; ranking blocks by
    their own FLOPs would evict exactly those.
  Simplifications, stated: Marconi's radix tree checkpoints at the exact token where
  sequences diverge and at the exact last token; here checkpoints exist only on the
  organization's grid, so both points are rounded down to it; the final boundary is
  computed from the request's output length (its `max_tokens` when served). Marconi
  evicts radix nodes (KV and state together); here the score ranks the pool's units, a
  unit taking the score of the entry on it (a slab page the best of its cached slots).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real

import numpy as np

from serving_core.geometry import Geometry
from serving_core.memory.marconi_tuning import (
    MARCONI_WEIGHTS,
    AlphaTuner,
    normalized,
    replayed,
)
from serving_core.memory.pool import UnitPool

CACHE_POLICIES = ("lru", "marconi")
DEFAULT_MARCONI_ALPHA = 1.0  # engine.marconi_weight=fixed: equal weight of the two terms
DEFAULT_MARCONI_WEIGHT = "tuned"  # Marconi's replay over recent requests (marconi_tuning)


def check_cache_policy(policy: str, alpha: float, weight: str = DEFAULT_MARCONI_WEIGHT) -> None:
    """ValueError naming the field and the allowed values."""
    if policy not in CACHE_POLICIES:
        raise ValueError(f"engine.cache_policy={policy!r}: allowed values are "
                         f"{', '.join(CACHE_POLICIES)}")
    if weight not in MARCONI_WEIGHTS:
        raise ValueError(f"engine.marconi_weight={weight!r}: allowed values are "
                         f"{', '.join(MARCONI_WEIGHTS)}")
    if isinstance(alpha, bool) or not isinstance(alpha, Real) or not 0 <= alpha < float("inf"):
        raise ValueError(f"engine.marconi_alpha={alpha!r}: allowed values are finite "
                         "numbers >= 0")


@dataclass(frozen=True, slots=True)
class FlopModel:
    """Forward FLOPs of a prefix, from the geometry: a token at position t costs
    2 x params (every weight once, multiply and add) plus 4 x layers x heads x head_dim x t
    (attention scores and values over the t tokens before it), so n tokens cost
    F(n) = 2 P n + 2 L H d n (n - 1)."""

    params: int
    attention: int  # layers x query heads x head dim
    layers: int

    @classmethod
    def of(cls, geometry: Geometry) -> FlopModel:
        return cls(geometry.num_params,
                   geometry.num_layers * geometry.num_attention_heads * geometry.head_dim,
                   geometry.num_layers)

    def prefix(self, n: int) -> float:
        return 2.0 * self.params * n + 2.0 * self.attention * n * (n - 1)

    def span(self, start: int, end: int) -> float:
        """FLOPs of tokens [start, end) after a cached prefix of `start` tokens."""
        return self.prefix(end) - self.prefix(start)


class CachePolicy:
    """The `marconi` policy's decisions; an organization without one runs `lru`."""

    name = "marconi"

    def __init__(self, geometry: Geometry, alpha: float = DEFAULT_MARCONI_ALPHA,
                 weight: str = DEFAULT_MARCONI_WEIGHT) -> None:
        check_cache_policy(self.name, alpha, weight)
        self.weight = weight
        self.tuner = AlphaTuner() if weight == "tuned" else None
        self.alpha = 0.0 if self.tuner else float(alpha)  # the weight in force
        self.flops = FlopModel.of(geometry)

    @property
    def fixed_alpha(self) -> float | None:
        """engine.marconi_alpha as it runs: the fixed weight, None when tuned."""
        return None if self.tuner else self.alpha

    # ----- the weight, tuned (memory.marconi_tuning) ------------------------------------------
    def on_eviction(self) -> None:
        if self.tuner:
            self.tuner.on_eviction()

    def observe(self, req, block: int, interval: int, capacity: int) -> None:
        """A request finished (its tokens still held): log it, and tune when due."""
        if not self.tuner or not interval:
            return
        final = req.num_prompt + req.num_generated - 1
        record = replayed(req.ensure_keys(final // block)[: final // block], req.num_prompt,
                          final, block, interval)
        if self.tuner.observe(record):
            self.alpha = self.tuner.tune(capacity, self.flops, block, interval,
                                         self.admitted_boundaries)

    def tuning_record(self) -> list[dict] | None:
        """The tunings made (None under a fixed weight): when, the alpha chosen, its
        replayed hit rate, the window and the shadow cache's capacity."""
        if not self.tuner:
            return None
        keys = ("after_requests", "alpha", "hit_rate", "window", "capacity")
        return [dict(zip(keys, h, strict=True)) for h in self.tuner.history]

    # ----- admission -----------------------------------------------------------------------
    @staticmethod
    def admitted_boundaries(cached_attention: int, jadopt: int, num_tokens: int,
                            final_tokens: int, interval: int) -> frozenset[int]:
        """Checkpoint boundaries (tokens) a request admitted now may publish.

        cached_attention: contiguous cached attention prefix found at admission (tokens);
        jadopt: the adopted depth; num_tokens: tokens the request holds now (prompt plus
        output so far); final_tokens: tokens its last computed state covers (prompt plus
        output, less the last generated token, which is never fed back); interval: C.
        """
        if not interval:
            return frozenset()
        out = set()
        branch = (min(cached_attention, num_tokens - 1) // interval) * interval
        if branch > jadopt:
            out.add(branch)
        final = (final_tokens // interval) * interval
        if final > jadopt:
            out.add(final)
        return frozenset(out)

    # ----- eviction ------------------------------------------------------------------------
    def efficiency(self, is_checkpoint: bool, boundary: int, num_bytes: int) -> float:
        """FLOPs a hit on the entry saves per byte it holds: a checkpoint at boundary b
        saves the whole prefix F(b) (the state cannot be rebuilt from part of it); an
        attention block is ranked by recency alone (0; module doc)."""
        if not is_checkpoint or num_bytes <= 0 or boundary <= 0:
            return 0.0
        return self.flops.prefix(boundary) / num_bytes

    def make_pool(self, name: str, num_units: int, unit_bytes: int, free_queue: str,
                  weight_of: Callable[[int], float]) -> ScoredPool:
        if free_queue != "free_first":
            raise ValueError(f"engine.free_queue={free_queue!r}: engine.cache_policy=marconi "
                             "ranks evictable units itself; allowed value is free_first")
        return ScoredPool(name, num_units, unit_bytes, self, weight_of)


class ScoredPool(UnitPool):
    """A UnitPool whose eviction takes the unit of least Marconi utility (module doc).

    `evictable` keeps its meaning (unit -> recency stamp); `weight_of(unit)` gives the
    efficiency of the entry on a unit when the unit becomes evictable; alpha is the
    policy's weight in force (it moves when tuned)."""

    __slots__ = ("policy", "weight_of", "_stamp", "_eff", "_mask")

    def __init__(self, name: str, num_units: int, unit_bytes: int, policy: CachePolicy,
                 weight_of: Callable[[int], float]) -> None:
        super().__init__(name, num_units, unit_bytes, "free_first")
        self.policy = policy
        self.weight_of = weight_of
        self._stamp = np.zeros(num_units, dtype=np.int64)
        self._eff = np.zeros(num_units, dtype=np.float64)
        self._mask = np.zeros(num_units, dtype=bool)

    def add_evictable(self, unit: int, stamp: int | None = None) -> None:
        self.gains += 1
        if stamp is None:
            stamp = self.tick()
        self.evictable[unit] = stamp
        self._stamp[unit] = stamp
        self._eff[unit] = self.weight_of(unit)
        self._mask[unit] = True

    def discard_evictable(self, unit: int) -> None:
        if self.evictable.pop(unit, None) is not None:
            self._mask[unit] = False

    def lru_first(self) -> bool:
        return not self.free

    def victim(self) -> int:
        """The evictable unit of least utility (no change)."""
        units = np.flatnonzero(self._mask)
        stamps = self._stamp[units]
        eff = self._eff[units]
        score = normalized(stamps.astype(np.float64)) + self.policy.alpha * normalized(eff)
        best = units[score == score.min()]
        if len(best) > 1:
            stamps = self._stamp[best]
            best = best[stamps == stamps.min()]
        return int(best[0])

    def pop_lru(self) -> int:
        self.policy.on_eviction()
        unit = self.victim()
        del self.evictable[unit]
        self._mask[unit] = False
        return unit


def build_cache_policy(policy: str, geometry: Geometry, alpha: float = DEFAULT_MARCONI_ALPHA,
                       weight: str = DEFAULT_MARCONI_WEIGHT) -> CachePolicy | None:
    """The policy object an organization runs (None: `lru`, the pools' own order)."""
    check_cache_policy(policy, alpha, weight)
    return None if policy == "lru" else CachePolicy(geometry, alpha, weight)
