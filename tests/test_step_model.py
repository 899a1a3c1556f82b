"""Step-time model of the simulated executor, checked against hand-derived values.

Model constants below are typed from the Falcon-H1-7B config and SPEC section 2
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

# Falcon-H1-7B-Instruct, bf16 (SPEC section 2 and conf/model/falcon_h1_7b.yaml).
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
    return StepTimeModel(falcon, load_device_profile("a100"), "s2")


@pytest.fixture(scope="module")
def h200(falcon):
    return StepTimeModel(falcon, load_device_profile("h200"), "s2")


def chunks(n: int) -> list[int]:
    return [SSD_CHUNK] * (n // SSD_CHUNK) + ([n % SSD_CHUNK] if n % SSD_CHUNK else [])


def reference(new, ctx, checkpoint_writes, dev):
    """Per-sequence, per-token loops: the roofline built one item at a time."""
    mem_bytes = 2 * PARAMS
    dense = attn = scan = 0
    for n, c in zip(new, ctx, strict=True):
        mem_bytes += (c + n + n) * KV_PER_LAYER * LAYERS
        mem_bytes += 2 * COMPOSITE_PER_LAYER * LAYERS
        dense += 2 * PARAMS * n
        attn += sum(4 * ATTN_HEADS * HEAD_DIM * LAYERS * (c + j + 1) for j in range(n))
        for s in chunks(n):
            scan += LAYERS * (4 * HPN * s + 2 * HPN + INTRA_PER_PAIR * s * s)
    mem_bytes += checkpoint_writes * COMPOSITE_PER_LAYER * LAYERS
    peak = dev["peak_flops"]
    memory_s = mem_bytes / (dev["hbm_bytes_per_s"] * dev["memory_efficiency"])
    compute_s = (
        dense / (peak * dev["matmul_efficiency"])
        + attn / (peak * dev["attention_efficiency"])
        + scan / (peak * dev["scan_efficiency"])
    )
    overhead = dev["per_step_overhead_s"] + len(new) * dev["per_seq_overhead_s"]
    return {
        "memory_bytes": mem_bytes,
        "dense_flops": dense,
        "attention_flops": attn,
        "scan_flops": scan,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "step_s": max(memory_s, compute_s) + overhead,
    }


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
    cfg = raw_yaml("a100") | edit
    with pytest.raises(ValueError, match=field):
        load_device_profile(cfg)


def test_missing_profile_field_is_named():
    cfg = raw_yaml("a100")
    del cfg["peak_flops"]
    with pytest.raises(ValueError, match="peak_flops"):
        load_device_profile(cfg)


# --- hand-computed steps ----------------------------------------------------


def test_single_decode_at_context_zero_is_weight_streaming(a100):
    dev = raw_yaml("a100")
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
    dev = raw_yaml("a100")
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
    dev = raw_yaml("a100")
    base = a100.breakdown([1] * 8, [600] * 8)
    more = a100.breakdown([1] * 8, [600] * 8, checkpoint_writes=3)
    added = 3 * COMPOSITE_PER_LAYER * LAYERS
    assert more["state_write_bytes"] - base["state_write_bytes"] == added
    assert more["memory_s"] - base["memory_s"] == pytest.approx(
        added / (1_555e9 * dev["memory_efficiency"]), rel=1e-9
    )
    assert more["compute_s"] == base["compute_s"]


def test_sums_match_per_token_reference(a100):
    dev = raw_yaml("a100")
    rng = random.Random(7)
    batches = [([2000] + [1] * 48, [0] + [3600] * 48), ([256, 257, 512, 513], [0, 5, 9, 1000])]
    for _ in range(40):
        size = rng.randint(1, 40)
        new = [rng.choice([1, 1, 1, rng.randint(2, 1200)]) for _ in range(size)]
        ctx = [rng.randint(0, 6000) for _ in range(size)]
        batches.append((new, ctx))
    for new, ctx in batches:
        writes = sum(1 for n in new if n > 300)
        got = a100.breakdown(new, ctx, checkpoint_writes=writes)
        want = reference(new, ctx, writes, dev)
        for key in ("memory_bytes", "dense_flops", "attention_flops", "scan_flops"):
            assert got[key] == want[key], key
        for key in ("memory_s", "compute_s", "step_s"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), key
        assert a100.step_seconds(new, ctx, writes) == got["step_s"]


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


def test_h200_is_faster(a100, h200):
    for new, ctx in [
        ([1], [0]),
        ([1] * 63, [3600] * 63),
        ([2048], [0]),
        ([2000] + [1] * 48, [0] + [3600] * 48),
    ]:
        assert h200.step_seconds(new, ctx) < a100.step_seconds(new, ctx)


def test_attention_only_geometry_has_no_state():
    dev = raw_yaml("a100")
    model = StepTimeModel(load_geometry("attention_only"), "a100", "d0")
    b = model.breakdown([1, 1, 500], [10, 20, 0])
    assert b["state_read_bytes"] == b["state_write_bytes"] == 0
    assert b["state_s"] == 0.0 and b["scan_flops"] == 0
    single = model.breakdown([1], [0])
    assert single["memory_bytes"] == PARAMS * 2 + 2 * KV_PER_LAYER * LAYERS
    expected = single["memory_bytes"] / (1_555e9 * dev["memory_efficiency"])
    assert single["memory_s"] == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="checkpoint_writes"):
        model.step_seconds([1], [0], checkpoint_writes=1)


@pytest.mark.parametrize("org", ["s1", "s2", "s2_retention"])
def test_indirection_overhead_scales_only_state_memory(falcon, org):
    plain = StepTimeModel(falcon, "a100", org)
    paged = StepTimeModel(falcon, "a100", org, indirection_overhead=0.25)
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
    plain = StepTimeModel(falcon, "a100", org)
    paged = StepTimeModel(falcon, "a100", org, indirection_overhead=0.25)
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
