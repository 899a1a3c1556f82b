"""analysis.questions.n0_native on small real ledgers (campaign n0_a100, simulated): the per-org
means and intervals and N0's paired effects agree with values computed directly from the written
tables; the page, its figure and the report hold up with N0 runs present or absent."""

from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import saved_figures
from scipy import stats as scipy_stats

import ledgers
from analysis import report
from analysis.pages import paper_figures as pf
from analysis.questions import n0_native
from ledgers.catalog import LedgerWarning
from tests.analysis_ledgers import write_cells

matplotlib.use("Agg")
ORGS = ("n0", "s0", "s1", "s2", "d0")
BUDGETS = ("b63", "b108")
SEEDS = (0, 1, 2)
LOAD = ("load.rate=20",)  # contention at 36 requests: the orgs differ


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("n0") / "ledgers"
    for org in ORGS:
        for budget in BUDGETS:
            write_cells(root, "n0_a100", "", [*LOAD, f"org={org}", f"budget={budget}"], SEEDS)
    for org in ("n0", "s2"):  # a smoke stage, as `make n0 SMOKE=1` collects it
        write_cells(root, "n0_a100_smoke", "", [*LOAD, f"org={org}", "budget=b63"], (0, 1),
                    question="n0_a100")
    return root


def _table(root, name, campaign="n0_a100"):
    files = sorted((root / name / f"campaign={campaign}").rglob("*.parquet"))
    return pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)


def _expected_runs(root) -> pd.DataFrame:
    """Per run, the readouts computed from the raw runs and requests tables (numpy)."""
    runs, reqs = _table(root, "runs"), _table(root, "requests")
    rows = []
    for run in runs.itertuples():
        mine = reqs[reqs["run_id"] == run.run_id]
        done = mine[mine["status"] == "finished"]
        admitted = mine[~mine["start_s"].isna()]
        rows.append({
            "org": run.org, "budget": run.budget, "seed": int(run.seed),
            "throughput_span": run.throughput_span, "throughput_ledger": run.throughput_ledger,
            "ttft_p99": np.percentile(done["ttft_s"], 99),
            "e2e_p99": np.percentile(done["e2e_s"], 99),
            "prefix_hit_tokens": np.clip(mine["adopted_prefix_tokens"], 0, None).sum(),
            "preemptions": mine["preemptions"].sum(),
            "c_once_tokens": (admitted["prompt_tokens"]
                              - admitted["adopted_prefix_tokens"]).sum()})
    return pd.DataFrame(rows)


def _t_interval(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=float)
    if np.ptp(values) == 0:
        return values[0], values[0]
    return scipy_stats.t.interval(0.95, values.size - 1, loc=values.mean(),
                                  scale=scipy_stats.sem(values))


@pytest.fixture(scope="module")
def written(root, tmp_path_factory):
    out = tmp_path_factory.mktemp("n0_report")
    def facts(fig):
        ax = fig.axes[0]
        return {"legend": ax.get_legend_handles_labels()[1], "title": ax.get_title(),
                "rotations": {t.get_rotation() for t in ax.get_xticklabels()}}

    with saved_figures(facts) as seen:
        page = n0_native.write_page(ledgers.connect(root), out)
    return out, page, seen


def test_per_org_means_and_intervals_match_the_ledgers(root, written):
    out, _, _ = written
    table = pd.read_csv(out / "tables" / "n0_a100_orgs.csv")
    expected = _expected_runs(root)
    assert len(table) == len(ORGS) * len(BUDGETS)
    assert list(table["org"][:5]) == ["S0", "S1", "S2", "D0", "N0"]  # b63 first, N0 last
    for row in table.itertuples():
        mine = expected[(expected["org"] == row.org) & (expected["budget"] == row.condition)]
        assert row.n == 3 and row.seeds == "0-2" and row.stage == "main"
        for r in n0_native.READOUTS:
            low, high = _t_interval(mine[r.name])
            assert getattr(row, r.name) == pytest.approx(mine[r.name].mean(), rel=1e-9)
            assert getattr(row, f"{r.name}_low") == pytest.approx(low, rel=1e-9, abs=1e-9)
            assert getattr(row, f"{r.name}_high") == pytest.approx(high, rel=1e-9, abs=1e-9)


def test_paired_effects_of_n0_match_seedwise_changes(root, written):
    out, _, _ = written
    table = pd.read_csv(out / "tables" / "n0_a100_effects.csv")
    expected = _expected_runs(root).set_index(["org", "budget", "seed"]).sort_index()
    assert list(table["comparison"][:4]) == ["N0 vs S0", "N0 vs S1", "N0 vs S2", "N0 vs D0"]
    assert sorted(zip(table["condition"], table["control"], strict=True)) == sorted(
        (b, c) for b in BUDGETS for c in ("S0", "S1", "S2", "D0"))
    nonzero = 0
    for row in table.itertuples():
        n0 = expected.loc[("N0", row.condition)]
        control = expected.loc[(row.control, row.condition)]
        assert row.n == 3 and row.stage == "main"
        for r in n0_native.READOUTS:
            if r.effect == "pct":
                d = 100.0 * (n0[r.name] / control[r.name] - 1.0)
            else:
                d = n0[r.name] - control[r.name]
            low, high = _t_interval(d)
            assert getattr(row, r.name) == pytest.approx(d.mean(), rel=1e-9, abs=1e-9)
            assert getattr(row, f"{r.name}_low") == pytest.approx(low, rel=1e-9, abs=1e-9)
            assert getattr(row, f"{r.name}_high") == pytest.approx(high, rel=1e-9, abs=1e-9)
            assert getattr(row, f"{r.name}_pos") == (d > 0).sum()
            assert getattr(row, f"{r.name}_neg") == (d < 0).sum()
            nonzero += bool((d != 0).any())
    assert nonzero > len(table)  # the fixture's orgs really differ


def test_page_is_descriptive_with_both_stages_and_a_figure_each(written):
    out, page, seen = written
    text = (out / n0_native.PAGE).read_text()
    assert "no preregistered plan" in text and "No complete runs" not in text
    assert "## Stage main: campaign n0_a100" in text
    assert "## Stage smoke: campaign n0_a100_smoke" in text
    assert "30 runs, seeds 0-2; model falcon_h1_7b" in text and "36 requests per run" in text
    assert "| b63 | N0 (vLLM native) | 3 |" in text and "| b108 | N0 vs D0 | 3 |" in text
    assert "| all | N0 vs S2 | 2 |" in text  # smoke: one budget, so no budget in the label
    for name in ("n0_a100_throughput.png", "n0_a100_smoke_throughput.png"):
        png = out / "figures" / name
        assert png.is_file() and png.with_suffix(".svg").is_file() and png in page.figures
        assert f"(figures/{name})" in text
        record = seen[name]
        assert "N0 (vLLM native)" in record["legend"] and record["rotations"] == {0.0}
        assert "n = " in record["title"] and "cap 63" in record["title"]
    assert seen["n0_a100_throughput.png"]["legend"] == [
        "S0", "S1", "S2", "D0", "N0 (vLLM native)"]
    assert (out / "tables" / "n0_a100_smoke_effects.csv").is_file()


def test_no_runs_page_is_one_line_with_its_command(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.warns(LedgerWarning, match="is empty"):
        con = ledgers.connect(tmp_path / "empty")
    page = n0_native.build(con)
    lines = [line for line in page.text.splitlines() if line]
    assert lines[1:] == ["No complete runs in campaign n0_a100: `make n0` fills it."]
    assert page.tables == {} and page.figures == []


def test_report_with_n0_present_and_absent(root, tmp_path):
    summary = report.write_report(root, tmp_path / "with", allow_changed_plan=True)
    assert not summary.errors
    index = (tmp_path / "with" / "index.md").read_text()
    assert f"- [{n0_native.TITLE}]({n0_native.PAGE})" in index
    assert tmp_path / "with" / "figures" / "n0_a100_throughput.png" in summary.figures
    assert tmp_path / "with" / "tables" / "n0_a100_effects.csv" in summary.tables
    for module in report.QUESTIONS:  # every question page still written, none failed
        assert (tmp_path / "with" / f"{module.QUESTION}.md").is_file()
    other = tmp_path / "other"  # N0 runs under a question's campaign, none in n0_a100
    write_cells(other, "q1", "", ["org=n0", "budget=b63", "engine.pinning_k=2"], (42000,))
    summary = report.write_report(other, tmp_path / "without", allow_changed_plan=True)
    assert not summary.errors
    assert "`make n0` fills it." in (tmp_path / "without" / n0_native.PAGE).read_text()


def test_grouped_bars_legend_names_an_org_missing_from_the_first_budget(tmp_path):
    runs = pd.DataFrame({"org": ["S2", "S2", "N0"], "budget": ["b63", "b108", "b108"],
                         "seed": [0, 0, 0], "throughput_span": [1.0, 2.0, 3.0]})
    labels = []
    original = pf.save
    pf.save = lambda fig, path: labels.extend(fig.axes[0].get_legend_handles_labels()[1])
    try:
        pf.grouped_bars(runs, "throughput_span", "throughput (tokens/s)", "t", tmp_path / "f.png")
    finally:
        pf.save = original
    assert labels == ["S2", "N0 (vLLM native)"]


def test_cli_refuses_a_missing_ledger_root_in_one_line(tmp_path, capsys):
    assert n0_native.main(["--ledgers", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --ledgers=")
