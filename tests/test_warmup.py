"""The warm-up before serving (serving_core/model/warmup.py): it runs what it says, leaves the
model's outputs and weights as they were, and bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.geometry import load_geometry
from serving_core.model.dense_state import DenseState
from serving_core.model.warmup import warm_up
from serving_core.server import process_settings


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    state = DenseState(model, ids.shape[0])
    first = state.run(model, ids[:, :-1])
    return torch.cat([first, state.run(model, ids[:, -1:])])


def test_the_warm_up_leaves_outputs_and_weights_as_they_were(tiny_model):
    ids = torch.tensor([[5, 17, 99, 1000, 42, 7, 3], [8, 1, 2, 300, 4, 5, 6]])
    before = _logits(tiny_model, ids)
    versions = {k: w._version for k, w in tiny_model.w.items()}
    sums = {k: float(w.double().sum()) for k, w in tiny_model.w.items()}
    ran = warm_up(tiny_model, 96, 5)
    assert ran["mode"] == "auto" and ran["ran"] is True
    assert (ran["tokens"], ran["rows"]) == (96, 5) and ran["s"] >= 0 and ran["minor_faults"] >= 0
    assert {k: w._version for k, w in tiny_model.w.items()} == versions
    assert {k: float(w.double().sum()) for k, w in tiny_model.w.items()} == sums
    assert torch.equal(_logits(tiny_model, ids), before)
    assert warm_up(tiny_model, 96, 5, "off") == {"mode": "off", "ran": False}


def test_the_engine_warm_up_takes_the_engines_own_limits(tiny_model):
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63",
                             {"cap": 3, "max_num_batched_tokens": 80}, clock="wall")
    ran = process_settings.warm_engine(build_engine(spec, model=tiny_model), "auto")
    assert (ran["tokens"], ran["rows"]) == (80, 3)
    with pytest.raises(ValueError, match=r"^warm_up='on': allowed values are auto, off$"):
        process_settings.warm_engine(None, "on")


def test_the_server_refuses_a_bad_warm_up_value(capsys):
    from serving_core.server.__main__ import main

    assert main(["--spec", "none.json", "--warm-up", "yes"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --warm-up='yes': allowed values are auto, off")
