"""The host tier as users run one: bounded capacity with LRU eviction of whole entries,
saves off the engine thread that never read a reassigned unit, restore on resume.

Store rules are checked with hand-computed byte counts; the engine-level tests run the
tiny torch model (tokens compared with an engine that never used the tier)."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from engines import torch_engine

from experiments.workloads.workload import RequestSpec
from serving_core.executor.state_copy import ArenaCopier, ThreadCopier
from serving_core.geometry import load_geometry
from serving_core.host_tier import HostTier
from serving_core.planner import plan_budget, units_for
from serving_core.request import Request
from serving_core.scheduler import SchedulerConfig
from serving_core.state_manager import BLOCK, CHECKPOINT, HybridStateManager

# ----- the store ------------------------------------------------------------------------------
BLOCK_B, CKPT_B = 10, 20  # bytes of one block and one checkpoint in the store tests


def _put(tier: HostTier, key: int, chain: list[int], complete: bool = True) -> bool:
    """Save the entry `key` (a checkpoint over `chain`) the way a state manager does."""
    parts = [(BLOCK, k, BLOCK_B) for k in chain if not tier.holds(BLOCK, k)]
    parts.append((CHECKPOINT, key, CKPT_B))
    if not tier.begin_entry(key, chain, parts):
        return False
    if complete:
        for kind, k, _ in parts:
            tier.save(kind, k, [torch.zeros(1, dtype=torch.uint8)])
        tier.complete()
    return True


def test_capacity_evicts_whole_lru_entries_and_keeps_shared_blocks():
    tier = HostTier(100)
    assert _put(tier, 2, [1, 2])  # X: 2 blocks + checkpoint = 40 B
    assert _put(tier, 4, [1, 2, 3, 4])  # Y shares X's blocks: 2 new blocks + checkpoint
    assert tier.used_bytes == 80 and tier.num_entries == 2
    assert _put(tier, 8, [7, 8])  # Z: 40 B; X is the LRU entry: its checkpoint goes (20 B)
    assert tier.evictions == 1 and tier.evicted_bytes == 20 and tier.used_bytes == 100
    assert not tier.holds_entry(2) and tier.holds(BLOCK, 1) and tier.holds(BLOCK, 2)
    assert tier.restorable_prefix([1, 2], 1, 2) == 0  # X's checkpoint is gone
    assert tier.restorable_prefix([1, 2, 3, 4], 1, 2) == 4  # Y is whole
    assert tier.restorable_prefix([7, 8], 1, 2) == 2
    tier.touch(4)  # Y used: Z is now the LRU entry
    assert _put(tier, 10, [9, 10])  # evicts Z whole (its blocks are nobody else's)
    assert tier.evictions == 2 and tier.evicted_bytes == 60 and tier.used_bytes == 100
    assert not tier.holds(BLOCK, 7) and not tier.holds(BLOCK, 8) and 7 not in tier.blocks
    assert tier.restorable_prefix([1, 2, 3, 4], 1, 2) == 4


def test_pinned_and_inflight_entries_are_never_evicted_and_a_misfit_is_rejected():
    tier = HostTier(80)
    assert _put(tier, 2, [1, 2])
    assert _put(tier, 4, [3, 4], complete=False)  # copies in flight
    tier.pin(2)  # a restore reads X
    assert not _put(tier, 6, [5, 6])  # no evictable entry: rejected, nothing changed
    assert tier.rejected_saves == 1 and tier.used_bytes == 80 and tier.evictions == 0
    assert tier.holds_entry(2) and tier.holds_entry(4) and not tier.holds(BLOCK, 5)
    tier.unpin(2)
    assert _put(tier, 6, [5, 6])  # X evicted now; the in-flight entry stays
    assert not tier.holds_entry(2) and tier.holds_entry(4) and tier.used_bytes == 80
    assert not _put(tier, 99, [90, 91, 92, 93, 94, 95, 96])  # 90 B > 80 B capacity
    assert tier.rejected_saves == 2
    with pytest.raises(ValueError, match="capacity_bytes=0 must be an integer > 0"):
        HostTier(0)


def test_an_entry_in_flight_is_not_restorable():
    tier = HostTier(100)
    assert _put(tier, 2, [1, 2], complete=False)
    assert tier.restorable_prefix([1, 2], 1, 2) == 0
    for kind, key in ((BLOCK, 1), (BLOCK, 2), (CHECKPOINT, 2)):
        tier.save(kind, key, [torch.zeros(1, dtype=torch.uint8)])
    assert tier.restorable_prefix([1, 2], 1, 2) == 0  # landed, not completed
    assert tier.complete() == 3 and tier.restorable_prefix([1, 2], 1, 2) == 2


# ----- on the tiny model ----------------------------------------------------------------------
GEOMETRY = "falcon_h1_tiny"
# One S2 entry of a 599-token prompt: 2 layers x (512 x 1,024 B of KV + 1,557 KiB state)
ENTRY_BYTES = 2 * (512 * 1024 + 1557 * 1024)


def _engine(model, org="S2", tier_bytes: int | None = 1 << 30):
    geometry = load_geometry(GEOMETRY)
    units = units_for(plan_budget(geometry, "b63"), org)
    tier = {"capacity_bytes": tier_bytes} if tier_bytes else None
    return torch_engine(model, geometry, org, units,
                        SchedulerConfig(cap=4, max_num_batched_tokens=2048, headroom=0.0),
                        clock="virtual", host_tier=tier)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128_256, n).astype(np.int32)


def _serve(engine, rid: int, prompt: np.ndarray, out: int = 4) -> list[int]:
    engine.add_request(RequestSpec(rid, 0.0, prompt, out, -1, ""))
    tokens = []
    while engine.has_work():
        step = engine.step()
        if step is not None:
            tokens += [t for r, t in step.produced if r == rid]
    engine.host_tier and engine.host_tier.flush(engine.sched.state)
    return tokens


def test_capacity_overflow_evicts_and_a_later_request_recomputes_correctly(tiny_model):
    a, b = _prompt(1, 599), _prompt(2, 599)
    reference = _engine(tiny_model, tier_bytes=None)
    want_a, want_b = _serve(reference, 0, a), _serve(reference, 1, b)
    eng = _engine(tiny_model, tier_bytes=ENTRY_BYTES + ENTRY_BYTES // 2)  # one entry fits
    tier = eng.host_tier.tier
    assert eng.effective_rules()["host_tier"] == {"capacity_bytes": ENTRY_BYTES * 3 // 2,
                                                  "poison": False}
    assert _serve(eng, 0, a) == want_a and tier.used_bytes == ENTRY_BYTES
    assert _serve(eng, 1, b) == want_b
    assert (tier.evictions, tier.evicted_bytes, tier.num_entries) == (1, ENTRY_BYTES, 1)
    eng.reset_prefix_cache()
    assert _serve(eng, 2, a) == want_a  # A's entry was evicted: recompute, same tokens
    assert 2 not in eng.host_tier.restored
    assert tier.evictions == 2 and tier.holds_entry(Request(
        RequestSpec(2, 0.0, a, 4, -1, ""), 512).lookup_keys()[0])  # A saved again, B out
    eng.reset_prefix_cache()
    assert _serve(eng, 3, a) == want_a  # A is held now: restored, same tokens
    assert eng.host_tier.restored[3] == 512
    eng.reset_prefix_cache()
    assert _serve(eng, 4, b) == want_b and 4 not in eng.host_tier.restored
    counters = eng.host_tier.counters()
    assert counters["tier_usage_bytes"] <= counters["tier_capacity_bytes"]


def _gated(engine, gate: threading.Event) -> ThreadCopier:
    """Replace the engine's copier by one whose reads wait for `gate` (a slow copy)."""
    link = engine.host_tier
    link.worker.close()
    link.worker = ThreadCopier(link.copier, gate=gate)
    return link.worker


def _grab_every_unit(mem, arena) -> list:
    """Allocate every unit the device can give (evicting what it may) and overwrite it, as
    a new request's prefill would."""
    grabbed = []
    while mem.can_allocate(mem.demand(1, 0)):
        obj = mem.allocate_attention(-1)
        arena.raw[obj.pool][:, obj.units] = 0x11
        grabbed.append(obj)
    return grabbed


@pytest.mark.parametrize("held", [True, False])
def test_a_save_racing_a_reassignment_never_copies_stale_bytes(tiny_model, monkeypatch, held):
    """An injected slow copy: while the copier still has to read an entry, the engine hands
    out every unit it can and overwrites them. The copy hold keeps the entry's units out
    of reach, so the tier gets the published bytes and a reload continues exactly; with
    the hold removed (control) the units are reassigned and the tier copies the new bytes."""
    if not held:
        monkeypatch.setattr(HybridStateManager, "hold_for_copy", lambda self, obj: None)
        monkeypatch.setattr(HybridStateManager, "end_copy_hold", lambda self, obj, st: None)
    prompt = _prompt(3, 599)
    spec = RequestSpec(0, 0.0, prompt, 4, -1, "")
    want = _serve(_engine(tiny_model, tier_bytes=None), 0, prompt)
    eng = _engine(tiny_model)
    gate = threading.Event()
    worker = _gated(eng, gate)
    eng.add_request(spec)
    got = []
    while eng.has_work():
        step = eng.step()
        got += [t for r, t in (step.produced if step else []) if r == 0]
    assert got == want and worker.inflight == 2  # the block and the checkpoint, unread
    mem, arena = eng.mem, eng.executor.arena
    copier = ArenaCopier(arena)
    published = {(kind, k): copier.read(obj) for kind, table in
                 ((BLOCK, mem.cache.attention), (CHECKPOINT, mem.cache.checkpoints))
                 for k, obj in table.items()}
    keys = Request(spec, 512).lookup_keys()
    tier = eng.host_tier.tier
    assert len(published) == 2 and tier.restorable_prefix(keys, 512, 512) == 0
    grabbed = _grab_every_unit(mem, arena)
    assert (len(mem.cache.attention), len(mem.cache.checkpoints)) == ((1, 1) if held else (0, 0))
    gate.set()  # the slow copies read now
    eng.host_tier.flush(eng.sched.state)
    same = [all(torch.equal(a, b) for a, b in zip(tier.entry(kind, k), data, strict=True))
            for (kind, k), data in published.items()]
    assert same == [held, held]
    for obj in grabbed:
        mem.release(obj)
    if held:  # a reset device behind the same tier continues exactly
        fresh = _engine(tiny_model)
        fresh.host_tier.tier = tier
        assert _serve(fresh, 5, prompt) == want and fresh.host_tier.restored[5] == 512


def _expected_resume_b(mem, tokens: int) -> int:
    """Deepest boundary the device had published (hence the tier saved) within `tokens`."""
    return max([o.boundary for o in mem.cache.checkpoints.values() if o.boundary <= tokens]
               or [0])


@pytest.mark.parametrize("org, n", [("S0", 1027), ("S1", 1027), ("S2", 1027), ("D0", 3587),
                                    ("N0", 3139)])
def test_a_preempted_request_restores_on_resume_with_b_equal_p(tiny_model, org, n):
    """The request is preempted after 3 generated tokens and the device cache dropped (what
    eviction under pressure does); at re-admission the tier restores B, the deepest
    boundary it holds within the tokens known, the scheduler adopts p = B, and the tokens
    equal an uninterrupted run's."""
    prompt = _prompt(4, n)
    want = _serve(_engine(tiny_model, org, tier_bytes=None), 0, prompt, out=8)
    eng = _engine(tiny_model, org)
    sched = eng.sched
    eng.add_request(RequestSpec(0, 0.0, prompt, 8, -1, ""))
    got = []
    while not sched.running or sched.running[0].num_generated < 3:
        step = eng.step()
        got += [t for r, t in step.produced if r == 0]
    req = sched.running[0]
    known = req.num_tokens - 1  # a resume looks up every token but the last
    b = _expected_resume_b(eng.mem, known)
    assert b > 0
    sched._preempt(sched.running.pop())  # the scheduler's tail preemption
    eng.reset_prefix_cache()  # the device lost the prefix; the tier keeps it
    while eng.has_work():
        step = eng.step()
        got += [t for r, t in step.produced if r == 0]
    assert got == want
    assert req.preemptions == 1 and eng.host_tier.resumed[0] == b == req.adopted_resume
    assert eng.host_tier.counters()["tier_resume_restores"] == 1


# ----- the simulated tier ---------------------------------------------------------------------
def test_the_modelled_link_charges_bytes_over_bandwidth_plus_latency():
    """Falcon-H1-7B S2: a block is 44 x 512 x 1,024 B, a checkpoint 44 x (1,536 + 21) KiB;
    the A100 profile's nominal PCIe 4.0 x16 link is 16 GT/s x 16 x 128/130 / 8 B/s."""
    from dataclasses import asdict

    from serving_core.builder import build_engine
    from serving_core.engine_spec import EngineSpec, ExecutorSpec
    from serving_core.executor.profiles import load_device_profile

    profile = load_device_profile("a100")
    assert profile.host_link_bandwidth_Bps == pytest.approx(31.50769230769e9)
    assert profile.host_link_latency_s == 10e-6
    spec = EngineSpec(model=asdict(load_geometry("falcon_h1_7b")), org="S2", budget="b63",
                      executor=ExecutorSpec("simulated", profile=asdict(profile)),
                      host_tier={"capacity_bytes": 1 << 34})
    link = build_engine(spec).host_tier.copier
    assert (link.block_bytes, link.state_bytes) == (23_068_672, 70_152_192)
    bw = 16e9 * 16 * 128 / 130 / 8
    assert link.seconds(23_068_672 + 70_152_192, 2) == pytest.approx(
        (23_068_672 + 70_152_192) / bw + 2e-5)
    assert link.seconds(0) == 0.0


def _sim_cell(*overrides):
    from conftest import compose_config

    from experiments.runners.cell import run_cell

    cfg = compose_config("org=d0", "budget=b63", "workload.num_requests=60",
                         "write_ledgers=false", *overrides)
    return run_cell(cfg)


def test_a_simulated_campaign_cell_runs_the_tier_and_records_it():
    off = _sim_cell()
    small = _sim_cell("host_tier.capacity_bytes=2000000000")
    again = _sim_cell("host_tier.capacity_bytes=2000000000")
    assert off.engine_config["host_tier"] is False and "host_tier_copies" not in off.engine_config
    rules = small.engine_config
    assert rules["host_tier"] == {"capacity_bytes": 2_000_000_000, "poison": False}
    assert rules["host_tier_copies"] == {"copies": "modelled",
                                         "link_bandwidth_Bps": pytest.approx(31.50769230769e9),
                                         "link_latency_s": 10e-6}
    assert small.tables == again.tables  # a pure function of (config, seed)
    assert small.tables != off.tables


def test_a_small_simulated_tier_evicts_and_restores_cost_their_transfer_time():
    from conftest import compose_config

    from experiments.runners.spec import engine_spec
    from experiments.workloads.workload import build_workload
    from serving_core.builder import build_engine
    from serving_core.engine import serve

    cfg = compose_config("org=d0", "budget=b63", "workload.num_requests=60",
                         "host_tier.capacity_bytes=1500000000", "write_ledgers=false")
    engine = build_engine(engine_spec(cfg))
    serve(engine, build_workload(cfg.workload, cfg.load, int(cfg.seed)).requests)
    link = engine.host_tier
    c = link.counters()
    assert c["tier_evictions"] > 0 and c["tier_usage_bytes"] <= 1_500_000_000
    assert c["tier_restores"] > 0 and c["tier_bytes_d2h"] > 0
    bw, lat = link.copier.bandwidth_Bps, link.copier.latency_s
    assert link.restore_seconds == pytest.approx(
        c["tier_bytes_h2d"] / bw + link.restore_transfers * lat)


def test_bad_tier_capacity_is_refused_with_one_line():
    from conftest import compose_config

    from experiments.config.validation import validate_config

    for value, message in (("0", "host_tier.capacity_bytes=0: allowed integers >= 1"),
                           ("1.5", "host_tier.capacity_bytes=1.5: allowed integers >= 1"),
                           ("true", "host_tier.capacity_bytes=True: allowed integers >= 1")):
        with pytest.raises(ValueError, match=re.escape(message)):
            validate_config(compose_config(f"host_tier.capacity_bytes={value}"),
                            check_root=False)


def test_a_copy_hold_keeps_the_lru_recency_the_entry_had(tiny_model):
    """A save's hold is not a use: after it ends, the cached units sit in the LRU where they
    were; a plain reference (an adopter) would have moved them to the MRU end."""
    eng = _engine(tiny_model, tier_bytes=None)
    _serve(eng, 0, _prompt(5, 599))
    state, mem = eng.sched.state, eng.mem
    (obj,) = mem.cache.checkpoints.values()
    pool = mem.pools[obj.pool]
    before = [pool.evictable[u] for u in obj.units]
    token = state.hold_for_copy(obj)
    assert obj.ref_count == 1 and not any(u in pool.evictable for u in obj.units)
    state.end_copy_hold(obj, token)
    assert [pool.evictable[u] for u in obj.units] == before
    mem.acquire(obj)
    mem.release(obj)
    assert [pool.evictable[u] for u in obj.units] != before  # control: a use refreshes


def test_the_modelled_link_counts_a_granite_presets_scope_layers_not_its_layers():
    """Granite-4.0-H-Tiny (conf/model/granite_4_0_h_tiny.yaml) S2: 40 layers, but 4 storage
    groups of 1 attention and 9 Mamba2 layers. A block is 4 groups x 512 tokens x (4 KV heads
    x 128 x K,V x 2 B) = 4 x 512 x 2,048 B; a checkpoint 4 groups x 9 layers x (SSM 48 x 64 x
    128 x 2 B + conv (48 x 64 + 2 x 128) x 3 x 2 B). Counting 40 layers would give 10x."""
    from dataclasses import asdict

    from serving_core.builder import build_engine
    from serving_core.engine_spec import EngineSpec, ExecutorSpec
    from serving_core.executor.profiles import load_device_profile

    block = 4 * 512 * (4 * 128 * 2 * 2)
    state = 4 * 9 * (48 * 64 * 128 * 2 + (48 * 64 + 2 * 128) * 3 * 2)
    assert (block, state) == (4_194_304, 29_030_400)
    spec = EngineSpec(model=asdict(load_geometry("granite_4_0_h_tiny")), org="S2",
                      budget="b63",
                      executor=ExecutorSpec("simulated", profile=asdict(load_device_profile(
                          "a100"))), host_tier={"capacity_bytes": 1 << 34})
    link = build_engine(spec).host_tier.copier
    assert (link.block_bytes, link.state_bytes) == (block, state)
