"""Logical state objects and the sentinel for absence.

A StateObject is one logical unit of state that a request holds (through the
hybrid-state manager, serving_core.state_manager) or the prefix cache publishes:
an attention block (a fixed number of tokens of KV) or a recurrent composite
(SSM + conv state of one sequence at one token boundary).
Its physical placement (page ids, conv slot) is what a paged kernel reads.
"""

from __future__ import annotations

from enum import IntEnum


class Kind(IntEnum):
    ATTENTION = 0
    COMPOSITE = 1


class _Null:
    """Absence of a location. Never equal to a unit id, including 0."""

    __slots__ = ()
    is_null = True

    def __repr__(self) -> str:
        return "NULL"

    def __bool__(self) -> bool:
        return False


NULL = _Null()
NO_SLOT = -1  # negative conv-line sentinel: "no conv state"; never decoded as a slot


class StateObject:
    """One attention block or recurrent composite and where it lives.

    `units` are the ids of the units of pool `pool` the object owns alone (an attention
    block: one; a composite: one unit in S0, D0 and N0, else its SSM member pages, then
    S1's conv page); `slab_page` and `slot` locate an S2 conv slot (NO_SLOT when absent).
    `ref_count` counts execution references plus pins; a cached object with ref_count 0
    sits in its pool's LRU through its units.
    """

    __slots__ = (
        "oid",
        "kind",
        "pool",
        "units",
        "slab_page",
        "slot",
        "ref_count",
        "key",
        "boundary",
        "cached",
        "valid",
        "producer",
        "stamp",
        "shared",
    )
    is_null = False

    def __init__(self, oid: int, kind: Kind, pool: str, units: list[int], producer: int) -> None:
        self.oid = oid
        self.kind = kind
        self.pool = pool
        self.units = units
        self.slab_page = NO_SLOT
        self.slot = NO_SLOT
        self.ref_count = 1  # the allocating request holds it
        self.key: int | None = None
        self.boundary = -1  # tokens of prefix this state covers (checkpoints / block end)
        self.cached = False
        self.valid = True
        self.producer = producer
        self.stamp: int | None = None  # LRU stamp at publication (checkpoint_recency rule)
        self.shared = False  # adopted by a request other than its producer (private_blocks)

    def __repr__(self) -> str:
        return (
            f"StateObject(oid={self.oid}, kind={self.kind.name}, pool={self.pool}, "
            f"units={self.units}, slot=({self.slab_page},{self.slot}), ref={self.ref_count}, "
            f"cached={self.cached}, valid={self.valid})"
        )
