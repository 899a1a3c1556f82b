"""Hand-worked allocator scenarios: units per object, demand, availability, pinning, LRU order.

Expected numbers come from docs/engine_rules.md section 3, worked by hand (Falcon-H1-7B
unless said otherwise): S0 pages of 1,594,368 B; S1/S2 pages of 512 KiB with ceil(1,536 KiB /
512 KiB) = 3 SSM member pages; S1 adds one conv page; S2 puts the 21-KiB conv state in
a 32-KiB slot, 512 / 32 = 16 slots per slab page; D0 has a 16,384-B attention pool and
a 1,594,368-B recurrent pool. Granite: 1 MiB pages, one member page, 32 slots per slab.
"""

from __future__ import annotations

import pytest

from serving_core.memory import NO_SLOT, MemoryEvents, build_memory
from serving_core.memory.invariants import check_invariants

KIB = 1024


class Losses(MemoryEvents):
    def __init__(self) -> None:
        self.lost: list[tuple[int, int]] = []  # (key, cause)

    def on_loss(self, obj, cause_request):
        self.lost.append((obj.key, cause_request))


def cached_block(mem, key, request_id=1):
    obj = mem.allocate_attention(request_id)
    assert mem.publish(obj, key, 512)
    mem.release(obj)
    return obj


def cached_checkpoint(mem, key, request_id=1):
    obj = mem.allocate_composite(request_id)
    assert mem.publish(obj, key, 512)
    mem.release(obj)
    return obj


# ----- units per object -------------------------------------------------------------------
def test_s0_everything_takes_one_coarse_page(falcon):
    mem = build_memory(falcon, "S0", {"shared": 4})
    assert mem.pools["shared"].unit_bytes == 1_594_368
    block, comp = mem.allocate_attention(1), mem.allocate_composite(1)
    assert block.units == [0] and comp.units == [1]
    assert mem.usage() == {"shared": (2, 0, 2, 4)}
    check_invariants(mem)


def test_s1_composite_is_three_member_pages_and_one_conv_page(falcon):
    mem = build_memory(falcon, "S1", {"shared": 6})
    assert mem.pools["shared"].unit_bytes == 512 * KIB
    comp = mem.allocate_composite(1)
    assert comp.units == [0, 1, 2, 3]
    assert mem.ssm_member_pages(comp) == [0, 1, 2] and mem.conv_line(comp) == 3
    assert (comp.slab_page, comp.slot) == (NO_SLOT, NO_SLOT)
    assert mem.allocate_attention(1).units == [4]
    assert mem.usage() == {"shared": (5, 0, 1, 6)}


def test_s2_composite_is_three_pages_and_one_slot(falcon):
    mem = build_memory(falcon, "S2", {"shared": 8})
    comp = mem.allocate_composite(1)
    # the slab page is taken first (page 0), then the three member pages
    assert (comp.slab_page, comp.slot) == (0, 0) and comp.units == [1, 2, 3]
    assert mem.usage() == {"shared": (4, 0, 4, 8)}
    second = mem.allocate_composite(1)
    assert (second.slab_page, second.slot) == (0, 1) and second.units == [4, 5, 6]
    assert mem.usage() == {"shared": (7, 0, 1, 8)}  # 2 x 3 members + 1 shared slab page


def test_s2_sixteen_composites_share_one_slab_the_seventeenth_opens_another(falcon):
    mem = build_memory(falcon, "S2", {"shared": 1 + 16 * 3 + 1 + 3})
    comps = [mem.allocate_composite(1) for _ in range(16)]
    assert {c.slab_page for c in comps} == {0} and [c.slot for c in comps] == list(range(16))
    assert mem.usage()["shared"][0] == 1 + 48
    extra = mem.allocate_composite(1)
    assert extra.slab_page == 49 and extra.slot == 0
    assert mem.usage()["shared"] == (53, 0, 0, 53)
    check_invariants(mem)


def test_s2_granite_slab_holds_32_slots_of_one_page_composites(granite):
    mem = build_memory(granite, "S2", {"shared": 1 + 32 + 2})
    comps = [mem.allocate_composite(1) for _ in range(32)]
    assert all(len(c.units) == 1 for c in comps)
    assert {c.slab_page for c in comps} == {0} and comps[-1].slot == 31
    assert mem.allocate_composite(1).slab_page == 33
    check_invariants(mem)


def test_d0_composite_is_one_recurrent_unit(falcon):
    mem = build_memory(falcon, "D0", {"attention": 3, "recurrent": 2})
    assert mem.pools["attention"].unit_bytes == 16 * 1024
    assert mem.pools["recurrent"].unit_bytes == 1_594_368
    comp, block = mem.allocate_composite(1), mem.allocate_attention(1)
    assert comp.units == [0] and comp.pool == "recurrent"
    assert block.units == [0] and block.pool == "attention"  # id 0 in each pool
    assert mem.usage() == {"attention": (1, 0, 2, 3), "recurrent": (1, 0, 1, 2)}
    check_invariants(mem)


def test_attention_only_geometry_allocates_no_composite(attention_only):
    mem = build_memory(attention_only, "D0", {"attention": 4, "recurrent": 0})
    assert list(mem.pools) == ["attention"]  # no recurrent state: a single attention pool
    assert mem.demand(2, 0) == {"attention": 2}
    assert mem.lookup([1, 2]).jadopt == 0
    with pytest.raises(AssertionError):
        mem.allocate_composite(1)
    s2 = build_memory(attention_only, "S2", {"shared": 4})
    assert s2.demand(3, 0) == {"shared": 3}
    with pytest.raises(AssertionError):
        s2.allocate_composite(1)


# ----- demand ----------------------------------------------------------------------------
def test_demand_by_organization(falcon):
    assert build_memory(falcon, "S0", {"shared": 8}).demand(2, 1) == {"shared": 3}
    assert build_memory(falcon, "S1", {"shared": 8}).demand(2, 1) == {"shared": 2 + 4}
    # S2 on an empty pool: members plus one new slab page per 16 composites
    s2 = build_memory(falcon, "S2", {"shared": 64})
    assert s2.demand(2, 1) == {"shared": 2 + 3 + 1}
    assert s2.demand(0, 16) == {"shared": 48 + 1}
    assert s2.demand(0, 17) == {"shared": 51 + 2}
    d0 = build_memory(falcon, "D0", {"attention": 8, "recurrent": 4})
    assert d0.demand(3, 2) == {"attention": 3, "recurrent": 2}


def test_s2_demand_counts_free_slots_by_what_they_cost(falcon):
    mem = build_memory(falcon, "S2", {"shared": 64}, slab_policy="refill")
    held = mem.allocate_composite(1)  # slab 0 referenced, 15 free slots
    assert mem.demand(0, 15) == {"shared": 45}  # free slots of a referenced slab cost nothing
    assert mem.demand(0, 16) == {"shared": 48 + 1}
    cached = mem.allocate_composite(1)
    mem.publish(cached, 7, 512)
    mem.release(cached)
    mem.release(held)  # slab 0 now holds only a cached checkpoint: it is evictable
    assert 0 in mem.pools["shared"].evictable
    # using one of its 15 free slots pulls the slab page out of the LRU: one available unit
    assert mem.demand(0, 1) == {"shared": 3 + 1}
    assert mem.demand(0, 15) == {"shared": 45 + 1}
    assert mem.demand(0, 16) == {"shared": 48 + 1 + 1}


def test_s2_demand_is_enough_when_the_only_free_slots_are_on_an_evictable_slab(falcon):
    # 7 pages: a cached checkpoint (slab 0 + members 1-3), a held block on 4, pages 5-6 free.
    mem = build_memory(falcon, "S2", {"shared": 7})
    cached_checkpoint(mem, key=11)
    mem.allocate_attention(2)
    assert mem.usage()["shared"] == (1, 4, 2, 7)
    # two composites need 6 member pages and the slab page: 7 > 6 available units
    assert mem.demand(0, 2) == {"shared": 7}
    assert not mem.can_allocate(mem.demand(0, 2))
    assert mem.can_allocate(mem.demand(0, 1))
    mem.allocate_composite(3)  # fits: slab 0 pulled, members from 5, 6 and the LRU
    check_invariants(mem)


def test_s2_slot_goes_to_a_referenced_slab_before_an_evictable_one(falcon):
    mem = build_memory(falcon, "S2", {"shared": 1 + 16 * 3 + 1 + 3 + 3})
    first = [mem.allocate_composite(1) for _ in range(16)]  # fills slab 0
    other = mem.allocate_composite(1)  # slab 49
    assert other.slab_page == 49
    mem.publish(first[0], 5, 512)
    for comp in first[1:]:
        mem.release(comp)  # freed: slab 0 keeps only the cached checkpoint
    mem.release(first[0])  # slab 0 is evictable with 15 free slots
    assert 0 in mem.pools["shared"].evictable
    assert mem.allocate_composite(1).slab_page == 49  # referenced slab: no unit pulled
    check_invariants(mem)


# ----- availability ----------------------------------------------------------------------
def test_can_allocate_with_extra_headroom(falcon):
    mem = build_memory(falcon, "S1", {"shared": 10})
    cached_block(mem, key=3)  # 1 evictable + 9 free = 10 available
    assert mem.can_allocate({"shared": 8}, {"shared": 2})
    assert not mem.can_allocate({"shared": 8}, {"shared": 3})
    assert mem.can_allocate({"shared": 10}) and not mem.can_allocate({"shared": 11})


def test_d0_availability_is_checked_per_pool(falcon):
    mem = build_memory(falcon, "D0", {"attention": 4, "recurrent": 2})
    assert mem.can_allocate(mem.demand(4, 2))
    assert not mem.can_allocate(mem.demand(5, 0))  # the recurrent pool lends nothing
    assert not mem.can_allocate(mem.demand(0, 3))
    assert not mem.can_allocate(mem.demand(1, 1), {"attention": 0, "recurrent": 2})


# ----- pinning -----------------------------------------------------------------------------
def test_pinned_by_adoption_counts_units_leaving_the_lru(falcon):
    mem = build_memory(falcon, "S1", {"shared": 12})
    block, ckpt = cached_block(mem, 1), cached_checkpoint(mem, 1)
    assert mem.pinned_by_adoption([block, ckpt]) == {"shared": 1 + 4}
    mem.acquire(ckpt)
    assert mem.pinned_by_adoption([block, ckpt]) == {"shared": 1}  # already referenced
    assert mem.usage()["shared"] == (4, 1, 7, 12)


def test_s2_pinned_by_adoption_counts_the_slab_page_once(falcon):
    mem = build_memory(falcon, "S2", {"shared": 12})
    a, b = cached_checkpoint(mem, 1), cached_checkpoint(mem, 2)
    assert a.slab_page == b.slab_page == 0
    assert mem.pinned_by_adoption([a]) == {"shared": 3 + 1}
    assert mem.pinned_by_adoption([a, b]) == {"shared": 3 + 3 + 1}
    mem.acquire(b)  # slab 0 is referenced now: adopting a pulls only its members
    assert mem.pinned_by_adoption([a]) == {"shared": 3}
    mem.acquire(a)
    assert mem.usage()["shared"] == (7, 0, 5, 12)
    check_invariants(mem)


def test_d0_pinned_by_adoption(falcon):
    mem = build_memory(falcon, "D0", {"attention": 4, "recurrent": 2})
    block, ckpt = cached_block(mem, 1), cached_checkpoint(mem, 1)
    assert mem.pinned_by_adoption([block, ckpt]) == {"attention": 1, "recurrent": 1}


# ----- LRU order ---------------------------------------------------------------------------
def test_least_recently_released_is_evicted_first(falcon):
    events = Losses()
    mem = build_memory(falcon, "S1", {"shared": 3}, events)
    a, b, c = (mem.allocate_attention(1) for _ in range(3))
    for key, obj in enumerate((a, b, c)):
        mem.publish(obj, key, 512 * (key + 1))
    mem.release(a)
    mem.release(b)
    mem.release(c)
    mem.acquire(a)  # a is used again and released last
    mem.release(a)
    mem.allocate_attention(2)
    mem.allocate_attention(3)
    assert events.lost == [(1, 2), (2, 3)]  # b, then c; a survives
    assert mem.cached_attention(0) is a


def test_blocks_released_in_reverse_order_lose_the_tail_first(falcon):
    events = Losses()
    mem = build_memory(falcon, "S2", {"shared": 4}, events)
    blocks = [mem.allocate_attention(1) for _ in range(4)]
    keys = [10, 11, 12, 13]  # chain of one prompt
    for i, (obj, key) in enumerate(zip(blocks, keys, strict=True)):
        mem.publish(obj, key, 512 * (i + 1))
    for obj in reversed(blocks):
        mem.release(obj)
    assert mem.lookup(keys).attention == 4 * 512
    mem.allocate_attention(2)
    assert events.lost == [(13, 2)]
    assert mem.lookup(keys).attention == 3 * 512  # the prefix survives, only the tail is gone
    mem.allocate_attention(2)
    assert mem.lookup(keys).attention == 2 * 512


def test_free_units_are_used_before_any_cached_unit(falcon):
    events = Losses()
    mem = build_memory(falcon, "S0", {"shared": 3}, events)
    cached_block(mem, 1)
    mem.allocate_attention(2)
    mem.allocate_attention(2)
    assert events.lost == []
    mem.allocate_attention(2)
    assert events.lost == [(1, 2)]


def test_d0_pools_evict_independently(falcon):
    events = Losses()
    mem = build_memory(falcon, "D0", {"attention": 2, "recurrent": 2}, events)
    ckpt = cached_checkpoint(mem, key=100)
    for key in range(6):  # attention churn far beyond the attention pool
        cached_block(mem, key, request_id=5)
    assert [c for _, c in events.lost] == [5] * 4
    assert mem.cached_checkpoint(100) is ckpt and ckpt.valid
    assert mem.usage()["recurrent"] == (0, 1, 1, 2)
    kept = mem.cached_attention(5)
    mem.allocate_composite(6)
    mem.allocate_composite(7)  # recurrent pressure evicts the checkpoint, never attention
    assert events.lost[-1] == (100, 7) and mem.cached_attention(5) is kept
    check_invariants(mem)


# ----- publication and release -------------------------------------------------------------
def test_duplicate_publish_is_a_no_op_and_the_destination_is_freed(falcon):
    mem = build_memory(falcon, "S1", {"shared": 8})
    first = cached_checkpoint(mem, 9)
    dup = mem.allocate_composite(2)
    assert not mem.publish(dup, 9, 512)
    assert mem.cached_checkpoint(9) is first
    mem.release(dup)
    assert not dup.valid and mem.usage()["shared"] == (0, 4, 4, 8)
    check_invariants(mem)


def test_s2_last_referenced_slot_freed_next_to_a_cached_one_makes_the_slab_evictable(falcon):
    mem = build_memory(falcon, "S2", {"shared": 8})
    cached = mem.allocate_composite(1)
    working = mem.allocate_composite(1)
    mem.publish(cached, 5, 512)
    mem.release(cached)
    assert 0 not in mem.pools["shared"].evictable  # working still references slab 0
    mem.release(working)  # unpublished: freed; slab 0 keeps only the cached checkpoint
    assert 0 in mem.pools["shared"].evictable
    assert mem.usage()["shared"] == (0, 4, 4, 8)
    check_invariants(mem)


def test_allocation_beyond_availability_is_refused(falcon):
    mem = build_memory(falcon, "S1", {"shared": 4})
    mem.allocate_composite(1)
    with pytest.raises(MemoryError, match="can_allocate"):
        mem.allocate_attention(1)


@pytest.mark.parametrize(
    "org, pools",
    [("S1", {"attention": 4, "recurrent": 4}), ("D0", {"shared": 8}), ("S2", {})],
)
def test_build_memory_names_the_expected_pools(falcon, org, pools):
    with pytest.raises(ValueError, match="pool_units"):
        build_memory(falcon, org, pools)


def test_build_memory_refuses_unknown_organization_and_empty_pool(falcon):
    with pytest.raises(ValueError, match="org="):
        build_memory(falcon, "S9", {"shared": 4})
    with pytest.raises(ValueError, match="num_units"):
        build_memory(falcon, "S1", {"shared": 0})


def test_prefix_lookup_reads_entries_lost_this_step_only_under_m1():
    """M0 sees the valid entries; M1 also those lost during this step (PrefixCache.lost).
    Chain of 12 blocks of 16 tokens, checkpoint every 64 tokens (every 4th key)."""
    from serving_core.memory.objects import Kind, StateObject
    from serving_core.memory.prefix_cache import PrefixCache, PrefixHit

    cache = PrefixCache()
    cache.begin_step(1)
    keys = list(range(100, 112))
    objs = {}
    for i, key in enumerate(keys):
        if i == 9:
            continue  # attention chain breaks at block 9 (144 tokens)
        objs[(False, key)] = StateObject(i, Kind.ATTENTION, "shared", [i], 0)
        cache.insert(objs[(False, key)], key, checkpoint=False)
    for i in (3, 7, 11):  # checkpoints at 64, 128, 192 tokens
        objs[(True, keys[i])] = StateObject(50 + i, Kind.COMPOSITE, "shared", [50 + i], 0)
        cache.insert(objs[(True, keys[i])], keys[i], checkpoint=True)
    assert cache.lookup(keys, 16, 64) == PrefixHit(144, 128, 192, 128)
    cache.remove(objs[(False, keys[2])])  # lost this step: attention now 2 blocks under M0
    cache.remove(objs[(True, keys[7])])  # and the 128-token checkpoint
    assert cache.lookup(keys, 16, 64) == PrefixHit(32, 0, 192, 0)
    assert cache.lookup(keys, 16, 64, m1=True) == PrefixHit(144, 128, 192, 128)
    cache.begin_step(2)  # a new step forgets what was lost in the last one
    assert cache.lookup(keys, 16, 64, m1=True) == PrefixHit(32, 0, 192, 0)
    assert cache.lookup(keys, 16, 0) == PrefixHit(32, 32, 0, 32)
