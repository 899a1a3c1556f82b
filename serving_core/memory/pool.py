"""A pool of equal-size allocation units with a free queue and an LRU of cached units."""

from __future__ import annotations

import heapq
from collections import deque


class UnitPool:
    """Units [0, num_units) of `unit_bytes` each.

    A unit is in exactly one of three states: free (in `free`), cached and
    unreferenced (in `evictable`), or in use. Allocation takes free units first;
    only then does the owner evict the least recent evictable unit. Recency is a
    stamp from the pool's clock: by default the instant the unit became evictable,
    or an earlier stamp the owner supplies (an S2 write-once slab keeps the stamp of
    its last write). Freed units go to the tail of the free queue, so reuse order is
    deterministic.
    """

    __slots__ = ("name", "num_units", "unit_bytes", "free", "evictable", "_heap", "clock")

    def __init__(self, name: str, num_units: int, unit_bytes: int) -> None:
        if num_units <= 0:
            raise ValueError(f"pool {name!r}: num_units={num_units} must be positive")
        self.name = name
        self.num_units = num_units
        self.unit_bytes = unit_bytes
        self.free: deque[int] = deque(range(num_units))
        self.evictable: dict[int, int] = {}  # unit -> recency stamp
        self._heap: list[tuple[int, int]] = []  # (stamp, unit); stale entries skipped lazily
        self.clock = 0

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
        return self.free.popleft() if self.free else -1

    def push_free(self, unit: int) -> None:
        assert unit not in self.evictable, f"unit {unit} freed while still evictable"
        self.free.append(unit)

    def add_evictable(self, unit: int, stamp: int | None = None) -> None:
        """Make `unit` evictable with recency `stamp` (default: now, the MRU end)."""
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
        """Move an evictable unit to the LRU end (the next eviction takes it)."""
        assert unit in self.evictable, f"unit {unit} is not evictable"
        self.add_evictable(unit, -self.tick())

    def pop_lru(self) -> int:
        heap, evictable = self._heap, self.evictable
        while True:
            stamp, unit = heapq.heappop(heap)
            if evictable.get(unit) == stamp:
                del evictable[unit]
                return unit
