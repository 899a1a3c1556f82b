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
    """The entry of each key (`attention`, `checkpoints`: key -> object) and, when the
    organization caches duplicates (memory.base.DUPLICATE_RULES), the further copies of a
    key in publication order (`copies`: (is_checkpoint, key) -> objects). The entry is the
    oldest valid copy; losing it promotes the next, and the key is lost with its last."""

    __slots__ = ("attention", "checkpoints", "copies", "lost", "current_step", "demand",
                 "version", "watched_blocks", "watched_checkpoints", "watch_version")

    def __init__(self) -> None:
        self.attention: dict[int, StateObject] = {}
        self.checkpoints: dict[int, StateObject] = {}
        self.copies: dict[tuple[bool, int], list[StateObject]] = {}
        # (is_checkpoint, key) -> step in which the entry was lost
        self.lost: dict[tuple[bool, int], int] = {}
        self.current_step = 0
        # checkpoint key -> distinct requests whose prompt demanded it
        self.demand: dict[int, set[int]] = {}
        self.version = 0  # bumped on every insert/remove: lookups can be memoized against it
        # A blocked head's chain (see watch): the attention and checkpoint keys whose entry
        # appearing could deepen its adoption; watch_version is bumped when one does, when
        # a key's entry passes to another copy, and when a new chain is watched.
        self.watched_blocks: frozenset[int] = frozenset()
        self.watched_checkpoints: frozenset[int] = frozenset()
        self.watch_version = 0

    def begin_step(self, step: int) -> None:
        self.current_step = step
        if self.lost:
            self.lost.clear()

    def insert(self, obj: StateObject, key: int, checkpoint: bool,
               duplicate: bool = False) -> bool:
        """Publish obj under key; if a valid entry already holds it, False (no-op), or with
        `duplicate` obj becomes a further copy of the key (True)."""
        table = self.checkpoints if checkpoint else self.attention
        if key in table:
            if not duplicate:
                return False
            self.copies.setdefault((checkpoint, key), []).append(obj)
        else:
            table[key] = obj
            self.version += 1
            if key in (self.watched_checkpoints if checkpoint else self.watched_blocks):
                self.watch_version += 1
        obj.key = key
        obj.cached = True
        return True

    def remove(self, obj: StateObject) -> bool:
        """Drop a published copy whose storage is being reassigned; True if it was the
        key's last copy (the entry is lost), False if another copy still holds the key."""
        checkpoint = bool(obj.kind)
        table = self.checkpoints if checkpoint else self.attention
        copies = self.copies.get((checkpoint, obj.key))
        obj.cached = False
        obj.valid = False
        if table.get(obj.key) is not obj:
            assert copies and obj in copies, f"entry {obj} is not a cached copy of its key"
            copies.remove(obj)
        elif copies:
            table[obj.key] = copies.pop(0)  # the oldest further copy is the entry now
            self.version += 1
            self.watch_version += 1  # the entry is another object (its references differ)
        else:
            del table[obj.key]
            self.version += 1
            self.lost[(checkpoint, obj.key)] = self.current_step
            return True
        if not copies:
            del self.copies[(checkpoint, obj.key)]
        return False

    def lookup(
        self, keys: list[int], block_tokens: int, interval: int, m1: bool = False
    ) -> PrefixHit:
        """Depths for a prompt whose full-block chain keys are `keys`; with `m1`, entries
        lost during this step count as present (the M1 bracket).

        With interval 0 (no recurrent state) the joint depth is the attention depth.
        """
        # M0 (the admission path: a blocked head asks every step) tests plain dict membership
        attention = _WithLost(self.attention, self.lost, False) if m1 else self.attention
        checkpoints = _WithLost(self.checkpoints, self.lost, True) if m1 else self.checkpoints
        n = len(keys)
        i = 0
        while i < n and keys[i] in attention:
            i += 1
        depth = i * block_tokens
        if interval == 0:
            return PrefixHit(depth, depth, 0, depth)
        per = interval // block_tokens
        amax = (depth // interval) * interval
        rmax = 0
        for k in range(n // per, 0, -1):
            if keys[k * per - 1] in checkpoints:
                rmax = k * interval
                break
        jadopt = 0
        for k in range(min(amax, rmax) // interval, 0, -1):
            if keys[k * per - 1] in checkpoints:
                jadopt = k * interval
                break
        return PrefixHit(depth, amax, rmax, jadopt)

    def watch(self, keys: list[int], hit: PrefixHit, block_tokens: int,
              interval: int) -> int:
        """Watch the chain of a head whose admission failed: the attention keys of its
        cached prefix and the first missing block, and the checkpoint keys up to that
        prefix's grid depth. Only an entry appearing (or changing) under one of them can
        deepen what the head adopts; a lost entry never makes it cheaper to admit under
        the full-prompt gate (serving_core/scheduler.py `_try_admit`). Returns the new
        watch version."""
        self.watched_blocks = frozenset(keys[: hit.attention // block_tokens + 1])
        per = interval // block_tokens if interval else 0
        self.watched_checkpoints = (
            frozenset(keys[per - 1 : hit.amax // block_tokens : per]) if per else frozenset())
        self.watch_version += 1
        return self.watch_version

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


class _WithLost:
    """Membership in a table or among the entries of its kind lost this step (M1)."""

    __slots__ = ("table", "lost", "checkpoint")

    def __init__(self, table: dict, lost: dict, checkpoint: bool) -> None:
        self.table, self.lost, self.checkpoint = table, lost, checkpoint

    def __contains__(self, key: int) -> bool:
        return key in self.table or (self.checkpoint, key) in self.lost
