"""Evaluate a question's preregistered families (conf/prereg/<q>.yaml) on ledger runs.

A family is first checked against the plan (`prereg.check_family`): missing
cells or seeds, duplicated adopted runs or a changed plan hash refuse it, and
the reasons are kept word for word. An accepted family gets its declared
decision: exact sign-flip p with Holm adjustment over the family's tests
(`sign_flip_holm`), a paired-t interval decision (`paired_t_interval`), the
probe containment check (`containment`), or effects only (`descriptive`).
A refused family is still summarised over the seeds present, labelled
exploratory: unadjusted p, no Holm, no decisions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis import prereg, stats
from analysis.common import METRICS
from analysis.paired import CONFIDENCE, compare, diff_interval, summarize_d
from analysis.render import md_table

ROW_COLUMNS = ("test", "kind", "predicted", "cells", "n", "effect", "unit", "effect_pp",
               "ci_low", "ci_high", "n_pos", "n_neg", "n_zero", "p_exact", "p_holm",
               "decision", "note")
ACCEPTED, REFUSED = "accepted", "refused"


@dataclass
class FamilyResult:
    """One family: plan check outcome, one tests table per estimand, per-seed d values."""

    question: str
    name: str
    role: str
    method: str
    description: str
    accepted: bool
    reasons: list[str]
    plan_changed: bool = False
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    estimand_notes: dict[str, str] = field(default_factory=dict)
    per_seed: pd.DataFrame = field(default_factory=pd.DataFrame)
    gate_passed: bool | None = None  # containment families only

    @property
    def status(self) -> str:
        if not self.accepted:
            return "refused"
        return "accepted (plan changed; --allow-changed-plan)" if self.plan_changed else ACCEPTED

    def markdown(self) -> str:
        out = [f"### Family `{self.name}` ({self.role}, {self.method}): {self.status}", ""]
        if self.description:
            out += [self.description, ""]
        out += [f"- {reason}" for reason in self.reasons]
        if self.reasons:
            out.append("")
        if not self.accepted and self.tables:
            out += ["Exploratory only (family refused): effects over the seeds present, "
                    "unadjusted sign-flip p, no Holm adjustment, no decisions.", ""]
        if self.gate_passed is not None:
            out += [f"Gate: {'PASSED' if self.gate_passed else 'NOT PASSED'}.", ""]
        for estimand, table in self.tables.items():
            out += [f"_Estimand {estimand}: {self.estimand_notes.get(estimand, '')}_", "",
                    md_table(table, list(ROW_COLUMNS)), ""]
        skipped = {k: v for k, v in self.estimand_notes.items() if k not in self.tables}
        out += [f"- estimand {k}: {v}" for k, v in skipped.items()]
        return "\n".join(out).rstrip() + "\n"


def evaluate_plan(plan: prereg.Plan, runs: pd.DataFrame, *,
                  allow_changed_plan: bool = False) -> list[FamilyResult]:
    """Every family of `plan` evaluated on `runs` (RunSet.all_runs of the plan's campaigns)."""
    return [evaluate_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
            for fam in plan.families]


def evaluate_family(plan: prereg.Plan, fam: prereg.Family, runs: pd.DataFrame, *,
                    allow_changed_plan: bool = False) -> FamilyResult:
    result = FamilyResult(plan.question, fam.name, fam.role, fam.decision["method"],
                          " ".join(str(fam_description(plan, fam)).split()), False, [])
    try:
        check = prereg.check_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
    except ValueError as exc:  # runs lack a column the cells name
        result.reasons = [f"refused: {exc}"]
        return result
    result.accepted, result.plan_changed = check.accepted, check.plan_changed
    matched, notes = (check.runs, []) if check.accepted else relaxed_match(plan, fam, runs)
    if len(matched) == 0:
        campaigns = sorted({str(c.keys["campaign"]) for c in fam.cells})
        result.reasons = [f"no data: none of the {check.num_expected} planned runs "
                          f"({len(fam.cells)} cells, campaign {', '.join(campaigns)}) "
                          "is in the ledger"]
        return result
    result.reasons = check.reasons() + notes
    values = {cell.id: matched[matched["cell_id"] == cell.id].set_index("seed")
              for cell in fam.cells}
    per_seed = []
    for estimand in fam.estimands:
        metric = METRICS.get(estimand.metric)
        if metric is None:
            result.estimand_notes[estimand.name] = (f"{estimand.metric} ({estimand.role}) is "
                                                    "reported in the question's own sections")
            continue
        if metric.name not in runs.columns:
            result.estimand_notes[estimand.name] = (f"{metric.name} ({estimand.role}): "
                                                    "no such readout in these runs")
            continue
        table, seeds = _tests_table(fam, values, metric.name)
        _decide(table, fam, estimand, result.accepted)
        result.tables[estimand.name] = table
        scale = "log ratio" if metric.scale == "log" else f"difference in {metric.unit}"
        result.estimand_notes[estimand.name] = (f"{metric.label} [{metric.name}], "
                                                f"{estimand.role}; per-seed {scale}")
        per_seed.append(seeds.assign(estimand=estimand.name))
        if fam.decision["method"] == "containment" and estimand.role == "primary":
            result.gate_passed = bool(result.accepted and len(table)
                                      and (table["decision"] == "PASS").all())
    result.per_seed = pd.concat(per_seed, ignore_index=True) if per_seed else pd.DataFrame()
    return result


def fam_description(plan: prereg.Plan, fam: prereg.Family) -> str:
    raw = next((f for f in plan.raw.get("families", []) if f.get("name") == fam.name), {})
    return raw.get("description", "")


def relaxed_match(plan: prereg.Plan, fam: prereg.Family,
                  runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Runs of the family's cells at any seed (for exploratory summaries), and notes.

    A cell and seed matched by more than one run is left out and named.
    """
    seeds = tuple(sorted({int(s) for s in runs["seed"]})) if len(runs) else ()
    if not seeds:
        return pd.DataFrame(columns=["cell_id", "seed"]), []
    relaxed = dataclasses.replace(
        fam, cells=tuple(dataclasses.replace(c, seeds=seeds) for c in fam.cells), tests=())
    found = prereg.check_family(plan, relaxed, runs, allow_changed_plan=True).runs
    duplicated = found.duplicated(["cell_id", "seed"], keep=False)
    notes = []
    if duplicated.any():
        pairs = sorted({(c, int(s)) for c, s in found.loc[duplicated, ["cell_id", "seed"]]
                        .itertuples(index=False)})
        notes.append(f"exploratory summary leaves out duplicated cell/seed pairs {pairs}")
    return found[~duplicated], notes


def _series(values: dict[str, pd.DataFrame], cell_id: str, metric: str) -> pd.Series:
    return values[cell_id][metric].astype(float).sort_index()


def _tests_table(fam: prereg.Family, values: dict[str, pd.DataFrame],
                 metric: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, per_seed = [], []
    confidence = float(fam.decision.get("confidence", CONFIDENCE))
    for test in fam.tests:
        if test.kind == "paired":
            row, d = _paired(values, test, metric, confidence)
        elif test.kind == "interaction":
            row, d = _interaction(values, test, metric, confidence)
        else:
            row, d = _containment(values, test, metric, fam.decision)
        rows.append({"test": test.id, "kind": test.kind, "predicted": test.predicted, **row})
        per_seed += [{"test": test.id, "seed": int(s), "d": float(v)} for s, v in d.items()]
    table = pd.DataFrame(rows)
    for column in ROW_COLUMNS:
        if column not in table:
            table[column] = math.nan if column not in ("decision", "note", "unit") else ""
    return table[list(ROW_COLUMNS)], pd.DataFrame(per_seed, columns=["test", "seed", "d"])


def _with_confidence(row: dict, d: pd.Series, scale: str, confidence: float) -> dict:
    """Recompute the interval at the family's confidence when it is not 95%."""
    if confidence != CONFIDENCE and len(d) >= 2:
        if scale == "log":
            interval = stats.paired_t_interval(d.to_numpy(), confidence)
            row.update(ci_low=interval.low_pct, ci_high=interval.high_pct)
        else:
            row["ci_low"], row["ci_high"] = diff_interval(d.to_numpy(), confidence)
    return row


def _paired(values, test, metric, confidence) -> tuple[dict, pd.Series]:
    t, c = test.cells["treatment"], test.cells["control"]
    row, d = compare(_series(values, t, metric), _series(values, c, metric), metric)
    unit = "%" if METRICS[metric].scale == "log" else METRICS[metric].unit
    row = _with_confidence(row, d, METRICS[metric].scale, confidence)
    return {"cells": f"{t} vs {c}", "unit": unit, **row}, d


def _interaction(values, test, metric, confidence) -> tuple[dict, pd.Series]:
    """Per seed (T_a vs C_a) minus (T_b vs C_b); log scale shows pp and the ratio of ratios."""
    roles = ("a.treatment", "a.control", "b.treatment", "b.control")
    cells = [test.cells[k] for k in roles]
    frame = pd.concat([_series(values, c, metric).rename(r) for c, r in zip(cells, roles,
                                                                           strict=True)],
                      axis=1, join="inner").dropna()
    scale = METRICS[metric].scale
    text = f"({cells[0]} vs {cells[1]}) - ({cells[2]} vs {cells[3]})"
    if scale == "log":
        if (frame <= 0).any().any():
            return {"cells": text, "unit": "%", "n": len(frame),
                    "note": "nonpositive values"}, pd.Series(dtype=float)
        frame = np.log(frame)
    d_a = frame["a.treatment"] - frame["a.control"]
    d_b = frame["b.treatment"] - frame["b.control"]
    d = d_a - d_b
    row = summarize_d(d.to_numpy(), scale)
    row = _with_confidence(row, d, scale, confidence)
    row.pop("display_mean_pct", None)
    if scale == "log" and len(d):
        row["effect_pp"] = stats.effect_pct(d_a.to_numpy()) - stats.effect_pct(d_b.to_numpy())
    unit = "% (ratio of ratios)" if scale == "log" else METRICS[metric].unit
    return {"cells": text, "unit": unit, **row}, d


def _containment(values, test, metric, decision) -> tuple[dict, pd.Series]:
    """Paired-t interval of 100 ln(ON/OFF) against +-margin_pct."""
    on, off = test.cells["probe_on"], test.cells["probe_off"]
    frame = pd.concat([_series(values, on, metric).rename("on"),
                       _series(values, off, metric).rename("off")], axis=1, join="inner").dropna()
    d = np.log(frame["on"]) - np.log(frame["off"])
    row = summarize_d(d.to_numpy(), "diff")
    row.update(unit="100 ln(ON/OFF)", effect=100 * row["effect"], ci_low=math.nan,
               ci_high=math.nan)
    if len(frame) >= 2:
        check = stats.containment(frame["on"], frame["off"], decision["margin_pct"],
                                  decision["confidence"])
        row.update(effect=check.estimate_log_pct, ci_low=check.low_log_pct,
                   ci_high=check.high_log_pct, decision="PASS" if check.passed else "FAIL")
    else:
        row["note"] = "containment needs n >= 2 ON/OFF pairs"
    return {"cells": f"{on} vs {off}", **row}, d


def _decide(table: pd.DataFrame, fam: prereg.Family, estimand: prereg.Estimand,
            accepted: bool) -> None:
    """Fill p_holm and decision in place, as the family's decision method says."""
    method = fam.decision["method"]
    if not accepted:
        table["decision"] = "refused"
        return
    if method == "containment":
        table["decision"] = table["decision"].replace("", "not evaluated")
        return
    if method == "descriptive":
        table["decision"] = "descriptive"
        return
    if method == "paired_t_interval":
        table["decision"] = [_interval_decision(r) for r in table.itertuples()]
        return
    p = table["p_exact"].to_numpy(dtype=float)
    if len(p) and np.isfinite(p).all():
        table["p_holm"] = stats.holm(p)
        reject = stats.holm_reject(p, fam.alpha)
        if estimand.role == "primary":
            table["decision"] = [(f"reject H0 ({'positive' if e > 0 else 'negative'})"
                                  if r else "not rejected")
                                 for r, e in zip(reject, table["effect"], strict=True)]
        else:
            table["decision"] = f"{estimand.role}: no decision"
    else:
        table["decision"] = "not evaluated: a test has no p"


def _interval_decision(row) -> str:
    """CONFIRMED / DIRECTIONAL / NOT_CONFIRMED against the predicted direction."""
    if math.isnan(row.ci_low):
        return "no interval"
    if row.predicted == "none":
        return "interval excludes 0" if row.ci_low > 0 or row.ci_high < 0 else "interval includes 0"
    sign = 1 if row.predicted == "positive" else -1
    if (sign > 0 and row.ci_low > 0) or (sign < 0 and row.ci_high < 0):
        return stats.CONFIRMED
    all_in_direction = (row.n_pos if sign > 0 else row.n_neg) == row.n
    return stats.DIRECTIONAL if all_in_direction else stats.NOT_CONFIRMED
