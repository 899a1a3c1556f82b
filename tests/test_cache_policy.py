"""engine.cache_policy (serving_core/memory/cache_policy.py): Marconi's admission and
eviction decisions on hand-made traces, with the expected checkpoints and victims written
out by hand; `lru` is today's engine; bad values are refused naming the field."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import compose_config
from engines import run_simulated

from experiments.workloads.workload import RequestSpec
from serving_core.engine_spec import rule_sections
from serving_core.memory import AllocatorRules, build_memory
from serving_core.memory.cache_policy import CachePolicy, FlopModel, ScoredPool
from serving_core.memory.invariants import check_invariants

admitted = CachePolicy.admitted_boundaries


# ----- admission ---------------------------------------------------------------------------
def test_admission_by_reuse_scenario_by_hand():
    # 1,536 tokens of the prompt found cached (a branch off an earlier sequence), nothing
    # adopted, 2,000 prompt tokens and 100 output: branch 1,536; final (2,099 // 512) x 512
    assert admitted(1536, 0, 2000, 2099, 512) == {1536, 2048}
    # the branch point already adopted: only the end of input plus output
    assert admitted(1536, 1536, 2000, 2099, 512) == {2048}
    # nothing shared: only the final boundary; a branch never beyond the last prompt token
    assert admitted(0, 0, 2000, 2099, 512) == {2048}
    assert admitted(2000, 0, 2000, 2099, 512) == {1536, 2048}  # min(2000, 1999) -> 1536
    # a short request whose final boundary is adopted publishes nothing
    assert admitted(600, 512, 700, 760, 512) == set()
    # no recurrent state: no checkpoint
    assert admitted(600, 0, 700, 760, 0) == set()


class ConstantStep:
    def step_seconds(self, new_tokens, context_tokens, checkpoint_writes=0):
        return 0.01


def _spec(rid, arrival, context, suffix, output):
    rng = np.random.default_rng(rid + 1)
    tokens = np.concatenate([context, rng.integers(0, 50_000, suffix)]).astype(np.int32)
    return RequestSpec(rid, arrival, tokens, output, 0, "")


def test_marconi_checkpoints_the_branch_point_for_the_third_request(falcon):
    """S2 (512-token blocks and grid, 512-token chunks: a checkpoint at every chunk end), a
    1,200-token shared context, three requests one after another, each with its own
    600-token suffix and 10 output tokens (prompt 1,800).
    lru: request 0 publishes 512, 1,024 and 1,536, so request 1
    adopts 1,024, the deepest boundary inside the context.
    marconi: request 0 finds nothing cached and may publish only its final boundary
    (1,809 // 512) x 512 = 1,536, which lies in its own suffix, so request 1 adopts nothing;
    request 1 finds 1,024 tokens of cached attention (blocks 0-1; block 2 holds its own
    suffix), a branch point, and publishes 1,024 there; request 2 adopts 1,024."""
    context = np.random.default_rng(0).integers(0, 50_000, 1200)
    specs = [_spec(i, 10.0 * i, context, 600, 10) for i in range(3)]
    units = {"shared": 60}
    out = {}
    for policy in ("lru", "marconi"):
        cfg = rule_sections(cap=4, max_num_batched_tokens=512, cache_policy=policy)
        res = run_simulated(falcon, "S2", units, cfg, specs, ConstantStep())
        out[policy] = res.tables["requests"]["adopted_prefix_tokens"]
    assert out["lru"] == [0, 1024, 1024]
    assert out["marconi"] == [0, 0, 1024]


def test_marconi_keeps_the_end_of_a_conversation_for_its_continuation(falcon):
    """D0 (1,792-token grid): a 1,900-token prompt with 300 output tokens ends its last state
    at 2,199 tokens: Marconi admits only (2,199 // 1,792) x 1,792 = 1,792. A continuation whose
    prompt is that prompt plus more adopts 1,792 under both policies; under marconi the
    first request published one checkpoint (no earlier sequence to branch from)."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 50_000, 1900).astype(np.int32)
    follow = np.concatenate([first, rng.integers(0, 50_000, 700)]).astype(np.int32)
    specs = [RequestSpec(0, 0.0, first, 300, 0, ""), RequestSpec(1, 100.0, follow, 10, 0, "")]
    units = {"attention": 600, "recurrent": 8}
    for policy in ("lru", "marconi"):
        cfg = rule_sections(cap=4, max_num_batched_tokens=2048, cache_policy=policy)
        res = run_simulated(falcon, "D0", units, cfg, specs, ConstantStep())
        assert res.tables["requests"]["adopted_prefix_tokens"] == [0, 1792]


# ----- eviction ----------------------------------------------------------------------------
def test_scored_pool_victim_by_hand():
    """Stamps 1, 2, 3 (min-max: 0, 0.5, 1) and efficiencies 10, 0, 5 (1, 0, 0.5):
    alpha 1 scores 1, 0.5, 1.5 -> unit 1; alpha 0 is LRU -> unit 0; alpha 0.4 scores
    0.4, 0.5, 1.2 -> unit 0."""
    eff = {0: 10.0, 1: 0.0, 2: 5.0}
    for alpha, victim in ((1.0, 1), (0.0, 0), (0.4, 0)):
        policy = SimpleNamespace(alpha=alpha, on_eviction=lambda: None)
        pool = ScoredPool("p", 3, 1, policy, eff.__getitem__)
        for unit in (0, 1, 2):
            pool.free.popleft()
            pool.add_evictable(unit)
        assert pool.victim() == victim


def test_flop_model_by_hand(falcon):
    f = FlopModel.of(falcon)
    # F(n) = 2 P n + 2 L H d n (n - 1), L H d = 44 x 12 x 128 = 67,584
    assert f.attention == 67_584
    assert f.prefix(2) == 2 * 7_590_000_000 * 2 + 2 * 67_584 * 2 * 1
    assert f.span(16, 32) == f.prefix(32) - f.prefix(16)


def test_marconi_evicts_the_least_useful_checkpoint_by_hand(falcon):
    """D0's recurrent pool (3 native composites, equal bytes), checkpoints at 5,376, 1,792
    and 3,584 tokens released in that order (stamps 1, 2, 3: recency 0, 0.5, 1).
    F(b) = 1.518e10 b + 135,168 b (b - 1): F(1792) = 2.7636e13, F(3584) = 5.6141e13,
    F(5376) = 8.5514e13, so efficiency normalizes to 0, 0.4925, 1 (1792, 3584, 5376).
    alpha 1: scores 5376 -> 1.0, 1792 -> 0.5, 3584 -> 1.4925: the victim is 1,792 (LRU would
    take 5,376). Next, between 5,376 (recency 0, efficiency 1) and 3,584 (1, 0) the scores
    tie at 1: the older stamp, 5,376, goes. alpha 0.4: 5376 -> 0.4, 1792 -> 0.5: 5,376."""
    for alpha, victims in ((1.0, [1792, 5376]), (0.4, [5376, 1792]), (0.0, [5376, 1792])):
        mem = build_memory(falcon, "D0", {"attention": 4, "recurrent": 3},
                           cache_policy="marconi", marconi_weight="fixed",
                           marconi_alpha=alpha)
        objs = {}
        for key, boundary in ((1, 5376), (2, 1792), (3, 3584)):
            obj = mem.allocate_composite(key)
            mem.publish(obj, key, boundary)
            objs[boundary] = obj
        for boundary in (5376, 1792, 3584):
            mem.release(objs[boundary], producer=True)
        lost = []
        for _ in range(2):
            mem.allocate_composite(9)
            lost += [b for b, o in objs.items() if not o.valid and b not in lost]
        assert lost == victims, (alpha, lost)
        check_invariants(mem)


def test_marconi_keeps_attention_blocks_in_recency_order(falcon):
    """D0's attention pool under marconi: blocks carry no FLOP term, so the victim is the
    least recent, whatever its depth (a request releases its deepest block first): blocks
    at 16, 32, 48 tokens released 48, 32, 16 go in that order."""
    mem = build_memory(falcon, "D0", {"attention": 3, "recurrent": 1}, cache_policy="marconi")
    blocks = {}
    for key, depth in ((1, 16), (2, 32), (3, 48)):
        blocks[depth] = mem.allocate_attention(1)
        mem.publish(blocks[depth], key, depth)
    for depth in (48, 32, 16):
        mem.release(blocks[depth])
    lost = []
    for _ in range(3):
        mem.allocate_attention(2)
        lost += [d for d, b in blocks.items() if not b.valid and d not in lost]
    assert lost == [48, 32, 16]


def test_marconi_ranks_attention_blocks_and_slabs_in_s2(falcon):
    """S2 under marconi keeps the allocator's invariants on a shared workload (every pool
    ranked, slab pages by their best cached checkpoint) and completes every request."""
    from experiments.runners.cell import run_cell

    cfg = compose_config("org=s2", "budget=b63", "workload.num_requests=40",
                         "engine.cache_policy=marconi", "write_ledgers=false")
    res = run_cell(cfg, on_step=lambda sched, mem: check_invariants(mem))
    assert res.summary["completed"] == 40
    assert res.engine_config["cache_policy"] == "marconi"
    assert res.engine_config["marconi_weight"] == "tuned"  # the default: Marconi's replay
    assert res.engine_config["marconi_alpha"] is None
    assert isinstance(res.engine_config["marconi_tuning"], list)


# ----- the axis ----------------------------------------------------------------------------
def test_default_is_lru_and_recorded_from_the_engine():
    from experiments.runners.cell import run_cell

    res = run_cell(compose_config("org=d0", "budget=b63", "workload.num_requests=10",
                                  "write_ledgers=false"))
    assert res.engine_config["cache_policy"] == "lru"
    assert res.engine_config["marconi_alpha"] is None
    assert res.engine_config["marconi_weight"] is None


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_policy": "lfu"}, "engine.cache_policy='lfu': allowed values are lru, marconi"),
    ({"cache_policy": "marconi", "marconi_alpha": -1.0}, "engine.marconi_alpha=-1.0"),
    ({"cache_policy": "marconi", "marconi_weight": "auto"},
     "engine.marconi_weight='auto': allowed values are tuned, fixed"),
    ({"cache_policy": "marconi", "free_queue": "single_queue"}, "engine.free_queue="),
])
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AllocatorRules(**kwargs)
