"""Figures draw one collection stage (issue 20, section 3).

A ledger holds main and smoke runs of the same cells and seeds, the smoke runs with fewer
requests (so their values differ). Fig. 2(a-d), Fig. 5 and Fig. 6 must plot the main-only
run means, computed here straight from the ledger's runs table; a smoke-only figure says
so on the figure with its request count and carries the stage in its file name.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_ledgers import WORKLOAD, cell_overrides
from conftest import compose_config, saved_figures

import ledgers
from analysis.inference import prereg
from analysis.pages import paper_figures as pf
from analysis.questions import q1, q5, q6
from experiments.runners.cell import run_cell
from experiments.runners.ledger_io import run_key, runs_row
from ledgers import write_run

SMOKE_REQUESTS = 16
MAIN_REQUESTS = 24  # the stages differ in size, which the titles state
CELLS = (("q1", "EXT-22", ("S0_b63", "S2_b63")),
         ("q1", "exp1b_low_load", ("S0_b63_low", "S2_b63_low")),
         ("q5", "load_curves", ("S2_b63_r0p8", "D0_b63_r0p8", "S2_b63_r3", "D0_b63_r3")),
         ("q6", "headroom_curves", ("D0_b63_f0", "S2_b63_f0", "S2_b63_f27", "D0_b63_f27")))
SEEDS = 2


def _write(root, cell, campaign, home, seeds, smoke: bool) -> None:
    workload = [w for w in WORKLOAD if not w.startswith("workload.num_requests")]
    size = SMOKE_REQUESTS if smoke else MAIN_REQUESTS
    cfg = compose_config(f"ledger_root={root}", f"campaign_name={campaign}", f"question={home}",
                         *workload, f"workload.num_requests={size}",
                         *cell_overrides(cell.keys))
    for seed in seeds:
        cfg.seed = int(seed)
        key = run_key(cfg)
        result = run_cell(cfg)
        row = runs_row(cfg, key, result, result.summary["wall_seconds"])
        tables = {n: c for n, c in result.tables.items() if len(next(iter(c.values())))}
        write_run(root, key.campaign, key.run_id, tables, row)


@pytest.fixture(scope="module")
def staged_ledger(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages") / "ledger"
    for plan_name, family, ids in CELLS:
        fam = prereg.load_plan(plan_name).family(family)
        for cell in (c for c in fam.cells if c.id in ids):
            home = prereg.cell_campaigns(cell)[-1]
            seeds = cell.seeds[:SEEDS]
            _write(root, cell, home, home, seeds, smoke=False)
            _write(root, cell, f"{home}_smoke", home, seeds, smoke=True)
    return root


@pytest.fixture(scope="module")
def drawn(staged_ledger, tmp_path_factory):
    """Draw Fig. 2, 5 and 6, recording each saved figure's axes before it is closed."""
    out = tmp_path_factory.mktemp("figures")
    con = ledgers.connect(staged_ledger)
    with saved_figures() as seen:
        for module in (q1, q5, q6):
            module.draw(module.analyze(con, allow_changed_plan=True), out)
    runs = con.execute("SELECT * FROM runs").df()
    runs["org"] = runs["org"].str.upper()
    return seen, runs


def _bar_heights(ax) -> list[float]:
    return sorted(round(p.get_height(), 6) for p in ax.patches if p.get_height() > 0)


def _means(runs: pd.DataFrame, campaign: str, by, metric: str, **where) -> list[float]:
    part = runs[runs["campaign"] == campaign]
    for column, values in where.items():
        part = part[part[column].isin(values)]
    return sorted(round(v, 6) for v in part.groupby(by)[metric].mean())


def test_fig2_plots_main_only_means(drawn):
    seen, runs = drawn
    assert {"q1_fig2a_throughput.png", "q1_fig2b_e2e_p99.png",
            "q1_fig2cd_low_load.png"} <= set(seen)
    assert not any("smoke" in name for name in seen)  # main present: main alone
    main = runs[runs["rate"] == 3.0]
    for name, metric in (("q1_fig2a_throughput.png", "throughput_span"),):
        ax = seen[name].axes[0]
        expected = _means(main, "q1", ["org", "budget"], metric)
        assert _bar_heights(ax) == pytest.approx(expected)
        pooled = _means(main[main["campaign"].isin(["q1", "q1_smoke"])].assign(campaign="x"),
                        "x", ["org", "budget"], metric)
        assert pooled != pytest.approx(expected)  # the smoke runs would have moved the bars
    low = runs[runs["rate"] == 0.8]
    bars = [h for ax in seen["q1_fig2cd_low_load.png"].axes for h in _bar_heights(ax)]
    assert sorted(bars) == pytest.approx(_means(low, "q1", ["org", "budget"], "throughput_span"))
    title = seen["q1_fig2a_throughput.png"].axes[0].get_title()
    assert f"main stage, {MAIN_REQUESTS} requests per run" in title


def test_fig5_and_fig6_curves_plot_main_only_means(drawn):
    seen, runs = drawn
    for name, campaign, x in (("q5_fig5_load_curves.png", "q5", "rate"),
                              ("q6_fig6_headroom.png", "q6", "f")):
        fig = seen[name]
        plotted = sorted(round(float(y), 6) for ax in fig.axes for line in ax.lines
                         for y in line.get_ydata())
        assert plotted == pytest.approx(_means(runs, campaign, ["org", "budget", x],
                                               "throughput_span"))
        assert "main stage" in fig._suptitle.get_text()


def test_a_smoke_only_figure_says_so_with_its_request_count(drawn, tmp_path):
    _, runs = drawn
    smoke = runs[runs["campaign"] == "q5_smoke"].assign(stage="smoke", num_requests=SMOKE_REQUESTS)
    seen = {}
    original = pf.save
    pf.save = lambda fig, path: seen.setdefault(path.name, fig) and original(fig, path)
    try:
        written = pf.staged(smoke, tmp_path / "q5_fig5_load_curves.png",
                            lambda r, p, n, s: pf.curves(r, "rate", "λ", p, "t", note=n, stage=s))
    finally:
        pf.save = original
    assert [(stage, path.name) for stage, path in written] == [
        ("smoke", "q5_fig5_load_curves_smoke.png")]
    fig = seen["q5_fig5_load_curves_smoke.png"]
    texts = [t.get_text() for t in fig.texts]
    note = f"SMOKE STAGE, {SMOKE_REQUESTS} requests per run: a pipeline check, not a result"
    assert note in texts and note in fig._suptitle.get_text()
    assert written[0][1].is_file()


def test_figure_stages_prefer_main_and_never_pool():
    frame = pd.DataFrame({"stage": ["smoke", "demo", "smoke"], "x": np.arange(3)})
    assert pf.figure_stages(frame) == ["smoke", "demo"]
    assert pf.figure_stages(frame.assign(stage=["smoke", "main", "demo"])) == ["main"]
    assert pf.figure_stages(frame.head(0)) == []
