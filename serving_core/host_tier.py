"""An external (host) tier for published state: attention blocks and recurrent
checkpoints held by prefix key in host memory, saved from a device and restored later.

Two layers, on the model of a serving engine's offloading manager:
- `HostTier` is the store: which entries it holds, their host buffers, two-phase saves
  and the lookup of the deepest restorable prefix. It sees keys and tensors only: never
  a scheduler queue, the allocator or a device arena.
- `EngineTier` is one engine's link to a store: the engine calls `before_admission` with
  the requests that entered since its last step and `after_step` once a step's states are
  in their units; it asks the engine's state manager (serving_core.state_manager), which
  owns every allocation, publication and copy (through the executor's copy port,
  serving_core/executor/state_copy.py), to save the newly published entries and to
  restore a held prefix into fresh units before admission looks it up. The device cache
  is reset by the engine (`Engine.reset_prefix_cache`); the tier keeps what it holds.

Saving is two-phase: `save` starts a copy of one entry the tier does not hold yet;
`complete` waits for the copies (a device sync on GPU) and only then adds them to the
index. An entry whose copy has not completed is never restorable.

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
from dataclasses import dataclass

import torch

from serving_core.state_manager import BLOCK, HybridStateManager, RestoreResult


@dataclass
class _Pending:
    kind: str  # BLOCK | CHECKPOINT
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
    """Host copies of published entries, keyed by their chained prefix keys.

    What a state manager calls: `holds` and `save` (start a copy), `complete` (land the
    due copies), `restorable_prefix` (lookup), `entry` (a held copy, what a restore
    writes back), `record_restore` (counters) and the audit flag `poison`. The host
    buffers are `blocks` and `checkpoints` (key -> data; the continuation audit reads them).
    """

    def __init__(self, *, poison: bool = True, save_delay_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if save_delay_s < 0:
            raise ValueError(f"save_delay_s={save_delay_s} must be >= 0")
        self.blocks: dict[int, torch.Tensor] = {}  # key -> (layers, block_tokens, 2, KVH, hd)
        self.checkpoints: dict[int, list] = {}  # key -> per layer (conv, ssm)
        self._pending: list[_Pending] = []
        self._held: set[tuple[str, int]] = set()  # entries held or being copied
        self._sync = False  # a started copy came from a GPU: complete() syncs first
        self.poison = poison
        self.save_delay_s = float(save_delay_s)
        self.clock = clock
        self.saves_started = 0
        self.saves_completed = 0
        self.restores = 0
        self.restored_tokens = 0
        self.bytes_h2d = 0

    # ----- save -------------------------------------------------------------------------------
    def holds(self, kind: str, key: int) -> bool:
        """Whether the entry is held or being copied (a second save would duplicate it)."""
        return (kind, key) in self._held

    def save(self, kind: str, key: int, snapshot) -> None:
        """Start copying one entry: `snapshot` is its device state (a block's tensor, or a
        checkpoint's (conv, ssm) per layer). Without a delay the copy is issued now; with
        one, the host buffer stays NaN until `complete` lands the snapshot after the delay."""
        now = self.clock()
        if _on_cuda(snapshot):
            self._sync = True
        if not self.save_delay_s:
            data = (_host_copy(snapshot) if kind == BLOCK
                    else [(_host_copy(c), _host_copy(s)) for c, s in snapshot])
            self._pending.append(_Pending(kind, key, data, None, now))
        else:
            data = (_nan_like(snapshot) if kind == BLOCK
                    else [(_nan_like(c), _nan_like(s)) for c, s in snapshot])
            self._pending.append(_Pending(kind, key, data, snapshot, now + self.save_delay_s))
        self._held.add((kind, key))
        self.saves_started += 1

    def complete(self, now: float | None = None) -> int:
        """Wait for the started copies that are due (all, without a save delay), then
        index them; returns how many completed. The others stay pending: not restorable."""
        if self._sync:  # copies from a GPU were issued asynchronously
            torch.cuda.synchronize()
            self._sync = False
        now = self.clock() if now is None else now
        due = [p for p in self._pending if p.ready_at <= now]
        self._pending = [p for p in self._pending if p.ready_at > now]
        for p in due:
            if p.staged is not None:  # the delayed copy lands now
                if p.kind == BLOCK:
                    p.data.copy_(p.staged)
                else:
                    for (c, s), (c0, s0) in zip(p.data, p.staged, strict=True):
                        c.copy_(c0)
                        s.copy_(s0)
            (self.blocks if p.kind == BLOCK else self.checkpoints)[p.key] = p.data
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

    def entry(self, kind: str, key: int):
        """The host copy of a completed entry (what a restore writes back)."""
        return (self.blocks if kind == BLOCK else self.checkpoints)[key]

    def record_restore(self, result: RestoreResult) -> None:
        """Count one restore a state manager made from this tier."""
        self.restores += 1
        self.restored_tokens += result.prefix_tokens
        self.bytes_h2d += result.bytes_h2d


class EngineTier:
    """One engine's link to a host tier (`EngineSpec.host_tier`, `--host-tier`).

    Before its first admission, a request whose prompt the tier holds deeper than the
    device's prefix cache gets that prefix restored (deepest complete boundary, see
    HybridStateManager.restore_prefix), so the scheduler's ordinary lookup adopts exactly
    B tokens. After every step that changed the device cache, each newly published entry
    is saved (two-phase: started, then completed once its copy landed). `restored` maps
    request id -> B. Every call goes through the engine's state manager and this
    engine's copy port (`copier`, over its arena); the link holds no device state.
    """

    def __init__(self, tier: HostTier, copier) -> None:
        self.tier = tier
        self.copier = copier
        self.restored: dict[int, int] = {}
        self.query_tokens = 0  # prompt tokens looked up in the tier
        self.restore_failures = 0  # restores the device had no room for (recomputed)
        self._version = -1  # the device cache version last saved from

    def before_admission(self, state: HybridStateManager, requests) -> None:
        """Restore held prefixes for `requests` (entered, never admitted), in order."""
        tier = self.tier
        for req in requests:
            keys = req.lookup_keys()
            self.query_tokens += req.num_prompt
            held = tier.restorable_prefix(keys, state.B, state.C)
            if held <= state.peek(req).jadopt:
                continue
            try:
                got = state.restore_prefix(keys, tier, self.copier)
            except MemoryError:
                self.restore_failures += 1
                continue
            self.restored[req.rid] = got.prefix_tokens

    def after_step(self, state: HybridStateManager) -> None:
        """Save what the step published (when the device cache changed), land due copies."""
        if state.cache_version != self._version:
            state.save_published(self.tier, self.copier)
            self._version = state.cache_version
        if self.tier.num_pending:
            self.tier.complete()

    def counters(self) -> dict[str, int]:
        t = self.tier
        return {"tier_saves_started": t.saves_started, "tier_saves_completed": t.saves_completed,
                "tier_restores": t.restores, "tier_restored_tokens": t.restored_tokens,
                "tier_query_tokens": self.query_tokens,
                "tier_restore_failures": self.restore_failures}


def _on_cuda(snapshot) -> bool:
    """Whether a block tensor or a checkpoint's (conv, ssm) list lives on a GPU."""
    first = snapshot if isinstance(snapshot, torch.Tensor) else snapshot[0][0]
    return first.device.type == "cuda"
