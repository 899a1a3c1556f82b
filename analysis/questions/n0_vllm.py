"""N0 against vLLM's own scheduler, decision by decision (campaign n0_vllm).

The same cells (model x budget x load x seed) on the simulator's N0 and on the
virtual-clock vLLM arm (executor=vllm_virtual), both priced by one step model, so every
difference is one of rules. Requests are paired by (model, budget, load, seed, request id):
the workload is a function of the seed. Per request: the prefix adopted at first admission,
the prefix re-adopted on resume, the preemptions, first-token and finish virtual times. Per
step (paired by step index): scheduled prefill tokens and decode sequences, and the first
step where the two runs differ. Per cell (seeds pooled): the agreement table of issue 42
with its targets: equal admission hit for >= 98 % of requests, preemptions per run within
10 % (within 2 under 20), throughput within 2 %, TTFT p50 and p99 within 5 %, and the
cells in the same order (`ranking`).

`python -m analysis.questions.n0_vllm --ledgers ROOT` prints the page (last line: JSON);
`analysis.report` writes it as n0_vllm.md when the campaign has runs.
"""

from __future__ import annotations

import json
import sys
from itertools import combinations
from pathlib import Path

import pandas as pd

from analysis import cli, field_errors
from analysis.pages.render import md_table
from ledgers.arms import ARMS, VLLM_RULES

CAMPAIGN = "n0_vllm"
PAGE = "n0_vllm.md"
TITLE = "N0 against vLLM's own scheduler, decision by decision"
FILL = "make campaign C=n0_vllm JOBS=1 (needs make setup-vllm)"
CELL = ["model", "budget", "rate"]
RUN = [*CELL, "seed"]
# issue 42's targets
HIT_SHARE, PREEMPT_REL, PREEMPT_ABS, PREEMPT_SMALL = 98.0, 10.0, 2, 20
TPUT_PCT, TTFT_PCT = 2.0, 5.0

_RUNS = """
    SELECT run_id, model, budget, rate, seed, org, executor, engine_config, throughput_span
    FROM runs WHERE campaign = ? AND status = 'complete' AND adopted
"""
_REQUESTS = """
    SELECT run_id, request_id, greatest(adopted_prefix_tokens, 0) AS hit,
           greatest(resume_adopted_tokens, 0) AS resume_hit, preemptions,
           first_token_s, finish_s, ttft_s, tpot_s, e2e_s
    FROM requests WHERE campaign = ? AND status = 'finished'
"""
_STEPS = """
    SELECT run_id, step, prefill_tokens_initial + prefill_tokens_resume AS prefill,
           num_decode_seqs AS decodes, num_preempted
    FROM steps WHERE campaign = ?
"""


# N0 under vLLM's rules (ledgers.arms.VLLM_RULES, docs/engine_rules.md section 17): the arm
# n0_vllm (runs.org N0_VLLM) is "sim_vllm"; a run of org N0 (before that arm) counts as
# "sim_vllm" where its effective rules are the seven its campaign block set (all of
# VLLM_RULES but release_order, added with the arm), else as "sim" (N0 at its defaults).
SIM_VLLM_ORG = ARMS["n0_vllm"].ledger_org
BLOCK_RULES = {k: v for k, v in VLLM_RULES.items() if k != "release_order"}
SIM_ARMS = {"sim": "N0 at its defaults", "sim_vllm": "N0 under vLLM's rules"}


def arm_of(org: str, executor: str, engine_config: str) -> str:
    """'vllm' for the virtual-clock vLLM arm; for the simulator's N0 'sim_vllm' for the
    n0_vllm arm or an N0 run under BLOCK_RULES, else 'sim'."""
    if str(executor).startswith("vllm"):
        return "vllm"
    if str(org).upper() == SIM_VLLM_ORG:
        return "sim_vllm"
    rules = json.loads(engine_config)
    return "sim_vllm" if all(rules.get(k) == v for k, v in BLOCK_RULES.items()) else "sim"


def with_arms(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs (org, executor, engine_config, model, budget, rate, seed) with their arm, one
    per (arm, model, budget, load, seed): the first by run id."""
    runs = runs.assign(arm=[arm_of(o, e, c) for o, e, c in zip(
        runs["org"], runs["executor"], runs["engine_config"], strict=True)])
    return runs.sort_values(["arm", *RUN, "run_id"]).drop_duplicates(["arm", *RUN])


def load(con, campaign: str = CAMPAIGN) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(runs, finished requests, steps), each with its arm and run key; one run per
    (arm, model, budget, load, seed): the first adopted one."""
    runs = con.execute(_RUNS, [campaign]).df()
    if runs.empty:
        return runs, pd.DataFrame(), pd.DataFrame()
    runs = with_arms(runs)
    keys = runs[["run_id", "arm", *RUN]]
    reqs = con.execute(_REQUESTS, [campaign]).df().merge(keys, on="run_id")
    steps = con.execute(_STEPS, [campaign]).df().merge(keys, on="run_id")
    per_run = reqs.groupby("run_id").agg(
        preemptions=("preemptions", "sum"), ttft_p50=("ttft_s", "median"),
        ttft_p99=("ttft_s", lambda s: s.quantile(0.99)), tpot_p50=("tpot_s", "median"),
        e2e_p50=("e2e_s", "median"), hit_tokens=("hit", "sum"),
        resume_hit_tokens=("resume_hit", "sum")).reset_index()
    return runs.merge(per_run, on="run_id", how="left"), reqs, steps


def paired_requests(reqs: pd.DataFrame) -> pd.DataFrame:
    """Requests finished on both arms side by side (suffixes _sim, _vllm) with which
    decisions agree."""
    cols = [*RUN, "request_id", "hit", "resume_hit", "preemptions", "first_token_s",
            "finish_s"]
    both = reqs[reqs["arm"] == "sim"][cols].merge(
        reqs[reqs["arm"] == "vllm"][cols], on=[*RUN, "request_id"], suffixes=("_sim", "_vllm"))
    for col in ("hit", "resume_hit", "preemptions"):
        both[f"same_{col}"] = both[f"{col}_sim"] == both[f"{col}_vllm"]
    both["first_token_diff_s"] = both["first_token_s_sim"] - both["first_token_s_vllm"]
    return both.sort_values([*RUN, "request_id"]).reset_index(drop=True)


def step_agreement(steps: pd.DataFrame) -> pd.DataFrame:
    """Per run pair: steps of each arm, the first step whose (prefill tokens, decode
    sequences) differ, the share of equal steps at equal index, and preempting steps."""
    rows = []
    for key, group in steps.groupby(RUN, sort=True):
        sim = group[group["arm"] == "sim"].sort_values("step")
        vllm = group[group["arm"] == "vllm"].sort_values("step")
        if sim.empty or vllm.empty:
            continue
        n = min(len(sim), len(vllm))
        a = sim[["prefill", "decodes"]].to_numpy()[:n]
        b = vllm[["prefill", "decodes"]].to_numpy()[:n]
        equal = (a == b).all(axis=1)
        first = int(sim["step"].iloc[int((~equal).argmax())]) if (~equal).any() else -1
        rows.append({**dict(zip(RUN, key, strict=True)), "steps_sim": len(sim),
                     "steps_vllm": len(vllm), "first_differing_step": first,
                     "equal_steps_pct": round(100.0 * equal.mean(), 1),
                     "preempting_steps_sim": int((sim["num_preempted"] > 0).sum()),
                     "preempting_steps_vllm": int((vllm["num_preempted"] > 0).sum())})
    return in_cell_order(pd.DataFrame(rows))


def in_cell_order(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows by model, budget (b63 before b108), load and seed where present."""
    if frame.empty:
        return frame
    keys = [k for k in RUN if k in frame.columns]
    return frame.sort_values(keys, key=lambda col: col.str[1:].astype(int)
                             if col.name == "budget" else col).reset_index(drop=True)


def _pct(sim: float, vllm: float) -> float:
    """100 (sim / vllm - 1), NaN against 0."""
    return 100.0 * (sim / vllm - 1.0) if vllm else float("nan")


def preemptions_agree(sim: float, vllm: float) -> bool:
    """Within 10 % of vLLM's count per run, or within 2 where vLLM's is under 20."""
    if vllm < PREEMPT_SMALL:
        return abs(sim - vllm) <= PREEMPT_ABS
    return abs(sim - vllm) <= PREEMPT_REL / 100.0 * vllm


def cell_table(runs: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """Per cell (seeds pooled): share of requests with equal admission hit, preemptions
    per run on each arm, and throughput and TTFT p50/p99 differences (N0 against vLLM, %
    of vLLM's mean over seeds), each with whether it meets the target."""
    rows = []
    for key, group in runs.groupby(CELL, sort=True):
        sim, vllm = (group[group["arm"] == arm].mean(numeric_only=True) for arm in
                     ("sim", "vllm"))
        p = pairs[(pairs[CELL] == pd.Series(key, index=CELL)).all(axis=1)]
        row = dict(zip(CELL, key, strict=True))
        row["seeds"] = int((group["arm"] == "vllm").sum())
        row["requests"] = int(len(p))
        row["same_hit_pct"] = round(100.0 * p["same_hit"].mean(), 1) if len(p) else float("nan")
        row["preempt_sim"] = round(float(sim["preemptions"]), 1)
        row["preempt_vllm"] = round(float(vllm["preemptions"]), 1)
        for col, name in (("throughput_span", "tput"), ("ttft_p50", "ttft_p50"),
                          ("ttft_p99", "ttft_p99")):
            row[f"{name}_diff_pct"] = round(_pct(sim[col], vllm[col]), 2)
        row["ok"] = "".join((
            "H" if row["same_hit_pct"] >= HIT_SHARE else "-",
            "P" if preemptions_agree(row["preempt_sim"], row["preempt_vllm"]) else "-",
            "T" if abs(row["tput_diff_pct"]) <= TPUT_PCT else "-",
            "5" if abs(row["ttft_p50_diff_pct"]) <= TTFT_PCT else "-",
            "9" if abs(row["ttft_p99_diff_pct"]) <= TTFT_PCT else "-"))
        rows.append(row)
    return in_cell_order(pd.DataFrame(rows))


def ranking(runs: pd.DataFrame, metric: str, tol_pct: float) -> tuple[int, int]:
    """(cell pairs ordered alike, cell pairs compared) by the metric's mean over seeds,
    within each model; pairs whose vLLM means differ by at most `tol_pct` % are ties and
    not compared (the metric's own target)."""
    means = runs.groupby(["arm", *CELL])[metric].mean()
    same = total = 0
    for model in sorted(runs["model"].unique()):
        cells = sorted({k[1:] for k in means.index if k[1] == model})
        for a, b in combinations(cells, 2):
            va, vb = means[("vllm", *a)], means[("vllm", *b)]
            if abs(_pct(va, vb)) <= tol_pct:
                continue
            total += 1
            same += (va > vb) == (means[("sim", *a)] > means[("sim", *b)])
    return int(same), total


def summary(runs: pd.DataFrame, pairs: pd.DataFrame, cells: pd.DataFrame) -> dict:
    """The page's JSON summary: pooled agreement and how many cells meet each target."""
    rank = {m: ranking(runs, m, tol) for m, tol in (("throughput_span", TPUT_PCT),
                                                     ("ttft_p50", TTFT_PCT))}
    return {"cells": int(len(cells)), "paired_requests": int(len(pairs)),
            "same_hit_pct": round(float(100.0 * pairs["same_hit"].mean()), 2),
            "same_resume_hit_pct": round(float(100.0 * pairs["same_resume_hit"].mean()), 2),
            "same_preemptions_pct": round(float(100.0 * pairs["same_preemptions"].mean()), 2),
            "cells_meeting": {t: int(cells["ok"].str[i].ne("-").sum()) for i, t in
                              enumerate(("hit", "preemptions", "throughput", "ttft_p50",
                                         "ttft_p99"))},
            "ranking": {m: list(v) for m, v in rank.items()}}


def against(frame: pd.DataFrame, sim_arm: str, runs: pd.DataFrame) -> pd.DataFrame:
    """The vLLM arm's rows and `sim_arm`'s (relabelled 'sim') of the runs (model, budget,
    load, seed) both arms completed in `runs`."""
    arms = runs[runs["arm"].isin(("vllm", sim_arm))]
    both = arms.groupby(RUN)["arm"].nunique().reset_index()
    sub = frame[frame["arm"].isin(("vllm", sim_arm))].merge(
        both[both["arm"] == 2][RUN], on=RUN)
    sub.loc[sub["arm"] == sim_arm, "arm"] = "sim"
    return sub


def section(runs: pd.DataFrame, reqs: pd.DataFrame, steps: pd.DataFrame) -> tuple[str, dict]:
    """Markdown of the comparison of each simulated arm present against vLLM, and the
    summaries by arm."""
    out, info = [f"# {TITLE} ({CAMPAIGN})", ""], {"paired_requests": 0}
    have = sorted(set(runs["arm"])) if not runs.empty else []
    arms = [a for a in SIM_ARMS if a in have] if "vllm" in have else []
    if not arms:
        out.append(f"Needs complete runs of vLLM and N0 (have: {', '.join(have) or 'none'}); "
                   f"`{FILL}` fills them.")
        return "\n".join(out) + "\n", info
    for arm in arms:
        text, info[arm] = arm_section(*(against(f, arm, runs) for f in (runs, reqs, steps)))
        out += [f"## {SIM_ARMS[arm]} ({arm}) against vLLM", "", text]
        info["paired_requests"] += info[arm]["paired_requests"]
    return "\n".join(out), info


def arm_section(runs: pd.DataFrame, reqs: pd.DataFrame,
                steps: pd.DataFrame) -> tuple[str, dict]:
    """Markdown of one simulated arm against vLLM, and its summary."""
    out = []
    pairs = paired_requests(reqs)
    table = cell_table(runs, pairs)
    info = summary(runs, pairs, table)
    field, info["field"] = field_errors.error_table(
        field_errors.cells(runs.replace({"arm": {"vllm": "ref"}}), CELL))
    out += [
        "Per cell, seeds pooled. same_hit_pct: paired requests whose prefix adopted at first "
        "admission is equal; preempt_*: preemptions per run; *_diff_pct: 100 (N0 / vLLM - 1) "
        "of the means over seeds. ok: H hit >= 98 %, P preemptions within 10 % (2 under 20), "
        "T throughput within 2 %, 5 and 9 TTFT p50 and p99 within 5 %.", "",
        md_table(table), "",
        f"Requests: {info['paired_requests']} paired; equal admission hit "
        f"{info['same_hit_pct']} %, equal resume hit {info['same_resume_hit_pct']} %, equal "
        f"preemption count {info['same_preemptions_pct']} %. Ranking (cell pairs ordered "
        f"alike of those whose vLLM means differ beyond the target, within a model): "
        f"throughput {info['ranking']['throughput_span']}, TTFT p50 "
        f"{info['ranking']['ttft_p50']}.", "",
        "In the field's format (as fidelity_field.md prints it). " + field_errors.ERROR_NOTE, "",
        field, "",
        "Step by step:", "",
        "Steps paired by index: the first whose scheduled prefill tokens or decode sequences "
        "differ (-1: none), the share of equal steps, and the steps that preempted.", "",
        md_table(step_agreement(steps)), ""]
    return "\n".join(out), info


def write_page(con, out: Path, campaign: str = CAMPAIGN) -> tuple[Path, dict] | None:
    """Write n0_vllm.md (and the paired requests as CSV) when the campaign has runs."""
    runs, reqs, steps = load(con, campaign)
    if runs.empty:
        return None
    text, info = section(runs, reqs, steps)
    for arm in SIM_ARMS:
        if {arm, "vllm"} <= set(runs["arm"]):
            (out / "tables").mkdir(parents=True, exist_ok=True)
            paired_requests(against(reqs, arm, runs)).to_csv(
                out / "tables" / f"n0_vllm_requests_{arm}.csv", index=False)
    path = out / PAGE
    path.write_text(text, encoding="utf-8")
    return path, info


def main(argv: list[str] | None = None) -> int:
    return cli.section_main("analysis.questions.n0_vllm", __doc__,
                            lambda con: section(*load(con)),
                            lambda info: bool(info["paired_requests"]), argv)


if __name__ == "__main__":
    sys.exit(main())
