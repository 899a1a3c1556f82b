"""Simulator fidelity in the field's format (campaigns fidelity_vllm, fidelity_real/_sim).

Two references, one format. (1) The simulator's N0 (calibrated A100 step model) against
vLLM 0.32's own Scheduler and hybrid KV cache manager on a virtual clock priced by the same
step model (campaign fidelity_vllm, executor=vllm_virtual): equal step time on both sides,
so every error is a rule error. (2) The simulator against our real torch executor on the
tiny model (`make fidelity`: campaigns fidelity_real and fidelity_sim, the newest fitted
profile). Per metric over the cells (each the mean over its seeds): the mean absolute
percentage error (MAPE), its median and maximum, and Kendall's tau between the simulator's
and the reference's cell values; per design factor, the pairwise order agreement: of the
pairs of cells that differ in that factor only, the share the simulator orders as the
reference does (a tie counts as agreement only when both tie).

`python -m analysis.questions.fidelity_field --ledgers ROOT` prints the page (last line:
JSON); `analysis.report` writes it as fidelity_field.md when either campaign has runs.
"""

from __future__ import annotations

import math
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import cli
from analysis.pages import common
from analysis.pages.render import md_table

PAGE = "fidelity_field.md"
TITLE = "Simulator fidelity in the field's format"
VIRTUAL, REAL, SIM = "fidelity_vllm", "fidelity_real", "fidelity_sim"
METRICS = ("ttft_p50", "ttft_p99", "tpot_p50", "e2e_p50", "throughput_span", "hit_tokens",
           "preemptions")
ORDER_METRICS = ("throughput_span", "ttft_p50", "hit_tokens")
FILL = {VIRTUAL: "make campaign C=fidelity_vllm (needs make setup-vllm)",
        REAL: "make fidelity"}
PEERS = ("Peers, as issue 42 cites them: BLIS reports about 10 % median error; Vidur is far "
         "worse on TTFT; neither models hybrid (attention + state-space) state, which every "
         "cell here holds.")

_PER_RUN = """
    WITH q AS (
        SELECT run_id,
               quantile_cont(ttft_s, 0.5) AS ttft_p50, quantile_cont(ttft_s, 0.99) AS ttft_p99,
               quantile_cont(tpot_s, 0.5) AS tpot_p50, quantile_cont(e2e_s, 0.5) AS e2e_p50,
               sum(greatest(adopted_prefix_tokens, 0)) AS hit_tokens,
               sum(preemptions) AS preemptions
        FROM requests WHERE status = 'finished' AND campaign IN ({marks}) GROUP BY run_id)
    SELECT r.run_id, r.campaign, r.executor, r.org, r.model, r.budget, r.rate, r.seed,
           r.created_at, r.throughput_span, q.* EXCLUDE (run_id)
    FROM runs r JOIN q USING (run_id)
    WHERE r.campaign IN ({marks}) AND r.status = 'complete' AND r.adopted
"""


def per_run(con, campaigns: tuple[str, ...]) -> pd.DataFrame:
    """One row per adopted complete run of the campaigns with the compared metrics."""
    marks = ", ".join("?" * len(campaigns))
    return con.execute(_PER_RUN.format(marks=marks), [*campaigns, *campaigns]).df()


def virtual_runs(con) -> pd.DataFrame:
    """fidelity_vllm: arm vllm (executor vllm_virtual) or sim; cells model x budget x load."""
    runs = per_run(con, (VIRTUAL,))
    runs["arm"] = np.where(runs["executor"].str.startswith("vllm_virtual"), "ref", "sim")
    return runs


def real_runs(con) -> pd.DataFrame:
    """fidelity_real (ref) and fidelity_sim (sim, its newest profile only); cells org x
    budget."""
    runs = per_run(con, (REAL, SIM)).sort_values(["created_at", "run_id"], kind="stable")
    sim = runs[runs["campaign"] == SIM]
    if len(sim):
        runs = runs[(runs["campaign"] == REAL) | (runs["executor"] == sim["executor"].iloc[-1])]
    runs = runs.assign(arm=np.where(runs["campaign"] == REAL, "ref", "sim"))
    return runs.drop_duplicates(["arm", "org", "budget", "seed"], keep="first")


def cells(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per cell present in both arms: seeds and each metric's mean over seeds, per arm."""
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


def errors(table: pd.DataFrame) -> pd.DataFrame:
    """Per metric: cells, MAPE, median and max APE (cells with a nonzero reference), mean
    absolute difference, Kendall's tau across cells."""
    from scipy.stats import kendalltau

    rows = []
    for m in METRICS:
        ref, sim = table[f"{m}_ref"].to_numpy(float), table[f"{m}_sim"].to_numpy(float)
        ape = _ape(ref, sim)
        finite = ape[np.isfinite(ape)]
        tau = (float(kendalltau(ref, sim).statistic) if len(ref) > 2
               and np.ptp(ref) > 0 and np.ptp(sim) > 0 else math.nan)
        rows.append({"metric": m, "cells": len(ref), "cells_with_ape": len(finite),
                     "mape_pct": finite.mean() if len(finite) else math.nan,
                     "median_ape_pct": np.median(finite) if len(finite) else math.nan,
                     "max_ape_pct": finite.max() if len(finite) else math.nan,
                     "mean_abs_diff": float(np.mean(np.abs(sim - ref))) if len(ref) else
                     math.nan, "kendall_tau": tau})
    return pd.DataFrame(rows)


def order_agreement(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per factor and metric: of the cell pairs differing in that factor only, how many
    the simulator orders as the reference does."""
    rows = []
    for factor in keys:
        others = [k for k in keys if k != factor]
        groups = table.groupby(others) if others else [((), table)]
        for m in ORDER_METRICS:
            agree = pairs = 0
            for _, group in groups:
                for (_, a), (_, b) in combinations(group.iterrows(), 2):
                    pairs += 1
                    agree += int(np.sign(b[f"{m}_ref"] - a[f"{m}_ref"])
                                 == np.sign(b[f"{m}_sim"] - a[f"{m}_sim"]))
            if pairs:
                rows.append({"factor": factor, "metric": m, "pairs": pairs, "agree": agree,
                             "agreement_pct": 100 * agree / pairs})
    return pd.DataFrame(rows)


def _section(title: str, note: str, table: pd.DataFrame, keys: list[str]) -> tuple[list, dict]:
    """Markdown lines and a summary for one comparison."""
    err, order = errors(table), order_agreement(table, keys)
    shown = [*keys, "seeds_ref", "seeds_sim",
             *(f"{m}_{arm}" for m in ("throughput_span", "ttft_p50", "hit_tokens",
                                       "preemptions") for arm in ("ref", "sim"))]
    lines = [f"## {title}", "", note, "", "### Error per metric", "",
             md_table(err, list(err.columns)), "", "### Ranking agreement", "",
             md_table(order, list(order.columns)) if len(order) else "(one cell per factor)",
             "", "### Cells (mean over seeds)", "", md_table(table, shown), ""]
    info = {"cells": len(table),
            "mape_pct": {r.metric: round(float(r.mape_pct), 3) for r in err.itertuples()},
            "kendall_tau": {r.metric: round(float(r.kendall_tau), 3) for r in err.itertuples()},
            "order_agreement_pct": {f"{r.factor}:{r.metric}": round(float(r.agreement_pct), 1)
                                    for r in order.itertuples()}}
    return lines, info


VIRTUAL_NOTE = ("Reference: vLLM 0.32's Scheduler and KV cache manager (executor=vllm_virtual, "
                "retention at every block boundary, what N0 models); simulator: N0. Both priced "
                "by the calibrated A100 step model, so these errors are rule errors only.")
REAL_NOTE = ("Reference: our torch executor on the tiny model over HTTP (fidelity_real); "
             "simulator: the same cells under the profile fitted to those runs' steps "
             "(fidelity_sim). Errors mix rule and step-time error.")


def section(con) -> tuple[str, dict]:
    """The page's text and its JSON summary."""
    lines, info = [f"# {TITLE}", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
                   PEERS, ""], {}
    for name, runs_of, keys, title, note in (
            (VIRTUAL, virtual_runs, ["model", "budget", "rate"], "Simulator vs vLLM-virtual",
             VIRTUAL_NOTE),
            (REAL, real_runs, ["org", "budget"], "Simulator vs our real executor", REAL_NOTE)):
        runs = runs_of(con)
        table = cells(runs, keys) if set(runs.get("arm", ())) == {"ref", "sim"} else None
        if table is None or table.empty:
            lines += [f"## {title}", "", f"No paired cells yet: `{FILL[name]}`.", ""]
            info[name] = {"cells": 0}
            continue
        part, info[name] = _section(title, note, table, keys)
        lines += part
    return "\n".join(lines), info


def write_page(con, out: Path) -> tuple[Path, dict] | None:
    """Write fidelity_field.md when either reference has runs."""
    if per_run(con, (VIRTUAL, REAL)).empty:
        return None
    return cli.write_section(con, out, PAGE, section)


def main(argv: list[str] | None = None) -> int:
    return cli.section_main("analysis.questions.fidelity_field", __doc__, section,
                            lambda info: any(v["cells"] for v in info.values()), argv)


if __name__ == "__main__":
    sys.exit(main())
