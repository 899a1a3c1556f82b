"""Memory organizations behind one interface (see base.MemoryOrganization).

`ORG_TO_CLASS` is the organization registry: storage organization name -> class, each
class carrying every rule of its organization (unit layout, pools, budget conversion,
costs, addressing, default engine rules, slabs, retention). Everything that needs an
organization's facts looks its class up here (`org_class`, `org_layout`,
`normalize_org`), the way vLLM v1 picks a manager per cache spec from a registry dict;
the planner, storage, step models, arenas and builder loop over the registry and name
no organization (tests/test_org_registry.py holds that).

Adding an organization (tests/test_org_registry.py does it with a 256-token-page class):
1. `serving_core/memory/<org>.py`: a MemoryOrganization subclass with `org = "<ORG>"`,
   its `unit_layout(geometry)` (an OrgLayout; subclass it there for extra sizes), its
   pools (`pool_names`, `attention_pool`, `composite_pool`, `pool_unit_bytes`), its
   budget rounding (`units_of`, `budget_shares` or the whole `plan_pools`), what a
   checkpoint needs (`units_per_checkpoint`), its costs (`allocation_cost`) where the
   shared-page defaults do not fit, its `conv_addressing` for the torch arenas, its
   engine defaults (`checkpoint_placement`, `align_chunks`) and flags (`indirect`,
   `has_slabs`, `supports_retention`); override the runtime methods (allocation,
   eviction, `conv_line`) its mechanics change, as s2.py does for slabs;
2. one line: the class in `ORG_TO_CLASS` below (its position is its place in every table);
3. its arm in ledgers/arms.py (config name, ledger value, label, colour): `org=<name>`
   then runs, plans, prices and records it;
4. tests: a config in tests/test_memory_invariants.py (a test asks for one per registered
   organization) and hand-computed sizes beside tests/test_planner.py and test_storage.py.
An allocator whose pools do not own all their units at once (jenga.py: small pages exist
only inside large pages carved for their type) says which units are its pool's
(`carved(pool, unit)`) and checks its own bookkeeping (`check_own()`); memory/invariants.py
reads both. A cache policy (cache_policy.py) is a rule of every organization, not one.
"""

from __future__ import annotations

from dataclasses import replace

from serving_core.geometry import Geometry
from serving_core.layer_pattern import attention_group_first
from serving_core.layout import OrgLayout
from serving_core.memory.base import CONV_ADDRESSING, MemoryOrganization
from serving_core.memory.cache_policy import (
    CACHE_POLICIES,
    DEFAULT_MARCONI_ALPHA,
    build_cache_policy,
)
from serving_core.memory.d0 import D0DualPools
from serving_core.memory.events import MemoryEvents
from serving_core.memory.jenga import JengaTwoLevel
from serving_core.memory.n0 import N0UniformPages
from serving_core.memory.objects import NO_SLOT, NULL, Kind, StateObject
from serving_core.memory.prefix_cache import PrefixHit
from serving_core.memory.rules import AllocatorRules
from serving_core.memory.s0 import S0CoarsePages
from serving_core.memory.s1 import S1RecurrentPaging
from serving_core.memory.s2 import SLAB_POLICIES, S2PagingConvSlots

ORG_TO_CLASS: dict[str, type[MemoryOrganization]] = {
    cls.org: cls
    for cls in (S0CoarsePages, S1RecurrentPaging, S2PagingConvSlots, D0DualPools, N0UniformPages,
                JengaTwoLevel)
}


def normalize_org(org: str) -> str:
    """A storage organization's name, case-insensitive (s2 -> S2); ValueError names the
    registered ones. Experiment arms (s2_retention, ...) are the runner's: ledgers.arms
    maps them to organizations."""
    key = str(org).strip().upper()
    if key not in ORG_TO_CLASS:
        raise ValueError(f"org={org!r}: allowed values are {', '.join(ORG_TO_CLASS)}")
    return key


def org_class(org: str) -> type[MemoryOrganization]:
    """The class of a storage organization (case-insensitive; ValueError if unknown)."""
    return ORG_TO_CLASS[normalize_org(org)]


def org_layout(geometry: Geometry, org: str) -> OrgLayout:
    """Unit sizes of `org` under `geometry`, as its class derives them."""
    return org_class(org).unit_layout(geometry)


def build_memory(
    geometry: Geometry,
    org: str,
    pool_units: dict[str, int],
    events: MemoryEvents | None = None,
    rules: AllocatorRules | None = None,
    **overrides,
) -> MemoryOrganization:
    """The runtime allocator of `org` with pools sized by the planner ({pool: units}),
    running `rules` (memory.rules.AllocatorRules; None: the defaults) with `overrides`
    (rule name -> value) replacing some of them."""
    cls = org_class(org)
    layout = cls.unit_layout(geometry)
    expected = set(cls.pool_names)
    if set(pool_units) != expected:
        raise ValueError(
            f"pool_units for {cls.org} must name pools {sorted(expected)}, "
            f"got {sorted(pool_units)}"
        )
    rules = replace(rules or AllocatorRules(), **overrides)
    policy = build_cache_policy(rules.cache_policy, geometry, rules.marconi_alpha,
                                rules.marconi_weight)
    mem = cls(layout, dict(pool_units), events, rules=rules, cache_policy=policy)
    if rules.release_order == "groups":  # vLLM's KV cache group order for this model
        mem.attention_released_first = attention_group_first(geometry.layer_strings)
    return mem


__all__ = [
    "AllocatorRules",
    "CACHE_POLICIES",
    "DEFAULT_MARCONI_ALPHA",
    "CONV_ADDRESSING",
    "NO_SLOT",
    "NULL",
    "ORG_TO_CLASS",
    "D0DualPools",
    "JengaTwoLevel",
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
    "normalize_org",
    "org_class",
    "org_layout",
]
