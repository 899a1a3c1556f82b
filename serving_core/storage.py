"""Allocation cost and capacity of logical state sets per organization.

The cost rules: docs/engine_rules.md section 3.1.

A logical state set is xA attention blocks of 512 tokens and xR complete
recurrent checkpoints. S0/S1/S2 charge whole pages of one shared pool; S2 also
charges slab pages holding the conv slots. D0 stores the same logical state in
its native units (512 / 16 attention units per block, one composite per
checkpoint) in two static pools, each checked alone against its share of the
budget. N0 holds the xA x 512 attention tokens as one contiguous prefix in its
own (larger) blocks, ceil(512 xA / block) pages, and one padded page per
checkpoint, all in one pool. Every size comes from `layout.org_layout`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from fractions import Fraction

from serving_core.geometry import KV_CODECS, Geometry, available_models, load_geometry
from serving_core.layout import (
    D0_BLOCK_TOKENS,
    ORGS,
    PAGED_BLOCK_TOKENS,
    normalize_org,
    org_layout,
)
from serving_core.planner import exact_fraction

MIB = 2**20


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")


def _check_state(geometry: Geometry, attention_blocks: int, checkpoints: int) -> None:
    _check_count("attention_blocks", attention_blocks)
    _check_count("checkpoints", checkpoints)
    if checkpoints and not geometry.has_recurrent:
        raise ValueError(
            f"checkpoints={checkpoints}: model {geometry.name} has no recurrent state, "
            "allowed value is 0"
        )


def min_slabs(geometry: Geometry, checkpoints: int) -> int:
    """Fewest S2 slab pages holding `checkpoints` conv slots (ideal packing)."""
    _check_count("checkpoints", checkpoints)
    if not checkpoints:
        return 0
    return math.ceil(checkpoints / org_layout(geometry, "S2").slots_per_slab)


def n0_attention_pages(geometry: Geometry, attention_blocks: int) -> int:
    """N0 pages holding `attention_blocks` 512-token blocks as one contiguous prefix."""
    _check_count("attention_blocks", attention_blocks)
    block = org_layout(geometry, "N0").block_tokens
    return math.ceil(attention_blocks * PAGED_BLOCK_TOKENS / block)


def d0_units_per_block(geometry: Geometry) -> int:
    """D0 attention units holding one 512-token paged attention block."""
    return PAGED_BLOCK_TOKENS // D0_BLOCK_TOKENS


@dataclass(frozen=True, slots=True)
class AllocationCost:
    """Bytes one organization charges for a logical state set."""

    org: str
    attention_bytes: int
    recurrent_bytes: int  # S2: SSM member pages plus slab pages
    num_slabs: int  # S2 slab pages; 0 for the other organizations

    @property
    def num_bytes(self) -> int:
        return self.attention_bytes + self.recurrent_bytes

    @property
    def mib(self) -> float:
        return self.num_bytes / MIB


def allocation_cost(
    geometry: Geometry,
    org: str,
    attention_blocks: int,
    checkpoints: int,
    slabs: int | None = None,
) -> AllocationCost:
    """Cost of xA attention blocks and xR checkpoints; `slabs` is S2 only.

    S2 with `slabs=None` packs ideally (ceil(xR / slots per slab) slab pages);
    an explicit `slabs` must be at least that minimum.
    """
    org = normalize_org(org)
    _check_state(geometry, attention_blocks, checkpoints)
    layout = org_layout(geometry, org)
    if slabs is not None and org != "S2":
        raise ValueError(f"slabs={slabs}: only org S2 has slab pages, allowed value is None")
    if org == "D0":
        attention = layout.page_bytes * d0_units_per_block(geometry) * attention_blocks
        return AllocationCost(org, attention, layout.recurrent_unit_bytes * checkpoints, 0)
    if org == "N0":
        attention = layout.page_bytes * n0_attention_pages(geometry, attention_blocks)
        return AllocationCost(org, attention, layout.page_bytes * checkpoints, 0)
    attention = layout.page_bytes * attention_blocks
    recurrent = layout.page_bytes * layout.pages_per_composite * checkpoints
    if org != "S2":
        return AllocationCost(org, attention, recurrent, 0)
    needed = min_slabs(geometry, checkpoints)
    if slabs is None:
        slabs = needed
    _check_count("slabs", slabs)
    if slabs < needed:
        raise ValueError(
            f"slabs={slabs}: {checkpoints} checkpoints need at least {needed} slab pages "
            f"({layout.slots_per_slab} slots each)"
        )
    return AllocationCost(org, attention, recurrent + layout.page_bytes * slabs, slabs)


def cost(
    geometry: Geometry,
    org: str,
    attention_blocks: int,
    checkpoints: int,
    slabs: int | None = None,
) -> int:
    """Bytes of `allocation_cost`."""
    return allocation_cost(geometry, org, attention_blocks, checkpoints, slabs).num_bytes


def all_costs(
    geometry: Geometry, attention_blocks: int, checkpoints: int, slabs: int | None = None
) -> dict[str, AllocationCost]:
    """Costs of every organization; `slabs` applies to S2 only."""
    return {
        org: allocation_cost(
            geometry, org, attention_blocks, checkpoints, slabs if org == "S2" else None
        )
        for org in ORGS
    }


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
    _check_budget(budget_bytes)
    if isinstance(attention_fraction, bool) or not 0 < attention_fraction <= 1:
        raise ValueError(
            f"d0_attention_fraction={attention_fraction}: allowed values are 0 < f <= 1"
        )
    frac = exact_fraction(attention_fraction)
    return D0Split(frac, math.floor(frac * budget_bytes), math.floor((1 - frac) * budget_bytes))


def d0_feasible(
    geometry: Geometry,
    attention_blocks: int,
    checkpoints: int,
    budget_bytes: int,
    attention_fraction: float | None = None,
) -> bool:
    """True when each D0 pool alone holds its part of the state set."""
    frac = geometry.d0_attention_fraction if attention_fraction is None else attention_fraction
    split = d0_split(budget_bytes, frac)
    need = allocation_cost(geometry, "D0", attention_blocks, checkpoints)
    return need.attention_bytes <= split.attention_bytes and (
        need.recurrent_bytes <= split.recurrent_bytes
    )


def _check_budget(budget_bytes: int) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive integer")


def _check_mix(geometry: Geometry, mix: tuple[int, int]) -> None:
    if len(mix) != 2:
        raise ValueError(f"mix={mix!r}: allowed form is (attention_blocks, checkpoints)")
    _check_state(geometry, *mix)
    if mix == (0, 0):
        raise ValueError("mix=(0, 0): at least one of attention_blocks, checkpoints must be > 0")


def _shared_capacity(geometry: Geometry, org: str, mix: tuple[int, int], budget: int) -> int:
    """Largest z with cost(z aA, z aR) <= M, by bisection (cost never decreases with z)."""
    # One copy's S2 slab page costs at most its member pages, so cost(z copies)
    # >= z x cost(one copy) / 2 and `high` below is already over budget. N0 packs
    # copies' attention into shared blocks, so z copies cost at least z x (their
    # attention bytes + checkpoint pages); that bound is used instead.
    if org == "N0":
        layout = org_layout(geometry, org)
        per_token = layout.page_bytes // layout.block_tokens
        floor_per_copy = mix[0] * PAGED_BLOCK_TOKENS * per_token + mix[1] * layout.page_bytes
        high = budget // floor_per_copy + 1
    else:
        high = 2 * budget // cost(geometry, org, *mix) + 1
    low = 0  # invariant: cost(low) <= M < cost(high)
    while high - low > 1:
        mid = (low + high) // 2
        fits = cost(geometry, org, mix[0] * mid, mix[1] * mid) <= budget
        low, high = (mid, high) if fits else (low, mid)
    return low


def _d0_capacity(geometry: Geometry, mix: tuple[int, int], split: D0Split) -> int:
    need = allocation_cost(geometry, "D0", *mix)
    limits = []
    if need.attention_bytes:
        limits.append(split.attention_bytes // need.attention_bytes)
    if need.recurrent_bytes:
        limits.append(split.recurrent_bytes // need.recurrent_bytes)
    return min(limits)


def capacity(
    geometry: Geometry,
    org: str,
    mix: tuple[int, int],
    budget_bytes: int,
    attention_fraction: float | None = None,
) -> int:
    """How many copies of the mix (aA blocks, aR checkpoints) fit in the budget.

    D0 splits the budget by `attention_fraction` (default: the geometry's) and
    takes the tighter pool; a type the mix does not use imposes no limit.
    """
    org = normalize_org(org)
    mix = tuple(mix)
    _check_budget(budget_bytes)
    _check_mix(geometry, mix)
    if org != "D0":
        return _shared_capacity(geometry, org, mix, budget_bytes)
    frac = geometry.d0_attention_fraction if attention_fraction is None else attention_fraction
    return _d0_capacity(geometry, mix, d0_split(budget_bytes, frac))


def mib_to_bytes(mib: str | float) -> int:
    """Whole bytes in a MiB amount written in decimal ("100", "96.5"); must be positive."""
    try:
        num_bytes = math.floor(Fraction(str(mib).strip()) * MIB)
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"capacity_mib={mib!r} must be a positive number") from exc
    if num_bytes <= 0:
        raise ValueError(f"capacity_mib={mib!r} must be a positive number")
    return num_bytes


def parse_mix(text: str) -> tuple[int, int]:
    """Parse "aA,aR" into two integers >= 0, not both zero."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"mix={text!r}: allowed form is aA,aR with integers >= 0")
    mix = (int(parts[0]), int(parts[1]))
    if mix == (0, 0):
        raise ValueError(f"mix={text!r}: at least one of aA, aR must be > 0")
    return mix


def costs_to_dict(costs: dict[str, AllocationCost]) -> dict:
    out = {org: {"bytes": c.num_bytes, "mib": c.mib} for org, c in costs.items()}
    out["S2"]["slabs"] = costs["S2"].num_slabs
    return out


def capacities_to_dict(
    geometry: Geometry, mix: tuple[int, int], budget_bytes: int, attention_fraction: float
) -> dict:
    """Capacity per organization plus the D0 split used."""
    out: dict = {
        org: capacity(geometry, org, mix, budget_bytes, attention_fraction) for org in ORGS
    }
    split = d0_split(budget_bytes, attention_fraction)
    out["budget_bytes"] = budget_bytes
    out["mix"] = list(mix)
    out["d0_split"] = {
        "attention_fraction": float(split.attention_fraction),
        "attention_bytes": split.attention_bytes,
        "recurrent_bytes": split.recurrent_bytes,
    }
    return out


def _format(data: dict) -> str:
    lines = []
    for org in ORGS:
        value = data[org]
        if isinstance(value, dict):
            extra = f"  slabs {value['slabs']}" if "slabs" in value else ""
            lines.append(f"{org}  {value['bytes']:>14,} B  {value['mib']:>12.6f} MiB{extra}")
        else:
            lines.append(f"{org}  {value:>8,} copies")
    if "d0_split" in data:
        s = data["d0_split"]
        lines.append(
            f"D0 split f={s['attention_fraction']}: attention {s['attention_bytes']:,} B, "
            f"recurrent {s['recurrent_bytes']:,} B"
        )
    return "\n".join(lines)


def _format_side_by_side(data: dict[str, dict]) -> str:
    """One row per organization, one column group per codec (bytes or copies)."""
    codecs = list(data)
    first = data[codecs[0]]
    capacity_mode = not isinstance(first[ORGS[0]], dict)
    header = ["org"] + [f"{c} copies" if capacity_mode else f"{c} bytes" for c in codecs]
    if not capacity_mode:
        header += [f"{c} MiB" for c in codecs]
    rows = []
    for org in ORGS:
        if capacity_mode:
            rows.append([org] + [f"{data[c][org]:,}" for c in codecs])
        else:
            row = [org] + [f"{data[c][org]['bytes']:,}" for c in codecs]
            rows.append(row + [f"{data[c][org]['mib']:.6f}" for c in codecs])
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in (header, *rows)]
    if capacity_mode:
        s = first["d0_split"]
        lines.append(f"budget {first['budget_bytes']:,} B, mix {first['mix']}; D0 split "
                     f"f={s['attention_fraction']}: attention {s['attention_bytes']:,} B, "
                     f"recurrent {s['recurrent_bytes']:,} B")
    else:
        lines.append("S2 slabs: " + ", ".join(f"{c} {data[c]['S2']['slabs']}" for c in codecs))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving_core.storage",
        description="Allocation cost of a logical state set, or capacity of a repeated mix.",
    )
    parser.add_argument("--model", required=True, help=f"one of {available_models()}")
    parser.add_argument(
        "--attention-blocks", type=int,
        help="xA: 512-token attention blocks (N0 holds them contiguously in its own blocks)",
    )
    parser.add_argument("--checkpoints", type=int, help="xR: recurrent checkpoints")
    parser.add_argument("--slabs", type=int, help="S2 slab pages (default: ideal packing)")
    parser.add_argument("--capacity-mib", help="budget M in MiB for capacity mode")
    parser.add_argument("--mix", help="aA,aR: blocks and checkpoints per copy (capacity mode)")
    parser.add_argument("--d0-attention-fraction", type=float, help="D0 split (default: model's)")
    parser.add_argument(
        "--kv-codec", choices=(*KV_CODECS, "both"),
        help="attention KV representation (default: the preset's); both: side by side",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _run(args: argparse.Namespace) -> dict:
    geometry = load_geometry(args.model)
    if args.kv_codec == "both":
        return {c: _run_one(args, geometry.with_codec(c)) for c in KV_CODECS}
    return _run_one(args, geometry.with_codec(args.kv_codec or geometry.kv_codec))


def _run_one(args: argparse.Namespace, geometry: Geometry) -> dict:
    capacity_mode = args.capacity_mib is not None or args.mix is not None
    cost_mode = args.attention_blocks is not None or args.checkpoints is not None
    if capacity_mode == cost_mode:
        raise ValueError(
            "mode: give either --attention-blocks and --checkpoints (cost) "
            "or --capacity-mib and --mix (capacity)"
        )
    if capacity_mode:
        if args.slabs is not None:
            raise ValueError("slabs: only cost mode takes --slabs (capacity packs S2 ideally)")
        if args.capacity_mib is None or args.mix is None:
            raise ValueError("capacity mode needs both --capacity-mib and --mix")
        frac = args.d0_attention_fraction
        frac = geometry.d0_attention_fraction if frac is None else frac
        return capacities_to_dict(geometry, parse_mix(args.mix), mib_to_bytes(args.capacity_mib),
                                  frac)
    if args.d0_attention_fraction is not None:
        raise ValueError("d0_attention_fraction: only capacity mode takes a D0 split")
    if args.attention_blocks is None or args.checkpoints is None:
        raise ValueError("cost mode needs both --attention-blocks and --checkpoints")
    return costs_to_dict(all_costs(geometry, args.attention_blocks, args.checkpoints, args.slabs))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        data = _run(args)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    side_by_side = args.kv_codec == "both"
    print(json.dumps(data) if args.json else
          _format_side_by_side(data) if side_by_side else _format(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
