"""N0 native uniform pages: vLLM's hybrid allocator, one page size for attention and Mamba.

The attention block is enlarged until one page holds a recurrent composite
(`n0_block_tokens`), the composite is padded to that page, and both draw
from one block pool: an attention block takes one page, a checkpoint takes one
page. A checkpoint is kept at block boundaries only, so the checkpoint interval
equals the block, and a lookup is a strict prefix match over whole blocks (the
last prompt token is always computed).

Engine rules (decided here, once): every_boundary placement with unaligned
chunks. On the GPU, vLLM's Mamba2 prefill kernel returns the state at every
block boundary inside a chunk (mid-prefill checkpoints requested by the layer's
cache spec), and those states are cached: that is a checkpoint at each boundary
a chunk crosses, whatever the chunk's length. (vLLM's block-aligned split of the
prefill, `_mamba_block_aligned_split`, matters where the kernel cannot return
intermediate states: its CPU path with this project's workaround, which the
n0_validate page compares request by request.) vLLM 0.32 by default also retains
only "semantic" Mamba checkpoints (`--prefix-cache-retention-interval 0`); N0
retains one at every block boundary, which is what
`--prefix-cache-retention-interval <block tokens>` gives there.
"""

from __future__ import annotations

import math

from serving_core.geometry import Geometry
from serving_core.layout import OrgLayout, PoolPlan
from serving_core.memory.base import MemoryOrganization

# Kernel block alignment of vLLM's attention backend. vLLM 0.32 FlashAttention (the A100
# arm) declares `[MultipleOf(16)]` and the default block is 16 tokens; its CPU backend
# declares `[MultipleOf(32)]` with a default block of 128, so the CPU alignment is
# max(32, 128) = 128 (platforms/cpu.py, check_and_update_config). A model's
# `n0_block_alignment` picks one per run.
N0_BLOCK_ALIGNMENT = 16
N0_CPU_BLOCK_ALIGNMENT = 128


def n0_block_tokens(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> int:
    """Attention block of vLLM's native hybrid page: the smallest multiple of `alignment`
    tokens whose per-layer KV bytes hold one recurrent composite.

    vLLM 0.32, platforms/interface.py `_align_hybrid_block_size`:
        attn_block_size = kernel_block_alignment_size * cdiv(
            mamba_page_size, kernel_block_alignment_size * attn_page_size_1_token)
    with kernel_block_alignment_size = max(smallest kernel block, cache block_size);
    `mamba_cache_mode == "align"` then sets mamba_block_size = block_size. (Earlier
    releases' mamba_cache_mode "all" rounded up to lcm(Mamba2 chunk, alignment) tokens
    instead: 1,792 for Falcon-H1, the unit of the paper's earlier uniform path.)
    An attention-only model keeps the default block of `alignment` tokens.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment={alignment!r} must be a positive integer (tokens)")
    if not geometry.has_recurrent:
        return alignment
    per_block = alignment * geometry.attention_bytes_per_token
    return alignment * math.ceil(geometry.composite_bytes / per_block)


def n0_layout(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> OrgLayout:
    """N0: one page size for attention and Mamba, as vLLM's hybrid allocator derives it.

    The attention page is `n0_block_tokens` x KV bytes per token; the composite is
    padded to that page (vLLM: "Padding mamba page size ... to ensure that mamba page
    size and attention page size are exactly equal"), so `recurrent_unit_bytes` is the
    page and `n0_padding_bytes` says how much of it the state leaves unused. Mamba
    prefix caching ("align" mode) keeps a state only at block boundaries, so the
    checkpoint interval is the block.
    """
    block = n0_block_tokens(geometry, alignment)
    page = block * geometry.attention_bytes_per_token
    rec = geometry.has_recurrent
    return OrgLayout(org=N0UniformPages.org, block_tokens=block,
                     checkpoint_interval=block if rec else 0, page_bytes=page,
                     units_per_composite=1 if rec else 0, ssm_members=1 if rec else 0,
                     recurrent_unit_bytes=page)


def n0_padding_bytes(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> int:
    """Bytes of one N0 page a recurrent composite leaves unused (0 without recurrent state)."""
    if not geometry.has_recurrent:
        return 0
    return n0_layout(geometry, alignment).page_bytes - geometry.composite_bytes


class N0UniformPages(MemoryOrganization):
    org = "N0"
    conv_addressing = "unit"
    checkpoint_placement = "every_boundary"
    align_chunks = False

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """`n0_layout` at the model's kernel block alignment (`n0_block_alignment`)."""
        return n0_layout(geometry, geometry.n0_block_alignment)

    @classmethod
    def plan_pools(cls, geometry: Geometry, layout: OrgLayout,
                   nominal_bytes: int) -> tuple[PoolPlan, ...]:
        """vLLM's block count for the same per-layer bytes, less its null block.

        vLLM 0.32, v1/core/kv_cache_utils.py `get_kv_cache_config_from_groups`:
        `num_blocks = available_memory // bytes_per_block`, bytes_per_block being the page
        times the layers of a group (the attention and Mamba groups alias the same
        tensors), so per layer it is floor(nominal / page); v1/core/block_pool.py then
        takes `self.null_block = self.free_block_queue.popleft()`, which no request gets.
        """
        page = layout.page_bytes
        total = nominal_bytes // page
        return (PoolPlan(cls.org, "shared", max(total - 1, 0), page, min(total, 1)),)
