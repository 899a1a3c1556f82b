"""The second architecture: a Granite-4.0-H-style interleaved hybrid (attention in one layer of
four, Mamba2 in the others, MoE blocks) in our torch model equals transformers' own.

The checkpoint is built offline from transformers' GraniteMoeHybridForCausalLM with random
weights (serving_core/model/make_tiny.py, preset conf/model/granite_hybrid_tiny.yaml); the
reference is that class's greedy continuation with its own cache. Our model runs over
contiguous per-sequence state (serving_core/model/dense_state.py), whole and with the prompt
split into chunks that do not align with anything.
"""

from __future__ import annotations

import engines
import numpy as np
import pytest
import torch

from serving_core.geometry import load_geometry
from serving_core.model.dense_state import DenseState
from serving_core.model.granite_moe_hybrid import GraniteMoeHybrid

OUTPUT_TOKENS = 24
PRESET = "granite_hybrid_tiny"


@pytest.fixture(scope="module")
def checkpoint(granite_tiny_checkpoint):
    """The session's seed-0 checkpoint (tests/conftest.py), built once for every file."""
    return granite_tiny_checkpoint


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(2028)
    ctx = rng.integers(0, 128_256, 300)
    return [np.concatenate([ctx, rng.integers(0, 128_256, n)]).astype(np.int64)
            for n in (7, 19)]


def _reference(checkpoint, prompts):
    out, net = engines.transformers_generate("GraniteMoeHybridForCausalLM", checkpoint, prompts,
                                             OUTPUT_TOKENS)
    return out, sum(p.numel() for p in net.parameters())


def _ours(model, prompt, chunks=None):
    state = DenseState(model)
    ids = torch.tensor([prompt.tolist()])
    bounds = [0, *(chunks or []), ids.shape[1]]
    for a, b in zip(bounds, bounds[1:], strict=False):
        logits = state.run(model, ids[:, a:b])
    tokens = []
    for _ in range(OUTPUT_TOKENS):
        tok = int(logits[0].argmax())
        tokens.append(tok)
        logits = state.run(model, torch.tensor([[tok]]))
    return tokens


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    return _reference(checkpoint, prompts)


def test_parameters_of_the_pattern_equal_the_checkpoints(reference):
    g = load_geometry(PRESET)
    total, _ = g.pattern_params()
    assert total == reference[1] == g.num_params == 33_829_448


def test_greedy_tokens_equal_transformers(checkpoint, prompts, reference):
    model = GraniteMoeHybrid.load(checkpoint)
    assert (model.attention_layers, model.mamba_layers) == (1, 3)
    for prompt, expected in zip(prompts, reference[0], strict=True):
        assert _ours(model, prompt) == expected


def test_chunked_prefill_gives_the_same_tokens(checkpoint, prompts, reference):
    model = GraniteMoeHybrid.load(checkpoint, scan_chunk=64)
    assert _ours(model, prompts[1], chunks=[97, 211, 250]) == reference[0][1]


def test_state_bytes_match_the_geometry(checkpoint):
    g = load_geometry(PRESET)
    model = GraniteMoeHybrid.load(checkpoint)
    state = DenseState(model)
    ssm, conv = state.ssm[0], state.conv[0]
    # one storage group: its three Mamba2 layers' SSM (8 heads x 32 x 64 each) and conv
    # windows ((256 + 2 x 64) channels x 3 each), fp32, stacked
    assert tuple(ssm.shape) == (1, 3 * 8, 32, 64) and tuple(conv.shape) == (1, 3 * 384, 3)
    assert g.ssm_bytes == ssm.numel() * 4 and g.conv_bytes == conv.numel() * 4
    assert g.attention_bytes_per_token == model.kv_heads * model.head_dim * 2 * 4


def test_a_checkpoint_loads_into_the_model_its_type_names(checkpoint, tmp_path):
    import json

    from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
    from serving_core.model.loader import load_model

    assert isinstance(load_model(checkpoint), GraniteMoeHybrid)
    check_checkpoint(TorchExecutorConfig(str(checkpoint)), load_geometry(PRESET))
    with pytest.raises(ValueError, match="does not match model='falcon_h1_tiny'"):
        check_checkpoint(TorchExecutorConfig(str(checkpoint)), load_geometry("falcon_h1_tiny"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'; allowed values are falcon_h1, "
                                         "granitemoehybrid"):
        load_model(tmp_path)
