"""Budget planner: one nominal byte budget, converted to each organization's units.

A label `bN` means N uniform hybrid pages (N x layout.uniform_page_bytes); a
label `pN` (or "N pages") means exactly N paged-attention-block pages (S1/S2's), and
every organization gets the same nominal bytes; a label `NMiB` names N MiB of state memory for
the whole model (every layer), the form that compares models: the planner works in one storage
group of the layer pattern (serving_core/layer_pattern.py), so its nominal bytes are
N x 2^20 / Geometry.scope_layers, floored. bN and pN are sized in the model's reference KV
representation (bf16, geometry.REFERENCE_KV_CODEC), so a label names the same bytes under
every codec: with kv_codec=tq4, b63 is still 63 bf16 uniform pages of bytes, and each
organization fits its (smaller) attention units into them; likewise under a state codec
(model.state_codec, serving_core/state_codec.py) b63 is 63 pages of the model's own state
bytes, into which each organization fits its smaller (or larger) composites. Each
organization's class (serving_core/memory/) converts the bytes with its own rounding
(`plan_pools`), so arms are planner-matched, not byte-equal; the plan reports the
difference to nominal for that reason. This module loops over the registry and names no
organization.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real

from serving_core.geometry import (
    KV_CODECS,
    REFERENCE_KV_CODEC,
    Geometry,
    available_models,
    load_geometry,
)
from serving_core.layout import PoolPlan, exact_fraction, paged_page_bytes, uniform_page_bytes
from serving_core.memory import ORG_TO_CLASS, normalize_org
from serving_core.state_codec import DEFAULT_STATE_CODEC, STATE_CODECS

BUDGET_FORMS = ("bN (N uniform hybrid pages), pN or 'N pages' (N S1/S2 pages), NMiB (N MiB for "
                "the whole model), N a positive integer")
_MAX_SEARCH_COUNT = 1 << 40
_BUDGET_PATTERNS = (
    ("b", re.compile(r"b(\d+)")),
    ("p", re.compile(r"p(\d+)")),
    ("p", re.compile(r"(\d+)\s*pages?")),
    ("m", re.compile(r"(\d+)\s*mib")),
)


@dataclass(frozen=True, slots=True)
class Budget:
    """A parsed budget label: `kind` is "b" (uniform pages), "p" (S1/S2 pages) or "m" (MiB
    for the whole model)."""

    kind: str
    count: int

    @property
    def label(self) -> str:
        return f"{self.count}MiB" if self.kind == "m" else f"{self.kind}{self.count}"


def parse_budget(label: str) -> Budget:
    """Parse "b63", "p254", "254 pages" or "4096MiB" (case-insensitive)."""
    text = str(label).strip().lower()
    for kind, pattern in _BUDGET_PATTERNS:
        match = pattern.fullmatch(text)
        if match and int(match.group(1)) > 0:
            return Budget(kind, int(match.group(1)))
    raise ValueError(f"budget={label!r}: accepted forms are {BUDGET_FORMS}")


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    """Units per organization and pool for one nominal budget.

    Invariant: every registered organization (memory.ORG_TO_CLASS) has its pools in `pools`,
    each able to hold at least one complete recurrent checkpoint.
    """

    model: str
    label: str
    nominal_bytes: int
    pools: tuple[PoolPlan, ...]
    kv_codec: str = REFERENCE_KV_CODEC
    scope_layers: int = 1  # copies of the storage group the model holds
    kv_bytes_per_token: int = 0  # whole model, every attention layer
    recurrent_bytes_per_checkpoint: int = 0  # whole model, every recurrent layer
    # Organizations that cannot hold the model's layer pattern: {org: the one-line reason}.
    refused: tuple[tuple[str, str], ...] = ()
    state_codec: str = DEFAULT_STATE_CODEC  # how the SSM state is stored (model.state_codec)

    @property
    def model_nominal_bytes(self) -> int:
        """The nominal bytes for the whole model (every layer)."""
        return self.nominal_bytes * self.scope_layers

    def pools_of(self, org: str) -> tuple[PoolPlan, ...]:
        """The organization's pools; one that cannot hold the model is refused here."""
        org = normalize_org(org)
        reason = dict(self.refused).get(org)
        if reason is not None:
            raise ValueError(reason)
        return tuple(p for p in self.pools if p.org == org)

    def org_bytes(self, org: str) -> int:
        return sum(p.num_bytes for p in self.pools_of(org))

    def diff_bytes(self, org: str) -> int:
        """Organization bytes minus nominal bytes (negative: the org got less)."""
        return self.org_bytes(org) - self.nominal_bytes


def units_for(plan: BudgetPlan, org: str) -> dict[str, int]:
    """{pool: units} of one organization: {"shared": pages} for one shared pool,
    {"attention": n, "recurrent": m} for D0's two."""
    return {p.pool: p.num_units for p in plan.pools_of(org)}


def headroom_units(total_units: int, f: float) -> int:
    """Admission headroom H = floor(f x total_units), f in [0, 1)."""
    if isinstance(total_units, bool) or not isinstance(total_units, int) or total_units < 0:
        raise ValueError(f"total_units={total_units!r} must be an integer >= 0")
    if isinstance(f, bool) or not isinstance(f, Real) or not 0 <= f < 1:
        raise ValueError(f"headroom fraction f={f!r}: allowed values are 0 <= f < 1")
    return math.floor(exact_fraction(f) * total_units)


def nominal_bytes(geometry: Geometry, budget: str | Budget) -> int:
    """Bytes a label names: counted in the reference representation's units (bf16 KV, the
    SSM state at the model's dtype, state_codec auto), so a label names the same bytes
    under every KV and state codec."""
    parsed = budget if isinstance(budget, Budget) else parse_budget(budget)
    reference = geometry.with_codec(REFERENCE_KV_CODEC).with_state_codec(DEFAULT_STATE_CODEC)
    if parsed.kind == "m":
        return parsed.count * 2**20 // geometry.scope_layers
    if parsed.kind == "b":
        return parsed.count * uniform_page_bytes(reference)
    return parsed.count * paged_page_bytes(reference)


def refusals(geometry: Geometry) -> tuple[tuple[str, str], ...]:
    """(org, reason) of every organization whose layout cannot hold the model's pattern."""
    out = []
    for org, cls in ORG_TO_CLASS.items():
        try:
            cls.unit_layout(geometry)
        except ValueError as exc:
            out.append((org, str(exc)))
    return tuple(out)


def _build_pools(geometry: Geometry, budget: Budget) -> tuple[int, tuple[PoolPlan, ...]]:
    nominal = nominal_bytes(geometry, budget)
    refused = dict(refusals(geometry))
    pools: list[PoolPlan] = []
    for org, cls in ORG_TO_CLASS.items():
        if org not in refused:
            pools.extend(cls.plan_pools(geometry, cls.unit_layout(geometry), nominal))
    return nominal, tuple(pools)


def _shortfalls(geometry: Geometry, pools: tuple[PoolPlan, ...]) -> list[str]:
    refused = dict(refusals(geometry))
    need = {org: cls.min_units(cls.unit_layout(geometry)) for org, cls in ORG_TO_CLASS.items()
            if org not in refused}
    return [f"{p.org} {p.pool} gets {p.num_units} units, needs {need[p.org][p.pool]}"
            for p in pools if p.num_units < need[p.org][p.pool]]


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
    return _plan_budget(geometry, parsed, tuple(ORG_TO_CLASS.items()))


@functools.lru_cache(maxsize=1024)
def _plan_budget(geometry: Geometry, parsed: Budget, registry: tuple) -> BudgetPlan:
    """plan_budget, remembered: the geometry, the budget and the plan are immutable, and
    `registry` (the organizations registered now) is part of the key only (a campaign
    plans the same few budgets thousands of times)."""
    del registry  # the organizations _build_pools and refusals read: the key's part
    nominal, pools = _build_pools(geometry, parsed)
    refused = refusals(geometry)
    if len(refused) == len(ORG_TO_CLASS):
        raise ValueError(f"model {geometry.name!r}: no organization holds it "
                         f"({'; '.join(reason for _, reason in refused)})")
    short = _shortfalls(geometry, pools)
    if short:
        minimum = _smallest_feasible(geometry, parsed.kind)
        bound = f"the minimum is {minimum.label}" if minimum else "no budget is large enough"
        raise ValueError(
            f"budget={parsed.label!r} cannot hold one checkpoint for {geometry.name} "
            f"({'; '.join(short)}); {bound}"
        )
    return BudgetPlan(geometry.name, parsed.label, nominal, pools, geometry.kv_codec,
                      geometry.scope_layers, geometry.kv_bytes_per_token,
                      geometry.recurrent_bytes_per_checkpoint, refused, geometry.state_codec)


def _orgs(orgs: Sequence[str] | None) -> tuple[str, ...]:
    """The organizations a table shows: `orgs` (checked, registry order kept) or all."""
    if orgs is None:
        return tuple(ORG_TO_CLASS)
    chosen = {normalize_org(o) for o in orgs}
    return tuple(o for o in ORG_TO_CLASS if o in chosen)


def plan_to_dict(plan: BudgetPlan, orgs: Sequence[str] | None = None) -> dict:
    """The JSON shape of a plan: per-org units, unit bytes and bytes (one pool: its entry;
    more: one entry per pool and the organization's total bytes), all in one storage group;
    the whole model's KV bytes per token, recurrent bytes per checkpoint and nominal bytes
    (the group's x scope_layers)."""
    out: dict[str, dict] = {}
    refused = dict(plan.refused)
    for org in _orgs(orgs):
        if org in refused:
            out[org] = {"refused": refused[org]}
            continue
        entries = {
            p.pool: {"units": p.num_units, "unit_bytes": p.unit_bytes, "bytes": p.num_bytes}
            | ({"reserved_units": p.num_reserved} if p.num_reserved else {})
            for p in plan.pools_of(org)
        }
        if len(entries) > 1:
            out[org] = {**entries, "bytes": plan.org_bytes(org)}
        else:
            (out[org],) = entries.values()
    return {
        "model": plan.model,
        "kv_codec": plan.kv_codec,
        "state_codec": plan.state_codec,
        "budget": plan.label,
        "nominal_bytes": plan.nominal_bytes,
        "scope_layers": plan.scope_layers,
        "model_nominal_bytes": plan.model_nominal_bytes,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "recurrent_bytes_per_checkpoint": plan.recurrent_bytes_per_checkpoint,
        "orgs": out,
    }


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.3f}"


def format_plan(plan: BudgetPlan, orgs: Sequence[str] | None = None) -> str:
    """Aligned human table; the diff column is per organization (on its total row where it
    has more than one pool)."""
    header = ("org", "pool", "units", "unit bytes", "bytes", "MiB", "diff to nominal")
    rows = []
    refused = dict(plan.refused)
    for org in _orgs(orgs):
        if org in refused:
            rows.append((org, "refused", "", "", "", "", ""))
            continue
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
    title = (f"model {plan.model}  kv {plan.kv_codec}  state {plan.state_codec}  budget "
             f"{plan.label}  nominal {plan.nominal_bytes:,} B ({_mib(plan.nominal_bytes)} MiB)")
    if plan.scope_layers > 1 and plan.kv_bytes_per_token:
        title += (f" per storage group x {plan.scope_layers}; whole model: KV "
                  f"{plan.kv_bytes_per_token:,} B/token, recurrent "
                  f"{plan.recurrent_bytes_per_checkpoint:,} B/checkpoint")
    return _render(title, header, rows)


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


def format_side_by_side(plans: dict[str, BudgetPlan], orgs: Sequence[str] | None = None) -> str:
    """One row per organization and pool, one units / unit-bytes / diff group per codec.

    The plans share a model and a budget label (and so the nominal bytes)."""
    first = next(iter(plans.values()))
    codecs = list(plans)
    header = ["org", "pool"]
    for codec in codecs:
        header += [f"{codec} units", f"{codec} unit bytes", f"{codec} diff"]
    rows = []
    for org in _orgs(orgs):
        if any(org in dict(plan.refused) for plan in plans.values()):
            rows.append((org, "refused", *([""] * (len(header) - 2))))
            continue
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


def add_table_options(parser: argparse.ArgumentParser, org_help: str) -> None:
    """--org (repeatable), --kv-codec and --json: the options the planner's and the
    storage tables' command lines share."""
    parser.add_argument("--org", action="append", help=f"{org_help} "
                        f"(repeatable; one of {', '.join(ORG_TO_CLASS)})")
    parser.add_argument(
        "--kv-codec", choices=(*KV_CODECS, "both"),
        help="attention KV representation (default: the preset's); both: side by side",
    )
    parser.add_argument("--state-codec", choices=STATE_CODECS,
                        help="SSM state storage (model.state_codec; default: the preset's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serving_core.planner",
        description="Convert a budget label to whole units per memory organization.",
    )
    parser.add_argument("--model", required=True, help=f"one of {available_models()}")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--budget", help=BUDGET_FORMS)
    group.add_argument("--pages", help="N S1/S2 pages (same as --budget pN)")
    add_table_options(parser, "show only this organization")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        geometry = load_geometry(args.model)
        if args.state_codec:
            geometry = geometry.with_state_codec(args.state_codec)
        label = args.budget if args.budget is not None else f"{args.pages} pages"
        codecs = KV_CODECS if args.kv_codec == "both" else (args.kv_codec or geometry.kv_codec,)
        orgs = _orgs(args.org)
        plans = {c: plan_budget(geometry.with_codec(c), label) for c in codecs}
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if len(plans) > 1:
        print(json.dumps({c: plan_to_dict(p, orgs) for c, p in plans.items()}) if args.json
              else format_side_by_side(plans, orgs))
    else:
        plan = next(iter(plans.values()))
        print(json.dumps(plan_to_dict(plan, orgs)) if args.json else format_plan(plan, orgs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
