"""A blocked head's failed admission is memoized (serving_core/scheduler.py `_try_admit`).

The memo skips re-checking a head that failed while requests ran, until an entry it could
adopt appears in the prefix cache (any change under first_chunk), a pool gains a free or
evictable unit, or the token budget grows. It must be
exact: every table of a run is the same with it as without it, and it must actually skip
(a memo that never fires would pass the first check vacuously).
"""

from __future__ import annotations

import pytest
from conftest import compose_config

from experiments.runners.cell import run_cell
from serving_core.memory import MemoryOrganization
from serving_core.memory.objects import Kind, StateObject
from serving_core.memory.pool import UnitPool
from serving_core.memory.prefix_cache import PrefixCache, PrefixHit
from serving_core.scheduler import Scheduler
from serving_core.state_manager import HybridStateManager


def _run(monkeypatch, org: str, memo: bool, overrides: tuple[str, ...]):
    calls = {"adoption": 0}
    original = HybridStateManager.adoption

    def counted(self, req):
        calls["adoption"] += 1
        return original(self, req)

    with monkeypatch.context() as m:
        m.setattr(HybridStateManager, "adoption", counted)
        if not memo:
            m.setattr(MemoryOrganization, "stable_demand", False)
        cfg = compose_config(f"org={org}", "write_ledgers=false", *overrides)
        result = run_cell(cfg)
    return result, calls["adoption"]


@pytest.mark.parametrize("org", ["d0", "s0", "s1", "n0"])
def test_memoized_admission_runs_exactly_the_same_and_skips_retries(monkeypatch, org):
    overrides = ("budget=b63", "workload.num_requests=120")
    with_memo, tries_memo = _run(monkeypatch, org, True, overrides)
    without, tries_plain = _run(monkeypatch, org, False, overrides)
    assert with_memo.tables.keys() == without.tables.keys()
    for name, table in without.tables.items():
        assert with_memo.tables[name] == table, f"{org}: table {name} differs with the memo"
    assert with_memo.summary["throughput_ledger"] == without.summary["throughput_ledger"]
    assert tries_memo < tries_plain, f"{org}: the memo never skipped a blocked head"


def test_organizations_whose_availability_moves_outside_pool_gains_opt_out():
    from serving_core.memory.jenga import JengaTwoLevel
    from serving_core.memory.s2 import S2PagingConvSlots

    assert not S2PagingConvSlots.stable_demand  # a slab's free slots change its demand
    assert not JengaTwoLevel.stable_demand  # small pages carved from large pages


def test_every_way_a_unit_becomes_available_counts_as_a_gain():
    pool = UnitPool("p", 4, 1)
    a, b = pool.pop_free(), pool.pop_free()
    assert pool.gains == 0
    pool.push_free(a)
    assert pool.gains == 1 and pool.num_available == 3
    pool.add_evictable(b)
    assert pool.gains == 2 and pool.num_available == 4
    pool.pop_lru()
    pool.pop_free()
    assert pool.gains == 2  # taking units never counts


@pytest.mark.parametrize("org,overrides", [
    ("d0", ("engine.admission=reserve_output", "engine.reserve_output_tokens=256")),
    ("d0", ("semantics=first_chunk",)),  # the memo compares the whole cache's version
    ("s1", ("engine.duplicates=cache",)),  # entries pass from copy to copy
])
def test_the_memo_is_exact_under_other_gates_and_duplicates(monkeypatch, org, overrides):
    overrides = ("budget=b63", "workload.num_requests=120", *overrides)
    with_memo, tries_memo = _run(monkeypatch, org, True, overrides)
    without, tries_plain = _run(monkeypatch, org, False, overrides)
    for name, table in without.tables.items():
        assert with_memo.tables[name] == table, f"{org} {overrides}: table {name} differs"
    assert tries_memo <= tries_plain


def _hit(attention: int, amax: int) -> PrefixHit:
    return PrefixHit(attention, amax, amax, amax)


def test_watch_bumps_only_for_entries_on_the_watched_chain():
    cache = PrefixCache()
    keys = list(range(100, 120))  # 20 blocks of 4 tokens, interval 8: checkpoint every 2
    for key in keys[:5]:
        cache.insert(StateObject(key, Kind.ATTENTION, "p", [], 0), key, checkpoint=False)
    mark = cache.watch(keys, _hit(attention=20, amax=16), 4, 8)
    assert cache.watched_blocks == frozenset(keys[:6])  # the prefix and the first missing
    assert cache.watched_checkpoints == frozenset({keys[1], keys[3]})  # boundaries 8, 16
    cache.insert(StateObject(1, Kind.ATTENTION, "p", [], 0), 999, checkpoint=False)
    cache.insert(StateObject(2, Kind.ATTENTION, "p", [], 0), keys[7], checkpoint=False)
    cache.insert(StateObject(3, Kind.COMPOSITE, "p", [], 0), keys[5], checkpoint=True)
    assert cache.watch_version == mark  # off the chain, past the gap, past the grid depth
    cache.insert(StateObject(4, Kind.ATTENTION, "p", [], 0), keys[5], checkpoint=False)
    assert cache.watch_version == mark + 1  # the first missing block appeared
    cache.insert(StateObject(5, Kind.COMPOSITE, "p", [], 0), keys[3], checkpoint=True)
    assert cache.watch_version == mark + 2  # a checkpoint within the grid depth
    assert cache.watch(keys, _hit(0, 0), 4, 8) == mark + 3  # a new chain: every memo stale


def test_watch_bumps_when_an_entry_passes_to_another_copy():
    cache = PrefixCache()
    first = StateObject(1, Kind.ATTENTION, "p", [], 0)
    second = StateObject(2, Kind.ATTENTION, "p", [], 0)
    cache.insert(first, 7, checkpoint=False)
    cache.insert(second, 7, checkpoint=False, duplicate=True)
    mark = cache.watch([7, 8], _hit(4, 0), 4, 0)
    cache.remove(first)
    assert cache.attention[7] is second and cache.watch_version == mark + 1


def test_a_decode_below_room_end_needs_no_unit_and_crosses_no_boundary(monkeypatch):
    """The manager's `room_end` lets the scheduler skip `reserve` for most decodes; check
    its promise independently before every step, and that it is used."""
    seen = {"promised": 0}
    original = Scheduler.schedule

    def checked(self, now):
        B, C = self.B, self.C
        for req in self.running:
            p = req.num_computed
            if req.num_tokens - p == 1 and p < req.room_end:
                seen["promised"] += 1
                assert -(-(p + 1) // B) <= len(req.attn), f"request {req.rid} at {p}"
                assert not C or (p + 1) % C, f"request {req.rid} at {p}: a boundary"
        return original(self, now)

    monkeypatch.setattr(Scheduler, "schedule", checked)
    for org, extra in (("d0", ()), ("s1", ()), ("n0", ()), ("s2", ("semantics=first_chunk",))):
        cfg = compose_config(f"org={org}", "budget=b63", "workload.num_requests=80",
                             "write_ledgers=false", *extra)
        run_cell(cfg)
    assert seen["promised"] > 1000
