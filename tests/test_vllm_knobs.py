"""The vLLM knob page (analysis/questions/vllm_knobs.py): settings read back from vLLM's
reported engine_config, the winner table with its tie rule, and the plan's families."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pandas as pd

from analysis.inference import prereg
from analysis.questions.vllm_knobs import setting_of, winner_tests, winners


def _cfg(**kw) -> str:
    base = {"prefix_caching": True, "max_num_batched_tokens": 2048, "retention_interval": 0,
            "block_size": 1568}
    return json.dumps({**base, **kw})


def test_settings_are_read_back_from_vllms_values():
    assert setting_of(_cfg()) == "ret0"
    assert setting_of(_cfg(retention_interval=1568)) == "ret1"
    assert setting_of(_cfg(retention_interval=3136)) == "ret2"
    assert setting_of(_cfg(retention_interval=100)) == "ret100tokens"
    assert setting_of(_cfg(max_num_batched_tokens=4096)) == "mbt4096"
    assert setting_of(_cfg(prefix_caching=False, retention_interval=None)) == "nocache"


def test_winner_is_the_fastest_with_ttft_breaking_a_tie():
    rows = []
    for seed in (1, 2):
        for setting, tput, ttft in (("ret0", 100, 5.0), ("ret1", 110, 9.0),
                                    ("ret2", 110.3, 4.0), ("nocache", 50, 1.0)):
            rows.append({"model": "m", "budget": "b63", "setting": setting, "seed": seed,
                         "throughput_span": tput + seed, "ttft_p50": ttft, "ttft_p99": ttft,
                         "e2e_p50": 1.0, "prefill_tokens_computed": 1.0, "preemptions": 0})
    table, best = winners(pd.DataFrame(rows))
    (win,) = best.itertuples()
    assert win.winner == "ret2" and win.within_tie_band == "ret1"  # 0.3 % apart: TTFT decides
    assert win.seeds_above_default == "2/2"
    ret1 = table.set_index("setting").loc["ret1"]
    assert ret1["vs_default_pct"] > 8.9 and ret1["seeds"] == 2


def test_the_plan_pairs_every_setting_with_the_default():
    plan = prereg.load_plan("vllm_knobs")
    (family,) = plan.families
    assert len(family.cells) == 24 and len(family.tests) == 20
    assert {t.cells["control"].split("_")[1] for t in family.tests} == {"ret0"}
    assert family.decision["method"] == "sign_flip_holm"


def test_each_winner_carries_its_planned_test_against_the_default():
    plan = prereg.load_plan("vllm_knobs")
    tests = pd.DataFrame([{"test": "G108_ret2_vs_ret0", "n": 10, "effect": 3.0, "ci_low": 1.0,
                           "ci_high": 5.0, "p_holm": 0.02, "decision": "reject"}])
    results = [SimpleNamespace(tables={"throughput_span": tests})]
    best = pd.DataFrame([{"model": "granite_4_0_h_tiny", "budget": "b108", "winner": w}
                         for w in ("ret2", "ret0")])
    got = winner_tests(best, plan, results).set_index("winner")
    assert got.loc["ret2", ["test_n", "p_holm", "decision"]].tolist() == [10, 0.02, "reject"]
    assert got.loc["ret0", "decision"] == "the default"
