"""The organization registry (serving_core.memory.ORG_TO_CLASS) is the one place per organization.

Every registered class states its own rules; an unknown organization is refused in one
line at every entry point; no module of serving_core outside an organization's own
module compares an organization's name; and an organization added as one class plus one
registry line is sized, planned, priced, built, served and addressed with no other edit.
Expected numbers are worked out by hand in the comments.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import pytest
from conftest import compose_config

from serving_core.geometry import available_models, load_geometry
from serving_core.layout import PAGED_BLOCK_TOKENS, OrgLayout, paged_page_bytes
from serving_core.memory import (
    CONV_ADDRESSING,
    ORG_TO_CLASS,
    S1RecurrentPaging,
    build_memory,
    normalize_org,
    org_class,
    org_layout,
)

REPO = Path(__file__).resolve().parent.parent
UNKNOWN = "tetris"  # not registered
ALLOWED = "allowed values are S0, S1, S2, D0, N0, JENGA"
# (organization, preset) pairs an organization cannot hold: Zamba2-7B's one storage group
# has 13 attention layers (its shared-block calls), N0 pages one attention layer per group.
# N0: Zamba2's shared blocks; every int8-state preset (vLLM's Mamba page has no int8 dtype)
REFUSED = {("N0", "zamba2_7b")} | {("N0", m) for m in available_models() if m.endswith("_int8")}


def test_every_registered_class_states_its_rules():
    for org, cls in ORG_TO_CLASS.items():
        assert cls.org == org and normalize_org(org.lower()) == org
        assert cls.conv_addressing in CONV_ADDRESSING
        assert {cls.attention_pool, cls.composite_pool} <= set(cls.pool_names)
        assert not cls.has_slabs or cls.conv_addressing == "slot"
        for model in available_models():
            geometry = load_geometry(model)
            if (org, model) in REFUSED:  # refused alone, in one line naming both
                with pytest.raises(ValueError, match=f"^org={org.lower()} cannot hold model "
                                                     f"'{model}': [^\n]*$"):
                    cls.unit_layout(geometry)
                continue
            layout = cls.unit_layout(geometry)
            assert layout.org == org and org_layout(geometry, org) == layout
            assert set(cls.pool_unit_bytes(layout)) == set(cls.pool_names)
            assert set(cls.min_units(layout)) == set(cls.pool_names)
            plan = cls.plan_pools(geometry, layout, 10 * paged_page_bytes(geometry))
            assert tuple(p.pool for p in plan) == cls.pool_names
            assert all(p.org == org for p in plan)


def test_no_serving_core_module_compares_an_organization_name():
    """Outside its own module no code names an organization (a docstring may): a size, a
    pool, a cost or an address by name is a chain the next organization would miss."""
    own = {f"serving_core/memory/{org.lower()}.py" for org in ORG_TO_CLASS}
    offenders = []
    for path in sorted((REPO / "serving_core").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in own:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and id(node) not in docstrings
                    and isinstance(node.value, str) and node.value.upper() in ORG_TO_CLASS):
                offenders.append(f"{rel}:{node.lineno} {node.value!r}")
    assert offenders == []


# ----- an unknown organization --------------------------------------------------------------
def _refusals():
    """(entry point, call) for every way in that takes an organization's name."""
    from experiments.config.validation import validate_config
    from experiments.runners.spec import engine_spec
    from serving_core import planner, storage
    from serving_core.executor.simulated import build_step_model
    from serving_core.executor.state_arena import StateArena

    falcon, tiny = load_geometry("falcon_h1_7b"), load_geometry("falcon_h1_tiny")
    plan = planner.plan_budget(falcon, "b63")

    class Unregistered(S1RecurrentPaging):
        org = UNKNOWN.upper()

    unregistered = Unregistered(org_layout(tiny, "S1"), {"shared": 8})
    spec = engine_spec(compose_config("org=s1", "budget=b63"))
    return [
        ("normalize_org", lambda: normalize_org(UNKNOWN)),
        ("org_class", lambda: org_class(UNKNOWN)),
        ("org_layout", lambda: org_layout(falcon, UNKNOWN)),
        ("plan.pools_of", lambda: plan.pools_of(UNKNOWN)),
        ("units_for", lambda: planner.units_for(plan, UNKNOWN)),
        ("plan_to_dict", lambda: planner.plan_to_dict(plan, [UNKNOWN])),
        ("format_plan", lambda: planner.format_plan(plan, [UNKNOWN])),
        ("allocation_cost", lambda: storage.allocation_cost(falcon, UNKNOWN, 1, 1)),
        ("capacity", lambda: storage.capacity(falcon, UNKNOWN, (1, 1), 2**27)),
        ("fits", lambda: storage.fits(falcon, UNKNOWN, 1, 1, 2**27)),
        ("build_memory", lambda: build_memory(falcon, UNKNOWN, {"shared": 63})),
        ("StateArena", lambda: StateArena(unregistered, tiny)),
        ("step model", lambda: build_step_model(falcon, "a100", UNKNOWN)),
        ("EngineSpec", lambda: dataclasses.replace(spec, org=UNKNOWN)),
    ], lambda: validate_config(compose_config(f"org={UNKNOWN}"), check_root=False)


def test_an_unknown_organization_is_refused_at_every_entry_point(capsys):
    from serving_core import planner, storage

    calls, run_config = _refusals()
    for where, call in calls:
        with pytest.raises(ValueError) as err:
            call()
        message = str(err.value)
        assert "\n" not in message, where
        assert message.lower().startswith(f"org='{UNKNOWN}'"), (where, message)
        assert message.endswith(ALLOWED), (where, message)
    # a run's config names arms (ledgers/arms.py), lower case
    with pytest.raises(ValueError, match=rf"^org='{UNKNOWN}': allowed values are s0, s1, s2, d0"):
        run_config()
    # the command lines: exit 2, one line on stderr naming the field, nothing on stdout
    for main, argv in ((planner.main, ["--model", "falcon_h1_7b", "--budget", "b63"]),
                       (storage.main, ["--model", "falcon_h1_7b", "--capacity-mib", "100",
                                       "--mix", "1,1"])):
        assert main([*argv, "--org", UNKNOWN]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and f"org='{UNKNOWN}'" in err
        assert err.rstrip().endswith(ALLOWED)


def test_the_command_lines_show_the_organizations_asked_for(capsys):
    from serving_core import planner, storage

    assert planner.main(["--model", "falcon_h1_7b", "--budget", "b63", "--org", "d0",
                         "--org", "s2", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert list(data["orgs"]) == ["S2", "D0"]  # registry order
    # b63 = 63 x 1,605,632 = 101,154,816 B; S2 pages round(101,154,816 / 524,288) = 193
    assert data["orgs"]["S2"]["units"] == 193
    assert storage.main(["--model", "falcon_h1_7b", "--attention-blocks", "1",
                         "--checkpoints", "1", "--org", "S0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"S0": {"bytes": 2 * 1_594_368,
                                                         "mib": 2 * 1_594_368 / 2**20}}


# ----- an organization added with one class and one registry line ----------------------------
HALF_BLOCK = PAGED_BLOCK_TOKENS // 2


class HalfPagePaging(S1RecurrentPaging):
    """S1's mechanics on 256-token pages: a test organization defined only here."""

    org = "T1"

    @classmethod
    def unit_layout(cls, geometry):
        page = HALF_BLOCK * geometry.attention_bytes_per_token
        members = math.ceil(geometry.ssm_bytes / page)
        return OrgLayout(org=cls.org, block_tokens=HALF_BLOCK,
                         checkpoint_interval=PAGED_BLOCK_TOKENS, page_bytes=page,
                         units_per_composite=members + 1, ssm_members=members, conv_pages=1)


@pytest.fixture
def half_pages(monkeypatch):
    monkeypatch.setitem(ORG_TO_CLASS, HalfPagePaging.org, HalfPagePaging)
    return HalfPagePaging


def test_a_registered_class_is_planned_and_priced_with_no_other_edit(half_pages):
    from serving_core import planner, storage

    falcon = load_geometry("falcon_h1_7b")
    layout = org_layout(falcon, "t1")
    # 256 x 1,024 = 262,144-B pages; ceil(1,572,864 / 262,144) = 6 members + 1 conv page
    assert (layout.page_bytes, layout.ssm_members, layout.units_per_composite) == (
        262_144, 6, 7)
    plan = planner.plan_budget(falcon, "b63")
    # 101,154,816 / 262,144 = 385.875 -> 386 pages (its class keeps S1's rounding)
    assert planner.units_for(plan, "T1") == {"shared": 386}
    assert "T1" in planner.format_plan(plan) and "T1" in planner.plan_to_dict(plan)["orgs"]
    # a 512-token block is 2 pages; a checkpoint 7: (2 + 7) x 262,144 = 2,359,296 B
    assert storage.cost(falcon, "T1", 1, 1) == 2_359_296
    # 100 MiB = 400 pages: 400 // 9 = 44 copies of (1, 1)
    assert storage.capacity(falcon, "T1", (1, 1), 100 * 2**20) == 44
    with pytest.raises(ValueError, match="budget='b1' cannot hold one checkpoint .*T1 shared"):
        planner.plan_budget(falcon, "b1")  # 6 pages < the 7 of one checkpoint


def test_a_registered_class_serves_a_workload_with_no_other_edit(half_pages):
    from experiments.runners.spec import engine_spec
    from experiments.workloads.workload import build_workload
    from serving_core.builder import build_engine
    from serving_core.engine import serve
    from serving_core.memory.invariants import check_invariants

    cfg = compose_config("org=s1", "budget=b63", "workload.source=synthetic",
                         "workload.num_requests=30", "workload.synthetic_prompt_tokens=1400",
                         "workload.synthetic_context_tokens=1200",
                         "workload.synthetic_output_tokens=24", "load.rate=4")
    spec = dataclasses.replace(engine_spec(cfg), org="t1")
    engine = build_engine(spec, on_step=lambda sched, mem: check_invariants(mem))
    result = serve(engine, build_workload(cfg.workload, cfg.load, int(cfg.seed)).requests)
    assert result.summary["completed"] == 30 and result.summary["failed"] == 0
    rules = result.engine_config
    assert rules["org"] == "T1" and rules["pool_units"] == {"shared": 386}
    assert rules["pool_unit_bytes"] == {"shared": 262_144}
    assert rules["checkpoint_placement"] == "step_end" and rules["align_chunks"] is True
    # shared 1,200-token contexts: checkpoints at 512 and 1,024 are adopted
    assert result.summary["prefix_hit_tokens_cross"] > 0


def test_a_registered_class_is_addressed_by_the_arena_with_no_other_edit(half_pages):
    import torch

    from serving_core.executor.state_arena import StateArena

    tiny = load_geometry("falcon_h1_tiny")
    mem = build_memory(tiny, "T1", {"shared": 40})
    arena = StateArena(mem, tiny)
    first, second = mem.allocate_composite(1), mem.allocate_composite(2)
    gen = torch.Generator().manual_seed(0)
    states = [[(torch.randn(1, *arena.conv_shape, generator=gen),
                torch.randn(1, *arena.ssm_shape, generator=gen)) for _ in range(arena.layers)]
              for _ in (first, second)]
    arena.write(first, states[0])
    arena.write(second, states[1])
    for obj, want in zip((first, second), states, strict=True):
        for (conv, ssm), (conv_want, ssm_want) in zip(arena.read(obj), want, strict=True):
            assert torch.equal(conv, conv_want.to(arena.dtype).float())
            assert torch.equal(ssm, ssm_want.to(arena.dtype).float())
    # the conv window sits at the start of the page after the SSM members
    conv_page = mem.conv_line(first)
    assert conv_page == first.units[mem.layout.ssm_members]
    row = arena.pools["shared"][0, conv_page, : arena.conv_elems]
    assert torch.equal(row.float(), states[0][0][0].reshape(-1).to(arena.dtype).float())
