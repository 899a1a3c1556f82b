"""The bounded steps fit: it recovers a known CPU-like profile from simulated steps ledgers
of a plain and a paged organization, keeps efficiencies in (0, 1], and refuses too little
data."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from conftest import compose_config

from experiments.runners.cell import run_cell
from serving_core.executor import load_device_profile
from serving_core.executor.fit_steps import design, fit_steps
from serving_core.executor.simulated import AdditiveStepModel
from serving_core.geometry import load_geometry

KNOWN = {"memory_efficiency": 0.02, "matmul_efficiency": 0.05, "scan_efficiency": 0.01,
         "attention_efficiency": 0.025, "mixed_step_s": 0.02, "per_step_overhead_s": 0.03,
         "per_seq_overhead_s": 0.004, "indirection_overhead": 0.08, "name": "known-cpu"}
SYNTH = ("model=falcon_h1_tiny", "workload.source=synthetic", "workload.num_requests=16",
         "workload.synthetic_prompt_tokens=1100", "workload.synthetic_context_tokens=1024",
         "workload.synthetic_output_tokens=24", "workload.num_contexts=2", "load.rate=4",
         "budget=b8")


def _steps(org: str, profile: dict = KNOWN):
    """The steps table of a synthetic b8 run on the CPU profile with `profile` over it."""
    from omegaconf import OmegaConf

    cfg = compose_config(*SYNTH, f"org={org}")
    OmegaConf.set_struct(cfg, False)
    cfg.executor = OmegaConf.create({**asdict(load_device_profile("cpu")), **profile})
    return run_cell(cfg).tables["steps"]


@pytest.fixture(scope="module")
def runs():
    return [(org, _steps(org)) for org in ("s0", "s2", "d0")]


def test_fit_recovers_the_profile_that_timed_the_steps(runs):
    fit = fit_steps(load_geometry("falcon_h1_tiny"), "cpu", runs)
    p = fit.profile
    # Dense and scan share one scale, so the start's ratio of the two is kept: check the
    # per-token time, not each efficiency.
    start = load_device_profile("cpu")
    assert p.matmul_efficiency / p.scan_efficiency == pytest.approx(
        start.matmul_efficiency / start.scan_efficiency)
    for key in ("memory_efficiency", "attention_efficiency", "mixed_step_s",
                "per_step_overhead_s", "per_seq_overhead_s", "indirection_overhead"):
        assert getattr(p, key) == pytest.approx(KNOWN[key], rel=1e-4), key
    assert fit.rows == sum(len(s["step"]) for _, s in runs)
    assert all(abs(v) < 0.02 for v in fit.total_rel_error.values())


def test_fitted_profile_predicts_each_step(runs):
    geometry = load_geometry("falcon_h1_tiny")
    fit = fit_steps(geometry, "cpu", runs)
    for org, steps in runs:
        model = AdditiveStepModel(geometry, fit.profile, org)
        f = design(model, steps)
        device = f["memory"] + f["prefill"] + f["attention"] + model._mixed * f["mixed"]
        pred = device * model._scale + model._step_s + model._seq_s * f["seqs"]
        assert np.allclose(pred, steps["duration_s"], rtol=2e-3), org


def test_efficiencies_stay_bounded_when_the_machine_beats_the_start():
    """Steps faster than the start's peaks allow pin the efficiencies at 1, never above."""
    geometry = load_geometry("falcon_h1_tiny")
    steps = _steps("s2")
    fast = dict(steps, duration_s=[d * 1e-3 for d in steps["duration_s"]])
    p = fit_steps(geometry, "cpu", [("s2", fast)]).profile
    for key in ("memory_efficiency", "matmul_efficiency", "attention_efficiency",
                "scan_efficiency"):
        assert 0 < getattr(p, key) <= 1.0, key


def test_too_few_steps_are_refused():
    steps = _steps("s2")
    short = {k: v[:3] for k, v in steps.items()}
    with pytest.raises(ValueError, match="cannot identify"):
        fit_steps(load_geometry("falcon_h1_tiny"), "cpu", [("s2", short)])
    with pytest.raises(ValueError, match="no runs"):
        fit_steps(load_geometry("falcon_h1_tiny"), "cpu", [])


def test_codec_fit_recovers_the_constants_that_timed_tq4_steps():
    """Steps of the TQ4 tiny model simulated under KNOWN plus known codec constants; the fit,
    given KNOWN with the nominal codec constants, recovers them (S2: KNOWN's indirection
    scales the codec term too)."""
    from omegaconf import OmegaConf

    from serving_core.executor.fit_steps import fit_codec

    codec = {"kv_decode_s_per_element": 3.0e-8, "kv_encode_s_per_element": 1.1e-7}
    runs = []
    for org in ("s2",):
        cfg = compose_config(*SYNTH, "model=falcon_h1_tiny_tq4", f"org={org}")
        OmegaConf.set_struct(cfg, False)
        cfg.executor = OmegaConf.create({**asdict(load_device_profile("cpu")), **KNOWN, **codec})
        runs.append((org, run_cell(cfg).tables["steps"]))
    known = load_device_profile({**asdict(load_device_profile("cpu")), **KNOWN})
    fit = fit_codec(load_geometry("falcon_h1_tiny_tq4"), known, runs)
    assert fit.kv_decode_s_per_element == pytest.approx(codec["kv_decode_s_per_element"],
                                                        rel=1e-6)
    assert fit.kv_encode_s_per_element == pytest.approx(codec["kv_encode_s_per_element"],
                                                        rel=1e-6)
    assert fit.rms_rel_error < 1e-9 < fit.rms_rel_error_before and 0 < fit.codec_share < 1
    with pytest.raises(ValueError, match="bf16 KV"):
        fit_codec(load_geometry("falcon_h1_tiny"), known, runs)


# A CPU-like profile whose logits GEMMs cost 9 ms per pass over the head's weight (what
# bench/logits_bench.py measures for the tiny model's head on one core, order of magnitude).
KNOWN_LOGITS = {**KNOWN, "logit_gemm_s": 0.009, "logit_block_rows": 4, "name": "known-logits"}


@pytest.fixture(scope="module")
def logit_runs():
    return [(org, _steps(org, KNOWN_LOGITS)) for org in ("s0", "s2", "d0")]


def test_fit_recovers_the_logits_gemm_constant(logit_runs):
    """The b8 runs have steps whose chunks are all inside their prompts (no head) beside
    steps that sample, so the one pass a sampling step makes over the head's weight is told
    apart from the per-step and per-sequence terms."""
    sampling = np.concatenate([np.asarray(s["num_sampling"]) for _, s in logit_runs])
    assert (sampling == 0).any() and (sampling > 0).any()
    fit = fit_steps(load_geometry("falcon_h1_tiny"), "cpu", logit_runs, omit=("logit_row_s",))
    p = fit.profile
    for key in ("logit_gemm_s", "memory_efficiency", "mixed_step_s", "per_step_overhead_s",
                "per_seq_overhead_s", "indirection_overhead"):
        assert getattr(p, key) == pytest.approx(KNOWN_LOGITS[key], rel=1e-4), key
    assert fit.parameters["logit_row_s"] == 0.0 and p.logit_row_s == 0.0
    assert "held at 0: logit_row_s" in p.calibration


@pytest.fixture(scope="module")
def row_runs():
    return [(org, _steps(org, {**KNOWN_LOGITS, "logit_row_s": 0.002}))
            for org in ("s0", "s2", "d0")]


def test_omitted_row_term_goes_to_the_pass_term(row_runs):
    """The head's rows are the sampling items padded to 4, not the scheduled sequences (as
    with the head per forward). These b8 runs sample at most 4 rows a step, so every head
    is one block of 4: the row term held at 0 goes into the pass term (9 ms + 4 x 2 ms),
    the per-sequence term stays, and the steps are predicted as well."""
    rows = np.concatenate([4 * np.ceil(np.asarray(s["num_sampling"]) / 4) for _, s in row_runs])
    seqs = np.concatenate([np.asarray(s["num_scheduled"]) for _, s in row_runs])
    assert set(rows.tolist()) == {0.0, 4.0} and (rows != seqs).any()
    fit = fit_steps(load_geometry("falcon_h1_tiny"), "cpu", row_runs, omit=("logit_row_s",))
    assert fit.profile.logit_gemm_s == pytest.approx(0.009 + 4 * 0.002, rel=1e-4)
    assert fit.profile.per_seq_overhead_s == pytest.approx(KNOWN["per_seq_overhead_s"], rel=1e-4)
    assert fit.rms_rel_error < 1e-4


def test_fit_without_the_logits_term_misses_the_head(logit_runs):
    """The step model without the head's terms (both held at 0) cannot tell steps that run
    the head from steps that do not: its residuals are far larger than with the term."""
    geometry = load_geometry("falcon_h1_tiny")
    without = fit_steps(geometry, "cpu", logit_runs, omit=("logit_gemm_s", "logit_row_s"))
    with_term = fit_steps(geometry, "cpu", logit_runs, omit=("logit_row_s",))
    assert without.profile.logit_gemm_s == 0.0
    assert with_term.rms_rel_error < 1e-4 < without.rms_rel_error


def test_predict_steps_returns_the_simulated_durations(logit_runs):
    from serving_core.executor.fit_steps import predict_steps

    geometry = load_geometry("falcon_h1_tiny")
    profile = load_device_profile({**asdict(load_device_profile("cpu")), **KNOWN_LOGITS})
    for org, steps in logit_runs:
        pred = predict_steps(geometry, profile, org, steps)
        assert np.allclose(pred, steps["duration_s"], rtol=1e-9), org


def test_omit_names_allowed_parameters(logit_runs):
    with pytest.raises(ValueError, match="omit=.*allowed values are mixed_step_s"):
        fit_steps(load_geometry("falcon_h1_tiny"), "cpu", logit_runs[:1],
                  omit=("memory_scale",))
