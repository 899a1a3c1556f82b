"""Physical layout of each memory organization, derived from a Geometry.

One place says how big every allocation unit is, how many tokens an attention
block covers, where checkpoints fall, how many pages an SSM state spans and how
many conv slots a slab page holds. The planner, the storage accounting and the
runtime allocators all read it, so they cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving_core.geometry import Geometry

ORGS = ("S0", "S1", "S2", "D0", "N0")  # storage organizations (memory.ORG_TO_CLASS)
PAGED_BLOCK_TOKENS = 512  # attention block and checkpoint interval of S0/S1/S2
D0_BLOCK_TOKENS = 16  # attention unit of the native dual pools
D0_CHECKPOINT_INTERVAL = 1792  # native recurrent checkpoint interval of D0
HYBRID_PAGE_TOKEN_ROUNDING = 16  # uniform hybrid page rounds the composite to 16 tokens
# N0 (vLLM's native uniform page): kernel block alignment of the attention backend. vLLM
# 0.32 FlashAttention (the A100 arm) declares `[MultipleOf(16)]` and the default block is
# 16 tokens; its CPU backend declares `[MultipleOf(32)]` with a default block of 128, so
# the CPU alignment is max(32, 128) = 128 (platforms/cpu.py, check_and_update_config).
N0_BLOCK_ALIGNMENT = 16
N0_CPU_BLOCK_ALIGNMENT = 128


def normalize_org(org: str) -> str:
    """A storage organization's name, case-insensitive (s2 -> S2). Experiment arms
    (s2_retention, ...) are the runner's: ledgers.arms maps them to organizations."""
    key = str(org).strip().upper()
    if key not in ORGS:
        raise ValueError(f"org={org!r}: allowed values are {', '.join(ORGS)}")
    return key


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class OrgLayout:
    """Unit sizes of one organization under one geometry.

    For S0/S1/S2 every unit is a page of `page_bytes` in one shared pool.
    For D0 attention units and recurrent composites live in two static pools.
    For N0 an attention block and a (padded) composite each take one page of one pool.
    """

    org: str
    block_tokens: int  # tokens per attention block
    checkpoint_interval: int  # tokens between recurrent checkpoints (0: no recurrent state)
    page_bytes: int  # S0/S1/S2 page; D0 attention unit
    ssm_members: int  # pages an SSM state spans (S1/S2)
    conv_pages: int  # dedicated conv pages per composite (S1)
    conv_slot_bytes: int  # S2 conv slot
    slots_per_slab: int  # S2 slots in one slab page
    recurrent_unit_bytes: int  # D0 recurrent composite; S0 page holding a composite

    @property
    def pages_per_composite(self) -> int:
        """Whole pages one recurrent composite takes (S2 excludes its conv slot)."""
        if self.org in ("S0", "N0"):
            return 1 if self.checkpoint_interval else 0
        if self.org in ("S1", "S2"):
            return self.ssm_members + self.conv_pages
        return 0


def org_layout(geometry: Geometry, org: str) -> OrgLayout:
    org = normalize_org(org)
    tok = geometry.attention_bytes_per_token
    rec = geometry.has_recurrent
    if org == "N0":
        return n0_layout(geometry, geometry.n0_block_alignment)
    if org == "D0":
        return OrgLayout(
            org="D0",
            block_tokens=D0_BLOCK_TOKENS,
            checkpoint_interval=D0_CHECKPOINT_INTERVAL if rec else 0,
            page_bytes=D0_BLOCK_TOKENS * tok,
            ssm_members=0,
            conv_pages=0,
            conv_slot_bytes=0,
            slots_per_slab=0,
            recurrent_unit_bytes=geometry.composite_bytes,
        )
    attn_block_bytes = PAGED_BLOCK_TOKENS * tok
    interval = PAGED_BLOCK_TOKENS if rec else 0
    if org == "S0":
        page = max(attn_block_bytes, geometry.composite_bytes)
        return OrgLayout("S0", PAGED_BLOCK_TOKENS, interval, page, 0, 0, 0, 0, page)
    page = attn_block_bytes
    members = math.ceil(geometry.ssm_bytes / page) if rec else 0
    if org == "S1":
        return OrgLayout(
            "S1", PAGED_BLOCK_TOKENS, interval, page, members, 1 if rec else 0, 0, 0, 0
        )
    slot = _next_pow2(geometry.conv_bytes) if rec else 0
    if rec and slot > page:
        raise ValueError(f"conv state of {geometry.conv_bytes} B does not fit one {page}-B page")
    slots = page // slot if rec else 0
    return OrgLayout("S2", PAGED_BLOCK_TOKENS, interval, page, members, 0, slot, slots, 0)


def uniform_page_bytes(geometry: Geometry) -> int:
    """U: the recurrent composite in attention tokens, rounded up to 16 tokens, in bytes.

    An attention-only model has no composite; its U is one paged attention block.
    """
    tok = geometry.attention_bytes_per_token
    if not geometry.has_recurrent:
        return PAGED_BLOCK_TOKENS * tok
    tokens = math.ceil(geometry.composite_bytes / tok)
    tokens = math.ceil(tokens / HYBRID_PAGE_TOKEN_ROUNDING) * HYBRID_PAGE_TOKEN_ROUNDING
    return tokens * tok


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
    interval = block if geometry.has_recurrent else 0
    return OrgLayout("N0", block, interval, page, 1 if interval else 0, 0, 0, 0, page)


def n0_padding_bytes(geometry: Geometry, alignment: int = N0_BLOCK_ALIGNMENT) -> int:
    """Bytes of one N0 page a recurrent composite leaves unused (0 without recurrent state)."""
    if not geometry.has_recurrent:
        return 0
    return n0_layout(geometry, alignment).page_bytes - geometry.composite_bytes
