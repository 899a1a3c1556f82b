"""The value types every memory organization describes itself with, and the shared units.

Each organization's class (serving_core/memory/<org>.py) derives its own `OrgLayout`
from a Geometry, converts a budget to its own `PoolPlan`s and prices a logical state
set as an `AllocationCost`; the registry (serving_core/memory/__init__.py:
`org_layout`, `org_class`) finds the class. This module names no organization, so
those classes, the planner, the storage accounting and the runtime allocators all
import it without a cycle and cannot disagree on a size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from serving_core.geometry import Geometry

PAGED_BLOCK_TOKENS = 512  # paged attention block and checkpoint interval (S0/S1/S2); pN pages
HYBRID_PAGE_TOKEN_ROUNDING = 16  # uniform hybrid page rounds the composite to 16 tokens
MIB = 2**20


def exact_fraction(value: float) -> Fraction:
    """The decimal a float was written as (0.527383, not its binary neighbour).

    Floors of fraction x count must not flip on binary representation error.
    """
    return Fraction(repr(float(value)))


def round_half_up(numerator: int, denominator: int) -> int:
    """Nearest integer, halves up, in exact integer arithmetic."""
    return (2 * numerator + denominator) // (2 * denominator)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_page_bytes(geometry: Geometry) -> int:
    """One paged attention block of `PAGED_BLOCK_TOKENS` tokens, in bytes (a pN page)."""
    return PAGED_BLOCK_TOKENS * geometry.attention_bytes_per_token


def uniform_page_bytes(geometry: Geometry) -> int:
    """U: the recurrent composite in attention tokens, rounded up to 16 tokens, in bytes.

    An attention-only model has no composite; its U is one paged attention block.
    """
    tok = geometry.attention_bytes_per_token
    if not geometry.has_recurrent:
        return paged_page_bytes(geometry)
    tokens = math.ceil(geometry.composite_bytes / tok)
    tokens = math.ceil(tokens / HYBRID_PAGE_TOKEN_ROUNDING) * HYBRID_PAGE_TOKEN_ROUNDING
    return tokens * tok


@dataclass(frozen=True, kw_only=True)
class OrgLayout:
    """Unit sizes of one organization under one geometry (its class computes them).

    A field an organization does not use is 0. An organization that needs more
    geometry subclasses this in its own module.
    """

    org: str
    block_tokens: int  # tokens per attention block
    checkpoint_interval: int  # tokens between recurrent checkpoints (0: no recurrent state)
    page_bytes: int  # unit of the attention pool (S0/S1/S2/N0 page, D0 attention unit)
    units_per_composite: int = 0  # units of the composite pool one composite takes (S2: no slot)
    ssm_members: int = 0  # units an SSM state is split over (S1/S2; N0's one page)
    conv_pages: int = 0  # dedicated conv pages per composite (S1)
    conv_slot_bytes: int = 0  # conv slot in a slab page (S2)
    slots_per_slab: int = 0  # conv slots in one slab page (S2)
    recurrent_unit_bytes: int = 0  # unit holding a whole composite (S0 page, D0 composite, N0)

    @property
    def has_recurrent(self) -> bool:
        return self.checkpoint_interval > 0


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Whole units of one pool: `num_units` usable units of `unit_bytes` each, plus
    `num_reserved` units the pool allocates but never hands out (N0's null block)."""

    org: str
    pool: str  # one of the organization's `pool_names`
    num_units: int
    unit_bytes: int
    num_reserved: int = 0

    @property
    def num_bytes(self) -> int:
        return (self.num_units + self.num_reserved) * self.unit_bytes


@dataclass(frozen=True, slots=True)
class AllocationCost:
    """Bytes one organization charges for a logical state set."""

    org: str
    attention_bytes: int
    recurrent_bytes: int  # S2: SSM member pages plus slab pages
    num_slabs: int  # slab pages (organizations with slabs); 0 for the others

    @property
    def num_bytes(self) -> int:
        return self.attention_bytes + self.recurrent_bytes

    @property
    def mib(self) -> float:
        return self.num_bytes / MIB
