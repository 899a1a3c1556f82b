"""Paired-by-seed comparisons of run-level readouts (docs/statistics.md sections 2, 3).

Seeds are the independent repeats. A log-scale readout (throughput, latency,
input work) compares by per-seed log ratios d = ln(T/C), shown as
100 (exp(mean d) - 1) % with the back-transformed paired-t interval; counts,
gauges and depths compare by per-seed differences in their own unit. Every
comparison carries its sign counts and the exact two-sided sign-flip p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.inference import stats
from analysis.metrics import DESIGN_COLUMNS, METRICS, ORG_SETTINGS, budget_rank

CONFIDENCE = 0.95

def seed_values(runs: pd.DataFrame, cell: str, metric: str) -> pd.Series:
    """metric by seed for one cell (seeds unique: one adopted run per cell and seed)."""
    group = runs[runs["cell"] == cell]
    assert not group["seed"].duplicated().any(), f"cell {cell}: duplicated seeds"  # RunSet
    return group.set_index("seed")[metric].astype(float).sort_index()


def compare(treatment: pd.Series, control: pd.Series, metric: str) -> tuple[dict, pd.Series]:
    """Paired effect of treatment vs control on their common seeds.

    log scale: d(s) = ln(T/C), effect 100 (exp(mean d) - 1) %, paired-t 95% interval
    back-transformed, plus the display mean of seedwise changes; diff scale:
    d(s) = T - C in the metric's unit. Sign counts and the exact sign-flip p on d.
    """
    joined = pd.concat([treatment.rename("t"), control.rename("c")], axis=1, join="inner").dropna()
    scale = METRICS[metric].scale
    if scale == "log" and ((joined["t"] <= 0) | (joined["c"] <= 0)).any():
        bad = joined.index[(joined["t"] <= 0) | (joined["c"] <= 0)].tolist()
        return _empty_row(len(joined), f"nonpositive values for seeds {bad}"), pd.Series(
            dtype=float)
    d = (np.log(joined["t"]) - np.log(joined["c"])) if scale == "log" else joined["t"] - joined["c"]
    return summarize_d(d.to_numpy(), scale, joined), d


def _empty_row(n: int, note: str) -> dict:
    return {"n": n, "effect": math.nan, "ci_low": math.nan, "ci_high": math.nan,
            "display_mean_pct": math.nan, "n_pos": 0, "n_neg": 0, "n_zero": 0,
            "p_exact": math.nan, "note": note}


def summarize_d(d: np.ndarray, scale: str, joined: pd.DataFrame | None = None) -> dict:
    """Effect, 95% paired-t interval, sign counts and exact sign-flip p of per-seed d."""
    if d.size == 0:
        return _empty_row(0, "no paired seeds")
    row = _empty_row(int(d.size), "")
    row.update(n_pos=int((d > 0).sum()), n_neg=int((d < 0).sum()), n_zero=int((d == 0).sum()),
               p_exact=stats.sign_flip_test(d).pvalue)
    if scale == "log":
        row["effect"] = stats.effect_pct(d)
        if joined is not None:
            row["display_mean_pct"] = stats.display_mean_pct(joined["t"], joined["c"]).value_pct
        if d.size >= 2:
            interval = stats.paired_t_interval(d, CONFIDENCE)
            row.update(ci_low=interval.low_pct, ci_high=interval.high_pct)
    else:
        row["effect"] = float(d.mean())
        if d.size >= 2:
            low, high = diff_interval(d, CONFIDENCE)
            row.update(ci_low=low, ci_high=high)
    if d.size < 2:
        row["note"] = "n < 2: no interval"
    return row


def diff_interval(d: np.ndarray, confidence: float) -> tuple[float, float]:
    """Paired-t interval of mean d on the metric's own scale (df = n - 1)."""
    mean = float(d.mean())
    from scipy import stats as scipy_stats  # lazy: ~1 CPU s to import

    half = float(scipy_stats.t.ppf(0.5 + confidence / 2, d.size - 1)
                 * d.std(ddof=1) / math.sqrt(d.size))
    return mean - half, mean + half


def paired_changes(
    runs: pd.DataFrame,
    metric: str,
    pairs: Sequence[tuple],
    vary: str = "org",
    ignore: Sequence[str] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Paired changes treatment vs control of `vary` within each condition of the other columns.

    `pairs` are (treatment, control) values of `vary` (e.g. ("S1", "S0")); `ignore`
    (default: the org-specific settings when orgs are compared) leaves columns out of
    the condition. Returns a
    table (one row per treatment cell x control cell in a condition) and the per-seed
    d values (columns comparison, seed, d) for figures.
    """
    rows, per_seed = [], []
    if runs.empty:
        return pd.DataFrame(rows), pd.DataFrame(columns=["comparison", "seed", "d"])
    if ignore is None:
        ignore = ORG_SETTINGS if vary == "org" else ()
    keys = [c for c in DESIGN_COLUMNS if c not in (vary, *ignore)]
    unit = "%" if METRICS[metric].scale == "log" else METRICS[metric].unit
    for condition, group in runs.groupby(keys, dropna=False, sort=False):
        for treat_value, control_value in pairs:
            treat_cells = _cells_with(group, vary, treat_value)
            control_cells = _cells_with(group, vary, control_value)
            for t_cell in treat_cells:
                for c_cell in control_cells:
                    row, d = compare(seed_values(runs, t_cell, metric),
                                     seed_values(runs, c_cell, metric), metric)
                    name = comparison_name(t_cell, c_cell, vary)
                    rows.append({"comparison": name, "treatment": t_cell, "control": c_cell,
                                 **dict(zip(keys, condition, strict=True)),
                                 "metric": metric, "unit": unit, **row})
                    per_seed += [{"comparison": name, "seed": int(s), "d": float(v)}
                                 for s, v in d.items()]
    table = pd.DataFrame(rows)
    if not table.empty:  # budgets by size, then the numeric conditions ascending
        table["_b"] = table["budget"].map(budget_rank) if "budget" in table else 0
        order = ["_b", *(c for c in ("cap", "rate", "q", "f") if c in table)]
        table = table.sort_values(order, kind="stable").drop(columns="_b").reset_index(drop=True)
    return table, pd.DataFrame(per_seed, columns=["comparison", "seed", "d"])


def comparison_name(t_cell: str, c_cell: str, vary: str) -> str:
    """"S1 vs S0 @ b63 rate 3" when two org cells share their condition, else both labels."""
    t_org, _, t_rest = t_cell.partition(" ")
    c_org, _, c_rest = c_cell.partition(" ")
    if vary == "org" and t_rest == c_rest:
        return f"{t_org} vs {c_org}" + (f" @ {t_rest}" if t_rest else "")
    return f"{t_cell} vs {c_cell}"


def _cells_with(group: pd.DataFrame, column: str, value) -> list[str]:
    if isinstance(value, float):
        mask = np.isclose(group[column].astype(float), value)
    else:
        mask = group[column] == value
    return sorted(set(group.loc[mask, "cell"]))
