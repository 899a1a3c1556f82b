"""The SSM state codec (model.state_codec, serving_core/state_codec.py): bytes per checkpoint
and per conv slot for each codec and organization, checked against hand arithmetic; the
budget label's bytes unchanged; N0's page re-derived as vLLM 0.32 derives it; refusals."""

from __future__ import annotations

import dataclasses

import pytest

from serving_core.geometry import load_geometry
from serving_core.memory import org_layout
from serving_core.memory.n0 import n0_padding_bytes
from serving_core.planner import nominal_bytes, plan_budget, units_for
from serving_core.state_codec import STATE_CODECS, ops_per_element, transcodes
from serving_core.storage import cost

KIB = 1024
# Falcon-H1-7B, one layer: 24 heads x 128 head dim x 256 d_state = 786,432 SSM elements
# over 24 heads; conv (3,072 + 2 x 1 x 256 channels) x 3 taps x 2 B = 21,504 B (kept bf16).
FALCON_SSM = {
    "auto": 786_432 * 2,  # the preset's dtype_bytes (bf16): today's 1,572,864
    "fp32": 786_432 * 4,  # 3,145,728
    "bf16": 786_432 * 2,
    "fp16": 786_432 * 2,
    "fp8_e4m3": 786_432 * 1,  # 786,432
    "int8": 786_432 * 1 + 24 * 4,  # + one fp32 scale per head: 786,528
    "bf16_sr": 786_432 * 2,  # stochastic rounding changes the values, not the bytes
    "fp16_sr": 786_432 * 2,
}
FALCON_CONV = (3_072 + 2 * 256) * 3 * 2


@pytest.fixture(scope="module")
def falcon():
    return load_geometry("falcon_h1_7b")


@pytest.mark.parametrize("codec", STATE_CODECS)
def test_falcon_checkpoint_bytes_by_hand(falcon, codec):
    g = falcon.with_state_codec(codec)
    assert FALCON_CONV == 21_504
    assert (g.ssm_bytes, g.conv_bytes) == (FALCON_SSM[codec], FALCON_CONV)
    assert g.composite_bytes == FALCON_SSM[codec] + 21_504
    assert g.recurrent_bytes_per_checkpoint == 44 * (FALCON_SSM[codec] + 21_504)
    assert g.ssm_elements_per_checkpoint == 44 * 786_432


def test_default_is_todays_accounting(falcon):
    assert falcon.state_codec == "auto"
    assert falcon.composite_bytes == 1_594_368  # docs/engine_rules.md section 2
    assert not transcodes("auto", 2) and not transcodes("bf16", 2) and transcodes("fp32", 2)
    assert not transcodes("fp32", 4) and ops_per_element("fp32", 4) == 0
    assert ops_per_element("fp8_e4m3", 2) == 1 + 5 and ops_per_element("int8", 4) == 2 + 5
    # stochastic rounding into the model's own format is still work: bf16_sr on a bf16 model
    assert transcodes("bf16_sr", 2) and ops_per_element("bf16_sr", 2) == 1 + 4


# Per codec: (S0 page, S1/S2 SSM members of a 512-KiB page, N0 block tokens, N0 page).
# S0: max(512 x 1,024, composite). S1/S2: ceil(SSM / 524,288). S2's conv slot stays the
# smallest power of two >= 21,504 = 32 KiB, 524,288 / 32,768 = 16 slots per slab under
# every codec (conv is not compressed). N0 (vLLM _align_hybrid_block_size, alignment 16):
# block = 16 x ceil(composite / (16 x 1,024)), page = block x 1,024.
FALCON_UNITS = {
    "auto": (1_594_368, 3, 1_568, 1_605_632),  # ceil(1,594,368 / 16,384) = 98 -> 1,568
    "fp32": (3_167_232, 6, 3_104, 3_178_496),  # ceil(3,167,232 / 16,384) = 194 (193.3)
    "bf16": (1_594_368, 3, 1_568, 1_605_632),
    "fp16": (1_594_368, 3, 1_568, 1_605_632),
    "fp8_e4m3": (807_936, 2, 800, 819_200),  # ceil(807,936 / 16,384) = 50 (49.3)
    "fp16_sr": (1_594_368, 3, 1_568, 1_605_632),  # vLLM: float16 + stochastic rounding
}


@pytest.mark.parametrize("codec", list(FALCON_UNITS))
def test_falcon_units_per_organization(falcon, codec):
    g = falcon.with_state_codec(codec)
    s0_page, members, n0_block, n0_page = FALCON_UNITS[codec]
    assert org_layout(g, "S0").page_bytes == s0_page == max(512 * KIB, g.composite_bytes)
    for org in ("S1", "S2"):
        assert org_layout(g, org).ssm_members == members
    s2 = org_layout(g, "S2")
    assert (s2.conv_slot_bytes, s2.slots_per_slab) == (32 * KIB, 16)
    assert org_layout(g, "D0").recurrent_unit_bytes == g.composite_bytes
    n0 = org_layout(g, "N0")
    assert (n0.block_tokens, n0.page_bytes) == (n0_block, n0_page)
    assert n0_padding_bytes(g) == n0_page - g.composite_bytes


def test_int8_units_and_n0_refusal(falcon):
    g = falcon.with_state_codec("int8")
    assert org_layout(g, "S0").page_bytes == 786_528 + 21_504 == 808_032
    assert org_layout(g, "S1").ssm_members == 2  # ceil(786,528 / 524,288)
    with pytest.raises(ValueError, match=r"^org=n0 cannot hold model 'falcon_h1_7b': "
                       "model.state_codec='int8', allowed values are auto, fp32, bf16, fp16, "
                       "fp8_e4m3, fp16_sr$"):
        org_layout(g, "N0")
    assert dict(plan_budget(g, "b63").refused).keys() == {"N0"}
    # bf16 with stochastic rounding: vLLM 0.32 rounds stochastically only into float16
    assert dict(plan_budget(falcon.with_state_codec("bf16_sr"), "b63").refused).keys() == {"N0"}


def test_checkpoint_costs_by_hand(falcon):
    """Cost of xA = 2 blocks and xR = 3 checkpoints (storage.cost), fp8 against auto."""
    auto, fp8 = falcon, falcon.with_state_codec("fp8_e4m3")
    page = 512 * KIB
    # S0: one page per block or checkpoint, the page max(512 KiB, composite)
    assert cost(auto, "S0", 2, 3) == 5 * 1_594_368
    assert cost(fp8, "S0", 2, 3) == 5 * 807_936
    # S1: blocks, members and one conv page per checkpoint
    assert cost(auto, "S1", 2, 3) == (2 + 3 * (3 + 1)) * page
    assert cost(fp8, "S1", 2, 3) == (2 + 3 * (2 + 1)) * page
    # S2: blocks, members and ceil(3 / 16) = 1 slab page
    assert cost(fp8, "S2", 2, 3) == (2 + 3 * 2 + 1) * page


def test_budget_label_names_the_same_bytes_under_every_codec(falcon):
    # b63: 63 uniform pages of the auto composite rounded up to 16 tokens (1,557 -> 1,568
    # tokens of 1,024 B) under every codec
    for codec in STATE_CODECS:
        assert nominal_bytes(falcon.with_state_codec(codec), "b63") == 63 * 1_605_632
    # S0's pages: floor(101,154,816 / 807,936) = 125 (auto: floor(.. / 1,594,368) = 63)
    assert units_for(plan_budget(falcon.with_state_codec("fp8_e4m3"), "b63"), "S0") == {
        "shared": 125}
    assert units_for(plan_budget(falcon, "b63"), "S0") == {"shared": 63}


def test_granite_group_bytes(falcon):
    """Granite-4.0-H-Tiny: a group of 9 Mamba2 layers (48 heads x 64 x 128 = 393,216
    elements each) and 1 attention layer of 4 KV heads x 128 x 2 x 2 B = 2,048 B per token;
    N0 pages per layer: fp8 state 393,216 + conv (3,072 + 256) x 3 x 2 = 19,968 B."""
    g = load_geometry("granite_4_0_h_tiny").with_state_codec("fp8_e4m3")
    assert g.ssm_bytes == 9 * 393_216 and g.conv_bytes == 9 * 19_968
    n0 = org_layout(g, "N0")
    # 16 x ceil(413,184 / (16 x 2,048)) = 16 x 13 = 208 tokens; page 208 x 2,048
    assert (n0.block_tokens, n0.page_bytes, n0.units_per_composite) == (208, 425_984, 9)
    i8 = load_geometry("granite_4_0_h_tiny").with_state_codec("int8")
    assert i8.ssm_bytes == 9 * (393_216 + 48 * 4)


def test_n0_state_below_the_attention_page_is_padded(falcon):
    """vLLM raises the attention block only (never below the kernel alignment, 16 tokens)
    and pads the Mamba page up to the attention page: a state smaller than 16 tokens of KV
    takes a whole 16-token page."""
    small = dataclasses.replace(falcon, mamba_heads=1, d_state=16, state_codec="fp8_e4m3")
    state = 128 * 16 + (128 + 32) * 3 * 2  # 2,048 + 960 = 3,008 B < 16 x 1,024
    assert small.composite_bytes == state
    n0 = org_layout(small, "N0")
    assert (n0.block_tokens, n0.page_bytes) == (16, 16 * 1_024)
    assert n0_padding_bytes(small) == 16_384 - 3_008


def test_bad_codec_one_line(falcon):
    with pytest.raises(ValueError, match=r"^model.state_codec='fp4': allowed values are auto, "
                                         "fp32, bf16, fp16, fp8_e4m3, int8, bf16_sr, "
                                         "fp16_sr$"):
        falcon.with_state_codec("fp4")
    with pytest.raises(ValueError, match="mamba1 layer has no heads to scale"):
        load_geometry("jamba_v0_1").with_state_codec("int8")


# ----- the simulator prices the codec ------------------------------------------------------
def test_roofline_prices_fewer_bytes_and_the_codec_work(falcon):
    """a100_roofline, 4 decode sequences and 1 checkpoint write, fp8 against auto: state
    bytes are 44 x 807,936 per composite, read 4x and written 5x; the codec work is 4
    sequences x 44 x 786,432 SSM elements x (1 + 5) operations at 1 / 9.75e12 s each."""
    from serving_core.executor.simulated import StepTimeModel

    new, ctx = [1] * 4, [1000] * 4
    auto = StepTimeModel(falcon, "a100_roofline", "S2").breakdown(new, ctx, 1)
    fp8 = StepTimeModel(falcon.with_state_codec("fp8_e4m3"), "a100_roofline",
                        "S2").breakdown(new, ctx, 1)
    assert auto["state_read_bytes"] == 4 * 44 * 1_594_368
    assert fp8["state_read_bytes"] == 4 * 44 * 807_936
    assert fp8["state_write_bytes"] == 5 * 44 * 807_936
    ops = 4 * 44 * 786_432 * 6
    assert (auto["state_codec_ops"], fp8["state_codec_ops"]) == (0, ops)
    assert fp8["codec_s"] == pytest.approx(ops / 9.75e12)
    assert auto["codec_s"] == 0 and fp8["memory_s"] < auto["memory_s"]


def test_additive_model_adds_the_codec_work_to_fixed(falcon):
    from serving_core.executor.simulated import AdditiveStepModel

    auto = AdditiveStepModel(falcon, "a100", "S0")
    i8 = AdditiveStepModel(falcon.with_state_codec("int8"), "a100", "S0")
    (m0, d0, f0, x0), (m1, d1, f1, x1) = (m.features(3, 3, 3000, 0, 0, 0) for m in (auto, i8))
    assert f1 - f0 == pytest.approx(3 * 44 * 786_432 * (2 + 5) / 9.75e12)
    # memory: 2 x 3 composites at the peak bandwidth, 808,032 against 1,594,368 B per layer
    bw = auto.device.hbm_bytes_per_s
    assert m0 - m1 == pytest.approx(6 * 44 * (1_594_368 - 808_032) / bw)
    assert (d0, x0) == (d1, x1)
