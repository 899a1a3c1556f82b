"""Consistency check of a memory organization against the four invariants.

The invariants: docs/engine_rules.md section 3.3.

`check_invariants(mem)` walks every pool unit, live object, cache entry and (S2) slab
once and raises AssertionError naming the first violated property. It is O(units +
objects + cache entries) and reads only state, so the engine can call it after every
step in debug mode and the property tests after every operation.

What it checks, for S0, S1, S2, D0 and N0 alike:
- pool partition: every unit is exactly one of free / evictable / in use; a free unit
  has no owner; an evictable or used unit is owned by a live valid object (or an S2 slab),
  except, under state_blocks=vllm_align, an evicted composite's other units left queued;
- invariant 1 (complete checkpoint): every cached checkpoint is valid and owns all its
  members (SSM member pages, S1 conv page, S2 conv slot listed by its slab), so a
  lookup can never return a depth whose checkpoint misses a member;
- invariant 2 (protected access): no unit of a referenced object is in the LRU (an S2
  slab page with a referenced slot included); evictable units belong only to cached,
  unreferenced objects;
- invariant 3 (invalidate before reuse): no unit or slot is shared between objects,
  every cached entry is the live owner of its key (or, duplicates cached, a live copy of
  it), slab counters match their slots and an empty slab does not exist;
- invariant 4 (valid location or absence): ids are ints in [0, n), absence is NO_SLOT
  (-1) or an empty unit list, never 0 or None.
"""

from __future__ import annotations

from serving_core.memory.base import MemoryOrganization
from serving_core.memory.objects import NO_SLOT, Kind, StateObject


def _is_id(value: object, bound: int) -> bool:
    """A unit id: a plain int (bool and None excluded) in [0, bound)."""
    return type(value) is int and 0 <= value < bound


def _check_pools(mem: MemoryOrganization) -> None:
    """Pool partition and invariant 2 seen from the units."""
    slabs = getattr(mem, "slabs", {})
    # A two-level allocator (memory/jenga.py) says which units lie in large pages carved
    # for a pool; the others belong to no one and are neither free nor evictable there.
    carved = getattr(mem, "carved", None)
    for name, pool in mem.pools.items():
        n = pool.num_units
        owners = mem._owner[name]
        assert len(owners) == n, f"pool {name}: owner table has {len(owners)} rows for {n} units"
        free = set(pool.free)
        assert len(free) == len(pool.free), f"pool {name}: a unit is queued free twice"
        for unit in pool.free:
            assert _is_id(unit, n), f"pool {name}: free unit {unit!r} is not an id in [0, {n})"
        if pool.single_queue:  # one eviction order: the free queue's stamps never decrease
            stamps = list(pool.free_stamps)
            assert len(stamps) == len(pool.free), f"pool {name}: free stamps out of step"
            assert all(a <= b for a, b in zip(stamps, stamps[1:], strict=False)), (
                f"pool {name}: free queue out of eviction order"
            )
        for unit in pool.evictable:
            assert _is_id(unit, n), f"pool {name}: evictable unit {unit!r} is not an id in [0, {n})"
            assert unit not in free, f"pool {name}: unit {unit} is both free and evictable"
        evictable, live = pool.evictable, mem.live
        for unit in range(n):
            owner = owners[unit]
            if carved is not None and not carved(name, unit):
                assert owner is None and unit not in free and unit not in evictable, (
                    f"pool {name}: uncarved unit {unit} is in use, free or evictable")
                continue
            if unit in free:
                assert owner is None, f"pool {name}: free unit {unit} still owned by {owner!r}"
                continue
            if owner is None and mem.queued_siblings and unit in evictable:
                continue  # an evicted composite's other unit, queued until taken
            # _check_owner's checks of an object's unit as one expression (the hot path);
            # any of them false, _check_owner names the first that fails
            if (type(owner) is StateObject and live.get(owner.oid) is owner and owner.valid
                    and owner.pool == name and unit in owner.units
                    and ((owner.ref_count == 0 and owner.cached) if unit in evictable
                         else owner.ref_count > 0)):
                continue
            _check_owner(mem, name, unit, owner, unit in evictable, slabs)


def _check_owner(mem: MemoryOrganization, name: str, unit: int, owner, evictable: bool,
                 slabs: dict) -> None:
    """Invariant 2 for one unit in use or evictable: a live, valid object of this pool
    listing the unit (or a slab page), referenced exactly when not evictable."""
    state = "evictable" if evictable else "used"
    assert owner is not None, f"pool {name}: {state} unit {unit} has no owner (leaked)"
    if isinstance(owner, StateObject):
        assert mem.live.get(owner.oid) is owner, (
            f"pool {name}: {state} unit {unit} owned by dead {owner}"
        )
        assert owner.valid, f"pool {name}: {state} unit {unit} owned by invalid {owner}"
        assert owner.pool == name, (
            f"pool {name}: unit {unit} owned by {owner} of another pool"
        )
        assert unit in owner.units, (
            f"pool {name}: unit {unit}'s owner {owner} does not list it"
        )
        if evictable:
            assert owner.ref_count == 0, (
                f"invariant 2: unit {unit} of referenced {owner} is in the LRU"
            )
            assert owner.cached, f"pool {name}: evictable unit {unit} of uncached {owner}"
        else:
            assert owner.ref_count > 0, (
                f"pool {name}: unit {unit} of unreferenced {owner} "
                "is neither free nor evictable"
            )
    else:
        assert slabs.get(unit) is owner, (
            f"pool {name}: unit {unit} owned by {owner!r}, not a live object or slab"
        )
        if evictable:
            assert owner.num_referenced == 0, (
                f"invariant 2: slab page {unit} with {owner.num_referenced} "
                "referenced slots is in the LRU"
            )
        else:
            assert owner.num_referenced > 0, (
                f"pool {name}: slab page {unit} has no referenced slot but is not evictable"
            )



def _check_slot(mem: MemoryOrganization, obj: StateObject) -> None:
    """Invariant 4 and slab membership of the conv slot of one object."""
    per = mem.layout.slots_per_slab
    slabs = getattr(mem, "slabs", None)
    holds_slot = slabs is not None and obj.kind == Kind.COMPOSITE
    if not holds_slot:
        assert obj.slab_page == NO_SLOT and obj.slot == NO_SLOT, (
            f"invariant 4: {obj} has a conv slot in an organization without slots"
        )
        return
    assert obj.slab_page != NO_SLOT and obj.slot != NO_SLOT, (
        f"invariant 1: composite {obj} has no conv slot"
    )
    assert _is_id(obj.slab_page, mem.pools["shared"].num_units), (
        f"invariant 4: slab page {obj.slab_page!r} of {obj} is not an id"
    )
    assert _is_id(obj.slot, per), f"invariant 4: slot {obj.slot!r} of {obj} outside [0, {per})"
    slab = slabs.get(obj.slab_page)
    assert slab is not None, f"{obj} points at slab page {obj.slab_page}, which is not a slab"
    assert slab.slots[obj.slot] is obj, (
        f"invariant 3: slab {obj.slab_page} slot {obj.slot} holds "
        f"{slab.slots[obj.slot]!r}, not {obj}"
    )
    line = mem.conv_line(obj)
    assert line == per * obj.slab_page + obj.slot, (
        f"invariant 4: conv line {line} of {obj} is not {per} * page + slot"
    )


def _check_objects(mem: MemoryOrganization) -> int:
    """Every live object owns exactly its units; returns the number of cached objects."""
    num_cached = 0
    # (units, owner table) per pool, looked up once: this loop runs over every live object
    tables = {name: (pool.num_units, mem._owner[name]) for name, pool in mem.pools.items()}
    composite_units = mem.units_per_composite()
    no_slots = getattr(mem, "slabs", None) is None  # _check_slot of every object: no slot
    attention, pool, entries = Kind.ATTENTION, mem.attention_pool, mem.cache.attention
    n, owners = tables[pool]
    for oid, obj in mem.live.items():
        # _check_object's checks of an attention block that is the entry of its key (if
        # cached) as one expression, the hot path; else the object's checks one by one
        units = obj.units
        if (obj.kind == attention and obj.oid == oid and obj.valid and obj.pool == pool
                and len(units) == 1 and type(units[0]) is int and 0 <= units[0] < n
                and owners[units[0]] is obj and obj.slab_page == NO_SLOT
                and obj.slot == NO_SLOT and (obj.ref_count > 0 or (obj.ref_count == 0
                                                                  and obj.cached))
                and (not obj.cached or entries.get(obj.key) is obj)):
            num_cached += obj.cached
            continue
        num_cached += _check_object(mem, oid, obj, tables, composite_units, no_slots)
    return num_cached


def _check_object(mem: MemoryOrganization, oid: int, obj: StateObject, tables: dict,
                  composite_units: int, no_slots: bool) -> bool:
    """One live object owns exactly its units; whether it is cached."""
    assert obj.oid == oid, f"live table maps {oid} to {obj}"
    assert obj.valid, f"invalid {obj} still live"
    attention = obj.kind == Kind.ATTENTION
    expected_pool = mem.attention_pool if attention else mem.composite_pool
    assert obj.pool == expected_pool, (
        f"{obj} lives in pool {obj.pool}, expected {expected_pool}"
    )
    want = 1 if attention else composite_units
    assert len(obj.units) == want, (
        f"invariant 1: {obj} holds {len(obj.units)} units, needs {want}"
    )
    n, owners = tables[obj.pool]
    for unit in obj.units:  # _is_id inlined
        assert type(unit) is int and 0 <= unit < n, (
            f"invariant 4: unit {unit!r} of {obj} is not an id in [0, {n})")
        assert owners[unit] is obj, (
            f"invariant 3: unit {unit} of {obj} is owned by {owners[unit]!r}"
        )
    assert want == 1 or len(set(obj.units)) == want, f"{obj} lists a unit twice"
    assert obj.ref_count >= 0, f"{obj} has a negative reference count"
    if obj.ref_count == 0:
        assert obj.cached, f"unreferenced unpublished {obj} still holds storage"
    if obj.cached:
        checkpoint = obj.kind == Kind.COMPOSITE
        table = mem.cache.checkpoints if checkpoint else mem.cache.attention
        assert table.get(obj.key) is obj or any(
            c is obj for c in mem.cache.copies.get((checkpoint, obj.key), ())), (
            f"cached {obj} is not the entry of its key {obj.key} (nor a copy of it)")
    if no_slots or attention:  # _check_slot's first case, inlined
        assert obj.slab_page == NO_SLOT and obj.slot == NO_SLOT, (
            f"invariant 4: {obj} has a conv slot in an organization without slots"
        )
    else:
        _check_slot(mem, obj)
    if not attention:
        line = mem.conv_line(obj)
        assert line >= 0, f"invariant 4: live composite {obj} reports no conv state"
        for page in mem.ssm_member_pages(obj):
            assert _is_id(page, n), f"invariant 4: SSM member page {page!r} of {obj}"
    return obj.cached


def _check_cache(mem: MemoryOrganization, num_cached: int) -> None:
    """Invariant 1 and 3 seen from the prefix cache."""
    for checkpoint, table in ((False, mem.cache.attention), (True, mem.cache.checkpoints)):
        kind = Kind.COMPOSITE if checkpoint else Kind.ATTENTION
        for key, obj in table.items():
            what = "checkpoint" if checkpoint else "attention block"
            assert obj.kind == kind, f"{what} table holds {obj}"
            assert obj.key == key, f"{what} {key} maps to {obj} published as {obj.key}"
            assert obj.cached and obj.valid, f"invariant 1: cached {what} {key} is invalid: {obj}"
            assert mem.live.get(obj.oid) is obj, (
                f"invariant 3: cached {what} {key} lost its storage: {obj}"
            )
    num_copies = 0
    for (checkpoint, key), copies in mem.cache.copies.items():
        table = mem.cache.checkpoints if checkpoint else mem.cache.attention
        assert copies, f"key {key} has an empty list of further copies"
        assert key in table, f"key {key} has further copies but no entry"
        assert mem.cache_duplicates, f"key {key} has copies, but duplicates are {mem.duplicates}"
        for obj in copies:
            assert obj is not table[key], f"the entry of key {key} is listed as its copy too"
            assert obj.key == key and obj.cached and obj.valid, f"copy of {key} is {obj}"
            assert mem.live.get(obj.oid) is obj, f"invariant 3: copy of {key} lost its storage"
        num_copies += len(copies)
    num_entries = len(mem.cache.attention) + len(mem.cache.checkpoints) + num_copies
    assert num_entries == num_cached, (
        f"prefix cache holds {num_entries} entries and copies but {num_cached} live objects "
        "are cached"
    )


def _check_slabs(mem: MemoryOrganization) -> None:
    """S2 slab bookkeeping: counters equal what the slots say; no empty slab."""
    slabs = getattr(mem, "slabs", None)
    if slabs is None:
        return
    pool = mem.pools["shared"]
    per = mem.layout.slots_per_slab
    with_free = set()
    for page, slab in slabs.items():
        assert _is_id(page, pool.num_units), f"invariant 4: slab page {page!r} is not an id"
        assert slab.page == page, f"slab table maps page {page} to slab of page {slab.page}"
        assert mem._owner["shared"][page] is slab, f"slab page {page} is not owned by its slab"
        assert len(slab.slots) == per, f"slab {page} has {len(slab.slots)} slots, expected {per}"
        used = [obj for obj in slab.slots if obj is not None]
        assert used, f"invariant 3: slab page {page} has no used slot but was not freed"
        assert slab.num_used == len(used), (
            f"slab {page}: num_used={slab.num_used}, slots say {len(used)}"
        )
        referenced = sum(1 for obj in used if obj.ref_count > 0)
        assert slab.num_referenced == referenced, (
            f"slab {page}: num_referenced={slab.num_referenced}, slots say {referenced}"
        )
        for slot, obj in enumerate(slab.slots):
            if obj is not None:
                assert mem.live.get(obj.oid) is obj and obj.valid, (
                    f"invariant 3: slab {page} slot {slot} holds dead {obj}"
                )
                assert (obj.slab_page, obj.slot) == (page, slot), (
                    f"invariant 3: slab {page} slot {slot} holds {obj} located elsewhere"
                )
        if mem.write_once:
            assert all(obj is None for obj in slab.slots[slab.next_slot :]), (
                f"write-once slab {page} has a used slot beyond its cursor {slab.next_slot}"
            )
            assert slab is mem._newest or slab.next_slot == per, (
                f"write-once slab {page} is not the newest but has unwritten slots"
            )
        elif len(used) < per:
            with_free.add(page)
    assert mem._slabs_with_free == with_free, (
        f"slabs with a free slot {sorted(mem._slabs_with_free)} != {sorted(with_free)}"
    )
    newest = getattr(mem, "_newest", None)
    assert newest is None or slabs.get(newest.page) is newest, "the newest slab was freed"


def check_invariants(mem: MemoryOrganization) -> None:
    """Raise AssertionError naming the first violated property of `mem`; O(units)."""
    assert NO_SLOT == -1, "the absence sentinel must be -1"
    _check_pools(mem)
    num_cached = _check_objects(mem)
    _check_cache(mem, num_cached)
    _check_slabs(mem)
    check_own = getattr(mem, "check_own", None)  # an organization's own bookkeeping
    if check_own is not None:
        check_own()
