"""The compiled paged loops (serving_core/model/paged_loops.py) give the Python loops' bits:
decode attention over pages (lengths across page boundaries, padded and short rows, GQA
rep 1-3, fp32 and bf16) and the SSM update over member pages (S1/S2-like pieces, groups).
The default suite runs the checks with a cached build and never compiles; the slow test
builds it first."""

from __future__ import annotations

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


def test_modes(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="paged_loops='fast': allowed values are auto, "
                                         "compiled, python"):
        paged_loops.install("fast")
    paged_loops.install("python")
    assert paged_loops.loops() is None
    assert paged_loops.settings() == {"mode": "python", "loops": "python",
                                      "reason": "mode python"}
    monkeypatch.setattr(paged_loops, "CACHE", tmp_path)  # a clean clone: nothing built
    paged_loops.install("auto")
    assert paged_loops.loops() is None
    assert paged_loops.settings()["reason"] == "no cached build"
    monkeypatch.undo()
    paged_loops.install("auto")
