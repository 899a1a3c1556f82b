"""Simulator versus real (make fidelity): the same cells on the real executor and simulated.

Reads campaigns fidelity_real (executor=torch over HTTP) and fidelity_sim (the simulator
under the step profile experiments.studies.fidelity fitted to the real runs' steps ledgers); of
each, the adopted complete runs of its newest executor label (a refit gives the simulated
runs a new profile name). Per cell (organization x budget): the mean over seeds of
request-span and ledger throughput, TTFT and E2E p99, preemptions and C_once from both,
with the simulator's relative error (preemptions: the difference). Per budget: the paired
effects of each organization against S0 and of D0 against S2 (mean seedwise percent
change, 95 % paired-t interval of the log ratio) from both, with their difference in
percentage points, and the ranking of organizations by span throughput from both.

`python -m analysis.studies.fidelity --ledgers ROOT [--out DIR]` prints the tables; its last line
is JSON. `analysis.report` writes the page as fidelity.md when the campaigns have runs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import cli
from analysis.inference import stats
from analysis.pages import common
from analysis.pages.render import md_table

REAL, SIM = "fidelity_real", "fidelity_sim"
PAGE = "fidelity.md"
TITLE = "Simulator versus real"
TABLES = ("fidelity_fit",)  # the fit; the runs are campaigns fidelity_real, fidelity_sim
FIGURE = "figures/fidelity_throughput.png"
CELL_METRICS = ("throughput_span", "throughput_ledger", "ttft_p99", "e2e_p99", "preemptions",
                "c_once_tokens")
DIFF_METRICS = ("preemptions",)  # compared by difference (zero in both is common)
EFFECT_METRICS = ("throughput_span", "e2e_p99")
CONTRASTS = (("S1", "S0"), ("S2", "S0"), ("D0", "S0"), ("D0", "S2"))
RANK_METRIC = "throughput_span"
FILL = ("make fidelity (python -m experiments.studies.fidelity, then "
        "python -m analysis.studies.fidelity)")


def load(con, question: str) -> pd.DataFrame:
    """Adopted complete runs of one half, its newest executor label only, one per cell+seed."""
    runs = common.load_runs(con, [question]).all_runs
    if runs.empty:
        return runs
    runs = runs.sort_values(["created_at", "run_id"], kind="stable")
    runs = runs[runs["executor"] == runs["executor"].iloc[-1]]
    return runs.drop_duplicates(["org", "budget", "seed"], keep="first").reset_index(drop=True)


def _budgets(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["budget"].unique(), key=common.budget_rank)


def _orgs(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["org"].unique(), key=common.org_rank)


def cell_table(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """Per (budget, org): seeds and per metric the real mean, simulated mean and error."""
    rows = []
    both = pd.concat([real, sim])
    for budget in _budgets(both):
        for org in _orgs(both):
            r = real[(real["budget"] == budget) & (real["org"] == org)]
            s = sim[(sim["budget"] == budget) & (sim["org"] == org)]
            if r.empty and s.empty:
                continue
            row = {"budget": budget, "org": common.ORG_NAMES.get(org, org),
                   "seeds_real": len(r), "seeds_sim": len(s)}
            for m in CELL_METRICS:
                rv = float(pd.to_numeric(r[m], errors="coerce").mean()) if len(r) else math.nan
                sv = float(pd.to_numeric(s[m], errors="coerce").mean()) if len(s) else math.nan
                row[f"{m}_real"], row[f"{m}_sim"] = rv, sv
                if m in DIFF_METRICS:
                    row[f"{m}_diff"] = sv - rv
                else:
                    row[f"{m}_err_pct"] = 100.0 * (sv / rv - 1.0) if rv else math.nan
            rows.append(row)
    return pd.DataFrame(rows)


def _paired(frame: pd.DataFrame, budget: str, t: str, c: str, metric: str):
    """Seed-paired values of treatment and control organizations at one budget."""
    sub = frame[frame["budget"] == budget]
    a = sub[sub["org"] == t].set_index("seed")[metric]
    b = sub[sub["org"] == c].set_index("seed")[metric]
    joined = pd.concat([a.rename("t"), b.rename("c")], axis=1).dropna()
    joined = joined[(joined["t"] > 0) & (joined["c"] > 0)]
    return joined["t"].to_numpy(float), joined["c"].to_numpy(float)


def _effect(frame: pd.DataFrame, budget: str, t: str, c: str, metric: str) -> dict:
    a, b = _paired(frame, budget, t, c, metric)
    if a.size == 0:
        return {"n": 0, "pct": math.nan, "low": math.nan, "high": math.nan}
    out = {"n": int(a.size), "pct": stats.display_mean_pct(a, b).value_pct,
           "low": math.nan, "high": math.nan}
    if a.size >= 2:
        ci = stats.paired_t_interval(stats.log_ratios(a, b))
        out["low"], out["high"] = ci.low_pct, ci.high_pct
    return out


def effect_table(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """Per budget, contrast and metric: the paired effect from both executors."""
    rows = []
    for budget in _budgets(pd.concat([real, sim])):
        for t, c in CONTRASTS:
            for metric in EFFECT_METRICS:
                er, es = (_effect(f, budget, t, c, metric) for f in (real, sim))
                if er["n"] == 0 and es["n"] == 0:
                    continue
                same = (not math.isnan(er["pct"]) and not math.isnan(es["pct"])
                        and np.sign(er["pct"]) == np.sign(es["pct"]))
                rows.append({
                    "budget": budget, "contrast": f"{t} vs {c}", "metric": metric,
                    "n_real": er["n"], "real_pct": er["pct"], "real_low": er["low"],
                    "real_high": er["high"], "n_sim": es["n"], "sim_pct": es["pct"],
                    "sim_low": es["low"], "sim_high": es["high"],
                    "diff_pp": es["pct"] - er["pct"], "same_sign": bool(same),
                    "sim_in_real_ci": bool(er["low"] <= es["pct"] <= er["high"])})
    return pd.DataFrame(rows)


def rankings(real: pd.DataFrame, sim: pd.DataFrame, metric: str = RANK_METRIC) -> pd.DataFrame:
    """Per budget: organizations ordered by mean `metric` (best first) from both executors."""
    from scipy.stats import kendalltau

    rows = []
    for budget in _budgets(pd.concat([real, sim])):
        means = {}
        for name, frame in (("real", real), ("sim", sim)):
            sub = frame[frame["budget"] == budget]
            means[name] = sub.groupby("org")[metric].mean()
        orgs = sorted(set(means["real"].index) & set(means["sim"].index), key=common.org_rank)
        if not orgs:
            continue
        text = {k: _order_text(means[k], orgs) for k in means}
        tau = (float(kendalltau([means["real"][o] for o in orgs],
                                [means["sim"][o] for o in orgs]).statistic)
               if len(orgs) > 2 else math.nan)
        separated, wrong = separated_pairs(real, sim, budget, orgs, metric)
        # Agreement needs one strict order from both; a tie in either is not agreement.
        rows.append({"budget": budget, "real": text["real"], "sim": text["sim"],
                     "agree": text["real"] == text["sim"] and "=" not in text["real"],
                     "kendall_tau": tau, "separated": ", ".join(separated) or "none",
                     "separated_agree": not wrong,
                     "separated_wrong": ", ".join(wrong) or "none"})
    return pd.DataFrame(rows)


def separated_pairs(real: pd.DataFrame, sim: pd.DataFrame, budget: str, orgs: list[str],
                    metric: str) -> tuple[list[str], list[str]]:
    """The organization pairs whose real paired 95 % interval (seed-paired log ratio of
    `metric`) excludes 0, as 'A > B', and those of them the simulation orders otherwise: the
    ranking the real runs can tell apart, and where the simulator gets it wrong."""
    separated, wrong = [], []
    for i, a in enumerate(orgs):
        for b in orgs[i + 1:]:
            er = _effect(real, budget, a, b, metric)
            if er["n"] < 2 or not (er["low"] > 0 or er["high"] < 0):
                continue
            hi, lo = (a, b) if er["low"] > 0 else (b, a)
            pair = f"{common.ORG_NAMES.get(hi, hi)} > {common.ORG_NAMES.get(lo, lo)}"
            separated.append(pair)
            s_hi = sim[(sim["budget"] == budget) & (sim["org"] == hi)][metric].mean()
            s_lo = sim[(sim["budget"] == budget) & (sim["org"] == lo)][metric].mean()
            if not s_hi > s_lo:
                wrong.append(pair)
    return separated, wrong


def _order_text(means: pd.Series, orgs: list[str]) -> str:
    """Organizations best first; equal means (to 1e-9 relative) joined by '='."""
    ranked = sorted(orgs, key=lambda o: (-means[o], common.org_rank(o)))
    parts = [ranked[0]]
    for prev, org in zip(ranked, ranked[1:], strict=False):
        tie = math.isclose(means[prev], means[org], rel_tol=1e-9, abs_tol=0.0)
        parts.append(("= " if tie else "> ") + org)
    return " ".join(parts)


def summary(cells: pd.DataFrame, effects: pd.DataFrame, ranks: pd.DataFrame) -> dict:
    """The figures the closing line reports."""
    err = cells["throughput_span_err_pct"].abs() if not cells.empty else pd.Series(dtype=float)
    thr = effects[effects["metric"] == RANK_METRIC] if not effects.empty else effects
    return {
        "cells": int(len(cells)),
        "throughput_span_abs_err_pct_median": float(err.median()) if len(err) else None,
        "throughput_span_abs_err_pct_max": float(err.max()) if len(err) else None,
        "throughput_effects": int(len(thr)),
        "throughput_effects_same_sign": int(thr["same_sign"].sum()) if len(thr) else 0,
        "ranking_agrees": {r.budget: bool(r.agree) for r in ranks.itertuples()},
        "separated_ranking_agrees": {r.budget: bool(r.separated_agree)
                                     for r in ranks.itertuples()},
    }


TOLERANCE_PCT = 10.0  # a cell's span-throughput error the findings call within reach


def findings(cells: pd.DataFrame, ranks: pd.DataFrame) -> list[str]:
    """The comparison in plain words: how many cells are within TOLERANCE_PCT and which
    are not, and per budget which orderings the real runs can tell apart and whether the
    simulator orders them so."""
    out = []
    err = cells.dropna(subset=["throughput_span_err_pct"])
    if len(err):
        far = err[err["throughput_span_err_pct"].abs() > TOLERANCE_PCT]
        worst = err.loc[err["throughput_span_err_pct"].abs().idxmax()]
        text = (f"Span throughput: the simulator is within {TOLERANCE_PCT:g} % of the real runs "
                f"in {len(err) - len(far)} of {len(err)} cells; the largest error is "
                f"{worst['throughput_span_err_pct']:+.1f} % ({worst['org']} at "
                f"{worst['budget']}).")
        if len(far):
            text += " Beyond it: " + ", ".join(
                f"{r.org} {r.budget} {r.throughput_span_err_pct:+.1f} %"
                for r in far.itertuples()) + "."
        out.append(text)
    for r in ranks.itertuples():
        if r.separated == "none":
            out.append(f"At {r.budget} the real runs' 95 % intervals separate no pair of "
                       f"organizations (real order {r.real}, simulated {r.sim}): the real "
                       "order there is within the noise, so it does not check the simulator.")
        elif r.separated_agree:
            out.append(f"At {r.budget} the real runs separate {r.separated}; the simulator "
                       f"orders every one of these pairs the same way (real order {r.real}, "
                       f"simulated {r.sim}).")
        else:
            out.append(f"At {r.budget} the real runs separate {r.separated}; the simulator "
                       f"orders {r.separated_wrong} otherwise (real order {r.real}, "
                       f"simulated {r.sim}).")
    return out


def draw(real: pd.DataFrame, sim: pd.DataFrame, path: Path) -> Path | None:
    """Span throughput per organization within each budget: real vs simulated bars + seeds."""
    from matplotlib.patches import Patch

    from analysis.pages import figures

    if real.empty or sim.empty:
        return None
    budgets = _budgets(pd.concat([real, sim]))
    orgs = _orgs(pd.concat([real, sim]))
    fig, axes = figures.plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 4.2),
                                     squeeze=False)
    rng = np.random.default_rng(0)
    for ax, budget in zip(axes[0], budgets, strict=True):
        for i, org in enumerate(orgs):
            for k, (frame, hatch) in enumerate(((real, ""), (sim, "//"))):
                vals = frame[(frame["budget"] == budget) & (frame["org"] == org)][RANK_METRIC]
                vals = vals.astype(float).dropna()
                x = i + (k - 0.5) * 0.38
                ax.bar(x, vals.mean() if len(vals) else 0.0, width=0.36, hatch=hatch,
                       color=figures._color(org), alpha=0.8, edgecolor="black", linewidth=0.5)
                ax.scatter(x + rng.uniform(-0.08, 0.08, len(vals)), vals, s=10, color="black",
                           zorder=3)
        ax.set_xticks(range(len(orgs)))
        ax.set_xticklabels([common.ORG_NAMES.get(o, o) for o in orgs], rotation=0)
        n = int(real[real["budget"] == budget]["seed"].nunique())
        ax.set_title(f"{budget}: n = {n} seeds per bar", fontsize=9)
        ax.set_ylabel("request-span throughput (output tokens/s)")
        handles = [Patch(facecolor="white", edgecolor="black", hatch=h, label=n)
                   for n, h in (("real", ""), ("simulated", "//"))]
        ax.legend(handles=handles, title="bars: mean; dots: seeds", fontsize=7,
                  title_fontsize=7)
    model = str(real["model"].iloc[0])
    fig.suptitle(f"Real ({real['executor'].iloc[0]}) vs simulated ({sim['executor'].iloc[0]}), "
                 f"{model}, rate {real['rate'].iloc[0]:g}/s, cap {int(real['cap'].iloc[0])}",
                 fontsize=9)
    return figures._save(fig, path)


def _fmt(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype.kind == "f":
            out[col] = out[col].map(lambda v: "" if pd.isna(v) else f"{v:,.3g}"
                                    if abs(v) < 100 else f"{v:,.0f}")
    return out


def section(real: pd.DataFrame, sim: pd.DataFrame) -> tuple[str, dict, dict]:
    """Markdown of the comparison, the closing-line summary and the tables."""
    lines = ["# Simulator versus real (fidelity_real, fidelity_sim)", ""]
    if real.empty or sim.empty:
        missing = " and ".join(n for n, f in ((REAL, real), (SIM, sim)) if f.empty)
        lines.append(f"No complete runs in {missing}; `{FILL}` fills them.")
        return "\n".join(lines) + "\n", {"cells": 0}, {}
    cells, effects, ranks = cell_table(real, sim), effect_table(real, sim), rankings(real, sim)
    info = summary(cells, effects, ranks)
    lines += [
        f"Real: executor `{real['executor'].iloc[0]}`, {len(real)} runs; simulated: "
        f"`{sim['executor'].iloc[0]}`, {len(sim)} runs (the profile fitted to the real runs' "
        f"steps ledgers by experiments.studies.fidelity). Model {real['model'].iloc[0]}, "
        f"{int(real['completed_requests'].max())} requests per run, rate "
        f"{real['rate'].iloc[0]:g}/s, cap {int(real['cap'].iloc[0])}, seeds "
        f"{common.seeds_text(sorted(real['seed'].unique()))}.", "",
        "## Cells", "",
        "Mean over seeds; throughput in output tokens/s, latencies in s, preemptions per run, "
        "C_once in tokens; err_pct = 100 (sim / real - 1); preemptions as the difference.", "",
        md_table(_fmt(cells)), "",
        "## Paired effects", "",
        "Mean seedwise percent change (treatment vs control, paired by seed) and the 95 % "
        "paired-t interval of the log ratio, from each executor; diff_pp = sim - real.", "",
        md_table(_fmt(effects)), "",
        f"## Ranking by {RANK_METRIC}", "",
        "`separated`: the pairs whose real 95 % paired interval excludes 0 (what the real "
        "runs can order); `separated_agree`: the simulator orders every one of them so.", "",
        md_table(_fmt(ranks)), "",
        f"Span-throughput error per cell: median |err| "
        f"{info['throughput_span_abs_err_pct_median']:.1f} %, max "
        f"{info['throughput_span_abs_err_pct_max']:.1f} %; throughput effects with the same "
        f"sign: {info['throughput_effects_same_sign']} of {info['throughput_effects']}.", "",
        "## Findings", "", *(f"- {line}" for line in findings(cells, ranks)), ""]
    return "\n".join(lines), info, {"cells": cells, "effects": effects, "rankings": ranks}


def fit_section(fit: pd.DataFrame) -> str:
    """The newest fit (`fidelity_fit` study table): what the simulated half ran, and its
    residuals."""
    if fit.empty:
        return ""
    head = fit.iloc[0]
    errors = json.loads(head["org_errors"])
    return "\n".join([
        "## Fitted step profile", "",
        f"Fit {head['study_id']}: profile `{head['profile']}` from `{head['start']}`, "
        f"{int(head['rows'])} steps of {len(json.loads(head['runs']))} real runs; rms "
        f"relative step error {head['rms_rel_error']:.3f}; summed step time error by "
        "organization " + ", ".join(f"{o} {v:+.1%}" for o, v in errors.items()) + ".", "",
        md_table(fit, ["parameter", "value"]), ""])


def write_page(con, out: Path) -> tuple[Path, dict] | None:
    """Write fidelity.md, its CSVs and figure when either campaign has runs."""
    real, sim = load(con, REAL), load(con, SIM)
    if real.empty and sim.empty:
        return None
    text, info, tables = section(real, sim)
    text += "\n" + fit_section(common.latest_study(con, TABLES[0]))
    common.write_tables(out, "fidelity", tables)
    fig = draw(real, sim, out / FIGURE)
    if fig is not None:
        text += (f"\n![Span throughput, real vs simulated]({FIGURE})\n\n"
                 "Figure: bars are means over seeds, dots single seeds; hatched bars "
                 "simulated.\n")
    path = out / PAGE
    path.write_text(text, encoding="utf-8")
    return path, info


def main(argv: list[str] | None = None) -> int:
    def empty(args) -> None:
        print(f"fidelity: no runs of {REAL} or {SIM} under {args.ledgers}; {FILL}")

    return cli.report_page_main("analysis.studies.fidelity", __doc__, PAGE, write_page, "cells",
                                empty, argv)


if __name__ == "__main__":
    sys.exit(main())
