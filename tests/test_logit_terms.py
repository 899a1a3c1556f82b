"""The additive step model's logits GEMM terms (logit_gemm_s per pass over the LM head's
weight, logit_row_s per logits row, logit_block_rows): hand-computed step times, the
steps-ledger features the fit multiplies, the profile's checks and the executor's record."""

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


@pytest.mark.parametrize(("batch", "passes", "rows"), [
    (([1], [100]), 1, 1),  # one decode: one GEMM of one row
    (([1, 1], [100, 50]), 2, 2),  # below the block: the weight once per row
    (([1, 1, 1], [100, 50, 9]), 3, 3),
    (([1] * 4, [100] * 4), 1, 4),  # from the block on: once per GEMM
    (([1] * 10, [100] * 10), 1, 10),
    (([700], [0]), 1, 1),  # one prefill chunk: its own GEMM of one row
    (([700, 300, 1, 1], [0, 40, 5, 6]), 4, 4),  # two chunks + a decode GEMM of 2 rows
    (([700] + [1] * 6, [0] + [9] * 6), 2, 7),  # a chunk + a decode GEMM of 6 rows
])
def test_logit_terms_add_hand_counted_passes_and_rows(falcon, batch, passes, rows):
    plain = model(falcon)
    with_logits = model(falcon, logit_gemm_s=G, logit_row_s=R, logit_block_rows=4)
    extra = with_logits.step_seconds(*batch) - plain.step_seconds(*batch)
    assert extra == pytest.approx(G * passes + R * rows, rel=1e-9)
    assert with_logits.logit_passes(batch[0].count(1), len(batch[0]) - batch[0].count(1)) \
        == passes


def test_block_rows_moves_the_threshold(falcon):
    """logit_block_rows 2: three decodes are one GEMM pass; 1: every GEMM streams once."""
    batch = ([1, 1, 1], [10, 20, 30])
    plain = model(falcon).step_seconds(*batch)
    for block, passes in ((2, 1), (1, 1), (4, 3), (8, 3)):
        m = model(falcon, logit_gemm_s=G, logit_block_rows=block)
        assert m.step_seconds(*batch) - plain == pytest.approx(G * passes, rel=1e-9)


def test_logit_terms_scale_with_no_indirection(falcon):
    """Host-side GEMM seconds, not device time: the S1/S2 indirection does not scale them."""
    batch = ([1, 1], [100, 200])
    for org in ("s0", "s1", "s2", "d0"):
        plain = model(falcon, org).step_seconds(*batch)
        got = model(falcon, org, logit_gemm_s=G, logit_row_s=R).step_seconds(*batch)
        assert got - plain == pytest.approx(2 * G + 2 * R, rel=1e-9), org


def test_ledger_features_count_passes_and_rows():
    """Rows of a steps table: decode-only steps of 1, 3, 4 and 9 sequences, a prefill-only
    step of 2 chunks, a mixed step of 1 chunk and 2 decodes."""
    from serving_core.geometry import load_geometry

    m = AdditiveStepModel(load_geometry("falcon_h1_tiny"), load_device_profile("cpu"), "s2")
    num = [1, 3, 4, 9, 2, 3]
    dec = [1, 3, 4, 9, 0, 2]
    steps = {"num_scheduled": num, "num_decode_seqs": dec,
             "decode_context_tokens": [10 * d for d in dec], "decode_tokens": dec,
             "prefill_tokens_initial": [0, 0, 0, 0, 900, 500],
             "prefill_tokens_resume": [0] * 6, "prefill_attention_pairs": [0, 0, 0, 0, 9, 9],
             "checkpoint_writes": [0] * 6}
    f = m.ledger_features(steps)
    assert f["logit_passes"].tolist() == [1, 3, 1, 1, 2, 3]
    assert f["logit_rows"].tolist() == num


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
