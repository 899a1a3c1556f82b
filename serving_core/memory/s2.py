"""S2 paging + conv slots: SSM member pages plus a 32-KiB conv slot packed in a slab page.

A slab page holds `slots_per_slab` conv slots (16 for Falcon-H1). Conv line ids are
16 p + s for real page p and slot s, so page 0 slot 0 is line 0 and a negative
line is the "no conv state" sentinel. A slab page joins the LRU when none of its
slots is referenced; reclaiming it invalidates every cached checkpoint with a
slot in it (cross-invalidation). An empty slab page returns to the free queue.

Slab policy (SLAB_POLICIES):
- `write_once` (default, as measured): conv slots are taken only from the newest
  slab page, a freed slot is never refilled, and a slab page's LRU recency is its
  last write (a slot allocated, or its producer releasing it); adoption references
  protect a slab but do not refresh it. Hot shared checkpoints end up alone on old
  slabs that age out and are reclaimed together.
- `refill`: the first free slot of any slab (referenced slabs first) is reused and
  every last release refreshes the slab's recency.
- `dense`: `refill`'s placement (freed slots are refilled, referenced slabs first, so
  slabs stay packed) with `write_once`'s recency (last write; adoption protects a slab
  without refreshing it). Anchor F (docs/calibration.md section F): the measured slabs
  were densely packed (14.3 and 13.8 of 16 slots live in two state dumps) and still
  reclaimed slabs holding
  cached checkpoints in 35 of 63 runs; `write_once` gives the second, `refill` the first.
"""

from __future__ import annotations

import math

from serving_core.geometry import Geometry
from serving_core.layout import (
    PAGED_BLOCK_TOKENS,
    AllocationCost,
    OrgLayout,
    next_pow2,
    paged_page_bytes,
)
from serving_core.memory.base import MemoryOrganization
from serving_core.memory.objects import NO_SLOT, Kind, StateObject

SLAB_POLICIES = ("write_once", "refill", "dense")


class Slab:
    """One shared page carved into conv slots."""

    __slots__ = ("page", "slots", "num_used", "num_referenced", "next_slot", "last_write")

    def __init__(self, page: int, num_slots: int) -> None:
        self.page = page
        self.slots: list[StateObject | None] = [None] * num_slots
        self.num_used = 0
        self.num_referenced = 0
        self.next_slot = 0  # write-once cursor: slots below it have been written
        self.last_write = 0  # recency stamp of the last write (write_once, dense)

    def first_free(self) -> int:
        return self.slots.index(None)


def encode_conv_line(page: int, slot: int, slots_per_slab: int) -> int:
    if page < 0 or not 0 <= slot < slots_per_slab:
        raise ValueError(f"conv slot (page={page}, slot={slot}) outside [0, {slots_per_slab})")
    return slots_per_slab * page + slot


def decode_conv_line(line: int, slots_per_slab: int) -> tuple[int, int]:
    """(page, slot) of a conv line; the negative sentinel is never decoded."""
    if line < 0:
        raise ValueError(f"conv line {line} is the no-conv-state sentinel, not a slot")
    return divmod(line, slots_per_slab)


def min_slabs(layout: OrgLayout, checkpoints: int) -> int:
    """Fewest slab pages holding `checkpoints` conv slots (ideal packing)."""
    return math.ceil(checkpoints / layout.slots_per_slab) if checkpoints else 0


def slab_occupancy(slab: dict, slots_per_slab: int) -> dict[str, float]:
    """Slab occupancy of one run from its slab ledger, comparable with anchor F's dumps
    (docs/calibration.md section F).

    Occupancy = live conv slots / (slots_per_slab x slab pages). The state after the last
    event at each instant is held until the next instant; `mean` weights it by that time
    (instants with no slab page excluded) as time-averaged live slots over time-averaged
    slot capacity; `at_peak_pages` is the state when the slab page
    count first reaches its maximum, `at_peak_live` when the live slot count does (the two
    need not coincide). Events: SLAB_ALLOC / SLAB_FREE / SLAB_RECLAIM move the page count,
    SLOT_ALLOC / SLOT_FREE one live slot, CROSS_INVALIDATE `invalidated` live slots."""
    nan = float("nan")
    out = {"occupancy_mean": nan, "pages_mean": nan, "live_mean": nan, "pages_peak": 0,
           "live_at_peak_pages": 0, "occupancy_at_peak_pages": nan, "live_peak": 0,
           "pages_at_peak_live": 0, "occupancy_at_peak_live": nan}
    pages = live = 0
    states: list[tuple[float, int, int]] = []  # (t, pages, live) after each instant
    for t, event, lost in zip(slab["t_s"], slab["event"], slab["invalidated"], strict=True):
        if event == "SLAB_ALLOC":
            pages += 1
        elif event in ("SLAB_FREE", "SLAB_RECLAIM"):
            pages -= 1
        elif event == "SLOT_ALLOC":
            live += 1
        elif event == "SLOT_FREE":
            live -= 1
        elif event == "CROSS_INVALIDATE":
            live -= lost
        if states and states[-1][0] == t:
            states[-1] = (t, pages, live)
        else:
            states.append((t, pages, live))
    if not states:
        return out
    dur = pages_time = live_time = 0.0
    for (t, p, n), (t_next, _, _) in zip(states, states[1:], strict=False):
        if p > 0:
            dur += t_next - t
            pages_time += p * (t_next - t)
            live_time += n * (t_next - t)
    if dur > 0:
        out.update(occupancy_mean=live_time / (slots_per_slab * pages_time),
                   pages_mean=pages_time / dur, live_mean=live_time / dur)
    _, p, n = max(states, key=lambda s: (s[1], -s[0]))
    out.update(pages_peak=p, live_at_peak_pages=n,
               occupancy_at_peak_pages=n / (slots_per_slab * p) if p else nan)
    _, p, n = max(states, key=lambda s: (s[2], -s[0]))
    out.update(live_peak=n, pages_at_peak_live=p,
               occupancy_at_peak_live=n / (slots_per_slab * p) if p else nan)
    return out


class S2PagingConvSlots(MemoryOrganization):
    stable_demand = False  # demand depends on the open slabs' free slots
    org = "S2"
    indirect = True
    has_slabs = True
    conv_addressing = "slot"
    supports_retention = True

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """Paged-attention-block pages; ceil(SSM / page) member pages per composite and a
        conv slot of the smallest power of two >= the conv state, page / slot per slab.

        Over a layer pattern: pages and members as S1 (the storage group's attention
        layers per page, its whole SSM state over the members); one slot holds every
        recurrent layer's conv window of the group, so a group of several recurrent layers
        has larger slots and fewer per slab; a slot larger than a page is refused.
        """
        rec = geometry.has_recurrent
        page = paged_page_bytes(geometry)
        members = math.ceil(geometry.ssm_bytes / page) if rec else 0
        slot = next_pow2(geometry.conv_bytes) if rec else 0
        if rec and slot > page:
            raise ValueError(f"org=s2 cannot hold model {geometry.name!r}: its conv state of "
                             f"{geometry.conv_bytes} B does not fit one {page}-B page")
        return OrgLayout(org=cls.org, block_tokens=PAGED_BLOCK_TOKENS,
                         checkpoint_interval=PAGED_BLOCK_TOKENS if rec else 0, page_bytes=page,
                         units_per_composite=members, ssm_members=members,
                         conv_slot_bytes=slot, slots_per_slab=page // slot if rec else 0)

    @classmethod
    def units_per_checkpoint(cls, layout: OrgLayout) -> int:
        """The member pages plus one slab page for the conv slot."""
        return layout.units_per_composite + 1

    @classmethod
    def allocation_cost(cls, geometry: Geometry, layout: OrgLayout, attention_blocks: int,
                        checkpoints: int, slabs: int | None = None) -> AllocationCost:
        """Member pages as every paged organization, plus `slabs` slab pages (None: the
        fewest that hold the conv slots); fewer than that is refused."""
        base = super().allocation_cost(geometry, layout, attention_blocks, checkpoints)
        needed = min_slabs(layout, checkpoints)
        if slabs is None:
            slabs = needed
        if slabs < needed:
            raise ValueError(
                f"slabs={slabs}: {checkpoints} checkpoints need at least {needed} slab pages "
                f"({layout.slots_per_slab} slots each)"
            )
        return AllocationCost(cls.org, base.attention_bytes,
                              base.recurrent_bytes + layout.page_bytes * slabs, slabs)

    def __init__(self, layout, pool_units, events=None, **rules):
        super().__init__(layout, pool_units, events, **rules)
        slab_policy = self.rules.slab_policy  # checked by memory.rules.AllocatorRules
        self.slab_policy = slab_policy
        self.write_once = slab_policy == "write_once"  # placement: newest slab, no refill
        self._write_recency = slab_policy in ("write_once", "dense")  # recency: last write
        self.slabs: dict[int, Slab] = {}
        self._slabs_with_free: set[int] = set()  # refill: slabs with a free slot
        self._newest: Slab | None = None  # write_once: the slab slots are taken from

    # ----- demand -------------------------------------------------------------------------
    def _slab_preference(self, page: int) -> tuple[bool, int]:
        """Slot placement order: referenced slabs (already out of the LRU) before evictable
        ones, lowest page first within each group, so packing stays deterministic."""
        return (self.slabs[page].num_referenced == 0, page)

    def num_slab_pages_needed(self, num_composites: int) -> int:
        """Available units that placing `num_composites` conv slots consumes.

        Follows the order _alloc_slot uses: a free slot in a referenced slab costs
        nothing; the first slot taken in an evictable slab pulls that page out of the
        LRU (one available unit, like a new slab); the rest need new slab pages.
        Evictions during the allocation only move units between evictable and free,
        so the count is an upper bound on what the allocation really takes.
        """
        per = self.layout.slots_per_slab
        missing = num_composites
        pages = 0
        if self.write_once:
            newest = self._newest
            if newest is not None and newest.next_slot < per:
                pages += newest.num_referenced == 0
                missing -= per - newest.next_slot
            return pages + (math.ceil(missing / per) if missing > 0 else 0)
        for page in sorted(self._slabs_with_free, key=self._slab_preference):
            if missing <= 0:
                break
            slab = self.slabs[page]
            if slab.num_referenced == 0:
                pages += 1
            missing -= per - slab.num_used
        if missing > 0:
            pages += math.ceil(missing / per)
        return pages

    def demand(self, num_attention: int, num_composites: int) -> dict[str, int]:
        need = super().demand(num_attention, num_composites)
        if num_composites:
            need["shared"] += self.num_slab_pages_needed(num_composites)
        return need

    def pinned_by_adoption(self, objs: list[StateObject]) -> dict[str, int]:
        pulled = super().pinned_by_adoption(objs)
        slab_pages = {
            obj.slab_page for obj in objs
            if obj.ref_count == 0 and obj.slab_page != NO_SLOT
            and self.slabs[obj.slab_page].num_referenced == 0
        }
        pulled["shared"] += len(slab_pages)
        return pulled

    # ----- allocation: slot first, so needed free slots cannot be reclaimed under us ------
    def allocate_composite(self, request_id: int) -> StateObject:
        assert self.has_recurrent, "geometry has no recurrent state"
        obj = self._new_object(Kind.COMPOSITE, self.composite_pool, request_id)
        self._alloc_slot(obj, request_id)
        self._assign(obj, self.units_per_composite())
        return obj

    def _new_slab(self, request_id: int) -> Slab:
        page = self._take_unit("shared", request_id)
        slab = Slab(page, self.layout.slots_per_slab)
        self.slabs[page] = slab
        self._owner["shared"][page] = slab
        self.events.on_slab("SLAB_ALLOC", page, NO_SLOT, request_id, 0, 0)
        return slab

    def _alloc_slot(self, obj: StateObject, request_id: int) -> None:
        if self.write_once:
            slab = self._newest
            if slab is None or slab.next_slot == len(slab.slots):
                slab = self._newest = self._new_slab(request_id)
            slot = slab.next_slot
            slab.next_slot += 1
        else:
            if self._slabs_with_free:
                slab = self.slabs[min(self._slabs_with_free, key=self._slab_preference)]
            else:
                slab = self._new_slab(request_id)
                self._slabs_with_free.add(slab.page)
            slot = slab.first_free()
        if self._write_recency:
            slab.last_write = self.pools["shared"].tick()
        page = slab.page
        slab.slots[slot] = obj
        slab.num_used += 1
        if slab.num_referenced == 0:
            self.pools["shared"].discard_evictable(page)
        slab.num_referenced += 1
        if slab.num_used == len(slab.slots):
            self._slabs_with_free.discard(page)
        obj.slab_page, obj.slot = page, slot
        self.events.on_slab("SLOT_ALLOC", page, slot, request_id, slab.num_used, 0)

    def _free_slot(self, obj: StateObject, cause: int) -> None:
        page, slot = obj.slab_page, obj.slot
        slab = self.slabs[page]
        assert slab.slots[slot] is obj
        slab.slots[slot] = None
        slab.num_used -= 1
        obj.slab_page = obj.slot = NO_SLOT
        self.events.on_slab("SLOT_FREE", page, slot, cause, slab.num_used, 0)
        if slab.num_used == 0:
            if slab is self._newest:
                self._newest = None
            del self.slabs[page]
            self._slabs_with_free.discard(page)
            self._owner["shared"][page] = None
            pool = self.pools["shared"]
            pool.discard_evictable(page)
            pool.push_free(page)
            self.events.on_slab("SLAB_FREE", page, NO_SLOT, cause, 0, 0)
        elif not self.write_once:
            self._slabs_with_free.add(page)

    # ----- reference transitions include the slab page ------------------------------------
    def _on_referenced(self, obj: StateObject) -> None:
        super()._on_referenced(obj)
        if obj.slab_page != NO_SLOT:
            slab = self.slabs[obj.slab_page]
            if slab.num_referenced == 0:
                self.pools["shared"].discard_evictable(slab.page)
            slab.num_referenced += 1

    def _on_unreferenced(self, obj: StateObject, least_recent: bool = False) -> None:
        super()._on_unreferenced(obj, least_recent)
        if obj.slab_page != NO_SLOT:
            slab = self.slabs[obj.slab_page]
            slab.num_referenced -= 1
            if slab.num_referenced == 0:
                self._slab_evictable(slab)

    def _slab_evictable(self, slab: Slab) -> None:
        """An unreferenced slab joins the LRU: at its last write (write_once, dense) or now
        (refill)."""
        self.pools["shared"].add_evictable(slab.page,
                                           slab.last_write if self._write_recency else None)

    def release(self, obj: StateObject, producer: bool = False) -> None:
        """Drop one reference; the producer's release counts as a write of its slab."""
        if producer and self._write_recency and obj.slab_page != NO_SLOT:
            self.slabs[obj.slab_page].last_write = self.pools["shared"].tick()
        super().release(obj)

    def _destroy(self, obj: StateObject, cause: int, taken: int = -1) -> None:
        if obj.slab_page != NO_SLOT:
            page = obj.slab_page
            slab = self.slabs[page]
            last_reference = False
            if obj.ref_count == 0 and not obj.cached and obj.valid:
                # last reference of an unpublished composite: it was counted as referenced
                slab.num_referenced -= 1
                last_reference = slab.num_referenced == 0
            self._free_slot(obj, cause)
            if last_reference and page in self.slabs:
                # the cached neighbours left on the slab are unreferenced now: the page is evictable
                self._slab_evictable(self.slabs[page])
        super()._destroy(obj, cause, taken)

    # ----- eviction: a slab page is reclaimed whole ---------------------------------------
    def _evict_unit(self, pool_name: str, unit: int, cause: int) -> None:
        owner = self._owner[pool_name][unit]
        if not isinstance(owner, Slab):
            super()._evict_unit(pool_name, unit, cause)
            return
        slab = owner
        assert slab.num_referenced == 0, "reclaiming a slab with a referenced slot"
        victims = [obj for obj in slab.slots if obj is not None]
        self.events.on_slab("CROSS_INVALIDATE", unit, NO_SLOT, cause, slab.num_used, len(victims))
        for obj in victims:
            slab.slots[obj.slot] = None
            obj.slab_page = obj.slot = NO_SLOT
            self._invalidate(obj, cause, reason="slab_reclaim")
        del self.slabs[unit]
        self._slabs_with_free.discard(unit)
        if slab is self._newest:
            self._newest = None
        self._owner[pool_name][unit] = None
        self.events.on_slab("SLAB_RECLAIM", unit, NO_SLOT, cause, 0, len(victims))

    def unit_efficiency(self, pool: str, unit: int) -> float:
        """A slab page ranks as the best cached checkpoint on it (reclaiming it loses all)."""
        owner = self._owner[pool][unit]
        if isinstance(owner, Slab):
            return max((self.entry_efficiency(obj) for obj in owner.slots
                        if obj is not None and obj.cached), default=0.0)
        return super().unit_efficiency(pool, unit)

    # ----- addressing ---------------------------------------------------------------------
    def conv_line(self, obj: StateObject) -> int:
        """Line id 16 p + s of the composite's conv slot, or NO_SLOT."""
        assert obj.kind == Kind.COMPOSITE
        if obj.slab_page == NO_SLOT:
            return NO_SLOT
        return encode_conv_line(obj.slab_page, obj.slot, self.layout.slots_per_slab)

    def conv_address(self, obj: StateObject, offset: int, conv_base: int = 0) -> int:
        """conv_base + line * slot_bytes + offset. A test oracle for the line encoding
        (tests/test_memory_invariants.py); the torch arenas index slots by line id."""
        if not 0 <= offset < self.layout.conv_slot_bytes:
            raise ValueError(f"offset={offset} outside one {self.layout.conv_slot_bytes}-B slot")
        line = self.conv_line(obj)
        decode_conv_line(line, self.layout.slots_per_slab)  # refuses the sentinel
        return conv_base + line * self.layout.conv_slot_bytes + offset
