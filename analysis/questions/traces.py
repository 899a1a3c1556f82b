"""Organizations on trace windows and multi-turn sessions (issue 45; plan conf/prereg/traces.yaml).

S0, S1, S2, D0, N0 and Jenga at two budgets on windows of the Mooncake FAST'25 traces
(a repeat is a window, paired by seed) and on sessions (repeats by seed), on Falcon-H1-7B
(family TRACES-WIN) and Granite-4.0-H-Tiny (TRACES-WIN-GRANITE); each workload runs under its
own campaign (traces_<workload>, traces_granite_<workload>). The page shows, per model,
workload and budget, the plan's winner (the organization with the highest geometric mean
request-span throughput, tested against each other organization by exact sign flips, Holm
over the 5), the realised share of the possible reuse (adopted prefix tokens over the
requests ledger's `reusable_prefix_tokens` bound), and throughput and TTFT means.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import cli
from analysis.inference import stats
from analysis.pages import common, readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "traces"
TITLE = "Organizations on trace windows and multi-turn sessions"
FAMILIES = ("TRACES-WIN", "TRACES-WIN-GRANITE")  # Falcon-H1-7B, Granite-4.0-H-Tiny
GROUP = ["stage", "model", "workload", "budget"]  # one winner per group
METRICS = ("throughput_span", "ttft_p50", "ttft_p99", "failed_requests")

# Per run: the infinite-cache bound and what the organization adopted at first admission,
# over the requests the workload gives a bound (reusable_prefix_tokens >= 0).
_REUSE = """
    SELECT run_id,
           sum(reusable_prefix_tokens) FILTER (WHERE reusable_prefix_tokens >= 0) AS bound_tokens,
           sum(greatest(adopted_prefix_tokens, 0)) FILTER (WHERE reusable_prefix_tokens >= 0)
               AS adopted_tokens,
           count(*) FILTER (WHERE status = 'refused') AS refused_requests
    FROM requests WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id
"""


def workload(campaign: str) -> str:
    """The workload a run's campaign names (traces_conversation_smoke,
    traces_granite_conversation -> conversation)."""
    return campaign.removesuffix("_smoke").removeprefix("traces_").removeprefix("granite_")


def _winner_metric(plan) -> str:
    """The plan's winner metric, one for every family of it (ValueError otherwise)."""
    metrics = {plan.family(f).decision.get("winner", {}).get("metric", "throughput_span")
               for f in FAMILIES}
    if len(metrics) != 1:
        raise ValueError(f"{QUESTION}: families {list(FAMILIES)} name winner metrics "
                         f"{sorted(metrics)}; the page compares one")
    return metrics.pop()


def group_tests(group: pd.DataFrame, metric: str, alpha: float,
                by: str = "org") -> tuple[str, list[dict]]:
    """The candidate (highest mean log metric over the seeds every value of `by` ran: an
    organization, or a placement) and its exact sign-flip tests against each other value,
    Holm over them."""
    wide = group.pivot_table(index="seed", columns=by, values=metric, aggfunc="first")
    wide = wide.dropna()
    logs = np.log(wide.astype(float))
    candidate = str(logs.mean().idxmax())
    rows = []
    for other in [o for o in wide.columns if o != candidate]:
        d = (logs[candidate] - logs[other]).to_numpy()
        test = stats.sign_flip_test(d)
        pct = 100 * (wide[candidate] / wide[other] - 1)
        rows.append({"candidate": candidate, "other": other, "n": int(d.size),
                     "mean_pct": float(pct.mean()), "wins": int((d > 0).sum()),
                     "losses": int((d < 0).sum()), "p_exact": test.pvalue})
    if rows:
        adjusted = stats.holm([r["p_exact"] for r in rows])
        reject = stats.holm_reject([r["p_exact"] for r in rows], alpha)
        for row, p_holm, rej in zip(rows, adjusted, reject, strict=True):
            row.update(p_holm=float(p_holm), reject=bool(rej))
    return candidate, rows


def verdict(candidate: str, rows: list[dict]) -> str:
    """`<candidate>` when every test rejects, else the tie it cannot be told apart from."""
    tied = [r["other"] for r in rows if not r["reject"]]
    return candidate if not tied else "tie: " + ", ".join([candidate, *tied])


def winner_tables(runs: pd.DataFrame, metric: str, alpha: float,
                  keys: tuple[str, ...] = tuple(GROUP), by: str = "org"
                  ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per group of `keys` (model, workload and budget): the verdict (one row) and the candidate's
    tests against the other values of `by` (one row each)."""
    verdicts, tests = [], []
    for values, group in runs.groupby(list(keys), sort=False):
        candidate, rows = group_tests(group, metric, alpha, by)
        key = dict(zip(keys, values, strict=True))
        n = min((r["n"] for r in rows), default=0)
        verdicts.append({**key, "n": n, "candidate": candidate,
                         "winner": verdict(candidate, rows) if rows else "(one organization)"})
        tests += [{**key, **row} for row in rows]
    return pd.DataFrame(verdicts), pd.DataFrame(tests)


def reuse_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Realised / possible reuse per model, workload, budget and organization, summed over
    runs."""
    keys = [*GROUP, "org"]
    sums = runs.groupby(keys, sort=False)[
        ["bound_tokens", "adopted_tokens", "refused_requests"]].sum().reset_index()
    n = runs.groupby(keys, sort=False)["seed"].nunique()
    sums.insert(len(keys), "n", n.to_numpy())
    bound = sums["bound_tokens"].astype(float)
    sums["realised"] = (sums["adopted_tokens"].astype(float) / bound).where(bound > 0)
    return sums


def load(con, runs: pd.DataFrame, sql: str = _REUSE, question: str = QUESTION,
         name_of=workload) -> pd.DataFrame:
    """The plan's runs with their workload (`name_of` their campaign) and the per-run sums
    of `sql` (default: the reuse sums)."""
    runset = common.RunSet((question,), tuple(sorted(runs["campaign"].unique())), runs,
                           runs.head(0))
    sums = common.query(con, sql, runset)
    out = runs.merge(sums, on="run_id", how="left")
    return out.assign(workload=out["campaign"].astype(str).map(name_of))


def _sections(result: QuestionResult, runs: pd.DataFrame, plan) -> None:
    verdicts, tests = winner_tables(runs, _winner_metric(plan), plan.alpha)
    result.add("winners", verdicts)
    result.add("winner_tests", tests)
    reuse = result.add("reuse", reuse_table(runs))
    means = result.add("means", readouts.means_table(runs, [*GROUP[1:], "org"], METRICS))
    result.sections += [
        Section("Winner per model, workload and budget",
                "Candidate: the organization with the highest geometric mean request-span "
                "throughput over the paired repeats (trace windows or session seeds). It is "
                "tested against each other organization: exact two-sided sign-flip test of the "
                f"seedwise log ratio, Holm over the group's tests at alpha {plan.alpha}. A "
                "sole winner needs every test to reject; otherwise the organizations not "
                "rejected tie with it. mean_pct: mean seedwise 100 (candidate / other - 1); "
                "wins / losses: repeats with the candidate ahead / behind.",
                [("verdicts", verdicts, None), ("the candidate's tests", tests, None)]),
        Section("Realised / possible reuse",
                "bound_tokens: the infinite-cache reusable prefix summed over the requests "
                "(requests ledger `reusable_prefix_tokens`); adopted_tokens: prefix tokens the "
                "organization adopted at those requests' first admission; realised = adopted "
                "/ bound; refused_requests: requests whose state cannot fit the budget alone.",
                [("reuse", reuse, None)]),
        Section("Throughput and TTFT",
                "Arithmetic means over runs (n repeats): request-span throughput (output "
                "tok/s), TTFT p50 and p99 over each run's finished requests (s), failed "
                "(refused) requests.", [("cell means", means, None)]),
    ]


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir,
                                                per_campaign=True)
    if not runset.runs.empty:
        found = [readouts.family_runs(plan, f, runset.runs) for f in FAMILIES]
        runs = pd.concat([f for f in found if len(f)] or found[:1], ignore_index=True)
        if not runs.empty:
            _sections(result, load(con, runs), plan)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # tables only: the verdicts, reuse and means read as tables


def main(argv: list[str] | None = None) -> int:
    """Write this page alone (`make traces`): <out>/traces.md and its tables."""
    return cli.question_page_main("analysis.questions.traces", __doc__, QUESTION, analyze,
                                  argv)


if __name__ == "__main__":
    raise SystemExit(main())
