"""Mamba2 kernels in plain torch (the reference's torch-native path).

`chunk_scan` is the chunked SSD scan of a prefill segment from an initial state;
`state_update` is the one-token recurrence a decode step applies to a batch of
states in place; the conv helpers run the depthwise causal convolution from a
carried window of the last d_conv - 1 inputs. All SSM arithmetic is fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serving_core.model import paged_loops, share


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """Stable segment sums over the last dim: out[..., i, j] = sum x[..., j+1 .. i] (-inf above)."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    mask = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~mask, 0)
    out = torch.cumsum(x, dim=-2)
    mask = torch.tril(torch.ones(t, t, device=x.device, dtype=torch.bool), diagonal=0)
    return out.masked_fill(~mask, -torch.inf)


# Decay exponents below this are taken as exp = 0. exp(-60) ~ 9e-27 is far below fp32's
# relative precision next to the O(1) terms it would be added to, and without the cut a strong
# decay (dt |A| ~ 16 per token in the tiny model) fills the chunk matrices with subnormal
# floats, which x86 arithmetic (and MKL's matrix products) handles 2-3x slower.
EXP_FLOOR = -60.0
# Elementwise ops cut by rows (split.token_halves) keep their bits when a row is a multiple
# of this many floats: ATen's vectorized loops then never take their scalar tail.
ROW_ALIGN = 64


def _decay(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0, exactly 0 below EXP_FLOOR (no subnormal results)."""
    return torch.exp(x.masked_fill(x < EXP_FLOOR, -torch.inf))


# exp(EXP_FLOOR) as the exponential kernel rounds it (the threshold of `_decay_`'s results).
FLOOR_DECAY = torch.full((64,), EXP_FLOOR).exp_()[0].item()


def _decay_(x: torch.Tensor) -> torch.Tensor:
    """`_decay` in place (x is a temporary): exp(x), exactly 0 at or below EXP_FLOOR.

    The exponents are clamped to the floor, not set to -inf: MKL's exp takes a slow path on
    -inf (4x the time per element, and a strongly decaying chunk is mostly -inf). Results at
    exp(EXP_FLOOR) or below are then zeroed; an exponent above the floor, one float step
    (4e-6) or more, has an exponential above it by far more than the kernel's error, so the
    bits are those of exp(x) with -inf below the floor (checked on every float near the floor,
    tests/test_prefill_bits.py)."""
    return F.threshold_(x.clamp_(min=EXP_FLOOR).exp_(), FLOOR_DECAY, 0.0)


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """(b, T, ...) -> (b, T/chunk, chunk, ...) after zero-padding T."""
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float]):
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    return torch.clamp(dt, min=limit[0], max=limit[1])


def head_inputs(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, D: torch.Tensor,
                chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-head terms the chunked scan starts from: the skip term D x (b, T, H, P), then
    x dt and A dt cut into chunks of `chunk` tokens (the last zero-padded), all fp32."""
    t = x.shape[1]
    x = x.float()
    pad = (chunk - t % chunk) % chunk
    d_res = x * D.float()[:, None]
    xdt = x * dt[..., None].float()
    Adt = A.float() * dt.float()  # (b, T, H)
    return d_res, _chunks(xdt, pad, chunk), _chunks(Adt, pad, chunk)


def group_chunks(B: torch.Tensor, C: torch.Tensor, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """B and C (b, T, G, N) fp32 cut into chunks of `chunk` tokens (the last zero-padded),
    group-major: (b, c, G, chunk, N) views."""
    pad = (chunk - B.shape[1] % chunk) % chunk
    return tuple(_chunks(v.float(), pad, chunk).permute(0, 1, 3, 2, 4) for v in (B, C))


def causal_products(Bg: torch.Tensor, Cg: torch.Tensor) -> torch.Tensor:
    """C.B within each chunk of `group_chunks`, transposed and causal: (b, c, G, l_j, l_i),
    zero where j > i. Every head of a group shares it."""
    return torch.matmul(Bg, Cg.transpose(-1, -2)).triu_()


def scan_inputs(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, D: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """What the chunked scan starts from (chunk_scan's arguments): `head_inputs`, then B and
    C cut into chunks (b, c, chunk, G, N), all fp32."""
    pad = (chunk - x.shape[1] % chunk) % chunk
    return *head_inputs(x, dt, A, D, chunk), *(_chunks(v.float(), pad, chunk) for v in (B, C))


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, chunk: int, initial: torch.Tensor,
               groups: tuple | None = None, out: tuple | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan of one batch of equal-length segments.

    x (b, T, H, P), dt (b, T, H) discretized, A (H,) negative, B and C (b, T, G, N),
    initial (b, H, P, N). Returns y (b, T, H, P) fp32 and the final state (b, H, P, N).
    `groups`: (Bg, Cg, CBt) of `group_chunks` and `causal_products` when the caller has them
    (the heads of a split share them); `out`: (y, final) buffers to write the results into
    (either may be None; final may be `initial` itself, read before it is written).

    Within a chunk of `chunk` tokens the output is the masked quadratic form; across chunks
    the state is carried by a short loop. Heads that
    share a group share B and C, so the group's heads are stacked into one matrix product
    (no per-head copies of B or C): cost 2 T H P N for the states plus T x chunk x (N + H P)
    for the intra-chunk terms. For speed on CPU: the carried states are written by the
    matrix products into one buffer (chunk after chunk, in the (b, H, P, N) layout, so the
    initial and final states need no transposing copy) and carried by one in-place
    multiply-add per chunk; the chunk decay matrices are built transposed ([j, i]: the
    cumulative sum runs along the contiguous dim, the same additions in the same order as
    `segment_sum`) and in place, the causal mask applied once to the heads' shared C.B; decay
    exponents are cut in place (`_decay_`).
    """
    b, t, h, p = x.shape
    d_res, xdt, Adt = head_inputs(x, dt, A, D, chunk)
    if groups is None:
        Bg, Cg = group_chunks(B, C, chunk)
        groups = Bg, Cg, causal_products(Bg, Cg)
    Bg, Cg, CBt = groups
    g, n = Bg.shape[2], Bg.shape[4]
    nc, ln, hg = xdt.shape[1], chunk, h // g
    Ah = Adt.permute(0, 1, 3, 2).contiguous()  # (b, c, H, ln) head-major
    A_cum = torch.cumsum(Ah, dim=-1)  # (b, c, H, ln)
    # Intra-chunk: y_diag[i] = sum_{j <= i} (C_i . B_j) exp(A_cum_i - A_cum_j) xdt_j, with the
    # decay built transposed: Lt[j, i] = sum Ah[j+1 .. i] (0 for i <= j, masked by C.B below).
    upper = torch.ones(ln, ln, dtype=torch.bool, device=x.device).triu_(1)
    Lt = torch.where(upper, Ah[..., None, :], 0.0)  # (b, c, H, ln, ln)
    Lt.cumsum_(dim=-1)
    Lt = _decay_(Lt)
    Mt = Lt.view(b, nc, g, hg, ln, ln).mul_(CBt[:, :, :, None]).view(b, nc, h, ln, ln)
    xh = xdt.permute(0, 1, 3, 2, 4)  # (b, c, H, ln, P)
    y_diag = torch.matmul(Mt.transpose(-1, -2), xh)  # (b, c, H, ln, P)
    states = _chunk_states(xdt, A_cum, Bg, initial)
    # Inter-chunk: y_off[i] = exp(A_cum_i) C_i . s_k.
    y_off = torch.empty(b, nc, g, ln, hg * p, dtype=torch.float32, device=x.device)
    for i in range(b):
        torch.matmul(Cg[i], states[i, :nc].transpose(-1, -2), out=y_off[i])
    y = y_off.permute(0, 1, 3, 2, 4).reshape(b, nc, ln, h, p) if g > 1 else y_off.view(
        b, nc, ln, h, p)
    y = y.mul_(_decay_(A_cum).transpose(-1, -2)[..., None])
    y = y.add_(y_diag.permute(0, 1, 3, 2, 4))
    y_out, final_out = out or (None, None)
    y = torch.add(y.reshape(b, nc * ln, h, p)[:, :t], d_res, out=y_out)
    final = states[:, nc].reshape(b, h, p, n)
    return y, final if final_out is None else final_out.copy_(final)


def _chunk_states(xdt: torch.Tensor, A_cum: torch.Tensor, Bg: torch.Tensor,
                  initial: torch.Tensor) -> torch.Tensor:
    """The states entering each chunk and the final one, (b, c + 1, G, hg P, N): each
    chunk's own contribution to the state at its end (a (G, hg P, N) product per chunk),
    then the carry across chunks in place, s_{k+1} = own_k + exp(A_cum_k[-1]) s_k."""
    b, nc, ln, h, p = xdt.shape
    g, n = Bg.shape[2], Bg.shape[4]
    hg = h // g
    decay = _decay_(A_cum[..., -1:] - A_cum)  # (b, c, H, ln)
    xd = (xdt * decay.transpose(-1, -2)[..., None]).view(b, nc, ln, g, hg * p)
    xdT = xd.permute(0, 1, 3, 4, 2)  # (b, c, G, hg P, ln)
    states = torch.empty(b, nc + 1, g, hg * p, n, dtype=torch.float32, device=xdt.device)
    states[:, 0] = initial.reshape(b, g, hg * p, n)
    for i in range(b):
        torch.matmul(xdT[i], Bg[i], out=states[i, 1:])
    last = _decay_(A_cum[..., -1].clone())  # (b, c, H)
    last = last.view(b, nc, g, hg, 1, 1)
    for k in range(nc):
        states[:, k + 1].view(b, g, hg, p, n).addcmul_(
            states[:, k].view(b, g, hg, p, n), last[:, k])
    return states


def chunk_scan_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, D: torch.Tensor, chunk: int, initial: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan as transformers' torch path writes it (per-head B and C, all-pairs chunk
    decay): the cross-check for `chunk_scan`."""
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


class UpdateWorkspace:
    """The per-piece operands of `state_update` over paged states, kept across calls (every
    layer and step of one arena): buffers for the pieces' decays, input terms, B and C rows
    and read-outs, and their per-piece views, made once for the largest batch so far rather
    than per layer (the views were most of a member page's host cost). Each call fills the
    buffers with the same kernels as the unbuffered path (`out=` and copies), so the same
    bits."""

    def __init__(self) -> None:
        self.shape, self.k, self.device = None, 0, None

    def take(self, k: int, hp: int, p: int, n: int, device) -> tuple[list, list]:
        """(buffers, per-piece view lists) of the first k pieces: dA (k, hp, 1, 1), dtx
        (k, hp, p, 1), B (k, hp, 1, n), C (k, n), y (k, hp p)."""
        if self.shape != (hp, p, n) or self.k < k or self.device != device:
            self.shape, self.k, self.device = (hp, p, n), k, device
            self.buffers = [torch.empty(k, *s, dtype=torch.float32, device=device) for s in
                            ((hp, 1, 1), (hp, p, 1), (hp, 1, n), (n,), (hp * p,))]
            self.views = [t.unbind(0) for t in self.buffers]
        return [t[:k] for t in self.buffers], [v[:k] for v in self.views]


def state_update(
    state,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One-token recurrence for a batch, updating `state` fp32 in place.

    `state` is a (b, H, P, N) tensor or a `PagedSSM` (per-member-page views, updated
    where they are; with a `workspace`, an `UpdateWorkspace` for its operands). Both run the
    same loop over (H', P, N) pieces (a sequence's heads, or a member page's): state *=
    exp(dt A); state += (dt x) B; y = state C, the three back to back while the piece is in
    cache (one pass over the state from memory, not three), the read-out one matrix-vector
    product per piece and group (`_read_out_pieces`), so the paged update equals the
    contiguous one bit for bit.
    x (b, H, P), dt (b, H) discretized, B and C (b, G, N). Returns y (b, H, P) fp32.
    """
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    if isinstance(state, torch.Tensor):
        views, hp = state.unbind(0), h
        matrices = [v.view(-1, n) for v in views] if state.is_contiguous() else None
    else:
        views, hp, matrices = state.views, state.heads_per_member, state.matrices
    pieces = _read_out_pieces(h, hp, h // g)
    workspace = getattr(state, "workspace", None)
    if workspace is not None and all(len(pc) == 1 for pc in pieces):
        ys = _update_pieces(workspace, views, matrices, x, dt, A, B, C, hp, pieces)
        return ys.view(b, h, p) + x.float() * D.float()[None, :, None]
    dtf = dt.float()
    dA = torch.exp(dtf * A.float()[None, :])  # (b, h)
    dtx = dtf[..., None] * x.float()  # (b, h, p)
    Bh = B.float().repeat_interleave(h // g, dim=1)  # (b, h, n)
    k = len(views)
    y = torch.empty(k, hp * p, dtype=torch.float32, device=x.device)
    args = (views, dA.reshape(k, hp, 1, 1).unbind(0), dtx.reshape(k, hp, p, 1).unbind(0),
            Bh.reshape(k, hp, 1, n).unbind(0))
    if all(len(pc) == 1 for pc in pieces):  # each piece within one group: one product each
        grp = torch.tensor([pc[0][2] for pc in pieces], device=x.device).repeat(b)
        seq = torch.arange(b, device=x.device).repeat_interleave(len(pieces))
        cs = C.float()[seq, grp].unbind(0)  # (k, n): each piece's C
        if matrices is None:  # strided state: each piece read out after its update
            matrices = [None] * k
        for v, a, xb, bb, c, out, m in zip(*args, cs, y.unbind(0), matrices, strict=True):
            v.mul_(a).addcmul_(xb, bb)
            torch.mv(v.reshape(-1, n) if m is None else m, c, out=out)
    else:
        Cf = C.float()
        for i, (v, a, xb, bb, out) in enumerate(zip(*args, y.view(k, hp, p).unbind(0),
                                                    strict=True)):
            v.mul_(a).addcmul_(xb, bb)
            for lo, hi, gi in pieces[i % len(pieces)]:
                torch.mv(v[lo:hi].reshape(-1, n), Cf[i // len(pieces), gi],
                         out=out[lo:hi].view(-1))
    return y.view(b, h, p) + x.float() * D.float()[None, :, None]


def _update_pieces(workspace: UpdateWorkspace, views, matrices, x, dt, A, B, C, hp: int,
                   pieces) -> torch.Tensor:
    """`state_update`'s loop over pieces that each lie within one group, its operands
    written into the workspace's buffers (the values and layouts of the unbuffered path's
    dA, dt x, repeated B and gathered C). Returns the read-outs (k, hp P)."""
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    k = len(views)
    (dA, dtx, Bh, cs, y), lists = workspace.take(k, hp, p, n, x.device)
    dtf = dt.float()
    torch.exp(dtf * A.float()[None, :], out=dA.view(b, h))
    torch.mul(dtf[..., None], x.float(), out=dtx.view(b, h, p))
    Bh.view(b, g, h // g, n).copy_(B.float()[:, :, None, :].expand(b, g, h // g, n))
    grp = [pc[0][2] for pc in pieces]
    cs.view(b, len(pieces), n).copy_(C.float()[:, grp])
    compiled = paged_loops.loops() if x.device.type == "cpu" else None
    # The same calls from C++ (serving_core/model/paged_loops.py), or each page's update in
    # one pass where that stores the same bits (`fused_update`); chosen once per call.
    update = None if compiled is None else (
        compiled.update_pieces_fused if paged_loops.fused_update() else compiled.update_pieces)

    def run(first: int, end: int) -> None:  # pieces [first, end): each its own arithmetic
        if update is not None:
            update(views[first:end], matrices[first:end], dA[first:end], dtx[first:end],
                   Bh[first:end], cs[first:end], y[first:end])
            return
        for v, a, xb, bb, c, out, m in zip(views[first:end], *(t[first:end] for t in lists),
                                           matrices[first:end], strict=True):
            v.mul_(a).addcmul_(xb, bb)
            torch.mv(m, c, out=out)

    share.items(k, run)  # on the split worker in a decode pair: shared with the caller
    return y


def _read_out_pieces(h: int, hp: int, hg: int) -> list[list[tuple[int, int, int]]]:
    """Per piece of hp heads (a sequence's h heads in h / hp pieces): its (first, end) head
    ranges within the piece that share one group of hg heads, and that group."""
    out = []
    for j0 in range(0, h, hp):
        rng, lo = [], j0
        while lo < j0 + hp:
            grp = lo // hg
            hi = min(j0 + hp, (grp + 1) * hg)
            rng.append((lo - j0, hi - j0, grp))
            lo = hi
        out.append(rng)
    return out


def conv_scan(
    window: torch.Tensor, xbc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    rows=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of xbc (b, T, Cd) after the carried window (b, Cd, K-1).

    Returns silu(conv) (b, T, Cd) and the new window (b, Cd, K-1). A prefill runs token-major,
    K multiply-adds of shifted rows (contiguous along the channels): on CPU 2-5x faster than
    conv1d over the channel-major transpose and its copies, and the output is contiguous
    for the scan that reads it. `rows(t, Cd, run)` (split.token_halves) runs run(first, end)
    over the tokens [0, t), in parts that give the bits of the whole.
    """
    t = xbc.shape[1]
    k1 = window.shape[-1]
    if t == 1:  # decode: one dot product per channel (conv1d's setup dominates at this size)
        full = torch.cat([window.to(xbc.dtype), xbc.transpose(1, 2)], dim=-1)
        out = (full * weight.to(full.dtype)).sum(-1, keepdim=True)
        if bias is not None:
            out = out + bias[:, None]
        return F.silu(out).transpose(1, 2), full[:, :, full.shape[-1] - k1 :]
    if t <= k1 or xbc.shape[2] % ROW_ALIGN:
        full = torch.cat([window.to(xbc.dtype).transpose(1, 2), xbc], dim=1)  # (b, K-1+T, Cd)
        return _conv_rows(full, full, 0, t, weight, bias, rows), \
            full[:, full.shape[1] - k1 :].transpose(1, 2)
    # Rows of whole vectors (ROW_ALIGN): the first K-1 outputs over the window and the first
    # 2(K-1) inputs, the rest straight from xbc, not from a copy of all of it behind the
    # window (the same kernels on the same values, row by row: the same bits).
    lead = torch.cat([window.to(xbc.dtype).transpose(1, 2), xbc[:, : 2 * k1]], dim=1)
    return _conv_rows(lead, xbc, k1, t, weight, bias, rows), \
        xbc[:, t - k1 :].transpose(1, 2)


def _conv_rows(lead: torch.Tensor, xbc: torch.Tensor, head: int, t: int, weight: torch.Tensor,
               bias: torch.Tensor | None, rows) -> torch.Tensor:
    """`conv_scan`'s prefill outputs (b, t, Cd): rows below `head` over `lead` (the window
    then the inputs), tap k of row r >= head over xbc[r + k - (K-1)] (head 0: `lead` is the
    whole window-then-inputs sequence, read for every row)."""
    k1 = weight.shape[-1] - 1
    w = weight.to(lead.dtype).t().contiguous()  # (K, Cd): contiguous rows broadcast fastest
    out = torch.empty(lead.shape[0], t, lead.shape[2], dtype=lead.dtype, device=lead.device)
    src, shift = (lead, 0) if head == 0 else (xbc, -k1)

    def taps(part: torch.Tensor, seq: torch.Tensor, first: int, end: int) -> None:
        torch.mul(seq[:, first:end], w[0], out=part)
        for k in range(1, k1 + 1):
            part.addcmul_(seq[:, first + k : end + k], w[k])
        if bias is not None:
            part.add_(bias.to(part.dtype))
        F.silu(part, inplace=True)

    def run(first: int, end: int) -> None:
        if first < head:
            taps(out[:, first : min(end, head)], lead, first, min(end, head))
        if end > max(first, head):
            lo = max(first, head)
            taps(out[:, lo:end], src, lo + shift, end + shift)

    if rows is None:
        run(0, t)
    else:
        rows(t, lead.shape[2], run)
    return out
