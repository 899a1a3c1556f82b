"""The interface every memory organization offers the scheduler, and its shared mechanics.

Layering follows the block-pool / manager split of continuous-batching engines:
the hybrid-state manager (serving_core.state_manager) sees only this class (demand,
availability, allocate, acquire, release, publish, lookup); below it sit the unit pools
and the prefix cache. Subclasses say where each kind of logical object lives (S0, S1, S2,
D0, N0) and carry their organization's facts (class attributes below).

Invariants kept here (docs/engine_rules.md section 3.3):
1. a checkpoint is found only when all its members and its conv state are valid;
2. every unit of an object a request holds is referenced (never in the LRU);
3. before a unit is reassigned, every entry depending on it is invalidated
   (one member lost invalidates the whole checkpoint);
4. unit id 0 is a valid location; absence is NULL / NO_SLOT.
"""

from __future__ import annotations

import math

from serving_core.geometry import Geometry
from serving_core.layout import (
    PAGED_BLOCK_TOKENS,
    AllocationCost,
    OrgLayout,
    PoolPlan,
    round_half_up,
)
from serving_core.memory.events import MemoryEvents
from serving_core.memory.objects import NO_SLOT, Kind, StateObject
from serving_core.memory.pool import UnitPool
from serving_core.memory.prefix_cache import PrefixCache, PrefixHit
from serving_core.rules import rule_fields

# When a cached checkpoint's member pages take their LRU recency (engine.checkpoint_recency):
# `release` (default; vLLM V1: touch() takes a hit block out of the free queue and
# free_blocks() appends it at the tail) refreshes it at every last release, the producer's
# at publication and each adopter's after its first step; `publication` keeps the stamp of
# the producer's release, so adoption protects the checkpoint without refreshing it (the
# rule of write-once slab pages applied to the member pages; docs/engine_rules.md section 9.2).
CHECKPOINT_RECENCIES = ("release", "publication")
# When S1's dedicated conv page takes its LRU recency (engine.conv_page_recency; only an
# organization with a conv page of its own, layout.conv_pages > 0, has one): `members`
# (default) as its SSM member pages; `write`: its last write (the producer's release),
# never refreshed by an adopter's release, the rule of the write-once slab pages that hold
# S2's conv state (docs/engine_rules.md section 3.4) applied to the page that holds S1's.
# A checkpoint is lost with its first evicted member, so `write` bounds an S1 checkpoint's
# life by its publication while S0's contiguous composite keeps the release rule.
CONV_PAGE_RECENCIES = ("members", "write")
# Which of a finishing or preempted request's objects return first (engine.release_order;
# the first released is the first evicted): `attention_first` (default) its attention
# blocks deepest first, then its state (destinations, working composite, adopted and
# retained checkpoints); `state_first` its state, then its attention blocks deepest first.
# vLLM V1's hybrid coordinator frees one KV-cache group after another, each tail first
# (single_type_kv_cache_manager.free); `groups` takes vLLM's group order for the model
# (layer_pattern.attention_group_first: the state first where its first cached layer is
# state-only, Granite-4.0-H and Nemotron-H; the attention first for Falcon-H1).
RELEASE_ORDERS = ("attention_first", "state_first", "groups")
# A block or checkpoint computed again while its key is cached (engine.duplicates): `drop`
# (default) is not published; the recomputing request keeps its copy private and frees it
# at release. `cache` publishes it as a second copy of the same key (vLLM V1's
# BlockHashToBlockMap: "we don't de-duplicate the blocks in the cache"), so the key stays
# found while any copy is valid; adoption takes the oldest copy.
DUPLICATE_RULES = ("drop", "cache")
# Where a finishing request's attention blocks that no other request adopted (its private
# suffix: its own question and output) enter the LRU (engine.private_blocks): `mru`
# (default) at the most recent end, deepest first, like every block it releases; `evict_first`
# at the least recent end, deepest first, so they go before any entry another request used
# and do not compete with shared chains. vLLM frees a request's blocks tail first because
# the tail is the least likely to be reused (KVCacheManager.free); SGLang's radix cache
# evicts leaves (private suffixes) before the shared nodes above them. A preempted
# request's blocks keep `mru` (they are its own prefix on resume).
PRIVATE_BLOCK_RULES = ("mru", "evict_first")
# Where the torch arenas find a composite's conv window (MemoryOrganization.conv_addressing).
CONV_ADDRESSING = ("unit", "page", "slot")


class MemoryOrganization:
    """Shared pools, reference counting, publication, lookup and LRU eviction.

    Each subclass carries every rule of its organization, so nothing else keeps a
    table of names (the registry in serving_core.memory finds the class by name):

    Class facts the scheduler, the step model, the recorder and the arenas read:
    - `checkpoint_placement`, `align_chunks`: the engine's default rules for it;
    - `indirect`: the kernel reaches recurrent state through a page mapping;
    - `has_slabs`: conv states live in shared slab pages (slab ledger, slab policy);
    - `conv_addressing`: where the torch arenas find a composite's conv window
      (CONV_ADDRESSING): `unit`, SSM state then conv window in one unit; `page`, SSM
      member pages then a dedicated conv page (`conv_line` is its page id); `slot`, SSM
      member pages and a conv slot in a slab page (`conv_line` is its line id);
    - `supports_retention`: producer-side checkpoint retention (S2+Retention) applies;
    - `stable_demand`: `demand` depends on the counts alone and a pool's `num_available`
      grows only through its `gains` (UnitPool), so an admission that failed fails again
      while nothing it could adopt appeared in the prefix cache and no pool gained
      (serving_core/scheduler.py `_cache_mark`);
    - `pool_names`, `attention_pool`, `composite_pool`: its pools, in plan order, and
      which of them attention blocks and composites draw from.

    Class methods, each computed from a Geometry (never from one model's constants):
    - `unit_layout`: the unit sizes (required);
    - `pool_unit_bytes`, `budget_shares`, `units_of`, `plan_pools`: a nominal budget
      converted to whole units, each organization keeping its own rounding;
    - `units_per_checkpoint`, `min_units`: what one complete checkpoint needs;
    - `attention_units`, `allocation_cost`, `pool_bytes`: the exact bytes of a logical
      state set (serving_core/storage.py), and which pool pays them.
    The defaults describe one shared pool of equal pages rounded to the nearest page.
    """

    org = ""
    pool_names: tuple[str, ...] = ("shared",)
    attention_pool = "shared"
    composite_pool = "shared"
    checkpoint_placement = "step_end"  # step_end | every_boundary
    align_chunks = True
    indirect = False
    has_slabs = False
    conv_addressing = "page"  # CONV_ADDRESSING
    supports_retention = False
    stable_demand = True
    _resetting = False  # inside drop_cached: losses are reported with reason `reset`

    # ----- the organization's unit layout, budget conversion and costs -------------------
    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """Unit sizes of this organization under `geometry`."""
        raise NotImplementedError(f"{cls.__name__} must define unit_layout")

    @classmethod
    def pool_unit_bytes(cls, layout: OrgLayout) -> dict[str, int]:
        """Bytes of one unit of each pool: a page everywhere by default."""
        return dict.fromkeys(cls.pool_names, layout.page_bytes)

    @classmethod
    def budget_shares(cls, geometry: Geometry, budget_bytes: int) -> dict[str, int]:
        """Bytes of a budget each pool may hold: all of it, in one shared pool."""
        (pool,) = cls.pool_names
        return {pool: budget_bytes}

    @classmethod
    def units_of(cls, share_bytes: int, unit_bytes: int) -> int:
        """Whole units of a pool's share: round(share / unit), halves up (a pN share is
        N whole pages, so it gets N)."""
        return round_half_up(share_bytes, unit_bytes)

    @classmethod
    def plan_pools(cls, geometry: Geometry, layout: OrgLayout,
                   nominal_bytes: int) -> tuple[PoolPlan, ...]:
        """The pools a nominal budget buys, in `pool_names` order."""
        unit = cls.pool_unit_bytes(layout)
        shares = cls.budget_shares(geometry, nominal_bytes)
        return tuple(
            PoolPlan(cls.org, name, cls.units_of(shares[name], unit[name]) if unit[name] else 0,
                     unit[name])
            for name in cls.pool_names
        )

    @classmethod
    def units_per_checkpoint(cls, layout: OrgLayout) -> int:
        """Units of the composite pool one complete checkpoint takes at least."""
        return layout.units_per_composite

    @classmethod
    def min_units(cls, layout: OrgLayout) -> dict[str, int]:
        """Fewest units of each pool that hold one checkpoint (one attention block
        without recurrent state): a budget below them is refused."""
        need = dict.fromkeys(cls.pool_names, 0)
        need[cls.attention_pool] = 1
        if layout.has_recurrent:
            need[cls.composite_pool] = cls.units_per_checkpoint(layout)
        return need

    @classmethod
    def attention_units(cls, layout: OrgLayout, attention_blocks: int) -> int:
        """Attention units holding `attention_blocks` paged blocks of PAGED_BLOCK_TOKENS
        tokens as one contiguous prefix in this organization's own blocks."""
        return math.ceil(attention_blocks * PAGED_BLOCK_TOKENS / layout.block_tokens)

    @classmethod
    def allocation_cost(cls, geometry: Geometry, layout: OrgLayout, attention_blocks: int,
                        checkpoints: int, slabs: int | None = None) -> AllocationCost:
        """Bytes of xA paged attention blocks and xR checkpoints (`slabs`: organizations
        with slab pages only; the caller has checked the counts)."""
        assert slabs is None, f"{cls.org} has no slab pages"
        unit = cls.pool_unit_bytes(layout)
        attention = unit[cls.attention_pool] * cls.attention_units(layout, attention_blocks)
        recurrent = unit[cls.composite_pool] * layout.units_per_composite * checkpoints
        return AllocationCost(cls.org, attention, recurrent, 0)

    @classmethod
    def pool_bytes(cls, cost: AllocationCost) -> dict[str, int]:
        """The bytes of a cost each pool pays (capacity checks each pool against its share)."""
        out = dict.fromkeys(cls.pool_names, 0)
        out[cls.attention_pool] += cost.attention_bytes
        out[cls.composite_pool] += cost.recurrent_bytes
        return out

    @classmethod
    def split_summary(cls, geometry: Geometry, budget_bytes: int) -> dict:
        """How a budget is split between the pools, where it is split ({} otherwise)."""
        return {}

    # ----- runtime -----------------------------------------------------------------------
    def __init__(
        self,
        layout: OrgLayout,
        pool_units: dict[str, int],
        events: MemoryEvents | None = None,
        *,
        rules=None,
        cache_policy=None,
    ):
        """`rules`: an AllocatorRules (memory.rules; None: the defaults), checked there;
        `cache_policy`: the policy object its cache_policy rule names (None: lru)."""
        if rules is None:
            from serving_core.memory.rules import AllocatorRules

            rules = AllocatorRules()
        self.rules = rules
        free_queue = rules.free_queue
        self.free_queue = free_queue
        self.checkpoint_recency = rules.checkpoint_recency
        self._recency_at_publication = rules.checkpoint_recency == "publication"
        self.layout = layout
        # Index of the dedicated conv page among a composite's units (None: no such page).
        self._conv_unit = layout.ssm_members if layout.conv_pages else None
        self.conv_page_recency = (rules.conv_page_recency if self._conv_unit is not None
                                  else None)
        self._conv_at_write = self.conv_page_recency == "write"
        self.release_order = rules.release_order
        # whether a released request's attention blocks return before its state (`groups`:
        # set by memory.build_memory from the model's layer pattern)
        self.attention_released_first = rules.release_order != "state_first"
        self.duplicates = rules.duplicates
        self.cache_duplicates = rules.duplicates == "cache"
        self.private_blocks = rules.private_blocks
        self.private_first = rules.private_blocks == "evict_first"
        self.events = events or MemoryEvents()
        # state_blocks=vllm_align (queue_evicted_siblings): an evicted composite's other
        # units keep their LRU places, as vLLM's other KV cache groups keep their blocks
        # queued and cached (the checkpoint is lost: a hit needs every group).
        self.queued_siblings = False
        self.cache = PrefixCache()
        self.pools: dict[str, UnitPool] = {}
        self._owner: dict[str, list] = {}
        # engine.cache_policy (memory.cache_policy): None is `lru`, the pools' own order
        self.cache_policy = cache_policy
        unit_bytes = self.pool_unit_bytes(layout)
        for name, n in pool_units.items():
            self.pools[name] = self._make_pool(name, n, unit_bytes[name], free_queue)
            self._owner[name] = [None] * n
        self.live: dict[int, StateObject] = {}  # objects owning storage, by oid
        self._next_oid = 0
        # A rule no mechanism above reads is kept under its own name (the record reads it).
        for f in rule_fields(rules):
            if not hasattr(self, f.name):
                setattr(self, f.name, getattr(rules, f.name))

    def _make_pool(self, name: str, num_units: int, unit_bytes: int,
                   free_queue: str) -> UnitPool:
        """One pool: LRU (UnitPool), or ranked by the cache policy's utility."""
        if self.cache_policy is None:
            return UnitPool(name, num_units, unit_bytes, free_queue)
        return self.cache_policy.make_pool(
            name, num_units, unit_bytes, free_queue,
            lambda unit, pool=name: self.unit_efficiency(pool, unit))

    def unit_efficiency(self, pool: str, unit: int) -> float:
        """FLOPs saved per byte by the cached entry on `unit` (cache policy ranking)."""
        obj = self._owner[pool][unit]
        return self.entry_efficiency(obj) if isinstance(obj, StateObject) else 0.0

    def entry_efficiency(self, obj: StateObject) -> float:
        """FLOPs a hit on a cached entry saves per byte of the units it holds."""
        num_bytes = len(obj.units) * self.pools[obj.pool].unit_bytes
        return self.cache_policy.efficiency(obj.kind == Kind.COMPOSITE, obj.boundary,
                                            num_bytes)

    @property
    def cache_policy_name(self) -> str:
        return "lru" if self.cache_policy is None else self.cache_policy.name

    # ----- geometry of the organization -------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    @property
    def checkpoint_interval(self) -> int:
        return self.layout.checkpoint_interval

    @property
    def has_recurrent(self) -> bool:
        return self.layout.checkpoint_interval > 0

    def units_per_composite(self) -> int:
        """Whole units of the composite pool one composite takes."""
        return self.layout.units_per_composite

    # ----- demand and availability ------------------------------------------------------
    def demand(self, num_attention: int, num_composites: int) -> dict[str, int]:
        """Units each pool must supply for new attention blocks and composites."""
        need = dict.fromkeys(self.pools, 0)
        need[self.attention_pool] += num_attention
        if num_composites:
            need[self.composite_pool] += num_composites * self.units_per_composite()
        return need

    def availability_gains(self) -> int:
        """Units that became free or evictable so far, over every pool (see stable_demand)."""
        return sum(pool.gains for pool in self.pools.values())

    def can_allocate(self, need: dict[str, int], extra: dict[str, int] | None = None) -> bool:
        for name, pool in self.pools.items():
            more = extra.get(name, 0) if extra else 0
            if need.get(name, 0) + more > pool.num_available:
                return False
        return True

    def pinned_by_adoption(self, objs: list[StateObject]) -> dict[str, int]:
        """Units that taking references on `objs` would pull out of the LRU."""
        pulled = dict.fromkeys(self.pools, 0)
        for obj in objs:
            if obj.ref_count == 0:
                pulled[obj.pool] += len(obj.units)
        return pulled

    def total_units(self) -> dict[str, int]:
        return {name: pool.num_units for name, pool in self.pools.items()}

    # ----- allocation ---------------------------------------------------------------------
    def _new_object(self, kind: Kind, pool: str, request_id: int) -> StateObject:
        obj = StateObject(self._next_oid, kind, pool, [], request_id)
        self._next_oid += 1
        self.live[obj.oid] = obj
        return obj

    def _take_unit(self, pool_name: str, request_id: int) -> int:
        """A free unit, else the LRU cached unit after invalidating what depends on it."""
        pool = self.pools[pool_name]
        if not pool.lru_first():
            return pool.pop_free()
        if not pool.evictable:
            raise MemoryError(f"pool {pool_name!r} exhausted: caller must check can_allocate first")
        unit = pool.pop_lru()
        self._evict_unit(pool_name, unit, request_id)
        return unit

    def _assign(self, obj: StateObject, count: int) -> None:
        owner = self._owner[obj.pool]
        for _ in range(count):
            unit = self._take_unit(obj.pool, obj.producer)
            owner[unit] = obj
            obj.units.append(unit)

    def allocate_attention(self, request_id: int) -> StateObject:
        """One attention block held by `request_id` (reference count 1, unpublished)."""
        return self.allocate_attention_blocks(request_id, 1)[0]

    def allocate_attention_blocks(self, request_id: int, count: int) -> list[StateObject]:
        """`count` attention blocks held by `request_id`, allocated in order one at a time
        (a chunk's blocks in one call: D0's 16-token blocks make this the hottest path)."""
        pool = self.attention_pool
        owner, new, take = self._owner[pool], self._new_object, self._take_unit
        # _take_unit's free-first branch inlined where no subclass redefines it
        free = (self.pools[pool].free if type(self)._take_unit is MemoryOrganization._take_unit
                and not self.pools[pool].single_queue else None)
        blocks = []
        for _ in range(count):
            obj = new(Kind.ATTENTION, pool, request_id)
            unit = free.popleft() if free else take(pool, request_id)
            owner[unit] = obj
            obj.units.append(unit)
            blocks.append(obj)
        return blocks

    def allocate_composite(self, request_id: int) -> StateObject:
        """One complete recurrent composite (SSM + conv) held by `request_id`."""
        assert self.has_recurrent, "geometry has no recurrent state"
        obj = self._new_object(Kind.COMPOSITE, self.composite_pool, request_id)
        self._assign(obj, self.units_per_composite())
        return obj

    # ----- references ---------------------------------------------------------------------
    def acquire(self, obj: StateObject) -> None:
        """Take an execution reference (or pin); a cached object leaves the LRU."""
        assert obj.valid, f"acquire of invalidated {obj}"
        if obj.ref_count == 0:
            self._on_referenced(obj)
        obj.ref_count += 1

    def release(self, obj: StateObject, producer: bool = False) -> None:
        """Drop one reference. Last release keeps a published entry cached (evictable);
        an unpublished object's storage is freed at once. `producer` marks the producing
        request's own release (S2 write-once slabs count it as a write)."""
        self.release_each((obj,))

    def release_each(self, objs, finishing: bool = False) -> None:
        """`release` of each of `objs` in turn, none a producer's release (one call for a
        request's attention blocks; S2 adds to `release` only for producers). `finishing`:
        under private_blocks `evict_first`, the cached blocks no other request adopted go
        to the least recent end of the LRU afterwards, the first of `objs` last (so it is
        the first evicted)."""
        private = [] if finishing and self.private_first else None
        for obj in objs:
            assert obj.ref_count > 0, f"release of unreferenced {obj}"
            obj.ref_count -= 1
            if obj.ref_count:
                continue
            if not obj.cached:
                self._destroy(obj, obj.producer)
            elif private is not None and not obj.shared and obj.kind == Kind.ATTENTION:
                private.append(obj)
            else:
                self._on_unreferenced(obj)
        for obj in reversed(private or ()):
            self._on_unreferenced(obj, least_recent=True)

    def release_by_group(self, objs) -> None:
        """`release_each` of composites with their units returned group by group, as vLLM's
        hybrid coordinator frees one KV cache group after another (`KVCacheCoordinator.free`,
        `remove_skipped_blocks`): member 0 of every object in `objs` order, then member 1, ...
        (state_blocks=vllm_align; Granite's nine Mamba groups). Under a publication-stamped
        recency rule, or an organization with its own release mechanics (S2's slabs,
        Jenga), the objects go one by one (`release_each`)."""
        if not self._plain_release():
            self.release_each(objs)
            return
        done = []
        for obj in objs:
            assert obj.ref_count > 0, f"release of unreferenced {obj}"
            obj.ref_count -= 1
            if not obj.ref_count:
                done.append(obj)
        for j in range(max((len(obj.units) for obj in done), default=0)):
            for obj in done:
                if j < len(obj.units):
                    self._return_unit(obj, obj.units[j])
        for obj in done:
            if not obj.cached:
                self._retire(obj)

    def _plain_release(self) -> bool:
        """Whether releases and evictions take this class's mechanics unchanged and no
        publication-stamped recency rule holds (the group-by-group rules apply)."""
        cls, base = type(self), MemoryOrganization
        return not (self._recency_at_publication or self._conv_at_write
                    or cls._destroy is not base._destroy
                    or cls._on_unreferenced is not base._on_unreferenced
                    or cls._evict_unit is not base._evict_unit)

    def queue_evicted_siblings(self) -> None:
        """state_blocks=vllm_align: an evicted composite's other units keep their LRU places
        (where the mechanics are this class's: see `_plain_release`)."""
        self.queued_siblings = self._plain_release()

    def _return_unit(self, obj: StateObject, unit: int) -> None:
        """One unit of an unreferenced object: to the LRU (cached) or the free queue."""
        if obj.cached:
            self.pools[obj.pool].add_evictable(unit)
        else:
            self._owner[obj.pool][unit] = None
            self._free_unit(obj.pool, unit)

    def _on_referenced(self, obj: StateObject) -> None:
        pool = self.pools[obj.pool]
        for unit in obj.units:
            pool.discard_evictable(unit)

    def _on_unreferenced(self, obj: StateObject, least_recent: bool = False) -> None:
        pool = self.pools[obj.pool]
        if least_recent:  # below every stamp given so far: the next eviction takes it
            for unit in obj.units:
                pool.add_evictable(unit, -pool.tick())
            return
        if obj.kind == Kind.COMPOSITE and (self._recency_at_publication or self._conv_at_write):
            # The first last-release is the producer's (publication); later ones (adopters)
            # return the units that keep their publication stamp (all members under
            # `publication`, the conv page under conv_page_recency `write`) where it put them.
            if obj.stamp is None:
                obj.stamp = pool.tick()
            conv = self._conv_unit
            for i, unit in enumerate(obj.units):
                keep = self._recency_at_publication or i == conv
                pool.add_evictable(unit, obj.stamp if keep else None)
            return
        for unit in obj.units:
            pool.add_evictable(unit)

    def _destroy(self, obj: StateObject, cause: int, taken: int = -1) -> None:
        """Return every unit of obj (except `taken`, which the caller reuses) to the free queue."""
        owner = self._owner[obj.pool]
        for unit in obj.units:
            owner[unit] = None
            if unit != taken:
                self._free_unit(obj.pool, unit)
        self._retire(obj)

    def _retire(self, obj: StateObject) -> None:
        """An object whose units are all returned: invalid, no longer live."""
        obj.units = []
        obj.valid = False
        self.live.pop(obj.oid, None)

    def _free_unit(self, pool_name: str, unit: int) -> None:
        """A destroyed object's unit: off the LRU, onto its pool's free queue (vLLM's one
        queue keeps its place in the order)."""
        pool = self.pools[pool_name]
        stamp = pool.evictable.get(unit) if pool.single_queue else None
        pool.discard_evictable(unit)
        pool.push_free(unit, stamp)

    # ----- eviction -----------------------------------------------------------------------
    def drop_cached(self) -> int:
        """Evict every unreferenced cached entry through the eviction path (as allocations
        would: losses recorded, dependent units freed) and free its units; returns the
        cached units freed. A prefix-cache reset; referenced entries stay."""
        freed = 0
        self._resetting = True
        for name, pool in self.pools.items():
            while pool.evictable:
                unit = pool.pop_lru()
                self._evict_unit(name, unit, -1)
                pool.push_free(unit)
                freed += 1
        self._resetting = False
        return freed

    def _evict_unit(self, pool_name: str, unit: int, cause: int) -> None:
        """Invalidate the entry living on `unit` (now out of the LRU) and free its other units
        (under `queued_siblings` they stay in the LRU, owned by no one, until taken)."""
        owner = self._owner[pool_name]
        obj = owner[unit]
        if obj is None:  # a queued sibling of an evicted composite: nothing depends on it
            return
        if self.queued_siblings and len(obj.units) > 1:
            siblings = [u for u in obj.units if u != unit]
            obj.units = [unit]
            for u in siblings:
                owner[u] = None
        self._invalidate(obj, cause, taken=unit)

    def _invalidate(self, obj: StateObject, cause: int, taken: int = -1,
                    reason: str = "lru") -> None:
        """Evict a cached entry; `reason` (serving_core.lineage.END_CAUSES) is what the
        loss report carries (`reset` throughout a prefix-cache reset)."""
        assert obj.ref_count == 0 and obj.cached, f"evicting a referenced or uncached {obj}"
        if self.cache.remove(obj):  # the key's last copy: the entry is lost
            events = self.events
            events.loss_reason = "reset" if self._resetting else reason
            events.on_loss(obj, cause)
            events.loss_reason = "lru"
        self._destroy(obj, cause, taken)

    # ----- publication and lookup ---------------------------------------------------------
    def publish(self, obj: StateObject, key: int, boundary: int) -> bool:
        """Publish obj as the entry for the prefix named by `key`; False if one exists
        (under duplicates `cache`, obj becomes another copy of it instead: True)."""
        assert obj.valid and obj.ref_count > 0, f"publish of {obj}"
        if not self.cache.insert(obj, key, checkpoint=obj.kind == Kind.COMPOSITE,
                                 duplicate=self.cache_duplicates):
            return False
        obj.boundary = boundary
        self.events.on_publish(obj)
        return True

    def lookup(self, keys: list[int], m1: bool = False) -> PrefixHit:
        return self.cache.lookup(keys, self.block_tokens, self.checkpoint_interval, m1)

    def cached_attention(self, key: int) -> StateObject | None:
        return self.cache.attention.get(key)

    def cached_checkpoint(self, key: int) -> StateObject | None:
        return self.cache.checkpoints.get(key)

    # ----- addressing (what a paged kernel reads) -----------------------------------------
    def ssm_member_pages(self, obj: StateObject) -> list[int]:
        """Physical page of each SSM member of a composite, in member order."""
        assert obj.kind == Kind.COMPOSITE
        return list(obj.units[: max(1, self.layout.ssm_members)])

    def ssm_address(self, obj: StateObject, member: int, offset: int, base: int = 0) -> int:
        """base + page_of(b, j) * page_stride + offset(j, u).

        The stride is the unit size of the pool holding the composite (a page for
        S0/S1/S2, the native composite for D0's recurrent pool). A test oracle: the torch
        arenas address by page id; tests/test_memory_invariants.py holds this formula.
        """
        stride = self.pools[obj.pool].unit_bytes
        if not 0 <= offset < stride:
            raise ValueError(f"offset={offset} outside one {stride}-B unit")
        pages = self.ssm_member_pages(obj)
        if not 0 <= member < len(pages):
            raise ValueError(f"member={member} outside [0, {len(pages)}) SSM member pages")
        return base + pages[member] * stride + offset

    def conv_line(self, obj: StateObject) -> int:
        """Conv-state location: a page id here; S2 overrides with line ids 16 p + s."""
        assert obj.kind == Kind.COMPOSITE
        return obj.units[-1] if obj.units else NO_SLOT

    # ----- observability ------------------------------------------------------------------
    def usage(self) -> dict[str, tuple[int, int, int, int]]:
        """Per pool: (used, cached, free, total) units."""
        return {
            name: (p.num_used, p.num_evictable, p.num_free, p.num_units)
            for name, p in self.pools.items()
        }

    def owner_of(self, pool: str, unit: int):
        """The object holding `unit` of `pool`: for invariant checks
        (tests/test_memory_invariants.py)."""
        return self._owner[pool][unit]
