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
from analysis.inference.families import evaluate_family
from analysis.pages import common, readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "arms"
TITLE = "Arms from the literature against S2 (Jenga, Marconi)"
METRICS = ("throughput_span", "throughput_ledger", "c_once_tokens", "token_hit_rate",
           "ttft_p99")
# S2 and S2+Marconi rerun at full size under another slab rule (docs/usage.md, arms):
# make campaign C=arms ARGS="campaign_name=arms_slab_<rule> engine.slab_policy=<rule>
#   hydra.sweeper.blocks.arms.org=s2,s2_marconi"; the other arms have no slabs
SLAB_CAMPAIGNS = {"slab_dense": "arms_slab_dense", "slab_refill": "arms_slab_refill"}
SLAB_ORGS = ("S2", "S2_MARCONI")
FULL_SLAB_TEXT = (
    "ARMS-9 at its full design under each slab rule: the S2 and S2+Marconi cells rerun "
    "under `engine.slab_policy=<rule>` (campaigns arms_slab_<rule>; the other arms hold "
    "no slabs, so their runs are the campaign's), evaluated by the plan's own decision "
    "(mean seedwise % change, exact sign-flip test, Holm over 9). `holds_under` compares "
    "each rule with the page's `write_once` runs: a contrast that changes sign or decision "
    "depends on the slab rule and is not a winner.")
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


def _slab_runs(runs: pd.DataFrame, arms_runs: pd.DataFrame, campaign: str) -> pd.DataFrame:
    """The campaign's runs with S2's and S2+Marconi's taken from `campaign` (empty when it
    lacks them)."""
    alt = runs[(runs["campaign"].astype(str) == campaign) & runs["org"].isin(SLAB_ORGS)]
    if alt.empty:
        return alt
    keep = arms_runs[~arms_runs["org"].isin(SLAB_ORGS)]
    return pd.concat([keep, alt.assign(campaign=QUESTION)], ignore_index=True)


def full_slab_table(con, plan, arms_runs: pd.DataFrame, own) -> pd.DataFrame:
    """ARMS-9 per slab rule at full size: effect (decision) per test and rule, and where
    each contrast's sign or decision changes against the page's own runs (`own`)."""
    runs = common.load_runs(con, [QUESTION]).all_runs
    fam = plan.family("ARMS-9")
    rows = [{"alternative": "default", "test": r.test, "effect": r.effect,
             "decision": r.decision, "n": r.n} for r in own.itertuples()]
    for alt, campaign in SLAB_CAMPAIGNS.items():
        mixed = _slab_runs(runs, arms_runs, campaign)
        table = (evaluate_family(plan, fam, mixed).tables.get(fam.primary_estimand.name)
                 if not mixed.empty else None)
        rows += [] if table is None else [
            {"alternative": alt, "test": r.test, "effect": r.effect, "decision": r.decision,
             "n": r.n} for r in table.itertuples()]
    long = pd.DataFrame(rows).assign(family="ARMS-9", label="", unit="%")
    if set(long["alternative"]) == {"default"}:
        return pd.DataFrame()
    long["value"] = [f"{e:+.1f}% ({d})" for e, d in zip(long["effect"], long["decision"],
                                                          strict=True)]
    table = long.pivot(index="test", columns="alternative", values="value")
    texts = flips.flip_texts(long)
    table[flips.COLUMN] = [texts.get(("ARMS-9", t), "") for t in table.index]
    return table.reindex(list(own["test"])).reset_index()


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
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    own = [f.tables["throughput_span"] for f in families
           if f.name == "ARMS-9" and "throughput_span" in f.tables]
    if own:
        full = result.add("arms9_by_slab_rule", full_slab_table(
            con, plan, readouts.family_runs(plan, "ARMS-9", runs), own[0]))
        if not full.empty:
            result.sections.append(Section("ARMS-9 under each slab rule (full size)",
                                            FULL_SLAB_TEXT, [("", full, None)]))
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # tables only: the arms' comparison is read from the cell means and the family
