"""An external (host) tier for published state: attention blocks and recurrent
checkpoints copied out of the device arenas by prefix key, and reloaded later.

Saving is two-phase: `save_published` starts a copy of every published entry the
tier does not hold yet; `complete` waits for the copies (a device sync on GPU) and
only then adds them to the index. An entry whose copy has not completed is never
restorable. `restore` reloads the deepest prefix the tier holds completely (every
attention block up to a checkpoint boundary, and that checkpoint) into freshly
allocated units of a (possibly reset) device and publishes it there, so the
scheduler's ordinary lookup finds and adopts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from serving_core.executor.state_arena import StateArena
from serving_core.memory import MemoryOrganization


@dataclass
class RestoreResult:
    """What one restore put back: the restored prefix B (tokens) and the new objects."""

    prefix_tokens: int
    blocks: list = field(default_factory=list)
    checkpoint: object = None


class HostTier:
    """Host copies of published entries, keyed by their chained prefix keys."""

    def __init__(self) -> None:
        self.blocks: dict[int, torch.Tensor] = {}  # key -> (layers, block_tokens, 2, KVH, hd)
        self.checkpoints: dict[int, list] = {}  # key -> per layer (conv, ssm)
        self._pending: list[tuple[str, int, object]] = []
        self.saves_started = 0
        self.saves_completed = 0

    # ----- save -------------------------------------------------------------------------------
    def save_published(self, mem: MemoryOrganization, arena: StateArena) -> int:
        """Start copying every published entry not yet held; returns how many started."""
        held = {("a", k) for k in self.blocks} | {("c", k) for k in self.checkpoints}
        held |= {(kind, k) for kind, k, _ in self._pending}
        started = 0
        for key, obj in mem.cache.attention.items():
            if ("a", key) not in held:
                unit = obj.units[0]
                copy = torch.stack([arena.kv_view(layer)[unit] for layer in range(arena.layers)])
                self._pending.append(("a", key, copy.to("cpu", copy=True, non_blocking=True)))
                started += 1
        for key, obj in mem.cache.checkpoints.items():
            if ("c", key) not in held:
                states = [(c.to("cpu", copy=True, non_blocking=True),
                           s.to("cpu", copy=True, non_blocking=True))
                          for c, s in arena.read(obj)]
                self._pending.append(("c", key, states))
                started += 1
        self.saves_started += started
        return started

    def complete(self, device: torch.device | str = "cpu") -> int:
        """Wait for the started copies, then index them; returns how many completed."""
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        pending, self._pending = self._pending, []
        for kind, key, data in pending:
            (self.blocks if kind == "a" else self.checkpoints)[key] = data
        self.saves_completed += len(pending)
        return len(pending)

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

    def restore(self, mem: MemoryOrganization, arena: StateArena, keys: list[int]) -> RestoreResult:
        """Reload the deepest complete prefix of `keys` into freshly allocated units and
        publish it as cached entries (unreferenced, evictable) on that device."""
        bt, interval = mem.block_tokens, mem.checkpoint_interval
        depth = self.restorable_prefix(keys, bt, interval)
        result = RestoreResult(depth)
        if not depth:
            return result
        nblocks = depth // bt
        need = mem.demand(nblocks, 1 if interval else 0)
        if not mem.can_allocate(need):
            raise MemoryError(f"restoring {depth} tokens needs {need} units; the device has "
                              f"{ {p: pool.num_available for p, pool in mem.pools.items()} }")
        for i in range(nblocks):
            obj = mem.allocate_attention(-1)
            unit = obj.units[0]
            data = self.blocks[keys[i]]
            for layer in range(arena.layers):
                arena.kv_view(layer)[unit] = data[layer].to(arena.device)
            if not mem.publish(obj, keys[i], (i + 1) * bt):
                raise RuntimeError(f"block {i} of the restored prefix is already cached")
            mem.release(obj)  # cached, evictable: the scheduler's lookup will adopt it
            result.blocks.append(obj)
        if interval:
            key = keys[nblocks - 1]
            obj = mem.allocate_composite(-1)
            arena.write(obj, [(c.to(arena.device), s.to(arena.device))
                              for c, s in self.checkpoints[key]])
            if not mem.publish(obj, key, depth):
                raise RuntimeError(f"the checkpoint at {depth} is already cached")
            mem.release(obj)
            result.checkpoint = obj
        return result
