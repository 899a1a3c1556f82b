"""Engine rules on small synthetic cases, each showing the difference between its settings:
admission gate, checkpoint placement and chunk alignment, S2 slab policy, the progress
guarantee under retention and pinning, and the mechanism readouts."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import compose_config
from engines import run_simulated

from experiments.runners.cell import run_cell
from experiments.workloads.workload import RequestSpec
from serving_core.engine_spec import rule_sections
from serving_core.memory import build_memory
from serving_core.records import Recorder
from serving_core.scheduler import SchedulerConfig


class ConstantStep:
    """Every step takes 10 ms: the rules under test do not depend on timing."""

    def step_seconds(self, new_tokens, context_tokens, checkpoint_writes=0):
        return 0.01


def spec(rid: int, prompt: int, output: int, arrival: float = 0.0, first: int = 0):
    tokens = (np.arange(prompt, dtype=np.int64) * 31 + 1000 * (first or rid + 1)) % 50_000
    return RequestSpec(rid, arrival, tokens.astype(np.int32), output, -1, "")


def run(falcon, org, units, specs, **cfg):
    sched_cfg = rule_sections(**{"cap": 8, "max_num_batched_tokens": 512, **cfg})
    return run_simulated(falcon, org, units, sched_cfg, specs, ConstantStep(), trace=True)


# ----- admission gate ---------------------------------------------------------------------
def test_full_prompt_defers_where_first_chunk_preempts(falcon):
    """S0, 8 pages, two 1,500-token prompts arriving together. first_chunk admits the second
    on its first chunk and later preempts it; full_prompt defers it until the first ends."""
    specs = [spec(0, 1500, 300), spec(1, 1500, 300)]
    units = {"shared": 8}
    eager = run(falcon, "S0", units, specs, admission="first_chunk", max_num_batched_tokens=2048)
    gated = run(falcon, "S0", units, specs, admission="full_prompt", max_num_batched_tokens=2048)
    assert eager.summary["preemptions"] >= 1
    assert gated.summary["preemptions"] == 0
    first, second = gated.requests
    assert second.start_s >= first.finish_s  # deferred, never started alongside
    assert eager.requests[1].start_s < eager.requests[0].finish_s
    # identical input work under full_prompt; first_chunk recomputes the victim's prefix
    assert gated.summary["prefill_tokens_computed"] == 3000
    assert eager.summary["prefill_tokens_computed"] > 3000


def test_full_prompt_keeps_the_idle_engine_progress_rule(falcon):
    """A prompt whose whole demand exceeds the pool is still served on an idle engine."""
    res = run(falcon, "S0", {"shared": 8}, [spec(0, 2600, 20)], admission="full_prompt")
    assert res.summary["completed"] == 1


# ----- checkpoint placement and alignment -------------------------------------------------
def published_boundaries(res) -> list[int]:
    tr = res.tables["trace"]
    return sorted(
        b for e, k, b in zip(tr["event"], tr["kind"], tr["boundary"], strict=True)
        if e == "PUBLISH" and k == "checkpoint"
    )


def prefill_chunks(res) -> list[int]:
    st = res.tables["steps"]
    return [p for p in st["prefill_tokens_initial"] if p]


@pytest.mark.parametrize(
    "placement, align, chunks, boundaries",
    [
        ("every_boundary", False, [1400], [512, 1024]),  # one chunk, each boundary it crosses
        ("step_end", False, [1400], []),  # the step ends off the grid: nothing published
        ("step_end", True, [1024, 376], [1024]),  # last full boundary, then the tail
    ],
)
def test_checkpoint_placement_and_alignment(falcon, placement, align, chunks, boundaries):
    res = run(falcon, "S2", {"shared": 64}, [spec(0, 1400, 8)], max_num_batched_tokens=2048,
              checkpoint_placement=placement, align_chunks=align)
    assert prefill_chunks(res) == chunks
    assert published_boundaries(res) == boundaries


@pytest.mark.parametrize(
    "n, split, chunks, boundaries",
    [
        (1024, False, [1024], [1024]),  # one chunk ends at N: no checkpoint at N - C
        (1024, True, [512, 512], [512, 1024]),  # split: the state at N - C = 512 published
        (1536, True, [1024, 512], [1024, 1536]),  # k = 3: ends at (k - 1) C, then C
        (1400, True, [1024, 376], [1024]),  # not a multiple of C: the rule changes nothing
        (512, True, [512], [512]),  # k = 1: no boundary inside the prompt to end at
    ],
)
def test_split_last_boundary_publishes_the_state_at_n_minus_c(falcon, n, split, chunks,
                                                              boundaries):
    """Aligned chunks under step_end (S2): with the rule, a prompt of k C tokens ends its
    aligned chunk at (k - 1) C, so p = C floor((N - 1) / C) for a later identical prompt."""
    res = run(falcon, "S2", {"shared": 64}, [spec(0, n, 4)], max_num_batched_tokens=2048,
              checkpoint_placement="step_end", align_chunks=True, split_last_boundary=split)
    assert prefill_chunks(res) == chunks
    assert published_boundaries(res) == boundaries
    assert res.engine_config["split_last_boundary"] is split


def test_split_last_boundary_is_a_boolean():
    with pytest.raises(ValueError, match="split_last_boundary='yes': allowed values are true"):
        SchedulerConfig(split_last_boundary="yes")


def test_aligned_chunks_wait_for_a_boundary_within_the_budget(falcon):
    """Next to decodes, an aligned chunk takes a multiple of 512 of the budget left."""
    specs = [spec(0, 600, 200), spec(1, 3000, 4, arrival=0.5)]
    res = run(falcon, "S2", {"shared": 64}, specs, max_num_batched_tokens=2048,
              checkpoint_placement="step_end", align_chunks=True)
    first, second = prefill_chunks(res)[:2], prefill_chunks(res)[2:]
    assert first == [512, 88]  # last full boundary, then the tail
    assert second == [1536, 1024, 440]  # 2,047 tokens left next to one decode: 1,536


def test_per_organization_defaults(falcon):
    from serving_core.scheduler import Scheduler

    for org, units, step_end, align in (
        ("S0", {"shared": 8}, True, True), ("S1", {"shared": 8}, True, True),
        ("S2", {"shared": 8}, True, True),
        ("D0", {"attention": 64, "recurrent": 4}, False, False),
    ):
        sched = Scheduler(build_memory(falcon, org, units), SchedulerConfig(), Recorder(False,
                                                                                     False))
        assert (sched.step_end, sched.align) == (step_end, align), org


def test_semantics_presets_select_the_rules():
    paper = compose_config().engine
    old = compose_config("semantics=first_chunk").engine
    assert (paper.semantics, paper.admission, paper.slab_policy) == (
        "paper", "full_prompt", "write_once")
    assert paper.checkpoint_placement is None and paper.align_chunks is None
    assert (old.admission, old.checkpoint_placement, old.align_chunks, old.slab_policy) == (
        "first_chunk", "every_boundary", False, "refill")


@pytest.mark.parametrize("key, bad", [("engine.admission", "eager"),
                                      ("engine.checkpoint_placement", "sometimes"),
                                      ("engine.slab_policy", "lru")])
def test_bad_rule_names_the_field(key, bad):
    with pytest.raises(ValueError, match=key):
        run_cell(compose_config(f"{key}={bad}", "workload.source=synthetic",
                                "workload.num_requests=2"))


# ----- S2 slab policy -------------------------------------------------------------------
def test_write_once_never_refills_a_freed_slot(falcon):
    for policy, slot in (("refill", 0), ("write_once", 2)):
        mem = build_memory(falcon, "S2", {"shared": 32}, slab_policy=policy)
        a, b = mem.allocate_composite(1), mem.allocate_composite(1)
        assert (a.slot, b.slot) == (0, 1)
        mem.release(a, producer=True)  # unpublished: its slot is freed
        c = mem.allocate_composite(1)
        assert (c.slab_page, c.slot) == (b.slab_page, slot), policy


def test_adoption_protects_but_does_not_refresh_a_write_once_slab(falcon):
    """A cached checkpoint X (slab page + 3 members) and a later cached block Y fill the
    pool; X is then adopted and released. One more unit must be evicted: write_once
    reclaims X's old slab (invalidating X) while refill evicts the older block Y."""
    for policy, x_survives in (("refill", True), ("write_once", False)):
        mem = build_memory(falcon, "S2", {"shared": 5}, slab_policy=policy)
        x = mem.allocate_composite(1)
        mem.publish(x, 11, 512)
        mem.release(x, producer=True)
        y = mem.allocate_attention(2)
        mem.publish(y, 22, 512)
        mem.release(y, producer=True)
        mem.acquire(x)  # adoption by another request
        mem.release(x)
        mem.allocate_attention(3)
        assert (mem.cached_checkpoint(11) is not None) == x_survives, policy
        assert (mem.cached_attention(22) is not None) == (not x_survives), policy


def test_write_once_reclaims_slabs_holding_live_checkpoints_on_a_shared_workload():
    """With write_once, slab pages holding cached checkpoints age out and are reclaimed
    (cross-invalidation, as measured); on this workload refill never does."""
    counts = {}
    for policy in ("refill", "write_once"):
        res = run_cell(compose_config(
            "org=s2", "budget=b63", "workload.num_requests=120", f"engine.slab_policy={policy}"))
        slab = res.tables["slab"]
        counts[policy] = sum(1 for e, n in zip(slab["event"], slab["invalidated"], strict=True)
                             if e == "CROSS_INVALIDATE" and n > 0)
    assert counts["refill"] == 0 and counts["write_once"] > 0


# ----- progress guarantee with retention and pinning --------------------------------------
RETENTION_REPRO = ("workload.source=synthetic", "workload.synthetic_prompt_tokens=1400",
                   "workload.synthetic_context_tokens=1200", "org=s2_retention",
                   "load.rate=20")


def smallest_pages(output: int) -> int:
    """Pages of the S2 pool one request needs: its blocks, two composites, one slab."""
    return -(-(1400 + output) // 512) + 2 * 3 + 1


@pytest.mark.parametrize("output, budget", [
    (out, f"p{n}") for out in (600, 1300, 2000) for n in range(smallest_pages(out), 19)])
def test_retention_repro_completes(budget, output):
    """A running request's own retained checkpoints must never starve it."""
    res = run_cell(compose_config(*RETENTION_REPRO, f"budget={budget}",
                                  f"workload.synthetic_output_tokens={output}",
                                  "workload.num_requests=12"))
    assert res.summary["completed"] == 12


def test_random_small_budgets_with_retention_and_pinning_never_raise():
    rng = random.Random(13)
    for _ in range(16):
        output = rng.randint(600, 2000)
        pages = rng.randint(smallest_pages(output), 24)
        overrides = [
            *RETENTION_REPRO, f"budget=p{pages}", f"workload.synthetic_output_tokens={output}",
            f"workload.num_requests={rng.randint(3, 10)}", f"workload.q={rng.choice([0.5, 1.0])}",
            f"engine.pinning_k={rng.choice([1, 2, 3])}", f"retention.k={rng.choice([1, 2])}",
            f"engine.headroom={rng.choice([0.0, 0.1, 0.3])}",
            f"semantics={rng.choice(['paper', 'first_chunk'])}", f"seed={rng.randint(0, 99)}",
        ]
        res = run_cell(compose_config(*overrides))
        assert res.summary["failed"] == 0, overrides


# ----- mechanism readouts -----------------------------------------------------------------
def test_c_once_h_k_and_prefix_hit_split():
    res = run_cell(compose_config(
        "workload.source=synthetic", "workload.synthetic_prompt_tokens=1400",
        "workload.synthetic_context_tokens=1200", "workload.synthetic_output_tokens=1000",
        "workload.num_requests=60", "org=d0", "budget=b30", "load.rate=2"))
    s, req = res.summary, res.tables["requests"]
    c_once = sum(p - a for p, a in zip(req["prompt_tokens"], req["adopted_prefix_tokens"],
                                       strict=True))
    assert s["c_once_tokens"] == c_once
    assert s["h_tokens"] == c_once + s["output_tokens"]
    assert s["engine_steps"] == len(res.tables["steps"]["step"])
    assert s["h_per_step"] == pytest.approx(s["h_tokens"] / s["engine_steps"])
    assert s["prefix_hit_tokens_cross"] == sum(req["adopted_prefix_tokens"])
    assert s["prefix_hit_tokens_self"] == sum(req["resume_adopted_tokens"]) > 0
    assert s["prefix_hit_tokens"] == s["prefix_hit_tokens_cross"] + s["prefix_hit_tokens_self"]
    # resume recomputation is excluded from C_once but counted in computed prefill
    assert s["prefill_tokens_computed"] > c_once
    po = res.tables["poller"]
    waiting = po["waiting"]  # D0 writes one row per pool per sample
    per_sample = waiting[:: len(set(po["pool"]))]
    assert s["waiting_max"] == max(per_sample)
    assert s["waiting_median"] == float(np.median(per_sample))
    assert s["running_mean"] == pytest.approx(np.mean(po["running"][:: len(set(po["pool"]))]))


# ----- reserve_output admission -------------------------------------------------------------
def test_reserve_output_defers_what_full_prompt_admits_and_later_preempts(falcon):
    """S0, 7 pages of one 512-token block or one composite; two 1,000-token prompts with 300
    output tokens. The first takes its aligned first chunk (1 block, the checkpoint at 512,
    the working composite: 3 pages), leaving 4. full_prompt's gate for the second is 2
    blocks + 1 checkpoint + the working composite = 4 pages: admitted, and the two later
    grow into third blocks in decode (a preemption). reserve_output with r = 300 asks for
    ceil(1,300 / 512) = 3 blocks, 5 pages > 4: the second waits for the first to finish."""
    specs = [spec(0, 1000, 300), spec(1, 1000, 300)]
    units = {"shared": 7}
    plain = run(falcon, "S0", units, specs, admission="full_prompt", max_num_batched_tokens=2048)
    reserved = run(falcon, "S0", units, specs, admission="reserve_output",
                   reserve_output_tokens=300, max_num_batched_tokens=2048)
    assert plain.requests[1].start_s < plain.requests[0].finish_s
    assert plain.summary["preemptions"] == 1
    first, second = reserved.requests
    assert second.start_s >= first.finish_s and reserved.summary["preemptions"] == 0
    # r = 24 still fits: 1,024 tokens are two blocks, so the second is admitted at once
    small = run(falcon, "S0", units, specs, admission="reserve_output",
                reserve_output_tokens=24, max_num_batched_tokens=2048)
    assert small.requests[1].start_s == plain.requests[1].start_s


def test_reserve_output_of_zero_is_full_prompt(falcon):
    specs = [spec(i, 700 + 90 * i, 40 + 7 * i, arrival=0.01 * i) for i in range(6)]
    a = run(falcon, "S1", {"shared": 40}, specs, admission="full_prompt")
    b = run(falcon, "S1", {"shared": 40}, specs, admission="reserve_output")
    def timeless(summary):
        return {k: v for k, v in summary.items() if "wall" not in k}

    assert timeless(a.summary) == timeless(b.summary) and a.summary["completed"] == 6
    assert [r.start_s for r in a.requests] == [r.start_s for r in b.requests]


def test_reserve_output_config_is_checked_and_read_from_the_engine_keys():
    with pytest.raises(ValueError, match="engine.reserve_output_tokens=-1"):
        SchedulerConfig(admission="reserve_output", reserve_output_tokens=-1)
    with pytest.raises(ValueError, match="reserve_output_tokens=8: applies only with"):
        SchedulerConfig(admission="full_prompt", reserve_output_tokens=8)
    from experiments.runners.spec import engine_spec
    from serving_core.builder import build_engine

    cfg = compose_config("engine.admission=reserve_output", "engine.reserve_output_tokens=64")
    rules = build_engine(engine_spec(cfg)).effective_rules()
    assert (rules["admission"], rules["reserve_output_tokens"]) == ("reserve_output", 64)
    default = build_engine(engine_spec(compose_config())).effective_rules()
    assert (default["admission"], default["reserve_output_tokens"]) == ("full_prompt", 0)
