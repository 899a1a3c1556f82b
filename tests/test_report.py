"""`python -m analysis.report`: files, provenance, figures, partial ledgers, changed plans."""

from __future__ import annotations

import contextlib
import importlib
import io
import re

import matplotlib.image as mpimg
import pandas as pd
import pyarrow as pa
import pytest
from analysis_ledgers import LEDGER_REQUESTS, WORKLOAD, shared_ledger
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
            assert f"SMOKE STAGE, {LEDGER_REQUESTS} requests per run" in titles, (name, titles)
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


def test_the_pages_the_report_owns_come_from_the_registries(tmp_path, monkeypatch):
    """Every registered page is owned (cleaned before a report writes), a question added to
    the registry (a q11) with it, and every page module of analysis/questions is registered."""
    import pkgutil
    from types import SimpleNamespace

    from analysis import questions

    owned = report.owned_files()
    assert {f"{q.QUESTION}.md" for q in report.QUESTIONS} <= set(owned)
    assert {p.PAGE for p in (*report.CAMPAIGN_PAGES, *report.STUDY_PAGES)} <= set(owned)
    assert not any("[" in name for name in owned)  # no hand-written q[1-9].md
    modules = {m.name for m in pkgutil.iter_modules(questions.__path__)}
    # Q6's selection stage, shown on q6.md; the models page's sensitivity table, on models.md
    helpers = {"development", "models_sens"}
    assert modules - helpers == {*questions.QUESTION_MODULES, *questions.CAMPAIGN_PAGE_MODULES}
    for name in questions.QUESTION_MODULES:
        module = importlib.import_module(f"analysis.questions.{name}")
        pages = getattr(module, "PAGES", (module,))
        assert all(callable(p.analyze) and callable(p.draw) and p.TITLE for p in pages)
    q11 = SimpleNamespace(QUESTION="q11", TITLE="A later question")
    monkeypatch.setattr(report, "QUESTIONS", (*report.QUESTIONS, q11))
    (tmp_path / "q11.md").write_text("stale")
    (tmp_path / "notes.md").write_text("the user's")
    report._clean(tmp_path)
    assert not (tmp_path / "q11.md").exists() and (tmp_path / "notes.md").exists()


def test_study_pages_are_written_indexed_and_stale_ones_removed(tmp_path):
    """A ledger root holding only a continuation study: its page is written and listed under
    Studies; a stale page of a study without data is removed; the intro opens the index."""
    from ledgers.studies import STUDY_SCHEMAS, write_study

    row = {f.name: {pa.string(): "", pa.int64(): 0, pa.bool_(): True}[f.type]
           for f in STUDY_SCHEMAS["continuation"]}
    row.update(study_id="20260101T000000-abcdef", org="s2", length_case="C+1", n_tokens=513,
               interval=512, placement="step_end", align_chunks=True,
               split_last_boundary=False, window_b=-1, window_p=-1, first_mismatch=-1)
    write_study(tmp_path / "led", "continuation", {k: [v] for k, v in row.items()})
    out = tmp_path / "report"
    (out / "tables").mkdir(parents=True)
    for stale in ("continuation_http.md", "reload_study.md", "tables/old.csv"):
        (out / stale).write_text("stale")
    summary = report.write_report(tmp_path / "led", out, intro="What this is.\n")
    assert not summary.errors
    assert (out / "continuation.md") in summary.pages
    assert "| s2 | 513 (C+1) | 512 | step_end+align |" in (out / "continuation.md").read_text()
    assert not any((out / s).exists() for s in ("continuation_http.md", "reload_study.md",
                                                  "tables/old.csv"))
    index = (out / "index.md").read_text()
    assert index.startswith("# Hybrid State Lab report\n\nWhat this is.\n")
    studies = index.split("## Studies\n\n")[1]
    assert "(continuation.md)" in studies and "(sensitivity.md)" in studies
    assert "continuation_http.md" not in index
