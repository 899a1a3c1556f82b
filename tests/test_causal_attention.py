"""A prompt's first segment attends in one causal call: the same bits as the masked
query blocks it replaces, across a block boundary and with grouped KV heads."""

import pytest
import torch
import torch.nn.functional as F

from serving_core.model.falcon_h1 import ATTENTION_QUERY_BLOCK, causal_attention


def _masked_blocks(q, k, v, scale):
    """The query-block path with explicit causal masks (c = 0)."""
    t, outs = q.shape[2], []
    for s in range(0, t, ATTENTION_QUERY_BLOCK):
        e = min(t, s + ATTENTION_QUERY_BLOCK)
        mask = torch.arange(e)[None, :] <= torch.arange(s, e)[:, None]
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e],
                                                   attn_mask=mask, scale=scale,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("t", [37, ATTENTION_QUERY_BLOCK + 88])
def test_first_segment_causal_call_equals_the_masked_blocks(t):
    g = torch.Generator().manual_seed(t)
    q = torch.randn(2, 4, t, 16, generator=g)
    k, v = (torch.randn(2, 2, t, 16, generator=g) for _ in range(2))
    out = causal_attention(q, k, v, 0, None, 0.25, True)
    assert torch.equal(out, _masked_blocks(q, k, v, 0.25))
    assert torch.equal(causal_attention(q, k, v, 0, torch.ones(2, 0, dtype=torch.bool), 0.25,
                                        True), out)
