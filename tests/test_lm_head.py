"""The LM head computed in vocabulary blocks equals the single product bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from serving_core.model.falcon_h1 import HEAD_VOCAB_BLOCK, rms_norm


def _one_product(model, h: torch.Tensor) -> torch.Tensor:
    last = rms_norm(h, model.w["model.final_layernorm.weight"], model.eps)
    out = F.linear(last, model.w["lm_head.weight"])
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
