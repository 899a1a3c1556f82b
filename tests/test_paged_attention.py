"""Decode attention over KV pages in place equals attention over each sequence's context
written out contiguously (fp64 reference computed independently, with repeated KV heads),
and reads nothing but the sequence's own tokens."""

from __future__ import annotations

import pytest
import torch

from serving_core.model.paged_attention import DecodeLayout, UnitMatrices, decode_attention


def _reference(q, contexts, kvh):
    """softmax(q k^T / sqrt(d)) v per sequence in fp64, K/V heads repeated for GQA."""
    b, _, heads, d = q.shape
    rep = heads // kvh
    outs = []
    for i, (k, v) in enumerate(contexts):  # k, v (length, KVH, d)
        k = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, length, d)
        v = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
        s = torch.einsum("hd,hld->hl", q[i, 0].double(), k) / d ** 0.5
        outs.append(torch.einsum("hl,hld->hd", torch.softmax(s, -1), v).reshape(heads * d))
    return torch.stack(outs)[:, None]


@pytest.mark.parametrize("lengths", [[1, 7, 16], [16, 17, 33, 40], [48, 5]])
@pytest.mark.parametrize("heads,kvh", [(4, 2), (4, 4), (6, 1)])
def test_paged_decode_attention_equals_contiguous(lengths, heads, kvh):
    g = torch.Generator().manual_seed(sum(lengths) * heads + kvh)
    bt, d, units = 16, 8, 24
    pool = torch.randn(units, bt, 2, kvh, d, generator=g)
    order = torch.randperm(units, generator=g).tolist()  # blocks anywhere, out of order
    tables, contexts = [], []
    for n in lengths:
        nb = -(-n // bt)
        table, order = order[:nb], order[nb:]
        tables.append(table + [order[0]])  # a spare unit past the end is never read
        kv = torch.cat([pool[u] for u in table])[:n]
        contexts.append((kv[:, 0], kv[:, 1]))
    q = torch.randn(len(lengths), 1, heads, d, generator=g)
    before = pool.clone()
    out = decode_attention(q, pool, tables, lengths, d ** -0.5)
    assert out.shape == (len(lengths), 1, heads * d) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _reference(q, contexts, kvh), rtol=1e-5,
                               atol=1e-6)
    assert torch.equal(pool, before)  # read only


def test_tokens_past_the_length_do_not_count():
    """Poisoning the rest of the last block and the spare unit changes nothing."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(4, 16, 2, 2, 8, generator=g)
    q = torch.randn(1, 1, 4, 8, generator=g)
    a = decode_attention(q, pool, [[2, 0, 3]], [20], 8 ** -0.5)
    pool[0, 4:] = 1e4
    pool[3] = -1e4
    b = decode_attention(q, pool, [[2, 0, 3]], [20], 8 ** -0.5)
    assert torch.equal(a, b)
    pool[0, 3] = 5.0  # the last valid token does count
    assert not torch.equal(a, decode_attention(q, pool, [[2, 0, 3]], [20], 8 ** -0.5))


def _per_sequence(q, kv_view, tables, lengths, scale):
    """The loop the batched kernel replaced (one score row and one softmax per sequence):
    the bits the paged decode attention must keep."""
    b, _, heads, d = q.shape
    _, bt, _, kvh, _ = kv_view.shape
    rep = heads // kvh
    keys_t = kv_view[:, :, 0].permute(0, 2, 3, 1)
    vals = kv_view[:, :, 1].transpose(1, 2)
    qs = (q.float() * scale).to(kv_view.dtype).view(b, kvh, rep, d).unbind(0)
    out = torch.empty(b, kvh, rep, d, dtype=kv_view.dtype)
    for qi, o, table, length in zip(qs, out.unbind(0), tables, lengths, strict=True):
        full = (length - 1) // bt
        last = length - full * bt
        s = torch.empty(kvh, rep, length, dtype=kv_view.dtype)
        for j in range(full):
            torch.bmm(qi, keys_t[table[j]], out=s[..., j * bt : (j + 1) * bt])
        torch.bmm(qi, keys_t[table[full]][..., :last], out=s[..., full * bt :])
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(kv_view.dtype)
        if not full:
            torch.bmm(p, vals[table[0]][:, :last], out=o)
            continue
        torch.bmm(p[..., :bt], vals[table[0]], out=o)
        for j in range(1, full):
            o.baddbmm_(p[..., j * bt : (j + 1) * bt], vals[table[j]])
        o.baddbmm_(p[..., full * bt :], vals[table[full]][:, :last])
    return out.view(b, 1, heads * d).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[1, 9, 15, 16, 17, 63, 64, 65, 130], [70, 70, 70],
                                     [5, 5], [200, 3, 128, 64]])
def test_batched_rows_keep_the_per_sequence_bits(dtype, lengths):
    """One score buffer and one softmax for the batch (rows padded with -inf, short rows
    alone) give the per-sequence loop's bits, head-major units as the arena stores them,
    with the step's layout and unit views reused across calls as a decode step does."""
    g = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    bt, kvh, heads, d = 32, 2, 4, 64
    units = sum(-(-n // bt) for n in lengths) + 1
    pool = torch.randn(units, 2, kvh, bt, d, generator=g).to(dtype).permute(0, 3, 1, 2, 4)
    order = torch.randperm(units, generator=g).tolist()
    tables = []
    for n in lengths:
        nb = -(-n // bt)
        tables.append(order[:nb] + [order[-1]])
        order = order[nb:]
    layout, unit_views = DecodeLayout(tables, lengths, bt), UnitMatrices(pool)
    for _ in range(2):
        q = 3 * torch.randn(len(lengths), 1, heads, d, generator=g)
        want = _per_sequence(q, pool, tables, lengths, d ** -0.5)
        assert torch.equal(decode_attention(q, pool, tables, lengths, d ** -0.5), want)
        assert torch.equal(decode_attention(q, pool, tables, lengths, d ** -0.5, layout,
                                            unit_views), want)
