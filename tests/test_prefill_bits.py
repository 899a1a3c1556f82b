"""The prefill's faster kernels give the bits of the code they replaced (87cd36f), kept
here as the oracle: the decay exponential (`mamba._decay_`, exponents clamped at the floor
instead of set to -inf) on every float near the floor; the SSD scan, whole, split by heads
over the worker (C.B computed once, in chunk halves) and writing its final state over the
initial one; the conv and the gated norm by token halves over the worker; prefill attention
with its kept additive causal mask instead of a boolean one per call."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from serving_core.model import mamba, split
from serving_core.model.falcon_h1 import FalconH1, causal_attention


@pytest.fixture
def worker():
    split.install(1)
    yield
    split.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _old_decay_(x: torch.Tensor) -> torch.Tensor:
    return F.threshold_(x, mamba.EXP_FLOOR, -torch.inf).exp_()


def _old_chunk_scan(x, dt, A, B, C, D, chunk, initial):
    """mamba.chunk_scan as of 87cd36f (its decay exponential included)."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    d_res, xdt, Adt, B, C = mamba.scan_inputs(x, dt, A, B, C, D, chunk)
    nc, ln = xdt.shape[1], chunk
    Ah = Adt.permute(0, 1, 3, 2).contiguous()
    A_cum = torch.cumsum(Ah, dim=-1)
    upper = torch.ones(ln, ln, dtype=torch.bool).triu_(1)
    Lt = _old_decay_(torch.where(upper, Ah[..., None, :], 0.0).cumsum_(dim=-1))
    Bg, Cg = B.permute(0, 1, 3, 2, 4), C.permute(0, 1, 3, 2, 4)
    CBt = torch.matmul(Bg, Cg.transpose(-1, -2)).triu_()
    Mt = Lt.view(b, nc, g, hg, ln, ln).mul_(CBt[:, :, :, None]).view(b, nc, h, ln, ln)
    y_diag = torch.matmul(Mt.transpose(-1, -2), xdt.permute(0, 1, 3, 2, 4))
    decay = _old_decay_(A_cum[..., -1:] - A_cum)
    xd = (xdt * decay.transpose(-1, -2)[..., None]).view(b, nc, ln, g, hg * p)
    states = torch.empty(b, nc + 1, g, hg * p, n)
    states[:, 0] = initial.reshape(b, g, hg * p, n)
    for i in range(b):
        torch.matmul(xd.permute(0, 1, 3, 4, 2)[i], Bg[i], out=states[i, 1:])
    last = _old_decay_(A_cum[..., -1].clone()).view(b, nc, g, hg, 1, 1)
    for k in range(nc):
        states[:, k + 1].view(b, g, hg, p, n).addcmul_(states[:, k].view(b, g, hg, p, n),
                                                      last[:, k])
    y_off = torch.empty(b, nc, g, ln, hg * p)
    for i in range(b):
        torch.matmul(Cg[i], states[i, :nc].transpose(-1, -2), out=y_off[i])
    y = y_off.permute(0, 1, 3, 2, 4).reshape(b, nc, ln, h, p)
    y = y.mul_(_old_decay_(A_cum).transpose(-1, -2)[..., None])
    y = y.add_(y_diag.permute(0, 1, 3, 2, 4))
    return y.reshape(b, nc * ln, h, p)[:, :t] + d_res, states[:, nc].reshape(b, h, p, n)


def _floats_between(lo: float, hi: float) -> torch.Tensor:
    ends = sorted(torch.tensor([lo, hi]).view(torch.int32).tolist())
    return torch.arange(ends[0], ends[1] + 1, dtype=torch.int32).view(torch.float32)


def test_decay_equals_the_exp_of_minus_inf_below_the_floor():
    near = _floats_between(mamba.EXP_FLOOR - 1, mamba.EXP_FLOOR + 1)  # every float: 786,433
    gen = torch.Generator().manual_seed(0)
    mixed = -200 * torch.rand(50_001, generator=gen)
    mixed[::7], mixed[::11], mixed[::13] = 0.0, -torch.inf, math.nan
    for x in (near, near.flip(0), mixed, mixed[3:40]):
        assert torch.equal(_bits(mamba._decay_(x.clone())), _bits(_old_decay_(x.clone())))


def _scan_inputs(b, t, h, p, g, n, strong, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, p, generator=gen)
    dt = mamba.discretize_dt(torch.randn(b, t, h, generator=gen) + 3 * strong,
                             0.5 * torch.randn(h, generator=gen), (0.0, math.inf))
    A = -torch.exp(torch.randn(h, generator=gen) + 2 * strong)
    B, C = (torch.randn(b, t, g, n, generator=gen) for _ in "BC")
    return x, dt, A, B, C, torch.randn(h, generator=gen), torch.randn(b, h, p, n, generator=gen)


# (b, t, h, p, g, n, chunk, strong decay): the tiny Falcon-H1's mixer (12 x 64, N 512) at a
# ragged last chunk, Granite's tiny shapes, several groups, chunks of 1 and 3 tokens
SCANS = [(1, 300, 12, 64, 1, 512, 128, True), (1, 200, 8, 32, 1, 64, 128, False),
         (2, 130, 8, 16, 2, 32, 64, True), (3, 96, 8, 8, 4, 16, 32, False),
         (1, 5, 4, 8, 1, 16, 1, True), (2, 70, 4, 8, 1, 16, 3, False)]


@pytest.mark.parametrize(("b", "t", "h", "p", "g", "n", "chunk", "strong"), SCANS)
def test_the_scan_gives_the_old_bits_whole_and_split(worker, b, t, h, p, g, n, chunk, strong):
    x, dt, A, B, C, D, init = _scan_inputs(b, t, h, p, g, n, strong, seed=t + h)
    want = _old_chunk_scan(x, dt, A, B, C, D, chunk, init)
    whole = mamba.chunk_scan(x, dt, A, B, C, D, chunk, init.clone())
    state = init.clone()  # the final state written over the initial one
    halves = split.scan_heads(mamba.chunk_scan, x, dt, A, B, C, D, chunk, state, final=state)
    assert halves[1] is state
    for got in (whole, halves):
        assert torch.equal(_bits(got[0]), _bits(want[0]))
        assert torch.equal(_bits(got[1]), _bits(want[1]))


def _old_conv(window, xbc, weight, bias):
    full = torch.cat([window.transpose(1, 2), xbc], dim=1)
    w, t = weight.t().contiguous(), xbc.shape[1]
    out = full[:, :t] * w[0]
    for k in range(1, w.shape[0]):
        out.addcmul_(full[:, k : k + t], w[k])
    return F.silu(out.add_(bias), inplace=True)


@pytest.mark.parametrize(("b", "t", "cd"), [(1, 300, 1792), (2, 257, 384), (1, 300, 100)])
def test_the_conv_by_token_halves_gives_the_old_bits(worker, b, t, cd):
    gen = torch.Generator().manual_seed(cd)
    window = torch.randn(b, cd, 3, generator=gen)
    xbc = torch.randn(b, t, cd + 9, generator=gen)[:, :, 4 : 4 + cd]  # strided rows
    weight, bias = 3 * torch.randn(cd, 4, generator=gen), torch.randn(cd, generator=gen)
    got, new_window = mamba.conv_scan(window, xbc, weight, bias, rows=split.token_halves)
    assert torch.equal(_bits(got), _bits(_old_conv(window, xbc, weight, bias)))
    assert torch.equal(new_window, xbc[:, -3:].transpose(1, 2))


@pytest.mark.parametrize(("b", "t", "cd"), [(1, 4, 128), (2, 5, 64), (1, 7, 64), (1, 2, 64),
                                        (3, 130, 1792), (1, 6, 100)])
def test_the_conv_on_one_thread_gives_the_old_bits(b, t, cd):
    """Rows of whole vectors read their taps from xbc itself past the first K-1 (no copy of
    xbc behind the window): the old bits, at lengths around K-1 and 2(K-1) too."""
    gen = torch.Generator().manual_seed(cd + t)
    window = torch.randn(b, cd, 3, generator=gen)
    xbc = torch.randn(b, t, cd + 9, generator=gen)[:, :, 4 : 4 + cd]  # strided rows
    weight, bias = 3 * torch.randn(cd, 4, generator=gen), torch.randn(cd, generator=gen)
    got, new_window = mamba.conv_scan(window, xbc, weight, bias)
    assert torch.equal(_bits(got), _bits(_old_conv(window, xbc, weight, bias)))
    full = torch.cat([window.transpose(1, 2), xbc], dim=1)
    assert torch.equal(new_window, full[:, -3:].transpose(1, 2))


class _Norm:
    """What FalconH1's gated norm reads of the model (no weights needed)."""

    _gated_norm = FalconH1._gated_norm
    _gated_norm_rows = FalconH1._gated_norm_rows

    def __init__(self, groups: int, before_gate: bool) -> None:
        self.n_groups, self.norm_before_gate, self.eps = groups, before_gate, 1e-5


@pytest.mark.parametrize(("before_gate", "groups", "d"),
                         [(False, 1, 768), (True, 1, 768), (False, 2, 768), (False, 1, 100)])
def test_the_gated_norm_by_token_halves_gives_the_old_bits(worker, before_gate, groups, d):
    gen = torch.Generator().manual_seed(groups + 2 * before_gate)
    y = torch.randn(2, 300, d, generator=gen)
    gate = torch.randn(2, 300, d + 5, generator=gen)[:, :, 5:]
    weight = torch.randn(d, generator=gen)
    h = y if before_gate else y * F.silu(gate)
    h = h.view(2, 300, groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    want = (weight.view(groups, -1) * h).view(2, 300, d)
    want = want * F.silu(gate) if before_gate else want
    got = _Norm(groups, before_gate)._gated_norm(y, gate, weight)
    assert torch.equal(_bits(got), _bits(want))


def _old_attention(q, keys, vals, c, scale, gqa):
    """causal_attention as of 87cd36f without padding: a boolean mask per query block."""
    t, outs = q.shape[2], []
    for s in range(0, t, 512):
        e = min(t, s + 512)
        qpos = torch.arange(s, e)[:, None] + c
        mask = (torch.arange(c + e)[None, :] <= qpos)[None, None]
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], keys[:, :, :c + e],
                                                   vals[:, :, :c + e], attn_mask=mask,
                                                   scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize(("b", "h", "kvh", "t", "c"), [
    (1, 4, 2, 488, 512),  # the tiny model's second chunk
    (1, 4, 2, 600, 0),  # two query blocks
    (2, 8, 8, 70, 33),  # no GQA
    (1, 4, 2, 1, 9),  # one query
    (1, 4, 2, 520, 1600),  # a first block's mask too large to keep
])
def test_attention_with_the_kept_mask_gives_the_old_bits(worker, b, h, kvh, t, c):
    gen = torch.Generator().manual_seed(t + c)
    q = 3 * torch.randn(b, t, h, 32, generator=gen).transpose(1, 2)
    k, v = (torch.randn(b, c + t, kvh, 32, generator=gen).transpose(1, 2) for _ in "kv")
    want = _old_attention(q, k, v, c, 32 ** -0.5, h != kvh)
    for _ in range(2):  # the mask made, then reused
        got = split.attention_heads(causal_attention, q, k, v, c, None, 32 ** -0.5, h != kvh)
        assert torch.equal(_bits(got), _bits(want))
