"""The engine's boundaries: one way to build an engine, the state manager's ownership of a
request's state objects, the host tier behind its interface, one list of executor rule
keys, one run-summary builder (checked against values computed by hand)."""

from __future__ import annotations

import ast
import math
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import call_sites, compose_config
from omegaconf import open_dict

from experiments.runners.spec import engine_spec
from serving_core.builder import build_engine, preflight
from serving_core.engine_spec import RULE_SECTIONS
from serving_core.executor.base import EXECUTOR_RULE_KEYS, Executor
from serving_core.records import run_summary

REPO = Path(__file__).resolve().parent.parent
CORE = REPO / "serving_core"
# What HybridStateManager records on a request (serving_core/state_manager.py's doc).
MANAGER_FIELDS = {"attn", "working", "adopted", "dests", "retained", "pin", "memo_hit",
                  "memo_version"}


def _tree(rel: str) -> ast.Module:
    return ast.parse((REPO / rel).read_text())


def _attributes(tree: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


# ----- one way to build an engine -------------------------------------------------------------
def test_only_the_builder_constructs_an_engine():
    assert call_sites(CORE.rglob("*.py"), "Engine") == ["serving_core/builder.py"]


def test_the_engine_declares_every_attribute_it_sets_and_nobody_else_sets_one():
    cls = next(n for n in _tree("serving_core/engine.py").body
               if isinstance(n, ast.ClassDef) and n.name == "Engine")
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    assigned = {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign | ast.AnnAssign)
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    public = {a for a in assigned if not a.startswith("_")}
    assert public and public <= declared
    builder = _tree("serving_core/builder.py")
    assert not [t for n in ast.walk(builder) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "engine"]


def test_every_executor_says_whether_it_reads_state(tiny_model):
    from serving_core.builder import loaded_model_spec
    from serving_core.geometry import load_geometry

    sim = build_engine(engine_spec(compose_config()))
    assert sim.executor.reads_state is False and sim.sched.state_views is False
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63", {})
    real = build_engine(spec, model=tiny_model)
    assert real.executor.reads_state is True and real.sched.state_views is True
    assert "reads_state" in Executor.__annotations__  # the protocol names it


# ----- the state manager's boundary -----------------------------------------------------------
def test_the_scheduler_reads_no_field_the_state_manager_owns():
    assert _attributes(_tree("serving_core/scheduler.py")) & MANAGER_FIELDS == set()


def test_the_host_tier_touches_no_queue_allocator_or_arena():
    """serving_core/host_tier.py sees keys and tensors: every allocation, publication,
    lookup and copy goes through the state manager and the executor's copy port."""
    tree = _tree("serving_core/host_tier.py")
    reached = _attributes(tree) & {
        "sched", "waiting", "running", "mem", "cache", "pools", "arena", "executor",
        "kv_view", "allocate_attention", "allocate_composite", "publish", "acquire",
        "release", "drop_cached", "lookup", "usage"}
    assert reached == set()
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                and (n.module or "").startswith("serving_core")}
    assert imported == {"serving_core.state_manager"}


def test_nothing_outside_the_scheduler_changes_its_queues():
    """The queues are the scheduler's: the engine and the server read their lengths, and
    change them only through Scheduler methods (add_request, abort_waiting)."""
    sites = []
    for path in CORE.rglob("*.py"):
        if path.name == "scheduler.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute)
                    and node.func.value.attr in ("waiting", "running")
                    and node.func.attr in ("remove", "append", "appendleft", "pop",
                                           "popleft", "clear", "insert", "extend")):
                sites.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert sites == []


# ----- one list of executor rule keys ---------------------------------------------------------
def test_executor_rules_use_the_one_list_of_keys(tiny_model):
    from serving_core.builder import loaded_model_spec
    from serving_core.geometry import load_geometry

    for executor in ("a100", "a100_roofline"):
        spec = engine_spec(compose_config(f"executor={executor}"))
        engine = build_engine(spec)
        assert engine.executor.describe().keys() == {"executor", "step_model", "profile",
                                                      "indirection"}
        requested = spec.requested_rules()
        assert {k for k in requested if k in EXECUTOR_RULE_KEYS} == {"executor", "step_model"}
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63", {})
    described = build_engine(spec, model=tiny_model).executor.describe()
    assert described.keys() == {"executor", "device", "dtype", "scan_chunk", "kv_codec",
                                "kv_group_heads", "prefill_batch_tokens", "decode_attention"}
    assert described.keys() <= set(EXECUTOR_RULE_KEYS)
    # preflight leaves exactly these keys to the built executor
    effective = preflight(spec)
    assert not effective.keys() & (set(EXECUTOR_RULE_KEYS) - {"step_model"})


# ----- scheduler defaults come from SchedulerConfig -------------------------------------------
def test_a_config_without_the_optional_engine_keys_gets_scheduler_config_defaults():
    cfg = compose_config()
    optional = ("admission", "reserve_output_tokens", "checkpoint_placement", "align_chunks",
                "slab_policy", "free_queue", "checkpoint_recency", "interleave",
                "split_last_boundary")
    with open_dict(cfg):
        for key in optional:
            del cfg.engine[key]
    got = engine_spec(cfg)
    # each rule's declared default, from the dataclass of the layer that owns it
    defaults = {f.name: getattr(cls(), f.name)
                for cls in RULE_SECTIONS.values() for f in fields(cls)}
    owner = {f.name: section for section, cls in RULE_SECTIONS.items() for f in fields(cls)}
    values = {k: getattr(getattr(got, owner[k]), k) for k in optional}
    assert values == {k: defaults[k] for k in optional}
    full = engine_spec(compose_config())  # the config's values are these
    assert (full.scheduler, full.allocator) == (got.scheduler, got.allocator)


# ----- one run-summary builder ----------------------------------------------------------------
def test_run_summary_by_hand():
    """Three requests, by hand: r0 arrives 1, first token 2, finishes 5 with 4 tokens; r1
    arrives 0, first 3, finishes 4 with 1 token; r2 arrives 0.5 and did not complete."""
    s = run_summary(arrival_s=[1.0, 0.0, 0.5], first_token_s=[2.0, 3.0, 4.0],
                    finish_s=[5.0, 4.0, math.nan], output_tokens=[4, 1, 2],
                    done=[True, True, False], episode_end_s=6, sim_seconds=5.5,
                    wall_seconds=0.25, inter_token_s=[1.0, 1.0, 1.0])
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 5)
    assert (s["span_start_s"], s["span_end_s"], s["episode_end_s"]) == (0.0, 5.0, 6)
    assert s["throughput_ledger"] == pytest.approx(5 / 6)
    assert s["throughput_span"] == pytest.approx(5 / 5)
    assert s["ttft_p50"] == pytest.approx(2.0)  # TTFTs 1 and 3
    assert s["ttft_p99"] == pytest.approx(1 + 0.99 * 2)
    assert s["e2e_p50"] == pytest.approx(4.0)  # E2Es 4 and 4
    assert s["tpot_p99"] == pytest.approx(1.0)  # r0: (5 - 2) / 3; r1 has one token
    assert (s["itl_p50"], s["itl_p99"]) == (1.0, 1.0)
    assert (s["sim_seconds"], s["wall_seconds"], s["episode_start_s"]) == (5.5, 0.25, 0)
    bare = run_summary(arrival_s=[], first_token_s=[], finish_s=[], output_tokens=[],
                       done=[], episode_end_s=0, sim_seconds=0.0, wall_seconds=0.0)
    assert "itl_p50" not in bare and bare["throughput_ledger"] == 0.0
    assert math.isnan(bare["ttft_p50"]) and bare["span_start_s"] == 0.0
