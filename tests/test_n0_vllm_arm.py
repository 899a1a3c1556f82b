"""The arm `n0_vllm` (ledgers.arms): N0 under vLLM's rules, one named arm whose rules are
applied as every arm's rules are (experiments.runners.spec) and read back from the engine
into the run's record (docs/engine_rules.md section 17)."""

from __future__ import annotations

import json

import pytest

from analysis.questions import n0_vllm
from experiments.runners.spec import engine_spec
from ledgers.arms import ARMS, VLLM_RULES, arm
from serving_core.builder import build_engine
from serving_core.engine_spec import rule_declarations
from tests.conftest import compose_config

TINY = ("model=falcon_h1_tiny", "budget=b63")


def _effective(*overrides: str) -> dict:
    return build_engine(engine_spec(compose_config(*TINY, *overrides))).effective_rules()


def test_the_arm_runs_vllms_rules_read_back_from_the_engine():
    effective = _effective("org=n0_vllm", "engine.duplicates=drop")  # the arm's rules win
    assert {k: effective[k] for k in VLLM_RULES} == dict(VLLM_RULES)
    assert effective["org"] == "N0"
    default = _effective("org=n0")
    assert all(default[k] != v for k, v in VLLM_RULES.items())  # n0 stays N0's defaults


def test_every_arm_rule_is_a_declared_rule():
    names = {f.name for _, f in rule_declarations()}
    for a in ARMS.values():
        assert set(a.rules) <= names, a.name
    assert arm("n0_vllm").ledger_org == "N0_VLLM" and arm("N0+vLLM").label == "N0+vLLM"


def test_the_record_of_an_n0_vllm_run_is_what_ran(tmp_path):
    """A simulated run of the arm: runs.org N0_VLLM, its label, the effective rules in the
    runs row and the manifest; the comparison page reads it as N0 under vLLM's rules."""
    import ledgers
    from experiments.run import main_run

    main_run(compose_config(*TINY, f"ledger_root={tmp_path}", "org=n0_vllm",
                            "workload.num_requests=4"))
    ((org, label, executor, config),) = ledgers.connect(tmp_path).sql(
        "select org, arm, executor, engine_config from runs").fetchall()
    effective = json.loads(config)
    assert (org, label) == ("N0_VLLM", "N0+vLLM")
    assert {k: effective[k] for k in VLLM_RULES} == dict(VLLM_RULES)
    manifest = json.loads(next(tmp_path.glob("manifests/**/*.json")).read_text())
    assert manifest["engine"] == effective
    assert n0_vllm.arm_of(org, executor, config) == "sim_vllm"


@pytest.mark.parametrize("org, rules, arm_name", [
    ("N0", {**VLLM_RULES, "release_order": "attention_first"}, "sim_vllm"),  # before the arm
    ("N0", {**VLLM_RULES, "duplicates": "drop"}, "sim"),
    ("N0", {}, "sim"),
])
def test_older_n0_runs_are_read_by_their_effective_rules(org, rules, arm_name):
    assert n0_vllm.arm_of(org, "sim:a100-calibrated", json.dumps(rules)) == arm_name
    assert n0_vllm.arm_of(org, "vllm_virtual:a100", json.dumps(rules)) == "vllm"
