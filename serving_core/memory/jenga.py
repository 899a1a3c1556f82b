"""Jenga: a two-level allocator, LCM-sized large pages carved into per-type small pages.

After Zhang et al., "Jenga: Effective Memory Management for Serving LLM with
Heterogeneity" (SOSP 2025), and vLLM v1's hybrid allocator that grew out of it
(vllm/v1/core/kv_cache_coordinator.py, single_type_kv_cache_manager.py, block_pool.py).

Where this arm follows Jenga:
- two levels over one byte budget: the budget is whole *large pages* (the LCM of the
  small-page sizes of the state types the model needs); a large page is handed to one
  state type on demand and carved into that type's *small pages*: attention pages of
  `JENGA_BLOCK_TOKENS` tokens (vLLM's default block) and recurrent-state pages of one
  composite each. A large page returns to the large-page free list as soon as all its
  small pages are free, so capacity moves between the types with the workload (no
  static split as in D0, no page sized for the largest type as in S0/N0);
- per-type prefix caching and eviction: each type's allocator serves from its own small
  pages, free ones first and then its own least recently used cached one (in large pages
  that are still in use); only when the type has none does it ask the large-page level,
  which hands out a free large page or, failing that, reclaims the least recently used
  large page that nothing references (its recency: the newest of its small pages, one
  clock for both types), of either type, evicting every cached entry on it. A type's
  allocations thus never take another type's cached state while it has its own, and whole
  large pages are reclaimed in recency order across types (Jenga's LCM-level eviction).
  Unlike the single-level organizations' free-first rule, a type evicts its own cached
  small page in an in-use large page before it takes a free large page; `can_allocate` is
  exact for this order (each type's own in-use pages first, then whole large pages from
  one shared count);
- prefix-subset order: a request releases its attention blocks tail first (the state
  manager), so of one prefix the deepest blocks are the least recent and go first.

Where it simplifies:
- the LCM of the exact sizes can be huge (Falcon-H1-7B: 16 KiB attention pages and a
  1,594,368-B composite have an LCM of 2^14 x 1,557 B = 24.3 MiB, a quarter of b63), so,
  as vLLM's hybrid allocator pads a Mamba page, the state page is padded to a whole number
  of attention pages (1,605,632 B, +0.7 %); the large page is the LCM of the padded sizes
  (for Falcon-H1-7B the state page itself: one composite or 98 attention pages);
- Jenga's balancing of hit lengths across layer types (its per-layer-type policies for
  sliding-window or cross-attention layers) and its common-prefix predictor are not
  modelled: a hybrid layer here has one attention and one state type, hits need both
  (the joint-depth rule of the state manager), and eviction is the LRU order above;
- checkpoints keep S2's engine rules (512-token grid, step-end placement, aligned chunks),
  so a comparison with S2 isolates the allocator;
- the torch arenas hold each type's small pages in their own tensor (the same addressing
  as D0's `unit` composites); the large-page aliasing of one byte range by both types is
  bookkeeping here, not shared storage, which the token-exact checks do not depend on.

A budget is floor(nominal / large page) large pages. The plan lists both small-page pools
at full capacity (L x per-large-page small pages each); their bytes are the large pages'
and are counted once (`CarvedPoolPlan`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from serving_core.geometry import Geometry
from serving_core.layout import PAGED_BLOCK_TOKENS, AllocationCost, OrgLayout, PoolPlan
from serving_core.memory.base import MemoryOrganization
from serving_core.memory.objects import Kind, StateObject
from serving_core.memory.pool import UnitPool

JENGA_BLOCK_TOKENS = 16  # attention small page: vLLM's default block_size
JENGA_CHECKPOINT_INTERVAL = PAGED_BLOCK_TOKENS  # S2's grid (module doc)

# Small-page states
_UNCARVED, _FREE, _USED, _CACHED = 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class JengaLayout(OrgLayout):
    """OrgLayout plus the large page and how many small pages of each type it holds."""

    large_page_bytes: int
    attention_per_large: int
    state_per_large: int


@dataclass(frozen=True, slots=True)
class CarvedPoolPlan(PoolPlan):
    """A pool whose units are carved from the large pages counted on the first pool's
    plan: its bytes are not counted again."""

    @property
    def num_bytes(self) -> int:
        return 0


def jenga_layout(geometry: Geometry) -> JengaLayout:
    """Small pages and the large page (module doc: the state page padded to whole
    attention pages, large page = lcm of the two)."""
    attention = JENGA_BLOCK_TOKENS * geometry.attention_bytes_per_token
    rec = geometry.has_recurrent
    state = math.ceil(geometry.composite_bytes / attention) * attention if rec else 0
    large = math.lcm(attention, state) if rec else attention
    return JengaLayout(org=JengaTwoLevel.org, block_tokens=JENGA_BLOCK_TOKENS,
                       checkpoint_interval=JENGA_CHECKPOINT_INTERVAL if rec else 0,
                       page_bytes=attention, units_per_composite=1 if rec else 0,
                       recurrent_unit_bytes=state, large_page_bytes=large,
                       attention_per_large=large // attention,
                       state_per_large=large // state if rec else 0)


class _SmallPages(UnitPool):
    """The small pages of one type: `free` holds the free small pages of the large pages
    carved for it (a dict as an ordered set); `num_available` is what this type alone
    could obtain (its free and cached small pages, plus every large page it could take)."""

    __slots__ = ("owner_org",)

    def __init__(self, name: str, num_units: int, unit_bytes: int, owner_org) -> None:
        super().__init__(name, num_units, unit_bytes, "free_first")
        self.free = {}  # type: ignore[assignment]  # unit -> None, carved and free
        self.owner_org = owner_org

    @property
    def num_available(self) -> int:
        return self.owner_org.available_alone(self.name)

    def tick(self) -> int:
        """One recency clock for both types (large pages compare stamps across them)."""
        return self.owner_org.tick()

    def make_least_recent(self, unit: int) -> None:
        super().make_least_recent(unit)
        self.owner_org._restamp(self.name, unit)


class JengaTwoLevel(MemoryOrganization):
    stable_demand = False  # small pages are carved from large pages outside the pools' gains
    org = "JENGA"
    pool_names = ("attention", "recurrent")
    attention_pool = "attention"
    composite_pool = "recurrent"
    conv_addressing = "unit"
    checkpoint_placement = "step_end"
    align_chunks = True

    # ----- the organization's facts ------------------------------------------------------
    @classmethod
    def unit_layout(cls, geometry: Geometry) -> JengaLayout:
        return jenga_layout(geometry)

    @classmethod
    def pool_unit_bytes(cls, layout: OrgLayout) -> dict[str, int]:
        return {"attention": layout.page_bytes, "recurrent": layout.recurrent_unit_bytes}

    @classmethod
    def budget_shares(cls, geometry: Geometry, budget_bytes: int) -> dict[str, int]:
        """Both types draw on the whole budget (their large pages are one pool)."""
        return {"attention": budget_bytes, "recurrent": budget_bytes}

    @classmethod
    def plan_pools(cls, geometry: Geometry, layout: JengaLayout,
                   nominal_bytes: int) -> tuple[PoolPlan, ...]:
        """floor(nominal / large page) large pages, as each type's small pages."""
        large = nominal_bytes // layout.large_page_bytes
        return (PoolPlan(cls.org, "attention", large * layout.attention_per_large,
                         layout.page_bytes),
                CarvedPoolPlan(cls.org, "recurrent", large * layout.state_per_large,
                               layout.recurrent_unit_bytes))

    @classmethod
    def min_units(cls, layout: JengaLayout) -> dict[str, int]:
        """One attention page and one checkpoint need two large pages (one per type)."""
        if not layout.has_recurrent:
            return {"attention": 1, "recurrent": 0}
        return {"attention": 2 * layout.attention_per_large,
                "recurrent": 2 * layout.state_per_large}

    @classmethod
    def allocation_cost(cls, geometry: Geometry, layout: JengaLayout, attention_blocks: int,
                        checkpoints: int, slabs: int | None = None) -> AllocationCost:
        """Whole large pages: ceil(attention pages / per large page) for attention and
        ceil(checkpoints / per large page) for the states (ideal packing)."""
        assert slabs is None, f"{cls.org} has no slab pages"
        pages = cls.attention_units(layout, attention_blocks)
        attention = math.ceil(pages / layout.attention_per_large) * layout.large_page_bytes
        recurrent = (math.ceil(checkpoints / layout.state_per_large) * layout.large_page_bytes
                     if checkpoints else 0)
        return AllocationCost(cls.org, attention, recurrent, 0)

    @classmethod
    def pool_bytes(cls, cost: AllocationCost) -> dict[str, int]:
        """Both pools pay the whole cost: they share the large pages."""
        return {"attention": cost.num_bytes, "recurrent": cost.num_bytes}

    def ssm_member_pages(self, obj):
        """A composite is one state page: its only member."""
        return list(obj.units[:1])

    # ----- runtime -----------------------------------------------------------------------
    def __init__(self, layout: JengaLayout, pool_units: dict[str, int], events=None,
                 **rules):
        if rules.get("cache_policy") is not None:
            raise ValueError("engine.cache_policy=marconi: org=jenga evicts by its own "
                             "per-type rule; allowed value is lru")
        if rules.get("free_queue", "free_first") != "free_first":
            raise ValueError(f"engine.free_queue={rules['free_queue']!r}: org=jenga keeps "
                             "its own free lists; allowed value is free_first")
        per = {"attention": layout.attention_per_large, "recurrent": layout.state_per_large}
        att = pool_units["attention"]
        if att <= 0 or att % per["attention"]:
            raise ValueError(f"pool_units attention={att}: a positive multiple of "
                             f"{per['attention']} (small pages per large page)")
        self.num_large = att // per["attention"]
        if layout.has_recurrent:
            want = self.num_large * per["recurrent"]
            if pool_units.get("recurrent") != want:
                raise ValueError(f"pool_units recurrent={pool_units.get('recurrent')}: "
                                 f"{self.num_large} large pages hold {want} state pages")
            pool_units = {"attention": att, "recurrent": want}
        else:
            pool_units = {"attention": att}
        self.per = {name: per[name] for name in pool_units}
        self.clock = 0  # the recency clock of both small-page types
        super().__init__(layout, pool_units, events, **rules)
        n = self.num_large
        self.large_free: deque[int] = deque(range(n))
        self.large_type: list[str | None] = [None] * n
        # per large page: small pages used (referenced), cached (evictable), free
        self.used = [0] * n
        self.cached = [0] * n
        self.nfree = [0] * n
        self.page_free: list[dict[int, None]] = [{} for _ in range(n)]
        self.state = {name: [_UNCARVED] * pool.num_units for name, pool in self.pools.items()}
        # per type: in-use large pages with a free small page (ordered set)
        self.open: dict[str, dict[int, None]] = {name: {} for name in self.pools}
        # per type: (stamp, unit) of cached small pages in in-use large pages (lazy)
        self.active_heap: dict[str, list[tuple[int, int]]] = {name: [] for name in self.pools}
        # large pages nothing references that hold cached small pages: (stamp, page, version)
        self.reclaim_heap: list[tuple[int, int, int]] = []
        self.page_stamp = [0] * n
        self.page_version = [0] * n

    def _make_pool(self, name: str, num_units: int, unit_bytes: int,
                   free_queue: str) -> UnitPool:
        return _SmallPages(name, num_units, unit_bytes, self)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ----- small-page state transitions ---------------------------------------------------
    def _page(self, pool: str, unit: int) -> int:
        return unit // self.per[pool]

    def _set(self, pool: str, unit: int, new: int) -> None:
        """Move one small page to state `new`, keeping the large page's counters, free lists
        and heaps; a large page whose small pages are all free returns to the free list."""
        state = self.state[pool]
        old = state[unit]
        state[unit] = new
        p = unit // self.per[pool]
        was_active = self.used[p] > 0
        small = self.pools[pool]
        if old == _FREE:
            self.nfree[p] -= 1
            del self.page_free[p][unit]
            del small.free[unit]
        elif old == _USED:
            self.used[p] -= 1
        elif old == _CACHED:
            self.cached[p] -= 1
        if new == _FREE:
            self.nfree[p] += 1
            self.page_free[p][unit] = None
            small.free[unit] = None
        elif new == _USED:
            self.used[p] += 1
        elif new == _CACHED:
            self.cached[p] += 1
        active = self.used[p] > 0
        if active and not was_active:  # the page is in use again: its cached pages rank
            heap = self.active_heap[pool]  # in the type's own LRU
            base = p * self.per[pool]
            for u in range(base, base + self.per[pool]):
                if state[u] == _CACHED:
                    heapq.heappush(heap, (small.evictable[u], u))
        elif new == _CACHED and active:
            heap = self.active_heap[pool]
            heapq.heappush(heap, (small.evictable[unit], unit))
            if len(heap) > 4 * len(small.evictable) + 64:
                self._rebuild_active(pool)
        if active and self.nfree[p]:
            self.open[pool][p] = None
        else:
            self.open[pool].pop(p, None)
        if not active:
            if self.cached[p]:
                if was_active:  # nothing references it any more: reclaimable as a whole
                    self._reclaimable(pool, p)
            elif self.nfree[p] == self.per[pool]:
                self._uncarve(pool, p)

    def _rebuild_active(self, pool: str) -> None:
        """Drop stale entries of the type's LRU heap (lazy deletion keeps it bounded)."""
        small, per = self.pools[pool], self.per[pool]
        heap = [(stamp, u) for u, stamp in small.evictable.items() if self.used[u // per] > 0]
        heapq.heapify(heap)
        self.active_heap[pool] = heap

    def _restamp(self, pool: str, unit: int) -> None:
        """A cached small page got a new recency stamp: rank it again."""
        p = unit // self.per[pool]
        if self.used[p] > 0:
            heapq.heappush(self.active_heap[pool], (self.pools[pool].evictable[unit], unit))
        else:
            self._reclaimable(pool, p)

    def _reclaimable(self, pool: str, p: int) -> None:
        small = self.pools[pool]
        base = p * self.per[pool]
        stamp = max(small.evictable[u] for u in range(base, base + self.per[pool])
                    if self.state[pool][u] == _CACHED)
        self.page_stamp[p] = stamp
        self.page_version[p] += 1
        heapq.heappush(self.reclaim_heap, (stamp, p, self.page_version[p]))

    def _uncarve(self, pool: str, p: int) -> None:
        small = self.pools[pool]
        for unit in list(self.page_free[p]):
            del small.free[unit]
            self.state[pool][unit] = _UNCARVED
        self.page_free[p].clear()
        self.nfree[p] = 0
        self.large_type[p] = None
        self.page_version[p] += 1
        self.large_free.append(p)

    def _carve(self, pool: str) -> int:
        """Hand the oldest free large page to type `pool`, all its small pages free."""
        p = self.large_free.popleft()
        self.large_type[p] = pool
        base = p * self.per[pool]
        small = self.pools[pool]
        for unit in range(base, base + self.per[pool]):
            self.state[pool][unit] = _FREE
            self.page_free[p][unit] = None
            small.free[unit] = None
        self.nfree[p] = self.per[pool]
        return p  # not yet in use: the caller takes one of its small pages at once

    def _take_free(self, pool: str, p: int) -> int:
        unit = next(iter(self.page_free[p]))
        self._set(pool, unit, _USED)
        return unit

    def _evict_small(self, pool: str, unit: int, cause: int) -> None:
        """Evict the cached entry on `unit` and keep the unit (now used) for the caller."""
        self.pools[pool].discard_evictable(unit)
        obj = self._owner[pool][unit]
        self._set(pool, unit, _USED)
        self._invalidate(obj, cause, taken=unit)

    def _pop_active(self, pool: str) -> int | None:
        heap, state, small = self.active_heap[pool], self.state[pool], self.pools[pool]
        per, used = self.per[pool], self.used
        while heap:
            stamp, unit = heapq.heappop(heap)
            if state[unit] == _CACHED and small.evictable.get(unit) == stamp \
                    and used[unit // per] > 0:
                return unit
        return None

    def _pop_reclaimable(self) -> int | None:
        heap = self.reclaim_heap
        while heap:
            stamp, p, version = heapq.heappop(heap)
            if (version == self.page_version[p] and self.large_type[p] is not None
                    and self.used[p] == 0 and self.cached[p]):
                return p
        return None

    def _take_unit(self, pool_name: str, request_id: int) -> int:
        """A small page of `pool_name` (module doc's order): a free one in an in-use large
        page, else the type's own LRU cached one there, else a free large page, else the
        LRU reclaimable large page of either type."""
        opened = self.open[pool_name]
        if opened:
            return self._take_free(pool_name, next(iter(opened)))
        unit = self._pop_active(pool_name)
        if unit is not None:
            self._evict_small(pool_name, unit, request_id)
            return unit
        if not self.large_free:
            p = self._pop_reclaimable()
            if p is None:
                raise MemoryError(f"pool {pool_name!r} exhausted: caller must check "
                                  "can_allocate first")
            owner_type = self.large_type[p]
            if owner_type == pool_name:
                if self.nfree[p]:
                    return self._take_free(pool_name, p)
                base = p * self.per[pool_name]
                small = self.pools[pool_name]
                unit = min((small.evictable[u], u) for u in range(base, base + self.per[pool_name])
                           if self.state[pool_name][u] == _CACHED)[1]
                self._evict_small(pool_name, unit, request_id)
                return unit
            self._reclaim(owner_type, p, request_id)  # returns it to the free list
        return self._take_free(pool_name, self._carve(pool_name))

    def _reclaim(self, pool: str, p: int, cause: int) -> None:
        """Evict every cached entry of large page p (of type `pool`); it becomes free."""
        base = p * self.per[pool]
        owners = self._owner[pool]
        victims = [owners[u] for u in range(base, base + self.per[pool])
                   if self.state[pool][u] == _CACHED]
        for obj in victims:
            for unit in obj.units:
                self.pools[pool].discard_evictable(unit)
            self._invalidate(obj, cause, reason="pool_pressure")

    # ----- references and frees -----------------------------------------------------------
    def _on_referenced(self, obj: StateObject) -> None:
        small = self.pools[obj.pool]
        for unit in obj.units:
            small.discard_evictable(unit)
            self._set(obj.pool, unit, _USED)

    def _on_unreferenced(self, obj: StateObject, least_recent: bool = False) -> None:
        small = self.pools[obj.pool]
        if least_recent:
            stamp = -small.tick()
        elif self._recency_at_publication and obj.kind == Kind.COMPOSITE:
            if obj.stamp is None:
                obj.stamp = small.tick()
            stamp = obj.stamp
        else:
            stamp = small.tick()
        for unit in obj.units:
            small.add_evictable(unit, stamp)
            self._set(obj.pool, unit, _CACHED)

    def _free_unit(self, pool_name: str, unit: int) -> None:
        """A destroyed object's small page: off the LRU, free in its large page."""
        self.pools[pool_name].discard_evictable(unit)
        self._set(pool_name, unit, _FREE)

    def drop_cached(self) -> int:
        freed = 0
        for obj in [o for o in self.live.values() if o.cached and o.ref_count == 0]:
            for unit in obj.units:
                self.pools[obj.pool].discard_evictable(unit)
            freed += len(obj.units)
            self._resetting = True
            self._invalidate(obj, -1)
            self._resetting = False
        return freed

    # ----- availability ---------------------------------------------------------------------
    def _own(self, pool: str) -> int:
        """Free and cached small pages of the type in its in-use large pages."""
        per = self.per[pool]
        return sum(self.nfree[p] + self.cached[p] for p in range(self.num_large)
                   if self.large_type[p] == pool and self.used[p] > 0) if per else 0

    def _pool_pages(self) -> int:
        """Large pages either type can take: free, or reclaimable (nothing referenced)."""
        return len(self.large_free) + sum(
            1 for p in range(self.num_large)
            if self.large_type[p] is not None and self.used[p] == 0)

    def available_alone(self, pool: str) -> int:
        return self._own(pool) + self._pool_pages() * self.per[pool]

    def pinned_by_adoption(self, objs: list[StateObject]) -> dict[str, int]:
        """Units the references pull out of the LRU, and under `<pool>:pages` the large
        pages nothing referenced that they bring back into use (can_allocate counts such a
        page whole, with its other small pages, for its type)."""
        pulled = dict.fromkeys(self.pools, 0)
        pages: dict[str, set[int]] = {name: set() for name in self.pools}
        in_pages = dict.fromkeys(self.pools, 0)
        for obj in objs:
            if obj.ref_count == 0:
                pulled[obj.pool] += len(obj.units)
                for unit in obj.units:
                    p = self._page(obj.pool, unit)
                    if self.used[p] == 0:
                        pages[obj.pool].add(p)
                        in_pages[obj.pool] += 1
        for name in self.pools:
            if pages[name]:
                pulled[f"{name}:pages"] = len(pages[name])
                pulled[f"{name}:in_pages"] = in_pages[name]
        return pulled

    def can_allocate(self, need: dict[str, int], extra: dict[str, int] | None = None) -> bool:
        """Exact for the allocation order of `_take_unit`: each type covers its need first
        from its own in-use large pages, then takes whole large pages (free or reclaimable,
        `n` small pages each) from one shared count."""
        extra = extra or {}
        pages_left = self._pool_pages()
        for name in self.pools:
            pages_left -= extra.get(f"{name}:pages", 0)
        want_pages = 0
        for name in self.pools:
            per = self.per[name]
            want = need.get(name, 0) + extra.get(name, 0)
            if not want:
                continue
            own = self._own(name) + per * extra.get(f"{name}:pages", 0)
            if want > own:
                want_pages += -(-(want - own) // per)
        return want_pages <= pages_left

    def usage(self) -> dict[str, tuple[int, int, int, int]]:
        """Per type: (used, cached, free, total) small pages of its id space (L x its small
        pages per large page); free is what is neither used nor cached by the type (its
        free small pages, and the small pages of large pages not carved for it), so the four
        add up as for every organization; `num_available` says what the type can obtain."""
        out = {}
        for name, pool in self.pools.items():
            used = self.state[name].count(_USED)
            cached = len(pool.evictable)
            out[name] = (used, cached, pool.num_units - used - cached, pool.num_units)
        return out

    # ----- bookkeeping check (tests; memory/invariants.py calls it) ------------------------
    def carved(self, pool: str, unit: int) -> bool:
        """Whether `unit` of `pool` lies in a large page carved for that type."""
        return self.state[pool][unit] != _UNCARVED

    def _unit_states_agree(self, name: str, pool) -> bool:
        """Each small page's state names exactly its place: the free queue, the LRU, an
        owner (check_own's per-page loop in whole-set comparisons, the hot path)."""
        states, owners = self.state[name], self._owner[name]
        return (len(owners) == len(states)
                and set(pool.free) == {u for u, s in enumerate(states) if s == _FREE}
                and pool.evictable.keys() == {u for u, s in enumerate(states) if s == _CACHED}
                and [o is not None for o in owners] == [s in (_USED, _CACHED) for s in states])

    def check_own(self) -> None:
        """Large pages partition the budget; counters equal the small pages' states."""
        assert len(set(self.large_free)) == len(self.large_free), "a large page freed twice"
        for p in range(self.num_large):
            kind = self.large_type[p]
            if kind is None:
                assert p in self.large_free, f"large page {p} is neither carved nor free"
                for name in self.pools:
                    base = p * self.per[name]
                    assert self.state[name][base:base + self.per[name]].count(
                        _UNCARVED) == self.per[name], (
                        f"free large page {p} has carved {name} small pages")
                continue
            assert p not in self.large_free, f"carved large page {p} is on the free list"
            for name in self.pools:
                base = p * self.per[name]
                states = self.state[name][base:base + self.per[name]]
                if name != kind:
                    assert states.count(_UNCARVED) == len(states), (
                        f"large page {p} of {kind} also carved for {name}")
                    continue
                assert _UNCARVED not in states, f"large page {p} of {kind} partly carved"
                assert states.count(_USED) == self.used[p], f"page {p} used count"
                assert states.count(_CACHED) == self.cached[p], f"page {p} cached count"
                assert states.count(_FREE) == self.nfree[p], f"page {p} free count"
                assert self.used[p] or self.cached[p], f"all-free large page {p} kept carved"
                assert set(self.page_free[p]) == {
                    base + i for i, s in enumerate(states) if s == _FREE}, f"page {p} free list"
                assert (p in self.open[name]) == (self.used[p] > 0 and self.nfree[p] > 0), (
                    f"page {p} open-list membership")
        for name, pool in self.pools.items():
            if self._unit_states_agree(name, pool):
                continue  # the loop below would pass: its checks as set comparisons
            free = set(pool.free)  # (a deque: a membership test walks it)
            for unit, s in enumerate(self.state[name]):
                assert (unit in free) == (s == _FREE), f"{name} {unit} free-set state"
                assert (unit in pool.evictable) == (s == _CACHED), f"{name} {unit} LRU state"
                owner = self._owner[name][unit]
                assert (owner is not None) == (s in (_USED, _CACHED)), (
                    f"{name} small page {unit} in state {s} owned by {owner!r}")
