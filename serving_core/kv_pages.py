"""Attention over TQ4-packed KV pages (serving_core.kv_codec), without a dense cache.

A packed KV page view has shape (units, block_tokens, 2, kv_heads, bytes_per_vector), uint8:
K at index 0 and V at 1 of the third axis, each vector head_dim / 2 code bytes then its fp16
norm (kv_codec.TQ4Codec.pack). The torch executor serves `model.kv_codec=tq4` with these
(serving_core.executor.state_arena, torch_executor):

- `store` encodes new K/V rows into their (unit, offset) slots;
- `decode_attention` runs one query token per sequence page by page with an online softmax,
  in the rotated basis: scores q.k = (R q).(R k) read codebook values times norms, the value
  sum stays rotated and is rotated back once per head, so neither K nor V is rebuilt and at
  most one page of every sequence is decoded at a time;
- `prefill_attention` runs a chunk of new tokens causally over the cached prefix plus the
  chunk, rebuilding the prefix's K/V for `head_group` KV heads at a time (the bounded
  reconstruction of a long prefill), and reports the peak bytes of those temporaries.
"""

from __future__ import annotations

import math

import torch

from serving_core.kv_codec import TQ4Codec


def page_view(codec: TQ4Codec, units: int, block_tokens: int, kv_heads: int) -> torch.Tensor:
    """A zeroed packed KV page tensor (units, block_tokens, 2, kv_heads, bytes per vector)."""
    return torch.zeros(units, block_tokens, 2, kv_heads, codec.bytes_per_vector,
                       dtype=torch.uint8)


def _split(codec: TQ4Codec, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated-basis vectors |x| c[codes] of packed (..., bytes) as float32 (..., head_dim)."""
    return codec.decode_rotated(*codec.unpack(packed))


def decode_attention(q: torch.Tensor, view: torch.Tensor, codec: TQ4Codec,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One query token per sequence over its packed pages.

    q (B, q_heads, head_dim); block_table (B, max_pages) unit ids (any value past a
    sequence's pages); seq_lens (B,) cached tokens including the query's own key. Grouped
    query heads share their KV head (q_heads a multiple of kv_heads). Returns (B, q_heads,
    head_dim) float32.
    """
    b, hq, d = q.shape
    block, hkv = view.shape[1], view.shape[3]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qr = codec.rotate(q).view(b, hkv, group, d) * scale  # rotated once per head
    m = torch.full((b, hkv, group), -math.inf)
    denom = torch.zeros(b, hkv, group)
    acc = torch.zeros(b, hkv, group, d)
    pages = math.ceil(int(seq_lens.max()) / block)
    positions = torch.arange(block)
    for j in range(pages):
        units = block_table[:, j].clamp(0, view.shape[0] - 1)  # past the end: masked below
        kv = _split(codec, view[units])  # (B, block, 2, hkv, d): one page of each sequence
        valid = (j * block + positions)[None, :] < seq_lens[:, None]  # (B, block)
        # Slots past a sequence's end hold whatever the unit held before (another state's
        # bytes, NaN norms included): zero them so that 0 x NaN never reaches the sums.
        kv = torch.where(valid[:, :, None, None, None], kv, 0.0)
        k, v = kv[:, :, 0], kv[:, :, 1]
        scores = torch.einsum("bhgd,bthd->bhgt", qr, k)
        scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
        m_new = torch.maximum(m, scores.amax(-1))
        keep = torch.exp(m - m_new).nan_to_num(0.0)
        p = torch.exp(scores - m_new[..., None]).nan_to_num(0.0)
        denom = denom * keep + p.sum(-1)
        acc = acc * keep[..., None] + torch.einsum("bhgt,bthd->bhgd", p, v)
        m = m_new
    out = acc / denom[..., None]
    return codec.unrotate(out).view(b, hq, d)


QUERY_BLOCK = 512  # queries per score block of a prefill (bounds the score temporary)


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      view: torch.Tensor, codec: TQ4Codec, units: torch.Tensor, cached: int,
                      head_group: int | None = None, scale: float | None = None,
                      ) -> tuple[torch.Tensor, int]:
    """Causal attention of a chunk of n new tokens after `cached` tokens held in packed pages.

    q (n, q_heads, d); k_new, v_new (n, kv_heads, d): the chunk's own keys and values (the
    executor passes them decoded from what it stored, so every key the chunk reads is the
    one a later decode reads); units: the sequence's page ids in order. K/V are rebuilt
    `head_group` KV heads at a time (None: all heads at once): the group's (cached + n)
    float32 K and V operands, filled page by page (a page's decoded temporary is freed
    before the next). Returns (output (n, q_heads, d) float32, peak bytes held at once by
    those operands plus the largest page temporary).
    """
    n, hq, d = q.shape
    block, hkv = view.shape[1], view.shape[3]
    group = hq // hkv
    step = hkv if head_group is None else head_group
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= hkv:
        raise ValueError(f"head_group={head_group!r}: allowed values are 1..{hkv} or None")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = math.ceil(cached / block)
    total = cached + n
    out = torch.empty(n, hq, d)
    peak = 0
    for h0 in range(0, hkv, step):
        heads = slice(h0, min(h0 + step, hkv))
        g = heads.stop - heads.start
        k = torch.empty(total, g, d)
        v = torch.empty(total, g, d)
        page_temp = 0
        for j in range(pages):
            t0, t1 = j * block, min(cached, (j + 1) * block)
            kv = codec.decode(*codec.unpack(view[units[j], : t1 - t0, :, heads]))  # (t, 2, g, d)
            k[t0:t1], v[t0:t1] = kv[:, 0], kv[:, 1]
            page_temp = max(page_temp, kv.numel() * kv.element_size())
            del kv
        k[cached:], v[cached:] = k_new[:, heads], v_new[:, heads]
        peak = max(peak, k.numel() * k.element_size() + v.numel() * v.element_size() + page_temp)
        qh = q[:, heads.start * group:heads.stop * group].float().view(n, g, group, d)
        for s in range(0, n, QUERY_BLOCK):
            e = min(n, s + QUERY_BLOCK)
            span = cached + e
            scores = torch.einsum("nhgd,thd->hgnt", qh[s:e], k[:span]) * scale
            causal = torch.arange(span)[None, :] > (cached + torch.arange(s, e))[:, None]
            scores = scores.masked_fill(causal, -math.inf)
            o = torch.einsum("hgnt,thd->nhgd", scores.softmax(-1), v[:span])
            out[s:e, heads.start * group:heads.stop * group] = o.reshape(e - s, -1, d)
        del k, v
    return out, peak
