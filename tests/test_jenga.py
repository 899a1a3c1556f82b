"""The Jenga arm (serving_core/memory/jenga.py): sizes, plans and costs by hand, the
two-level allocator's rules on hand-built scenarios, and the invariants (memory/invariants.py
with Jenga's own bookkeeping check) over 10^5 random operations.

Falcon-H1-7B by hand: KV 2 heads x 2 x 128 x 2 B = 1,024 B per token, so an attention small
page (16 tokens) is 16,384 B; the composite is 1,572,864 + 21,504 = 1,594,368 B, padded to
ceil(1,594,368 / 16,384) = 98 attention pages = 1,605,632 B; the large page is
lcm(16,384, 1,605,632) = 1,605,632 B = one state page or 98 attention pages. That is
exactly the uniform hybrid page U, so bN is N large pages.
"""

from __future__ import annotations

import pytest
from test_memory_invariants import CONFIG, assert_exercised, new_run, run

from serving_core import planner, storage
from serving_core.memory import build_memory, org_layout
from serving_core.memory.invariants import check_invariants
from serving_core.memory.jenga import JengaTwoLevel

LARGE = 1_605_632


def test_layout_by_hand(falcon, granite):
    lay = org_layout(falcon, "jenga")
    assert (lay.block_tokens, lay.checkpoint_interval) == (16, 512)
    assert (lay.page_bytes, lay.recurrent_unit_bytes, lay.large_page_bytes) == (
        16_384, LARGE, LARGE)
    assert (lay.attention_per_large, lay.state_per_large) == (98, 1)
    # Granite: 2,048 B/token -> 32,768-B pages; 1,048,576 + 26,112 = 1,074,688 B composite,
    # ceil(1,074,688 / 32,768) = 33 pages = 1,081,344 B
    g = org_layout(granite, "jenga")
    assert (g.page_bytes, g.recurrent_unit_bytes, g.attention_per_large) == (
        32_768, 1_081_344, 33)


@pytest.mark.parametrize("label, large", [("b63", 63), ("b83", 83), ("b108", 108),
                                          ("p254", 82)])
def test_plan_by_hand(falcon, label, large):
    # p254 = 254 x 524,288 = 133,169,152 B; / 1,605,632 = 82.9 -> 82 large pages
    plan = planner.plan_budget(falcon, label)
    assert planner.units_for(plan, "jenga") == {"attention": 98 * large, "recurrent": large}
    assert plan.org_bytes("JENGA") == large * LARGE


def test_costs_by_hand(falcon):
    def cost(blocks, checkpoints):
        return storage.allocation_cost(falcon, "jenga", blocks, checkpoints)

    # 1 paged block = 512 tokens = 32 pages -> 1 large page; 4 blocks = 128 -> 2; 6 = 192 -> 2
    assert cost(1, 0).num_bytes == LARGE
    assert cost(4, 0).num_bytes == cost(6, 0).num_bytes == 2 * LARGE
    assert cost(7, 0).num_bytes == 3 * LARGE  # 224 pages > 196
    # checkpoints take one large page each
    c = cost(4, 3)
    assert (c.attention_bytes, c.recurrent_bytes) == (2 * LARGE, 3 * LARGE)
    # the whole cost against the whole budget (both types share the large pages)
    assert storage.fits(falcon, "jenga", 4, 3, 5 * LARGE)
    assert not storage.fits(falcon, "jenga", 4, 3, 5 * LARGE - 1)


def _mem(falcon, large=3):
    return build_memory(falcon, "jenga", {"attention": 98 * large, "recurrent": large})


def _cached_attention(mem, key, rid=1):
    obj = mem.allocate_attention(rid)
    mem.publish(obj, key, 16)
    mem.release(obj, producer=True)
    return obj


def test_small_pages_share_a_large_page_and_it_returns_when_all_are_free(falcon):
    mem = _mem(falcon)
    blocks = [mem.allocate_attention(1) for _ in range(98)]
    assert {u // 98 for b in blocks for u in b.units} == {0}  # one large page, carved
    assert list(mem.large_free) == [1, 2]
    extra = mem.allocate_attention(1)  # the 99th page opens a second large page
    assert extra.units == [98] and list(mem.large_free) == [2]
    for b in blocks[:-1]:
        mem.release(b)
    assert list(mem.large_free) == [2]  # one small page still used
    mem.release(blocks[-1])
    assert list(mem.large_free) == [2, 0]  # all free: the large page returns
    state = mem.allocate_composite(2)  # a state page takes the oldest free large page
    assert state.units == [2] and mem.large_type[2] == "recurrent"
    check_invariants(mem)


def test_a_type_evicts_its_own_cached_pages_before_another_types(falcon):
    """Large page 0 holds a used attention page and cached one A; page 1 holds cached
    state S (nothing references it, so it is reclaimable). The remaining free large page
    goes first; then a new attention page takes A (the type's own LRU, in an in-use large
    page) although S is older, and a new state takes page 1 back from S."""
    mem = _mem(falcon)
    mem.allocate_attention(1)  # held: large page 0 stays in use
    s = mem.allocate_composite(2)
    mem.publish(s, 7, 512)
    mem.release(s, producer=True)  # S cached first (oldest)
    fill = [mem.allocate_attention(3) for _ in range(97)]  # page 0 full
    a = fill[-1]
    mem.publish(a, 11, 16)
    for b in fill[:-1]:
        mem.release(b)
    mem.release(a)  # A cached, page 0 still in use (held)
    new = mem.allocate_attention(4)  # 96 free pages in page 0 first
    assert new.units[0] // 98 == 0 and a.valid and s.valid
    more = [mem.allocate_attention(4) for _ in range(95)]  # page 0's free pages: all gone
    assert all(u // 98 == 0 for b in more for u in b.units) and a.valid
    a_unit = a.units[0]
    third = mem.allocate_attention(4)  # the type's own cached page before a free large page
    assert third.units == [a_unit] and not a.valid and s.valid
    assert list(mem.large_free) == [2]
    state = mem.allocate_composite(5)  # the free large page
    assert state.units == [2] and s.valid
    state2 = mem.allocate_composite(5)  # then the reclaimable large page of S
    assert state2.units == [1] and not s.valid
    check_invariants(mem)


def test_reclaim_takes_the_least_recent_unreferenced_large_page_of_either_type(falcon):
    """No large page free: a type with nothing of its own in use reclaims the large page
    that nothing references and whose newest small page is oldest, whatever its type."""
    mem = _mem(falcon)
    a1 = _cached_attention(mem, 1)  # large page 0
    a2 = _cached_attention(mem, 2)  # page 0 is not in use: a free large page, 1, first
    assert (a1.units, a2.units) == ([0], [98])
    s1 = mem.allocate_composite(2)  # large page 2
    mem.publish(s1, 3, 512)
    mem.release(s1, producer=True)
    mem.acquire(a1)  # a hit refreshes page 0: LRU order now page 1 < page 2 < page 0
    mem.release(a1)
    assert not mem.large_free
    s2 = mem.allocate_composite(3)  # reclaims page 1 from attention: a2 is evicted
    assert s2.units == [1] and not a2.valid and a1.valid and s1.valid
    s3 = mem.allocate_composite(3)  # then page 2, its own type's: s1 is evicted
    assert s3.units == [2] and not s1.valid
    a3 = mem.allocate_attention(4)  # page 0 is attention's: a free small page, no eviction
    assert a3.units[0] // 98 == 0 and a1.valid
    check_invariants(mem)


def test_can_allocate_counts_whole_large_pages(falcon):
    mem = _mem(falcon, large=2)
    blocks = [mem.allocate_attention(1) for _ in range(3)]  # page 0: 3 used, 95 free
    assert mem.can_allocate({"attention": 95 + 98, "recurrent": 0})
    assert not mem.can_allocate({"attention": 95 + 98 + 1, "recurrent": 0})
    assert mem.can_allocate({"attention": 95, "recurrent": 1})
    assert not mem.can_allocate({"attention": 96, "recurrent": 1})  # needs a third page
    # a pinned cached page in an unreferenced large page brings that page back whole
    for b in blocks:
        mem.publish(b, b.oid + 100, 16)
        mem.release(b)
    pinned = mem.pinned_by_adoption([blocks[0]])
    assert pinned == {"attention": 1, "recurrent": 0, "attention:pages": 1,
                      "attention:in_pages": 1}
    assert mem.can_allocate({"attention": 97, "recurrent": 1}, pinned)
    assert not mem.can_allocate({"attention": 98, "recurrent": 1}, pinned)
    for obj in (blocks[0],):
        mem.acquire(obj)
    check_invariants(mem)
    took = [mem.allocate_attention(9) for _ in range(97)] + [mem.allocate_composite(9)]
    assert len(took) == 98
    check_invariants(mem)


def test_marconi_is_refused_with_jenga(falcon):
    with pytest.raises(ValueError, match="engine.cache_policy=marconi: org=jenga"):
        build_memory(falcon, "jenga", {"attention": 98, "recurrent": 1}, cache_policy="marconi")
    with pytest.raises(ValueError, match="pool_units attention=97"):
        JengaTwoLevel(org_layout(falcon, "jenga"), {"attention": 97, "recurrent": 1})


NUM_OPS = 100_000


@pytest.mark.slow  # ~25 CPU s each
@pytest.mark.parametrize("name", ["JENGA-falcon-dense", "JENGA-granite"])
def test_invariants_over_100k_random_operations(name):
    """Full check_invariants (with Jenga's own check) after every one of 10^5 operations.
    In the default suite: the same check after every one of 10^4 operations on the same
    configurations and JENGA-falcon, with the same exercised-states floor
    (tests/test_memory_invariants.py::test_random_operations_keep_all_invariants[JENGA-*])."""
    mem, recorder, driver = new_run(CONFIG[name], seed=29)
    run(driver, NUM_OPS, lambda: check_invariants(mem))
    assert_exercised(CONFIG[name], driver, recorder)
    # large pages moved between the types: both carved over the run, reclaimed across types
    assert driver.stats["admitted"] > 1000


def test_a_served_cell_keeps_the_invariants_after_every_step():
    """The Jenga arm in the engine (b63, 40 requests of the default workload): every
    invariant after every step, all requests complete, the record names the organization."""
    from conftest import compose_config

    from experiments.runners.cell import run_cell

    cfg = compose_config("org=jenga", "budget=b63", "workload.num_requests=40",
                         "write_ledgers=false")
    res = run_cell(cfg, on_step=lambda sched, mem: check_invariants(mem))
    assert res.summary["completed"] == 40
    assert res.engine_config["org"] == "JENGA"
    assert res.engine_config["pool_units"] == {"attention": 63 * 98, "recurrent": 63}
