"""Checkpoint placement policies (serving_core/placement.py, overlap.py): each policy's
boundaries for hand-built chunks and request sequences, computed by hand; `align` against
vLLM 0.32's rule; the dynamic program against brute force; the engine publishing and
reading back each placement."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from engines import simulated_engine
from test_engine_rules import ConstantStep, run, spec

from experiments.workloads.workload import RequestSpec
from serving_core.engine import serve
from serving_core.engine_spec import rule_sections
from serving_core.overlap import PrefixTree, optimal_positions, placement_value
from serving_core.placement import Placement, parse_placement, retention_blocks
from serving_core.planner import plan_budget, units_for
from serving_core.request import Request
from serving_core.scheduler import SchedulerConfig

C = 4  # a 4-token grid (block = interval, as N0) keeps the hand computations small


def request(rid: int, tokens, generated: int = 0) -> Request:
    req = Request(RequestSpec(rid, 0.0, np.asarray(tokens, dtype=np.int32), 8, -1, ""), C)
    for _ in range(generated):
        req.append_generated()
    return req


def placed(name: str, retention: int = 0, budget: int = 0) -> Placement:
    policy, param = parse_placement(name)
    return Placement(policy, C, retention, param, budget_checkpoints=budget, block=C)


# ----- request-independent policies ------------------------------------------------------
@pytest.mark.parametrize("name, start, end, boundaries", [
    ("step_end", 0, 8, [2]), ("step_end", 0, 7, []), ("step_end", 3, 8, [2]),
    ("every_boundary", 0, 9, [1, 2]), ("every_boundary", 3, 8, [1, 2]),
    ("all", 0, 9, [1, 2]), ("all", 7, 8, [2]),  # a decode reaching a boundary
    ("periodic:2", 0, 17, [2, 4]), ("periodic:2", 5, 9, [2]), ("periodic:3", 0, 11, []),
])
def test_fixed_policies(name, start, end, boundaries):
    req = request(0, range(20))
    assert placed(name).boundaries(req, start, end) == boundaries


@pytest.mark.parametrize("prompt, chunks, boundaries", [
    (10, [(0, 10)], [2]),  # one final chunk: the last boundary below its end, 8
    (10, [(0, 8), (8, 10)], [2]),  # non-final chunk ends on 8; the tail has none (8 < 8 + C)
    (12, [(0, 12)], [2, 3]),  # ends on the grid: 12 (its block is full) and 8 below it
    (5, [(0, 5)], [1]),  # 4 = start + C: valid
    (4, [(0, 4)], [1]),  # (4 - 1) // 4 * 4 = 0 is not past the start; the end is on the grid
    (10, [(0, 6), (6, 10)], []),  # unaligned: 6 is off the grid, the final chunk starts off it
    (13, [(4, 13)], [3]),  # after an adopted prefix of 4: 12 - 4 >= C
    (13, [(8, 13)], [3]),  # 12 = 8 + C: still valid
    (12, [(8, 12)], [3]),  # 8 < 8 + C: only the end, on the grid
])
def test_align_by_hand(prompt, chunks, boundaries):
    req, rule = request(0, range(prompt)), placed("align")
    assert [j for s, e in chunks for j in rule.boundaries(req, s, e)] == boundaries


def test_align_decode_publishes_where_a_step_ends_on_the_grid():
    """Decodes (prompt 10, then one token per step): 11 is off the grid, 12 is on it."""
    rule = placed("align")
    assert rule.boundaries(request(0, range(10), generated=1), 10, 11) == []
    assert rule.boundaries(request(0, range(10), generated=2), 11, 12) == [3]


# vLLM 0.32, vllm/v1/kv_cache_interface.py, restated: the prefill checkpoint of a chunk that
# reaches the prefill end (MambaManager.get_num_blocks_to_allocate / _needs_internal_checkpoint
# in vllm/v1/core/single_type_kv_cache_manager.py; prefill_end = max(num_prompt_tokens,
# num_tokens - 1) in KVCacheManager.allocate_slots, vllm/v1/core/kv_cache_manager.py), and
# the state cached where a step ends on a block boundary (MambaManager.cache_blocks caches
# the full blocks; align leaves the skipped ones null). Hash block = Mamba block = C,
# Mamba2's prefill_checkpoint_alignment = 1 (MambaMixer2.get_kv_cache_spec), no EAGLE.
def vllm_checkpoint_position(num_tokens: int, hash_block: int) -> int:
    """get_mamba_prefill_checkpoint_position(num_tokens, hash_block, drop_eagle_block=False)"""
    return max((num_tokens - 1) // hash_block * hash_block, 0)


def vllm_checkpoint_valid(start: int, end: int, pos: int, block: int, alignment: int) -> bool:
    """is_mamba_prefill_checkpoint_valid(start, end, pos, block, block, alignment)"""
    initial_col, ckpt_col = (start - 1) // block, -(-end // block) - 2
    return (start % block == 0 and ckpt_col > initial_col and start + block <= pos
            and start < pos < end and (pos - start) % alignment == 0)


def vllm_align(start: int, end: int, prefill_end: int) -> list[int]:
    pos = vllm_checkpoint_position(end, C)
    internal = end >= prefill_end and vllm_checkpoint_valid(start, end, pos, C, 1)
    cached_end = [end // C] if end % C == 0 else []
    return ([pos // C] if internal else []) + cached_end


def test_align_is_vllms_rule_on_every_chunk():
    """Every chunk [start, end) of prompts up to 14 tokens, prefill and decode."""
    rule = placed("align")
    for prompt, generated in itertools.product(range(1, 15), range(3)):
        req = request(0, range(prompt), generated)
        prefill_end = max(req.num_prompt, req.num_tokens - 1)
        for start in range(req.num_tokens):
            for end in range(start + 1, req.num_tokens + 1):
                assert rule.boundaries(req, start, end) == vllm_align(start, end, prefill_end), (
                    prompt, generated, start, end)


# ----- retention interval -----------------------------------------------------------------
@pytest.mark.parametrize("prompt, boundaries", [(17, [2, 4]), (14, [2, 3])])
def test_retention_keeps_multiples_and_the_replay_boundary(prompt, boundaries):
    """2block: multiples of 2 C, and the prompt's last boundary (prompt - 1) // C (vLLM's
    replay boundary): 4 for 17 tokens (a multiple anyway), 3 for 14."""
    req = request(0, range(prompt))
    assert placed("every_boundary", retention=2).boundaries(req, 0, prompt) == boundaries
    assert retention_blocks("block") == 1 and retention_blocks("2block") == 2
    assert retention_blocks("0block") == retention_blocks(2) == retention_blocks("x") == 0


# ----- junction: the branch point from the prefix tree ---------------------------------------
def test_junction_learns_branch_points_from_the_prefix_tree():
    """C = 4. r0 = A (10 tokens) + X (6): nothing seen before, so only its tail: boundaries
    from (16 - 1) // 4 = 3 on. r1 = A + Y: it shares blocks 0-1 (8 tokens; block 2 mixes A
    and Y) with r0, so its branch point is 8 (j = 2) besides its tail 3, 4. r2 = r1's first 6
    tokens + Z: branch point 4 (j = 1)."""
    a, x, y, z = list(range(10)), [100 + i for i in range(6)], [200 + i for i in range(6)], \
        [300 + i for i in range(10)]
    rule = placed("junction")
    got = []
    for rid, tokens in enumerate((a + x, a + y, a[:6] + z)):
        req = request(rid, tokens)
        rule.admit(req)
        got.append(rule.boundaries(req, 0, len(tokens)))
        rule.finish(req)
    assert got == [[3, 4], [2, 3, 4], [1, 3, 4]]
    assert rule.tree.depths == {0: 1, 2: 1, 1: 1}  # overlap depths 0, 8, 4 tokens


def test_positions_are_fixed_at_admission():
    """A request's positions do not move when later requests change the tree (what its
    chunks reserved is what they publish)."""
    rule = placed("junction")
    first = request(0, range(16))
    rule.admit(first)
    assert rule.boundaries(first, 0, 16) == [3, 4]
    rule.admit(request(1, list(range(10)) + [99] * 6))
    assert rule.boundaries(first, 0, 16) == [3, 4]


# ----- optimal: the dynamic program ----------------------------------------------------------
def brute_force(tail: list[float], m: int) -> float:
    n = len(tail) - 1
    return max(placement_value(s, tail) for k in range(min(m, n) + 1)
               for s in itertools.combinations(range(1, n + 1), k))


def test_dp_matches_brute_force_on_random_instances():
    rng = random.Random(44)
    for _ in range(300):
        n, m = rng.randint(1, 8), rng.randint(1, 5)
        counts = [rng.choice((0, 0, 1, 2, 5)) for _ in range(n + 1)]
        counts[n] = counts[n] or 1
        total, tail, above = sum(counts), [0.0] * (n + 1), 0
        for j in range(n, -1, -1):
            above += counts[j]
            tail[j] = above / total
        chosen = optimal_positions(tail, m)
        assert len(chosen) <= m
        assert placement_value(chosen, tail) == pytest.approx(brute_force(tail, m), abs=1e-12)


def test_dp_by_hand():
    """Overlap depths (grid units) 0, 1, 2, 2: T = [1, 3/4, 1/2]. One checkpoint: at 1
    it serves 3/4 x 1, at 2 it serves 1/2 x 2 = 1 (the better); two: 3/4 + 1/2 x 1 = 1.25."""
    tree = PrefixTree(block=C, interval=C)
    for depth in (0, 4, 8, 8):
        tree.record(depth)
    tail = tree.tail_mass()
    assert tail == [1.0, 0.75, 0.5]
    assert optimal_positions(tail, 1) == [2] and placement_value([2], tail) == 1.0
    assert optimal_positions(tail, 2) == [1, 2] and placement_value([1, 2], tail) == 1.25


def test_optimal_is_fed_by_the_requests_seen():
    """optimal:1, C = 4: r0 (nothing seen, depth 0), r1 and r2 share 8 tokens with r0
    (depth 8), r3 shares 4 (depth 4). r0 chooses nothing (no overlap yet: T = [1]); r3's
    admission sees depths 0, 8, 8 (T = [1, 2/3, 2/3]): one checkpoint at j = 2."""
    base = list(range(20))
    prompts = [base, base[:8] + [50] * 12, base[:8] + [60] * 12, base[:4] + [70] * 16]
    rule = placed("optimal:1")
    got = []
    for rid, tokens in enumerate(prompts):
        req = request(rid, tokens)
        rule.admit(req)
        got.append(rule.boundaries(req, 0, 20))
    assert got == [[], [], [2], [2]]
    assert rule.tree.depths == {0: 1, 2: 2, 1: 1}


# ----- in the engine ----------------------------------------------------------------------
def published_by(res) -> dict[int, list[int]]:
    tr, out = res.tables["trace"], {}
    for e, k, rid, b in zip(tr["event"], tr["kind"], tr["request_id"], tr["boundary"],
                            strict=True):
        if e == "PUBLISH" and k == "checkpoint":
            out.setdefault(int(rid), []).append(int(b))
    return {rid: sorted(bs) for rid, bs in out.items()}


def branching(falcon, placement: str):
    """S2 (C = 512): three 1,400-token prompts one after another, sharing 700 tokens."""
    specs = [spec(i, 1400, 4, arrival=10.0 * i) for i in range(3)]
    for s in specs[1:]:
        s.prompt[:700] = specs[0].prompt[:700]
    return run(falcon, "S2", {"shared": 64}, specs, max_num_batched_tokens=2048,
               checkpoint_placement=placement)


@pytest.mark.parametrize("placement, published, adopted", [
    # aligned chunks 1,024 + 376: the step ends on 1,024 only; nobody reuses 700 tokens
    ("step_end", {0: [1024], 1: [1024], 2: [1024]}, [0, 0, 0]),
    # r0 publishes 512 and 1,024; r1 and r2 adopt 512 and publish their own 1,024
    ("every_boundary", {0: [512, 1024], 1: [1024], 2: [1024]}, [0, 512, 512]),
    # each its tail (1,399 // 512 = 2); r1 learns the branch at 700 (512) and publishes it
    ("junction", {0: [1024], 1: [512, 1024], 2: [1024]}, [0, 0, 512]),
])
def test_placement_decides_the_reuse_of_a_shared_prefix(falcon, placement, published, adopted):
    res = branching(falcon, placement)
    assert published_by(res) == published
    assert [r.adopted_first for r in res.requests] == adopted


@pytest.mark.parametrize("org, units", [("S0", {"shared": 64}), ("S1", None), ("S2", None),
                                        ("D0", None), ("N0", None), ("JENGA", None)])
def test_every_organization_runs_and_reads_back_each_placement(falcon, org, units):
    pools = units or units_for(plan_budget(falcon, "b20"), org)
    for name in ("align", "all", "junction", "periodic:2", "optimal", "optimal:3"):
        cfg = rule_sections(cap=4, max_num_batched_tokens=2048, checkpoint_placement=name,
                            retention_interval="2block")
        engine = simulated_engine(falcon, org, pools, cfg, ConstantStep())
        rules = engine.effective_rules()
        assert (rules["checkpoint_placement"], rules["retention_interval"]) == (name, "2block")
        specs = [spec(0, 1100, 3), spec(1, 1100, 3, arrival=1.0, first=1)]
        assert serve(engine, specs).summary["completed"] == 2


@pytest.mark.parametrize("value", ["sometimes", "periodic:0", "periodic:x", "optimal:-1",
                                   "periodic", "junction:2"])
def test_a_bad_placement_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"^engine.checkpoint_placement=.*: allowed values "
                                         r"are step_end, .*periodic:N"):
        SchedulerConfig(checkpoint_placement=value)
    with pytest.raises(ValueError, match=r"^engine.retention_interval='0block': allowed"):
        SchedulerConfig(retention_interval="0block")
