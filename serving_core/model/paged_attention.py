"""Decode attention read where the KV lies: over a block table's pages, no gathered copy.

A decode step has one query per sequence. Gathering each sequence's whole context into a
contiguous buffer first (index_select of its blocks) moves every KV byte twice more than
attention itself reads it, and was most of the paged decode step's overhead. Here each
block's K and V are views of their unit in the arena (`kv_view`, (units, block_tokens, 2,
KV heads, head dim), stored head-major: each head's K or V of a block is one contiguous
matrix); per sequence, scores are one matrix product per block into the sequence's row of
one score buffer for the batch, one softmax over the whole buffer, and the output
accumulates one product per block (BLAS reads the views in place).

The host loop is the cost at small sizes, so what does not change between layers is built
once: the step's `DecodeLayout` (per sequence its pages and the column split of its score
row) and, per layer, the views of each unit's K^T and V (`UnitMatrices`, kept by the arena).
Per sequence and layer what remains is one product per page for the scores, one per page
for the output, and two column splits.

Exactness: the same softmax(q k^T / sqrt(d)) v in fp32 as the contiguous path's fused
kernel, summed in a different order (per block rather than in the fused kernel's tiles),
so the two agree to fp32 rounding (relative ~1e-6), not bit for bit; greedy tokens still
equal transformers' (tests/test_reference_model.py). Against the per-sequence loop it
replaced the bits are the same (tests/test_paged_attention.py keeps that loop as its
oracle): every product has the same shape, operands and accumulation order, and the batch's
softmax reads each row's columns past its length as -inf, whose exp is an exact 0 in the
row's sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serving_core.model import paged_loops


class UnitMatrices(dict):
    """Per unit of one layer's `kv_view`, its (K^T (KVH, d, bt), V (KVH, bt, d)) views,
    made on first use and kept (a unit's views never change: the arena never moves)."""

    def __init__(self, kv_view: torch.Tensor) -> None:
        super().__init__()
        self.keys_t = kv_view[:, :, 0].permute(0, 2, 3, 1)  # (units, KVH, d, bt)
        self.vals = kv_view[:, :, 1].transpose(1, 2)  # (units, KVH, bt, d)

    def __missing__(self, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self[unit] = (self.keys_t[unit], self.vals[unit])
        return pair


# A row shorter than this takes its own softmax when the batch's rows are padded: below
# the CPU kernel's vector width (16 fp32 lanes under AVX-512) the row's sum is reduced in
# another order than a longer row's, so -inf padding would change its bits; from the
# vector width on, it does not (checked for every length and padding up to 5,000 columns).
SHORT_ROW = 64


class DecodeLayout:
    """A decode batch's pages, the same for every layer of a step: per sequence its units
    (block order, `tables[i]` cut to its length) and the split of its score row into each
    page's columns (the last page's valid tokens, then the padding up to the batch's longest
    row); whether any row is padded, and which padded rows are short (`SHORT_ROW`)."""

    def __init__(self, tables: list[list[int]], lengths: list[int], block_tokens: int) -> None:
        bt = block_tokens
        self.width = max(lengths)
        self.padded = min(lengths) != self.width
        self.rows = []
        for table, length in zip(tables, lengths, strict=True):
            full = (length - 1) // bt  # whole blocks before the last one
            last = length - full * bt  # tokens in the last block
            pad = [self.width - length] if length < self.width else []
            self.rows.append((table[: full + 1], [bt] * full + [last] + pad, last))
        # the same pages flat for the compiled loops (paged_loops): row i's units are
        # units[starts[i]:starts[i + 1]], its last page holding lasts[i] tokens
        self.units = [u for table, _, _ in self.rows for u in table]
        self.starts = [0]
        for table, _, _ in self.rows:
            self.starts.append(self.starts[-1] + len(table))
        self.lasts = [last for _, _, last in self.rows]
        self.short = [(i, n) for i, n in enumerate(lengths)
                      if self.padded and n < min(SHORT_ROW, self.width)]
        self._key = None  # of the buffers made by the step's first layer

    def buffers(self, b: int, kvh: int, rep: int, dtype, device) -> tuple:
        """The step's score and probability buffers (b, KVH, rep, width), scores -inf where
        a row is padded, and per row their per-page column views: made on the first layer,
        reused by the others (each layer writes every valid score column before reading
        it, and the padding is never written)."""
        key = (b, kvh, rep, dtype, device)
        if self._key != key:
            shape = (b, kvh, rep, self.width)
            s = (torch.full(shape, -torch.inf, dtype=dtype, device=device) if self.padded
                 else torch.empty(shape, dtype=dtype, device=device))
            p = torch.empty_like(s)
            self._buffers = (s, p, *([r.split(split, -1) for r, (_, split, _)
                                      in zip(t.unbind(0), self.rows, strict=True)]
                                     for t in (s, p)))
            self._key = key
        return self._buffers


def decode_attention(q: torch.Tensor, kv_view: torch.Tensor, tables: list[list[int]],
                     lengths: list[int], scale: float, layout: DecodeLayout | None = None,
                     units: UnitMatrices | None = None) -> torch.Tensor:
    """One query per sequence q (b, 1, H, d) over its first `lengths[i]` tokens (the new
    token's K and V already stored), held in the units `tables[i]` (block order) of
    `kv_view` (units, block_tokens, 2, KVH, d). GQA: query head h reads KV head
    h // (H / KVH). Returns (b, 1, H d) in q's dtype. `layout` (of these tables and
    lengths) and `units` (of this kv_view) are built here when not given; a decode step
    passes the ones it keeps across layers."""
    b, _, heads, d = q.shape
    _, bt, _, kvh, _ = kv_view.shape
    rep = heads // kvh
    dtype = kv_view.dtype
    layout = layout or DecodeLayout(tables, lengths, bt)
    units = units if units is not None else UnitMatrices(kv_view)
    qs = (q.float() * scale).to(dtype).view(b, kvh, rep, d)
    s, p, s_cols, p_cols = layout.buffers(b, kvh, rep, dtype, q.device)
    compiled = paged_loops.loops() if q.device.type == "cpu" else None
    args = (layout.units, layout.starts, layout.lasts, bt)
    if compiled is not None:
        compiled.attention_scores(qs, units.keys_t, s, *args)
    else:
        _scores(qs.unbind(0), s_cols, layout, units)
    if dtype == torch.float32:
        torch.softmax(s, dim=-1, out=p)
    else:
        p.copy_(torch.softmax(s, dim=-1, dtype=torch.float32))
    for i, n in layout.short:  # the row alone, as long as it is (see SHORT_ROW)
        p[i, ..., :n] = torch.softmax(s[i, ..., :n], dim=-1, dtype=torch.float32)
    out = torch.empty(b, kvh, rep, d, dtype=dtype, device=q.device)
    if compiled is not None:
        compiled.attention_outputs(p, units.vals, out, *args)
    else:
        _outputs(out, p_cols, layout, units)
    return out.view(b, 1, heads * d).to(q.dtype)


def _scores(qs, s_cols, layout: DecodeLayout, units: UnitMatrices) -> None:
    """Per row, one product per page into its columns of the scores (the Python loop)."""
    bmm = torch.bmm
    for qi, cols, (table, _, last) in zip(qs, s_cols, layout.rows, strict=True):
        n = len(table) - 1
        for j in range(n):
            bmm(qi, units[table[j]][0], out=cols[j])
        bmm(qi, units[table[n]][0][..., :last], out=cols[n])


def _outputs(out, p_cols, layout: DecodeLayout, units: UnitMatrices) -> None:
    """Per row, the probabilities' product with each page's V, accumulated (Python loop)."""
    bmm = torch.bmm
    for o, cols, (table, _, last) in zip(out.unbind(0), p_cols, layout.rows, strict=True):
        n = len(table) - 1
        if not n:
            bmm(cols[0], units[table[0]][1][:, :last], out=o)
            continue
        bmm(cols[0], units[table[0]][1], out=o)
        for j in range(1, n):
            o.baddbmm_(cols[j], units[table[j]][1])
        o.baddbmm_(cols[n], units[table[n]][1][:, :last])


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
