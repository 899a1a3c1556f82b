"""An external (host) tier for published state: attention blocks and recurrent
checkpoints held by prefix key in host memory, saved from a device and restored later.

Two layers, on the model of a serving engine's offloading manager:
- `HostTier` is the store: which entries it holds, their host buffers, its capacity and
  LRU eviction, two-phase saves and the lookup of the deepest restorable prefix. It sees
  keys, byte counts and tensors only: never a scheduler queue, the allocator or a device
  arena.
- `EngineTier` is one engine's link to a store: the engine calls `before_admission` before
  every step (requests that entered, and preempted requests waiting to resume) and
  `after_step` once a step's states are in their units; it asks the engine's state manager
  (serving_core.state_manager), which owns every allocation, publication and copy hold, to
  save the newly published entries and to restore a held prefix into fresh units before
  admission looks it up. Copies go through the executor's copy port and its copier
  (serving_core/executor/state_copy.py): a worker thread (a CUDA stream on a GPU) for the
  torch executor, a host-link time model for a simulated one.

Entries. A tier entry is a checkpoint with its whole attention chain (without recurrent
state: a block with its chain): a restore needs all of it, so the tier holds it whole or
not at all. Blocks shared by several entries are held once, counted by the entries whose
chain includes them. `capacity_bytes` bounds the bytes held and in flight; a save that
does not fit evicts least recently used entries (saved or restored last longest ago) that
no restore pins and whose copies have landed; their blocks go with them unless another
entry still needs them. A save that still does not fit (or is larger than the capacity)
is rejected and counted.

Saving is two-phase: `begin_entry` reserves an entry's bytes (its parts then copy), `save`
receives a part's copy once it has landed, and `complete` indexes the due copies; only
then can a lookup find them. An entry whose copy has not completed is never restorable.

Audit hooks (the continuation check's byte audits; off when serving):
- `poison`: before a restore writes a destination unit, the unit is filled with NaN,
  so any byte the restore misses reads back as NaN (and changes the tokens);
- `save_delay_s` with a `clock`: a landed save stays incomplete until `clock()` has
  advanced by the delay. Its host buffer holds NaN until then (an in-flight copy has
  not landed), so restoring it early would show;
- every restore counts the bytes it copies host-to-device (`RestoreResult.bytes_h2d`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving_core.state_manager import (
    BLOCK,
    CHECKPOINT,
    HybridStateManager,
    RestoreResult,
    reads_no_cache,
)


@dataclass
class _Pending:
    kind: str  # BLOCK | CHECKPOINT
    key: int
    data: object  # host buffer(s) the index will hold
    staged: object  # landed copy still to move into `data` (delayed saves), else None
    ready_at: float


@dataclass
class _Entry:
    chain: tuple  # block keys a restore of this entry needs, in order
    checkpoint: bool  # the entry's own checkpoint (keyed like its last block) is a part
    inflight: int  # its parts whose copies have not completed


def _nan_like(data):
    """NaN of the saved regions' shapes: 0xFF bytes (NaN in fp32, bf16 and TQ4 norms)."""
    if data is None:
        return None
    return [torch.full(t.shape, 0xFF, dtype=t.dtype) for t in data]


class HostTier:
    """Host copies of published entries, keyed by their chained prefix keys.

    What a state manager calls: `holds` / `holds_entry`, `begin_entry` (reserve, evict),
    `save` (a part's copy landed), `complete` (index the due copies), `restorable_prefix`
    (lookup), `pin` / `unpin` around a restore, `entry` (a held copy, what a restore writes
    back), `record_restore` (counters) and the audit flag `poison`. The host buffers are
    `blocks` and `checkpoints` (key -> data; the continuation audit reads them).
    """

    def __init__(self, capacity_bytes: int, *, poison: bool = False, save_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be an integer > 0")
        if save_delay_s < 0:
            raise ValueError(f"save_delay_s={save_delay_s} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.blocks: dict[int, object] = {}  # key -> a block's saved regions
        self.checkpoints: dict[int, object] = {}  # key -> a checkpoint's saved regions
        self._pending: list[_Pending] = []
        self._held: set[tuple[str, int]] = set()  # parts held or being copied
        self._size: dict[tuple[str, int], int] = {}
        self._owner: dict[tuple[str, int], int] = {}  # part in flight -> its entry's key
        self._refs: dict[int, int] = {}  # block key -> entries whose chain includes it
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU first
        self._pins: dict[int, int] = {}
        self.used_bytes = 0
        self.poison = poison
        self.save_delay_s = float(save_delay_s)
        self.clock = clock
        self.saves_started = 0
        self.saves_completed = 0
        self.restores = 0
        self.restored_tokens = 0
        self.bytes_h2d = 0
        self.bytes_saved = 0
        self.evictions = 0  # entries evicted
        self.evicted_bytes = 0
        self.rejected_saves = 0  # entries that did not fit
        self.skipped_saves = 0  # entries whose chain had left the device before the save

    # ----- save -------------------------------------------------------------------------------
    def holds(self, kind: str, key: int) -> bool:
        """Whether the part is held or being copied (a second save would duplicate it)."""
        return (kind, key) in self._held

    def holds_entry(self, key: int) -> bool:
        return key in self._entries

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def touch(self, key: int) -> None:
        """A use of an entry (published again, restored): most recently used."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def begin_entry(self, key: int, chain: list[int], parts: list[tuple[str, int, int]]) -> bool:
        """Reserve an entry: `chain` its block keys, `parts` the (kind, key, bytes) the tier
        lacks and will receive through `save`. Evicts LRU entries to make room; False (and
        counted as rejected) when the entry does not fit."""
        need = sum(n for _, _, n in parts)
        if need > self.capacity_bytes:
            self.rejected_saves += 1
            return False
        kept = [k for k in chain if k in self._refs]
        for k in kept:  # the chain's held blocks cannot go while room is made for the rest
            self._refs[k] += 1
        while self.used_bytes + need > self.capacity_bytes:
            victim = next((k for k, e in self._entries.items()
                           if not e.inflight and not self._pins.get(k)), None)
            if victim is None:
                for k in kept:
                    self._refs[k] -= 1
                self.rejected_saves += 1
                return False
            self._evict(victim)
        for kind, k, n in parts:
            self._held.add((kind, k))
            self._size[(kind, k)] = n
            self._owner[(kind, k)] = key
            if kind == BLOCK:
                self._refs[k] = 1
        self._entries[key] = _Entry(tuple(chain), any(p == CHECKPOINT for p, _, _ in parts),
                                    len(parts))
        self.used_bytes += need
        self.saves_started += len(parts)
        return True

    def save(self, kind: str, key: int, data) -> None:
        """A part's copy has landed in `data` (host regions): it completes at the next
        `complete` (with a save delay: once the delay has passed; its buffer NaN until then)."""
        now = self.clock()
        if not self.save_delay_s:
            self._pending.append(_Pending(kind, key, data, None, now))
        else:
            self._pending.append(_Pending(kind, key, _nan_like(data), data,
                                          now + self.save_delay_s))

    def complete(self, now: float | None = None) -> int:
        """Index the landed copies that are due (all, without a save delay); returns how many
        completed. The others stay pending: not restorable."""
        now = self.clock() if now is None else now
        due = [p for p in self._pending if p.ready_at <= now]
        if not due:
            return 0
        self._pending = [p for p in self._pending if p.ready_at > now]
        for p in due:
            if p.staged is not None:  # the delayed copy lands now
                for t, t0 in zip(p.data, p.staged, strict=True):
                    t.copy_(t0)
            (self.blocks if p.kind == BLOCK else self.checkpoints)[p.key] = p.data
            self.bytes_saved += self._size.get((p.kind, p.key), 0)
            owner = self._owner.pop((p.kind, p.key), None)
            if owner is not None and owner in self._entries:
                self._entries[owner].inflight -= 1
        self.saves_completed += len(due)
        return len(due)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ----- eviction ---------------------------------------------------------------------------
    def _evict(self, key: int) -> None:
        """Drop a whole entry: its checkpoint and every block of its chain no other held
        entry needs."""
        entry = self._entries.pop(key)
        freed = 0
        if entry.checkpoint:
            self.checkpoints.pop(key, None)
            self._held.discard((CHECKPOINT, key))
            freed += self._size.pop((CHECKPOINT, key), 0)
        for k in entry.chain:
            refs = self._refs[k] - 1
            if refs:
                self._refs[k] = refs
                continue
            del self._refs[k]
            self.blocks.pop(k, None)
            self._held.discard((BLOCK, k))
            freed += self._size.pop((BLOCK, k), 0)
        self.used_bytes -= freed
        self.evictions += 1
        self.evicted_bytes += freed

    def pin(self, key: int) -> None:
        """Keep an entry from eviction while a restore reads it (and count it as a use)."""
        self._pins[key] = self._pins.get(key, 0) + 1
        self.touch(key)

    def unpin(self, key: int) -> None:
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
        else:
            del self._pins[key]

    # ----- restore ----------------------------------------------------------------------------
    def restorable_prefix(self, keys: list[int], block_tokens: int, interval: int) -> int:
        """Deepest boundary (tokens) with every block before it and its checkpoint held."""
        if not interval:
            n = 0
            while n < len(keys) and keys[n] in self.blocks:
                n += 1
            return n * block_tokens
        per = interval // block_tokens
        for k in range(len(keys) // per, 0, -1):
            if keys[k * per - 1] in self.checkpoints and all(
                keys[i] in self.blocks for i in range(k * per)
            ):
                return k * interval
        return 0

    def entry(self, kind: str, key: int):
        """The host copy of a completed part (what a restore writes back)."""
        return (self.blocks if kind == BLOCK else self.checkpoints)[key]

    def record_restore(self, result: RestoreResult) -> None:
        """Count one restore a state manager made from this tier."""
        self.restores += 1
        self.restored_tokens += result.prefix_tokens
        self.bytes_h2d += result.bytes_h2d


class EngineTier:
    """One engine's link to a host tier (`EngineSpec.host_tier`, `--host-tier-capacity-bytes`).

    Before admission, a request whose prompt the tier holds deeper than the device's prefix
    cache gets that prefix restored (deepest complete boundary, see
    HybridStateManager.restore_prefix), so the scheduler's ordinary lookup adopts exactly B
    tokens: a request that entered since the last step (`restored`: request id -> B), and a
    preempted request waiting to resume (`resumed`: request id -> B of its last restore),
    tried at every step until it runs again. After every step each newly published entry
    is saved: the state manager holds the objects it reads and hands each part to the
    `worker` (ThreadCopier or ModelledCopier), which copies off the step loop; a part's
    hold ends, and its copy lands in the tier, at the first step after it finished.
    `copier` is the copy port restores write through. The link holds no device state.
    """

    def __init__(self, tier: HostTier, copier, worker=None) -> None:
        self.tier = tier
        self.copier = copier
        self.worker = worker  # None: copies are made on the engine thread (synchronous)
        self.restored: dict[int, int] = {}
        self.resumed: dict[int, int] = {}
        self.query_tokens = 0  # prompt tokens looked up in the tier
        self.restore_failures = 0  # restores the device had no room for (recomputed)
        self.resume_restores = 0
        self._resuming: dict[int, object] = {}  # preempted, not running again yet
        self.restore_seconds = 0.0  # modelled transfer time charged to steps (simulated)
        self.restore_transfers = 0  # objects written by restores (one copy each)

    def before_admission(self, state: HybridStateManager, requests) -> float:
        """Restore held prefixes for `requests` (entered, never admitted) and for preempted
        requests waiting to resume; returns the modelled transfer seconds of the restores
        (0 with real copies, whose time the wall clock measures)."""
        seconds = 0.0
        for req in requests:
            self.query_tokens += req.num_prompt
            got = self._restore(state, req)
            if got is not None:
                self.restored[req.rid] = got.prefix_tokens
                seconds += self._seconds(got)
        for req in state.drain_preempted():
            self._resuming[req.rid] = req
        if self._resuming:
            for rid, req in list(self._resuming.items()):
                if req.status.name != "WAITING":  # admitted again (or finished)
                    del self._resuming[rid]
                    continue
                got = self._restore(state, req)
                if got is not None:
                    self.resumed[rid] = got.prefix_tokens
                    self.resume_restores += 1
                    seconds += self._seconds(got)
        self.restore_seconds += seconds
        return seconds

    def _restore(self, state: HybridStateManager, req) -> RestoreResult | None:
        if reads_no_cache(req):  # its prompt logprobs need its own prefill
            return None
        keys = req.lookup_keys()
        held = self.tier.restorable_prefix(keys, state.B, state.C)
        if held <= state.peek(req).jadopt:
            return None
        try:
            return state.restore_prefix(keys, self.tier, self.copier)
        except MemoryError:
            self.restore_failures += 1
            return None

    def _seconds(self, got: RestoreResult) -> float:
        parts = len(got.blocks) + (got.checkpoint is not None)
        self.restore_transfers += parts
        model = getattr(self.copier, "seconds", None)
        return 0.0 if model is None else model(got.bytes_h2d, parts)

    def after_step(self, state: HybridStateManager) -> None:
        """Land the copies that finished, start saving what the step published."""
        tier, worker = self.tier, self.worker
        if worker is None:
            state.start_saves(tier, self.copier)
        else:
            self._land(state)

            def submit(kind, key, obj):
                worker.submit((kind, key, obj, state.hold_for_copy(obj)), obj)

            state.start_saves(tier, self.copier, submit)
        if tier.num_pending:
            tier.complete()

    def _land(self, state: HybridStateManager) -> None:
        for (kind, key, obj, stamps), data in self.worker.done():
            state.end_copy_hold(obj, stamps)
            self.tier.save(kind, key, data)

    def flush(self, state: HybridStateManager, timeout: float | None = 60.0) -> None:
        """Wait for every copy in flight and land it (before a device cache reset, which
        needs every hold dropped, and at shutdown)."""
        if self.worker is not None:
            self.worker.wait(timeout)
            self._land(state)
        if self.tier.num_pending:
            self.tier.complete()

    def close(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()

    def describe(self) -> dict:
        """The tier rules the engine runs (its record's `host_tier`)."""
        return {"capacity_bytes": self.tier.capacity_bytes, "poison": bool(self.tier.poison)}

    def describe_transfer(self) -> dict:
        """How copies move: a worker thread / CUDA stream, or the modelled host link."""
        worker = self.worker
        if worker is None:
            return {"copies": "engine_thread"}
        if hasattr(worker, "bandwidth_Bps"):
            return {"copies": "modelled", "link_bandwidth_Bps": worker.bandwidth_Bps,
                    "link_latency_s": worker.latency_s}
        return {"copies": "cuda_stream" if worker.gpu else "thread"}

    def counters(self) -> dict[str, int]:
        t = self.tier
        return {"tier_saves_started": t.saves_started, "tier_saves_completed": t.saves_completed,
                "tier_restores": t.restores, "tier_restored_tokens": t.restored_tokens,
                "tier_query_tokens": self.query_tokens,
                "tier_restore_failures": self.restore_failures,
                "tier_resume_restores": self.resume_restores,
                "tier_usage_bytes": t.used_bytes, "tier_capacity_bytes": t.capacity_bytes,
                "tier_entries": t.num_entries, "tier_evictions": t.evictions,
                "tier_evicted_bytes": t.evicted_bytes, "tier_rejected_saves": t.rejected_saves,
                "tier_skipped_saves": t.skipped_saves, "tier_bytes_h2d": t.bytes_h2d,
                "tier_bytes_d2h": t.bytes_saved}
