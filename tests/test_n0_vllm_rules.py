"""N0 under vLLM's rules (docs/engine_rules.md section 17), each rule on a hand-computed case.

Falcon-H1-7B under N0: 1,568-token blocks, one page per attention block and one per
checkpoint composite, so a request's demand is attention blocks + composites in pages.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_engine_rules import prefill_chunks, published_boundaries, run, spec

from analysis.questions import n0_vllm
from serving_core.geometry import load_geometry
from serving_core.memory import build_memory
from serving_core.memory.invariants import check_invariants
from serving_core.scheduler import Scheduler, SchedulerConfig
from serving_core.vllm_state_blocks import VllmStateBlocks
from tests.conftest import compose_config
from tests.test_n0_vllm import pytestmark as needs_vllm  # skipped with the reason without vLLM

B = 1_568


@pytest.mark.parametrize("align, cross, chunks", [
    (False, False, [2048, 1187]),  # N0's default: unaligned chunks of the token budget
    (True, False, [B, B, 99]),  # every chunk ends on a block boundary, then the tail
    (True, True, [B, 3235 - B]),  # vLLM: the chunk reaching the prompt's end crosses 3,136
])
def test_cross_final_chunk_is_vllms_split(falcon, align, cross, chunks):
    """A 3,235-token prompt, 2,048 batched tokens (vLLM runs it as 1,568 + 1,667)."""
    res = run(falcon, "N0", {"shared": 16}, [spec(0, 3235, 2)], max_num_batched_tokens=2048,
              align_chunks=align, cross_final_chunk=cross)
    assert prefill_chunks(res) == chunks
    assert res.engine_config["cross_final_chunk"] is (align and cross)


@pytest.mark.parametrize("start, total, budget, stop, tokens", [
    (B, 3258, 2031, 2 * B, B),  # vLLM's junction at 3,136 inside the final chunk: stop there
    (B, 3258, 2031, 0, 3258 - B),  # no junction: the final chunk crosses
    (B, 3258, 2031, B, 3258 - B),  # a junction at the chunk's start is no stop
    (0, 5000, 2048, 4 * B, B),  # a junction beyond the aligned end changes nothing
])
def test_a_chunk_stops_at_the_junction(start, total, budget, stop, tokens):
    sched = SimpleNamespace(align=True, C=B, cross_final_chunk=True, split_last_boundary=False)
    assert Scheduler._chunk(sched, start, total, budget, stop) == tokens


@pytest.mark.parametrize("start, total, prefill_end, end", [
    (B, 2 * B + 1, 0, 2 * B + 1),  # a fresh 3,137-token prompt: the final chunk crosses 3,136
    # Falcon b83 3 requests/s seed 42001, request 252 resumed with 3,127 prompt + 10 output
    # tokens: prefill ends at 3,136, its checkpoint (1,568) is the chunk's start, so vLLM's
    # split stops at 3,136 (last_cache_position) and the last token follows alone
    (B, 2 * B + 1, 2 * B, 2 * B),
    (0, 2 * B + 1, 2 * B, 2 * B + 1),  # resumed from 0: its checkpoint 1,568 lies inside
    (B + 100, 3 * B, 0, 2 * B),  # a start inside a block: to the next boundary
    (2 * B, 2 * B + 1, 2 * B, 2 * B + 1),  # past the prefill end: no split
])
def test_the_final_chunk_crosses_where_vllms_split_saves_its_checkpoint(start, total,
                                                                         prefill_end, end):
    sched = SimpleNamespace(align=True, C=B, cross_final_chunk=True, split_last_boundary=False)
    assert Scheduler._chunk(sched, start, total, 4 * B, 0, prefill_end) == end - start


def test_stop_at_junction_is_declared_off_by_default():
    assert SchedulerConfig().stop_at_junction is False
    with pytest.raises(ValueError, match="stop_at_junction='yes': allowed values are true"):
        SchedulerConfig(stop_at_junction="yes")


# Request 0 (1,000 tokens, decoding) holds one block and its working composite: 2 pages.
# Request 1 (5,000 tokens) arrives with it: full_prompt asks 4 blocks + 3 boundary
# composites (1,568, 3,136, 4,704) + the working one = 8 pages; capped_prompt (vLLM's
# MambaManager admission cap) 4 + 1 + 1 = 6.
TWO = [spec(0, 1000, 50), spec(1, 5000, 4)]


@pytest.mark.parametrize("pages, admission, second_starts", [
    (9, "full_prompt", 0.5),  # 7 pages free < 8: waits until request 0 finishes
    (9, "capped_prompt", 0.0),  # 7 >= 6: admitted beside it
    (10, "full_prompt", 0.0),  # 8 >= 8
])
def test_capped_prompt_counts_one_boundary_composite(falcon, pages, admission, second_starts):
    res = run(falcon, "N0", {"shared": pages}, TWO, max_num_batched_tokens=2048,
              admission=admission)
    assert res.requests[1].start_s == pytest.approx(second_starts)
    assert res.engine_config["admission"] == admission


@pytest.mark.parametrize("whole, chunks, preemptions", [
    # Step 3 asks [3,095, 5,000): 2 blocks + 2 composites = 4 pages, 3 available (2 free
    # and the checkpoint at 1,568 evictable). Shortened to 4,704: 1 block + 2 = 3 pages.
    (False, [2048, 2047, 4704 - 3095, 5000 - 4704], 0),
    (True, [2048, 2047], 1),  # vLLM's allocate_slots: all or nothing, so it preempts
])
def test_whole_chunks_preempt_instead_of_shortening(falcon, whole, chunks, preemptions):
    """8 pages under capped_prompt: request 1 is admitted on 6 and later runs short."""
    res = run(falcon, "N0", {"shared": 8}, TWO, max_num_batched_tokens=2048,
              admission="capped_prompt", whole_chunks=whole)
    assert prefill_chunks(res)[:len(chunks)] == chunks
    assert res.summary["preemptions"] == preemptions
    assert res.summary["completed"] == 2


ALIGNED = {"align_chunks": True, "cross_final_chunk": True, "max_num_batched_tokens": 4096}


@pytest.mark.parametrize("blocks, retention, published", [
    ("per_boundary", 1, [B, 2 * B, 3 * B, 4 * B]),  # a checkpoint at every boundary a chunk crosses
    ("vllm_align", 1, [B, 2 * B, 4 * B]),  # chunk 1: its checkpoint and end; 2: its checkpoint
    ("vllm_align", 0, [4 * B]),  # retention 0: only the prompt's last boundary
])
def test_vllm_align_publishes_chunk_ends_and_prefill_checkpoints(falcon, blocks, retention,
                                                                 published):
    """A 6,500-token prompt, 4,096 batched tokens: chunks [0, 3,136) and [3,136, 6,500).
    vLLM's align-mode Mamba group writes the state at a chunk's end and one prefill
    checkpoint at the last boundary inside it (1,568; 6,272), not the 4,704 between."""
    res = run(falcon, "N0", {"shared": 32}, [spec(0, 6500, 2)], state_blocks=blocks,
              retention_blocks=retention, **ALIGNED)
    assert prefill_chunks(res) == [2 * B, 6500 - 2 * B]
    assert published_boundaries(res) == published


def test_a_hit_cached_in_this_step_waits_for_the_next(falcon):
    """Requests 1 and 2 share request 0's prompt up to 3,136 and arrive together after it
    finished. Request 1's admission keys the checkpoint at 3,136, its prompt's last
    boundary, again (vLLM's `_cache_partial_tail_block`), so vLLM refuses request 2's hit on
    it for that step (`cached_blocks_this_step`): it starts one step later."""
    specs = [spec(0, 3300, 2, first=1), spec(1, 3250, 2, 1.0, first=1),
             spec(2, 3260, 2, 1.0, first=1)]
    starts = {}
    for blocks in ("per_boundary", "vllm_align"):
        res = run(falcon, "N0", {"shared": 32}, specs, state_blocks=blocks, **ALIGNED)
        assert [r.adopted_first for r in res.requests] == [0, 2 * B, 2 * B]
        starts[blocks] = res.requests[2].start_s - res.requests[1].start_s
    assert starts == {"per_boundary": 0.0, "vllm_align": pytest.approx(0.01)}


@pytest.mark.parametrize("start, end, total, retention, checkpoint", [
    (0, 3 * B, 5000, 1, 2 * B),  # a non-final chunk reserves one under interval retention
    (0, 3 * B, 5000, 0, 0),  # under retention 0 only the chunk reaching the prefill end
    (B, 5000, 5000, 0, 3 * B),  # the final chunk: the last boundary inside it
    (B, 2 * B, 2 * B, 1, 0),  # one block: the last boundary below its end is its start
    (100, 5000, 5000, 1, 0),  # a chunk that starts off a boundary writes none
])
def test_prefill_checkpoint_position(start, end, total, retention, checkpoint):
    req = SimpleNamespace(num_prompt=total, num_tokens=total)
    assert VllmStateBlocks(B, retention).checkpoint(req, start, end) == checkpoint


def test_retention_blocks_needs_vllm_align():
    with pytest.raises(ValueError, match="retention_blocks=0: applies only with "
                                         "engine.state_blocks=vllm_align"):
        SchedulerConfig(retention_blocks=0)
    assert SchedulerConfig(state_blocks="vllm_align", retention_blocks=0).retention_blocks == 0


# ----- against vLLM's own scheduler (the virtual-clock arm) ---------------------------------
VLLM_RULES = ("engine.align_chunks=true", "engine.cross_final_chunk=true",
              "engine.stop_at_junction=true", "engine.admission=capped_prompt",
              "engine.whole_chunks=true", "engine.state_blocks=vllm_align",
              "engine.duplicates=cache", "engine.release_order=groups")
SMALL_CELL = ("org=n0", "model=falcon_h1_7b", "budget=b63", "load.rate=3.0", "seed=42000",
              "workload.num_requests=24", "campaign_name=n0_vllm")


@needs_vllm
@pytest.mark.slow
def test_n0_under_vllms_rules_agrees_with_the_arm_decision_by_decision(tmp_path):
    """24 requests, Falcon-H1-7B b63, 3 requests/s: under vLLM's rules N0 adopts the same
    prefix for every request, preempts alike (never) and schedules the same prefill tokens
    and decode sequences in every step; at its defaults it differs at step 1."""
    import ledgers
    from experiments.run import main_run

    for overrides in (("executor=vllm_virtual",), VLLM_RULES, ()):
        main_run(compose_config(*SMALL_CELL, f"ledger_root={tmp_path}", *overrides))
    runs, reqs, steps = n0_vllm.load(ledgers.connect(tmp_path))
    for arm in ("sim_vllm", "sim"):
        a_runs, a_reqs, a_steps = (n0_vllm.against(f, arm, runs) for f in (runs, reqs, steps))
        pairs = n0_vllm.paired_requests(a_reqs)
        assert len(pairs) == 24
        (row,) = n0_vllm.step_agreement(a_steps).to_dict("records")
        if arm == "sim_vllm":
            assert row["first_differing_step"] == -1
            assert pairs["same_hit"].all() and pairs["same_preemptions"].all()
        else:
            assert row["first_differing_step"] == 1


# ----- the comparison page (analysis.questions.n0_vllm) -------------------------------------
@pytest.mark.parametrize("sim, vllm, agree", [
    (0, 2, True), (0, 3, False), (19, 21, True),  # under 20: within 2
    (18, 20, True), (17, 20, False), (33, 30, True), (34, 30, False),  # 10 % of vLLM's
])
def test_preemptions_agree_within_the_issues_target(sim, vllm, agree):
    assert n0_vllm.preemptions_agree(sim, vllm) is agree


def test_ranking_counts_cell_pairs_ordered_alike_beyond_the_tolerance():
    """Three cells of one model: vLLM 100 / 110 / 101 tok/s, N0 100 / 105 / 106. The pair
    (100, 101) is a tie within 2 %; (100, 110) is ordered alike, (110, 101) is not."""
    import pandas as pd

    rows = [(arm, b, v) for arm, values in (("vllm", (100, 110, 101)), ("sim", (100, 105, 106)))
            for b, v in zip(("b63", "b83", "b108"), values, strict=True)]
    runs = pd.DataFrame([{"arm": a, "model": "m", "budget": b, "rate": 3.0, "seed": 1,
                          "throughput_span": v} for a, b, v in rows])
    assert n0_vllm.ranking(runs, "throughput_span", 2.0) == (1, 2)


@pytest.mark.parametrize("vllm_groups", [False, True])
def test_granite_checkpoints_return_group_by_group(vllm_groups):
    """Granite-4.0-H-Tiny under N0: a checkpoint is one page in each of nine Mamba groups.
    vLLM frees group by group and keeps an evicted block's other groups queued, so a new
    composite's nine pages evict both cached checkpoints A and B; N0's default frees B's
    other pages at B's eviction and reuses them, keeping A."""
    mem = build_memory(load_geometry("granite_4_0_h_tiny"), "N0", {"shared": 18})
    if vllm_groups:
        mem.queue_evicted_siblings()
    assert mem.queued_siblings is vllm_groups
    a, b = mem.allocate_composite(0), mem.allocate_composite(0)
    mem.publish(a, 1, 400)
    mem.publish(b, 2, 800)
    units_a, units_b = list(a.units), list(b.units)
    (mem.release_by_group if vllm_groups else mem.release_each)([b, a])
    new = mem.allocate_composite(1)
    check_invariants(mem)
    if vllm_groups:
        assert new.units == [u for pair in zip(units_b, units_a, strict=True) for u in pair][:9]
        assert mem.cached_checkpoint(1) is None and mem.cached_checkpoint(2) is None
    else:
        assert sorted(new.units) == sorted(units_b)
        assert mem.cached_checkpoint(1) is a and mem.cached_checkpoint(2) is None


@pytest.mark.parametrize("model, pages, order, attention_first", [
    ("granite_4_0_h_tiny", 9, "groups", False),  # vLLM: nine Mamba groups, then attention
    ("falcon_h1_7b", 1, "groups", True),  # vLLM: the attention group, then the Mamba group
    ("granite_4_0_h_tiny", 9, "attention_first", True),  # N0's default
    ("granite_4_0_h_tiny", 9, "state_first", False),
])
def test_release_order_groups_is_vllms_kv_cache_group_order(model, pages, order,
                                                            attention_first):
    """A preempted Granite-4.0-H-Tiny request holding one cached attention block and one
    cached checkpoint (nine pages) returns them in vLLM's group order under `groups`: the
    Mamba groups first, so the next page taken is a page of the checkpoint (lost, its
    other pages stay queued) and the attention block stays cached; attention first, the
    block is taken and the checkpoint stays (Granite b63 4.5 requests/s seed 42002, step
    2,555 of the grid: vLLM's request 177 lost its states at 2,000, 2,800 and 3,200)."""
    import numpy as np

    from experiments.workloads.workload import RequestSpec
    from serving_core.request import Request
    from serving_core.state_manager import HybridStateManager

    geometry = load_geometry(model)
    mem = build_memory(geometry, "N0", {"shared": 1 + pages}, release_order=order)
    assert mem.attention_released_first is attention_first
    state = HybridStateManager(mem, step_end=False, retention_k=None, pinning_k=None,
                               vllm_blocks=True)
    B = mem.block_tokens
    req = Request(RequestSpec(0, 0.0, np.arange(1, B + 2, dtype=np.int32), 1, -1, ""), B)
    key = req.ensure_keys(1)[0]
    req.attn = [mem.allocate_attention(0)]
    req.working = mem.allocate_composite(0)
    mem.publish(req.attn[0], key, B)
    mem.publish(req.working, key, B)
    state.release_all(req)
    mem.allocate_attention(1)
    check_invariants(mem)
    assert (mem.cached_attention(key) is not None) is not attention_first
    assert (mem.cached_checkpoint(key) is not None) is attention_first


@pytest.mark.parametrize("layers, first", [
    (["hybrid+mlp"], True), (["mamba2+moe", "attention+moe"], False),
    (["mlp", "mamba2", "attention"], False), (["mlp", "attention", "mamba2"], True)])
def test_attention_group_first_follows_the_first_cached_layer(layers, first):
    from serving_core.layer_pattern import attention_group_first

    assert attention_group_first(layers) is first
