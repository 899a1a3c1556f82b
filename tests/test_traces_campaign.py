"""`make traces SMOKE=1` (issue 45), narrowed to S2 and D0 on the first conversation-trace
window and one sessions seed: the runs land under the workload's campaign, a trace repeat is
the window its seed maps to, every request's adopted prefix stays within the recorded bound,
and the page reads them through the plan (conf/prereg/traces.yaml). The winner procedure and
its tie rule are checked by hand on a small frame."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

import ledgers
from analysis.questions import traces
from experiments.campaigns.sweeps import CampaignSpec, expand_jobs

REPO = Path(__file__).resolve().parent.parent


def test_traces_smoke_campaign_and_page(tmp_path):
    root, out = tmp_path / "ledgers", tmp_path / "reports"
    args = (f"org=s2,d0 hydra.sweeper.only=[conversation_w0,sessions] "
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    proc = subprocess.run(["make", "-s", "--no-print-directory", "-o", ".venv/.installed",
                           "traces", "SMOKE=1", "JOBS=2", f"LEDGER_ROOT={root}",
                           f"REPORT_DIR={out}", f"ARGS={args}"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert (summary["planned"], summary["done"], summary["failed"]) == (8, 8, 0)
    con = ledgers.connect(root)
    rows = con.execute("SELECT campaign, org, budget, seed, arrival FROM runs").fetchall()
    assert sorted(rows) == sorted(
        [("traces_conversation_smoke", o, b, 42000, "trace") for o in ("S2", "D0")
         for b in ("16384MiB", "20480MiB")]
        + [("traces_sessions_smoke", o, b, 42000, "poisson") for o in ("S2", "D0")
           for b in ("b63", "b108")])
    over = con.execute("SELECT count(*) FROM requests WHERE reusable_prefix_tokens < 0 "
                       "OR adopted_prefix_tokens > reusable_prefix_tokens").fetchone()[0]
    assert over == 0
    text = (out / "traces.md").read_text()
    assert "Winner per workload and budget" in text and "Realised / possible reuse" in text
    assert "Family `TRACES-WIN (smoke)`" in text
    reuse = pd.read_csv(out / "tables" / "traces_reuse.csv")
    assert set(reuse["workload"]) == {"conversation", "sessions"} and len(reuse) == 8
    assert (reuse["adopted_tokens"] <= reuse["bound_tokens"]).all()
    con.close()


def test_a_trace_repeat_is_the_window_its_seed_maps_to():
    raw = yaml.safe_load((REPO / "conf" / "campaign" / "traces.yaml").read_text())
    jobs = expand_jobs(CampaignSpec.from_config(raw["hydra"]["sweeper"]), [], "traces")
    starts = {}
    for job in jobs:
        over = dict(o.split("=", 1) for o in job.overrides)
        if over.get("workload") == "trace":
            starts.setdefault((over["workload.trace_file"], int(over["seed"])), set()).add(
                int(over["workload.trace_start"]))
    assert len(jobs) == 384 and len(starts) == 16
    assert all(s == {400 * (seed - 42000)} for (_, seed), s in starts.items())


def _group(values: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"seed": 42000 + i, "org": org, "throughput_span": v}
                         for org, vs in values.items() for i, v in enumerate(vs)])


def test_winner_needs_every_holm_test_to_reject_else_a_tie():
    ahead = list(np.linspace(110, 120, 8))
    group = _group({"S2": ahead, "S0": [100] * 8, "D0": [101] * 8})
    candidate, rows = traces.group_tests(group, "throughput_span", 0.05)
    assert candidate == "S2" and all(r["p_exact"] == 2 / 256 for r in rows)
    assert traces.verdict(candidate, rows) == "S2"  # Holm: 2/256 x 2 <= 0.05
    mixed = _group({"S2": ahead, "S0": [100] * 8,
                    "D0": [a + (1 if i % 2 else -1) for i, a in enumerate(ahead)]})
    candidate, rows = traces.group_tests(mixed, "throughput_span", 0.05)
    assert traces.verdict(candidate, rows) == f"tie: {candidate}, " + (
        "D0" if candidate == "S2" else "S2")
