"""The LM head computed in vocabulary blocks equals the single product bit for bit, and a
row's logits do not depend on the other rows of the product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving_core.model.falcon_h1 import HEAD_VOCAB_BLOCK, rms_norm
from serving_core.model.head_rows import pad_rows


def _one_product(model, h: torch.Tensor) -> torch.Tensor:
    """The head as one product over the same (padded) rows."""
    last = rms_norm(h, model.w["model.final_layernorm.weight"], model.eps)
    rows = pad_rows(last.reshape(-1, last.shape[-1]))
    out = F.linear(rows, model.w["lm_head.weight"])
    out = out[: last[..., 0].numel()].reshape(*last.shape[:-1], -1)
    return out.mul_(model.mult["lm_head_multiplier"]).float()


@pytest.mark.parametrize("shape", [(1, 128), (3, 128), (64, 128), (2, 5, 128)])
def test_blocked_head_equals_one_product(tiny_model, shape):
    assert tiny_model.w["lm_head.weight"].shape[0] % HEAD_VOCAB_BLOCK  # a ragged last block
    h = torch.randn(*shape[:-1], tiny_model.hidden, generator=torch.Generator().manual_seed(5))
    got = tiny_model.head(h)
    assert got.shape == (*shape[:-1], tiny_model.w["lm_head.weight"].shape[0])
    assert torch.equal(got, _one_product(tiny_model, h))


def test_blocked_head_of_a_strided_row_view(tiny_model):
    h = torch.randn(4, 7, tiny_model.hidden, generator=torch.Generator().manual_seed(6))
    assert torch.equal(tiny_model.head(h[:, -1]), _one_product(tiny_model, h[:, -1]))


# (intra-op threads, batch sizes): one thread, a row with 1, 2, 3 and 7 others; two threads,
# 5 and 6 rows, whose 1-2-row remainder on one thread an unpadded product rounds differently.
CASES = [(1, (2, 3, 4, 8)), (2, (5, 6))]


# Falcon's blocked head at two threads opens 63 parallel regions per call, seconds on a
# loaded 2-core machine: slow; Granite's one product covers the same padding at two threads.
MODELS_THREADS = [
    pytest.param("tiny_model", *CASES[0], id="falcon-1thread"),
    pytest.param("tiny_model", *CASES[1], id="falcon-2threads", marks=pytest.mark.slow),
    pytest.param("granite_tiny_model", *CASES[0], id="granite-1thread"),
    pytest.param("granite_tiny_model", *CASES[1], id="granite-2threads"),
]


@pytest.mark.parametrize("name,threads,sizes", MODELS_THREADS)
def test_a_rows_logits_do_not_depend_on_the_other_rows(request, name, threads, sizes):
    """The step's one head product meets a row with 0 to hundreds of others: each row's
    logits are the bits of the same row alone through the same (padded) path."""
    model = request.getfixturevalue(name)
    h = torch.randn(max(sizes), model.hidden, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = [model.head(h[i : i + 1])[0] for i in range(len(h))]
        for n in sizes:
            got = model.head(h[:n])
            for i in range(n):
                assert torch.equal(got[i], alone[i]), (n, i)
    finally:
        torch.set_num_threads(before)
