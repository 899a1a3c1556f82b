"""The preregistered plan of the `models` campaign (conf/prereg/models.yaml), written with
its test campaign by experiments/campaigns/models_regime.py before any test run exists.

One family per model (Falcon-H1-7B primary: the step model is calibrated on it), cells per
organization, budget and load, every pair of organizations per budget and load (Holm over
the family), and the practical-equivalence margin the page calls ties with (EQUIVALENCE).
"""

from __future__ import annotations

import itertools
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


def _cells(entry: dict, orgs) -> list[dict]:
    cells = []
    for (level, mib), (load, rate) in itertools.product(entry["budgets"].items(),
                                                        entry["rates"].items()):
        for org in orgs:
            ledger_org = arm(org).ledger_org
            cell = {"id": f"{ledger_org}_{level}_{load}", "org": ledger_org,
                    "budget": f"{mib}MiB", "rate": rate}
            if ledger_org == "D0":
                cell["d0_attention_fraction"] = entry["d0_split"]["fraction"]
            cells.append(cell)
    return cells


def _tests(cells: list[dict]) -> list[dict]:
    tests = []
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault(tuple(c["id"].split("_", 1)[1:]), []).append(c)
    for (tail,), group in groups.items():
        for a, b in itertools.combinations(group, 2):
            tests.append({"id": f"{b['org']}_vs_{a['org']}_{tail}", "kind": "paired",
                          "treatment": b["id"], "control": a["id"], "predicted": "none"})
    return tests


def write_plan(regime: dict, orgs, seeds) -> Path:
    families = []
    for i, (model, entry) in enumerate(regime.items()):
        cells = _cells(entry, orgs)
        families.append({
            "name": model, "role": "primary" if i == 0 else "secondary",
            "description": f"{TITLES.get(model, model)} on {entry['device_name']}: every "
                           "organization at each budget and load; every pair per budget and "
                           "load, Holm over the family.",
            "seeds": list(seeds),
            "defaults": {"model": model, "executor": f"sim:{entry['device_name']}"},
            "cells": cells,
            "estimands": [{"name": "throughput_span", "metric": "throughput_span",
                           "role": "primary"},
                          {"name": "throughput_ledger", "metric": "throughput_ledger",
                           "role": "sensitivity"}],
            "decision": DECISION, "tests": _tests(cells)})
    doc = {"question": "MODELS", "campaign": "models",
           "title": "Which memory organization serves each hybrid model best", "alpha": 0.05,
           "equivalence": EQUIVALENCE,
           "defaults": {"arrival": "poisson", "trace": False, "f": 0.0, "reuse": "share",
                        "q": 1.0, "pinning_k": 2, "cap": 63},
           "families": families}
    PLAN_FILE.write_text(PLAN_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100))
    return PLAN_FILE


PLAN_HEADER = """\
# Per-model plan (issue 48), written by experiments/campaigns/models_plan.py with the test
# campaign conf/campaign/models.yaml, after the regime stages (ceilings, D0's split on
# seeds 43000-43001) and before any test run: page analysis/questions/models.py. One family
# per model (Falcon-H1-7B primary: the step model is calibrated on it; the others'
# step-model terms come from their geometry on the calibrated constants, on the device each
# fits). Cells: S0, S1, S2, D0, N0, Jenga at two budgets (16 and 32 requests at the
# workload's mean) and two loads (60 and 90 % of the model's measured ceiling); ties by the
# equivalence margin below.
"""
