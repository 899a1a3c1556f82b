"""Arms from the literature against S2 (issue 29; plan conf/prereg/arms.yaml).

S2, D0, Jenga's two-level allocator (serving_core/memory/jenga.py) and S2 and D0 under
Marconi's admission and eviction (serving_core/memory/cache_policy.py, its weight tuned
as Marconi tunes it, memory.marconi_tuning), at b63, b83, b108 (λ 3, cap 63, q 1, f 0,
pinning K 2), paired by seed. The page shows, per arm and budget, the arithmetic run means
of throughput, C_once, the token hit rate and TTFT p99; Jenga against S2 under each slab
rule (the sensitivity reruns of ARMS-9, analysis.flips) and what Jenga's margin is made
of; D0+Marconi decomposed into D0's grid (D0 / S2) and the policy (D0+Marconi / D0), with
the tuned weights the runs record; then the preregistered families: ARMS-9 (each
literature arm against S2 per budget, Holm over 9) decides, each contrast saying where it
flips (`holds_under`); arms_within is descriptive.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd

from analysis import flips
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "arms"
TITLE = "Arms from the literature against S2 (Jenga, Marconi)"
METRICS = ("throughput_span", "throughput_ledger", "c_once_tokens", "token_hit_rate",
           "ttft_p99")
DECOMPOSITION = (("D0", "S2"), ("D0_MARCONI", "D0"), ("D0_MARCONI", "S2"),
                 ("S2_MARCONI", "S2"))
SLAB_TEXT = (
    "Jenga / S2 (mean seedwise % change of throughput_span, decision) under each slab rule "
    "and identified alternative, from the sensitivity reruns of ARMS-9 (`make sensitivity`, "
    "`--families ARMS-9`; smoke campaigns at 3 seeds and 60 requests decide nothing). Both "
    "hold the same bytes and one checkpoint costs the same in each; the calibrated step "
    "model charges no organization for paging (A100 profile: indirection_overhead about "
    "0, no page or slot cost), so what separates them is what stays cached: under "
    "`write_once` S2 never refills a freed conv slot and reclaims whole slabs holding "
    "cached checkpoints; `dense` and `refill` pack slots. The rest of Jenga's margin is "
    "its attention page: 16 tokens (Jenga, D0) against S2's 512. S2 cannot be run with "
    "16-token attention pages: its one pool has one page size, the KV of B tokens (Falcon-"
    "H1-7B: 1,024 B per token), so B = 16 makes 16,384-B pages, smaller than the "
    "32,768-B conv slot the layout refuses (memory.s2 `unit_layout`: a slot larger than a "
    "page), with 96 member pages per 1,572,864-B SSM state and a checkpoint grid C = B = "
    "16; the ablation needs a second page size, which is Jenga's design, not S2's.")
TUNED_TEXT = (
    "Marconi's weight alpha as the runs chose it (engine_config.marconi_tuning: LRU order "
    "until the first eviction, then replays of a 5 x bootstrap window of finished requests "
    "under alpha 0-2.0, memory.marconi_tuning). Per arm and budget: runs, runs that tuned, "
    "tunings, and how often each alpha was chosen.")


def with_hit_rate(runs: pd.DataFrame) -> pd.DataFrame:
    """Token hit rate of a run: prompt tokens adopted at first admissions over all prompt
    tokens, cross / (cross + C_once) (C_once = prompt - adopted at first admission)."""
    cross = runs["prefix_hit_tokens_cross"].astype(float)
    total = cross + runs["c_once_tokens"].astype(float)
    return runs.assign(token_hit_rate=(cross / total).where(total > 0))


def tuned_alphas(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per Marconi arm and budget: runs, runs with a tuning, tunings, and the
    alphas chosen with their counts ('0.0 x 40, 1.1 x 2')."""
    rows = []
    marconi = runs[runs["org"].astype(str).str.endswith("_MARCONI")]
    for (org, budget), group in marconi.groupby(["org", "budget"], sort=True):
        tunings = [json.loads(c or "{}").get("marconi_tuning") or []
                   for c in group["engine_config"]]
        chosen = Counter(t["alpha"] for ts in tunings for t in ts)
        rows.append({"org": org, "budget": budget, "runs": len(group),
                     "runs_tuned": sum(bool(ts) for ts in tunings),
                     "tunings": sum(len(ts) for ts in tunings),
                     "alphas": ", ".join(f"{a:g} x {n}" for a, n in sorted(chosen.items()))
                     or "none (no tuning: alpha 0 throughout)"})
    return pd.DataFrame(rows)


def slab_rule_table(con, plan_dir=None) -> pd.DataFrame:
    """Jenga / S2 per budget (rows) under each alternative with ARMS-9 reruns (columns)."""
    long = flips.alternative_effects(con, QUESTION, "ARMS-9", plan_dir)
    if long.empty:
        return long
    jenga = long[long["test"].str.startswith("JENGA_vs_S2")]
    text = jenga.assign(value=[f"{e:+.1f}% ({d}, n = {n})" for e, d, n in
                               zip(jenga["effect"], jenga["decision"], jenga["n"], strict=True)])
    return text.pivot(index="test", columns="alternative", values="value").reset_index()


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        arms = with_hit_rate(readouts.family_runs(plan, "ARMS-9", runs))
        cells = result.add("cells", readouts.means_table(arms, ["budget", "org"], METRICS))
        result.sections.append(Section(
            "Arms by budget", "λ 3, cap 63, q 1, f 0, pin K 2; arithmetic means over runs "
            "(n seeds). Token hit rate: prompt tokens adopted at first admission over all "
            "prompt tokens. TTFT p99: per run over its finished requests.",
            [("cell means", cells, None)]))
        slab = result.add("jenga_by_slab_rule", slab_rule_table(con, plan_dir))
        result.sections.append(Section(
            "Jenga against S2 under each slab rule", SLAB_TEXT,
            [("Jenga / S2", slab, None)] if not slab.empty else []))
        readouts.changes_section(
            result, arms, "marconi_decomposed",
            "D0+Marconi decomposed: D0's grid (D0 / S2), then the policy (D0+Marconi / D0)",
            ["throughput_span"], DECOMPOSITION, effect="mean_seedwise")
        alphas = result.add("marconi_alphas", tuned_alphas(arms))
        result.sections.append(Section("Marconi's tuned weight", TUNED_TEXT,
                                        [("alphas chosen", alphas, None)]))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # tables only: the arms' comparison is read from the cell means and the family
