"""An external (host) tier for published state: attention blocks and recurrent
checkpoints copied out of the device arenas by prefix key, and reloaded later.

Saving is two-phase: `save_published` starts a copy of every published entry the
tier does not hold yet; `complete` waits for the copies (a device sync on GPU) and
only then adds them to the index. An entry whose copy has not completed is never
restorable. `restore` reloads the deepest prefix the tier holds completely (every
attention block up to a checkpoint boundary, and that checkpoint) into freshly
allocated units of a (possibly reset) device and publishes it there, so the
scheduler's ordinary lookup finds and adopts it.

Audit hooks (the continuation check's byte audits):
- `poison`: before a restore writes a destination unit, the unit is filled with NaN,
  so any byte the restore misses reads back as NaN (and changes the tokens);
- `save_delay_s` with a `clock`: a started save stays incomplete until `clock()` has
  advanced by the delay. Its host buffer holds NaN until then (an in-flight copy has
  not landed), so restoring it early would show;
- every restore counts the bytes it copies host-to-device (`RestoreResult.bytes_h2d`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serving_core.executor.state_arena import StateArena
from serving_core.memory import MemoryOrganization


@dataclass
class RestoreResult:
    """What one restore put back: the restored prefix B (tokens), the new objects, the
    bytes copied host-to-device and the destination units it poisoned beforehand."""

    prefix_tokens: int
    blocks: list = field(default_factory=list)
    checkpoint: object = None
    bytes_h2d: int = 0
    poisoned_units: int = 0


@dataclass
class _Pending:
    kind: str  # "a" attention block | "c" checkpoint
    key: int
    data: object  # host buffer(s) the index will hold
    staged: object  # source snapshot still to land in `data` (delayed saves), else None
    ready_at: float


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True, non_blocking=True)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    """NaN of t's shape; packed TQ4 bytes (uint8): 0xFF, whose fp16 norms are NaN."""
    fill = math.nan if t.is_floating_point() else 0xFF
    return torch.full(t.shape, fill, dtype=t.dtype, device="cpu")


class HostTier:
    """Host copies of published entries, keyed by their chained prefix keys."""

    def __init__(self, *, poison: bool = True, save_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if save_delay_s < 0:
            raise ValueError(f"save_delay_s={save_delay_s} must be >= 0")
        self.blocks: dict[int, torch.Tensor] = {}  # key -> (layers, block_tokens, 2, KVH, hd)
        self.checkpoints: dict[int, list] = {}  # key -> per layer (conv, ssm)
        self._pending: list[_Pending] = []
        self._held: set[tuple[str, int]] = set()  # entries held or being copied
        self.poison = poison
        self.save_delay_s = float(save_delay_s)
        self.clock = clock
        self.saves_started = 0
        self.saves_completed = 0
        self.restores = 0
        self.restored_tokens = 0
        self.bytes_h2d = 0

    # ----- save -------------------------------------------------------------------------------
    def _stage(self, kind: str, key: int, snapshot, now: float) -> None:
        """Queue the copy of one entry. Without a delay the copy is issued now; with one,
        the host buffer stays NaN until `complete` lands the snapshot after the delay."""
        if not self.save_delay_s:
            data = (_host_copy(snapshot) if kind == "a"
                    else [(_host_copy(c), _host_copy(s)) for c, s in snapshot])
            self._pending.append(_Pending(kind, key, data, None, now))
            return
        data = (_nan_like(snapshot) if kind == "a"
                else [(_nan_like(c), _nan_like(s)) for c, s in snapshot])
        self._pending.append(_Pending(kind, key, data, snapshot, now + self.save_delay_s))

    def save_published(self, mem: MemoryOrganization, arena: StateArena) -> int:
        """Start copying every published entry not yet held; returns how many started."""
        held = self._held
        now = self.clock()
        started = 0
        for key, obj in mem.cache.attention.items():
            if ("a", key) not in held:
                unit = obj.units[0]
                snap = torch.stack([arena.kv_view(layer)[unit] for layer in range(arena.layers)])
                self._stage("a", key, snap, now)
                held.add(("a", key))
                started += 1
        for key, obj in mem.cache.checkpoints.items():
            if ("c", key) not in held:
                snap = [(c.to(arena.dtype), s.to(arena.dtype)) for c, s in arena.read(obj)]
                self._stage("c", key, snap, now)
                held.add(("c", key))
                started += 1
        self.saves_started += started
        return started

    def complete(self, device: torch.device | str = "cpu", now: float | None = None) -> int:
        """Wait for the started copies that are due (all, without a save delay), then
        index them; returns how many completed. The others stay pending: not restorable."""
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        now = self.clock() if now is None else now
        due = [p for p in self._pending if p.ready_at <= now]
        self._pending = [p for p in self._pending if p.ready_at > now]
        for p in due:
            if p.staged is not None:  # the delayed copy lands now
                if p.kind == "a":
                    p.data.copy_(p.staged)
                else:
                    for (c, s), (c0, s0) in zip(p.data, p.staged, strict=True):
                        c.copy_(c0)
                        s.copy_(s0)
            (self.blocks if p.kind == "a" else self.checkpoints)[p.key] = p.data
        self.saves_completed += len(due)
        return len(due)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

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

    def _poison(self, mem: MemoryOrganization, arena: StateArena, obj) -> int:
        """Fill every unit `obj` owns (and an S2 conv slot) with NaN; returns the units."""
        if not self.poison:
            return 0
        pool = arena.pools[obj.pool]
        for unit in obj.units:
            pool[:, unit].fill_(math.nan)
        if obj.kind and mem.has_slabs:  # the conv slot's line in its slab page
            arena.conv_slot(mem.conv_line(obj)).fill_(math.nan)
        return len(obj.units)

    def _to_device(self, t: torch.Tensor, arena: StateArena, result: RestoreResult):
        result.bytes_h2d += t.numel() * t.element_size()
        return t.to(arena.device, copy=True)

    def _write_block(self, arena: StateArena, unit: int, data: torch.Tensor,
                     result: RestoreResult) -> None:
        for layer in range(arena.layers):
            arena.kv_view(layer)[unit] = self._to_device(data[layer], arena, result)

    def _write_checkpoint(self, arena: StateArena, obj, states: list,
                          result: RestoreResult) -> None:
        arena.write(obj, [(self._to_device(c, arena, result), self._to_device(s, arena, result))
                          for c, s in states])

    def restore(self, mem: MemoryOrganization, arena: StateArena, keys: list[int]) -> RestoreResult:
        """Reload the deepest complete prefix of `keys` into freshly allocated units and
        publish it as cached entries (unreferenced, evictable) on that device. Entries the
        device still holds are kept (held during the restore so its allocations cannot
        evict them) and not copied again."""
        bt, interval = mem.block_tokens, mem.checkpoint_interval
        depth = self.restorable_prefix(keys, bt, interval)
        result = RestoreResult(depth)
        if not depth:
            return result
        nblocks = depth // bt
        held = [mem.cached_attention(keys[i]) for i in range(nblocks)]
        ckpt_key = keys[nblocks - 1]
        held_ckpt = mem.cached_checkpoint(ckpt_key) if interval else None
        kept = [o for o in (*held, held_ckpt) if o is not None]
        need = mem.demand(sum(o is None for o in held),
                          1 if interval and held_ckpt is None else 0)
        for obj in kept:
            mem.acquire(obj)
        try:
            if not mem.can_allocate(need):
                raise MemoryError(
                    f"restoring {depth} tokens needs {need} units; the device has "
                    f"{ {p: pool.num_available for p, pool in mem.pools.items()} }")
            for i in range(nblocks):
                if held[i] is not None:
                    continue
                obj = mem.allocate_attention(-1)
                result.poisoned_units += self._poison(mem, arena, obj)
                self._write_block(arena, obj.units[0], self.blocks[keys[i]], result)
                if not mem.publish(obj, keys[i], (i + 1) * bt):
                    raise RuntimeError(f"block {i} of the restored prefix is already cached")
                mem.release(obj)  # cached, evictable: the scheduler's lookup will adopt it
                result.blocks.append(obj)
            if interval and held_ckpt is None:
                obj = mem.allocate_composite(-1)
                result.poisoned_units += self._poison(mem, arena, obj)
                self._write_checkpoint(arena, obj, self.checkpoints[ckpt_key], result)
                if not mem.publish(obj, ckpt_key, depth):
                    raise RuntimeError(f"the checkpoint at {depth} is already cached")
                mem.release(obj)
                result.checkpoint = obj
        finally:
            for obj in kept:
                mem.release(obj)
        self.restores += 1
        self.restored_tokens += depth
        self.bytes_h2d += result.bytes_h2d
        return result


class EngineTier:
    """The host tier inside a serving engine (`EngineSpec.host_tier`, `--host-tier`).

    The engine calls `before_schedule` once arrivals entered the waiting queue and
    `after_step` once a step's states were written to their units. Before its first
    admission, a request whose prompt the tier holds deeper than the device's prefix
    cache gets that prefix restored (deepest complete boundary, see HostTier.restore),
    so the scheduler's ordinary lookup adopts exactly B tokens. After every step that
    changed the device cache, each newly published entry is saved (two-phase: started,
    then completed once its copy landed). `restored` maps request id -> B.
    """

    def __init__(self, tier: HostTier | None = None) -> None:
        self.tier = tier or HostTier()
        self.restored: dict[int, int] = {}
        self.query_tokens = 0  # prompt tokens looked up in the tier
        self.restore_failures = 0  # restores the device had no room for (recomputed)
        self._checked: set[int] = set()
        self._version = -1

    def before_schedule(self, engine) -> None:
        mem, tier = engine.mem, self.tier
        for req in engine.sched.waiting:
            if req.episodes or req.rid in self._checked:
                continue
            self._checked.add(req.rid)
            keys = req.lookup_keys()
            self.query_tokens += req.num_prompt
            device = mem.lookup(keys).jadopt
            if tier.restorable_prefix(keys, mem.block_tokens, mem.checkpoint_interval) <= device:
                continue
            try:
                got = tier.restore(mem, engine.executor.arena, keys)
            except MemoryError:
                self.restore_failures += 1
                continue
            self.restored[req.rid] = got.prefix_tokens

    def after_step(self, engine) -> None:
        mem, arena = engine.mem, engine.executor.arena
        if mem.cache.version != self._version:
            self.tier.save_published(mem, arena)
            self._version = mem.cache.version
        if self.tier.num_pending:
            self.tier.complete(arena.device)

    def counters(self) -> dict[str, int]:
        t = self.tier
        return {"tier_saves_started": t.saves_started, "tier_saves_completed": t.saves_completed,
                "tier_restores": t.restores, "tier_restored_tokens": t.restored_tokens,
                "tier_query_tokens": self.query_tokens,
                "tier_restore_failures": self.restore_failures}


def reset_device_cache(mem: MemoryOrganization) -> dict[str, int]:
    """Drop the device prefix cache: every cached, unreferenced entry is evicted through
    the allocator's own eviction path and its units freed. Returns the entries dropped and
    the cached units freed; raises RuntimeError when a cached entry is still referenced
    (a request holds it: the caller must wait until nothing runs)."""
    busy = [o for o in (*mem.cache.attention.values(), *mem.cache.checkpoints.values())
            if o.ref_count]
    if busy:
        raise RuntimeError(f"{len(busy)} cached entries are referenced by requests")
    entries = len(mem.cache.attention) + len(mem.cache.checkpoints)
    freed = mem.drop_cached()
    return {"entries": entries - len(mem.cache.attention) - len(mem.cache.checkpoints),
            "units": freed}
