"""Budget planner: one nominal byte budget, converted to each organization's units.

A label `bN` means N uniform hybrid pages (N x layout.uniform_page_bytes); a
label `pN` (or "N pages") means exactly N S1/S2 pages, and the other
organizations get the same nominal bytes. Both are sized in the model's reference KV
representation (bf16, geometry.REFERENCE_KV_CODEC), so a label names the same bytes under
every codec: with kv_codec=tq4, b63 is still 63 bf16 uniform pages of bytes, and each
organization fits its (smaller) attention units into them. Each organization keeps its own
rounding, so arms are planner-matched, not byte-equal; the plan reports the
difference to nominal for that reason. N0 rounds as vLLM sizes its block pool:
floor(nominal / page) pages, one of which is vLLM's reserved null block.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

from serving_core.geometry import (
    KV_CODECS,
    REFERENCE_KV_CODEC,
    Geometry,
    available_models,
    load_geometry,
)
from serving_core.layout import ORGS, normalize_org, org_layout, uniform_page_bytes

BUDGET_FORMS = "bN (N uniform hybrid pages), pN or 'N pages' (N S1/S2 pages), N a positive integer"
_MAX_SEARCH_COUNT = 1 << 40
_BUDGET_PATTERNS = (
    ("b", re.compile(r"b(\d+)")),
    ("p", re.compile(r"p(\d+)")),
    ("p", re.compile(r"(\d+)\s*pages?")),
)


def exact_fraction(value: float) -> Fraction:
    """The decimal a float was written as (0.527383, not its binary neighbour).

    Floors of fraction x count must not flip on binary representation error.
    """
    return Fraction(repr(float(value)))


@dataclass(frozen=True, slots=True)
class Budget:
    """A parsed budget label: `kind` is "b" (uniform pages) or "p" (S1/S2 pages)."""

    kind: str
    count: int

    @property
    def label(self) -> str:
        return f"{self.kind}{self.count}"


def parse_budget(label: str) -> Budget:
    """Parse "b63", "p254" or "254 pages" (case-insensitive)."""
    text = str(label).strip().lower()
    for kind, pattern in _BUDGET_PATTERNS:
        match = pattern.fullmatch(text)
        if match and int(match.group(1)) > 0:
            return Budget(kind, int(match.group(1)))
    raise ValueError(f"budget={label!r}: accepted forms are {BUDGET_FORMS}")


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """Whole units of one pool: `num_units` usable units of `unit_bytes` each, plus
    `num_reserved` units the pool allocates but never hands out (N0's null block)."""

    org: str
    pool: str  # "shared" for S0/S1/S2/N0; "attention" or "recurrent" for D0
    num_units: int
    unit_bytes: int
    num_reserved: int = 0

    @property
    def num_bytes(self) -> int:
        return (self.num_units + self.num_reserved) * self.unit_bytes


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    """Units per organization and pool for one nominal budget.

    Invariant: every organization in `layout.ORGS` has its pools in `pools`,
    each able to hold at least one complete recurrent checkpoint.
    """

    model: str
    label: str
    nominal_bytes: int
    pools: tuple[PoolPlan, ...]
    kv_codec: str = REFERENCE_KV_CODEC

    def pools_of(self, org: str) -> tuple[PoolPlan, ...]:
        org = normalize_org(org)
        return tuple(p for p in self.pools if p.org == org)

    def org_bytes(self, org: str) -> int:
        return sum(p.num_bytes for p in self.pools_of(org))

    def diff_bytes(self, org: str) -> int:
        """Organization bytes minus nominal bytes (negative: the org got less)."""
        return self.org_bytes(org) - self.nominal_bytes


def units_for(plan: BudgetPlan, org: str) -> dict[str, int]:
    """{"shared": pages} for S0/S1/S2/N0, {"attention": n, "recurrent": m} for D0."""
    return {p.pool: p.num_units for p in plan.pools_of(org)}


def headroom_units(total_units: int, f: float) -> int:
    """Admission headroom H = floor(f x total_units), f in [0, 1)."""
    if isinstance(total_units, bool) or not isinstance(total_units, int) or total_units < 0:
        raise ValueError(f"total_units={total_units!r} must be an integer >= 0")
    if isinstance(f, bool) or not isinstance(f, Real) or not 0 <= f < 1:
        raise ValueError(f"headroom fraction f={f!r}: allowed values are 0 <= f < 1")
    return math.floor(exact_fraction(f) * total_units)


def _round_half_up(numerator: int, denominator: int) -> int:
    """Nearest integer, halves up, in exact integer arithmetic."""
    return (2 * numerator + denominator) // (2 * denominator)


def nominal_bytes(geometry: Geometry, budget: str | Budget) -> int:
    """Bytes a label names: counted in the reference (bf16) representation's units."""
    parsed = budget if isinstance(budget, Budget) else parse_budget(budget)
    reference = geometry.with_codec(REFERENCE_KV_CODEC)
    if parsed.kind == "b":
        return parsed.count * uniform_page_bytes(reference)
    return parsed.count * org_layout(reference, "S1").page_bytes


def _shared_pool(geometry: Geometry, org: str, nominal: int) -> PoolPlan:
    """Pages = round(nominal / page); a pN nominal is N whole S1/S2 pages, so they get N."""
    page = org_layout(geometry, org).page_bytes
    return PoolPlan(org, "shared", _round_half_up(nominal, page), page)


def _d0_pools(geometry: Geometry, nominal: int) -> tuple[PoolPlan, PoolPlan]:
    layout = org_layout(geometry, "D0")
    frac = exact_fraction(geometry.d0_attention_fraction)
    attention = math.floor(frac * nominal / layout.page_bytes)
    composite = layout.recurrent_unit_bytes
    recurrent = math.floor((1 - frac) * nominal / composite) if composite else 0
    return (
        PoolPlan("D0", "attention", attention, layout.page_bytes),
        PoolPlan("D0", "recurrent", recurrent, composite),
    )


def _n0_pool(geometry: Geometry, nominal: int) -> PoolPlan:
    """vLLM's block count for the same per-layer bytes, less its null block.

    vLLM 0.32, v1/core/kv_cache_utils.py `get_kv_cache_config_from_groups`:
    `num_blocks = available_memory // bytes_per_block`, bytes_per_block being the page
    times the layers of a group (the attention and Mamba groups alias the same
    tensors), so per layer it is floor(nominal / page); v1/core/block_pool.py then
    takes `self.null_block = self.free_block_queue.popleft()`, which no request gets.
    """
    page = org_layout(geometry, "N0").page_bytes
    total = nominal // page
    return PoolPlan("N0", "shared", max(total - 1, 0), page, min(total, 1))


def _min_units(geometry: Geometry, org: str, pool: str) -> int:
    """Fewest units of a pool that hold one checkpoint (one block without recurrent state)."""
    layout = org_layout(geometry, org)
    if not geometry.has_recurrent:
        return 1 if pool in ("shared", "attention") else 0
    if org == "S2":
        return layout.ssm_members + 1  # members plus one slab page for the conv slot
    if org == "D0":
        return 1
    return layout.pages_per_composite


def _build_pools(geometry: Geometry, budget: Budget) -> tuple[int, tuple[PoolPlan, ...]]:
    nominal = nominal_bytes(geometry, budget)
    pools = [_shared_pool(geometry, org, nominal) for org in ORGS if org not in ("D0", "N0")]
    pools.extend(_d0_pools(geometry, nominal))
    pools.append(_n0_pool(geometry, nominal))
    return nominal, tuple(pools)


def _shortfalls(geometry: Geometry, pools: tuple[PoolPlan, ...]) -> list[str]:
    short = []
    for p in pools:
        need = _min_units(geometry, p.org, p.pool)
        if p.num_units < need:
            short.append(f"{p.org} {p.pool} gets {p.num_units} units, needs {need}")
    return short


def _feasible(geometry: Geometry, budget: Budget) -> bool:
    return not _shortfalls(geometry, _build_pools(geometry, budget)[1])


def _smallest_feasible(geometry: Geometry, kind: str) -> Budget | None:
    """Smallest feasible count of a kind, or None if no budget is feasible.

    Unit counts never decrease with the count, so feasibility is monotone:
    double to find a feasible count, then bisect.
    """
    high = 1
    while not _feasible(geometry, Budget(kind, high)):
        high *= 2
        if high > _MAX_SEARCH_COUNT:
            return None
    low = high // 2  # infeasible (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if _feasible(geometry, Budget(kind, mid)) else (mid, high)
    return Budget(kind, high)


def plan_budget(geometry: Geometry, budget: str | Budget) -> BudgetPlan:
    """Convert a budget label to whole units per organization and pool."""
    parsed = budget if isinstance(budget, Budget) else parse_budget(budget)
    nominal, pools = _build_pools(geometry, parsed)
    short = _shortfalls(geometry, pools)
    if short:
        minimum = _smallest_feasible(geometry, parsed.kind)
        bound = f"the minimum is {minimum.label}" if minimum else "no budget is large enough"
        raise ValueError(
            f"budget={parsed.label!r} cannot hold one checkpoint for {geometry.name} "
            f"({'; '.join(short)}); {bound}"
        )
    return BudgetPlan(geometry.name, parsed.label, nominal, pools, geometry.kv_codec)


def plan_to_dict(plan: BudgetPlan) -> dict:
    """The JSON shape of a plan: per-org units, unit bytes and bytes; D0 per pool."""
    orgs: dict[str, dict] = {}
    for org in ORGS:
        entries = {
            p.pool: {"units": p.num_units, "unit_bytes": p.unit_bytes, "bytes": p.num_bytes}
            | ({"reserved_units": p.num_reserved} if p.num_reserved else {})
            for p in plan.pools_of(org)
        }
        if org == "D0":
            orgs[org] = {**entries, "bytes": plan.org_bytes(org)}
        else:
            orgs[org] = entries["shared"]
    return {
        "model": plan.model,
        "kv_codec": plan.kv_codec,
        "budget": plan.label,
        "nominal_bytes": plan.nominal_bytes,
        "orgs": orgs,
    }


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.3f}"


def format_plan(plan: BudgetPlan) -> str:
    """Aligned human table; the diff column is per organization (D0 on its total row)."""
    header = ("org", "pool", "units", "unit bytes", "bytes", "MiB", "diff to nominal")
    rows = []
    for org in ORGS:
        pools = plan.pools_of(org)
        for p in pools:
            diff = f"{plan.diff_bytes(org):+,}" if len(pools) == 1 else ""
            rows.append(
                (org, p.pool, _units(p), f"{p.unit_bytes:,}", f"{p.num_bytes:,}",
                 _mib(p.num_bytes), diff)
            )
        if len(pools) > 1:
            total = plan.org_bytes(org)
            rows.append((org, "total", "", "", f"{total:,}", _mib(total),
                         f"{plan.diff_bytes(org):+,}"))
    return _render(f"model {plan.model}  kv {plan.kv_codec}  budget {plan.label}  nominal "
                   f"{plan.nominal_bytes:,} B ({_mib(plan.nominal_bytes)} MiB)", header, rows)


def _units(p: PoolPlan) -> str:
    return f"{p.num_units:,}" + (f"+{p.num_reserved} null" if p.num_reserved else "")


def _render(title: str, header, rows) -> str:
    """A title line over a table: the first two columns left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [title]
    for row in (header, *rows):
        pairs = enumerate(zip(row, widths, strict=True))
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_side_by_side(plans: dict[str, BudgetPlan]) -> str:
    """One row per organization and pool, one units / unit-bytes / diff group per codec.

    The plans share a model and a budget label (and so the nominal bytes)."""
    first = next(iter(plans.values()))
    codecs = list(plans)
    header = ["org", "pool"]
    for codec in codecs:
        header += [f"{codec} units", f"{codec} unit bytes", f"{codec} diff"]
    rows = []
    for org in ORGS:
        pools = {codec: plan.pools_of(org) for codec, plan in plans.items()}
        for i, pool in enumerate(pools[codecs[0]]):
            row = [org, pool.pool]
            for codec in codecs:
                p = pools[codec][i]
                row += [_units(p), f"{p.unit_bytes:,}", f"{plans[codec].diff_bytes(org):+,}"
                        if len(pools[codec]) == 1 else ""]
            rows.append(tuple(row))
        if len(pools[codecs[0]]) > 1:
            row = [org, "total"]
            for codec in codecs:
                row += ["", "", f"{plans[codec].diff_bytes(org):+,}"]
            rows.append(tuple(row))
    return _render(f"model {first.model}  budget {first.label}  nominal "
                   f"{first.nominal_bytes:,} B ({_mib(first.nominal_bytes)} MiB), the same "
                   f"bytes under {' and '.join(codecs)}", header, rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving_core.planner",
        description="Convert a budget label to whole units per memory organization.",
    )
    parser.add_argument("--model", required=True, help=f"one of {available_models()}")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--budget", help=BUDGET_FORMS)
    group.add_argument("--pages", help="N S1/S2 pages (same as --budget pN)")
    parser.add_argument(
        "--kv-codec", choices=(*KV_CODECS, "both"),
        help="attention KV representation (default: the preset's); both: side by side",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        geometry = load_geometry(args.model)
        label = args.budget if args.budget is not None else f"{args.pages} pages"
        codecs = KV_CODECS if args.kv_codec == "both" else (args.kv_codec or geometry.kv_codec,)
        plans = {c: plan_budget(geometry.with_codec(c), label) for c in codecs}
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if len(plans) > 1:
        print(json.dumps({c: plan_to_dict(p) for c, p in plans.items()}) if args.json
              else format_side_by_side(plans))
    else:
        plan = next(iter(plans.values()))
        print(json.dumps(plan_to_dict(plan)) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
