"""Continuation per state codec (experiments/studies/codec_continuation.py): a request
preempted after its first chunk resumes from its compressed checkpoint and repeats the
unpreempted compressed run bit for bit (tokens, logprobs, the state it publishes next),
while an fp32 state holds another one (the comparison sees the codec); a pair the
organization refuses is listed, a bad codec exits 2. The full matrix (every codec x
organization, reuse and preemption) is `make codec-continuation`; one pair end to end and
the chunking the logprob check needs are behind slow."""

from __future__ import annotations

import json

import pytest

from experiments.studies import codec_continuation as cc
from experiments.studies import continuation as cont
from serving_core.geometry import load_geometry


def test_a_preempted_fp8_request_resumes_bit_for_bit(tiny_model):
    geometry = load_geometry("falcon_h1_tiny").with_state_codec("fp8_e4m3")
    got = cc.run_preemption(tiny_model, geometry, "s2", "b63", 2, 0)
    assert (got.interval, got.n_tokens) == (512, 1025)
    assert got.preempted_at == got.resumed_b == 512 and got.preemptions == 1
    assert got.tokens_equal and got.logprobs_equal and got.state_equal
    assert got.fp32_differs and got.ok


def test_bad_codec_exits_2_naming_the_values(capsys):
    assert cc.main(["--codecs", "fp9"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --codecs='fp9': allowed values are auto, fp32, bf16, fp16, fp8_e4m3, int8, "
        "bf16_sr, fp16_sr")


@pytest.mark.slow
def test_one_pair_end_to_end_and_the_refused_pair(tiny_checkpoint, tmp_path, capsys):
    code = cc.main(["--checkpoint", str(tiny_checkpoint), "--codecs", "int8", "--orgs", "n0,s0",
                    "--output-tokens", "2", "--ledger-root", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and out[0].startswith("refused: int8 x n0: org=n0 cannot hold")
    assert json.loads(out[-1]) == {"pairs": 1, "refused": ["int8 x n0"], "reuse_ok": 1,
                                   "preempt_ok": 1, "ok": True}
    from ledgers.studies import read_study

    rows = read_study(tmp_path, "codec_continuation").to_pylist()
    assert [(r["state_codec"], r["org"], r["ok"], r["reuse_ok"]) for r in rows] == [
        ("int8", "s0", True, True)]
    from analysis.studies import codec_continuation as page

    assert page.main(["--ledgers", str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "codec_continuation.md").read_text()
    assert "| int8 | s0 | 512 | 512 | 512 | yes | yes | yes | yes | yes | yes |" in text


@pytest.mark.slow  # about 2 min on an idle machine (make codec-continuation)
def test_the_full_matrix_passes(tiny_checkpoint, tmp_path, capsys):
    assert cc.main(["--checkpoint", str(tiny_checkpoint), "--ledger-root", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "pairs": 34, "refused": ["int8 x n0", "bf16_sr x n0"], "reuse_ok": 34, "preempt_ok": 34,
        "ok": True}


@pytest.mark.slow
def test_logprobs_must_match_only_where_the_cold_run_ended_a_chunk_at_b(tiny_model):
    """D0 (every boundary published, C = 1,792) under fp8: with 2,048-token steps the cold
    run crosses B inside a chunk and continues from its unencoded state, so the reload from
    the encoded checkpoint is a different computation (same_chunks False: the pair passes on
    tokens); with C-token steps the cold run's state went through the codec at B and the
    reload repeats its logprobs bit for bit."""
    geometry = load_geometry("falcon_h1_tiny").with_state_codec("fp8_e4m3")
    wide = cont.run_pair(tiny_model, geometry, "d0", "b63", "C+1", 2, 0)
    assert (wide.chunk_tokens, wide.restored_prefix_b, wide.same_chunks) == (2048, 1792, False)
    assert wide.tokens_equal and wide.ok
    exact = cont.run_pair(tiny_model, geometry, "d0", "b63", "C+1", 2, 0, chunk_tokens="C")
    assert (exact.chunk_tokens, exact.same_chunks, exact.logprobs_equal) == (1792, True, True)
    assert exact.ok
