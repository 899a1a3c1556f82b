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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.inference import prereg, stats
from analysis.inference.paired import CONFIDENCE, diff_interval, summarize_d
from analysis.markdown import md_table
from analysis.metrics import METRICS, seeds_text

ROW_COLUMNS = ("test", "label", "kind", "predicted", "cells", "n", "effect", "unit", "min_seed",
               "max_seed", "ci_low", "ci_high", "interval", "n_pos", "n_neg", "n_zero",
               "statistic", "p6", "p9", "p_exact", "p_sensitivity", "p_holm", "decision", "note")
# as shown on a page: where the decision flips under the alternatives (analysis.flips)
SHOWN_COLUMNS = (*ROW_COLUMNS[:-1], "holds_under", ROW_COLUMNS[-1])
TEXT_COLUMNS = ("label", "kind", "predicted", "cells", "unit", "interval", "statistic",
                "decision", "note")
# The trace probe costs nothing in simulation: ON and OFF runs are identical, and so are
# S2 and S2+Retention under ISOLATE. Such checks are reported as uninformative, never passed.
UNINFORMATIVE = "not informative in simulation"
IDENTICAL = "identical runs: every seedwise difference is 0 (not informative in simulation)"
NOT_INFORMATIVE = ("not informative in simulation: ON and OFF runs are identical (the trace "
                   "probe has no cost in the simulator)")
ACCEPTED, REFUSED = "accepted", "refused"
NO_RUNS = "no runs yet"  # a family none of whose planned runs is in the ledger (not refused)


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
    m: int = 0  # tests in the family (Holm's m), also when only some rows are shown
    fill: list[str] = field(default_factory=list)  # commands that collect missing runs
    summary: str = ""  # one line: what is missing
    primary: str = ""  # the name of the primary estimand (its table carries the decision)

    @property
    def status(self) -> str:
        if self.no_data:
            return NO_RUNS
        if not self.accepted:
            return REFUSED
        if self.smoke:
            return SMOKE_STATUS
        return "accepted (plan changed; --allow-changed-plan)" if self.plan_changed else ACCEPTED

    @property
    def no_data(self) -> bool:
        return not self.accepted and any(r.startswith("no data") for r in self.reasons)

    @property
    def smoke(self) -> bool:
        return self.name.endswith(SMOKE_TAG)

    def headline(self) -> str:
        """One line for the top of the question's page when the family is refused."""
        if self.accepted:
            return ""
        why = self.summary or (self.reasons[0] if self.reasons else "no reason recorded")
        fill = f"; fill with `{' && '.join(self.fill)}`" if self.fill else ""
        why = why.removeprefix(f"{self.status}: ")
        return f"Family `{self.name}` {self.status}: {why}{fill}"

    def markdown(self) -> str:
        status = self.status
        m = self.m or (len(next(iter(self.tables.values()))) if self.tables else 0)
        out = [f"### Family `{self.name}` ({self.role}, {self.method}, m = {m}): {status}", ""]
        if self.description:
            out += [self.description, ""]
        out += [f"- {reason}" for reason in self.reasons]
        if self.reasons:
            out.append("")
        if not self.accepted and self.tables:
            out += ["Exploratory only (family refused): effects over the seeds present, "
                    "unadjusted sign-flip p, no Holm adjustment, no decisions.", ""]
        if self.gate_passed is not None:
            uninformative = any((table["decision"] == UNINFORMATIVE).all()
                                for table in self.tables.values())
            verdict = ("not informative in simulation (trace ON and OFF runs identical); depth "
                       "may be analysed" if self.gate_passed and uninformative else
                       "PASSED" if self.gate_passed else "NOT PASSED")
            out += [f"Gate: {verdict}.", ""]
        for estimand, table in self.tables.items():
            shown = [c for c in SHOWN_COLUMNS if c in table and not _blank(table[c])]
            out += [f"_Estimand {estimand}: {self.estimand_notes.get(estimand, '')}_", "",
                    md_table(table, shown), ""]
        skipped = {k: v for k, v in self.estimand_notes.items() if k not in self.tables}
        out += [f"- estimand {k}: {v}" for k, v in skipped.items()]
        return "\n".join(out).rstrip() + "\n"


def _blank(column: pd.Series) -> bool:
    return bool(column.map(lambda v: v == "" or (isinstance(v, float) and math.isnan(v))).all())


# Pipeline-check campaigns: `<c>_smoke` (make smoke) and `demo_<c>` (make demo).
SMOKE_TAG = " (smoke)"
SMOKE_STATUS = "smoke: n = 3, for checking the pipeline, not for conclusions"
SMOKE_SEEDS = 3


def smoke_campaigns(campaign: str) -> tuple[str, ...]:
    return (f"{campaign}_smoke", f"demo_{campaign}")


def smoke_plan(plan: prereg.Plan, present: set[str]) -> prereg.Plan | None:
    """The plan over its pipeline-check campaigns present in the ledger, or None.

    Each cell's campaign becomes its smoke or demo counterpart and its seeds the first
    SMOKE_SEEDS (what `hydra.sweeper.smoke` and the demo collect); families with no cell in
    those campaigns are dropped. The derived plan has its own hash; its runs carry the hash
    of the plan they were collected under, which the check compares per campaign.
    """
    families = []
    for fam in plan.families:
        cells = []
        for cell in fam.cells:
            names = tuple(s for c in prereg.cell_campaigns(cell) for s in smoke_campaigns(c)
                          if s in present)
            if names:
                keys = {**cell.keys, "campaign": names if len(names) > 1 else names[0]}
                cells.append(dataclasses.replace(cell, keys=keys, seeds=cell.seeds[:SMOKE_SEEDS]))
        if not cells:
            continue
        ids = {c.id for c in cells}
        cells += [dataclasses.replace(c, keys={**c.keys, "campaign": "(not collected)"},
                                      seeds=c.seeds[:SMOKE_SEEDS])
                  for c in fam.cells if c.id not in ids]
        families.append(dataclasses.replace(fam, name=fam.name + SMOKE_TAG, cells=tuple(cells),
                                            seeds=fam.seeds[:SMOKE_SEEDS]))
    if not families:
        return None
    raw = {"derived_from": plan.plan_hash, "smoke_seeds": SMOKE_SEEDS,
           "campaigns": sorted(present)}
    return dataclasses.replace(plan, families=tuple(families), plan_hash=prereg.plan_hash(raw),
                               raw={**plan.raw, "smoke": raw})


def evaluate_plan(plan: prereg.Plan, runs: pd.DataFrame, *, allow_changed_plan: bool = False,
                  only: Collection[str] | None = None) -> list[FamilyResult]:
    """Every family of `plan` (or those named in `only`: each family is decided on its own)
    evaluated on `runs` (RunSet.all_runs of the plan's campaigns), then the plan's smoke
    counterpart over any smoke or demo campaigns in `runs`."""
    out = [evaluate_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
           for fam in plan.families if only is None or fam.name in only]
    present = set(runs["campaign"].astype(str)) if len(runs) else set()
    smoke = smoke_plan(plan, present)
    if smoke is not None:
        checked = [f for fam in smoke.families
                   if only is None or fam.name.removesuffix(SMOKE_TAG) in only
                   if not (f := evaluate_family(smoke, fam, runs,
                                                allow_changed_plan=allow_changed_plan)).no_data]
        # with smoke or demo runs present, a family without any main-stage run is left out
        out = [f for f in out if not f.no_data] + checked
    return out


def _missing_summary(check) -> str:
    """"missing A of E planned runs: " and the first three cells lacking seeds."""
    absent = sum(len(m.seeds) for m in check.missing)
    named = ", ".join(f"{m.cell_id} seeds {seeds_text(m.seeds)}" for m in check.missing[:3])
    more = f" and {len(check.missing) - 3} more cells" if len(check.missing) > 3 else ""
    return f"missing {absent} of {check.num_expected} planned runs: {named}{more}"


def evaluate_family(plan: prereg.Plan, fam: prereg.Family, runs: pd.DataFrame, *,
                    allow_changed_plan: bool = False) -> FamilyResult:
    result = FamilyResult(plan.question, fam.name, fam.role, fam.decision["method"],
                          " ".join(str(fam_description(plan, fam)).split()), False, [],
                          m=len(fam.tests),
                          primary=next((e.name for e in fam.estimands if e.role == "primary"),
                                       ""))
    try:
        check = prereg.check_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
    except ValueError as exc:  # runs lack a column the cells name
        result.reasons = [f"refused: {exc}"]
        return result
    result.accepted, result.plan_changed = check.accepted, check.plan_changed
    order_notes = []
    if check.accepted and plan.raw.get("run_order") == "balanced":
        order_notes = [f"run order not balanced: {v} (runs are written in completion order; "
                       "`make q9` runs one job at a time)"
                       for v in prereg.run_order_violations(check.runs)]
        if order_notes and not fam.name.endswith(SMOKE_TAG):
            result.accepted = False
        elif order_notes:
            order_notes = [f"{n} (smoke runs: noted, not enforced)" for n in order_notes]
    matched, notes = ((check.runs, []) if result.accepted
                      else relaxed_match(plan, fam, runs))
    result.fill = fill_commands(check.missing, fam.name.endswith(SMOKE_TAG))
    if check.missing:
        result.summary = _missing_summary(check)
    if len(matched) == 0:
        campaigns = sorted({c for cell in fam.cells for c in prereg.cell_campaigns(cell)})
        result.reasons = [f"no data: none of the {check.num_expected} planned runs "
                          f"({len(fam.cells)} cells, campaign {', '.join(campaigns)}) "
                          "is in the ledger"]
        return result
    result.reasons = check.reasons() + order_notes + notes
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
                                      and table["decision"].isin(("PASS", UNINFORMATIVE)).all())
    result.per_seed = pd.concat(per_seed, ignore_index=True) if per_seed else pd.DataFrame()
    return result


QUESTION_TARGETS = tuple(f"q{i}" for i in range(1, 10))


def fill_commands(missing, smoke: bool) -> list[str]:
    """`make` commands that collect the missing runs (each home campaign once; the last
    campaign named by a cell is the one that collects its remaining seeds)."""
    homes = []
    for m in missing:
        value = m.keys["campaign"]
        names = (value,) if isinstance(value, str) else tuple(value)
        home = prereg.home_campaign(names[-1])
        if home not in homes and not home.startswith("("):
            homes.append(home)
    suffix = " SMOKE=1" if smoke else ""
    return [f"make {h}{suffix}" if h in QUESTION_TARGETS else f"make campaign C={h}{suffix}"
            for h in homes]


def fam_description(plan: prereg.Plan, fam: prereg.Family) -> str:
    name = fam.name.removesuffix(SMOKE_TAG)
    raw = next((f for f in plan.raw.get("families", []) if f.get("name") == name), {})
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


def _frame(values, cells: dict[str, str], metric: str) -> pd.DataFrame:
    """Role -> cell values side by side on the seeds every cell has."""
    return pd.concat([_series(values, c, metric).rename(r) for r, c in cells.items()],
                     axis=1, join="inner").dropna()


def _tests_table(fam: prereg.Family, values: dict[str, pd.DataFrame],
                 metric: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows, per_seed = [], []
    for test in fam.tests:
        if test.kind == "containment":
            row, d = _containment(values, test, metric, fam.decision)
        else:
            row, d = _contrast(values, test, metric, fam)
        rows.append({"test": test.id, "label": test.label, "kind": test.kind,
                     "predicted": test.predicted, **row})
        per_seed += [{"test": test.id, "seed": int(s), "d": float(v)} for s, v in d.items()]
    table = pd.DataFrame(rows)
    for column in ROW_COLUMNS:
        if column not in table:
            table[column] = "" if column in TEXT_COLUMNS else math.nan
    return table[list(ROW_COLUMNS)], pd.DataFrame(per_seed, columns=["test", "seed", "d"])


def seedwise(frame: pd.DataFrame, kind: str, scale: str) -> dict[str, pd.Series]:
    """Per-seed statistics of a paired test or an interaction.

    log scale: `pct` is the seedwise percent change 100 (T/C - 1) (for an interaction the
    difference of the two seedwise percent changes, in pp) and `log` the log ratio (or the
    difference of log ratios); diff scale: both are T - C (or the difference of differences).
    """
    if kind == "paired":
        t, c = frame["treatment"], frame["control"]
        if scale != "log":
            return {"pct": t - c, "log": t - c}
        return {"pct": 100 * (t / c - 1), "log": np.log(t) - np.log(c)}
    a = seedwise(frame.rename(columns={"a.treatment": "treatment", "a.control": "control"}),
                 "paired", scale)
    b = seedwise(frame.rename(columns={"b.treatment": "treatment", "b.control": "control"}),
                 "paired", scale)
    return {k: a[k] - b[k] for k in ("pct", "log")}


def _sign_flip_p(d: pd.Series, first_look: tuple[int, ...] | None) -> tuple[float, float, float]:
    """(p, p6, p9): the sign-flip p, or under the two-look rule p_seq = min(1, 2 min(p6, p9))
    with p6 on the first-look seeds and p9 on all seeds (1 when no second look was taken)."""
    if not len(d):
        return math.nan, math.nan, math.nan
    if first_look is None:
        return stats.sign_flip_test(d.to_numpy()).pvalue, math.nan, math.nan
    first = d[d.index.isin(first_look)]
    if len(first) != len(first_look):
        return math.nan, math.nan, math.nan
    p6 = stats.sign_flip_test(first.to_numpy()).pvalue
    p9 = stats.sign_flip_test(d.to_numpy()).pvalue if len(d) > len(first) else None
    return stats.two_look(p6, p9), p6, (1.0 if p9 is None else p9)


def _contrast(values, test: prereg.PlannedTest, metric: str,
              fam: prereg.Family) -> tuple[dict, pd.Series]:
    """One paired test or interaction: display, interval, sign counts, p.

    Methods: docs/statistics.md sections 2.5, 3-7.

    Display (log-scale metrics): the mean of seedwise percent changes (interactions: the mean
    of seedwise pp differences), or 100 (exp(mean d) - 1) where the decision says
    `display: back_transformed` (Q9). The sign-flip test runs on the family's `statistic`
    (log_ratio by default, relative_pct for ORIG-5 and PIN-2), the other one is reported
    as `p_sensitivity`.
    """
    frame = _frame(values, test.cells, metric)
    scale = METRICS[metric].scale
    names = list(test.cells.values())
    text = (f"{names[0]} vs {names[1]}" if test.kind == "paired" else
            f"({names[0]} vs {names[1]}) - ({names[2]} vs {names[3]})")
    decision = fam.decision
    back = decision.get("display") == "back_transformed" or (
        decision["method"] == "paired_t_interval" and "display" not in decision)
    unit = (METRICS[metric].unit if scale != "log" else
            "%" if test.kind == "paired" else "% (ratio of ratios)" if back else "pp")
    row: dict = {"cells": text, "unit": unit, "n": len(frame)}
    if scale == "log" and (frame <= 0).any().any():
        row["note"] = "nonpositive values"
        return row, pd.Series(dtype=float)
    if frame.empty:
        row["note"] = "no paired seeds"
        return row, pd.Series(dtype=float)
    per = seedwise(frame, test.kind, scale)
    statistic = decision.get("statistic", "log_ratio")
    d = per["pct"] if statistic == "relative_pct" and scale == "log" else per["log"]
    other = per["log"] if d is per["pct"] else per["pct"]
    first_look = tuple(decision["first_look_seeds"]) if "first_look_seeds" in decision else None
    p, p6, p9 = _sign_flip_p(d, first_look)
    row.update(p_exact=p, p6=p6, p9=p9, n_pos=int((d > 0).sum()), n_neg=int((d < 0).sum()),
               n_zero=int((d == 0).sum()), statistic=statistic if scale == "log" else "difference",
               min_seed=float(per["pct"].min()), max_seed=float(per["pct"].max()))
    if "sensitivity_statistic" in decision and scale == "log":
        row["p_sensitivity"] = _sign_flip_p(other, first_look)[0]
    if scale == "log" and back:
        row["effect"] = 100 * math.expm1(float(per["log"].mean()))
    else:
        row["effect"] = float(per["pct"].mean())
    self_comparison = test.kind == "paired" and test.cells["treatment"] == test.cells["control"]
    row.update(_interval(per, scale, decision, self_comparison)
               if test.intervals != "none" else
               {"interval": "", "note": "no interval: the plan declares none for this row"})
    if not self_comparison and len(d) and float(np.abs(per["log"]).max()) == 0.0:
        row["note"] = IDENTICAL
    return row, d


def _interval(per: dict[str, pd.Series], scale: str, decision: Mapping,
              self_comparison: bool) -> dict:
    """The family's display interval: none, a seeded bootstrap of the displayed mean, or the
    paired-t interval (log ratios back-transformed for log-scale metrics)."""
    kind = decision.get("intervals", "paired_t")
    n = len(per["log"])
    if kind == "none" or self_comparison or n < 2:
        note = "self-comparison: d = 0, p = 1" if self_comparison else (
            "no interval (min-max of seeds shown)" if kind == "none" else "n < 2: no interval")
        return {"interval": "", "note": note}
    confidence = float(decision.get("confidence", CONFIDENCE))
    if kind == "bootstrap":
        boot = decision.get("bootstrap", {})
        resamples, seed = int(boot.get("resamples", 10_000)), int(boot.get("seed", 0))
        low, high = stats.bootstrap_mean_interval(per["pct"].to_numpy(), resamples, seed,
                                                  confidence)
        return {"ci_low": low, "ci_high": high,
                "interval": f"{100 * confidence:g}% bootstrap ({resamples} seed resamples)"}
    if scale == "log":
        interval = stats.paired_t_interval(per["log"].to_numpy(), confidence)
        return {"ci_low": interval.low_pct, "ci_high": interval.high_pct,
                "interval": f"{100 * confidence:g}% paired-t of the mean log ratio"}
    low, high = diff_interval(per["log"].to_numpy(), confidence)
    return {"ci_low": low, "ci_high": high, "interval": f"{100 * confidence:g}% paired-t"}


def _containment(values, test, metric, decision) -> tuple[dict, pd.Series]:
    """Paired-t interval of 100 ln(ON/OFF) against +-margin_pct."""
    on, off = test.cells["probe_on"], test.cells["probe_off"]
    frame = pd.concat([_series(values, on, metric).rename("on"),
                       _series(values, off, metric).rename("off")], axis=1, join="inner").dropna()
    d = np.log(frame["on"]) - np.log(frame["off"])
    row = summarize_d(d.to_numpy(), "diff")
    row.pop("display_mean_pct", None)
    row.update(unit="100 ln(ON/OFF)", effect=100 * row["effect"], ci_low=math.nan,
               ci_high=math.nan, statistic="log_ratio")
    if len(frame) >= 2:
        check = stats.containment(frame["on"], frame["off"], decision["margin_pct"],
                                  decision["confidence"])
        row.update(effect=check.estimate_log_pct, ci_low=check.low_log_pct,
                   ci_high=check.high_log_pct, decision="PASS" if check.passed else "FAIL",
                   interval=f"{100 * check.confidence:g}% paired-t, margin +-{check.margin_pct:g}")
        if float(np.abs(d).max()) == 0.0:  # no probe cost at all: the check says nothing
            row.update(note=NOT_INFORMATIVE, decision=UNINFORMATIVE)
    else:
        row["note"] = "containment needs n >= 2 ON/OFF pairs"
    return {"cells": f"{on} vs {off}", **row}, d


def _decide(table: pd.DataFrame, fam: prereg.Family, estimand: prereg.Estimand,
            accepted: bool) -> None:
    """Fill p_holm and decision in place, as the family's decision method says.

    Only the primary estimand of a primary family carries a decision label; the other
    rows keep their p-values and intervals with an empty decision.
    """
    method = fam.decision["method"]
    labelled = fam.role == "primary" and estimand.role == "primary"
    if not accepted:
        table["decision"] = REFUSED
        return
    if method == "containment":
        table["decision"] = table["decision"].replace("", "not evaluated")
        return
    if method == "descriptive":
        table["decision"] = "descriptive" if labelled else ""
        return
    if method == "paired_t_interval":
        table["decision"] = [_interval_decision(r) if labelled else "" for r in table.itertuples()]
        return
    p = table["p_exact"].to_numpy(dtype=float)
    if len(p) and np.isfinite(p).all():
        table["p_holm"] = stats.holm(p)
        reject = stats.holm_reject(p, fam.alpha)
        table["decision"] = [(f"reject H0 ({'positive' if e > 0 else 'negative'})"
                              if r else "not rejected") if labelled else ""
                             for r, e in zip(reject, table["effect"], strict=True)]
    else:
        table["decision"] = "not evaluated: a test has no p" if labelled else ""


PAPER_LABELS = {stats.CONFIRMED: "PERF_CONFIRM", stats.DIRECTIONAL: "PERF_CONFIRM_DIRECTIONAL"}


def _interval_decision(row) -> str:
    """CONFIRMED / DIRECTIONAL / NOT_CONFIRMED against the predicted direction."""
    if math.isnan(row.ci_low):
        return "no interval"
    if row.predicted == "none":
        return "interval excludes 0" if row.ci_low > 0 or row.ci_high < 0 else "interval includes 0"
    sign = 1 if row.predicted == "positive" else -1
    if (sign > 0 and row.ci_low > 0) or (sign < 0 and row.ci_high < 0):
        return f"{stats.CONFIRMED} (paper: {PAPER_LABELS[stats.CONFIRMED]})"
    if (row.n_pos if sign > 0 else row.n_neg) == row.n:
        return f"{stats.DIRECTIONAL} (paper: {PAPER_LABELS[stats.DIRECTIONAL]})"
    return stats.NOT_CONFIRMED
