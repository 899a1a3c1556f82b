"""Issue 48's regime: a model runs on a device that holds it (or is refused in one line), a
tensor-parallel device splits the step by hand arithmetic, and a MoE step reads the experts
its tokens reach (the expected count against a brute-force count)."""

from __future__ import annotations

import itertools
import math

import pytest
from conftest import compose_config

from experiments.config.validation import validate_config
from serving_core.executor import device_fit
from serving_core.executor.moe_reads import expected_experts, weight_bytes_read
from serving_core.executor.profiles import load_device_profile, model_costs
from serving_core.executor.simulated import build_step_model
from serving_core.executor.tensor_parallel import (
    allreduce_bytes_per_gpu,
    allreduce_count,
    weight_bytes_per_gpu,
)
from serving_core.geometry import load_geometry


def test_each_preset_goes_on_the_first_declared_device_that_holds_it():
    state = 4 * 2**30
    chosen = {m: device_fit.choose_device(load_geometry(m), state) for m in (
        "falcon_h1_7b", "granite_4_0_h_small", "qwen3_next_80b_a3b", "jamba_v0_1")}
    # Falcon 15.18 GB + 4.29 fits 0.9 x 40 GiB; Granite Small 64 GB needs 80 GB; Jamba
    # 104 GB one H200 (126.9 usable); Qwen3-Next 160 GB two H200s (80 GB each of 126.9)
    assert chosen == {"falcon_h1_7b": "a100", "granite_4_0_h_small": "a100_80gb",
                      "qwen3_next_80b_a3b": "h200_tp2", "jamba_v0_1": "h200_141gb"}
    fit = device_fit.device_fit(load_geometry("falcon_h1_7b"), "a100", state)
    assert fit.activations == 2048 * 16 * 3072 * 2
    assert fit.usable == 0.9 * 42_949_672_960 and fit.fits


def test_a_model_no_device_holds_is_refused_in_one_line(capsys):
    with pytest.raises(ValueError, match="executor: cannot hold model='qwen3_next_80b_a3b'.*"
                       "executor=h200_tp2 holds it"):
        validate_config(compose_config("model=qwen3_next_80b_a3b", "budget=4091MiB",
                                       "write_ledgers=false"), check_root=False)
    huge = load_geometry("qwen3_next_80b_a3b", num_params=2_000_000_000_000)
    with pytest.raises(ValueError, match="no declared device holds it") as err:
        device_fit.check_fits(huge, "h100_tp8", 2**30, "executor")
    assert "\n" not in str(err.value)
    assert device_fit.main(["--model", "falcon_h1_7b", "--budget", "4000000MiB"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "fits no declared device" in out.err


def test_tensor_parallel_step_against_hand_arithmetic():
    g = load_geometry("falcon_h1_7b")
    one, tp2 = load_device_profile("h100"), load_device_profile("h100_tp2")
    assert weight_bytes_per_gpu(g, 2) == 15_180_000_000 / 2
    # 44 layers x (mixer + MLP) all-reduces of 10 tokens x 3,072 x 2 B; ring: 2 (t-1)/t = 1
    assert allreduce_count(g) == 88
    assert allreduce_bytes_per_gpu(g, 10, 2) == 88 * 10 * 3072 * 2 * 1.0
    assert allreduce_bytes_per_gpu(g, 10, 4) == 88 * 10 * 3072 * 2 * 1.5
    new, ctx = [1] * 10, [1000] * 10
    m1, m2 = build_step_model(g, one, "s2"), build_step_model(g, tp2, "s2")
    f1, f2 = m1.plan_features(new, ctx), m2.plan_features(new, ctx)
    assert f2[0] == pytest.approx(f1[0] / 2)  # every byte over twice the bandwidth
    link = 88 * 10 * 3072 * 2 / 450e9 + 88 * 1e-5
    host = one.per_step_overhead_s + 10 * (one.per_seq_overhead_s + m1.paged_s_per_seq)
    device1 = m1.step_seconds(new, ctx) - host
    assert m2.step_seconds(new, ctx) == pytest.approx(device1 / 2 + host + link)


def test_expected_experts_matches_a_brute_force_count():
    """E (1 - (1 - k/E)^n) is the mean distinct experts over every routing of n tokens,
    each token's k experts a uniform k-subset (marginal k/E per expert)."""
    for e, k, n in ((4, 1, 3), (5, 2, 2), (6, 2, 3)):
        subsets = list(itertools.combinations(range(e), k))
        counts = [len(set().union(*r)) for r in itertools.product(subsets, repeat=n)]
        brute = sum(counts) / len(counts)
        # independent k-subsets: a token misses an expert with probability 1 - k/E exactly
        assert expected_experts(e, k, n) == pytest.approx(brute, rel=1e-12)
    assert expected_experts(512, 10, 1) == pytest.approx(10)
    c = model_costs(load_geometry("qwen3_next_80b_a3b"))
    assert weight_bytes_read(c, 1) == pytest.approx(
        c.dense_weight_bytes + 48 * 10 * c.expert_bytes)
    assert c.expert_bytes == 3 * 2048 * 512 * 2
    assert weight_bytes_read(c, 10**6) == pytest.approx(c.weight_bytes)
    dense = model_costs(load_geometry("falcon_h1_7b"))
    assert weight_bytes_read(dense, 7) == dense.weight_bytes
    assert math.isclose(c.dense_weight_bytes + 48 * 512 * c.expert_bytes, c.weight_bytes)
