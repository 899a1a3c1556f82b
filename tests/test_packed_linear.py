"""oneDNN-prepacked linear weights give the plain products' bits (model/packed_linear.py):
the products of the tiny Falcon-H1's shapes, and its LM head, against the old ops computed
here; `--packed-linear` is a checked setting read back in the runtime record."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving_core.model import packed_linear, split
from serving_core.model.falcon_h1 import HEAD_PACK_BLOCKS, HEAD_VOCAB_BLOCK, FalconH1

ROWS = (1, 3, 4, 5, 8, 13, 64, 259)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [2572, 2048])
def test_a_packed_product_gives_f_linear_bits(one_thread, n):
    """The in_proj shape and a head block at K = 128: packed where the check at load
    passes, and F.linear's bits at every row count (1-3 rows take F.linear itself)."""
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 128, generator=gen) * 0.05
    entry = packed_linear.pack(w)
    assert entry is not None  # K = 128 products match on the CPUs measured (module docstring)
    for m in ROWS:
        x = torch.randn(m, 128, generator=gen)
        assert torch.equal(packed_linear.linear(x, w, None, entry), F.linear(x, w)), m
    x3 = torch.randn(2, 7, 128, generator=gen)
    assert torch.equal(packed_linear.linear(x3, w, None, entry), F.linear(x3, w))
    assert not entry.serves(w, 3) and entry.serves(w, 4)
    w.mul_(1.0)  # changed in place: the packed copy no longer serves it
    assert not entry.serves(w, 4)


def test_an_inner_dimension_that_rounds_differently_stays_plain(one_thread):
    """K = 768 (the out_proj's): oneDNN sums in another order, so the check refuses it."""
    w = torch.randn(2048, 768, generator=torch.Generator().manual_seed(1))
    assert packed_linear.pack(w) is None


def _old_head(model: FalconH1, h: torch.Tensor) -> torch.Tensor:
    """The head before packing: blocks of 2,048 vocabulary rows into the logits, scaled."""
    from serving_core.model.falcon_h1 import rms_norm
    from serving_core.model.head_rows import pad_rows

    last = rms_norm(h, model.w["model.final_layernorm.weight"], model.eps)
    rows = pad_rows(last.reshape(-1, last.shape[-1]))
    w = model.w["lm_head.weight"]
    out = torch.empty(rows.shape[0], w.shape[0])
    for v in range(0, w.shape[0], HEAD_VOCAB_BLOCK):
        torch.matmul(rows, w[v : v + HEAD_VOCAB_BLOCK].t(), out=out[:, v : v + HEAD_VOCAB_BLOCK])
    out = out[: last[..., 0].numel()].view(*last.shape[:-1], w.shape[0])
    return out.mul_(model.mult["lm_head_multiplier"]).float()


@pytest.mark.parametrize("workers", [0, 1])
def test_the_packed_head_gives_the_old_heads_bits(one_thread, tiny_model, workers):
    falcon = tiny_model
    pieces = -(-falcon.w["lm_head.weight"].shape[0] // (HEAD_PACK_BLOCKS * HEAD_VOCAB_BLOCK))
    assert pieces > 2 and len(falcon.packs.head) == falcon.packs.describe()["head_pieces"] == pieces
    gen = torch.Generator().manual_seed(7)
    split.install(workers)
    try:
        for n in (1, 3, 4, 6, 64):
            h = torch.randn(n, 1, falcon.hidden, generator=gen)
            assert torch.equal(falcon.head(h), _old_head(falcon, h)), n
    finally:
        split.close()


def test_off_packs_nothing_and_bad_values_are_refused(monkeypatch, tiny_checkpoint):
    from serving_core.server import process_settings

    monkeypatch.setattr(packed_linear, "_mode", packed_linear.mode())
    process_settings.apply_packed_linear("off")
    assert packed_linear.pack(torch.zeros(2572, 128)) is None
    FalconH1.load(tiny_checkpoint)
    record = process_settings.runtime_settings()["packed_linear"]
    assert record["mode"] == "off" and record["head_pieces"] == record["linear_packed"] == 0
    assert record["in_effect"] is False
    with pytest.raises(ValueError, match=r"packed_linear='on': allowed values are auto, off"):
        process_settings.apply_packed_linear("on")


def test_the_server_refuses_a_bad_packed_linear_value(capsys):
    from serving_core.server.__main__ import main

    assert main(["--spec", "none.json", "--packed-linear", "yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --packed-linear='yes': allowed values are auto, off"
