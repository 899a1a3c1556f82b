"""One engine: every path builds through serving_core.builder and runs the rules its record
states. Expectations are written out by hand per setting (docs/engine_rules.md sections
5-13 and each organization's class), not derived from the code under test."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import compose_config

from experiments.runners.server_process import ServerProcess, hsl_server_command
from experiments.runners.spec import engine_spec
from experiments.serve import server_spec
from ledgers.arms import ARMS, STORAGE_ORGS
from serving_core.builder import build_engine, preflight
from serving_core.engine_spec import EngineSpec, check_effective
from serving_core.memory import ORG_TO_CLASS

REPO = Path(__file__).resolve().parent.parent
RULE_KEYS = ("org", "admission", "checkpoint_placement", "align_chunks", "slab_policy",
             "free_queue", "checkpoint_recency", "retention_k", "pinning_k", "cap", "headroom",
             "interleave", "split_last_boundary", "retention_interval", "optimal_checkpoints")
PAPER_S2 = {"org": "S2", "admission": "full_prompt", "checkpoint_placement": "step_end",
            "align_chunks": True, "slab_policy": "write_once", "free_queue": "free_first",
            "checkpoint_recency": "release", "retention_k": None, "pinning_k": None, "cap": 63,
            "headroom": 0.0, "interleave": None, "split_last_boundary": False,
            "retention_interval": None, "optimal_checkpoints": None}
# (overrides, the rules an engine must run for them), by hand from docs/engine_rules.md
# section 13.
SETTINGS = {
    "paper": ((), PAPER_S2),
    "first_chunk": (("semantics=first_chunk",),
                    {**PAPER_S2, "admission": "first_chunk",
                     "checkpoint_placement": "every_boundary", "align_chunks": False,
                     "slab_policy": "refill"}),
    "admission": (("engine.admission=first_chunk",), {**PAPER_S2, "admission": "first_chunk"}),
    "placement": (("engine.checkpoint_placement=every_boundary",),
                  {**PAPER_S2, "checkpoint_placement": "every_boundary"}),
    "align": (("engine.align_chunks=false",), {**PAPER_S2, "align_chunks": False}),
    "slab_refill": (("engine.slab_policy=refill",), {**PAPER_S2, "slab_policy": "refill"}),
    "slab_dense": (("engine.slab_policy=dense",), {**PAPER_S2, "slab_policy": "dense"}),
    "survival": (("engine.free_queue=single_queue", "engine.checkpoint_recency=publication"),
                 {**PAPER_S2, "free_queue": "single_queue", "checkpoint_recency": "publication"}),
    "split_last": (("engine.split_last_boundary=true",),
                   {**PAPER_S2, "split_last_boundary": True}),
    # D0 runs unaligned chunks: the split rule has nothing to split, and says so.
    "d0_split_last": (("org=d0", "engine.split_last_boundary=true"),
                      {**PAPER_S2, "org": "D0", "checkpoint_placement": "every_boundary",
                       "align_chunks": False, "slab_policy": None}),
    "cap_f_pin": (("engine.cap=9", "engine.headroom=0.19", "engine.pinning_k=2"),
                  {**PAPER_S2, "cap": 9, "headroom": 0.19, "pinning_k": 2}),
    "retention": (("org=s2_retention", "retention.k=3"), {**PAPER_S2, "retention_k": 3}),
    "s0": (("org=s0",), {**PAPER_S2, "org": "S0", "slab_policy": None}),
    "s1_first_chunk": (("org=s1", "semantics=first_chunk"),
                       {**PAPER_S2, "org": "S1", "slab_policy": None,
                        "admission": "first_chunk", "checkpoint_placement": "every_boundary",
                        "align_chunks": False}),
    "d0": (("org=d0",), {**PAPER_S2, "org": "D0", "checkpoint_placement": "every_boundary",
                         "align_chunks": False, "slab_policy": None}),
    "d0_aligned": (("org=d0", "engine.checkpoint_placement=step_end",
                    "engine.align_chunks=true"),
                   {**PAPER_S2, "org": "D0", "slab_policy": None}),
    "d0_interleave": (("org=d0", "engine.interleave={decode_steps:4,prefill_tokens:64}"),
                      {**PAPER_S2, "org": "D0", "checkpoint_placement": "every_boundary",
                       "align_chunks": False, "slab_policy": None,
                       "interleave": {"decode_steps": 4, "prefill_tokens": 64}}),
    "n0": (("org=n0",), {**PAPER_S2, "org": "N0", "checkpoint_placement": "every_boundary",
                         "align_chunks": False, "slab_policy": None}),
    "s2_align": (("engine.checkpoint_placement=align",),
                 {**PAPER_S2, "checkpoint_placement": "align"}),
    "n0_junction_retention": (("org=n0", "engine.checkpoint_placement=junction",
                               "engine.retention_interval=2block"),
                              {**PAPER_S2, "org": "N0", "checkpoint_placement": "junction",
                               "align_chunks": False, "slab_policy": None,
                               "retention_interval": "2block"}),
    # optimal's M, the most positions its dynamic program may choose: the given one here
    "s2_optimal_m": (("engine.checkpoint_placement=optimal:3",),
                     {**PAPER_S2, "checkpoint_placement": "optimal:3",
                      "optimal_checkpoints": 3}),
    "n0_step_end": (("org=n0", "engine.checkpoint_placement=step_end"),
                    {**PAPER_S2, "org": "N0", "checkpoint_placement": "step_end",
                     "align_chunks": False, "slab_policy": None}),
}
TINY = ("model=falcon_h1_tiny", "budget=b63")


def _rules(effective: dict) -> dict:
    return {k: effective[k] for k in RULE_KEYS}


# ----- simulated, in process -----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_simulated_engine_runs_the_configured_rules(name):
    overrides, expected = SETTINGS[name]
    engine = build_engine(engine_spec(compose_config("budget=b63", *overrides)))
    effective = engine.effective_rules()
    assert _rules(effective) == expected
    assert effective["executor"] == "simulated" and effective["clock"] == "virtual"
    assert effective["step_model"] == "additive"  # conf/executor/a100.yaml is calibrated


def test_optimal_records_the_m_it_derives_from_the_budget():
    """`optimal` without M runs the composites the budget holds less the cap's working ones
    (docs/engine_rules.md section 8.5): S2 at b108 holds 331 slab units, 4 a composite, so
    82 composites, 63 of them the cap's: M = 19; at b63 (48 composites, under the cap) at
    least 1."""
    for budget, units, m in (("b108", 331, 19), ("b63", 193, 1)):
        effective = build_engine(engine_spec(compose_config(
            f"budget={budget}", "engine.checkpoint_placement=optimal"))).effective_rules()
        assert effective["pool_units"] == {"shared": units}
        assert (effective["checkpoint_placement"], effective["optimal_checkpoints"]) == (
            "optimal", m)


@pytest.mark.parametrize("org,budget,units,m", [
    ("d0", "b63", {"attention": 3256, "recurrent": 29}, 1),
    ("d0", "b108", {"attention": 5581, "recurrent": 51}, 1),
    ("jenga", "b63", {"attention": 6174, "recurrent": 63}, 1),
    ("jenga", "b108", {"attention": 10584, "recurrent": 108}, 45)])
def test_optimal_m_counts_only_the_recurrent_pool(org, budget, units, m):
    """On D0 and Jenga the budget-derived M counts the recurrent pool alone (one composite a
    unit), never the attention pool: D0 holds 29 composites at b63 and 51 at b108, both
    under the cap of 63, so M = 1; Jenga holds 63 state pages at b63 (63 - 63 = 0, so 1)
    and 108 at b108: M = 108 - 63 = 45."""
    effective = build_engine(engine_spec(compose_config(
        f"budget={budget}", f"org={org}", "engine.checkpoint_placement=optimal"))).effective_rules()
    assert effective["pool_units"] == units
    assert effective["optimal_checkpoints"] == m


def test_step_model_of_each_profile_is_the_one_it_names():
    """Drift 3: a profile's step model is the one its file names, on every path."""
    for profile, kind in (("a100", "additive"), ("a100_roofline", "roofline"),
                          ("h200", "roofline")):
        spec = engine_spec(compose_config(f"executor={profile}"))
        assert build_engine(spec).effective_rules()["step_model"] == kind
        served = server_spec([f"executor={profile}", "model=falcon_h1_tiny"])
        assert served.executor.kind == "paced"
        assert build_engine(served).effective_rules()["step_model"] == kind


# ----- the real executor in process ----------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_torch_inproc_engine_runs_the_configured_rules(name, tiny_checkpoint, tiny_model):
    """Drift 2 (slab policy lost in the torch engine) among them."""
    overrides, expected = SETTINGS[name]
    cfg = compose_config(*TINY, "executor=torch_inproc",
                         f"executor.checkpoint={tiny_checkpoint}", *overrides)
    engine = build_engine(engine_spec(cfg), model=tiny_model)
    effective = engine.effective_rules()
    assert _rules(effective) == expected
    assert (effective["executor"], effective["clock"]) == ("torch", "wall")
    assert engine.mem.has_slabs == (expected["slab_policy"] is not None)
    if engine.mem.has_slabs:
        assert engine.mem.write_once == (expected["slab_policy"] == "write_once")


def test_a_real_run_records_its_process_settings(tiny_checkpoint):
    """Wall-clock timings depend on the process: the record carries its intra-op threads
    and allocator, read back from the process (the server's `runtime` line over HTTP)."""
    import torch

    from experiments.runners.cell import run_cell
    from serving_core.server.process_settings import allocator_in_use

    cfg = compose_config(*TINY, "executor=torch_inproc", f"executor.checkpoint={tiny_checkpoint}",
                         "workload.source=synthetic", "workload.num_requests=2",
                         "workload.synthetic_prompt_tokens=40",
                         "workload.synthetic_context_tokens=16",
                         "workload.synthetic_output_tokens=2", "write_ledgers=false")
    runtime = run_cell(cfg).engine_config["runtime"]
    assert runtime["threads"] == torch.get_num_threads()
    assert runtime["allocator"] == allocator_in_use() in ("glibc", "tcmalloc")


# ----- over HTTP: the server builds from the whole spec ----------------------------------------
def _served_rules(tmp_path: Path, spec: EngineSpec) -> dict:
    """The rules the server reads back, served without the warm-up (a torch model's: about
    1 CPU s of prefill and decode that decide no rule; tests/test_warmup.py tests it)."""
    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    cmd = [*hsl_server_command(spec=str(path)), "--warm-up", "off"]
    with ServerProcess(cmd, health_timeout_s=120) as srv:
        return srv.engine_config()


# A server process per setting (~1.2 s of CPU and a second or more of boot each). The server's
# own build path (spec file -> load_spec -> build_engine, what the process runs before it
# prints its `engine` line) runs in process for every setting; the default suite serves one
# setting end to end over HTTP (d0_interleave: the most rule keys, a nested value among them)
# and the others with the slow tests. The settings built by default through the server's path
# between them change every rule key (checked below).
SERVED_BY_DEFAULT = ("first_chunk", "survival", "cap_f_pin", "retention", "d0_aligned",
                     "split_last", "d0_interleave", "n0_junction_retention", "s2_optimal_m")
SERVED_OVER_HTTP_BY_DEFAULT = ("d0_interleave",)


def test_served_settings_of_the_default_suite_change_every_rule():
    changed = {k for name in SERVED_BY_DEFAULT for k, v in SETTINGS[name][1].items()
               if v != PAPER_S2[k]}
    assert changed == set(RULE_KEYS)


def _server_build_rules(tmp_path: Path, spec: EngineSpec) -> dict:
    """The rules of the engine the server builds from `spec` written to a spec file, in
    process (serving_core/server/__main__.py: load_spec, with_host_tier, build_engine)."""
    from serving_core.server.__main__ import build_engine as server_build
    from serving_core.server.__main__ import load_spec, with_host_tier

    path = tmp_path / "spec.json"
    path.write_text(spec.to_json())
    return server_build(with_host_tier(load_spec(str(path)), None)).effective_rules()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_paced_server_build_path_runs_the_configured_rules(name, tmp_path):
    overrides, expected = SETTINGS[name]
    effective = _server_build_rules(tmp_path, server_spec([*TINY, *overrides]))
    assert _rules(effective) == expected
    assert (effective["executor"], effective["step_model"]) == ("paced", "additive")


@pytest.mark.parametrize("name", [n if n in SERVED_OVER_HTTP_BY_DEFAULT else
                                  pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(SETTINGS)])
def test_paced_server_runs_the_configured_rules(name, tmp_path):
    overrides, expected = SETTINGS[name]
    effective = _served_rules(tmp_path, server_spec([*TINY, *overrides]))
    assert _rules(effective) == expected
    assert (effective["executor"], effective["step_model"]) == ("paced", "additive")


def _torch_spec(name: str, tiny_checkpoint) -> EngineSpec:
    return engine_spec(compose_config(*TINY, "executor=torch",
                                      f"executor.checkpoint={tiny_checkpoint}",
                                      *SETTINGS[name][0]))


# An interpreter start per server (~2 s of CPU): the default suite serves first_chunk end to
# end; the server's own build path (spec file -> load_spec -> build_engine) runs in process
# for the others below, and all of them over HTTP with the slow tests.
@pytest.mark.parametrize("name", ["first_chunk",
                                  *(pytest.param(n, marks=pytest.mark.slow)
                                    for n in ("slab_refill", "n0", "n0_junction_retention"))])
def test_torch_server_runs_the_configured_rules(name, tmp_path, tiny_checkpoint):
    """Drift 1: `semantics=first_chunk executor=torch` ran the paper rules over HTTP."""
    effective = _served_rules(tmp_path, _torch_spec(name, tiny_checkpoint))
    assert _rules(effective) == SETTINGS[name][1]
    assert effective["executor"] == "torch"


@pytest.mark.parametrize("name", ["first_chunk", "slab_refill", "n0", "n0_junction_retention"])
def test_torch_server_build_path_runs_the_configured_rules(name, tmp_path, tiny_checkpoint):
    """The server's build from a spec file, in process: the rules the served engine runs."""
    effective = _server_build_rules(tmp_path, _torch_spec(name, tiny_checkpoint))
    assert _rules(effective) == SETTINGS[name][1]
    assert effective["executor"] == "torch"


# ----- refusal ---------------------------------------------------------------------------------
def test_an_engine_that_cannot_run_the_requested_rules_is_refused():
    """Aligned chunks need a token budget that reaches a boundary: asked for explicitly
    with a smaller budget, the scheduler would silently run unaligned chunks, so the run is
    refused with one line instead. (The organization's default, null, means aligned only
    where the budget reaches a boundary, and is recorded as what ran.)"""
    small = compose_config("engine.max_num_batched_tokens=256")
    assert build_engine(engine_spec(small)).effective_rules()["align_chunks"] is False
    spec = engine_spec(compose_config("engine.max_num_batched_tokens=256",
                                      "engine.align_chunks=true"))
    with pytest.raises(ValueError, match="align_chunks requested true, effective false"):
        build_engine(spec)
    with pytest.raises(ValueError, match="^engine rules differ from the request: "):
        preflight(spec)
    with pytest.raises(ValueError, match="checkpoint_placement requested step_end, effective"):
        check_effective({"checkpoint_placement": "step_end"},
                        {"checkpoint_placement": "every_boundary"})


def test_refused_run_exits_2_and_writes_nothing(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "ledgers"
    res = subprocess.run([sys.executable, "-m", "experiments.run", f"ledger_root={root}",
                          "engine.max_num_batched_tokens=256", "engine.align_chunks=true"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: engine rules differ from the request")
    assert not any(p.is_file() for p in root.rglob("*"))


def test_the_record_is_what_ran(tmp_path):
    """The runs row's engine_config and the manifest carry the engine's effective rules."""
    import ledgers
    from experiments.run import main_run

    cfg = compose_config(f"ledger_root={tmp_path}", "semantics=first_chunk",
                         "workload.num_requests=20", "org=s1")
    main_run(cfg)
    row = ledgers.connect(tmp_path).sql("select engine_config from runs").fetchall()
    effective = json.loads(row[0][0])
    assert _rules(effective) == SETTINGS["s1_first_chunk"][1]
    assert effective["step_model"] == "additive" and effective["executor"] == "simulated"
    manifest = json.loads(next(tmp_path.glob("manifests/**/*.json")).read_text())
    assert manifest["engine"] == effective


def test_spec_round_trips_through_json():
    spec = engine_spec(compose_config("org=s2_retention", "semantics=first_chunk",
                                      "engine.pinning_k=2"))
    again = EngineSpec.from_json(spec.to_json())
    assert again == spec and again.requested_rules() == spec.requested_rules()
    with pytest.raises(ValueError, match=r"engine spec: scheduler: unknown keys \['colour'\]"):
        EngineSpec.from_dict({**spec.to_dict(), "scheduler": {"colour": 1}})


def test_retention_is_refused_on_an_organization_without_it():
    spec = engine_spec(compose_config("org=s1"))
    bad = replace(spec, scheduler=replace(spec.scheduler, retention_k=2))
    with pytest.raises(ValueError, match="retention_k=2: checkpoint retention applies to S2"):
        build_engine(bad)


# ----- one table of names, one construction site ------------------------------------------------
def test_arm_table_names_the_registered_organizations():
    assert set(STORAGE_ORGS) == set(ORG_TO_CLASS)
    for arm in ARMS.values():
        cls = ORG_TO_CLASS[arm.org]
        assert cls.org == arm.org
        assert not arm.retention or cls.supports_retention


def _python_sources():
    for top in ("serving_core", "experiments", "analysis", "ledgers", "bench", "hydra_plugins"):
        yield from (REPO / top).rglob("*.py")


def test_rule_dataclasses_are_made_from_data_in_one_place():
    """The engine's rule dataclasses (SchedulerConfig, AllocatorRules: RULE_SECTIONS) are
    made from data only in serving_core/engine_spec.py, which builds them through
    RULE_SECTIONS (from_dict, rule_sections); elsewhere at most their defaults are made."""
    from serving_core.engine_spec import RULE_SECTIONS

    names = {cls.__name__ for cls in RULE_SECTIONS.values()}
    assert names == {"SchedulerConfig", "AllocatorRules"}
    sites = []
    for path in _python_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in names and (node.args or node.keywords)):
                sites.append(str(path.relative_to(REPO)))
    assert sites == []


def test_no_module_spells_a_tuple_of_organization_names():
    """Lists of org or arm names live in ledgers.arms (serving_core iterates its registry,
    memory.ORG_TO_CLASS, built from the organization classes);
    anywhere else a tuple, list or set naming four or more organizations is a second table
    (a question's own pair or chain, such as Q1's S0 -> S1 -> S2, is its design)."""
    names = {a.name for a in ARMS.values()} | {a.ledger_org for a in ARMS.values()}
    allowed = {"ledgers/arms.py"}
    offenders = []
    for path in _python_sources():
        rel = str(path.relative_to(REPO))
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if sum(isinstance(v, str) and v in names for v in values) >= 4:
                    offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_server_help_names_no_organization_flags():
    """The server takes the whole spec; no hand-picked subset of engine flags remains."""
    from serving_core.server.__main__ import parser

    flags = {a.dest for a in parser()._actions}
    assert not flags & {"org", "budget", "cap", "headroom", "retention_k", "pinning_k",
                        "admission", "slab_policy"}
    assert re.search(r"--spec", parser().format_help())


def test_runner_and_analysis_hash_plans_the_same_way():
    from analysis.inference.prereg import PLAN_DIR, load_plan
    from experiments.runners.provenance import prereg_plan_hash

    for path in sorted(PLAN_DIR.glob("q*.yaml")):
        assert prereg_plan_hash(path.stem) == load_plan(path.stem).plan_hash != ""
    assert prereg_plan_hash("no_such_question") == ""


def test_layering_imports_flow_one_way():
    """analysis -> ledgers <- experiments -> serving_core. ledgers is the shared leaf
    (schemas, arms, plan hashing) and imports none of the others; serving_core imports
    neither experiments nor analysis; experiments never imports analysis."""
    forbidden = {"serving_core": ("experiments", "analysis"),
                 "ledgers": ("experiments", "analysis", "serving_core"),
                 "experiments": ("analysis",)}
    found = []
    for top, banned in forbidden.items():
        for path in (REPO / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path.relative_to(REPO)} imports {n}" for n in names
                          if n.split(".")[0] in banned]
    assert found == []


def test_keys_added_at_their_neutral_default_keep_run_identities():
    """A key added after runs were collected (engine.reserve_output_tokens) leaves a cell's
    identity unchanged at the default that reproduces the earlier engine."""
    from omegaconf import OmegaConf, open_dict

    from experiments.runners.cell import config_hash, identity_neutral_defaults

    for (section, key), default in identity_neutral_defaults().items():
        # executor keys live in the executors that have them (the real one's, or the
        # simulated profiles' additive terms)
        real = section == "executor" and key == "prefill_batch_tokens"
        overrides = ("executor=torch_inproc",) if real else ()
        cfg = compose_config(*overrides)
        base = config_hash(cfg)
        assert cfg[section][key] == default  # the config's default is the neutral one
        old = OmegaConf.to_container(cfg, resolve=True)
        del old[section][key]
        assert config_hash(old) == base
        other = compose_config(*overrides)
        with open_dict(other):
            other[section][key] = (not default if isinstance(default, bool) else default + 1
                                   if isinstance(default, int) else "other")
        assert config_hash(other) != base
