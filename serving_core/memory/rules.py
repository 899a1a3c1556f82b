"""The allocator's engine rules: one declaration each (serving_core/rules.py says how).

`build_memory` hands an `AllocatorRules` to the organization's class; the engine's
record reads each rule back from the built allocator (`effective`). The allowed values
and the mechanics of each rule are documented beside the code that runs it
(memory.base, memory.pool, memory.s2, memory.cache_policy; docs/engine_rules.md 3.4, 9).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_core.memory.base import (
    CHECKPOINT_RECENCIES,
    CONV_PAGE_RECENCIES,
    DUPLICATE_RULES,
    PRIVATE_BLOCK_RULES,
    RELEASE_ORDERS,
)
from serving_core.memory.cache_policy import (
    CACHE_POLICIES,
    DEFAULT_MARCONI_ALPHA,
    DEFAULT_MARCONI_WEIGHT,
)
from serving_core.memory.marconi_tuning import MARCONI_WEIGHTS
from serving_core.memory.pool import FREE_QUEUES
from serving_core.memory.s2 import SLAB_POLICIES
from serving_core.rules import check_rules, is_number, rule


def _one(values: set):
    """The value every pool agrees on (a rule set per pool must be one rule)."""
    assert len(values) == 1, f"pools disagree: {sorted(values)}"
    return next(iter(values))


@dataclass(frozen=True)
class AllocatorRules:
    """The rules of the memory organization (every organization unless a field says)."""

    slab_policy: str = rule(
        "write_once", "how S2 places conv slots in slab pages and when a slab's recency moves",
        allowed=SLAB_POLICIES, identity_neutral=False,
        requested=lambda value, ctx: value if ctx.org_class.has_slabs else None,
        effective=lambda mem: mem.slab_policy if mem.has_slabs else None)
    free_queue: str = rule(
        "free_first", "free units before cached ones (free_first) or vLLM's one LRU queue",
        allowed=FREE_QUEUES,
        effective=lambda mem: _one({"single_queue" if pool.single_queue else "free_first"
                                    for pool in mem.pools.values()}))
    checkpoint_recency: str = rule(
        "release", "whether adopting a cached checkpoint refreshes its member pages' recency",
        allowed=CHECKPOINT_RECENCIES)
    cache_policy: str = rule(
        "lru", "eviction order: recency (lru) or recency plus FLOPs saved per byte (marconi)",
        allowed=CACHE_POLICIES, effective=lambda mem: mem.cache_policy_name)
    marconi_weight: str = rule(
        DEFAULT_MARCONI_WEIGHT, "marconi: alpha re-chosen by replaying recent requests "
        "(tuned, Marconi 4.2) or engine.marconi_alpha (fixed)",
        allowed=MARCONI_WEIGHTS, identity_neutral=False,
        requested=lambda value, ctx: value if ctx.rules.cache_policy != "lru" else None,
        effective=lambda mem: None if mem.cache_policy is None else mem.cache_policy.weight)
    marconi_alpha: float = rule(
        DEFAULT_MARCONI_ALPHA, "marconi_weight=fixed: weight of the FLOPs-saved-per-byte term",
        check=lambda v: is_number(v) and v >= 0, shown="values are finite numbers >= 0",
        normalize=float,
        requested=lambda value, ctx: (value if ctx.rules.cache_policy != "lru"
                                      and ctx.rules.marconi_weight == "fixed" else None),
        effective=lambda mem: None if mem.cache_policy is None else mem.cache_policy.fixed_alpha)
    conv_page_recency: str = rule(
        "members", "S1's conv page: recency of its SSM members, or of its last write",
        allowed=CONV_PAGE_RECENCIES,
        requested=lambda value, ctx: value if ctx.layout.conv_pages else None)
    release_order: str = rule(
        "attention_first", "which of a released request's objects enter the LRU first",
        allowed=RELEASE_ORDERS)
    duplicates: str = rule(
        "drop", "a block or checkpoint recomputed while cached: kept private, or cached twice",
        allowed=DUPLICATE_RULES)
    private_blocks: str = rule(
        "mru", "a finishing request's unshared blocks enter the LRU last (mru) or first",
        allowed=PRIVATE_BLOCK_RULES)

    def __post_init__(self) -> None:
        check_rules(self)
        if self.cache_policy == "marconi" and self.free_queue != "free_first":
            raise ValueError(f"engine.free_queue={self.free_queue!r}: with "
                             "engine.cache_policy=marconi the allowed value is free_first")
