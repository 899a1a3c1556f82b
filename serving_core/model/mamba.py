"""Mamba2 kernels in plain torch (the reference's torch-native path).

`chunk_scan` is the chunked SSD scan of a prefill segment from an initial state;
`state_update` is the one-token recurrence a decode step applies to a batch of
states in place; the conv helpers run the depthwise causal convolution from a
carried window of the last d_conv - 1 inputs. All SSM arithmetic is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sums over the last dim: out[..., i, j] = sum x[..., j+1 .. i] (-inf above)."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    mask = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    out = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~mask, -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """(b, T, ...) -> (b, T/chunk, chunk, ...) after zero-padding T."""
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]):
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    return torch.clamp(dt, min=limit[0], max=limit[1])


def chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk: int,
    initial: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan of one batch of equal-length segments.

    x (b, T, H, P), dt (b, T, H) discretized, A (H,) negative, B and C (b, T, G, N),
    initial (b, H, P, N). Returns y (b, T, H, P) fp32 and the final state (b, H, P, N).
    """
    b, t, h, p = x.shape
    g = B.shape[2]
    x = x.float()
    B = B.float().repeat_interleave(h // g, dim=2, output_size=h)
    C = C.float().repeat_interleave(h // g, dim=2, output_size=h)
    pad = (chunk - t % chunk) % chunk
    d_res = D[..., None] * (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x)
    x = x * dt[..., None].float()
    A = A.float() * dt.float()
    x, A, B, C = (_chunks(v, pad, chunk) for v in (x, A, B, C))
    A = A.permute(0, 3, 1, 2)  # (b, h, c, l)
    A_cum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay = torch.exp(A_cum[:, :, :, -1:] - A_cum)
    B_decay = B * decay.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([initial[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    c_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = c_states * torch.exp(A_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).contiguous().reshape(b, -1, h, p) + d_res
    return y[:, :t], final


def state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One-token recurrence for a batch, updating `state` (b, H, P, N) fp32 in place.

    x (b, H, P), dt (b, H) discretized, B and C (b, G, N). Returns y (b, H, P) fp32.
    """
    b, h, p = x.shape
    g = B.shape[1]
    dtf = dt.float()[..., None, None]  # (b, h, 1, 1)
    dA = torch.exp(dtf * A.float()[None, :, None, None])
    Bh = B.float().repeat_interleave(h // g, dim=1)[:, :, None, :]  # (b, h, 1, n)
    Ch = C.float().repeat_interleave(h // g, dim=1)  # (b, h, n)
    dBx = (dtf * Bh) * x.float()[..., None]
    state.mul_(dA).add_(dBx)
    y = torch.matmul(state, Ch[..., None]).view(b, h, p)  # state may be a strided arena view
    return y + x.float() * D.float()[None, :, None]


def conv_scan(
    window: torch.Tensor, xbc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of xbc (b, T, Cd) after the carried window (b, Cd, K-1).

    Returns silu(conv) (b, T, Cd) and the new window (b, Cd, K-1).
    """
    t = xbc.shape[1]
    k1 = window.shape[-1]
    full = torch.cat([window.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
    if t == 1:  # decode: one dot product per channel (conv1d's setup dominates at this size)
        out = (full * weight.to(full.dtype)).sum(-1, keepdim=True)
        if bias is not None:
            out = out + bias[:, None]
    else:
        out = F.conv1d(full, weight.unsqueeze(1), bias, groups=full.shape[1])[:, :, -t:]
    return F.silu(out).transpose(1, 2), full[:, :, full.shape[-1] - k1 :]
