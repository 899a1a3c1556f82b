"""Memory organizations behind one interface (see base.MemoryOrganization).

`ORG_TO_CLASS` is the organization registry: storage organization name -> class,
each class carrying its own facts (default rules, indirection, slabs, retention).
"""

from __future__ import annotations

from serving_core.geometry import Geometry
from serving_core.layout import ORGS, org_layout
from serving_core.memory.base import MemoryOrganization
from serving_core.memory.d0 import D0DualPools
from serving_core.memory.events import MemoryEvents
from serving_core.memory.n0 import N0UniformPages
from serving_core.memory.objects import NO_SLOT, NULL, Kind, StateObject
from serving_core.memory.prefix_cache import PrefixHit
from serving_core.memory.s0 import S0CoarsePages
from serving_core.memory.s1 import S1RecurrentPaging
from serving_core.memory.s2 import SLAB_POLICIES, S2PagingConvSlots

ORG_TO_CLASS: dict[str, type[MemoryOrganization]] = {
    cls.org: cls
    for cls in (S0CoarsePages, S1RecurrentPaging, S2PagingConvSlots, D0DualPools, N0UniformPages)
}
assert tuple(ORG_TO_CLASS) == ORGS, "layout.ORGS lists the registered organizations in order"


def org_class(org: str) -> type[MemoryOrganization]:
    """The class of a storage organization (S0 ... N0; case-insensitive)."""
    from serving_core.layout import normalize_org

    return ORG_TO_CLASS[normalize_org(org)]


def build_memory(
    geometry: Geometry,
    org: str,
    pool_units: dict[str, int],
    events: MemoryEvents | None = None,
    slab_policy: str = "write_once",
    free_queue: str = "free_first",
    checkpoint_recency: str = "release",
    conv_page_recency: str = "members",
    release_order: str = "attention_first",
    duplicates: str = "drop",
) -> MemoryOrganization:
    """The runtime allocator of `org` with pools sized by the planner ({pool: units}).

    `slab_policy` (S2 only): see memory.s2.SLAB_POLICIES; `free_queue` (memory.pool),
    `checkpoint_recency`, `release_order` and `duplicates` (memory.base) apply to every
    organization, `conv_page_recency` (memory.base) to one with a dedicated conv page (S1)."""
    rules = {"free_queue": free_queue, "checkpoint_recency": checkpoint_recency,
             "conv_page_recency": conv_page_recency, "release_order": release_order,
             "duplicates": duplicates}
    layout = org_layout(geometry, org)
    cls = ORG_TO_CLASS[layout.org]
    expected = {"attention", "recurrent"} if layout.org == "D0" else {"shared"}
    if set(pool_units) != expected:
        raise ValueError(
            f"pool_units for {layout.org} must name pools {sorted(expected)}, "
            f"got {sorted(pool_units)}"
        )
    if layout.org == "D0" and not geometry.has_recurrent:
        # No recurrent state: D0 is a single attention pool.
        pool_units = {"attention": pool_units["attention"]}
    if slab_policy not in SLAB_POLICIES:
        raise ValueError(
            f"engine.slab_policy={slab_policy!r}: allowed values are {', '.join(SLAB_POLICIES)}"
        )
    if cls.has_slabs:
        return cls(layout, dict(pool_units), events, slab_policy=slab_policy, **rules)
    return cls(layout, dict(pool_units), events, **rules)


__all__ = [
    "NO_SLOT",
    "NULL",
    "ORG_TO_CLASS",
    "D0DualPools",
    "Kind",
    "MemoryEvents",
    "MemoryOrganization",
    "N0UniformPages",
    "PrefixHit",
    "SLAB_POLICIES",
    "S0CoarsePages",
    "S1RecurrentPaging",
    "S2PagingConvSlots",
    "StateObject",
    "build_memory",
    "org_class",
]
