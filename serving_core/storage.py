"""Allocation cost and capacity of logical state sets per organization.

The cost rules: docs/engine_rules.md section 3.1.

A logical state set is xA attention blocks of 512 tokens and xR complete recurrent
checkpoints. Each organization's class (serving_core/memory/) prices it in its own units
(`allocation_cost`: S0/S1/S2 whole pages of one shared pool, S2 also slab pages for the
conv slots; D0 native units in two static pools; N0 the xA x 512 tokens as one contiguous
prefix in its larger blocks and one padded page per checkpoint) and says which pool pays
what (`pool_bytes`) and how a budget is shared between its pools (`budget_shares`). This
module checks the inputs and loops over the registry; it names no organization.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from fractions import Fraction

from serving_core.geometry import KV_CODECS, Geometry, available_models, load_geometry
from serving_core.layout import MIB, AllocationCost
from serving_core.memory import ORG_TO_CLASS, normalize_org, org_class
from serving_core.planner import add_table_options


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


def _slab_orgs() -> str:
    return ", ".join(org for org, cls in ORG_TO_CLASS.items() if cls.has_slabs)


def allocation_cost(
    geometry: Geometry,
    org: str,
    attention_blocks: int,
    checkpoints: int,
    slabs: int | None = None,
) -> AllocationCost:
    """Cost of xA attention blocks and xR checkpoints; `slabs` only where there are slab
    pages (S2): None packs ideally (the fewest slab pages), an explicit count must be at
    least that minimum."""
    cls = org_class(org)
    _check_state(geometry, attention_blocks, checkpoints)
    if slabs is not None:
        if not cls.has_slabs:
            raise ValueError(f"slabs={slabs}: only org {_slab_orgs()} has slab pages, allowed "
                             "value is None")
        _check_count("slabs", slabs)
    return cls.allocation_cost(geometry, cls.unit_layout(geometry), attention_blocks,
                               checkpoints, slabs)


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
    """Costs of every organization; `slabs` applies to those with slab pages only."""
    return {
        org: allocation_cost(geometry, org, attention_blocks, checkpoints,
                             slabs if cls.has_slabs else None)
        for org, cls in ORG_TO_CLASS.items()
    }


def _check_budget(budget_bytes: int) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive integer")


def _with_split(geometry: Geometry, attention_fraction: float | None) -> Geometry:
    """The geometry with another static pool split (`d0_attention_fraction`), if given."""
    if attention_fraction is None:
        return geometry
    if isinstance(attention_fraction, bool) or not 0 < attention_fraction <= 1:
        raise ValueError(
            f"d0_attention_fraction={attention_fraction}: allowed values are 0 < f <= 1"
        )
    return replace(geometry, d0_attention_fraction=attention_fraction)


def fits(
    geometry: Geometry,
    org: str,
    attention_blocks: int,
    checkpoints: int,
    budget_bytes: int,
    attention_fraction: float | None = None,
) -> bool:
    """True when each pool of the organization alone holds its part of the state set
    within its share of the budget (one shared pool: the cost is at most the budget; D0:
    each static pool against its split, `attention_fraction` overriding the model's)."""
    _check_budget(budget_bytes)
    geometry = _with_split(geometry, attention_fraction)
    cls = org_class(org)
    shares = cls.budget_shares(geometry, budget_bytes)
    need = cls.pool_bytes(allocation_cost(geometry, org, attention_blocks, checkpoints))
    return all(need[pool] <= shares[pool] for pool in need)


def _check_mix(geometry: Geometry, mix: tuple[int, int]) -> None:
    if len(mix) != 2:
        raise ValueError(f"mix={mix!r}: allowed form is (attention_blocks, checkpoints)")
    _check_state(geometry, *mix)
    if mix == (0, 0):
        raise ValueError("mix=(0, 0): at least one of attention_blocks, checkpoints must be > 0")


def capacity(
    geometry: Geometry,
    org: str,
    mix: tuple[int, int],
    budget_bytes: int,
    attention_fraction: float | None = None,
) -> int:
    """How many copies of the mix (aA blocks, aR checkpoints) fit in the budget: the largest
    z with every pool's cost of (z aA, z aR) within its share of the budget.

    D0 splits the budget by `attention_fraction` (default: the geometry's) and so takes
    the tighter pool; a type the mix does not use imposes no limit. Costs never decrease
    with z, so z is found by doubling, then bisection.
    """
    mix = tuple(mix)
    _check_budget(budget_bytes)
    _check_mix(geometry, mix)
    geometry = _with_split(geometry, attention_fraction)
    cls = org_class(org)
    layout = cls.unit_layout(geometry)
    shares = cls.budget_shares(geometry, budget_bytes)

    def fits_copies(z: int) -> bool:
        need = cls.pool_bytes(cls.allocation_cost(geometry, layout, mix[0] * z, mix[1] * z))
        return all(need[pool] <= shares[pool] for pool in need)

    # Every copy costs at least one byte, so `high` passes the budget within log2(M) steps.
    low, high = 0, 1  # invariant: fits(low), and not fits(high) once the doubling stops
    while fits_copies(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits_copies(mid) else (low, mid)
    return low


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
    """Bytes and MiB per organization, plus the slab pages of those that have them."""
    out = {}
    for org, c in costs.items():
        out[org] = {"bytes": c.num_bytes, "mib": c.mib}
        if org_class(org).has_slabs:
            out[org]["slabs"] = c.num_slabs
    return out


def capacities_to_dict(
    geometry: Geometry, mix: tuple[int, int], budget_bytes: int, attention_fraction: float,
    orgs: tuple[str, ...] | None = None,
) -> dict:
    """Capacity per organization plus how each organization that splits the budget split
    it (`<org>_split`); `orgs` (default: every registered one) picks the organizations."""
    orgs = tuple(ORG_TO_CLASS) if orgs is None else orgs
    out: dict = {org: capacity(geometry, org, mix, budget_bytes, attention_fraction)
                 for org in orgs}
    out["budget_bytes"] = budget_bytes
    out["mix"] = list(mix)
    split_geometry = _with_split(geometry, attention_fraction)
    for org in orgs:
        split = org_class(org).split_summary(split_geometry, budget_bytes)
        if split:
            out[f"{org.lower()}_split"] = split
    return out


def _split_line(org: str, s: dict) -> str:
    return (f"{org} split f={s['attention_fraction']}: attention {s['attention_bytes']:,} B, "
            f"recurrent {s['recurrent_bytes']:,} B")


def _orgs_in(data: dict) -> list[str]:
    return [org for org in ORG_TO_CLASS if org in data]


def _format(data: dict) -> str:
    lines = []
    for org in _orgs_in(data):
        value = data[org]
        if isinstance(value, dict):
            extra = f"  slabs {value['slabs']}" if "slabs" in value else ""
            lines.append(f"{org}  {value['bytes']:>14,} B  {value['mib']:>12.6f} MiB{extra}")
        else:
            lines.append(f"{org}  {value:>8,} copies")
    for org in _orgs_in(data):
        if f"{org.lower()}_split" in data:
            lines.append(_split_line(org, data[f"{org.lower()}_split"]))
    return "\n".join(lines)


def _format_side_by_side(data: dict[str, dict]) -> str:
    """One row per organization, one column group per codec (bytes or copies)."""
    codecs = list(data)
    first = data[codecs[0]]
    orgs = _orgs_in(first)
    capacity_mode = not isinstance(first[orgs[0]], dict)
    header = ["org"] + [f"{c} copies" if capacity_mode else f"{c} bytes" for c in codecs]
    if not capacity_mode:
        header += [f"{c} MiB" for c in codecs]
    rows = []
    for org in orgs:
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
        splits = "; ".join(_split_line(org, first[f"{org.lower()}_split"]) for org in orgs
                           if f"{org.lower()}_split" in first)
        lines.append(f"budget {first['budget_bytes']:,} B, mix {first['mix']}"
                     + (f"; {splits}" if splits else ""))
    else:
        slabbed = [org for org in orgs if "slabs" in first[org]]
        for org in slabbed:
            lines.append(f"{org} slabs: " + ", ".join(f"{c} {data[c][org]['slabs']}"
                                                      for c in codecs))
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
    add_table_options(parser, "only this organization")
    return parser


def _run(args: argparse.Namespace) -> dict:
    geometry = load_geometry(args.model)
    if args.state_codec:
        geometry = geometry.with_state_codec(args.state_codec)
    if args.kv_codec == "both":
        return {c: _run_one(args, geometry.with_codec(c)) for c in KV_CODECS}
    return _run_one(args, geometry.with_codec(args.kv_codec or geometry.kv_codec))


def _chosen_orgs(names: list[str] | None) -> tuple[str, ...]:
    chosen = {normalize_org(n) for n in names} if names else set(ORG_TO_CLASS)
    return tuple(org for org in ORG_TO_CLASS if org in chosen)


def _run_one(args: argparse.Namespace, geometry: Geometry) -> dict:
    orgs = _chosen_orgs(args.org)
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
                                  frac, orgs)
    if args.d0_attention_fraction is not None:
        raise ValueError("d0_attention_fraction: only capacity mode takes a D0 split")
    if args.attention_blocks is None or args.checkpoints is None:
        raise ValueError("cost mode needs both --attention-blocks and --checkpoints")
    costs = all_costs(geometry, args.attention_blocks, args.checkpoints, args.slabs)
    return costs_to_dict({org: costs[org] for org in orgs})


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
