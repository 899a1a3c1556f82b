"""Callbacks through which memory organizations report what happens to state.

The engine's recorder implements these to write trace and slab ledgers; the
default sink ignores everything so the allocators can be used alone.
"""

from __future__ import annotations

from serving_core.memory.objects import StateObject


class MemoryEvents:
    """No-op sink; subclass and override what you record. `loss_reason` names what the
    organization is doing when it reports a loss (serving_core.lineage.END_CAUSES): `lru`
    unless it says otherwise around a slab reclaim, a large-page reclaim or a reset."""

    loss_reason = "lru"

    def on_publish(self, obj: StateObject) -> None:
        """obj was published under obj.key (attention block or checkpoint)."""

    def on_loss(self, obj: StateObject, cause_request: int) -> None:
        """A cached entry was invalidated because `cause_request`'s allocation took its storage."""

    def on_slab(
        self, event: str, page: int, slot: int, request_id: int, occupancy: int, invalidated: int
    ) -> None:
        """S2 slab lifecycle: SLAB_ALLOC, SLOT_ALLOC, SLOT_FREE, SLAB_RECLAIM,
        CROSS_INVALIDATE, SLAB_FREE."""
