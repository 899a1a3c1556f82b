"""The state codec on the real path (serving_core/executor/state_encoding.py): encoding by
hand, deterministic stochastic rounding, and the strict-prefix guarantee per codec: a
request that adopts a compressed checkpoint continues exactly as the writer's own run did
from the same compressed state (its chunk ended at the boundary, so its working state went
through the same encoding, with the same (seed, position) rounding)."""

from __future__ import annotations

import pytest
import torch
from engines import Spec, prompt_set, torch_engine

from serving_core.engine import serve
from serving_core.executor.state_encoding import StateEncoder, float_stochastic, fp8_stochastic
from serving_core.geometry import load_geometry
from serving_core.memory import org_layout
from serving_core.planner import plan_budget, units_for
from serving_core.records import record_produced
from serving_core.scheduler import SchedulerConfig

CODECS = ("bf16", "fp16", "fp8_e4m3", "int8", "bf16_sr", "fp16_sr")


def test_int8_layout_and_values_by_hand():
    """One layer, 2 heads of 1 x 2: codes then one fp32 scale per head (amax / 127)."""
    enc = StateEncoder("int8", (2, 1, 2), 1)
    assert enc.num_bytes == 2 * 2 + 2 * 4
    x = torch.tensor([[[[1.27, -0.635]], [[0.0, 0.0]]]])
    raw = enc.encode(x)
    assert raw[0, :4].view(torch.int8).tolist() == [127, -64, 0, 0]  # -0.635 / 0.01 = -63.5
    assert raw[0, 4:].view(torch.float32).tolist() == pytest.approx([0.01, 0.0])
    assert enc.decode(raw).flatten().tolist() == pytest.approx([1.27, -0.64, 0.0, 0.0])


def test_fp8_rounds_to_a_neighbour_without_bias():
    """0.3 lies between the e4m3 values 0.28125 and 0.3125: up with p = 0.6."""
    x = torch.full((20_000,), 0.3)
    codes = fp8_stochastic(x, torch.rand(20_000, generator=torch.Generator().manual_seed(1)))
    values = codes.view(torch.float8_e4m3fn).float()
    assert set(values.tolist()) == {0.28125, 0.3125}
    assert values.mean().item() == pytest.approx(0.3, abs=2e-3)
    # saturation at 448 and the sign bit
    big = fp8_stochastic(torch.tensor([-1e4, 448.0]), torch.zeros(2))
    assert big.view(torch.float8_e4m3fn).float().tolist() == [-448.0, 448.0]


@pytest.mark.parametrize(("dtype", "x", "lo", "hi"), [
    (torch.bfloat16, 1 + 2**-9, 1.0, 1 + 2**-7),  # 7 mantissa bits: up with p = 1/4
    (torch.float16, 1 + 2**-12, 1.0, 1 + 2**-10),  # 10 mantissa bits: up with p = 1/4
])
def test_bf16_fp16_stochastic_rounding_by_hand(dtype, x, lo, hi):
    u = torch.rand(20_000, generator=torch.Generator().manual_seed(1))
    values = float_stochastic(torch.full((20_000,), x), u, dtype).float()
    assert set(values.tolist()) == {lo, hi}
    assert (values == hi).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert values.mean().item() == pytest.approx(x, abs=0.01 * (hi - lo))  # unbiased
    assert float_stochastic(torch.tensor([-x, -x]), torch.tensor([0.0, 0.9]), dtype).tolist() == [
        -hi, -lo]  # magnitudes rounded: up when u < 1/4
    assert float_stochastic(torch.tensor([1.5]), torch.zeros(1), dtype).item() == 1.5  # exact
    assert float_stochastic(torch.tensor([1e6]), torch.ones(1), torch.float16).item() == 65504


def test_rounding_is_seeded_per_request_and_position():
    enc = StateEncoder("fp8_e4m3", (2, 4, 8), 1)
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(0))
    a = enc.encode(x, [(7, 512)], layer=1)
    assert torch.equal(a, enc.encode(x, [(7, 512)], layer=1))
    assert not torch.equal(a, enc.encode(x, [(8, 512)], layer=1))
    assert not torch.equal(a, enc.encode(x, [(7, 513)], layer=1))
    assert not torch.equal(a, enc.encode(x, [(7, 512)], layer=0))


def _served(model, codec: str, org: str):
    """Request 0 (cold) then request 1 (the same prompt, after it) on one engine whose
    chunks end at the checkpoint interval C; each one's produced tokens and request 1's
    prefix hit."""
    geometry = load_geometry("falcon_h1_tiny").with_state_codec(codec)
    c = org_layout(geometry, org).checkpoint_interval
    units = units_for(plan_budget(geometry, "b63"), org)
    engine = torch_engine(model, geometry, org, units,
                          SchedulerConfig(cap=2, max_num_batched_tokens=c, headroom=0.0),
                          clock="virtual")
    produced = record_produced(engine)
    (prompt,) = prompt_set(3, c, [40])
    specs = [Spec(0, 0.0, prompt, 3), Spec(1, 1e4, prompt, 3)]
    result = serve(engine, specs)
    return produced, result.requests[1].adopted_first, c, engine


@pytest.mark.parametrize("codec", CODECS)
def test_reused_compressed_checkpoint_continues_exactly(tiny_model, codec):
    produced, hit, c, engine = _served(tiny_model, codec, "S2")
    assert hit == c and produced[0] == produced[1] and len(produced[0]) == 3
    assert engine.executor.describe()["state_codec"] == codec


@pytest.mark.parametrize("org", ["S0", pytest.param("S1", marks=pytest.mark.slow),
                                 pytest.param("N0", marks=pytest.mark.slow)])
def test_continuation_per_organization_fp8(tiny_model, org):
    """S0: contiguous units (as N0 and D0); S1 pages as S2 does (slow: S2's codec tests above
    cover paged addressing), N0 its own page (slow)."""
    produced, hit, c, _ = _served(tiny_model, "fp8_e4m3", org)
    assert hit == c and produced[0] == produced[1]


@pytest.mark.slow  # test_state_codec.py::test_default_is_todays_accounting holds transcodes()
def test_auto_equals_fp32_storage_on_the_tiny_model(tiny_model):
    """On an fp32 model fp32 storage does not transcode: the same tokens as auto."""
    auto, _, _, _ = _served(tiny_model, "auto", "S2")
    fp32, _, _, _ = _served(tiny_model, "fp32", "S2")
    assert auto == fp32
