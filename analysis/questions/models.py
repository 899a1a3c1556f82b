"""Which memory organization serves each hybrid model best (issue 28).

The Q1 and Q4 cells (S0, S1, S2, D0; λ 3, cap 63, q 1, f 0, pinning K 2, seeds
42000-42011) for every preset with a public configuration (conf/model/: Falcon-H1-7B,
Granite-4.0-H-Tiny and -Small, Nemotron-H-8B, Qwen3-Next-80B-A3B, Jamba v0.1) at 4,096 and
8,192 MiB of state memory for the whole model (campaign models, plan conf/prereg/models.yaml).
One family per model with every pair of organizations per budget, decided as Q1/Q4 decide
(analysis.inference.families: seedwise log ratios, exact sign flips, Holm within the family);
Falcon-H1-7B's family is primary, the others secondary: the simulated A100's constants are
calibrated on Falcon-H1 and extrapolated to the other geometries through their layer
patterns (serving_core/executor/profiles.py, model_costs). The winner table names, per model
and budget, the organization with the highest mean request-span throughput, its effect
against the runner-up and that pair's test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from analysis.inference.families import SMOKE_TAG
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "models"
TITLE = "Which memory organization serves each hybrid model best"
ESTIMAND = "throughput_span"
ALPHA = 0.05  # conf/prereg/models.yaml
MAIN = ("throughput_span", "throughput_ledger", "e2e_p99", "ttft_p99", "c_once_tokens",
        "running_mean", "preemptions")
CAVEAT = (
    "The step model (conf/executor/a100.yaml) is calibrated on Falcon-H1-7B; for every other "
    "model its constants are extrapolated: the terms are computed from that model's layer "
    "pattern (weights, active parameters, KV and recurrent bytes, attention and scan FLOPs of "
    "the layers that carry them) and priced with Falcon-H1's fitted coefficients. MoE weights "
    "are streamed whole each step (the conservative bound). D0 splits at 0.527383 for "
    "Falcon-H1 (the paper's screen) and evenly (0.5) for the others, for which no "
    "stranded-byte screen was run. Budgets are state memory for the whole model (every "
    "layer), the same bytes for every model.")


def _family_table(families, model: str) -> tuple[pd.DataFrame | None, str]:
    for wanted in (model, model + SMOKE_TAG):
        for fam in families:
            if fam.name == wanted and ESTIMAND in fam.tables:
                return fam.tables[ESTIMAND], fam.role
    return None, ""


def winners(runs: pd.DataFrame, families) -> pd.DataFrame:
    """Per stage, model and budget: the organization with the highest mean request-span
    throughput (organizations with the same mean are one tied `best`, joined by "="), the
    runner-up (the best of the rest), the winner's mean seedwise percent change against it
    (seeds where both ran), and the declared test of that pair (exact and Holm p, decision).
    When every organization ties, memory does not bind at that budget: no runner-up."""
    rows = []
    for (stage, model, budget), part in runs.groupby(["stage", "model", "budget"], sort=False):
        means = part.groupby("org")[ESTIMAND].mean().sort_values(ascending=False, kind="stable")
        if len(means) < 2:
            continue
        top = float(means.iloc[0])
        tied = [o for o, v in means.items() if math.isclose(v, top, rel_tol=1e-12)]
        rest = means.drop(tied)
        row = {"stage": stage, "model": model, "budget": budget,
               "model_bytes": model_bytes(budget), "best": "=".join(tied),
               "best_tokens_s": top, "runner_up": "", "runner_up_tokens_s": math.nan,
               "n": 0, "effect_pct": math.nan, "min_seed_pct": math.nan,
               "max_seed_pct": math.nan, "wins": 0, "family": "", "p_exact": math.nan,
               "p_holm": math.nan, "decision": "all organizations tie" if rest.empty else "",
               "holm_below_alpha": False,
               "ranking": " > ".join(means.index)}
        if not rest.empty:
            best, second = tied[0], rest.index[0]
            wide = part.pivot_table(index="seed", columns="org", values=ESTIMAND).dropna(
                subset=[best, second])
            pct = 100 * (wide[best] / wide[second] - 1)
            table, role = _family_table(families, str(model))
            test = None
            if table is not None:
                ids = {f"{best}_vs_{second}_{budget}", f"{second}_vs_{best}_{budget}"}
                hit = table[table["test"].isin(ids)]
                test = hit.iloc[0] if len(hit) else None
            row.update({
                "runner_up": second, "runner_up_tokens_s": float(rest.iloc[0]),
                "n": int(len(pct)), "effect_pct": float(pct.mean()),
                "min_seed_pct": float(pct.min()), "max_seed_pct": float(pct.max()),
                "wins": int((pct > 0).sum()), "family": f"{model} ({role})" if role else "",
                "p_exact": float(test["p_exact"]) if test is not None else math.nan,
                "p_holm": float(test["p_holm"]) if test is not None else math.nan,
                "decision": str(test["decision"]) if test is not None else "",
                # the Holm step-down at the plan's alpha, shown for secondary families too
                "holm_below_alpha": bool(test is not None and test["p_holm"] <= ALPHA)})
        rows.append(row)
    return pd.DataFrame(rows)


def model_bytes(budget: str) -> int | None:
    """The whole-model state bytes a `NMiB` label names (serving_core/planner.py)."""
    text = str(budget).strip().lower()
    return int(text.removesuffix("mib")) * 2**20 if text.endswith("mib") else None


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    if runs.empty:
        return result
    win = result.add("winners", winners(runs, families))
    cells = result.add("cells", readouts.means_table(runs, ["model", "budget", "org"], MAIN))
    result.sections.insert(0, Section(
        "The best organization per model and budget",
        "Per model and budget (state memory for the whole model): the organization with the "
        "highest mean request-span throughput (output tokens/s), the runner-up, the winner's "
        "mean seedwise percent change against it (min-max over seeds, seeds it wins), and "
        "that pair's declared test in the model's family: exact two-sided sign-flip p of "
        "the seedwise log ratio and Holm p over the family's 12 tests. Falcon-H1-7B's family "
        "is primary; the others are secondary (extrapolated constants). Each model's "
        "whole-model KV bytes per token and recurrent bytes per checkpoint: `python -m "
        "serving_core.planner --model <model> --budget 4096MiB --json`. " + CAVEAT,
        [("", win, None)]))
    result.sections.insert(1, Section(
        "Cell means", "Arithmetic means over runs per model, budget and organization.",
        [("", cells, None)]))
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # the winner table carries the answer
