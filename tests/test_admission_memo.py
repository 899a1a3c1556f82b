"""A blocked head's failed admission is memoized (serving_core/scheduler.py `_try_admit`).

The memo skips re-checking a head that failed while requests ran, until the prefix cache
changes, a pool gains a free or evictable unit, or the token budget grows. It must be
exact: every table of a run is the same with it as without it, and it must actually skip
(a memo that never fires would pass the first check vacuously).
"""

from __future__ import annotations

import pytest
from conftest import compose_config

from experiments.runners.cell import run_cell
from serving_core.memory import MemoryOrganization
from serving_core.memory.pool import UnitPool
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
