"""vLLM's align-mode Mamba block lifecycle in N0's terms (engine.state_blocks=vllm_align).

vLLM 0.32, v1/core/single_type_kv_cache_manager.py `MambaManager` with
`mamba_cache_mode="align"`: a request's Mamba group holds one running-state block, the
block of the chunk's last token; a chunk whose end lies in a new block gets a new one
(`allocate_new_blocks`: the blocks in between are null), and a chunk that reaches the
prefill end also gets one prefill-checkpoint block at the last boundary inside it
(`get_mamba_prefill_checkpoint_position`, `is_mamba_prefill_checkpoint_valid`: the chunk
starts on a block boundary and the checkpoint lies at least a block past it). The
previous running-state block, the checkpoint block and the prefix-hit block are freed
at the request's next `allocate_slots` (`remove_skipped_blocks`), not when the step ends.
A block that fills is cached (`cache_blocks`): the states at chunk ends on a boundary and
the prefill checkpoints are what the prefix cache holds, cached when the chunk is
scheduled; a prefix hit on a state cached in the current step is refused until the next
(`cached_blocks_this_step`), and the prompt's last boundary is cached again while the
request still holds its state there (`_cache_partial_tail_block`). The hybrid manager's Mamba2
spec asks one checkpoint block with alignment 1 (`MambaMixer2.get_kv_cache_spec`).

Retention (`prefix_cache_retention_interval`, `reachable_block_mask`): every block (the
interval a block, N0's default), one boundary in k blocks, or none (0, vLLM's default);
the prompt's last boundary and the shared-prefix junction are always kept. Under
interval 0 only the chunk reaching the prefill end reserves a checkpoint block
(`get_num_blocks_to_allocate`'s `prefill_end`); otherwise any chunk may.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving_core.request import Request


def new_running_state(start: int, end: int, B: int) -> bool:
    """Whether the chunk [start, end) ends in a block its start's state is not in."""
    return -(-end // B) > -(-start // B)


@dataclass(frozen=True, slots=True)
class VllmStateBlocks:
    """The Mamba group's blocks of one request under vLLM's align mode, block B tokens,
    a checkpoint retained every `retention` blocks (0: only the reachable boundaries)."""

    B: int
    retention: int = 1

    def checkpoint(self, req: Request, start: int, end: int) -> int:
        """Position of the prefill checkpoint the chunk [start, end) writes, or 0: the last
        boundary below `end` when the chunk starts on a boundary and the boundary lies at
        least one block past its start (under retention 0 only a chunk reaching the
        prefill end: the prompt, or the known tokens less one on a resume)."""
        B = self.B
        if start % B or (not self.retention and end < max(req.num_prompt, req.num_tokens - 1)):
            return 0
        position = (end - 1) // B * B
        return position if start + B <= position < end else 0

    def retained(self, req: Request, boundary: int) -> bool:
        """Whether the state at `boundary` is cached: every k-th block boundary, the
        prompt's last boundary and the shared-prefix junction."""
        k = self.retention
        return ((k and boundary // self.B % k == 0) or boundary == req.junction
                or boundary == (req.num_prompt - 1) // self.B * self.B)

    def demand(self, req: Request, start: int, end: int) -> int:
        """Composites the chunk [start, end) allocates: a running state, a checkpoint."""
        return int(new_running_state(start, end, self.B) or not req.working) + int(
            self.checkpoint(req, start, end) > 0)

    def allocate(self, mem, req: Request, start: int, end: int) -> None:
        """Allocate the chunk's composites; the running state it replaces waits in `lagging`
        for the request's next allocation."""
        if new_running_state(start, end, self.B) or not req.working:
            if req.working:
                req.lagging.append(req.working)
            req.working = mem.allocate_composite(req.rid)
        if self.checkpoint(req, start, end):
            req.dests.append(mem.allocate_composite(req.rid))

    def published(self, req: Request, start: int, end: int) -> list[int]:
        """Boundaries whose state the chunk [start, end) writes: its checkpoint, its end."""
        return [b for b in (self.checkpoint(req, start, end), 0 if end % self.B else end) if b]

    def cached_at_scheduling(self, req: Request, start: int, end: int) -> list[int]:
        """Keys of the checkpoints vLLM caches when it schedules the chunk [start, end):
        the retained states it writes, and the prompt's last boundary when the chunk
        starts there (`_cache_partial_tail_block` keys it again)."""
        B = self.B
        last = (req.num_prompt - 1) // B * B
        marks = [b for b in self.published(req, start, end) if self.retained(req, b)]
        if start == last and last:
            marks.append(last)
        if not marks:
            return []
        keys = req.ensure_keys(max(marks) // B)
        return [keys[b // B - 1] for b in marks]
