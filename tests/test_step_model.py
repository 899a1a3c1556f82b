"""Step-time model of the simulated executor, checked against hand-derived values.

Model constants below are typed from the Falcon-H1-7B config and docs/engine_rules.md section 2
(not read from the geometry code); device constants are read straight from the
profile YAML, and the datasheet peaks are asserted literally.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from serving_core.executor import StepTimeModel, load_device_profile
from serving_core.geometry import load_geometry

CONF = Path(__file__).resolve().parents[1] / "conf" / "executor"

# Falcon-H1-7B-Instruct, bf16 (docs/engine_rules.md section 2, conf/model/falcon_h1_7b.yaml).
LAYERS = 44
PARAMS = 7_590_000_000
KV_PER_LAYER = 1_024  # 2 KV heads x 128 x (K, V) x 2 B
COMPOSITE_PER_LAYER = 1_594_368  # SSM 1,572,864 + conv 21,504
ATTN_HEADS, HEAD_DIM = 12, 128
M_HEADS, M_HEAD_DIM, D_STATE, N_GROUPS = 24, 128, 256, 1
HPN = M_HEADS * M_HEAD_DIM * D_STATE
SSD_CHUNK = 256

# Per-token scan FLOPs of one layer for a chunk of s tokens (Mamba-2 SSD stages):
# 2sNP chunk state + 2sNP read-out per head, 2NP state passing, 2s^2 (P per head + N per group).
INTRA_PER_PAIR = 2 * (M_HEADS * M_HEAD_DIM + N_GROUPS * D_STATE)


def raw_yaml(name: str) -> dict:
    with (CONF / f"{name}.yaml").open() as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def a100(falcon):
    return StepTimeModel(falcon, load_device_profile("a100_roofline"), "s2")


@pytest.fixture(scope="module")
def h200(falcon):
    return StepTimeModel(falcon, load_device_profile("h200"), "s2")


def chunks(n: int) -> list[int]:
    return [SSD_CHUNK] * (n // SSD_CHUNK) + ([n % SSD_CHUNK] if n % SSD_CHUNK else [])


# --- profiles ---------------------------------------------------------------


def test_profiles_carry_datasheet_peaks():
    a = load_device_profile("a100")
    assert a.hbm_bytes_per_s == 1_555e9
    assert a.peak_flops == 312e12
    assert a.max_num_batched_tokens == 2048
    h = load_device_profile("H200")
    assert h.hbm_bytes_per_s == 4.8e12
    assert h.peak_flops == 989e12
    assert h.hbm_capacity_bytes == 141e9


@pytest.mark.parametrize("name", ["a100", "h200"])
def test_mapping_and_hydra_node_load_the_same_profile(name):
    by_name = load_device_profile(name)
    assert load_device_profile(raw_yaml(name)) == by_name
    assert load_device_profile(OmegaConf.load(CONF / f"{name}.yaml")) == by_name


def test_unknown_device_lists_allowed():
    with pytest.raises(ValueError, match=r"executor='tpu'.*a100.*h200"):
        load_device_profile("tpu")


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"memory_efficiency": 1.5}, "memory_efficiency"),
        ({"scan_efficiency": 0.0}, "scan_efficiency"),
        ({"peak_flops": "fast"}, "peak_flops"),
        ({"per_seq_overhead_s": -1e-6}, "per_seq_overhead_s"),
        ({"max_num_batched_tokens": 2048.5}, "max_num_batched_tokens"),
        ({"hbm_bytes_per_s": 0}, "hbm_bytes_per_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_profile_field_is_named(edit, field):
    cfg = raw_yaml("a100_roofline") | edit
    with pytest.raises(ValueError, match=field):
        load_device_profile(cfg)


def test_missing_profile_field_is_named():
    cfg = raw_yaml("a100_roofline")
    del cfg["peak_flops"]
    with pytest.raises(ValueError, match="peak_flops"):
        load_device_profile(cfg)


# --- hand-computed steps ----------------------------------------------------


def test_single_decode_at_context_zero_is_weight_streaming(a100):
    dev = raw_yaml("a100_roofline")
    weight_bytes = PARAMS * 2
    kv_bytes = (0 + 1 + 1) * KV_PER_LAYER * LAYERS  # read its own key, write it
    state_bytes = 2 * COMPOSITE_PER_LAYER * LAYERS  # working composite read + write
    memory_s = (weight_bytes + kv_bytes + state_bytes) / (1_555e9 * dev["memory_efficiency"])
    expected = memory_s + dev["per_step_overhead_s"] + dev["per_seq_overhead_s"]

    b = a100.breakdown([1], [0])
    assert b["bound"] == "memory"
    assert weight_bytes / b["memory_bytes"] > 0.98
    assert b["memory_bytes"] == weight_bytes + kv_bytes + state_bytes
    assert a100.step_seconds([1], [0]) == pytest.approx(expected, rel=1e-12)
    # Compute for one token is tiny next to streaming 15 GB of weights.
    dense_s = 2 * PARAMS / (312e12 * dev["matmul_efficiency"])
    assert b["dense_s"] == pytest.approx(dense_s, rel=1e-12)
    assert b["compute_s"] < 0.1 * b["memory_s"]


def test_prefill_chunk_of_2048_is_compute_bound(a100):
    dev = raw_yaml("a100_roofline")
    n = 2048
    dense = 2 * PARAMS * n
    attn = 4 * ATTN_HEADS * HEAD_DIM * LAYERS * (n * (n + 1) // 2)  # causal in the chunk
    num_chunks = n // SSD_CHUNK  # 8 full chunks
    scan = LAYERS * (4 * HPN * n + 2 * HPN * num_chunks + INTRA_PER_PAIR * n * SSD_CHUNK)
    compute_s = (
        dense / (312e12 * dev["matmul_efficiency"])
        + attn / (312e12 * dev["attention_efficiency"])
        + scan / (312e12 * dev["scan_efficiency"])
    )
    b = a100.breakdown([n], [0])
    assert (b["dense_flops"], b["attention_flops"], b["scan_flops"]) == (dense, attn, scan)
    assert b["bound"] == "compute"
    assert b["compute_s"] > 5 * b["memory_s"]
    expected = compute_s + dev["per_step_overhead_s"] + dev["per_seq_overhead_s"]
    assert a100.step_seconds([n], [0]) == pytest.approx(expected, rel=1e-12)


def test_decode_batch_reads_every_cached_token(a100):
    b = a100.breakdown([1] * 63, [3600] * 63)
    assert b["kv_read_bytes"] == 63 * 3601 * KV_PER_LAYER * LAYERS
    assert b["kv_write_bytes"] == 63 * KV_PER_LAYER * LAYERS
    assert b["state_read_bytes"] == b["state_write_bytes"] == 63 * COMPOSITE_PER_LAYER * LAYERS
    assert b["attention_pairs"] == 63 * 3601


def test_checkpoint_write_adds_one_composite(a100):
    dev = raw_yaml("a100_roofline")
    base = a100.breakdown([1] * 8, [600] * 8)
    more = a100.breakdown([1] * 8, [600] * 8, checkpoint_writes=3)
    added = 3 * COMPOSITE_PER_LAYER * LAYERS
    assert more["state_write_bytes"] - base["state_write_bytes"] == added
    assert more["memory_s"] - base["memory_s"] == pytest.approx(
        added / (1_555e9 * dev["memory_efficiency"]), rel=1e-9
    )
    assert more["compute_s"] == base["compute_s"]


def test_batch_terms_add_up_over_sequences_and_ignore_order(a100):
    """Metamorphic: the bytes and FLOPs of a batch are the weights once plus the sum of
    its sequences' own terms, whatever their order (no formula re-derived here)."""
    rng = random.Random(7)
    for _ in range(30):
        size = rng.randint(2, 30)
        new = [rng.choice([1, 1, 1, rng.randint(2, 1200)]) for _ in range(size)]
        ctx = [rng.randint(0, 6000) for _ in range(size)]
        whole = a100.breakdown(new, ctx)
        parts = [a100.breakdown([n], [c]) for n, c in zip(new, ctx, strict=True)]
        w = whole["weight_bytes"]
        assert whole["memory_bytes"] - w == sum(p["memory_bytes"] - w for p in parts)
        for key in ("dense_flops", "attention_flops", "scan_flops", "attention_pairs"):
            assert whole[key] == sum(p[key] for p in parts), key
        order = list(range(size))
        rng.shuffle(order)
        shuffled = a100.breakdown([new[i] for i in order], [ctx[i] for i in order])
        assert shuffled["step_s"] == pytest.approx(whole["step_s"], rel=1e-12)


def test_splitting_a_chunk_on_the_scan_grid_keeps_dense_and_attention_work(a100):
    """A 1,024-token chunk equals two 512-token chunks (the second after the first's
    context) in dense and attention FLOPs; the scan differs only by state passing."""
    one = a100.breakdown([1024], [300])
    a, b = a100.breakdown([512], [300]), a100.breakdown([512], [812])
    assert one["dense_flops"] == a["dense_flops"] + b["dense_flops"]
    assert one["attention_flops"] == a["attention_flops"] + b["attention_flops"]
    assert one["scan_flops"] == a["scan_flops"] + b["scan_flops"]  # 256-token chunks align


# --- qualitative properties -------------------------------------------------


def test_monotonic_in_tokens_and_context(a100):
    decode_ctx = [1200] * 31
    for grow in range(32):
        prev = None
        for n in (1, 2, 17, 255, 256, 257, 700, 1024, 2000):
            t = a100.step_seconds([n] + [1] * grow, [300] + decode_ctx[:grow])
            assert prev is None or t >= prev
            prev = t
    prev = None
    for c in (0, 1, 100, 1000, 4000, 8000):
        t = a100.step_seconds([1] * 63, [c] * 63)
        assert prev is None or t > prev  # decode is memory-bound: more KV, more time
        prev = t
    assert a100.step_seconds([1] * 10, [50] * 10) > a100.step_seconds([1] * 9, [50] * 9)


def test_h200_is_faster_than_the_a100_roofline(a100, h200):
    for new, ctx in [
        ([1], [0]),
        ([1] * 63, [3600] * 63),
        ([2048], [0]),
        ([2000] + [1] * 48, [0] + [3600] * 48),
    ]:
        assert h200.step_seconds(new, ctx) < a100.step_seconds(new, ctx)


def test_attention_only_geometry_has_no_state():
    dev = raw_yaml("a100_roofline")
    model = StepTimeModel(load_geometry("attention_only"), "a100_roofline", "d0")
    b = model.breakdown([1, 1, 500], [10, 20, 0])
    assert b["state_read_bytes"] == b["state_write_bytes"] == 0
    assert b["state_s"] == 0.0 and b["scan_flops"] == 0
    single = model.breakdown([1], [0])
    assert single["memory_bytes"] == PARAMS * 2 + 2 * KV_PER_LAYER * LAYERS
    expected = single["memory_bytes"] / (1_555e9 * dev["memory_efficiency"])
    assert single["memory_s"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="checkpoint_writes"):
        model.step_seconds([1], [0], checkpoint_writes=1)


@pytest.mark.parametrize("org", ["s1", "s2"])
def test_indirection_overhead_scales_only_state_memory(falcon, org):
    plain = StepTimeModel(falcon, "a100_roofline", org)
    paged = StepTimeModel(falcon, "a100_roofline", org, indirection_overhead=0.25)
    for new, ctx in [([1] * 63, [3600] * 63), ([2048], [0])]:
        p, q = plain.breakdown(new, ctx), paged.breakdown(new, ctx)
        assert q["state_s"] == pytest.approx(1.25 * p["state_s"], rel=1e-12)
        assert q["indirection_s"] == pytest.approx(0.25 * p["state_s"], rel=1e-12)
        for key in ("weights_s", "kv_s", "compute_s", "overhead_s", "memory_bytes"):
            assert q[key] == p[key], key
        assert q["memory_s"] > p["memory_s"]
    assert paged.step_seconds([1] * 63, [3600] * 63) > plain.step_seconds([1] * 63, [3600] * 63)


@pytest.mark.parametrize("org", ["s0", "d0"])
def test_indirection_overhead_does_not_apply_to_contiguous_state(falcon, org):
    plain = StepTimeModel(falcon, "a100_roofline", org)
    paged = StepTimeModel(falcon, "a100_roofline", org, indirection_overhead=0.25)
    assert paged.effective_indirection == 0.0
    assert paged.step_seconds([1] * 63, [3600] * 63) == plain.step_seconds([1] * 63, [3600] * 63)


# --- misuse ----------------------------------------------------------------


@pytest.mark.parametrize(
    "new, ctx, writes, field",
    [
        ([-1], [0], 0, "new_tokens"),
        ([0], [0], 0, "new_tokens"),
        ([], [], 0, "new_tokens"),
        ([1.5], [0], 0, "new_tokens"),
        ([1], [-5], 0, "context_tokens"),
        ([1, 1], [0], 0, "context_tokens"),
        ([1], [0.5], 0, "context_tokens"),
        ([1], [0], -1, "checkpoint_writes"),
        ([1], [0], 1.0, "checkpoint_writes"),
    ],
)
def test_bad_batch_names_the_field(a100, new, ctx, writes, field):
    with pytest.raises(ValueError, match=field):
        a100.step_seconds(new, ctx, writes)
    with pytest.raises(ValueError, match=field):
        a100.breakdown(new, ctx, writes)


def test_bad_org_device_or_overhead_is_named(falcon):
    with pytest.raises(ValueError, match="org"):
        StepTimeModel(falcon, "a100", "s3")
    with pytest.raises(ValueError, match="executor"):
        StepTimeModel(falcon, "v100", "s2")
    for bad in (-0.1, math.nan, math.inf, "lots"):
        with pytest.raises(ValueError, match="indirection_overhead"):
            StepTimeModel(falcon, "a100", "s2", indirection_overhead=bad)


# --- additive (calibrated) model ----------------------------------------------

ADDITIVE = {
    **{k: v for k, v in yaml.safe_load((CONF / "a100_roofline.yaml").read_text()).items()},
    "name": "test-additive",
    "step_model": "additive",
    "memory_efficiency": 0.5,
    "matmul_efficiency": 0.4,
    "mixed_step_s": 0.003,
    "indirection_overhead": 0.1,
    "per_step_overhead_s": 0.002,
    "per_seq_overhead_s": 1e-5,
}
W_BYTES = 2 * PARAMS
KV = KV_PER_LAYER * LAYERS
STATE = COMPOSITE_PER_LAYER * LAYERS


def additive(falcon, org="d0", **edit):
    from serving_core.executor import AdditiveStepModel

    return AdditiveStepModel(falcon, load_device_profile({**ADDITIVE, **edit}), org)


def test_additive_single_decode_is_weights_kv_and_state_traffic(falcon):
    model = additive(falcon)
    memory = (W_BYTES + 1 * KV + 2 * STATE) / 1_555e9  # own key, working composite in/out
    expected = memory / 0.5 + 0.002 + 1e-5
    assert model.step_seconds([1], [0]) == pytest.approx(expected, rel=1e-12)
    # 63 decodes at context 3,600: weights once, 3,601 keys and two composites each
    memory63 = (W_BYTES + 63 * 3601 * KV + 63 * 2 * STATE) / 1_555e9
    assert model.step_seconds([1] * 63, [3600] * 63) == pytest.approx(
        memory63 / 0.5 + 0.002 + 63e-5, rel=1e-12
    )


def test_additive_prefill_chunk_is_flops_without_weight_streaming(falcon):
    model = additive(falcon)
    n = 2048
    peak = 312e12
    dense = 2 * PARAMS * n / (peak * 0.4)
    attention = 4 * ATTN_HEADS * HEAD_DIM * LAYERS * (n * (n + 1) // 2) / (peak * 0.5)
    scan_per_token = LAYERS * (4 * HPN + INTRA_PER_PAIR * SSD_CHUNK + 2 * HPN / SSD_CHUNK)
    scan = n * scan_per_token / (peak * 0.25)
    state = 2 * STATE / 1_555e9 / 0.5
    expected = dense + attention + scan + state + 0.002 + 1e-5
    assert model.step_seconds([n], [0]) == pytest.approx(expected, rel=1e-12)


def test_additive_mixed_step_costs_the_sum_of_its_parts_plus_the_mixed_term(falcon):
    """Section C of the anchors: steps add up. Running 15 decodes apart from a 512-token
    chunk saves the mixed term but pays one more host step."""
    for org, scale in (("d0", 1.0), ("s2", 1.1)):
        model = additive(falcon, org)
        prefill, decodes = ([512], [1024]), ([1] * 15, [3000] * 15)
        mixed = model.step_seconds(prefill[0] + decodes[0], prefill[1] + decodes[1])
        split = model.step_seconds(*prefill) + model.step_seconds(*decodes)
        assert mixed - split == pytest.approx(0.003 * scale - 0.002, rel=1e-9)


def test_additive_indirection_scales_device_time_of_paged_orgs_only(falcon):
    batch = ([700] + [1] * 20, [0] + [2500] * 20)
    host = 0.002 + 21e-5
    base = additive(falcon, "d0").step_seconds(*batch) - host
    assert additive(falcon, "s0").step_seconds(*batch) - host == pytest.approx(base, rel=1e-12)
    for org in ("s1", "s2"):
        paged = additive(falcon, org).step_seconds(*batch) - host
        assert paged == pytest.approx(1.1 * base, rel=1e-12)


def test_paged_state_pieces_count_what_each_kernel_gathers(falcon):
    """Addressing (docs/engine_rules.md section 3.2): S1 reads 3 SSM member pages and its
    conv page, S2 3 member pages and a conv slot; S0, D0 and N0 keep a composite contiguous;
    no recurrent state, none."""
    from serving_core.executor.simulated import paged_state_pieces

    assert paged_state_pieces(falcon, "S1") == (4, 0)
    assert paged_state_pieces(falcon, "s2") == (3, 1)
    for org in ("S0", "D0", "N0"):
        assert paged_state_pieces(falcon, org) == (0, 0)
    assert paged_state_pieces(load_geometry("attention_only"), "S2") == (0, 0)


def test_additive_paged_terms_charge_each_sequence_per_piece(falcon):
    """state_page_s per member page and conv_slot_s per slot, per scheduled sequence, on top
    of the step (hand-computed: 21 sequences)."""
    batch = ([700] + [1] * 20, [0] + [2500] * 20)
    edit = {"indirection_overhead": 0.0, "state_page_s": 1e-4, "conv_slot_s": 3e-5}
    plain = {"indirection_overhead": 0.0}
    for org, per_seq in (("s0", 0.0), ("d0", 0.0), ("s1", 4 * 1e-4), ("s2", 3 * 1e-4 + 3e-5)):
        got = additive(falcon, org, **edit).step_seconds(*batch)
        want = additive(falcon, org, **plain).step_seconds(*batch) + 21 * per_seq
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    model = additive(falcon, "s2", **edit)
    feats = model.plan_features(*batch)
    assert model.device_seconds(feats, 21) - model.device_seconds(feats) == pytest.approx(
        21 * (3e-4 + 3e-5), rel=1e-12)
    from serving_core.executor.modelled import SimulatedExecutor

    assert SimulatedExecutor(model).describe()["paged_state_s"] == pytest.approx(3.3e-4)
    assert "paged_state_s" not in SimulatedExecutor(additive(falcon, "s2")).describe()


def test_paged_terms_are_validated(falcon):
    with pytest.raises(ValueError, match="state_page_s"):
        load_device_profile({**ADDITIVE, "state_page_s": -1.0})
    with pytest.raises(ValueError, match="conv_slot_s"):
        load_device_profile({**ADDITIVE, "conv_slot_s": float("nan")})


def test_calibrated_a100_is_the_default_and_the_roofline_stays_available(falcon):
    from serving_core.executor import AdditiveStepModel, build_step_model

    calibrated = load_device_profile("a100")
    assert calibrated.step_model == "additive" and "calibrate" in calibrated.calibration
    assert isinstance(build_step_model(falcon, "a100", "s2"), AdditiveStepModel)
    assert isinstance(build_step_model(falcon, "a100_roofline", "s2"), StepTimeModel)
    fit = raw_yaml("a100")["fit"]
    for key in ("memory_efficiency", "matmul_efficiency", "mixed_step_s", "per_step_overhead_s"):
        assert fit["fitted"][key] == getattr(calibrated, key)
    assert fit["residuals"] and fit["data"]["anchors_sha256"]


# --- compressed KV (tq4) -------------------------------------------------------------------
KV_TQ4 = 264 * LAYERS  # 2 KV heads x (K, V) x (128 / 2 + 2) B per layer
ELEMENTS = 2 * 2 * 128 * LAYERS  # K/V elements per token, all layers: 22,528
DEC, ENC = 1e-12, 3e-12  # test values of the per-element codec seconds


def test_tq4_additive_decode_adds_packed_kv_bytes_and_codec_work(falcon):
    tq4 = falcon.with_codec("tq4")
    model = additive(tq4, kv_decode_s_per_element=DEC, kv_encode_s_per_element=ENC)
    # 63 decodes at context 3,600: 3,601 packed keys read and decoded, one key encoded each
    memory = (W_BYTES + 63 * 3601 * KV_TQ4 + 63 * 2 * STATE) / 1_555e9
    codec = 63 * 3601 * ELEMENTS * DEC + 63 * ELEMENTS * ENC
    expected = memory / 0.5 + codec + 0.002 + 63e-5
    assert model.step_seconds([1] * 63, [3600] * 63) == pytest.approx(expected, rel=1e-12)
    # the same batch with bf16 KV pays 1,024 B per token per layer and no codec work
    bf16 = additive(falcon, kv_decode_s_per_element=DEC, kv_encode_s_per_element=ENC)
    memory_bf16 = (W_BYTES + 63 * 3601 * KV + 63 * 2 * STATE) / 1_555e9
    assert bf16.step_seconds([1] * 63, [3600] * 63) == pytest.approx(
        memory_bf16 / 0.5 + 0.002 + 63e-5, rel=1e-12)


def test_tq4_additive_prefill_encodes_every_new_token(falcon):
    edit = {"kv_decode_s_per_element": DEC, "kv_encode_s_per_element": ENC}
    tq4 = additive(falcon.with_codec("tq4"), **edit)
    bf16 = additive(falcon, **edit)
    # a 2,048-token chunk after 1,000 cached tokens: only the encode term differs
    assert tq4.step_seconds([2048], [1000]) - bf16.step_seconds([2048], [1000]) == pytest.approx(
        2048 * ELEMENTS * ENC, rel=1e-9)


def test_tq4_ledger_features_match_the_step_features(falcon):
    import numpy as np

    model = additive(falcon.with_codec("tq4"), kv_decode_s_per_element=DEC,
                     kv_encode_s_per_element=ENC)
    new, ctx = [700, 1, 1, 1], [512, 2000, 3000, 10]
    memory, dense, fixed, mixed = model.plan_features(new, ctx, 1)
    row = {"num_scheduled": [4], "num_decode_seqs": [3], "decode_context_tokens": [5010],
           "decode_tokens": [3], "prefill_tokens_initial": [700], "prefill_tokens_resume": [0],
           "prefill_attention_pairs": [700 * 512 + 700 * 701 // 2], "checkpoint_writes": [1]}
    f = model.ledger_features(row)
    assert f["codec"][0] == pytest.approx((5010 + 3) * ELEMENTS * DEC + 703 * ELEMENTS * ENC)
    np.testing.assert_allclose([f["memory"][0], f["dense"][0],
                                f["attention"][0] + f["scan"][0] + f["codec"][0], f["mixed"][0]],
                               [memory, dense, fixed, mixed], rtol=1e-12)


def test_tq4_roofline_breakdown_counts_codec_elements(falcon):
    profile = {**raw_yaml("a100_roofline"), "kv_decode_s_per_element": DEC,
               "kv_encode_s_per_element": ENC}
    model = StepTimeModel(falcon.with_codec("tq4"), load_device_profile(profile), "s2")
    b = model.breakdown([1, 100], [1000, 0])
    assert b["kv_read_bytes"] == (1000 + 101) * KV_TQ4
    assert b["codec_decode_elements"] == 1101 * ELEMENTS
    assert b["codec_encode_elements"] == 101 * ELEMENTS
    assert b["codec_s"] == pytest.approx(1101 * ELEMENTS * DEC + 101 * ELEMENTS * ENC)
    assert b["compute_s"] == pytest.approx(b["dense_s"] + b["attention_s"] + b["scan_s"]
                                           + b["codec_s"])
    assert StepTimeModel(falcon, load_device_profile(profile), "s2").breakdown(
        [1, 100], [1000, 0])["codec_s"] == 0


def test_codec_constants_are_nominal_and_stated():
    from serving_core.executor import profiles

    a100 = load_device_profile("a100")
    assert a100.kv_decode_s_per_element == pytest.approx(4 / 9.75e12)
    assert a100.kv_encode_s_per_element == pytest.approx(17 / 9.75e12)
    roofline = raw_yaml("a100_roofline")
    assert roofline["kv_decode_s_per_element"] == pytest.approx(
        profiles.NOMINAL_KV_DECODE_S_PER_ELEMENT)
    assert "NOMINAL" in (CONF / "a100_roofline.yaml").read_text()
    with pytest.raises(ValueError, match="kv_encode_s_per_element=-1"):
        load_device_profile({**roofline, "kv_encode_s_per_element": -1.0})
