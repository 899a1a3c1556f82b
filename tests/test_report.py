"""`python -m analysis.report`: files, provenance, figures, partial ledgers, changed plans."""

from __future__ import annotations

import contextlib
import io
import re

import matplotlib.image as mpimg
import pandas as pd
import pytest
from analysis_ledgers import WORKLOAD, shared_ledger
from conftest import compose_config

from analysis import figures, prereg, report
from experiments.run import main_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def ledger(tmp_path_factory):
    return shared_ledger(tmp_path_factory)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory, ledger):
    """Run the report CLI once, recording the axes of every figure it saves."""
    out = tmp_path_factory.mktemp("report")
    axes = {}
    save = figures._save

    def recording_save(fig, path):
        axes[path.name] = [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes if ax.has_data()]
        return save(fig, path)

    figures._save = recording_save
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = report.main(["--ledgers", str(ledger.root), "--out", str(out),
                                "--plans", str(ledger.plan_dir)])
    finally:
        figures._save = save
    return out, code, stdout.getvalue(), axes


def test_report_writes_index_pages_tables_and_prints_wall_time(drawn, ledger):
    out, code, stdout, _ = drawn
    assert code == 0
    assert re.fullmatch(r"report wall time: \d+\.\d\d s", stdout.strip().splitlines()[-1])
    index = (out / "index.md").read_text()
    for module in report.QUESTIONS:
        assert f"]({module.QUESTION}.md)" in index
        assert (out / f"{module.QUESTION}.md").is_file()
    assert str(ledger.root.resolve()) in index and "analysis sources sha256:" in index
    for campaign in ("q1", "q7", "q9"):
        plan_hash = prereg.load_plan(campaign, ledger.plan_dir).plan_hash[:12]
        assert re.search(rf"\| {plan_hash} \| {campaign}: {plan_hash} x\d+ \| match \|", index)
    counts = pd.Series([r["campaign"] for r in ledger.rows]).value_counts()
    for campaign, n in counts.items():
        assert re.search(rf"\| {campaign} \| {n} \| {n} \| {n} \| 0 \| {n} \|", index)
    assert "plan-hash check: strict" in index
    cells = pd.read_csv(out / "tables" / "q1_cells.csv")
    assert set(cells["cell"]) == {"S0", "S1", "S2", "D0"}
    family = pd.read_csv(out / "tables" / "q1_family_steps_throughput.csv")
    assert list(family["test"])[:2] == ["S1_vs_S0", "S2_vs_S1"]
    assert "No data for Q2" in (out / "q2.md").read_text()
    assert "No data for Q3" in (out / "q3.md").read_text()


def test_every_figure_is_a_valid_png_with_labelled_axes(drawn):
    out, _, _, axes = drawn
    pngs = sorted((out / "figures").glob("*.png"))
    expected = {"q1_throughput.png", "q1_steps.png", "q4_d0_vs_s2.png", "q5_load_curves.png",
                "q6_headroom.png", "q7_depth.png", "q8_depth.png", "q9_kret.png"}
    assert expected <= {p.name for p in pngs}
    for path in pngs:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        height, width = mpimg.imread(path).shape[:2]
        assert height > 200 and width > 300
        assert axes[path.name], path.name
        for xlabel, ylabel in axes[path.name]:
            assert xlabel and ylabel, (path.name, xlabel, ylabel)
            assert "(" in ylabel, f"{path.name}: y label without a unit: {ylabel!r}"
        page = (out / f"{path.name.split('_')[0]}.md").read_text()
        assert f"(figures/{path.name})" in page


def test_partial_ledger_from_the_runner_names_missing_runs_and_states_allowance(tmp_path):
    root = tmp_path / "ledger"
    for org in ("s0", "s1"):  # two Exp 1a cells of the real Q1 plan, one seed each
        main_run(compose_config(f"ledger_root={root}", "campaign_name=q1", "question=q1",
                                *WORKLOAD[:2], f"org={org}", "budget=b63", "seed=42000",
                                "engine.pinning_k=2"))
    out = tmp_path / "report"
    summary = report.write_report(root, out, allow_changed_plan=True)
    assert not summary.errors
    q1_page = (out / "q1.md").read_text()
    assert "Family `EXT-22` (primary, sign_flip_holm, m = 22): refused" in q1_page
    assert q1_page.index("> Family `EXT-22` refused: missing runs") < q1_page.index("## ")
    assert re.search(r"missing runs: S0_b63 \(.*\) seeds \[42001, 42002", q1_page)
    assert re.search(r"missing runs: S2_b63 \(.*\) seeds \[42000, 42001", q1_page)
    assert "S1 vs S0" in q1_page  # the descriptive step change over the seed present
    for question in ("q2", "q3", "q5", "q6", "q7", "q8", "q9"):
        assert f"No data for {question.upper()}" in (out / f"{question}.md").read_text()
    index = (out / "index.md").read_text()
    plan_hash = prereg.load_plan("q1").plan_hash[:12]
    assert re.search(rf"\| Q1 \| q1 \| {plan_hash} \| q1: {plan_hash} x2 \| match \|", index)
    assert "--allow-changed-plan was given" in index
