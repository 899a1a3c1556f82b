"""analysis.questions.vllm_arm on small real ledgers (simulated cells in campaign vllm_native): the
per-arm table agrees with values computed directly from the written tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

import ledgers
from analysis.questions import vllm_arm
from tests.analysis_ledgers import write_cells


def _table(root, name):
    files = sorted((root / name).rglob("*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def test_per_arm_metrics_match_the_ledgers(tmp_path):
    root = tmp_path / "ledgers"
    for org in ("s0", "s2"):
        write_cells(root, vllm_arm.CAMPAIGN, "", ["model=falcon_h1_tiny", f"org={org}",
                                                  "budget=b63"], seeds=(0, 1))
    con = ledgers.connect(root)
    arms = vllm_arm.per_arm(vllm_arm.per_run(con)).set_index("arm")
    runs, reqs, poll = _table(root, "runs"), _table(root, "requests"), _table(root, "poller")
    assert sorted(arms.index) == ["ours S0 (sim)", "ours S2 (sim)"]
    for org in ("S0", "S2"):
        ids = runs.loc[runs["org"] == org, "run_id"]
        row = arms.loc[f"ours {org} (sim)"]
        assert row["seeds"] == 2
        assert np.isclose(row["throughput"], runs.loc[runs["org"] == org,
                                                      "throughput_ledger"].mean())
        mine = reqs[reqs["run_id"].isin(ids)]
        assert row["prefix_hit_tokens"] == mine.groupby("run_id")[
            "adopted_prefix_tokens"].sum().mean()
        p99 = [np.percentile(g.loc[g["status"] == "finished", "ttft_s"], 99)
               for _, g in mine.groupby("run_id")]
        assert np.isclose(row["ttft_p99"], np.mean(p99))
        pre = poll[poll["run_id"].isin(ids)].groupby("run_id")["preemptions_total"].max()
        assert row["preemptions"] == pre.mean()
        assert np.isnan(row["boot_s"])  # no vLLM in these arms
    text = vllm_arm.section(con)
    assert "| ours S2 (sim) | 2 |" in text and "No vLLM run is complete yet." in text
    assert vllm_arm.write_page(con, tmp_path / "report") == tmp_path / "report" / vllm_arm.PAGE
