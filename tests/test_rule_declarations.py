"""Engine rules are declarations (serving_core/rules.py): a rule added by its declaration
alone is validated, asked for, read back from the engine, recorded, documented and refused
on a bad value; the docs table and the config file agree with the declarations; a run
derives its plan once and builds its engine once."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import make_dataclass
from pathlib import Path

import pytest
from conftest import compose_config

from experiments.config.rule_defaults import register as register_rule_defaults
from experiments.config.validation import validate_config
from experiments.runners.cell import config_hash, run_cell
from experiments.runners.run_plan import plan_run
from serving_core import engine_spec as engine_spec_module
from serving_core.engine_spec import rule_declarations, rules_table
from serving_core.memory import AllocatorRules
from serving_core.rules import declared, default_of, hydra_key, rule

REPO = Path(__file__).resolve().parent.parent
SMALL = ("workload.source=synthetic", "workload.num_requests=12", "org=s1",
         "model=falcon_h1_tiny", "budget=b8", "write_ledgers=false")
# The whole addition of a rule: one declaration on the allocator's rule dataclass
# (here a subclass registered in RULE_SECTIONS, as a test cannot edit memory/rules.py); the
# config then has its key at its default (engine.victim_order=..., no `+`, no YAML).
ADD_RULE = """
from dataclasses import make_dataclass
from serving_core.engine_spec import RULE_SECTIONS
from serving_core.memory import AllocatorRules
from serving_core.rules import rule

RULE_SECTIONS["allocator"] = make_dataclass(
    "WithVictimOrder",
    [("victim_order", str, rule("oldest", "which cached entry an eviction takes first",
                                allowed=("oldest", "newest")))],
    bases=(AllocatorRules,), frozen=True)
"""


@pytest.fixture
def victim_order(monkeypatch):
    """RULE_SECTIONS' allocator entry extended by one declared rule, `victim_order`."""
    cls = make_dataclass(
        "WithVictimOrder",
        [("victim_order", str, rule("oldest", "which cached entry an eviction takes first",
                                    allowed=("oldest", "newest")))],
        bases=(AllocatorRules,), frozen=True)
    monkeypatch.setitem(engine_spec_module.RULE_SECTIONS, "allocator", cls)
    register_rule_defaults()  # what Hydra's start does (hydra_plugins/hsl_rules)
    yield cls
    monkeypatch.undo()
    register_rule_defaults()


def test_a_rule_added_by_its_declaration_alone_runs_and_is_recorded(victim_order):
    cfg = compose_config(*SMALL, "engine.victim_order=newest")
    plan = validate_config(cfg, check_root=False)
    assert isinstance(plan.spec.allocator, victim_order)
    assert plan.spec.requested_rules()["victim_order"] == "newest"
    res = run_cell(cfg, plan=plan)
    assert res.summary["completed"] == 12
    assert res.memory.victim_order == "newest"  # the allocator holds it
    assert res.engine_config["victim_order"] == "newest"  # read back for the record
    assert "| `engine.victim_order` | `oldest` | oldest, newest | allocator" in rules_table()
    # at its declared default it stays out of a run's identity
    assert config_hash(compose_config(*SMALL, "engine.victim_order=oldest")) == \
        config_hash(compose_config(*SMALL))


def test_a_rule_added_by_its_declaration_alone_refuses_a_bad_value(victim_order):
    cfg = compose_config(*SMALL, "engine.victim_order=sideways")
    with pytest.raises(ValueError) as err:
        validate_config(cfg, check_root=False)
    assert str(err.value) == "engine.victim_order='sideways': allowed values are oldest, newest"


def test_a_bad_value_of_an_added_rule_exits_2_with_one_line(tmp_path):
    script = ADD_RULE + "from experiments.run import cli\ncli()\n"
    res = subprocess.run(
        [sys.executable, "-c", script, f"--config-path={REPO / 'conf'}", *SMALL,
         "engine.victim_order=sideways", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: engine.victim_order='sideways': allowed values are oldest, newest"]


def test_docs_table_is_generated_from_the_declarations():
    """docs/engine_rules.md holds rules_table() between its markers (to update it:
    .venv/bin/python -m serving_core.engine_spec --write-docs)."""
    text = (REPO / "docs/engine_rules.md").read_text()
    found = re.search(r"<!-- rules-table:begin.*?-->\n(.*?)<!-- rules-table:end -->", text,
                      re.S)
    assert found, "docs/engine_rules.md: no rules-table markers"
    assert found.group(1) == rules_table()


def test_config_file_sets_every_declared_rule_at_its_declared_default():
    """conf/config.yaml's engine section lists each rule the config sets at the default of
    its declaration (engine.max_num_batched_tokens: null, the executor profile's)."""
    eng = compose_config().engine
    for _, f in rule_declarations():
        if not declared(f).config:
            continue
        expected = None if f.name == "max_num_batched_tokens" else default_of(f)
        assert f.name in eng and eng[f.name] == expected, f.name


def _count_builds(monkeypatch) -> dict[str, int]:
    """Counts of engine assemblies (builder._assemble: a build or a preflight) and budget
    plans from here on."""
    import experiments.config.validation as validation
    import experiments.runners.run_plan as run_plan
    import serving_core.builder as builder
    import serving_core.planner as planner

    calls = {"assemble": 0, "plan_budget": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(builder, "_assemble", counted("assemble", builder._assemble))
    plan_budget = counted("plan_budget", planner.plan_budget)
    for module in (planner, validation, run_plan):
        monkeypatch.setattr(module, "plan_budget", plan_budget)
    return calls


def test_a_run_plans_its_budget_and_builds_its_engine_once(tmp_path, monkeypatch):
    from experiments.run import main_run

    calls = _count_builds(monkeypatch)
    cfg = compose_config(*SMALL[:-1], f"ledger_root={tmp_path}")
    line = main_run(cfg)
    assert line["completed"] == 12 and not line["skipped"]
    assert calls == {"assemble": 1, "plan_budget": 1}


def test_a_torch_run_in_process_builds_its_engine_once(tiny_checkpoint, monkeypatch):
    """The in-process torch run uses its plan's spec and builds its engine (the model
    loaded) once, checked as it is built: no preflight engine beside it."""
    from experiments.run import main_run

    calls = _count_builds(monkeypatch)
    cfg = compose_config(*SMALL, "executor=torch_inproc",
                         f"executor.checkpoint={tiny_checkpoint}",
                         "workload.num_requests=2", "workload.synthetic_prompt_tokens=40",
                         "workload.synthetic_context_tokens=16",
                         "workload.synthetic_output_tokens=2")
    line = main_run(cfg)
    assert line["completed"] == 2 and not line["skipped"]
    assert calls == {"assemble": 1, "plan_budget": 1}


def test_executor_rules_are_declared_on_the_executor_spec():
    """The executor's rules (serving_core/executor/spec.py) are declarations like the
    others: documented in the table, at their declared defaults in the config, asked of the
    executor that runs them only, and refused on a bad value in one line."""
    from serving_core.engine_spec import ExecutorSpec, executor_rule_declarations

    keys = {hydra_key(f) for _, f in executor_rule_declarations()}
    assert keys == {"engine.indirection_overhead", "executor.scan_chunk",
                    "executor.prefill_batch_tokens"}
    table = rules_table()
    assert all(f"| `{key}` |" in table for key in keys)
    assert "| `executor.prefill_batch_tokens` | `null` | integers >= 0 or null" in table
    assert compose_config().engine.indirection_overhead == 0.0  # no line of YAML
    torch = ExecutorSpec(kind="torch", checkpoint="x", prefill_batch_tokens=64)
    assert ExecutorSpec(kind="torch", checkpoint="x").prefill_batch_tokens is None
    cfg = compose_config(*SMALL)
    for ex, asked in ((torch, {"prefill_batch_tokens": 64}), (ExecutorSpec(), {})):
        spec = engine_spec_module.EngineSpec.from_dict(
            {**plan_run(cfg).spec.to_dict(), "executor": ex.__dict__ | {"profile": None}})
        requested = spec.requested_rules()
        assert {k: requested[k] for k in ("prefill_batch_tokens", "scan_chunk",
                                          "indirection_overhead") if k in requested} == asked
    with pytest.raises(ValueError) as err:
        ExecutorSpec(kind="torch", checkpoint="x", prefill_batch_tokens=-1)
    assert str(err.value) == ("executor.prefill_batch_tokens=-1: allowed integers >= 0 or "
                              "null (the executor's default)")
