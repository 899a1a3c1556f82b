"""Checkpoint placement per workload and budget, and why (issue 44; conf/prereg/placement.yaml).

S2, D0 and N0 under each checkpoint placement at two budgets, on shared contexts (two sharing
levels x two loads), on Mooncake conversation windows, and in vLLM issue 45238's shift (the
shared prefix moved from just above to just below the first checkpoint boundary). Per
workload, budget and organization the page gives the plan's winner placement (highest
geometric mean request-span throughput, tested against each other placement by exact sign
flips, Holm over the group) and the hit attribution that explains it: the requests ledger's
ideal prefix, the adopted prefix and the tokens lost to each cause (docs/engine_rules.md
section 15), summed over each run's requests, then averaged over seeds.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section
from analysis.questions import traces

QUESTION = "placement"
TITLE = "Checkpoint placement per workload and budget"
FAMILIES = {"PLACE-WIN": ("stage", "workload", "q", "rate", "budget", "org"),
            "PLACE-TRACE": ("stage", "workload", "budget", "org")}
SHIFT = "PLACE-SHIFT"
LOSSES = ("block", "placement", "admission", "attention", "group", "checkpoint", "tier")
ATTRIBUTION = ("ideal_tokens", "adopted_tokens", *(f"lost_{c}" for c in LOSSES))

# Per run: the attribution summed over its attributed requests (ideal >= 0), hit counts.
_ATTRIBUTION = """
    SELECT run_id, count(*) AS requests,
           count(*) FILTER (WHERE adopted_prefix_tokens > 0) AS hit_requests,
           sum(ideal_prefix_tokens) AS ideal_tokens,
           sum(adopted_prefix_tokens) AS adopted_tokens,
           {losses}
    FROM requests WHERE {{campaigns}} AND run_id IN ({{adopted}})
      AND ideal_prefix_tokens >= 0 GROUP BY run_id
""".format(losses=",\n           ".join(f"sum(lost_{c}_tokens) AS lost_{c}" for c in LOSSES))


def workload(campaign: str) -> str:
    """The workload a run's campaign names (placement_shift_above_smoke -> shift_above)."""
    return campaign.removesuffix("_smoke").removeprefix("placement_")


def load(con, runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with their workload and per-run attribution sums."""
    return traces.load(con, runs, _ATTRIBUTION, QUESTION, workload)


def attribution_table(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Means over seeds of the per-run sums, per group of `keys` and placement, with the
    realised share adopted / ideal and the identity residual (0 on every row)."""
    by = [*keys, "placement"]
    table = runs.groupby(by, sort=False)[["requests", "hit_requests", *ATTRIBUTION]].mean()
    table.insert(0, "n", runs.groupby(by, sort=False)["seed"].nunique())
    ideal = table["ideal_tokens"].astype(float)
    table["realised"] = (table["adopted_tokens"] / ideal).where(ideal > 0)
    table["residual"] = ideal - table[["adopted_tokens", *(f"lost_{c}" for c in LOSSES)]].sum(
        axis=1)
    return table.reset_index()


def winner_section(result: QuestionResult, plan, runs: pd.DataFrame, name: str,
                   title: str) -> None:
    keys = FAMILIES[name]
    found = readouts.family_runs(plan, name, runs)
    if found.empty:
        return
    found = load_frame(found, runs)
    rule = dict(plan.family(name).decision.get("winner", {}))
    verdicts, tests = traces.winner_tables(found, rule.get("metric", "throughput_span"),
                                           plan.alpha, keys, "placement")
    attribution = attribution_table(found, list(keys))
    frame = name.lower().replace("-", "_")
    result.add(f"{frame}_winners", verdicts)
    result.add(f"{frame}_tests", tests)
    result.add(f"{frame}_attribution", attribution)
    result.sections.append(Section(title, WINNER_TEXT.format(alpha=plan.alpha), [
        ("verdicts", verdicts, None), ("the candidate's tests", tests, None),
        ("hit attribution per organization and placement (tokens per run, mean over seeds)",
         attribution, None)]))


WINNER_TEXT = (
    "Candidate: the placement with the highest geometric mean request-span throughput over the "
    "paired seeds (windows for the trace). It is tested against each other placement of its "
    "group: exact two-sided sign-flip test of the seedwise log ratio, Holm over the group's "
    "tests at alpha {alpha}. A sole winner needs every test to reject; otherwise the "
    "placements not rejected tie with it. mean_pct: mean seedwise 100 (candidate / other - 1). "
    "The attribution explains the verdict: ideal_tokens, the longest prefix each request "
    "shared with an earlier one; adopted_tokens, what it adopted; lost_<cause>, the tokens "
    "lost to each cause in the waterfall of docs/engine_rules.md section 18 (block: beyond the "
    "last whole block; placement: no checkpoint was ever published there; admission: published "
    "only after the lookup; attention / group / checkpoint: evicted; tier: not restored). "
    "realised = adopted / ideal; residual = ideal - adopted - losses (0 by the identity).")


def load_frame(found: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The family's runs with the loaded columns (workload, attribution sums) of `runs`."""
    extra = [c for c in runs.columns if c not in found.columns or c == "run_id"]
    return found.merge(runs[extra], on="run_id", how="left")


def shift_section(result: QuestionResult, plan, runs: pd.DataFrame) -> None:
    """vLLM issue 45238: hits, TTFT and attribution above vs below the first boundary."""
    found = readouts.family_runs(plan, SHIFT, runs)
    if found.empty:
        return
    found = load_frame(found, runs)
    table = attribution_table(found, ["stage", "org", "workload"])
    ttft = found.groupby(["stage", "org", "workload", "placement"], sort=False)[
        ["ttft_p50", "ttft_p99", "throughput_span"]].mean().reset_index()
    table = table.merge(ttft, on=["stage", "org", "workload", "placement"], how="left")
    result.add("shift", table)
    result.sections.append(Section(
        "vLLM issue 45238: the shared prefix moved across the first checkpoint boundary",
        "64 requests share one prefix of C + 50 tokens (shift_above) or C - 50 tokens "
        "(shift_below), C the organization's first checkpoint boundary, the prompt length the "
        "same: the 100 tokens move into the unique suffix. hit_requests: requests that adopted "
        "a cached prefix (of `requests` attributed); TTFT p50 / p99 in seconds; tokens per run, "
        "means over seeds. Below the boundary the whole ideal is lost to `block` (below the "
        "first block) under every placement that keeps to the grid.",
        [("hits, TTFT and attribution per organization, placement and side", table, None)]))


def _fill(result: QuestionResult, plan, runs: pd.DataFrame, con) -> None:
    runs = load(con, runs)
    winner_section(result, plan, runs, "PLACE-WIN",
                   "Winner per shared-context condition (sharing q, load, budget, organization)")
    winner_section(result, plan, runs, "PLACE-TRACE",
                   "Winner per conversation-trace budget and organization")
    shift_section(result, plan, runs)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir,
                                                per_campaign=True)
    if not runset.runs.empty:
        _fill(result, plan, runset.runs, con)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # tables only: verdicts, attribution and the shift read as tables


def main(argv: list[str] | None = None) -> int:
    """Write this page alone (`make placement`): <out>/placement.md and its tables."""
    return cli.question_page_main("analysis.questions.placement", __doc__, QUESTION, analyze,
                                  argv)


if __name__ == "__main__":
    raise SystemExit(main())
