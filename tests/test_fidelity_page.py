"""fidelity_field.md from ledgers holding the vLLM half alone, the real half alone, and
both: each half's table where its campaigns have paired cells, the fill hint where not."""

from __future__ import annotations

import json

import duckdb
import pandas as pd
import pytest

from analysis.questions import fidelity_field, n0_vllm

DEFAULTS = json.dumps({})
VLLM_RULES = json.dumps(dict(n0_vllm.VLLM_RULES))


def _run(run_id, campaign, executor, config, rate, seed, tput, **cell) -> dict:
    return {"run_id": run_id, "campaign": campaign, "executor": executor,
            "engine_config": config, "org": cell.get("org", "n0"),
            "model": cell.get("model", "falcon_h1_7b"), "budget": cell.get("budget", "b63"),
            "rate": rate, "seed": seed, "created_at": f"2026-12-06T10:00:{seed % 60:02d}",
            "throughput_span": tput, "status": "complete", "adopted": True}


def _virtual() -> list[dict]:
    """n0_vllm: two loads x one seed on vLLM, N0 at its defaults and N0 under vLLM's rules."""
    rows = []
    for rate, tput in ((1.0, 100.0), (3.0, 200.0)):
        rows += [_run(f"v{rate}", "n0_vllm", "vllm_virtual:a100", DEFAULTS, rate, 1, tput),
                 _run(f"s{rate}", "n0_vllm", "sim:a100", DEFAULTS, rate, 1, tput * 1.1),
                 _run(f"r{rate}", "n0_vllm", "sim:a100", VLLM_RULES, rate, 1, tput)]
    return rows


def _real() -> list[dict]:
    """fidelity_real and fidelity_sim: two organizations at one budget, one seed."""
    rows = []
    for org, tput in (("s0", 10.0), ("s2", 20.0)):
        rows += [_run(f"t{org}", "fidelity_real", "torch", DEFAULTS, 2.0, 1, tput, org=org),
                 _run(f"f{org}", "fidelity_sim", "sim:fit", DEFAULTS, 2.0, 1, tput * 0.8,
                      org=org)]
    return rows


def _connect(runs: list[dict]) -> duckdb.DuckDBPyConnection:
    reqs = pd.DataFrame([{"run_id": r["run_id"], "campaign": r["campaign"],
                          "status": "finished", "ttft_s": 0.1 * r["throughput_span"],
                          "tpot_s": tpot, "e2e_s": 1.0, "adopted_prefix_tokens": 5,
                          "preemptions": 0} for r in runs for tpot in (0.01, float("nan"))])
    con = duckdb.connect()
    con.register("runs_df", pd.DataFrame(runs))
    con.register("reqs_df", reqs)
    con.execute("CREATE TABLE runs AS SELECT * FROM runs_df")
    con.execute("CREATE TABLE requests AS SELECT * FROM reqs_df")
    return con


@pytest.mark.parametrize("halves", [("virtual",), ("real",), ("virtual", "real")])
def test_the_page_shows_each_half_present(halves):
    runs = [*(_virtual() if "virtual" in halves else ()), *(_real() if "real" in halves else ())]
    text, info = fidelity_field.section(_connect(runs))
    keys = {"n0_vllm:sim", "n0_vllm:sim_vllm"} if "virtual" in halves else set()
    assert set(info) == keys | ({"fidelity_real"} if "real" in halves else set())
    if "virtual" in halves:
        assert info["n0_vllm:sim"]["mape_pct"]["throughput_span"] == pytest.approx(10.0)
        assert info["n0_vllm:sim_vllm"]["mape_pct"]["throughput_span"] == 0.0
        assert info["n0_vllm:sim"]["mape_pct"]["tpot_p50"] == 0.0  # the NaN TPOT left out
    if "real" in halves:
        assert info["fidelity_real"]["mape_pct"]["throughput_span"] == pytest.approx(20.0)
        assert info["fidelity_real"]["order_agreement_pct"]["org:throughput_span"] == 100.0
    for half, hint in fidelity_field.FILL.items():
        missing = f"No paired cells against the {half} reference yet: `{hint}`."
        assert (missing in text) is (half not in halves)
