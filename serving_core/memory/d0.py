"""D0 native dual pools: 16-token attention units and native composites in two static pools.

Capacity never moves between the pools; each is checked and evicted alone. A budget is
split once, by the model's `d0_attention_fraction` f: M_A = floor(f M) bytes of attention
units and M_R = floor((1 - f) M) of composites, each floored to whole units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from serving_core.geometry import Geometry
from serving_core.layout import OrgLayout, exact_fraction
from serving_core.memory.base import MemoryOrganization

D0_BLOCK_TOKENS = 16  # attention unit of the native dual pools
D0_CHECKPOINT_INTERVAL = 1792  # native recurrent checkpoint interval of D0


@dataclass(frozen=True, slots=True)
class D0Split:
    """Static split of a byte budget between the D0 attention and recurrent pools."""

    attention_fraction: Fraction
    attention_bytes: int
    recurrent_bytes: int


def d0_split(budget_bytes: int, attention_fraction: float) -> D0Split:
    """M_A = floor(f x M), M_R = floor((1 - f) x M), f in (0, 1].

    Flooring loses nothing: units are whole, so floor(M_A / u) = floor(floor(M_A) / u).
    """
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive integer")
    check_attention_fraction(attention_fraction)
    frac = exact_fraction(attention_fraction)
    return D0Split(frac, math.floor(frac * budget_bytes), math.floor((1 - frac) * budget_bytes))


def check_attention_fraction(attention_fraction: float) -> None:
    if (isinstance(attention_fraction, bool) or not isinstance(attention_fraction, Real)
            or not 0 < attention_fraction <= 1):
        raise ValueError(
            f"d0_attention_fraction={attention_fraction}: allowed values are 0 < f <= 1"
        )


class D0DualPools(MemoryOrganization):
    org = "D0"
    pool_names = ("attention", "recurrent")
    attention_pool = "attention"
    composite_pool = "recurrent"
    conv_addressing = "unit"
    # The native path publishes at every boundary a chunk crosses; chunks are not aligned.
    checkpoint_placement = "every_boundary"
    align_chunks = False

    def __init__(self, layout: OrgLayout, pool_units: dict[str, int], events=None, **rules):
        if not layout.has_recurrent:  # no recurrent state: a single attention pool
            pool_units = {"attention": pool_units["attention"]}
        super().__init__(layout, pool_units, events, **rules)

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """16-token attention units; one native composite per recurrent unit."""
        rec = geometry.has_recurrent
        return OrgLayout(org=cls.org, block_tokens=D0_BLOCK_TOKENS,
                         checkpoint_interval=D0_CHECKPOINT_INTERVAL if rec else 0,
                         page_bytes=D0_BLOCK_TOKENS * geometry.attention_bytes_per_token,
                         units_per_composite=1 if rec else 0,
                         recurrent_unit_bytes=geometry.composite_bytes)

    @classmethod
    def pool_unit_bytes(cls, layout: OrgLayout) -> dict[str, int]:
        return {"attention": layout.page_bytes, "recurrent": layout.recurrent_unit_bytes}

    @classmethod
    def budget_shares(cls, geometry: Geometry, budget_bytes: int) -> dict[str, int]:
        split = d0_split(budget_bytes, geometry.d0_attention_fraction)
        return {"attention": split.attention_bytes, "recurrent": split.recurrent_bytes}

    @classmethod
    def units_of(cls, share_bytes: int, unit_bytes: int) -> int:
        """Whole units that fit the pool's share (floor): the pools are sized at start-up."""
        return share_bytes // unit_bytes

    @classmethod
    def split_summary(cls, geometry: Geometry, budget_bytes: int) -> dict:
        split = d0_split(budget_bytes, geometry.d0_attention_fraction)
        return {"attention_fraction": float(split.attention_fraction),
                "attention_bytes": split.attention_bytes,
                "recurrent_bytes": split.recurrent_bytes}

    def ssm_member_pages(self, obj):
        """A native composite is one contiguous unit: its only member."""
        return list(obj.units[:1])
