"""A pool of equal-size allocation units with a free queue and an LRU of cached units."""

from __future__ import annotations

import heapq
from collections import deque

FREE_QUEUES = ("free_first", "single_queue")


class UnitPool:
    """Units [0, num_units) of `unit_bytes` each.

    A unit is in exactly one of three states: free (in `free`), cached and
    unreferenced (in `evictable`), or in use. Allocation takes free units first;
    only then does the owner evict the least recent evictable unit. Recency is a
    stamp from the pool's clock: by default the instant the unit became evictable,
    or an earlier stamp the owner supplies (an S2 write-once slab keeps the stamp of
    its last write). Freed units go to the tail of the free queue, so reuse order is
    deterministic.

    Free-queue rule (FREE_QUEUES):
    - `free_first` (default; docs/engine_rules.md section 9.1): allocation takes free units
      first and evicts a cached unit only when none is free.
    - `single_queue` (vLLM V1 BlockPool: one free_block_queue "in eviction order",
      including eviction candidates): free and evictable units form one LRU; allocation
      takes whichever is least recent, a never-used unit before any other, so cached
      content can be evicted while freed units wait behind it. A unit freed because its
      object was evicted keeps its place (vLLM keeps a bundle's other blocks in the queue).
    """

    __slots__ = ("name", "num_units", "unit_bytes", "free", "evictable", "_heap", "clock",
                 "single_queue", "free_stamps", "gains")

    def __init__(self, name: str, num_units: int, unit_bytes: int,
                 free_queue: str = "free_first") -> None:
        if free_queue not in FREE_QUEUES:
            raise ValueError(f"engine.free_queue={free_queue!r}: allowed values are "
                             f"{', '.join(FREE_QUEUES)}")
        if num_units <= 0:
            raise ValueError(f"pool {name!r}: num_units={num_units} must be positive")
        self.name = name
        self.num_units = num_units
        self.unit_bytes = unit_bytes
        self.free: deque[int] = deque(range(num_units))
        self.evictable: dict[int, int] = {}  # unit -> recency stamp
        self._heap: list[tuple[int, int]] = []  # (stamp, unit); stale entries skipped lazily
        self.clock = 0
        self.single_queue = free_queue == "single_queue"
        # single_queue: the stamp of each free unit, in queue order (never-used units: 0)
        self.free_stamps: deque[int] = deque([0] * num_units) if self.single_queue else deque()
        # units that became free or evictable so far: num_available can only have grown
        # since an instant when `gains` had the same value (a blocked admission memo)
        self.gains = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    @property
    def num_available(self) -> int:
        """Units an allocation can obtain: free plus evictable cached."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_units - len(self.free) - len(self.evictable)

    def tick(self) -> int:
        """A fresh recency stamp (later than every earlier one)."""
        self.clock += 1
        return self.clock

    def pop_free(self) -> int:
        if not self.free:
            return -1
        if self.single_queue:
            self.free_stamps.popleft()
        return self.free.popleft()

    def push_free(self, unit: int, stamp: int | None = None) -> None:
        """Queue a unit as free. single_queue: at the tail (now), or at the head with an old
        `stamp` (a unit that was already in the queue, e.g. an evicted object's sibling)."""
        assert unit not in self.evictable, f"unit {unit} freed while still evictable"
        self.gains += 1
        if not self.single_queue:
            self.free.append(unit)
        elif stamp is None or (self.free_stamps and stamp > self.free_stamps[0]):
            self.free.append(unit)
            self.free_stamps.append(self.tick())
        else:
            self.free.appendleft(unit)
            self.free_stamps.appendleft(stamp)

    def lru_first(self) -> bool:
        """True if the next allocation should evict the LRU cached unit rather than take a
        free one: no free unit, or (single_queue) the LRU unit is older than the free head."""
        if not self.free:
            return True
        if not self.single_queue or not self.evictable:
            return False
        heap, evictable = self._heap, self.evictable
        while evictable.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale entry
        return heap[0][0] < self.free_stamps[0]

    def add_evictable(self, unit: int, stamp: int | None = None) -> None:
        """Make `unit` evictable with recency `stamp` (default: now, the MRU end)."""
        self.gains += 1
        if stamp is None:
            stamp = self.tick()
        self.evictable[unit] = stamp
        heapq.heappush(self._heap, (stamp, unit))
        if len(self._heap) > 4 * len(self.evictable) + 64:
            self._heap = [(s, u) for u, s in self.evictable.items()]
            heapq.heapify(self._heap)

    def discard_evictable(self, unit: int) -> None:
        self.evictable.pop(unit, None)

    def make_least_recent(self, unit: int) -> None:
        """Move an evictable unit to the LRU end (the next eviction takes it): a test hook
        for eviction-order checks (tests/test_memory_invariants.py)."""
        assert unit in self.evictable, f"unit {unit} is not evictable"
        self.add_evictable(unit, -self.tick())

    def pop_lru(self) -> int:
        heap, evictable = self._heap, self.evictable
        while True:
            stamp, unit = heapq.heappop(heap)
            if evictable.get(unit) == stamp:
                del evictable[unit]
                return unit
