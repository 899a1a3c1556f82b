"""N0, vLLM's native uniform-page organization: geometry, units, planner, storage, runs.

Expected numbers are worked by hand from vLLM 0.32's rule (platforms/interface.py
`_align_hybrid_block_size`): block = a * ceil(composite / (a x KV bytes per token)) with
kernel block alignment a = 16 (FlashAttention) or 128 (the CPU backend's default block),
the composite padded to the page; block pool = floor(bytes / page) pages, one of them
the null block.

Falcon-H1-7B: KV 1,024 B/token, composite 1,594,368 B.
  a = 16: 16 x 1,024 = 16,384 B per group; 1,594,368 / 16,384 = 97.31 -> 98 groups
          -> 1,568 tokens, page 1,605,632 B, padding 11,264 B (0.71 %)
  a = 128: 131,072 B per group; 12.16 -> 13 groups -> 1,664 tokens, page 1,703,936 B
Granite: KV 2,048 B/token, composite 1,074,688 B; 32,768 B per group; 32.80 -> 33
          -> 528 tokens, page 1,081,344 B, padding 6,656 B.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.runners import ledger_io
from experiments.runners.cell import run_cell
from serving_core.geometry import load_geometry
from serving_core.memory import MemoryEvents, N0UniformPages, build_memory, org_layout
from serving_core.memory.invariants import check_invariants
from serving_core.memory.n0 import (
    N0_CPU_BLOCK_ALIGNMENT,
    n0_block_tokens,
    n0_layout,
    n0_padding_bytes,
)
from serving_core.planner import plan_budget, plan_to_dict, units_for
from serving_core.storage import allocation_cost, capacity

REPO = Path(__file__).resolve().parent.parent
FALCON_PAGE = 1_605_632
SMALL = ("workload.source=synthetic", "workload.num_requests=24")


class Losses(MemoryEvents):
    def __init__(self) -> None:
        self.lost: list[tuple[int, int]] = []

    def on_loss(self, obj, cause_request):
        self.lost.append((obj.key, cause_request))


# ----- geometry derived the way vLLM derives it --------------------------------------------
def test_falcon_block_page_and_padding(falcon):
    layout = org_layout(falcon, "n0")
    assert (layout.block_tokens, layout.checkpoint_interval) == (1_568, 1_568)
    assert layout.page_bytes == layout.recurrent_unit_bytes == FALCON_PAGE
    assert layout.units_per_composite == 1
    assert n0_padding_bytes(falcon) == 11_264


def test_cpu_alignment_gives_a_larger_block(falcon):
    assert n0_block_tokens(falcon, N0_CPU_BLOCK_ALIGNMENT) == 1_664
    assert n0_layout(falcon, N0_CPU_BLOCK_ALIGNMENT).page_bytes == 1_703_936
    assert n0_padding_bytes(falcon, N0_CPU_BLOCK_ALIGNMENT) == 1_703_936 - 1_594_368


def test_granite_block(granite):
    layout = org_layout(granite, "N0")
    assert (layout.block_tokens, layout.page_bytes) == (528, 1_081_344)
    assert n0_padding_bytes(granite) == 6_656


def test_small_recurrent_state_and_attention_only(attention_only):
    # 2 Mamba heads x 64 dim x d_state 64 x 2 B = 16,384 B SSM; conv (128 + 2 x 64) x 3 x 2
    # = 1,536 B; 17,920 B > one 16-token group of 16,384 B -> 2 groups = 32 tokens
    small = load_geometry("falcon_h1_7b", mamba_heads=2, mamba_head_dim=64, d_state=64)
    assert small.composite_bytes == 17_920
    assert n0_block_tokens(small) == 32 and n0_padding_bytes(small) == 32_768 - 17_920
    # no recurrent state: vLLM's default 16-token block, no checkpoints
    layout = org_layout(attention_only, "N0")
    assert (layout.block_tokens, layout.checkpoint_interval, layout.page_bytes) == (16, 0, 16_384)
    assert n0_padding_bytes(attention_only) == 0


@pytest.mark.parametrize("alignment", [0, -16, 1.5, True])
def test_alignment_must_be_a_positive_integer(falcon, alignment):
    with pytest.raises(ValueError, match="alignment"):
        n0_block_tokens(falcon, alignment)


# ----- the allocator -------------------------------------------------------------------------
def test_block_and_checkpoint_each_take_one_page(falcon):
    mem = build_memory(falcon, "n0", {"shared": 4})
    assert isinstance(mem, N0UniformPages)
    assert mem.pools["shared"].unit_bytes == FALCON_PAGE
    block, comp = mem.allocate_attention(1), mem.allocate_composite(1)
    assert block.units == [0] and comp.units == [1]
    assert mem.ssm_member_pages(comp) == [1] and mem.conv_line(comp) == 1
    assert mem.ssm_address(comp, 0, 5, base=100) == 100 + FALCON_PAGE + 5
    with pytest.raises(ValueError, match="offset"):
        mem.ssm_address(comp, 0, FALCON_PAGE)
    assert mem.usage() == {"shared": (2, 0, 2, 4)}
    assert mem.demand(2, 1) == {"shared": 3}
    check_invariants(mem)


def test_checkpoint_at_every_block_boundary_and_strict_prefix(falcon):
    mem = build_memory(falcon, "N0", {"shared": 8})
    keys = [11, 12, 13]
    for i, key in enumerate(keys[:2]):
        block = mem.allocate_attention(1)
        assert mem.publish(block, key, (i + 1) * 1_568)
        mem.release(block)
    ckpt = mem.allocate_composite(1)
    assert mem.publish(ckpt, keys[0], 1_568)
    mem.release(ckpt)
    hit = mem.lookup(keys[:2])
    # two cached blocks, a checkpoint only at the first boundary: adopt 1,568 tokens
    assert (hit.attention, hit.amax, hit.rmax, hit.jadopt) == (3_136, 3_136, 1_568, 1_568)
    assert mem.lookup([99, 12]).jadopt == 0  # another first block: the chain misses
    check_invariants(mem)


def test_losing_the_page_loses_the_checkpoint(falcon):
    losses = Losses()
    mem = build_memory(falcon, "N0", {"shared": 2}, losses)
    ckpt = mem.allocate_composite(1)
    mem.publish(ckpt, 7, 1_568)
    mem.release(ckpt)
    block = mem.allocate_attention(2)
    assert mem.lookup([7]).rmax == 1_568 and losses.lost == []  # took the free page
    mem.allocate_attention(3)  # only the cached checkpoint's page is left
    assert losses.lost == [(7, 3)] and mem.lookup([7]).rmax == 0 and not ckpt.valid
    mem.release(block)
    check_invariants(mem)


def test_build_memory_names_one_shared_pool(falcon):
    with pytest.raises(ValueError, match="shared"):
        build_memory(falcon, "n0", {"attention": 4, "recurrent": 2})


# ----- planner: one pool, vLLM's floor, one null block -------------------------------------
# nominal bN = N x 1,605,632 = N N0 pages exactly; vLLM keeps one as its null block.
@pytest.mark.parametrize(("label", "usable"), [("b63", 62), ("b83", 82), ("b108", 107)])
def test_falcon_budgets(falcon, label, usable):
    plan = plan_budget(falcon, label)
    assert units_for(plan, "n0") == {"shared": usable}
    assert plan.org_bytes("N0") == plan.nominal_bytes == (usable + 1) * FALCON_PAGE
    assert plan.diff_bytes("N0") == 0


def test_page_budget_and_other_models(falcon, granite, attention_only):
    # p254: 254 x 524,288 = 133,169,152 B / 1,605,632 = 82.94 -> 82 pages, 81 usable
    plan = plan_budget(falcon, "p254")
    assert units_for(plan, "N0") == {"shared": 81}
    assert plan.diff_bytes("N0") == 82 * FALCON_PAGE - 133_169_152
    # Granite b63: 63 x 1,081,344 = 63 N0 pages; attention-only b4: 2,097,152 / 16,384 = 128
    assert units_for(plan_budget(granite, "b63"), "N0") == {"shared": 62}
    assert units_for(plan_budget(attention_only, "b4"), "N0") == {"shared": 127}


def test_plan_dict_reports_the_null_block(falcon):
    n0 = plan_to_dict(plan_budget(falcon, "b63"))["orgs"]["N0"]
    assert n0 == {"units": 62, "unit_bytes": FALCON_PAGE, "bytes": 63 * FALCON_PAGE,
                  "reserved_units": 1}


def test_budget_too_small_for_n0_is_named(falcon):
    # b1: 1,605,632 B is one page, the null block: no usable page
    with pytest.raises(ValueError, match="N0 shared gets 0 units, needs 1"):
        plan_budget(falcon, "b1")


# ----- storage: contiguous attention in 1,568-token blocks, a page per checkpoint -------------
def test_costs(falcon):
    # 1 block of 512 tokens -> ceil(512 / 1,568) = 1 page; + 1 checkpoint page
    assert allocation_cost(falcon, "N0", 1, 1).num_bytes == 2 * FALCON_PAGE
    # 16 x 512 = 8,192 tokens -> ceil(5.22) = 6 pages; + 16 checkpoints = 22 pages
    cost = allocation_cost(falcon, "N0", 16, 16)
    assert (cost.attention_bytes, cost.recurrent_bytes) == (6 * FALCON_PAGE, 16 * FALCON_PAGE)
    # 49 blocks = 25,088 tokens / 1,568 = 16.0 pages exactly
    assert N0UniformPages.attention_units(org_layout(falcon, "N0"), 49) == 16


@pytest.mark.parametrize(
    ("mix", "copies"),
    # 100 MiB = 104,857,600 B = 65.3 pages -> 65 pages of budget
    # (1, 0): ceil(512 z / 1,568) <= 65 -> 512 z <= 101,920 -> z = 199
    # (1, 1): ceil(512 z / 1,568) + z <= 65: z = 49 -> 16 + 49 = 65; z = 50 -> 17 + 50 = 67
    # (0, 1): 65; (16, 1): ceil(8,192 z / 1,568) + z: z = 10 -> 53 + 10 = 63, z = 11 -> 58 + 11
    [((1, 0), 199), ((1, 1), 49), ((0, 1), 65), ((16, 1), 10)],
)
def test_capacity_100_mib(falcon, mix, copies):
    assert capacity(falcon, "N0", mix, 100 * 2**20) == copies


def test_storage_and_planner_cli_include_n0():
    def cli(module, *args):
        result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    costs = cli("serving_core.storage", "--model", "falcon_h1_7b", "--attention-blocks", "16",
                "--checkpoints", "16", "--json")
    assert costs["N0"]["bytes"] == 22 * FALCON_PAGE
    plan = cli("serving_core.planner", "--model", "falcon_h1_7b", "--budget", "b108", "--json")
    assert plan["orgs"]["N0"]["units"] == 107


# ----- runs --------------------------------------------------------------------------------
def test_engine_run_keeps_invariants_and_checkpoints_on_block_boundaries(make_cfg):
    cfg = make_cfg(*SMALL, "org=n0", "budget=b8", "workload.synthetic_prompt_tokens=2000",
                   "workload.synthetic_context_tokens=1600", "write_ledgers=false")
    steps = []

    def on_step(sched, mem):
        check_invariants(mem)
        steps.append(sched.step)

    result = run_cell(cfg, on_step=on_step)
    assert result.units == {"shared": 7} and steps
    assert result.summary["completed"] == 24 and result.summary["prefix_hit_tokens"] > 0
    boundaries = {obj.boundary for obj in result.memory.cache.checkpoints.values()}
    assert boundaries and all(b % 1_568 == 0 for b in boundaries)


def test_run_is_deterministic_and_labelled(make_cfg):
    cfg = make_cfg(*SMALL, "org=n0", "budget=b63", "write_ledgers=false")
    first, second = run_cell(cfg), run_cell(cfg)
    strip = lambda s: {k: v for k, v in s.items() if k != "wall_seconds"}  # noqa: E731
    assert strip(first.summary) == strip(second.summary)
    assert first.tables == second.tables
    columns = ledger_io.cell_columns(cfg)
    assert (columns["org"], columns["arm"]) == ("N0", "N0")
    assert ledger_io.planned_units(cfg) == {"shared": 62}


def test_command_line_run():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", "org=n0", "budget=b63", "write_ledgers=false",
         *SMALL], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert (summary["org"], summary["completed"]) == ("n0", 24)


def test_unknown_org_names_n0():
    with pytest.raises(ValueError, match="N0"):
        org_layout(load_geometry("falcon_h1_7b"), "n9")
    assert dataclasses.is_dataclass(org_layout(load_geometry("granite"), "n0"))
