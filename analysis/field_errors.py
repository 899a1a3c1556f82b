"""Simulator error in the field's format: per metric over cells, the mean absolute
percentage error (MAPE), its median and maximum, Kendall's tau and the cell pairs ordered
alike; per design factor, the pairwise order agreement. One arithmetic for every page that
compares a simulator against a reference (fidelity_field.md, n0_vllm.md).

A run frame holds `arm` ('ref' or 'sim'), the cell keys, `seed` and METRICS; a cell is the
mean over its seeds, compared only where both arms ran it. A one-token request's TPOT
is NaN and left out of the TPOT median (DuckDB would sort NaN above every value).
"""

from __future__ import annotations

import math
from itertools import combinations

import numpy as np
import pandas as pd

from analysis.pages import common
from analysis.pages.render import md_table

METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50", "throughput_span", "hit_tokens",
           "preemptions")
ORDER_METRICS = ("throughput_span", "ttft_p50", "hit_tokens")

_PER_RUN = """
    WITH q AS (
        SELECT run_id,
               quantile_cont(ttft_s, 0.5) AS ttft_p50, quantile_cont(ttft_s, 0.99) AS ttft_p99,
               quantile_cont(tpot_s, 0.5) FILTER (WHERE NOT isnan(tpot_s)) AS tpot_p50,
               quantile_cont(e2e_s, 0.5) AS e2e_p50,
               sum(greatest(adopted_prefix_tokens, 0)) AS hit_tokens,
               sum(preemptions) AS preemptions
        FROM requests WHERE status = 'finished' AND campaign IN ({marks}) GROUP BY run_id)
    SELECT r.run_id, r.campaign, r.executor, r.engine_config, r.org, r.model, r.budget,
           r.rate, r.seed, r.created_at, r.throughput_span, q.* EXCLUDE (run_id)
    FROM runs r JOIN q USING (run_id)
    WHERE r.campaign IN ({marks}) AND r.status = 'complete' AND r.adopted
"""


def per_run(con, campaigns: tuple[str, ...]) -> pd.DataFrame:
    """One row per adopted complete run of the campaigns with the compared metrics."""
    marks = ", ".join("?" * len(campaigns))
    return con.execute(_PER_RUN.format(marks=marks), [*campaigns, *campaigns]).df()


def cells(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per cell present in both arms: seeds and each metric's mean over seeds, per arm."""
    if runs.empty or set(runs["arm"]) != {"ref", "sim"}:
        return pd.DataFrame(columns=[*keys, "seeds_ref", "seeds_sim"])
    means = runs.groupby(["arm", *keys])[list(METRICS)].mean()
    seeds = runs.groupby(["arm", *keys])["seed"].nunique().rename("seeds")
    wide = pd.concat([means, seeds], axis=1).unstack("arm")
    wide.columns = [f"{m}_{arm}" for m, arm in wide.columns]
    both = wide.dropna(subset=["seeds_ref", "seeds_sim"]).reset_index()
    order = both["budget"].map(common.budget_rank)
    by = ["_o" if k == "budget" else k for k in keys]
    return both.assign(_o=order).sort_values(by).drop(columns="_o").reset_index(drop=True)


def _ape(ref: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """|sim - ref| / |ref| in %; NaN where ref is 0 (0 when both are)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ape = 100 * np.abs(sim - ref) / np.abs(ref)
    return np.where((ref == 0) & (sim == 0), 0.0, np.where(ref == 0, np.nan, ape))


def _alike(ref: np.ndarray, sim: np.ndarray) -> tuple[int, int]:
    """(cell pairs the simulator orders as the reference does, cell pairs); a tie is alike
    only when both tie."""
    pairs = list(combinations(range(len(ref)), 2))
    alike = sum(int(np.sign(ref[j] - ref[i]) == np.sign(sim[j] - sim[i])) for i, j in pairs)
    return alike, len(pairs)


def _metric_row(m: str, ref: np.ndarray, sim: np.ndarray) -> dict:
    """One metric's errors over the cells."""
    from scipy.stats import kendalltau

    ape = _ape(ref, sim)
    finite = ape[np.isfinite(ape)]
    tau = (float(kendalltau(ref, sim).statistic) if len(ref) > 2
           and np.ptp(ref) > 0 and np.ptp(sim) > 0 else math.nan)
    alike, pairs = _alike(ref, sim)
    some = len(finite) > 0
    return {"metric": m, "cells": len(ref), "cells_with_ape": len(finite),
            "mape_pct": finite.mean() if some else math.nan,
            "median_ape_pct": np.median(finite) if some else math.nan,
            "max_ape_pct": finite.max() if some else math.nan,
            "mean_abs_diff": float(np.mean(np.abs(sim - ref))) if len(ref) else math.nan,
            "kendall_tau": tau, "pairs": pairs, "pairs_alike": alike}


def errors(table: pd.DataFrame) -> pd.DataFrame:
    """Per metric: cells, MAPE, median and max APE (cells with a nonzero reference), mean
    absolute difference, Kendall's tau and the cell pairs ordered alike across cells."""
    return pd.DataFrame([_metric_row(m, table[f"{m}_ref"].to_numpy(float),
                                     table[f"{m}_sim"].to_numpy(float)) for m in METRICS])


def order_agreement(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per factor and metric: of the cell pairs differing in that factor only, how many
    the simulator orders as the reference does."""
    rows = []
    for factor in keys:
        others = [k for k in keys if k != factor]
        groups = [g for _, g in table.groupby(others)] if others else [table]
        for m in ORDER_METRICS:
            counts = [_alike(g[f"{m}_ref"].to_numpy(float), g[f"{m}_sim"].to_numpy(float))
                      for g in groups]
            agree, pairs = sum(c[0] for c in counts), sum(c[1] for c in counts)
            if pairs:
                rows.append({"factor": factor, "metric": m, "pairs": pairs, "agree": agree,
                             "agreement_pct": 100 * agree / pairs})
    return pd.DataFrame(rows)


ERROR_NOTE = ("Per metric over the cells (each the mean over its seeds): mape_pct, "
              "median_ape_pct, max_ape_pct: the absolute percentage error of the simulator "
              "against the reference (cells with a nonzero reference; 0 against 0 is no "
              "error); kendall_tau and pairs_alike of pairs: does the simulator order the "
              "cells as the reference does (a tie is alike only when both tie).")


def error_table(table: pd.DataFrame) -> tuple[str, dict]:
    """The errors' Markdown table (three decimals) and its summary: the one table every
    comparison page prints."""
    err = errors(table)
    info = {"cells": len(table),
            "mape_pct": {r.metric: round(float(r.mape_pct), 3) for r in err.itertuples()},
            "median_ape_pct": {r.metric: round(float(r.median_ape_pct), 3)
                               for r in err.itertuples()},
            "kendall_tau": {r.metric: round(float(r.kendall_tau), 3) for r in err.itertuples()}}
    return md_table(err.round(3), list(err.columns)), info
