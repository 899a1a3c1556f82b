"""Decode attention read where the KV lies: over a block table's pages, no gathered copy.

A decode step has one query per sequence. Gathering each sequence's whole context into a
contiguous buffer first (index_select of its blocks) moves every KV byte twice more than
attention itself reads it, and was most of the paged decode step's overhead. Here each
block's K and V are views of their unit in the arena (`kv_view`, (units, block_tokens, 2,
KV heads, head dim), stored head-major: each head's K or V of a block is one contiguous
matrix); per sequence, scores are one matrix product per block into one row, one softmax
over the row, and the output accumulates one product per block (BLAS reads the views in
place).

Exactness: the same softmax(q k^T / sqrt(d)) v in fp32 as the contiguous path's fused
kernel, summed in a different order (per block rather than in the fused kernel's tiles),
so the two agree to fp32 rounding (relative ~1e-6), not bit for bit; greedy tokens still
equal transformers' (tests/test_reference_model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(q: torch.Tensor, kv_view: torch.Tensor, tables: list[list[int]],
                     lengths: list[int], scale: float) -> torch.Tensor:
    """One query per sequence q (b, 1, H, d) over its first `lengths[i]` tokens (the new
    token's K and V already stored), held in the units `tables[i]` (block order) of
    `kv_view` (units, block_tokens, 2, KVH, d). GQA: query head h reads KV head
    h // (H / KVH). Returns (b, 1, H d) in q's dtype.

    The host loop is the cost at small sizes, so each sequence runs few calls: the block
    scores are written by `bmm` straight into one row per head (no list, no concatenation),
    then one softmax, and the output accumulates one product per block."""
    b, _, heads, d = q.shape
    _, bt, _, kvh, _ = kv_view.shape
    rep = heads // kvh
    keys_t = kv_view[:, :, 0].permute(0, 2, 3, 1)  # (units, KVH, d, bt): K^T of each unit
    vals = kv_view[:, :, 1].transpose(1, 2)  # (units, KVH, bt, d)
    qs = (q.float() * scale).to(kv_view.dtype).view(b, kvh, rep, d).unbind(0)
    out = torch.empty(b, kvh, rep, d, dtype=kv_view.dtype, device=q.device)
    bmm = torch.bmm
    for qi, o, table, length in zip(qs, out.unbind(0), tables, lengths, strict=True):
        full = (length - 1) // bt  # whole blocks before the last one
        last = length - full * bt  # tokens in the last block
        s = torch.empty(kvh, rep, length, dtype=kv_view.dtype, device=q.device)
        for j in range(full):
            bmm(qi, keys_t[table[j]], out=s[..., j * bt : (j + 1) * bt])
        bmm(qi, keys_t[table[full]][..., :last], out=s[..., full * bt :])
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(kv_view.dtype)
        if not full:
            bmm(p, vals[table[0]][:, :last], out=o)
            continue
        bmm(p[..., :bt], vals[table[0]], out=o)
        for j in range(1, full):
            o.baddbmm_(p[..., j * bt : (j + 1) * bt], vals[table[j]])
        o.baddbmm_(p[..., full * bt :], vals[table[full]][:, :last])
    return out.view(b, 1, heads * d).to(q.dtype)


def fused_decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                           valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query per sequence q (b, 1, H, d) over K, V (b, KVH, S, d) (any strides, the
    query's own token included) in one fused kernel (torch's scaled_dot_product_attention,
    GQA without repeating K/V, no score matrix kept); valid (b, S) masks each row's padding
    (None: every position valid). Returns (b, 1, H d) in q's dtype: the gathered decode path
    of an accelerator, and the contiguous path's decode (FalconH1._decode_attention)."""
    b, _, heads, d = q.shape
    mask = None if valid is None else valid[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask, scale=scale,
        enable_gqa=heads != keys.shape[1],
    )  # (b, H, 1, d)
    return out.reshape(b, 1, heads * d)
