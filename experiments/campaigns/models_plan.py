"""The preregistered plan of the `models` campaign (conf/prereg/models.yaml), written with
its test campaign by experiments/campaigns/models_regime.py before any test run exists.

One family per model (Falcon-H1-7B primary: the step model is calibrated on it), cells per
organization, budget and load; the tests: every other organization against the budget's
leader (the organization of highest memory-bound capacity on the capacity stage's own seed)
per budget and load, Holm over the family; the seeds: enough that a unanimous effect passes
Holm (seeds_for_holm); the practical-equivalence margin the page calls ties with
(EQUIVALENCE); the overload bound (OVERLOAD) each cell's p99 TTFT is checked against.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import yaml

from ledgers.arms import arm

PLAN_FILE = Path(__file__).resolve().parents[2] / "conf" / "prereg" / "models.yaml"
TITLES = {"falcon_h1_7b": "Falcon-H1-7B", "granite_4_0_h_tiny": "Granite-4.0-H-Tiny",
          "granite_4_0_h_small": "Granite-4.0-H-Small", "nemotron_h_8b": "Nemotron-H-8B",
          "qwen3_next_80b_a3b": "Qwen3-Next-80B-A3B", "jamba_v0_1": "Jamba v0.1"}
# Two one-sided tests of the seedwise log ratio (winner / runner-up): the winner is a tie
# when the 90 % t interval of the mean log ratio lies within +-log(1.01).
EQUIVALENCE = {"method": "tost", "margin_pct": 1.0, "alpha": 0.05,
               "rule": "paired t TOST of the seedwise log ratio of winner and runner-up: "
                       "equivalent (a tie) when the 1 - 2 alpha t interval of its mean lies "
                       "within +-log(1 + margin_pct / 100); the winner is then not named"}
DECISION = {"method": "sign_flip_holm", "statistic": "log_ratio", "intervals": "none",
            "rule": "Exact two-sided sign-flip test (all 2^n assignments) of the seedwise log "
                    "ratio; Holm step-down over the family's tests at alpha. Displays are "
                    "mean seedwise percent changes 100 (A/B - 1)."}


OVERLOAD = {"metric": "ttft_p99", "factor": 10.0,
            "rule": "a cell (organization, budget, load) whose mean p99 TTFT over the seeds "
                    "exceeds the model's bound (factor x its unloaded p99 TTFT, the best "
                    "organization's, measured by the capacity stage) is overloaded: flagged, "
                    "not ranked"}


def seeds_for_holm(tests: int, alpha: float = 0.05) -> int:
    """The fewest seeds n whose exact two-sided sign-flip test can pass Holm over `tests`
    tests when every seed agrees: its smallest p, 2 / 2^n, at most alpha / tests."""
    return math.ceil(math.log2(2 * tests / alpha))


def _cells(entry: dict, orgs) -> list[dict]:
    cells = []
    for level, mib in entry["budgets"].items():
        for (load, rate), org in itertools.product(entry["rates"][level].items(), orgs):
            ledger_org = arm(org).ledger_org
            cell = {"id": f"{ledger_org}_{level}_{load}", "org": ledger_org,
                    "budget": f"{mib}MiB", "rate": rate}
            if ledger_org == "D0":
                cell["d0_attention_fraction"] = entry["d0_split"]["fraction"]
            cells.append(cell)
    return cells


def _tests(cells: list[dict], leaders: dict[str, str]) -> list[dict]:
    """Every other organization against its budget's leader, per budget and load."""
    tests = []
    for c in cells:
        tail = c["id"].split("_", 1)[1]
        leader = leaders[tail.split("_")[0]]
        if c["org"] != leader:
            tests.append({"id": f"{c['org']}_vs_{leader}_{tail}", "kind": "paired",
                          "treatment": c["id"], "control": f"{leader}_{tail}",
                          "predicted": "none"})
    return tests


def _seeds_rule(tests: int, seeds: int) -> str:
    n = seeds_for_holm(tests)
    return (f"{tests} tests per family (every other organization against the budget's leader "
            f"at each budget and load); the smallest exact sign-flip p with n seeds is 2 / 2^n, "
            f"and Holm's first step needs p <= 0.05 / {tests} = {0.05 / tests:.5f}: n = {n} "
            f"(2 / 2^{n} = {2 / 2 ** n:.5f}; n - 1 gives {2 / 2 ** (n - 1):.5f}); "
            f"{seeds} seeds run")


def write_plan(regime: dict, orgs, seeds) -> Path:
    families = []
    for i, (model, entry) in enumerate(regime.items()):
        cells = _cells(entry, orgs)
        tests = _tests(cells, {lv: c["org"] for lv, c in entry["capacity"].items()})
        if len(seeds) < seeds_for_holm(len(tests)):
            raise ValueError(f"{model}: {len(tests)} tests need {seeds_for_holm(len(tests))} "
                             f"seeds for a unanimous effect to pass Holm; got {len(seeds)}")
        families.append({
            "name": model, "role": "primary" if i == 0 else "secondary",
            "description": f"{TITLES.get(model, model)} on {entry['device_name']}: every "
                           "organization at each budget and load; each against the budget's "
                           "leader per budget and load, Holm over the family; overload bound "
                           f"{entry['ttft_bound_s']} s p99 TTFT.",
            "ttft_p99_bound_s": entry["ttft_bound_s"],
            "seeds": list(seeds),
            "defaults": {"model": model, "executor": f"sim:{entry['device_name']}"},
            "cells": cells,
            "estimands": [{"name": "throughput_span", "metric": "throughput_span",
                           "role": "primary"},
                          {"name": "throughput_ledger", "metric": "throughput_ledger",
                           "role": "sensitivity"}],
            "decision": DECISION, "tests": tests})
    doc = {"question": "MODELS", "campaign": "models",
           "title": "Which memory organization serves each hybrid model best", "alpha": 0.05,
           "equivalence": EQUIVALENCE, "overload": OVERLOAD,
           "seeds_rule": _seeds_rule(len(families[0]["tests"]), len(seeds)),
           "defaults": {"arrival": "poisson", "trace": False, "f": 0.0, "reuse": "share",
                        "q": 1.0, "pinning_k": 2, "cap": 63},
           "families": families}
    PLAN_FILE.write_text(PLAN_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100))
    return PLAN_FILE


PLAN_HEADER = """\
# Per-model plan (issue 48), written by experiments/campaigns/models_plan.py with the test
# campaign conf/campaign/models.yaml, after the regime stages (capacities, D0's split on
# seeds 43000-43001) and before any test run: page analysis/questions/models.py. One family
# per model (Falcon-H1-7B primary: the step model is calibrated on it; the others'
# step-model terms come from their geometry on the calibrated constants, on the device each
# fits). Cells: S0, S1, S2, D0, N0, Jenga at two budgets (16 and 32 requests at the
# workload's mean) and one load (80 % of the memory-bound capacity of the budget's best
# organization, measured on seed 41000); tests: each organization against that leader;
# seeds: seeds_rule; ties by the equivalence margin; overloaded cells by the bound below.
"""
