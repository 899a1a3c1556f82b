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

from analysis import report
from analysis.inference import prereg
from analysis.inference.families import SMOKE_STATUS
from analysis.pages import figures
from analysis.pages import paper_figures as pf
from experiments.run import main_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def ledger(tmp_path_factory):
    return shared_ledger(tmp_path_factory)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory, ledger):
    """Run the report CLI once, recording the axes and titles of every figure it saves."""
    out = tmp_path_factory.mktemp("report")
    seen = {}
    saves = {figures: "_save", pf: "save"}
    originals = {module: getattr(module, name) for module, name in saves.items()}

    def recorder(original):
        def recording_save(fig, path):
            seen[path.name] = {
                "axes": [(ax.get_xlabel(), ax.get_ylabel(), ax) for ax in fig.axes
                         if ax.has_data()],
                "titles": [ax.get_title() for ax in fig.axes]
                + [fig._suptitle.get_text() if fig._suptitle else ""],
                "rotations": [label.get_rotation() for ax in fig.axes
                              for label in ax.get_xticklabels()],
            }
            return original(fig, path)
        return recording_save

    for module, name in saves.items():
        setattr(module, name, recorder(originals[module]))
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            code = report.main(["--ledgers", str(ledger.root), "--out", str(out)])
    finally:
        for module, name in saves.items():
            setattr(module, name, originals[module])
    return out, code, stdout.getvalue(), seen


@pytest.mark.slow  # end to end: the whole report CLI, every page and figure (~15 s CPU)
def test_report_writes_index_pages_tables_and_prints_wall_time(drawn, ledger):
    out, code, stdout, _ = drawn
    assert code == 0
    assert re.fullmatch(r"report wall time: \d+\.\d\d s", stdout.strip().splitlines()[-1])
    index = (out / "index.md").read_text()
    for module in report.QUESTIONS:
        assert f"]({module.QUESTION}.md)" in index
        assert (out / f"{module.QUESTION}.md").is_file()
    assert str(ledger.root.resolve()) in index and "analysis sources sha256:" in index
    assert "## Readings of the AMBIGUOUS items" in index
    assert all(f"| {r['id']} | {r['item']} |" in index for r in prereg.load_readings())
    for campaign in ("q7", "q9"):
        plan_hash = prereg.load_plan(campaign).plan_hash[:12]
        assert re.search(rf"\| {plan_hash} \| {campaign}: {plan_hash} x\d+ \| match \|", index)
    counts = pd.Series([r["campaign"] for r in ledger.rows]).value_counts()
    for campaign, n in counts.items():
        assert re.search(rf"\| {campaign} \| {n} \| {n} \| {n} \| 0 \| {n} \|", index)
    assert "plan-hash check: strict" in index
    assert f"EXT-22 (smoke): {SMOKE_STATUS}" in index
    low = pd.read_csv(out / "tables" / "q1_exp1b.csv")
    assert len(low) == 6 and set(low["org"]) == {"S0", "S1", "S2"}
    ext = pd.read_csv(out / "tables" / "q1_family_ext_22_smoke_throughput_span.csv")
    assert len(ext) == 22 and list(ext["test"])[:2] == ["S1_vs_S0_b63", "S1_vs_S0_b83"]
    assert "No data for CAPS" in (out / "caps.md").read_text()
    for page in ("orig5", "pinning", "d0_split", "caps", "bursts"):
        assert (out / f"{page}.md").is_file()


# The shared ledger holds EXT-22, Q3 (so Exp 2c) and Q6-17 at smoke size only: those figures
# carry the stage in their file names.
PAPER_FIGURES = {"q1_fig2a_throughput_smoke.png", "q1_fig2b_e2e_p99_smoke.png",
                 "q1_fig2cd_low_load.png", "q2_fig3a_c_once.png", "q2_fig3b_index_smoke.png",
                 "q3_fig4_endpoints_smoke.png",
                 "q5_fig5_load_curves.png", "q6_fig6_headroom_smoke.png", "q7_fig7a_state.png",
                 "q8_fig7b_retention.png", "q9_fig7c_kret.png"}


@pytest.mark.slow  # shares the whole report run above
def test_every_figure_is_a_labelled_png_and_svg_stating_its_conditions(drawn):
    out, _, _, seen = drawn
    pngs = sorted((out / "figures").glob("*.png"))
    assert PAPER_FIGURES <= {p.name for p in pngs}
    for path in pngs:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        assert path.with_suffix(".svg").read_text().lstrip().startswith("<?xml")
        height, width = mpimg.imread(path).shape[:2]
        assert height > 200 and width > 300
        record = seen[path.name]
        assert record["axes"], path.name
        assert any(xlabel for xlabel, _, _ in record["axes"]), path.name
        for _, ylabel, _ in record["axes"]:
            assert "(" in ylabel, f"{path.name}: y label without a unit: {ylabel!r}"
        assert set(record["rotations"]) <= {0.0}, path.name  # horizontal tick labels
        page = (out / f"{path.name.split('_')[0]}.md").read_text()
        assert f"(figures/{path.name})" in page
    for name in PAPER_FIGURES:
        titles = " ".join(" ".join(seen[name]["titles"]).split())  # wrapped lines joined
        assert "n = " in titles, (name, titles)  # every paper figure states n
        if name.endswith("_smoke.png"):  # and a smoke figure says so, with its request count
            assert "SMOKE STAGE, 36 requests per run" in titles, (name, titles)
        assert "S2_RETENTION" not in titles and "S2_RETENTION" not in str(
            [ax.get_legend_handles_labels()[1] for _, _, ax in seen[name]["axes"]])


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
    headline = ("> Family `EXT-22` refused: missing 286 of 288 planned runs: S0_b63 seeds "
                "42001-42011, S1_b63 seeds 42001-42011, S2_b63 seeds 42000-42011 and 21 more "
                "cells; fill with `make q1 && make q4 && make campaign C=d0_split && make q3`")
    assert q1_page.index(headline) < q1_page.index("## ")
    assert re.search(r"missing runs: S0_b63 \(.*\) seeds \[42001, 42002", q1_page)
    assert re.search(r"missing runs: S2_b63 \(.*\) seeds \[42000, 42001", q1_page)
    assert "S1_vs_S0_b63" in q1_page  # exploratory row over the seed present
    for question in ("q2", "q3", "q5", "q6", "q7", "q8", "q9"):
        assert f"No data for {question.upper()}" in (out / f"{question}.md").read_text()
    index = (out / "index.md").read_text()
    plan_hash = prereg.load_plan("q1").plan_hash[:12]
    assert re.search(rf"\| Q1 \| q1 \| {plan_hash} \| q1: {plan_hash} x2 \| match \|", index)
    assert "--allow-changed-plan was given" in index
