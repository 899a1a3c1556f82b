"""The additive step model's LM-head terms (one product per step over the items that sample:
logit_gemm_s per pass over the head's weight, logit_row_s per row padded to logit_block_rows):
hand-computed step times, the steps-ledger features the fit multiplies (with and without the
num_sampling column), the profile's checks and the executor's record."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from test_step_model import ADDITIVE, CONF

from serving_core.executor import AdditiveStepModel, load_device_profile
from serving_core.executor.modelled import SimulatedExecutor

G, R = 0.01, 0.001  # logit_gemm_s, logit_row_s


def model(falcon, org="d0", **edit):
    return AdditiveStepModel(falcon, load_device_profile({**ADDITIVE, **edit}), org)


@pytest.mark.parametrize(("batch", "sampling", "passes", "rows"), [
    (([1], [100]), 1, 1, 4),  # one decode: one product, its row padded to 4
    (([1, 1], [100, 50]), 2, 1, 4),
    (([1] * 4, [100] * 4), 4, 1, 4),
    (([1] * 10, [100] * 10), 10, 1, 12),
    (([1] * 5, [100] * 5), None, 1, 8),  # None: every scheduled item samples
    (([700], [0]), 1, 1, 4),  # a chunk that completes its prompt samples
    (([700], [0]), 0, 0, 0),  # a chunk inside its prompt: no head at all
    (([700, 300, 1, 1], [0, 40, 5, 6]), 3, 1, 4),  # one chunk completes, one does not
    (([700] + [1] * 6, [0] + [9] * 6), 7, 1, 8),
])
def test_logit_terms_add_hand_counted_passes_and_rows(falcon, batch, sampling, passes, rows):
    """One head product per step over the items that sample, rows padded to the block."""
    plain = model(falcon)
    with_logits = model(falcon, logit_gemm_s=G, logit_row_s=R, logit_block_rows=4)
    extra = (with_logits.step_seconds(*batch, num_sampling=sampling)
             - plain.step_seconds(*batch, num_sampling=sampling))
    assert extra == pytest.approx(G * passes + R * rows, rel=1e-9, abs=1e-15)
    if sampling is not None:
        assert with_logits.logit_counts(sampling) == (passes, rows)


def test_block_rows_sets_the_padding(falcon):
    """Three sampling rows padded to a multiple of logit_block_rows: 2 -> 4, 1 -> 3,
    4 -> 4, 8 -> 8 rows; one pass over the weight in every case."""
    batch = ([1, 1, 1], [10, 20, 30])
    plain = model(falcon).step_seconds(*batch)
    for block, rows in ((2, 4), (1, 3), (4, 4), (8, 8)):
        m = model(falcon, logit_gemm_s=G, logit_row_s=R, logit_block_rows=block)
        assert m.step_seconds(*batch, num_sampling=3) - plain == pytest.approx(
            G + R * rows, rel=1e-9)


def test_logit_terms_scale_with_no_indirection(falcon):
    """Host-side GEMM seconds, not device time: the S1/S2 indirection does not scale them."""
    batch = ([1, 1], [100, 200])
    for org in ("s0", "s1", "s2", "d0"):
        plain = model(falcon, org).step_seconds(*batch)
        got = model(falcon, org, logit_gemm_s=G, logit_row_s=R).step_seconds(*batch)
        assert got - plain == pytest.approx(G + 4 * R, rel=1e-9), org


def _ledger_rows(**extra):
    """Rows of a steps table: decode-only steps of 1, 3, 4 and 9 sequences, a prefill-only
    step of 2 chunks inside their prompts, a mixed step of 1 completing chunk and 2 decodes."""
    num = [1, 3, 4, 9, 2, 3]
    dec = [1, 3, 4, 9, 0, 2]
    return {"num_scheduled": num, "num_decode_seqs": dec,
            "decode_context_tokens": [10 * d for d in dec], "decode_tokens": dec,
            "prefill_tokens_initial": [0, 0, 0, 0, 900, 500],
            "prefill_tokens_resume": [0] * 6, "prefill_attention_pairs": [0, 0, 0, 0, 9, 9],
            "checkpoint_writes": [0] * 6, **extra}


@pytest.fixture(scope="module")
def tiny_s2():
    from serving_core.geometry import load_geometry

    return AdditiveStepModel(load_geometry("falcon_h1_tiny"), load_device_profile("cpu"), "s2")


def test_ledger_features_count_passes_and_rows(tiny_s2):
    f = tiny_s2.ledger_features(_ledger_rows(num_sampling=[1, 3, 4, 9, 0, 3]))
    assert f["logit_passes"].tolist() == [1, 1, 1, 1, 0, 1]
    assert f["logit_rows"].tolist() == [4, 4, 4, 12, 0, 4]


def test_ledgers_before_num_sampling_keep_the_per_forward_counts(tiny_s2):
    """A steps table written before the column (the executor's head per forward: one row per
    scheduled item, the decode GEMM once per row below 4 rows) reads with those counts;
    a query uniting older and newer files (NaN where absent) mixes the two per row."""
    old = tiny_s2.ledger_features(_ledger_rows())
    assert old["logit_passes"].tolist() == [1, 3, 1, 1, 2, 3]
    assert old["logit_rows"].tolist() == [1, 3, 4, 9, 2, 3]
    mixed = tiny_s2.ledger_features(_ledger_rows(num_sampling=[np.nan, 3, np.nan, 9, 0, 3]))
    assert mixed["logit_passes"].tolist() == [1, 1, 1, 1, 0, 1]
    assert mixed["logit_rows"].tolist() == [1, 4, 4, 12, 0, 4]


def test_a100_profile_carries_no_logits_cost(falcon):
    """The calibrated A100 profile states the neutral values; its steps are unchanged."""
    raw = yaml.safe_load((CONF / "a100.yaml").read_text())
    assert (raw["logit_gemm_s"], raw["logit_row_s"], raw["logit_block_rows"]) == (0.0, 0.0, 4)
    p = load_device_profile("a100")
    assert (p.logit_gemm_s, p.logit_row_s) == (0.0, 0.0)


@pytest.mark.parametrize(("edit", "field"), [
    ({"logit_gemm_s": -1e-3}, "logit_gemm_s"),
    ({"logit_row_s": float("nan")}, "logit_row_s"),
    ({"logit_block_rows": 0}, "logit_block_rows"),
    ({"logit_block_rows": 2.5}, "logit_block_rows"),
])
def test_bad_logit_constants_are_named(edit, field):
    with pytest.raises(ValueError, match=field):
        load_device_profile({**ADDITIVE, **edit})


def test_describe_records_the_logits_constants_the_model_runs(falcon):
    m = model(falcon, "s2", logit_gemm_s=G, logit_row_s=R, logit_block_rows=3)
    rec = SimulatedExecutor(m).describe()
    assert (rec["logit_gemm_s"], rec["logit_row_s"], rec["logit_block_rows"]) == (G, R, 3)
    assert not {"logit_gemm_s", "logit_row_s", "logit_block_rows"} & set(
        SimulatedExecutor(model(falcon, "s2")).describe())


def test_engine_record_states_the_logits_constants(falcon):
    """The run's engine_config, read back from the engine, names what the step model ran."""
    from conftest import compose_config
    from omegaconf import OmegaConf

    from experiments.runners.cell import run_cell

    cfg = compose_config("model=falcon_h1_tiny", "executor=cpu", "workload.source=synthetic",
                         "workload.num_requests=4", "budget=b63",
                         "executor.logit_gemm_s=0.0125", "executor.logit_block_rows=5")
    OmegaConf.set_struct(cfg, False)
    result = run_cell(cfg)
    rules = result.engine_config
    assert rules["logit_gemm_s"] == 0.0125 and rules["logit_block_rows"] == 5
    assert rules["logit_row_s"] == 0.0
    assert np.all(np.asarray(result.tables["steps"]["duration_s"]) >= 0.0125)


def test_engine_counts_the_items_that_sample():
    """num_sampling, recorded by the engine: a chunk inside its prompt samples nothing
    (prompts of 1,100 tokens under a 512-token budget), every decode samples, and each
    sampled row is one output token (so the column sums to the tokens produced)."""
    from conftest import compose_config

    from experiments.runners.cell import run_cell

    cfg = compose_config("model=falcon_h1_tiny", "executor=cpu", "workload.source=synthetic",
                         "workload.num_requests=6", "workload.synthetic_prompt_tokens=1100",
                         "workload.synthetic_output_tokens=5", "budget=b63",
                         "engine.max_num_batched_tokens=512", "executor.logit_gemm_s=0.01")
    result = run_cell(cfg)
    steps = {k: np.asarray(v) for k, v in result.tables["steps"].items()}
    num, dec, s = steps["num_scheduled"], steps["num_decode_seqs"], steps["num_sampling"]
    assert (s >= dec).all() and (s <= num).all()
    assert (s == 0).any() and (s[dec == num] == num[dec == num]).all()
    assert s.sum() == np.sum(result.tables["requests"]["output_tokens"])


def test_simulated_executor_prices_the_items_that_sample(falcon):
    """Of a chunk inside its prompt, a chunk completing it and a decode, two rows sample:
    one product, 2 rows padded to 4."""
    from types import SimpleNamespace as NS

    from serving_core.scheduler import Scheduled

    plan = [Scheduled(NS(num_tokens=1100), num_new=700, context=0),
            Scheduled(NS(num_tokens=1100), num_new=400, context=700),
            Scheduled(NS(num_tokens=51), num_new=1, context=50)]
    got = SimulatedExecutor(model(falcon, logit_gemm_s=G, logit_row_s=R)).execute(plan, 0)
    plain = model(falcon).step_seconds([700, 400, 1], [0, 700, 50])
    assert got.duration_s == pytest.approx(plain + G + 4 * R, rel=1e-12)
