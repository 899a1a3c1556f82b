"""A pool of equal-size allocation units with a free queue and an LRU of cached units."""

from __future__ import annotations

from collections import OrderedDict, deque


class UnitPool:
    """Units [0, num_units) of `unit_bytes` each.

    A unit is in exactly one of three states: free (in `free`), cached and
    unreferenced (in `evictable`, least recently released first), or in use.
    Allocation takes free units first; only then does the owner evict the LRU
    unit. Freed units go to the tail of the free queue, so reuse order is
    deterministic.
    """

    __slots__ = ("name", "num_units", "unit_bytes", "free", "evictable")

    def __init__(self, name: str, num_units: int, unit_bytes: int) -> None:
        if num_units <= 0:
            raise ValueError(f"pool {name!r}: num_units={num_units} must be positive")
        self.name = name
        self.num_units = num_units
        self.unit_bytes = unit_bytes
        self.free: deque[int] = deque(range(num_units))
        self.evictable: OrderedDict[int, None] = OrderedDict()

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

    def pop_free(self) -> int:
        return self.free.popleft() if self.free else -1

    def push_free(self, unit: int) -> None:
        assert unit not in self.evictable, f"unit {unit} freed while still evictable"
        self.free.append(unit)

    def add_evictable(self, unit: int) -> None:
        """Append at the MRU end (or move there if already present)."""
        self.evictable[unit] = None
        self.evictable.move_to_end(unit)

    def discard_evictable(self, unit: int) -> None:
        self.evictable.pop(unit, None)

    def pop_lru(self) -> int:
        unit, _ = self.evictable.popitem(last=False)
        return unit
