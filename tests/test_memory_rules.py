"""Candidate rules for how long a shared checkpoint survives (issue 19): the free-queue rule,
checkpoint recency, the dense slab policy, each against a hand-built scenario whose outcome
follows from the rule's text; every rule also keeps the allocator's invariants on a small
shared workload. Slab occupancy from a hand-written slab ledger."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
from conftest import compose_config

from experiments.runners.cell import run_cell
from serving_core.memory import AllocatorRules, build_memory
from serving_core.memory.invariants import check_invariants
from serving_core.memory.s2 import slab_occupancy


def cached_block(mem, key, rid=1):
    obj = mem.allocate_attention(rid)
    mem.publish(obj, key, 512)
    mem.release(obj, producer=True)
    return obj


# ----- free queue ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule, x_survives", [("free_first", True), ("single_queue", False)])
def test_free_queue_rule_decides_whether_a_freed_unit_or_the_lru_entry_goes(falcon, rule,
                                                                             x_survives):
    """Cached block X (unit 0) enters the LRU before unpublished Y (unit 1) is freed. Once the
    never-used units are gone, free_first reuses Y's unit and keeps X; single_queue takes the
    least recent of both queues, X (vLLM's one free_block_queue)."""
    mem = build_memory(falcon, "S1", {"shared": 8}, free_queue=rule)
    x = cached_block(mem, 11)
    y = mem.allocate_attention(2)
    mem.release(y, producer=True)  # unpublished: its unit is freed at the tail
    held = [mem.allocate_attention(3) for _ in range(6)]  # units 2..7, never used before
    assert sorted(u for h in held for u in h.units) == list(range(2, 8))
    z = mem.allocate_attention(4)
    assert (mem.cached_attention(11) is x) == x_survives
    assert z.units == ([1] if x_survives else [0])
    check_invariants(mem)


def test_single_queue_keeps_an_evicted_checkpoints_other_members_in_place(falcon):
    """Evicting the first member of cached composite X frees its other members where they
    stood in the queue (ahead of unit 4, freed later), as vLLM keeps a bundle's blocks."""
    mem = build_memory(falcon, "S1", {"shared": 6}, free_queue="single_queue")
    x = mem.allocate_composite(1)  # units 0..3 (3 SSM members + conv page)
    mem.publish(x, 11, 512)
    mem.release(x, producer=True)
    y = mem.allocate_attention(2)  # unit 4
    mem.allocate_attention(2)  # unit 5, held
    mem.release(y, producer=True)
    a = mem.allocate_attention(3)
    assert a.units == [0] and mem.cached_checkpoint(11) is None
    b = mem.allocate_attention(3)
    assert b.units == [1]
    check_invariants(mem)


# ----- checkpoint recency -------------------------------------------------------------------
def _adopt_checkpoint_after_block(mem) -> None:
    """Checkpoint X (key 11) is published, then block Y (key 22) is cached; X is adopted and
    released; then an allocation of 3 units needs an eviction."""
    x = mem.allocate_composite(1)
    mem.publish(x, 11, 512)
    mem.release(x, producer=True)
    cached_block(mem, 22, rid=2)
    mem.acquire(x)
    mem.release(x)
    mem.allocate_attention(3)


@pytest.mark.parametrize("rule, x_survives", [("release", True), ("publication", False)])
def test_checkpoint_recency_rule(falcon, rule, x_survives):
    """Checkpoint X (4 pages) then block Y fill the pool; X is adopted and released. The next
    allocation evicts Y if the adopter's release refreshed X, else X."""
    mem = build_memory(falcon, "S1", {"shared": 5}, checkpoint_recency=rule)
    _adopt_checkpoint_after_block(mem)
    assert (mem.cached_checkpoint(11) is not None) == x_survives
    assert (mem.cached_attention(22) is not None) == (not x_survives)
    check_invariants(mem)


def test_publication_recency_leaves_attention_blocks_refreshed(falcon):
    """The rule is about checkpoints: an adopted attention block is still refreshed."""
    mem = build_memory(falcon, "S1", {"shared": 2}, checkpoint_recency="publication")
    a = cached_block(mem, 11)
    cached_block(mem, 22)
    mem.acquire(a)
    mem.release(a)
    mem.allocate_attention(3)
    assert mem.cached_attention(11) is a and mem.cached_attention(22) is None


# ----- dense slab policy --------------------------------------------------------------------
def test_dense_refills_freed_slots(falcon):
    mem = build_memory(falcon, "S2", {"shared": 32}, slab_policy="dense")
    a, b = mem.allocate_composite(1), mem.allocate_composite(1)
    mem.release(a, producer=True)  # unpublished: slot 0 is freed
    c = mem.allocate_composite(1)
    assert (c.slab_page, c.slot) == (b.slab_page, 0)
    check_invariants(mem)


def test_dense_adoption_protects_but_does_not_refresh_the_slab(falcon):
    """As write_once: X's slab keeps the stamp of its last write, so after X is adopted and
    released the older-looking slab is reclaimed before the later block Y."""
    mem = build_memory(falcon, "S2", {"shared": 5}, slab_policy="dense")
    _adopt_checkpoint_after_block(mem)
    assert mem.cached_checkpoint(11) is None and mem.cached_attention(22) is not None


# ----- every rule on a shared workload --------------------------------------------------------
SYNTH = ("workload.source=synthetic", "workload.synthetic_prompt_tokens=1400",
         "workload.synthetic_context_tokens=1200", "workload.synthetic_output_tokens=200",
         "workload.num_requests=40", "budget=b30", "load.rate=6")


@pytest.mark.parametrize("org, rule", [
    ("s1", "engine.free_queue=single_queue"), ("s2", "engine.free_queue=single_queue"),
    ("d0", "engine.free_queue=single_queue"), ("s1", "engine.checkpoint_recency=publication"),
    ("s2", "engine.slab_policy=dense"),
    ("s2", "engine.slab_policy=dense engine.free_queue=single_queue"),
    ("s1", "engine.conv_page_recency=write"),
    ("s1", "engine.conv_page_recency=write engine.free_queue=single_queue"),
    ("s2", "engine.release_order=state_first engine.free_queue=single_queue"),
    ("s0", "engine.duplicates=cache"), ("s2", "engine.duplicates=cache"),
    ("d0", "engine.duplicates=cache engine.free_queue=single_queue"),
    ("s1", "engine.private_blocks=evict_first"), ("s2", "engine.private_blocks=evict_first"),
    ("d0", "engine.private_blocks=evict_first engine.free_queue=single_queue"),
    ("jenga", "engine.private_blocks=evict_first"),
])
def test_rules_keep_the_invariants_and_complete(org, rule):
    steps = []

    def check(sched, mem):
        steps.append(sched.step)
        check_invariants(mem)

    res = run_cell(compose_config(*SYNTH, f"org={org}", *rule.split()), on_step=check)
    assert res.summary["completed"] == 40 and steps
    for part in rule.split():
        key, value = part.removeprefix("engine.").split("=")
        assert str(getattr(res.memory, key)) == value  # read back from the allocator


def test_default_rules_are_todays():
    assert asdict(AllocatorRules()) == {
        "slab_policy": "write_once", "free_queue": "free_first", "checkpoint_recency": "release",
        "cache_policy": "lru", "marconi_weight": "tuned", "marconi_alpha": 1.0,
        "conv_page_recency": "members",
        "release_order": "attention_first", "duplicates": "drop", "private_blocks": "mru"}
    eng = compose_config().engine
    assert (eng.free_queue, eng.checkpoint_recency, eng.conv_page_recency, eng.release_order,
            eng.duplicates, eng.private_blocks) == ("free_first", "release", "members",
                                                    "attention_first", "drop", "mru")


@pytest.mark.parametrize("key, bad", [("engine.free_queue", "lifo"),
                                      ("engine.checkpoint_recency", "never"),
                                      ("engine.slab_policy", "sparse"),
                                      ("engine.conv_page_recency", "always"),
                                      ("engine.release_order", "random"),
                                      ("engine.duplicates", "merge"),
                                      ("engine.private_blocks", "lru")])
def test_bad_rule_values_name_the_field(key, bad):
    with pytest.raises(ValueError, match=key):
        AllocatorRules(**{key.removeprefix("engine."): bad})


# ----- slab occupancy -----------------------------------------------------------------------
def test_slab_occupancy_from_a_hand_written_ledger():
    """t 0: slab A, 3 slots; t 2: slab B, 1 slot (2 pages, 4 live); t 4: one slot freed
    (3 live); t 6: B reclaimed with its 1 live slot (1 page, 2 live); t 10: end (A freed).
    Time-averaged: live 3x2 + 4x2 + 3x2 + 2x4 = 28, page-seconds 1x2 + 2x2 + 2x2 + 1x4 = 14
    over 10 s, occupancy 28 / (16 x 14) = 0.125. Peak pages 2 first at t 2 with 4 live;
    peak live 4 at t 2."""
    rows = [(0, "SLAB_ALLOC", 0), (0, "SLOT_ALLOC", 0), (0, "SLOT_ALLOC", 0),
            (0, "SLOT_ALLOC", 0), (2, "SLAB_ALLOC", 0), (2, "SLOT_ALLOC", 0),
            (4, "SLOT_FREE", 0), (6, "CROSS_INVALIDATE", 1), (6, "SLAB_RECLAIM", 1),
            (10, "SLOT_FREE", 0), (10, "SLOT_FREE", 0), (10, "SLAB_FREE", 0)]
    slab = {"t_s": [r[0] for r in rows], "event": [r[1] for r in rows],
            "invalidated": [r[2] for r in rows]}
    occ = slab_occupancy(slab, 16)
    assert occ["occupancy_mean"] == pytest.approx(28 / (16 * 14))
    assert occ["pages_mean"] == pytest.approx(14 / 10)
    assert occ["live_mean"] == pytest.approx(28 / 10)
    assert (occ["pages_peak"], occ["live_at_peak_pages"]) == (2, 4)
    assert occ["occupancy_at_peak_pages"] == pytest.approx(4 / 32)
    assert (occ["live_peak"], occ["pages_at_peak_live"]) == (4, 2)
    empty = slab_occupancy({"t_s": [], "event": [], "invalidated": []}, 16)
    assert math.isnan(empty["occupancy_mean"]) and empty["pages_peak"] == 0


def test_dense_packs_slabs_tighter_than_write_once():
    """On a shared workload the dense policy keeps more live slots per slab page."""
    occ = {}
    for policy in ("write_once", "dense"):
        res = run_cell(compose_config(*SYNTH, "org=s2", f"engine.slab_policy={policy}"))
        occ[policy] = slab_occupancy(res.tables["slab"], 16)["occupancy_mean"]
    assert occ["dense"] > occ["write_once"]


# ----- the random-operation driver of test_memory_invariants under each rule ----------------
@pytest.mark.parametrize("org, pools, rules", [
    ("S1", {"shared": 24}, {"free_queue": "single_queue"}),
    ("S1", {"shared": 24}, {"checkpoint_recency": "publication"}),
    ("S2", {"shared": 60}, {"free_queue": "single_queue", "slab_policy": "dense"}),
    ("S2", {"shared": 24}, {"slab_policy": "dense", "checkpoint_recency": "publication"}),
    ("D0", {"attention": 150, "recurrent": 8}, {"free_queue": "single_queue"}),
    ("S1", {"shared": 24}, {"conv_page_recency": "write"}),
    ("S1", {"shared": 24}, {"duplicates": "cache", "release_order": "state_first"}),
    ("S2", {"shared": 60}, {"duplicates": "cache", "free_queue": "single_queue"}),
])
def test_random_operations_keep_all_invariants_under_each_rule(falcon, org, pools, rules):
    import test_memory_invariants as tmi

    recorder = tmi.Recorder()
    mem = build_memory(falcon, org, pools, recorder, **rules)
    driver = tmi.Driver(mem, 3, 6 if mem.has_slabs else 4)
    tmi.run(driver, 3000, lambda: check_invariants(mem))
    assert driver.stats["admitted"] > 50 and len(recorder.losses) > 20, driver.stats
    for req in list(driver.running):
        driver.finish(req)
    check_invariants(mem)
    for name, (used, cached, free, total) in mem.usage().items():
        assert used == 0 and cached + free == total, (name, mem.usage())


# ----- issue 33's candidate rules (memory.base) ----------------------------------------------
def _holder(attn=(), working=None):
    """What release_all reads of a request: its held objects."""
    from types import SimpleNamespace

    from serving_core.memory import NULL

    return SimpleNamespace(attn=list(attn), dests=[], working=working or NULL, adopted=NULL,
                           retained=[], pin=NULL)


@pytest.mark.parametrize("order, block_survives", [("attention_first", False),
                                                   ("state_first", True)])
def test_release_order_decides_what_a_single_queue_takes_first(falcon, order, block_survives):
    """A finishing request holds cached block A (unit 0) and its unpublished working
    composite W (units 1-4). Under vLLM's one queue, what is released first is taken first:
    attention_first queues A ahead of W's freed units, so once the never-used units 5-7 are
    gone the next block evicts A; state_first queues W's units first and A survives."""
    from serving_core.state_manager import HybridStateManager

    mem = build_memory(falcon, "S1", {"shared": 8}, free_queue="single_queue",
                       release_order=order)
    state = HybridStateManager(mem, step_end=True, retention_k=None, pinning_k=None)
    a = mem.allocate_attention(1)
    mem.publish(a, 11, 512)
    w = mem.allocate_composite(1)
    assert a.units == [0] and w.units == [1, 2, 3, 4]
    state.release_all(_holder([a], w))
    for _ in range(3):
        mem.allocate_attention(2)  # units 5, 6, 7: never used before
    b = mem.allocate_attention(2)
    assert (mem.cached_attention(11) is a) == block_survives
    assert b.units == ([1] if block_survives else [0])
    check_invariants(mem)


def test_release_order_does_not_matter_when_free_units_go_first(falcon):
    """Under free_first a freed unit is always taken before a cached one: both orders keep
    the block."""
    from serving_core.state_manager import HybridStateManager

    for order in ("attention_first", "state_first"):
        mem = build_memory(falcon, "S1", {"shared": 8}, release_order=order)
        state = HybridStateManager(mem, step_end=True, retention_k=None, pinning_k=None)
        a = mem.allocate_attention(1)
        mem.publish(a, 11, 512)
        state.release_all(_holder([a], mem.allocate_composite(1)))
        for _ in range(4):
            mem.allocate_attention(2)
        assert mem.cached_attention(11) is a


@pytest.mark.parametrize("rule, evicted", [("mru", [12, 13, 32, 31, 11]),
                                           ("evict_first", [32, 31, 12, 13, 11])])
def test_private_blocks_decide_whether_a_finished_suffix_goes_before_shared_chains(
        falcon, rule, evicted):
    """Request 1 holds a block S (key 11) that request 2 adopted and released, and two
    private blocks P1, P2 (keys 31, 32); it finishes after request 3's blocks (keys 12, 13)
    entered the LRU. Under `mru` its blocks enter at the recent end, deepest first (P2, P1,
    S), so 12 and 13 are evicted first. Under `evict_first` the unshared P2 and P1 go to the
    least recent end, P2 first, and are evicted before 12 and 13; S keeps its recency."""
    from serving_core.state_manager import HybridStateManager

    mem = build_memory(falcon, "S1", {"shared": 5}, private_blocks=rule)
    state = HybridStateManager(mem, step_end=True, retention_k=None, pinning_k=None)
    s, p1, p2 = (mem.allocate_attention(1) for _ in range(3))
    for obj, key in ((s, 11), (p1, 31), (p2, 32)):
        mem.publish(obj, key, 512)
    mem.acquire(s)  # request 2 adopts S (the state manager marks it shared) and releases it
    s.shared = True
    mem.release(s)
    cached_block(mem, 12, rid=3)
    cached_block(mem, 13, rid=3)
    state.release_all(_holder([s, p1, p2]), finishing=True)
    lost = []
    for _ in range(5):
        before = set(mem.cache.attention)
        mem.allocate_attention(4)
        lost += sorted(before - set(mem.cache.attention))
        check_invariants(mem)
    assert lost == evicted


def test_a_preempted_request_keeps_its_private_blocks_recent(falcon):
    """evict_first applies to a finishing request: a preempted one resumes from its own
    blocks, so they enter the LRU at the recent end as under mru."""
    from serving_core.state_manager import HybridStateManager

    mem = build_memory(falcon, "S1", {"shared": 3}, private_blocks="evict_first")
    state = HybridStateManager(mem, step_end=True, retention_k=None, pinning_k=None)
    old = cached_block(mem, 12, rid=3)
    mine = mem.allocate_attention(1)
    mem.publish(mine, 31, 512)
    state.release_all(_holder([mine]))  # preemption: not finishing
    mem.allocate_attention(4)
    mem.allocate_attention(4)
    assert mem.cached_attention(12) is None and mem.cached_attention(31) is mine
    assert old.valid is False


def test_a_block_another_request_adopted_is_marked_shared(falcon):
    """The state manager marks an adopted block shared when the adopter is not its producer
    (a resumed request adopting its own prefix leaves it private)."""
    from types import SimpleNamespace

    from serving_core.state_manager import HybridStateManager

    mem = build_memory(falcon, "S1", {"shared": 16})
    state = HybridStateManager(mem, step_end=False, retention_k=None, pinning_k=None)
    own, other = cached_block(mem, 11, rid=1), cached_block(mem, 12, rid=1)
    for rid, obj in ((1, own), (2, other)):
        req = SimpleNamespace(rid=rid, pin=None, attn=[], dests=[], working=None,
                              adopted=None, num_computed=0, num_prompt=1, num_tokens=1,
                              target_output=1, room_end=0)
        adoption = SimpleNamespace(objects=[obj], blocks=[obj], checkpoint=None, jadopt=0,
                                   keys=[], hit=None)
        state.admit(req, adoption, 0)
    assert own.shared is False and other.shared is True


@pytest.mark.parametrize("rule, checkpoint_survives", [("members", True), ("write", False)])
def test_conv_page_recency_write_keeps_the_publication_stamp(falcon, rule,
                                                             checkpoint_survives):
    """S1 checkpoint C (units 0-3, conv page unit 3) is published and released, block B
    (unit 4) enters the LRU after it, then an adopter reads C and releases it. Under
    `members` the adopter's release refreshes all four units, so the first eviction takes B;
    under `write` C's conv page keeps its last write (publication), older than B, so the
    first eviction takes it and C is lost (its SSM members are freed)."""
    mem = build_memory(falcon, "S1", {"shared": 6}, conv_page_recency=rule)
    c = mem.allocate_composite(1)
    assert mem.conv_line(c) == 3
    mem.publish(c, 21, 512)
    mem.release(c, producer=True)
    b = cached_block(mem, 11, rid=2)
    mem.acquire(c)  # an adopter reads the checkpoint ...
    mem.release(c)  # ... and drops it after its first step
    mem.allocate_attention(3)  # unit 5, the last free one
    got = mem.allocate_attention(3)  # evicts the least recent unit
    assert (mem.cached_checkpoint(21) is c) == checkpoint_survives
    assert (mem.cached_attention(11) is b) == (not checkpoint_survives)
    assert got.units == ([4] if checkpoint_survives else [3])
    check_invariants(mem)


def test_conv_page_recency_applies_only_where_a_conv_page_exists(falcon):
    """S0 (contiguous composite) and S2 (conv slot) have no conv page: the rule is absent
    (None) in the allocator and in the engine's record."""
    for org in ("S0", "S2", "D0"):
        pools = {"attention": 100, "recurrent": 4} if org == "D0" else {"shared": 12}
        assert build_memory(falcon, org, pools, conv_page_recency="write").conv_page_recency \
            is None
    assert build_memory(falcon, "S1", {"shared": 12},
                        conv_page_recency="write").conv_page_recency == "write"
    res = run_cell(compose_config(*SYNTH, "org=s0", "engine.conv_page_recency=write"))
    assert res.engine_config["conv_page_recency"] is None
    res = run_cell(compose_config(*SYNTH, "org=s1", "engine.conv_page_recency=write"))
    assert res.engine_config["conv_page_recency"] == "write"


@pytest.mark.parametrize("rule", ["drop", "cache"])
def test_duplicates_cache_keeps_a_key_while_any_copy_is_valid(falcon, rule):
    """Request 1 publishes block X for key 11; request 2 computed the same block Y meanwhile.
    `drop`: Y is not published and is freed at release; evicting X loses key 11. `cache`
    (vLLM's BlockHashToBlockMap keeps duplicates): Y is a second copy, the key survives X's
    eviction (Y becomes the entry; no LOSS recorded) and is lost with Y."""
    import test_memory_invariants as tmi

    recorder = tmi.Recorder()
    mem = build_memory(falcon, "S1", {"shared": 3}, recorder, duplicates=rule)
    x = mem.allocate_attention(1)
    y = mem.allocate_attention(2)
    assert mem.publish(x, 11, 512)
    assert mem.publish(y, 11, 512) == (rule == "cache")
    mem.release(x)
    mem.release(y)
    assert mem.pools["shared"].num_free == (2 if rule == "drop" else 1)
    check_invariants(mem)
    if rule == "drop":
        mem.allocate_attention(3)
        mem.allocate_attention(3)  # unit 2 and Y's freed unit 1
        mem.allocate_attention(3)  # evicts X
        assert mem.cached_attention(11) is None and recorder.losses == [(x, 3)]
        return
    mem.allocate_attention(3)  # unit 2, the last free one
    mem.allocate_attention(3)  # evicts X, the older copy
    assert mem.cached_attention(11) is y and recorder.losses == []
    assert mem.lookup([11]).attention == 512
    check_invariants(mem)
    mem.allocate_attention(3)  # evicts Y, the last copy
    assert mem.cached_attention(11) is None and recorder.losses == [(y, 3)]
    check_invariants(mem)


def test_duplicates_cache_publishes_a_recomputed_checkpoint(falcon):
    """A request crossing a boundary whose checkpoint is already cached: `drop` frees its
    destination (a no-op publication); `cache` publishes its state as a second copy."""
    from types import SimpleNamespace

    from serving_core.state_manager import HybridStateManager

    for rule, copies in (("drop", 0), ("cache", 1)):
        mem = build_memory(falcon, "S1", {"shared": 24}, duplicates=rule)
        state = HybridStateManager(mem, step_end=True, retention_k=None, pinning_k=None)
        first = mem.allocate_composite(1)
        mem.publish(first, 7, 512)
        mem.release(first, producer=True)
        req = SimpleNamespace(working=mem.allocate_composite(2),
                              dests=[mem.allocate_composite(2)], retained=[])
        produced = req.working
        got = state._cross_boundary(req, 7, 512)
        assert len(mem.cache.copies.get((True, 7), [])) == copies
        assert bool(got) == bool(copies) and (got is produced) == bool(copies)
        assert mem.cached_checkpoint(7) is first
        check_invariants(mem)
