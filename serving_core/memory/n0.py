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
# SSM state codecs vLLM's Mamba page stores (serving_core/state_codec.py): vLLM 0.32's
# mamba_ssm_cache_dtype (auto, float32, float16, bfloat16; config/cache.py MambaDType) and
# fp8_e4m3 (pull request 52962; MambaSpec's page is then the shapes' bytes at each dtype).
# fp16 with stochastic rounding (`--enable-mamba-cache-stochastic-rounding`, which vLLM 0.32
# accepts only with float16, config/vllm.py). int8 with per-head scales and bf16 with
# stochastic rounding have no vLLM form, so N0 refuses them.
N0_STATE_CODECS = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "fp16_sr")


def n0_layer_shape(geometry: Geometry) -> tuple[int, int, int]:
    """(one attention layer's KV bytes per token, the largest one-layer recurrent state,
    recurrent layers per storage group) as vLLM's allocator sees a model.

    vLLM pages every layer on its own: layers are grouped into KV-cache groups of equal
    size (one attention group per attention layer of the storage group, one Mamba group
    per recurrent layer), every Mamba page is padded to the one page size, and a request's
    recurrent state takes one page in each Mamba group. In the storage scope
    (serving_core/layer_pattern.py) that is one page per attention block and one page per
    recurrent layer of the group per checkpoint. For Falcon-H1 (one attention and one
    Mamba2 layer per group) this is the per-layer page as before.

    A storage group with several attention layers would take several pages per block;
    N0 refuses it (every preset has one attention layer per group).
    """
    g = geometry.scope_layers
    counts = geometry.state_layer_counts
    if counts["attention"] // g != 1:
        raise ValueError(f"org=n0 cannot hold model {geometry.name!r}: its storage group has "
                         f"{counts['attention'] // g} attention layers; N0 sizes one page "
                         "per attention block of one attention layer (allowed: 1)")
    kinds = [k for k in ("mamba2", "gdn", "mamba1") if counts[k]]
    state = max((sum(geometry.layer_state_bytes(k)) for k in kinds), default=0)
    return geometry.layer_kv_bytes_per_token, state, sum(counts[k] for k in kinds) // g


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
    An attention-only model keeps the default block of `alignment` tokens. Per layer
    (`n0_layer_shape`): the KV bytes of one attention layer, the state of one recurrent
    layer.
    """
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment={alignment!r} must be a positive integer (tokens)")
    if not geometry.has_recurrent:
        return alignment
    layer_kv, layer_state, _ = n0_layer_shape(geometry)
    per_block = alignment * layer_kv
    return alignment * math.ceil(layer_state / per_block)


def n0_layout(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> OrgLayout:
    """N0: one page size for attention and Mamba, as vLLM's hybrid allocator derives it.

    The attention page is `n0_block_tokens` x KV bytes per token; the composite is
    padded to that page (vLLM: "Padding mamba page size ... to ensure that mamba page
    size and attention page size are exactly equal"), so `recurrent_unit_bytes` is the
    page and `n0_padding_bytes` says how much of it the state leaves unused. Mamba
    prefix caching ("align" mode) keeps a state only at block boundaries, so the
    checkpoint interval is the block. A checkpoint takes one page per recurrent layer of
    the storage group (`n0_layer_shape`; one for Falcon-H1).
    """
    block = n0_block_tokens(geometry, alignment)
    rec = geometry.has_recurrent
    layer_kv, _, pages = n0_layer_shape(geometry) if rec else (
        geometry.attention_bytes_per_token, 0, 0)
    page = block * layer_kv
    return OrgLayout(org=N0UniformPages.org, block_tokens=block,
                     checkpoint_interval=block if rec else 0, page_bytes=page,
                     units_per_composite=pages, ssm_members=pages,
                     recurrent_unit_bytes=page)


def n0_padding_bytes(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> int:
    """Bytes of one N0 page a recurrent composite leaves unused (0 without recurrent state)."""
    if not geometry.has_recurrent:
        return 0
    layout = n0_layout(geometry, alignment)
    return layout.page_bytes * layout.units_per_composite - geometry.composite_bytes


class N0UniformPages(MemoryOrganization):
    org = "N0"
    conv_addressing = "unit"
    checkpoint_placement = "every_boundary"
    align_chunks = False

    @classmethod
    def unit_layout(cls, geometry: Geometry) -> OrgLayout:
        """`n0_layout` at the model's kernel block alignment (`n0_block_alignment`); a
        state codec vLLM's Mamba page has no dtype for (`N0_STATE_CODECS`) is refused."""
        if geometry.state_codec not in N0_STATE_CODECS:
            raise ValueError(f"org=n0 cannot hold model {geometry.name!r}: model.state_codec="
                             f"{geometry.state_codec!r}, allowed values are "
                             f"{', '.join(N0_STATE_CODECS)}")
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
