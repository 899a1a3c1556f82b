"""Q11 (state codec) page and plan: codecs read from preset names, the ranking and its
`changed` flag, gains against auto (tables typed by hand), the plan's primary family; and,
behind slow, `make campaign C=q11_state_codec SMOKE=1` on its primary block end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from analysis.inference import prereg
from analysis.questions import q11_state_codec as q11

REPO = Path(__file__).resolve().parent.parent


def test_codecs_of_preset_names():
    assert q11.codecs_of("falcon_h1_7b") == ("falcon_h1_7b", "bf16", "auto")
    assert q11.codecs_of("falcon_h1_7b_fp8") == ("falcon_h1_7b", "bf16", "fp8_e4m3")
    assert q11.codecs_of("falcon_h1_7b_tq4_fp8") == ("falcon_h1_7b", "tq4", "fp8_e4m3")
    assert q11.codecs_of("falcon_h1_7b_tq4") == ("falcon_h1_7b", "tq4", "auto")
    assert q11.codecs_of("granite_4_0_h_tiny_tq4_fp8") == ("granite_4_0_h_tiny", "tq4", "fp8_e4m3")
    assert q11.codecs_of("granite_4_0_h_tiny_int8") == ("granite_4_0_h_tiny", "bf16", "int8")


def _cells(throughput: dict[str, list[float]]) -> pd.DataFrame:
    rows = []
    for codec, values in throughput.items():
        for org, t in zip(["S0", "S1", "S2"], values, strict=True):
            rows.append({"base": "falcon_h1_7b", "kv_codec": "bf16", "reuse": "share",
                         "budget": "b63", "org": org, "state_codec": codec,
                         "throughput_span": t, "running_mean": t / 10, "running_max": 5})
    return pd.DataFrame(rows)


def test_ranking_flags_a_changed_order():
    out = q11.ranking(_cells({"auto": [100.0, 200.0, 300.0], "fp8_e4m3": [350.0, 200.0, 300.0],
                              "int8": [100.0, 250.0, 300.0]}))
    assert list(out["ranking"]) == ["S2 > S1 > S0", "S0 > S2 > S1", "S2 > S1 > S0"]
    assert list(out["changed"]) == ["-", "YES", "no"]


def test_gains_are_ratios_to_auto_per_organization():
    out = q11.gains(_cells({"auto": [100.0, 200.0, 300.0], "fp8_e4m3": [150.0, 200.0, 330.0]}))
    assert list(out["org"]) == ["S0", "S1", "S2"]
    assert list(out["throughput_ratio"]) == pytest.approx([1.5, 1.0, 1.1])
    assert list(out["running_mean_ratio"]) == pytest.approx([1.5, 1.0, 1.1])


def test_plan_primary_family_is_codec_effect_and_ranking():
    plan = prereg.load_plan("q11_state_codec")
    assert plan.raw["exploratory"] is True
    primary = plan.family("codec_and_ranking")
    assert primary.role == "primary" and len(primary.tests) == 9
    assert {c.keys["model"] for c in primary.cells} == {"falcon_h1_7b", "falcon_h1_7b_fp8"}
    kinds = [t.kind for t in primary.tests]
    assert kinds.count("paired") == 5 and kinds.count("interaction") == 4
    assert {c.keys["org"] for c in plan.family("int8").cells} == {"S0", "S1", "S2", "D0"}
    # amendment 1: 10 seeds (2/2^10 < 0.05/9, so Holm can reject), TQ4 KV crossed in on Granite
    assert len(primary.seeds) == 10 and 2 / 2 ** len(primary.seeds) < 0.05 / 9
    assert {c.keys["model"] for c in plan.family("granite_tq4").cells} == {
        "granite_4_0_h_tiny_tq4", "granite_4_0_h_tiny_tq4_fp8"}


@pytest.mark.slow
def test_make_campaign_q11_smoke_primary(tmp_path):
    import ledgers

    root = tmp_path / "ledgers"
    proc = subprocess.run(["make", "-s", "--no-print-directory", "campaign", "C=q11_state_codec",
                           "SMOKE=1", f"LEDGER_ROOT={root}", "JOBS=2",
                           "ARGS=hydra.sweeper.only=[primary] "
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["planned"], summary["failed"]) == (30, 0)
    con = ledgers.connect(root)
    result = q11.analyze(con)
    assert set(result.frames["cells"]["state_codec"]) == {"auto", "fp8_e4m3"}
    assert len(result.frames["gains"]) == 5
