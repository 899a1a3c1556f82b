"""`make traces SMOKE=1` (issue 45), narrowed to S2 and D0 on the first conversation-trace
window (Falcon-H1-7B) and one Granite-4.0-H-Tiny sessions seed: the runs land under the
workload's (and model's) campaign, a trace repeat is the window its seed maps to, every
request's adopted prefix stays within the recorded bound, and the page reads them through
the plan (conf/prereg/traces.yaml), one winner table per model. The Granite half mirrors
Falcon's cells with budgets by the same rule; the winner procedure and its tie rule are
checked by hand on a small frame."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from make_recipe import make_dry_run, recipe_commands, run_in_process

import ledgers
from analysis.inference import prereg
from analysis.questions import traces
from experiments.campaigns.sweeps import CampaignSpec, expand_jobs
from serving_core.executor.device_fit import device_fit
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget

REPO = Path(__file__).resolve().parent.parent


def test_traces_smoke_campaign_and_page(tmp_path):
    root, out = tmp_path / "ledgers", tmp_path / "reports"
    args = (f"org=s2,d0 hydra.sweeper.only=[conversation_w0,granite_sessions] "
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    # the target's recipe (`make -n`: the campaign, then the page) run in this process
    # (tests/make_recipe.py)
    commands = recipe_commands(make_dry_run("traces", "SMOKE=1", "JOBS=2", f"LEDGER_ROOT={root}",
                                            f"REPORT_DIR={out}", f"ARGS={args}"))
    assert [m for m, _ in commands] == ["experiments.run", "analysis.questions.traces"]
    (campaign, campaign_args), (page, page_args) = commands
    assert "hydra.sweeper.only=[conversation_w0,granite_sessions]" in campaign_args
    code, stdout, stderr = run_in_process(campaign, campaign_args)
    assert code == 0, stderr[-2000:]
    summary = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    assert (summary["planned"], summary["done"], summary["failed"]) == (8, 8, 0)
    code, _, stderr = run_in_process(page, page_args)
    assert code == 0, stderr[-2000:]
    con = ledgers.connect(root)
    rows = con.execute("SELECT campaign, model, org, budget, seed, arrival FROM runs").fetchall()
    assert sorted(rows) == sorted(
        [("traces_conversation_smoke", "falcon_h1_7b", o, b, 42000, "trace")
         for o in ("S2", "D0") for b in ("16384MiB", "20480MiB")]
        + [("traces_granite_sessions_smoke", "granite_4_0_h_tiny", o, b, 42000, "poisson")
           for o in ("S2", "D0") for b in ("b63", "b108")])
    over = con.execute("SELECT count(*) FROM requests WHERE reusable_prefix_tokens < 0 "
                       "OR adopted_prefix_tokens > reusable_prefix_tokens").fetchone()[0]
    assert over == 0
    text = (out / "traces.md").read_text()
    assert "Winner per model, workload and budget" in text
    assert "Realised / possible reuse" in text
    assert "Family `TRACES-WIN (smoke)`" in text
    assert "Family `TRACES-WIN-GRANITE (smoke)`" in text
    winners = pd.read_csv(out / "tables" / "traces_winners.csv")
    groups = zip(winners["model"], winners["workload"], winners["budget"], strict=True)
    assert sorted(groups) == sorted(
        [("falcon_h1_7b", "conversation", b) for b in ("16384MiB", "20480MiB")]
        + [("granite_4_0_h_tiny", "sessions", b) for b in ("b63", "b108")])
    reuse = pd.read_csv(out / "tables" / "traces_reuse.csv")
    assert set(zip(reuse["model"], reuse["workload"], strict=True)) == {
        ("falcon_h1_7b", "conversation"), ("granite_4_0_h_tiny", "sessions")}
    assert len(reuse) == 8
    assert (reuse["adopted_tokens"] <= reuse["bound_tokens"]).all()
    con.close()


def test_a_trace_repeat_is_the_window_its_seed_maps_to():
    raw = yaml.safe_load((REPO / "conf" / "campaign" / "traces.yaml").read_text())
    jobs = expand_jobs(CampaignSpec.from_config(raw["hydra"]["sweeper"]), [], "traces")
    starts, models = {}, {}
    for job in jobs:
        over = dict(o.split("=", 1) for o in job.overrides)
        model = over.get("model", "falcon_h1_7b")
        models[model] = models.get(model, 0) + 1
        if over.get("workload") == "trace":
            starts.setdefault((model, over["workload.trace_file"], int(over["seed"])),
                              set()).add(int(over["workload.trace_start"]))
    assert len(jobs) == 768 and models == {"falcon_h1_7b": 384, "granite_4_0_h_tiny": 384}
    assert len(starts) == 32
    assert all(s == {400 * (seed - 42000)} for (_, _, seed), s in starts.items())


def _design(cell: prereg.Cell) -> tuple:
    """A cell's design without its model: campaign (model tag dropped), keys and seeds."""
    keys = {k: v for k, v in cell.keys.items()
            if k not in ("model", "campaign", "d0_attention_fraction")}
    return (cell.keys["campaign"].replace("traces_granite_", "traces_"),
            tuple(sorted(keys.items())), cell.seeds)


def test_the_granite_half_mirrors_falcon_with_budgets_by_the_same_rule():
    """Amendment 2 of the plan: Granite-4.0-H-Tiny's cells are Falcon's (windows, seeds,
    loads, budgets) with D0 at the preset's split; the trace budgets of each model are the
    largest multiple of 4 GiB of state the A100-40GB holds beside its weights and 4 GiB
    below it."""
    plan = prereg.load_plan("traces")
    falcon, granite = plan.family("TRACES-WIN"), plan.family("TRACES-WIN-GRANITE")
    assert sorted(map(_design, falcon.cells)) == sorted(map(_design, granite.cells))
    assert len(granite.cells) == 48 and {c.keys["campaign"] for c in granite.cells} == {
        f"traces_granite_{w}" for w in ("conversation", "synthetic", "sessions", "agentic")}
    for fam, model in ((falcon, "falcon_h1_7b"), (granite, "granite_4_0_h_tiny")):
        g = load_geometry(model)
        assert {c.keys["model"] for c in fam.cells} == {model}
        assert {c.keys["d0_attention_fraction"] for c in fam.cells
                if c.keys["org"] == "D0"} == {g.d0_attention_fraction}
        mib = sorted({int(c.keys["budget"].removesuffix("MiB")) for c in fam.cells
                      if c.keys["arrival"] == "trace"})

        def fits(m, g=g):
            return device_fit(g, "a100", plan_budget(g, f"{m}MiB").model_nominal_bytes).fits

        assert mib == [mib[1] - 4096, mib[1]] and mib[1] % 4096 == 0
        assert fits(mib[1]) and not fits(mib[1] + 4096)


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
