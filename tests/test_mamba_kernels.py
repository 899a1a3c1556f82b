"""The fast kernels of the real path against independent formulations.

- `mamba.chunk_scan` (group-stacked matrix products, chunk loop) against the one-token
  recurrence run token by token and against transformers' formulation
  (`chunk_scan_reference`): outputs and final state within 2e-5 relative to the output's
  scale (fp32 rounding: the sums are reordered, nothing else differs), for segment lengths
  that are and are not multiples of the chunk, one and two groups, several chunk sizes;
- decode attention (fused, GQA without repeating K/V, padding masked) against an explicit
  per-sequence softmax over each sequence's own prefix;
- the `executor.scan_chunk` key is checked (one line naming the field).
"""

from __future__ import annotations

import math

import pytest
import torch

from serving_core.executor.torch_config import torch_executor_config
from serving_core.model import mamba

TOL = 2e-5


def _inputs(b, t, h, p, g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, p, generator=gen)
    dt = mamba.discretize_dt(torch.randn(b, t, h, generator=gen),
                             0.5 * torch.randn(h, generator=gen), (0.0, math.inf))
    A = -torch.exp(torch.randn(h, generator=gen))
    B = torch.randn(b, t, g, n, generator=gen)
    C = torch.randn(b, t, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    init = torch.randn(b, h, p, n, generator=gen)
    return x, dt, A, B, C, D, init


def _recurrence(x, dt, A, B, C, D, init):
    state = init.clone()
    ys = [mamba.state_update(state, x[:, i], dt[:, i], A, B[:, i], C[:, i], D)
          for i in range(x.shape[1])]
    return torch.stack(ys, 1), state


@pytest.mark.parametrize("t,chunk,g", [(100, 32, 2), (96, 32, 1), (7, 128, 1), (300, 128, 1),
                                       (300, 64, 2)])
def test_chunk_scan_equals_the_recurrence_and_the_reference(t, chunk, g):
    args = _inputs(2, t, 4, 8, g, 16, seed=t + chunk)
    x, dt, A, B, C, D, init = args
    y, final = mamba.chunk_scan(x, dt, A, B, C, D, chunk, init)
    y_rec, final_rec = _recurrence(*args)
    y_ref, final_ref = mamba.chunk_scan_reference(x, dt, A, B, C, D, chunk, init)
    scale, s_scale = y_rec.abs().max(), final_rec.abs().max()
    assert y.shape == y_rec.shape and final.shape == final_rec.shape
    assert (y - y_rec).abs().max() <= TOL * scale
    assert (final - final_rec).abs().max() <= TOL * s_scale
    assert (y - y_ref).abs().max() <= TOL * scale
    assert (final - final_ref).abs().max() <= TOL * s_scale


def test_strong_decay_cut_to_zero_below_the_floor_changes_nothing_visible():
    """dt |A| ~ 16 per token (the tiny model's fastest heads): decays underflow within a
    chunk; the scan zeroes exponents below EXP_FLOOR and still equals the recurrence."""
    x, dt, A, B, C, D, init = _inputs(1, 200, 4, 8, 1, 16, seed=9)
    A = -torch.tensor([1.0, 4.0, 8.0, 12.0])
    dt = dt + 1.0
    y, final = mamba.chunk_scan(x, dt, A, B, C, D, 128, init)
    y_rec, final_rec = _recurrence(x, dt, A, B, C, D, init)
    assert (y - y_rec).abs().max() <= TOL * y_rec.abs().max()
    assert (final - final_rec).abs().max() <= TOL * final_rec.abs().max()


def test_chunk_size_changes_only_rounding():
    x, dt, A, B, C, D, init = _inputs(1, 257, 6, 8, 1, 32, seed=5)
    y64, f64 = mamba.chunk_scan(x, dt, A, B, C, D, 64, init)
    y257, f257 = mamba.chunk_scan(x, dt, A, B, C, D, 257, init)
    assert (y64 - y257).abs().max() <= TOL * y64.abs().max()
    assert (f64 - f257).abs().max() <= TOL * f64.abs().max()


def test_decode_attention_masks_padding_and_shares_kv_heads(tiny_model):
    m = tiny_model
    gen = torch.Generator().manual_seed(3)
    b, s = 3, 40
    lengths = [40, 17, 1]
    q = torch.randn(b, 1, m.heads, m.head_dim, generator=gen)
    keys = torch.randn(b, m.kv_heads, s, m.head_dim, generator=gen)
    vals = torch.randn(b, m.kv_heads, s, m.head_dim, generator=gen)
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]
    out = m._decode_attention(q, keys, vals, valid).view(b, m.heads, m.head_dim)
    rep = m.heads // m.kv_heads
    for i, n in enumerate(lengths):
        for h in range(m.heads):
            k, v = keys[i, h // rep, :n], vals[i, h // rep, :n]
            w = torch.softmax((k @ q[i, 0, h]) / math.sqrt(m.head_dim), 0)
            assert torch.allclose(out[i, h], w @ v, atol=1e-5, rtol=1e-5)
    # Garbage in the padding does not matter.
    keys[1, :, 17:] = 1e4
    again = m._decode_attention(q, keys, vals, valid).view(b, m.heads, m.head_dim)
    assert torch.allclose(again, out, atol=1e-6)


def test_scan_chunk_key_is_checked():
    base = {"checkpoint": "x", "kind": "torch"}
    assert torch_executor_config(base).scan_chunk == 128
    assert torch_executor_config({**base, "scan_chunk": 64}).scan_chunk == 64
    for bad in (0, -1, "64", True):
        with pytest.raises(ValueError, match="executor.scan_chunk"):
            torch_executor_config({**base, "scan_chunk": bad})


@pytest.mark.parametrize("b,t,bias", [(1, 37, True), (3, 5, False), (2, 1, True)])
def test_conv_scan_equals_conv1d_and_the_one_token_steps(b, t, bias):
    """The token-major prefill conv against torch's conv1d over the channel-major sequence
    and against its own one-token (decode) path run token by token; the carried window is
    the last K-1 inputs."""
    gen = torch.Generator().manual_seed(b * 100 + t)
    cd, k = 24, 4
    window, xbc = torch.randn(b, cd, k - 1, generator=gen), torch.randn(b, t, cd, generator=gen)
    weight = torch.randn(cd, k, generator=gen)
    bias_v = torch.randn(cd, generator=gen) if bias else None
    y, new = mamba.conv_scan(window, xbc, weight, bias_v)
    full = torch.cat([window, xbc.transpose(1, 2)], dim=-1)
    ref = torch.nn.functional.conv1d(full, weight[:, None], bias_v, groups=cd)
    ref = torch.nn.functional.silu(ref).transpose(1, 2)
    assert y.shape == (b, t, cd) and new.shape == (b, cd, k - 1)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(new, full[:, :, -(k - 1):])
    win, steps = window, []
    for i in range(t):
        out, win = mamba.conv_scan(win, xbc[:, i : i + 1], weight, bias_v)
        steps.append(out)
    assert (torch.cat(steps, 1) - y).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(win, new)
