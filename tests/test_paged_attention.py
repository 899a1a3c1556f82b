"""Decode attention over KV pages in place equals attention over each sequence's context
written out contiguously (fp64 reference computed independently, with repeated KV heads),
and reads nothing but the sequence's own tokens."""

from __future__ import annotations

import pytest
import torch

from serving_core.model.paged_attention import decode_attention


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
