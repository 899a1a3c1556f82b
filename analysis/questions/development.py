"""Q6 admission development: which f this system selects.

Design: docs/paper_design.md sections 5.8, 3.4; AMBIGUOUS A5.

The development campaign (conf/campaign/q6_development.yaml) reruns the paper's selection
stage: an initial three-budget search and a b83 extension for S2. `select` applies the
plan's rule (`selection` in conf/prereg/q6_development.yaml) to run means; `selection_table`
puts each selection next to the paper's preselected f (conf/prereg/q6.yaml). A Q6 plan with
`preselected: development` tests these selections in Q6-17 (`derive_plan`); the default,
`preselected: paper`, tests the paper's values. Development data are never confirmation data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import pandas as pd

from analysis.inference import prereg
from analysis.pages.common import load_runs

PLAN = "q6_development"
PRESELECTED_SOURCES = ("paper", "development")
PICKS = ("smallest", "largest")


def f_key(f: float) -> float:
    return round(float(f), 6)


def curve(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per f: arithmetic mean of the metric over runs and the number of seeds."""
    if runs.empty:
        return pd.DataFrame(columns=["f", "mean", "n"])
    keyed = runs.assign(f=runs["f"].map(f_key))
    return (keyed.groupby("f")
            .agg(mean=(metric, "mean"), n=("seed", "nunique")).reset_index())


def pick(means: pd.DataFrame, within_pct: float, rule: str = "smallest") -> dict:
    """The candidates within `within_pct` % of the highest mean and the chosen f among them
    (`smallest` or `largest` f), with the highest-mean f (the alternative reading)."""
    if rule not in PICKS:
        raise ValueError(f"selection.pick={rule!r}: allowed values are {PICKS}")
    if means.empty:
        return {"selected_f": math.nan, "best_f": math.nan, "candidates": ""}
    best = means.loc[means["mean"].idxmax()]
    floor = float(best["mean"]) * (1 - within_pct / 100)
    candidates = sorted(float(f) for f in means.loc[means["mean"] >= floor, "f"])
    chosen = candidates[0] if rule == "smallest" else candidates[-1]
    return {"selected_f": chosen, "best_f": float(best["f"]),
            "best_mean": float(best["mean"]),
            "selected_mean": float(means.loc[means["f"] == chosen, "mean"].iloc[0]),
            "candidates": ", ".join(f"{f:g}" for f in candidates)}


def select(plan: prereg.Plan, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per organization and budget of the initial search: the selected f, where it
    came from, the highest-mean f, and (for an extension) the f = 0 baseline agreement.

    `runs`: adopted main-stage development runs with the design columns (org, budget, f,
    seed) and the selection metric. A cell without runs leaves its selection NaN.
    """
    spec = plan.raw["selection"]
    metric, within = spec.get("metric", "throughput_span"), float(spec["within_pct"])
    rule, tolerance = spec.get("pick", "smallest"), float(spec["merge_tolerance_pct"])
    searched, missing = {}, set()
    for fam in plan.families:
        searched[fam.name], absent = _family_runs(plan, fam.name, runs)
        missing |= {(fam.name, str(m.keys["org"]), str(m.keys["budget"])) for m in absent}
    initial = searched[spec["search"]]
    extensions = {(e["org"], e["budget"]): e["family"] for e in spec.get("extensions", [])}
    rows = []
    for org, budget in _org_budgets(plan.family(spec["search"])):
        base = initial[(initial["org"] == org) & (initial["budget"] == budget)]
        means, source, note = curve(base, metric), spec["search"], ""
        needed = [spec["search"]]
        family = extensions.get((org, budget))
        if family is not None:
            needed.append(family)
            ext = searched[family]
            ext = ext[(ext["org"] == org) & (ext["budget"] == budget)]
            ext_means = curve(ext, metric)
            agree = _baseline_gap_pct(means, ext_means)
            if math.isnan(agree):
                note = f"{family}: no f = 0 baseline in both searches"
                means, source = ext_means, family
            elif abs(agree) <= tolerance:
                means = curve(pd.concat([base, ext]), metric)
                source = f"{spec['search']} + {family} (merged)"
                note = f"f = 0 baselines differ by {agree:+.2f} % (within {tolerance:g} %): merged"
            else:
                means, source = ext_means, family
                note = (f"f = 0 baselines differ by {agree:+.2f} % (beyond {tolerance:g} %): "
                        "not merged")
        complete = not means.empty and not any((n, org, budget) in missing for n in needed)
        row = {"org": org, "budget": budget, "source": source,
               "n_seeds": int(means["n"].min()) if len(means) else 0,
               **pick(means, within, rule), "note": note}
        if not complete:
            row.update(selected_f=math.nan, note=(note + "; " if note else "")
                       + "search incomplete: `make campaign C=q6_development`")
        rows.append(row)
    return pd.DataFrame(rows)


def selection_table(selected: pd.DataFrame, paper: Mapping) -> pd.DataFrame:
    """The selections next to the paper's preselected f ({budget: {org: f}})."""
    if selected.empty:
        return selected
    table = selected.copy()
    table.insert(2, "paper_f", [float(paper.get(b, {}).get(o, math.nan))
                                for o, b in zip(table["org"], table["budget"], strict=True)])
    table.insert(3, "selected_f", table.pop("selected_f"))
    table["same_as_paper"] = [
        bool(math.isclose(p, s)) if not (math.isnan(p) or math.isnan(s)) else ""
        for p, s in zip(table["paper_f"], table["selected_f"], strict=True)]
    return table


def as_preselected(selected: pd.DataFrame) -> dict[str, dict[str, float]] | None:
    """{budget: {org: f}} from a complete selection, None when any selection is missing."""
    if selected.empty or selected["selected_f"].isna().any():
        return None
    out: dict[str, dict[str, float]] = {}
    for row in selected.itertuples(index=False):
        out.setdefault(row.budget, {})[row.org] = float(row.selected_f)
    return out


def development_runs(con) -> pd.DataFrame:
    """Adopted main-stage runs of the development campaign (empty when none)."""
    runs = load_runs(con, (PLAN,)).runs
    return runs[runs["stage"] == "main"] if len(runs) else runs


def _family_runs(plan: prereg.Plan, name: str, runs: pd.DataFrame):
    """Runs of one family's cells at its planned seeds (never another search's seeds), and
    the family's missing runs."""
    fam = plan.family(name)
    if runs.empty:
        return (runs.assign(cell_id=pd.Series(dtype=object)),
                tuple(prereg.MissingRuns(c.id, dict(c.keys), c.seeds) for c in fam.cells))
    check = prereg.check_family(plan, name, runs, allow_changed_plan=True)
    return check.runs, check.missing


def _org_budgets(family: prereg.Family) -> list[tuple[str, str]]:
    return list(dict.fromkeys((str(c.keys["org"]), str(c.keys["budget"])) for c in family.cells))


def _baseline_gap_pct(a: pd.DataFrame, b: pd.DataFrame) -> float:
    """100 (b(f = 0) / a(f = 0) - 1), NaN when either curve lacks f = 0."""
    at_a, at_b = a[a["f"] == 0.0]["mean"], b[b["f"] == 0.0]["mean"]
    if at_a.empty or at_b.empty:
        return math.nan
    return 100 * (float(at_b.iloc[0]) / float(at_a.iloc[0]) - 1)


# ---------------------------------------------------------------------------
# Q6-17 with other preselected values
# ---------------------------------------------------------------------------


def cell_id(org: str, budget: str, f: float) -> str:
    """Q6 cell ids: D0_b83_f10, S2_b63_f27, S2_b83_f43."""
    return f"{org}_{budget}_f{round(100 * float(f))}"


def derive_plan(plan: prereg.Plan, preselected: Mapping) -> prereg.Plan:
    """The Q6 plan whose Q6-17 tests PT, ID, IS and the PT cross-budget contrast use
    `preselected` ({budget: {org: f}}) instead of the YAML's. Cells for an f outside the
    confirmation grid are added (their runs are missing until collected). The plan hash
    stays the YAML's: its runs were stamped with it, and `preselected: development` in it
    declares the rule."""
    fam = plan.primary_family
    cells = {c.id: c for c in fam.cells}
    template = {org: next(c for c in fam.cells if c.keys["org"] == org) for org in ("D0", "S2")}

    def cell(org: str, budget: str, f: float) -> str:
        name = cell_id(org, budget, f)
        if name not in cells:
            keys = {**template[org].keys, "budget": budget, "f": float(f)}
            cells[name] = dataclasses.replace(template[org], id=name, keys=keys)
        return name

    tests = []
    for test in fam.tests:
        tests.append(_retarget(test, preselected, cell))
    new_fam = dataclasses.replace(fam, cells=tuple(cells.values()), tests=tuple(tests))
    families = tuple(new_fam if f.name == fam.name else f for f in plan.families)
    raw = {**plan.raw, "preselected_f": {b: dict(v) for b, v in preselected.items()}}
    return dataclasses.replace(plan, families=families, raw=raw)


def _retarget(test: prereg.PlannedTest, chosen: Mapping, cell) -> prereg.PlannedTest:
    """A Q6-17 test with the preselected cells moved to `chosen` (by legacy label)."""
    kind = test.id.split("_")[0]
    if kind not in ("PT", "ID", "IS"):
        return test

    def paired(budget: str) -> dict[str, str]:
        d0, s2 = float(chosen[budget]["D0"]), float(chosen[budget]["S2"])
        if kind == "PT":
            return {"treatment": cell("D0", budget, d0), "control": cell("S2", budget, s2)}
        org, f = ("D0", d0) if kind == "ID" else ("S2", s2)
        return {"treatment": cell(org, budget, f), "control": cell(org, budget, 0.0)}

    if test.kind == "paired":
        cells = paired(test.id.split("_")[1])
        label = test.label.removesuffix(" self-comparison")
        if cells["treatment"] == cells["control"]:
            label += " self-comparison"
        return dataclasses.replace(test, cells=cells, label=label)
    a, b = paired("b108"), paired("b63")  # the b108 minus b63 cross-budget contrast
    return dataclasses.replace(test, cells={"a.treatment": a["treatment"],
                                            "a.control": a["control"],
                                            "b.treatment": b["treatment"],
                                            "b.control": b["control"]})
