"""Hash-to-object maps for published attention blocks and recurrent checkpoints.

Keys are chained block hashes (salted per request), so a key names a whole
prefix. The cache holds only valid entries; an entry leaves it when any unit
it depends on is reassigned. Entries lost during the current engine step are
remembered for one step so lookups can report the M1 bracket (valid at the
start of the step) beside M0 (valid at the instant of lookup).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_core.memory.objects import StateObject


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Depths in tokens found for one prompt.

    attention: contiguous cached attention prefix (block granularity).
    amax: that prefix rounded down to the checkpoint grid.
    rmax: deepest complete checkpoint regardless of attention.
    jadopt: deepest boundary with both (the one adopted).
    """

    attention: int
    amax: int
    rmax: int
    jadopt: int


class PrefixCache:
    __slots__ = ("attention", "checkpoints", "lost", "current_step", "demand", "version")

    def __init__(self) -> None:
        self.attention: dict[int, StateObject] = {}
        self.checkpoints: dict[int, StateObject] = {}
        # (is_checkpoint, key) -> step in which the entry was lost
        self.lost: dict[tuple[bool, int], int] = {}
        self.current_step = 0
        # checkpoint key -> distinct requests whose prompt demanded it
        self.demand: dict[int, set[int]] = {}
        self.version = 0  # bumped on every insert/remove: lookups can be memoized against it

    def begin_step(self, step: int) -> None:
        self.current_step = step
        if self.lost:
            self.lost.clear()

    def insert(self, obj: StateObject, key: int, checkpoint: bool) -> bool:
        """Publish obj under key; False (no-op) if a valid entry already holds it."""
        table = self.checkpoints if checkpoint else self.attention
        if key in table:
            return False
        table[key] = obj
        self.version += 1
        obj.key = key
        obj.cached = True
        return True

    def remove(self, obj: StateObject) -> None:
        """Drop a published entry whose storage is being reassigned."""
        table = self.checkpoints if obj.kind else self.attention
        assert table.get(obj.key) is obj, f"entry {obj} is not the cached owner of its key"
        del table[obj.key]
        self.version += 1
        self.lost[(bool(obj.kind), obj.key)] = self.current_step
        obj.cached = False
        obj.valid = False

    def _has(self, key: int, checkpoint: bool, m1: bool) -> bool:
        table = self.checkpoints if checkpoint else self.attention
        return key in table or (m1 and (checkpoint, key) in self.lost)

    def lookup(
        self, keys: list[int], block_tokens: int, interval: int, m1: bool = False
    ) -> PrefixHit:
        """Depths for a prompt whose full-block chain keys are `keys`.

        With interval 0 (no recurrent state) the joint depth is the attention depth.
        """
        n = len(keys)
        i = 0
        while i < n and self._has(keys[i], False, m1):
            i += 1
        attention = i * block_tokens
        if interval == 0:
            return PrefixHit(attention, attention, 0, attention)
        per = interval // block_tokens
        amax = (attention // interval) * interval
        rmax = 0
        for k in range(n // per, 0, -1):
            if self._has(keys[k * per - 1], True, m1):
                rmax = k * interval
                break
        jadopt = 0
        if rmax:
            for k in range(min(amax, rmax) // interval, 0, -1):
                if self._has(keys[k * per - 1], True, m1):
                    jadopt = k * interval
                    break
        return PrefixHit(attention, amax, rmax, jadopt)

    def record_demand(
        self, keys: list[int], block_tokens: int, interval: int, request_id: int
    ) -> None:
        """Count `request_id` as a distinct requester of every checkpoint key of its prompt."""
        if interval == 0:
            return
        per = interval // block_tokens
        for k in range(1, len(keys) // per + 1):
            self.demand.setdefault(keys[k * per - 1], set()).add(request_id)

    def num_requesters(self, key: int) -> int:
        requesters = self.demand.get(key)
        return len(requesters) if requesters else 0
