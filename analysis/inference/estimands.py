"""Secondary and descriptive estimands (docs/paper_design.md section 2) from the ledgers.

Latency ratios D0/comparator (2.3, Tab. E-13), latency-qualified goodput (2.4, E.8), the
central-arrival window with its full-run gap and drift count (2.1, E.9, Tab. E-14),
stranded bytes of D0's two pools (2.4, B.4), cap-sweep ratios per completion (2.4,
Tab. E-11), the Q6 simultaneous upper bounds (3.4, AMBIGUOUS A4) and the EXT-22 adoption
scenarios B and C (3.2). Every one is a sensitivity or description: intervals (seed-level
percentile bootstrap, or Bonferroni paired-t for the bounds), never decision labels. The
readings chosen where the paper is silent are read from the plan YAML
(`secondary_estimands`, `simultaneous_upper_bounds`, `adoption_scenarios`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis.inference import stats
from analysis.runset import RunSet, query

DUAL_POOLS = ("attention", "recurrent")  # the two pools whose stranded bytes are measured
DEFAULTS = {"goodput_quantile": 0.9, "window": [0.2, 0.8], "drift_tolerance": 0.10,
            "resamples": 10_000, "seed": 0, "confidence": 0.95}
PAIR_COLUMNS = ("stage", "test", "label", "estimand", "n", "estimate", "unit", "ci_low",
                "ci_high", "interval", "alternative", "note")


def settings(raw_plan: Mapping) -> dict:
    """The declared readings of a plan (`secondary_estimands`), over the defaults."""
    return {**DEFAULTS, **dict(raw_plan.get("secondary_estimands", {}).get("parameters", {}))}


def readings_text(raw_plan: Mapping, keys: Sequence[str] | None = None) -> str:
    """The plan's declared readings (those named in `keys`, or all), one paragraph."""
    readings = raw_plan.get("secondary_estimands", {}).get("readings", {})
    return " ".join(f"{k}: {' '.join(str(v).split())}" for k, v in readings.items()
                    if keys is None or k in keys)


# ---------------------------------------------------------------------------
# Per-run raw data
# ---------------------------------------------------------------------------

_REQUESTS = """
    SELECT run_id, arrival_s, e2e_s, output_tokens, status, preemptions
    FROM requests WHERE {campaigns} AND run_id IN ({adopted})
"""
_GENERATION = """
    SELECT run_id, t_s, max(generation_tokens_total) AS generated
    FROM poller WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id, t_s
    ORDER BY run_id, t_s
"""
_POOLS = """
    SELECT p.run_id, p.t_s, p.pool, p.units_free, p.units_cached, p.units_total,
           coalesce(s.steps, 0) AS steps
    FROM poller p LEFT JOIN (
        SELECT run_id, CAST(floor(t_start_s) AS BIGINT) AS t_s, count(*) AS steps
        FROM steps WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY 1, 2) s
      ON p.run_id = s.run_id AND p.t_s = s.t_s
    WHERE {campaigns_p} AND p.run_id IN ({adopted}) AND p.pool IN ('attention', 'recurrent')
"""
_REJECTIONS = """
    SELECT run_id, count(DISTINCT (step, request_id)) AS rejections
    FROM trace WHERE {campaigns} AND run_id IN ({adopted}) AND event = 'ALLOC_FAIL'
    GROUP BY run_id
"""


def _runset(runs: pd.DataFrame) -> RunSet:
    return RunSet((), tuple(sorted(runs["campaign"].astype(str).unique())), runs, runs.head(0))


def request_frames(con, runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """run_id -> its requests (arrival, E2E, output tokens, status, preemptions)."""
    if runs.empty:
        return {}
    data = query(con, _REQUESTS, _runset(runs))
    return {str(k): g.reset_index(drop=True) for k, g in data.groupby("run_id")}


def generation_curves(con, runs: pd.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """run_id -> (sample times, cumulative generated tokens) from the 1-s poller."""
    if runs.empty:
        return {}
    data = query(con, _GENERATION, _runset(runs))
    return {str(k): (g["t_s"].to_numpy(float), g["generated"].to_numpy(float))
            for k, g in data.groupby("run_id")}


# ---------------------------------------------------------------------------
# Central-arrival window and drift (docs/paper_design.md section 2.1; E.9, Tab. E-14)
# ---------------------------------------------------------------------------


def central_window(arrivals: Sequence[float], lo: float = 0.2, hi: float = 0.8
                   ) -> tuple[float, float]:
    """The lo-hi quantiles (linear interpolation) of an arrival sequence."""
    a = np.sort(np.asarray(arrivals, dtype=float))
    return float(np.quantile(a, lo)), float(np.quantile(a, hi))


def window_rate(curve: tuple[np.ndarray, np.ndarray], start: float, end: float) -> float:
    """Output tokens/s generated in [start, end]: the cumulative poller counter, linearly
    interpolated between its 1-s samples."""
    t, g = curve
    if end <= start or len(t) < 2:
        return math.nan
    return float((np.interp(end, t, g) - np.interp(start, t, g)) / (end - start))


def drift(curve, start: float, end: float) -> float:
    """|T2 - T1| / T of the window's two halves (T = whole-window rate)."""
    mid = (start + end) / 2
    whole = window_rate(curve, start, end)
    if not whole or math.isnan(whole):
        return math.nan
    return abs(window_rate(curve, mid, end) - window_rate(curve, start, mid)) / whole


# ---------------------------------------------------------------------------
# Latency-qualified goodput (docs/paper_design.md section 2.4; E.8)
# ---------------------------------------------------------------------------


def _finished(req: pd.DataFrame) -> pd.DataFrame:
    return req[(req["status"] == "finished") & req["e2e_s"].notna()]


def goodput(req: pd.DataFrame, threshold: float, span_s: float) -> float:
    """Output tokens of finished requests with E2E <= threshold, per request-span second."""
    done = _finished(req)
    return float(done.loc[done["e2e_s"] <= threshold, "output_tokens"].sum()) / span_s


def goodput_thresholds(treatment: pd.DataFrame, control: pd.DataFrame,
                       quantile: float) -> dict[str, float]:
    """E2E thresholds from the comparator's finished requests and from both arms' union."""
    c = _finished(control)["e2e_s"].to_numpy(float)
    t = _finished(treatment)["e2e_s"].to_numpy(float)
    return {"comparator": float(np.quantile(c, quantile)),
            "union": float(np.quantile(np.concatenate([t, c]), quantile))}


# ---------------------------------------------------------------------------
# Seed-level summaries
# ---------------------------------------------------------------------------


def _boot(values: np.ndarray, cfg: Mapping, statistic=None) -> tuple[float, float]:
    """Seed-level percentile bootstrap of `statistic` (default: the mean) over the rows."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    if statistic is None:
        return stats.bootstrap_mean_interval(values, int(cfg["resamples"]), int(cfg["seed"]),
                                             float(cfg["confidence"]))
    rng = np.random.default_rng(int(cfg["seed"]))
    idx = rng.integers(0, n, size=(int(cfg["resamples"]), n))
    draws = statistic(values[idx])
    conf = float(cfg["confidence"])
    low, high = np.quantile(draws, [0.5 - conf / 2, 0.5 + conf / 2])
    return float(low), float(high)


def _interval_text(cfg: Mapping) -> str:
    return (f"{100 * float(cfg['confidence']):g}% seed bootstrap "
            f"({int(cfg['resamples'])} resamples)")


def mean_pct_row(pct: pd.Series, cfg: Mapping, **row) -> dict:
    """Mean of seedwise values (percent changes or pp) with its bootstrap interval."""
    values = pct.dropna().to_numpy(float)
    low, high = _boot(values, cfg)
    return {**row, "n": len(values), "estimate": float(values.mean()) if len(values) else math.nan,
            "ci_low": low, "ci_high": high, "interval": _interval_text(cfg)}


def ratio_of_means_row(t: pd.Series, c: pd.Series, cfg: Mapping, **row) -> dict:
    """Ratio of mean run-level values (AMBIGUOUS A17 reading); the mean of seedwise ratios
    is the alternative, shown beside it."""
    pair = pd.concat([t.rename("t"), c.rename("c")], axis=1, join="inner").dropna()
    both = pair[["t", "c"]].to_numpy(float)
    if len(both) == 0:
        return {**row, "n": 0, "note": "no paired seeds"}
    low, high = _boot(both, cfg, lambda x: x[..., 0].mean(axis=1) / x[..., 1].mean(axis=1))
    return {**row, "n": len(both), "estimate": float(both[:, 0].mean() / both[:, 1].mean()),
            "unit": "ratio", "ci_low": low, "ci_high": high, "interval": _interval_text(cfg),
            "alternative": float((both[:, 0] / both[:, 1]).mean())}


# ---------------------------------------------------------------------------
# Paired estimands of a plan's D0-vs-comparator tests (Tab. E-13, E-14, E.9)
# ---------------------------------------------------------------------------


def pair_runs(cell_runs: pd.DataFrame, treatment: str, control: str) -> pd.DataFrame:
    """Per stage and seed: the treatment and control runs of one paired test."""
    t = cell_runs[cell_runs["cell_id"] == treatment]
    c = cell_runs[cell_runs["cell_id"] == control]
    return t.merge(c, on=["stage", "seed"], suffixes=("_t", "_c"))


def seedwise_pair_values(pairs: pd.DataFrame, requests: Mapping, curves: Mapping,
                         cfg: Mapping) -> pd.DataFrame:
    """One row per stage and seed: goodput and central-window throughputs of both arms."""
    lo, hi = (float(x) for x in cfg["window"])
    rows = []
    for _, p in pairs.iterrows():
        rt, rc = requests.get(str(p["run_id_t"])), requests.get(str(p["run_id_c"]))
        row = {"stage": p["stage"], "seed": int(p["seed"]),
               "span_t": float(p["throughput_span_t"]), "span_c": float(p["throughput_span_c"]),
               "e2e_p99_t": float(p["e2e_p99_t"]), "e2e_p99_c": float(p["e2e_p99_c"]),
               "tpot_p99_t": float(p["tpot_p99_t"]), "tpot_p99_c": float(p["tpot_p99_c"])}
        if rt is not None and rc is not None and len(_finished(rc)) and len(_finished(rt)):
            tau = goodput_thresholds(rt, rc, float(cfg["goodput_quantile"]))
            span_t = float(p["span_end_s_t"]) - float(p["span_start_s_t"])
            span_c = float(p["span_end_s_c"]) - float(p["span_start_s_c"])
            for name, value in tau.items():
                row[f"goodput_{name}_t"] = goodput(rt, value, span_t)
                row[f"goodput_{name}_c"] = goodput(rc, value, span_c)
            # the frozen common window: the comparator's arrival sequence, for both arms
            start, end = central_window(rc["arrival_s"], lo, hi)
            row["window_common"] = bool(np.allclose(
                central_window(rt["arrival_s"], lo, hi), (start, end)))
            ct, cc = curves.get(str(p["run_id_t"])), curves.get(str(p["run_id_c"]))
            if ct is not None and cc is not None:
                row["central_t"], row["central_c"] = (window_rate(ct, start, end),
                                                      window_rate(cc, start, end))
                row["drift_t"], row["drift_c"] = drift(ct, start, end), drift(cc, start, end)
        rows.append(row)
    return pd.DataFrame(rows)


def _pct(frame: pd.DataFrame, t: str, c: str) -> pd.Series:
    if t not in frame or c not in frame:
        return pd.Series(dtype=float)
    return 100 * (frame[t] / frame[c] - 1)


def pair_estimands(seedwise: pd.DataFrame, test: str, label: str, cfg: Mapping) -> list[dict]:
    """Tab. E-13 / E-14 / E.9 rows of one test in one stage."""
    base = {"test": test, "label": label}
    rows = [ratio_of_means_row(seedwise["e2e_p99_t"], seedwise["e2e_p99_c"], cfg, **base,
                               estimand="E2E p99 ratio (ratio of mean run p99s)"),
            ratio_of_means_row(seedwise["tpot_p99_t"], seedwise["tpot_p99_c"], cfg, **base,
                               estimand="request-TPOT p99 ratio (ratio of mean run p99s)")]
    q = float(cfg["goodput_quantile"])
    for name in ("comparator", "union"):
        pct = _pct(seedwise, f"goodput_{name}_t", f"goodput_{name}_c")
        if len(pct.dropna()):
            rows.append(mean_pct_row(pct, cfg, **base, unit="%",
                                     estimand=f"goodput, {name}-threshold (E2E <= p{100 * q:g})"))
    full = _pct(seedwise, "span_t", "span_c")
    central = _pct(seedwise, "central_t", "central_c")
    if len(central.dropna()):
        rows.append(mean_pct_row(full, cfg, **base, unit="%", estimand="full-run gap"))
        note = ("" if seedwise["window_common"].all() else
                "arrival sequences differ between arms: the comparator's window is used")
        rows.append(mean_pct_row(central, cfg, **base, unit="%", note=note,
                                 estimand="central-arrival gap"))
        rows.append(mean_pct_row(central - full, cfg, **base, unit="pp",
                                 estimand="central minus full-run gap"))
        drifts = pd.concat([seedwise["drift_t"], seedwise["drift_c"]]).dropna()
        tol = float(cfg["drift_tolerance"])
        rows.append({**base, "estimand": f"runs failing the drift heuristic (> {tol:g})",
                     "n": len(drifts), "estimate": int((drifts > tol).sum()), "unit": "runs",
                     "note": f"max |T2 - T1| / T = {drifts.max():.3f}" if len(drifts) else ""})
    return rows


def pair_table(con, cell_runs: pd.DataFrame, tests: Sequence, cfg: Mapping) -> pd.DataFrame:
    """Tab. E-13/E-14/E.9 rows for paired tests (prereg.PlannedTest) over `cell_runs`
    (runs with `cell_id`, from readouts.family_runs)."""
    if cell_runs.empty:
        return pd.DataFrame(columns=list(PAIR_COLUMNS))
    requests, curves = request_frames(con, cell_runs), generation_curves(con, cell_runs)
    rows = []
    for test in tests:
        pairs = pair_runs(cell_runs, test.cells["treatment"], test.cells["control"])
        if pairs.empty:
            continue
        values = seedwise_pair_values(pairs, requests, curves, cfg)
        for stage, part in values.groupby("stage", sort=False):
            rows += [{"stage": stage, **r}
                     for r in pair_estimands(part, test.id, test.label or test.id, cfg)]
    table = pd.DataFrame(rows)
    for column in PAIR_COLUMNS:
        if column not in table:
            table[column] = math.nan
    text = ["unit", "interval", "note"]
    table[text] = table[text].fillna("")
    return table[list(PAIR_COLUMNS)]


# ---------------------------------------------------------------------------
# Stranded bytes of D0 (docs/paper_design.md section 2.4; B.4) and cap-sweep ratios (E-11)
# ---------------------------------------------------------------------------


def stranded_fractions(pools: pd.DataFrame, unit_bytes: Mapping[str, int]) -> dict:
    """Step-weighted stranded-byte fraction of one D0 run from its per-second pool samples.

    `pools`: rows (t_s, pool, units_free, units_cached, units_total, steps), steps = engine
    steps starting in [t_s, t_s + 1). A pool is exhausted when none of its units is
    available (free or reclaimable cached); the other pool's available bytes are then
    stranded. Fraction = sum_t steps_t * stranded_t / sum_t steps_t * configured bytes.
    The alternative counts free units only (cached units not available).
    """
    wide = pools.pivot_table(index="t_s", columns="pool",
                             values=["units_free", "units_cached", "units_total", "steps"],
                             aggfunc="first")
    if not {"attention", "recurrent"} <= set(wide["units_total"].columns):
        return {"stranded_frac": math.nan, "stranded_frac_free_only": math.nan,
                "stranded_max_progress": math.nan}
    w = wide["steps"].max(axis=1).to_numpy(float)
    nbytes = {p: float(unit_bytes[p]) for p in ("attention", "recurrent")}
    total = sum(wide["units_total"][p].to_numpy(float) * nbytes[p] for p in nbytes)
    out = {}
    for name, cached in (("stranded_frac", True), ("stranded_frac_free_only", False)):
        avail = {p: wide["units_free"][p].to_numpy(float)
                 + (wide["units_cached"][p].to_numpy(float) if cached else 0.0) for p in nbytes}
        stranded = (np.where(avail["recurrent"] == 0, avail["attention"] * nbytes["attention"], 0)
                    + np.where(avail["attention"] == 0,
                               avail["recurrent"] * nbytes["recurrent"], 0))
        denom = float((w * total).sum())
        out[name] = float((w * stranded).sum()) / denom if denom else math.nan
        if cached:
            cum_d = np.cumsum(w * total)
            running = np.divide(np.cumsum(w * stranded), cum_d, out=np.zeros_like(cum_d),
                                where=cum_d > 0)
            out["stranded_max_progress"] = float(running.max()) if len(running) else math.nan
    return out


def pool_unit_bytes(run: Mapping) -> dict[str, int] | None:
    """Bytes per unit of each of a run's pools, as its engine recorded them (the runs row's
    `engine_config`: `Engine.effective_rules()["pool_unit_bytes"]`, read back from the
    built memory organization); None where the record does not say (runs recorded before
    it did, other engines)."""
    try:
        units = json.loads(str(run.get("engine_config") or "{}")).get("pool_unit_bytes")
    except (ValueError, AttributeError):
        return None
    if not isinstance(units, dict) or not set(DUAL_POOLS) <= set(units):
        return None
    return {pool: int(units[pool]) for pool in DUAL_POOLS}


def stranded_table(con, runs: pd.DataFrame) -> pd.DataFrame:
    """Per D0 run: step-weighted stranded-byte fractions, in the unit bytes its record
    states (NaN where the record does not state them)."""
    d0 = runs[runs["org"] == "D0"]
    if d0.empty:
        return pd.DataFrame()
    data = query(con, _POOLS.replace("{campaigns_p}", "p.{campaigns}"), _runset(d0))
    rows = []
    for _, run in d0.iterrows():
        unit_bytes = pool_unit_bytes(run)
        part = data[data["run_id"] == run["run_id"]]
        values = (stranded_fractions(part, unit_bytes) if unit_bytes and len(part) else
                  {"stranded_frac": math.nan, "stranded_frac_free_only": math.nan,
                   "stranded_max_progress": math.nan})
        rows.append({"run_id": run["run_id"], **values})
    return pd.DataFrame(rows)


def cap_ratios(con, runs: pd.DataFrame) -> pd.DataFrame:
    """Per run: rejections, victims and preemptions per completion (Tab. E-11).

    Victims are requests preempted at least once; rejections are ALLOC_FAIL checks (one per
    request and step) and need the trace (NaN when the run was not traced).
    """
    if runs.empty:
        return pd.DataFrame()
    requests = request_frames(con, runs)
    traced = runs[runs["trace"].astype(bool)]
    rejected = (query(con, _REJECTIONS, _runset(traced))
                if len(traced) else pd.DataFrame(columns=["run_id", "rejections"]))
    rejected = dict(zip(rejected["run_id"].astype(str), rejected["rejections"], strict=True))
    rows = []
    for _, run in runs.iterrows():
        req = requests.get(str(run["run_id"]), pd.DataFrame(columns=["preemptions", "status"]))
        done = float((req["status"] == "finished").sum())
        rej = (float(rejected.get(str(run["run_id"]), 0)) if bool(run["trace"]) else math.nan)
        rows.append({"run_id": run["run_id"],
                     "rejections_per_completion": rej / done if done else math.nan,
                     "victims_per_completion": float((req["preemptions"] > 0).sum()) / done
                     if done else math.nan,
                     "preemptions_per_completion": float(req["preemptions"].sum()) / done
                     if done else math.nan})
    return pd.DataFrame(rows)


def units_bytes_note(runs: pd.DataFrame) -> str:
    """Models of the D0 runs whose records do not state their pools' unit bytes."""
    d0 = runs[runs["org"] == "D0"]
    unknown = sorted({str(run["model"]) for _, run in d0.iterrows()
                      if pool_unit_bytes(run) is None})
    return (f" Unit sizes not recorded for model(s) {', '.join(unknown)} (runs.engine_config "
            "without pool_unit_bytes): NaN." if unknown else "")


# ---------------------------------------------------------------------------
# Q6: simultaneous upper bounds (docs/paper_design.md section 3.4, AMBIGUOUS A4)
# ---------------------------------------------------------------------------


def upper_bound(d: np.ndarray, alpha: float, m: int) -> float:
    """Bonferroni one-sided paired-t upper bound of 100 (exp(mean d) - 1), level 1 - alpha/m."""
    n = len(d)
    if n < 2:
        return math.nan
    from scipy import stats as sps  # lazy: ~1 CPU s to import

    t = sps.t.ppf(1 - alpha / m, n - 1)
    return 100 * math.expm1(float(d.mean() + t * d.std(ddof=1) / math.sqrt(n)))


BOUND_AGAINST = ("preselected", "zero")  # what each f is bounded against (AMBIGUOUS A4)


def bound_members(spec: Mapping, preselected: Mapping | None = None,
                  against: str | None = None) -> list[dict]:
    """The declared members: per budget and organization each f of the grid against the
    organization's preselected f at that budget (`against: preselected`, `preselected`
    {budget: {org: f}}) or each f > 0 against f = 0 (`against: zero`), then D0/S2 at each
    common f > 0 per budget."""
    against = against or spec.get("against", "zero")
    if against not in BOUND_AGAINST:
        raise ValueError(f"simultaneous_upper_bounds.against={against!r}: allowed values are "
                         f"{BOUND_AGAINST}")
    grid = [float(f) for f in spec["f_grid"]]
    orgs, budgets = list(spec["orgs"]), list(spec["budgets"])
    members = []
    for budget in budgets:
        for org in orgs:
            if against == "zero":
                base = 0.0
            else:
                try:
                    base = float(preselected[budget][org])
                except (KeyError, TypeError) as exc:
                    raise ValueError(f"simultaneous_upper_bounds: no preselected f for {org} at "
                                     f"{budget} (preselected_f)") from exc
            members += [{"id": f"{org}_{budget}_f{f:g}_vs_f{base:g}", "budget": budget,
                         "org": org, "f": f, "against_f": base,
                         "treatment": (org, budget, f), "control": (org, budget, base)}
                        for f in grid if not math.isclose(f, base)]
        members += [{"id": f"D0_vs_S2_{budget}_f{f:g}", "budget": budget,
                     "treatment": ("D0", budget, f), "control": ("S2", budget, f)}
                    for f in grid if f > 0]
    return members


def simultaneous_bounds(runs: pd.DataFrame, spec: Mapping, metric: str = "throughput_span",
                        preselected: Mapping | None = None,
                        against: str | None = None) -> pd.DataFrame:
    """The upper bounds of every member over the runs (org, budget, f, stage, seed)."""
    members = bound_members(spec, preselected, against)
    m, alpha, margin = len(members), float(spec["alpha"]), float(spec["margin_pct"])
    rows = []
    for stage, part in runs.groupby("stage", sort=False):
        series = {(o, b, round(float(f), 6)): g.set_index("seed")[metric].astype(float)
                  for (o, b, f), g in part.groupby(["org", "budget", "f"])}
        for mem in members:
            t = series.get((*mem["treatment"][:2], round(mem["treatment"][2], 6)))
            c = series.get((*mem["control"][:2], round(mem["control"][2], 6)))
            row = {"stage": stage, "bound": mem["id"], "m": m}
            if t is not None and c is not None:
                pair = pd.concat([t.rename("t"), c.rename("c")], axis=1, join="inner").dropna()
                d = np.log(pair["t"].to_numpy()) - np.log(pair["c"].to_numpy())
                u = upper_bound(d, alpha, m)
                row.update(n=len(d), effect=100 * math.expm1(float(d.mean())) if len(d) else
                           math.nan, upper=u, excludes_margin=bool(u < margin)
                           if not math.isnan(u) else "")
            rows.append(row)
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------
# EXT-22 adoption scenarios (docs/statistics.md section 11; E.14, Tab. E-17)
# ---------------------------------------------------------------------------


def adoption_scenarios(family, plan_family, spec: Mapping) -> pd.DataFrame:
    """Scenario A (as adopted), B (complete case: the affected seed left out of the tests
    that use the affected cell, Holm over all tests) and C (affected tests not estimable,
    p = 1 for the correction), from an accepted family's per-seed test statistics."""
    table = family.tables.get(spec.get("estimand", "throughput_span"))
    per_seed = family.per_seed
    if table is None or table.empty or per_seed.empty:
        return pd.DataFrame()
    per_seed = per_seed[per_seed["estimand"] == spec.get("estimand", "throughput_span")]
    cell, seed = str(spec["cell"]), int(spec["seed"])
    affected = [t.id for t in plan_family.tests if cell in t.cells.values()]
    p_a = table["p_exact"].to_numpy(float)
    p_b, p_c, effect_b, n_b = p_a.copy(), p_a.copy(), table["effect"].to_numpy(float).copy(), \
        table["n"].to_numpy(float).copy()
    kinds = {t.id: t.kind for t in plan_family.tests}
    for i, test in enumerate(table["test"]):
        if test not in affected:
            continue
        d = per_seed[(per_seed["test"] == test) & (per_seed["seed"] != seed)]["d"].to_numpy()
        p_b[i] = stats.sign_flip_test(d).pvalue if len(d) else math.nan
        n_b[i] = len(d)
        effect_b[i] = (float(np.mean(100 * np.expm1(d))) if kinds[test] == "paired"
                       else math.nan)
        p_c[i] = 1.0
    out = pd.DataFrame({"test": table["test"], "affected": table["test"].isin(affected),
                        "n_A": table["n"], "p_holm_A": stats.holm(p_a), "n_B": n_b,
                        "effect_B": np.where(table["test"].isin(affected), effect_b,
                                             table["effect"]),
                        "p_holm_B": stats.holm(p_b), "p_holm_C": stats.holm(p_c)})
    return out

