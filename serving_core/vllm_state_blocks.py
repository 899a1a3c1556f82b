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
"""

from __future__ import annotations

from serving_core.request import Request


def prefill_checkpoint(req: Request, start: int, end: int, C: int) -> int:
    """Position of the prefill checkpoint the chunk [start, end) writes, or 0: the last
    boundary below `end` when the chunk reaches the prefill end (the prompt, or the known
    tokens less one on a resume), starts on a boundary and the boundary lies at least
    one block past its start."""
    if end < max(req.num_prompt, req.num_tokens - 1) or start % C:
        return 0
    position = (end - 1) // C * C
    return position if start + C <= position < end else 0


def new_running_state(start: int, end: int, C: int) -> bool:
    """Whether the chunk [start, end) ends in a block its start's state is not in."""
    return -(-end // C) > -(-start // C)


def vllm_state_demand(req: Request, start: int, end: int, C: int) -> int:
    """Composites the chunk [start, end) allocates: a running state, a prefill checkpoint."""
    return int(new_running_state(start, end, C) or not req.working) + int(
        prefill_checkpoint(req, start, end, C) > 0)


def allocate_vllm_state(mem, req: Request, start: int, end: int, C: int) -> None:
    """Allocate the chunk's composites; the running state it replaces waits in `lagging`
    for the request's next allocation."""
    if new_running_state(start, end, C) or not req.working:
        if req.working:
            req.lagging.append(req.working)
        req.working = mem.allocate_composite(req.rid)
    if prefill_checkpoint(req, start, end, C):
        req.dests.append(mem.allocate_composite(req.rid))


def cached_at_scheduling(req: Request, start: int, end: int, C: int) -> list[int]:
    """Keys of the checkpoints vLLM caches when it schedules the chunk [start, end): the
    state at its end on a boundary, its prefill checkpoint, and the prompt's last boundary
    when the chunk starts there (`_cache_partial_tail_block` keys it again)."""
    last = (req.num_prompt - 1) // C * C
    marks = [b for b in (0 if end % C else end, prefill_checkpoint(req, start, end, C),
                         last if start == last else 0) if b]
    if not marks:
        return []
    keys = req.ensure_keys(max(marks) // req.block_tokens)
    return [keys[b // req.block_tokens - 1] for b in marks]
