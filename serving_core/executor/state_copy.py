"""The copy port between a torch engine's state arena and a state tier.

A tier (serving_core.host_tier) holds entries by prefix key and never addresses device
memory: what it saves is read, and what it restores is written, through this port, called
by the state manager with the organization's objects (an attention block, a checkpoint
composite). Reads return device tensors the tier copies out; writes take host tensors and
count the bytes they move host-to-device. `poison` fills an object's units with NaN before
a restore writes them (the continuation audit: a byte the restore misses reads back NaN).
"""

from __future__ import annotations

import math

import torch

from serving_core.executor.state_arena import StateArena


class ArenaCopier:
    """Reads, writes and poisons published objects in one StateArena."""

    def __init__(self, arena: StateArena) -> None:
        self.arena = arena

    # ----- device -> tier ---------------------------------------------------------------------
    def snapshot_block(self, obj) -> torch.Tensor:
        """An attention block's KV over every layer, (layers, block_tokens, 2, KVH, hd)."""
        arena, unit = self.arena, obj.units[0]
        return torch.stack([arena.kv_view(layer)[unit] for layer in range(arena.layers)])

    def snapshot_checkpoint(self, obj) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A checkpoint's (conv, ssm) per layer in the arena's storage dtype."""
        dtype = self.arena.dtype
        return [(c.to(dtype), s.to(dtype)) for c, s in self.arena.read(obj)]

    # ----- tier -> device ---------------------------------------------------------------------
    def poison(self, obj) -> int:
        """Fill every unit `obj` owns (and an S2 conv slot) with NaN; returns the units."""
        arena = self.arena
        mem = arena.mem
        pool = arena.pools[obj.pool]
        for unit in obj.units:
            pool[:, unit].fill_(math.nan)
        if obj.kind and mem.has_slabs:  # the conv slot's line in its slab page
            arena.conv_slot(mem.conv_line(obj)).fill_(math.nan)
        return len(obj.units)

    def load_block(self, obj, data: torch.Tensor) -> int:
        """Write a block's saved KV (per layer) into `obj`'s unit; returns bytes moved."""
        arena, unit = self.arena, obj.units[0]
        moved = 0
        for layer in range(arena.layers):
            arena.kv_view(layer)[unit] = data[layer].to(arena.device, copy=True)
            moved += _nbytes(data[layer])
        return moved

    def load_checkpoint(self, obj, states: list) -> int:
        """Write a checkpoint's saved (conv, ssm) per layer into `obj`; returns bytes moved."""
        device = self.arena.device
        self.arena.write(obj, [(c.to(device, copy=True), s.to(device, copy=True))
                               for c, s in states])
        return sum(_nbytes(c) + _nbytes(s) for c, s in states)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
