"""The compiled paged loops (serving_core/model/paged_loops.py) give the Python loops' bits:
decode attention over pages (lengths across page boundaries, padded and short rows, GQA
rep 1-3, fp32 and bf16) and the SSM update over member pages (S1/S2-like pieces, groups),
its one-pass fused form included (checked against the ATen calls on wide-ranged values, and
refused at load when its bits differ).
The default suite runs the checks with a cached build and never compiles; the slow test
builds it first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from serving_core.executor.state_arena import PagedSSM
from serving_core.model import mamba, paged_loops
from serving_core.model.mamba import UpdateWorkspace
from serving_core.model.paged_attention import DecodeLayout, UnitMatrices, decode_attention

LAYOUTS = [  # (block tokens, heads, KV heads, lengths)
    (32, 4, 2, [1, 9, 15, 16, 17, 63, 64, 65, 130]),
    (32, 4, 2, [70, 70, 70]),
    (16, 6, 2, [5, 5]),
    (16, 4, 4, [200, 3, 128, 64]),
    (8, 6, 1, [8, 9, 16, 17, 33]),
    (64, 4, 2, [1025, 1025, 640, 1]),
]


def _attention_case(bt, heads, kvh, lengths, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    d = 16
    units = sum(-(-n // bt) for n in lengths) + 1
    pool = torch.randn(units, 2, kvh, bt, d, generator=g).to(dtype).permute(0, 3, 1, 2, 4)
    order = torch.randperm(units, generator=g).tolist()  # pages anywhere, out of order
    tables = []
    for n in lengths:
        nb = -(-n // bt)
        tables.append(order[:nb] + [order[-1]])  # a spare unit past the end
        order = order[nb:]
    q = 3 * torch.randn(len(lengths), 1, heads, d, generator=g)
    return q, pool, tables


def _update_case(b, h, g_groups, hp, seed):
    """A batch's SSM states as member pages of hp heads at shuffled units, and its inputs."""
    g = torch.Generator().manual_seed(seed)
    p, n = 8, 16
    members = h // hp
    arena = torch.randn(b * members + 3, hp, p, n, generator=g)
    pages = torch.randperm(arena.shape[0], generator=g)[: b * members].tolist()
    inputs = (torch.randn(b, h, p, generator=g), torch.rand(b, h, generator=g),
              -torch.rand(h, generator=g), torch.randn(b, g_groups, n, generator=g),
              torch.randn(b, g_groups, n, generator=g), torch.randn(h, generator=g))
    return arena, pages, inputs


def _paged(arena, pages, b, hp):
    views = [arena[u] for u in pages]
    return PagedSSM(views, b, hp, [v.view(-1, v.shape[-1]) for v in views], UpdateWorkspace())


def _check_same_bits(compiled, monkeypatch) -> None:
    """Every layout, compiled against Python loops (same inputs, bit for bit)."""
    for i, (bt, heads, kvh, lengths) in enumerate(LAYOUTS):
        for dtype in (torch.float32, torch.bfloat16):
            q, pool, tables = _attention_case(bt, heads, kvh, lengths, dtype, i)
            outs = []
            for loops in (None, compiled):
                monkeypatch.setattr(paged_loops, "loops", lambda loops=loops: loops)
                layout, units = DecodeLayout(tables, lengths, bt), UnitMatrices(pool)
                outs += [decode_attention(q, pool, tables, lengths, 0.25, layout, units)
                         for _ in range(2)]  # the step's layout reused by a second layer
            assert all(torch.equal(outs[0], o) for o in outs[1:]), (bt, heads, lengths, dtype)
    for b, h, groups, hp in ((3, 12, 1, 4), (5, 12, 1, 6), (2, 12, 3, 4), (4, 8, 2, 2)):
        arena, pages, inputs = _update_case(b, h, groups, hp, b * h + hp)
        results = []
        for loops in (None, compiled):
            monkeypatch.setattr(paged_loops, "loops", lambda loops=loops: loops)
            state = arena.clone()
            y = mamba.state_update(_paged(state, pages, b, hp), *inputs)
            results.append((y, state))
        (y0, s0), (y1, s1) = results
        assert torch.equal(y0, y1) and torch.equal(s0, s1), (b, h, groups, hp)


def _cached():
    paged_loops.install("auto")
    return paged_loops.loops()


def test_compiled_loops_give_the_python_bits(monkeypatch):
    compiled = _cached()
    if compiled is None:
        pytest.skip("no cached build of the paged loops (python -m serving_core.model.paged_loops)")
    _check_same_bits(compiled, monkeypatch)


@pytest.mark.slow
def test_built_loops_give_the_python_bits(monkeypatch):
    paged_loops.install("compiled")
    assert paged_loops.settings()["loops"] == "compiled"
    _check_same_bits(paged_loops.loops(), monkeypatch)
    paged_loops.install("auto")


def _pieces(seed, k, hp, p, n, scale):
    """k member pages (hp, p, n) and update_pieces' operands, values drawn at `scale` (None:
    exponents spread over about 2^-60 .. 2^60)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        t = torch.randn(*shape, generator=g)
        if scale is None:
            return t * torch.exp(30 * torch.randn(*shape, generator=g)).clamp(max=1e18)
        return t * scale

    return draw(k, hp, p, n), (draw(k, hp, 1, 1), draw(k, hp, p, 1), draw(k, hp, 1, n),
                               draw(k, n))


def _python_update(views, matrices, dA, dtx, Bh, cs, y):
    """mamba._update_pieces' Python loop: the ATen calls the fused pass must equal."""
    for v, a, xb, bb, c, out, m in zip(views, dA, dtx, Bh, cs, y, matrices, strict=True):
        v.mul_(a).addcmul_(xb, bb)
        torch.mv(m, c, out=out)


def _run(update, state, ops):
    s = state.clone()
    k, hp, p, n = s.shape
    y = torch.empty(k, hp * p)
    update(list(s.unbind(0)), list(s.view(k, hp * p, n).unbind(0)), *ops, y)
    return s.view(torch.int32), y.view(torch.int32)


def test_fused_update_gives_the_aten_bits():
    """Where the fused one-pass update is used, it stores the Python loop's bits: random
    pages at S1/S2's piece shape (4 heads x 64 x 512) and odd widths (scalar tails), values
    normal, spread over 2^+-60, subnormal and overflowing."""
    compiled = _cached()
    if compiled is None or not paged_loops.fused_update():
        pytest.skip("no cached build, or the fused update is off on this build")
    shapes = ((4, 64, 512), (3, 5, 7), (2, 16, 40), (1, 3, 1))
    for i, (hp, p, n) in enumerate(shapes):
        for j, scale in enumerate((1.0, None, 1e-39, 3e19, 1e-20)):
            state, ops = _pieces(10 * i + j, 3, hp, p, n, scale)
            fused = _run(compiled.update_pieces_fused, state, ops)
            expected = _run(_python_update, state, ops)
            assert all(torch.equal(a, b) for a, b in zip(fused, expected, strict=True)), (
                hp, p, n, scale)


def test_fused_update_is_checked_before_use(monkeypatch):
    """The load-time check turns the fused update off when its bits differ from ATen's
    (here: a stand-in computing v*a + x*b with the two products rounded apart) and on
    when they agree."""
    def unfused(views, matrices, dA, dtx, Bh, cs, y):
        for v, a, xb, bb, c, out, m in zip(views, dA, dtx, Bh, cs, y, matrices, strict=True):
            v.copy_(torch.mul(v, a) + torch.mul(xb, bb))
            torch.mv(m, c, out=out)

    for fused, expected in ((unfused, "aten (fused bits differ on this build)"),
                            (_python_update, "fused (bits checked at load)")):
        stand_in = SimpleNamespace(fused_supported=lambda: True, update_pieces=_python_update,
                                   update_pieces_fused=fused)
        monkeypatch.setattr(paged_loops, "_loops", stand_in)
        paged_loops._check_fused()
        assert paged_loops._state["ssm_update"] == expected
        assert paged_loops._fused == expected.startswith("fused")
    monkeypatch.undo()
    paged_loops.install("auto")


def test_modes(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="paged_loops='fast': allowed values are auto, "
                                         "compiled, python"):
        paged_loops.install("fast")
    paged_loops.install("python")
    assert paged_loops.loops() is None
    assert paged_loops.settings() == {"mode": "python", "loops": "python",
                                      "reason": "mode python", "ssm_update": "aten"}
    assert not paged_loops.fused_update()
    monkeypatch.setattr(paged_loops, "CACHE", tmp_path)  # a clean clone: nothing built
    paged_loops.install("auto")
    assert paged_loops.loops() is None
    assert paged_loops.settings()["reason"] == "no cached build"
    monkeypatch.undo()
    paged_loops.install("auto")
