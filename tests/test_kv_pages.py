"""Attention over TQ4-packed KV pages (serving_core.kv_pages) against a dense reference.

The reference decodes every cached vector with the codec and runs plain softmax attention
over the whole materialized cache; the page-native paths must agree with it to float32
rounding, whatever the page boundaries, the head grouping or the reconstruction group.
"""

from __future__ import annotations

import math

import pytest
import torch

from serving_core import kv_pages
from serving_core.kv_codec import TQ4Codec

HQ, HKV, D, BLOCK = 4, 2, 64, 16


def _reference(q, k, v, mask=None):
    """Plain attention, GQA by repeating KV heads: q (n, hq, d), k/v (t, hkv, d)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,thd->hnt", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)


def _filled(lengths, seed=0, key_scale=3.0):
    """A page view holding sequences of `lengths` tokens on scattered pages."""
    gen = torch.Generator().manual_seed(seed)
    codec = TQ4Codec(D)
    pages = [math.ceil(n / BLOCK) for n in lengths]
    view = kv_pages.page_view(codec, sum(pages) + 3, BLOCK, HKV)
    order = torch.randperm(view.shape[0], generator=gen)  # pages anywhere in the pool
    table = torch.full((len(lengths), max(pages)), 10_000, dtype=torch.long)
    kvs, at = [], 0
    for i, n in enumerate(lengths):
        units = order[at:at + pages[i]]
        at += pages[i]
        table[i, :pages[i]] = units
        k = torch.randn(n, HKV, D, generator=gen) * key_scale
        v = torch.randn(n, HKV, D, generator=gen)
        pos = torch.arange(n)
        # the packed write StateArena.store_kv does
        view[units[pos // BLOCK], pos % BLOCK] = codec.encode_packed(torch.stack([k, v], dim=1))
        kvs.append((k, v, units))
    return codec, view, table, kvs


def test_store_writes_the_codec_packing():
    codec, view, _, kvs = _filled([20])
    k, v, units = kvs[0]
    assert torch.equal(view[units[1], 3, 0], codec.encode_packed(k[BLOCK + 3]))
    assert torch.equal(view[units[0], 5, 1], codec.encode_packed(v[5]))


def test_decode_attention_equals_dense_attention_on_decoded_cache():
    lengths = [1, 16, 17, 50]
    codec, view, table, kvs = _filled(lengths)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(4))
    out = kv_pages.decode_attention(q, view, codec, table, torch.tensor(lengths))
    for i, (k, v, _) in enumerate(kvs):
        kd, vd = codec.decode(*codec.encode(k)), codec.decode(*codec.encode(v))
        want = _reference(q[i:i + 1], kd, vd)[0]
        torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-5)


def test_decode_attention_stays_near_full_precision():
    """Loosely bounded: TQ4 attention outputs against the uncompressed ones, at unit-variance
    keys and values (a sharper softmax amplifies the codec's score error)."""
    lengths = [64, 64, 200]
    codec, view, table, kvs = _filled(lengths, seed=1, key_scale=1.0)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(5))
    out = kv_pages.decode_attention(q, view, codec, table, torch.tensor(lengths))
    full = torch.stack([_reference(q[i:i + 1], k, v)[0] for i, (k, v, _) in enumerate(kvs)])
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), full.flatten(1))
    assert (cos > 0.97).all(), cos


@pytest.mark.parametrize("group", [1, 2, None])
def test_prefill_groups_agree_and_bound_the_temporaries(group):
    cached, n = 37, 9
    codec, view, _, kvs = _filled([cached], seed=2)
    k, v, units = kvs[0]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(n, HQ, D, generator=gen)
    k_new, v_new = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    out, peak = kv_pages.prefill_attention(q, k_new, v_new, view, codec, units, cached, group)
    kd, vd = codec.decode(*codec.encode(k)), codec.decode(*codec.encode(v))
    mask = torch.ones(n, cached + n, dtype=torch.bool).tril(cached)
    want = _reference(q, torch.cat([kd, k_new]), torch.cat([vd, v_new]), mask)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    heads = HKV if group is None else group
    # K and V of `heads` heads for prefix and chunk, plus one page's decoded K/V, float32
    assert peak == (cached + n) * 2 * heads * D * 4 + BLOCK * 2 * heads * D * 4


def test_prefill_rejects_a_bad_group():
    codec, view, _, kvs = _filled([8])
    q = torch.zeros(1, HQ, D)
    with pytest.raises(ValueError, match="head_group=3"):
        kv_pages.prefill_attention(q, torch.zeros(1, HKV, D), torch.zeros(1, HKV, D), view,
                                   codec, kvs[0][2], 8, 3)


def test_prefill_without_a_prefix_and_across_query_blocks(monkeypatch):
    """cached = 0 reads no page; query blocks smaller than the chunk change nothing."""
    codec, view, _, _ = _filled([8])
    gen = torch.Generator().manual_seed(9)
    n = 11
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    want = _reference(q, k, v, mask)
    out, peak = kv_pages.prefill_attention(q, k, v, view, codec, torch.zeros(0, dtype=torch.long),
                                           0, 1)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert peak == n * 2 * 1 * D * 4  # no page temporary
    monkeypatch.setattr(kv_pages, "QUERY_BLOCK", 4)
    blocked, _ = kv_pages.prefill_attention(q, k, v, view, codec,
                                            torch.zeros(0, dtype=torch.long), 0, None)
    torch.testing.assert_close(blocked, want, rtol=1e-4, atol=1e-5)


def test_decode_ignores_whatever_lies_past_a_sequence():
    """Slots past a sequence's end (and padding pages) may hold any bytes, NaN norms
    included (a unit's previous owner): the result equals the clean pool's."""
    lengths = [5, 21]
    codec, view, table, kvs = _filled(lengths, seed=4)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(8))
    clean = kv_pages.decode_attention(q, view, codec, table, torch.tensor(lengths))
    dirty = view.clone()
    nan_row = codec.pack(torch.zeros(HKV, D // 2, dtype=torch.uint8),
                         torch.full((HKV,), math.nan, dtype=torch.float16))
    for i, n in enumerate(lengths):
        for pos in range(n, table.shape[1] * BLOCK):
            page = table[i, pos // BLOCK]
            if page < dirty.shape[0]:
                dirty[page, pos % BLOCK] = nan_row
    used = set(table[table < dirty.shape[0]].tolist())
    for unit in set(range(dirty.shape[0])) - used:
        dirty[unit] = nan_row
    table = table.clamp(max=0) + table * (table < dirty.shape[0])  # padding -> unit 0
    got = kv_pages.decode_attention(q, dirty, codec, table, torch.tensor(lengths))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, clean, rtol=1e-5, atol=1e-6)
