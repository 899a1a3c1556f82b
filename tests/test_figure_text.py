"""No figure text leaves the canvas (issue 43): Q1's and Q9's demo-stage figures, whose
titles carry the stage note and the cell conditions, are drawn with the titles and notes
their questions give them, and every visible text artist's extent must lie inside the
figure's box; long titles wrap (analysis/pages/text_fit.py)."""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

from analysis.pages import paper_figures as pf
from analysis.pages.text_fit import fit_text

SEEDS = (0, 1, 2)


def _q1_runs(budgets=("b63",), rate=3.0) -> pd.DataFrame:
    rng = np.random.default_rng(1)
    rows = [{"org": org, "budget": budget, "seed": seed, "stage": "demo",
             "num_requests": 300, "cap": 63, "rate": rate, "q": 1, "f": 0, "pinning_k": 2,
             "arrival": "poisson", "throughput_span": rng.uniform(250, 500),
             "e2e_p99": rng.uniform(50, 180), "ttft_p99": rng.uniform(0, 5),
             "waiting_max": float(rng.integers(0, 6))}
            for org in ("S0", "S1", "S2") for budget in budgets for seed in SEEDS]
    return pd.DataFrame(rows)


def _q9() -> tuple[pd.DataFrame, pd.DataFrame]:
    rng = np.random.default_rng(2)
    runs = pd.DataFrame([{"org": org, "reuse": reuse, "seed": seed, "stage": "demo",
                          "num_requests": 300, "throughput_ledger": rng.uniform(400, 700)}
                         for org in ("S2", "S2_RETENTION") for reuse in ("isolate", "share")
                         for seed in SEEDS])
    summary = pd.DataFrame({"estimand": ["delta_share", "delta_isolate", "K_ret"],
                            "effect_pct": [19.2, 0.0, 19.2], "ci_low_pct": [9.1, -0.1, 9.07],
                            "ci_high_pct": [30.3, 0.1, 30.27]})
    return runs, summary


@pytest.fixture()
def recorded(monkeypatch):
    """Every figure pf.save writes, kept after it is laid out, saved and closed."""
    seen = {}
    original = pf.save

    def recording_save(fig, path):
        seen[path.name] = fig
        return original(fig, path)

    monkeypatch.setattr(pf, "save", recording_save)
    return seen


def outside(fig) -> list[str]:
    """Visible, non-empty text artists whose window extent leaves the figure's box."""
    if not hasattr(fig.canvas, "get_renderer"):  # closed by pf.save: lay it on Agg again
        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    out = []
    for text in fig.findobj(Text):
        if not (text.get_visible() and text.get_text().strip()):
            continue
        ext = text.get_window_extent(renderer)
        if (ext.x0 < box.x0 - 0.5 or ext.x1 > box.x1 + 0.5 or ext.y0 < box.y0 - 0.5
                or ext.y1 > box.y1 + 0.5):
            out.append(f"{text.get_text()[:60]!r} {ext.x0:.0f}..{ext.x1:.0f} x "
                       f"{ext.y0:.0f}..{ext.y1:.0f} in {box.x1:.0f} x {box.y1:.0f}")
    return out


def test_q1_and_q9_demo_figures_keep_their_text_on_the_canvas(recorded, tmp_path):
    main, low = _q1_runs(), _q1_runs(("b63", "b108"), rate=0.8)
    note = pf.stage_note(main, "demo")
    assert note == "DEMO STAGE, 300 requests per run: a pipeline check, not a result"
    # as analysis/questions/q1.py and q9.py draw them
    pf.grouped_bars(main, "throughput_span", "throughput, request span (output tokens/s)",
                    "Main throughput (Exp 1a)", tmp_path / "q1_fig2a.png", note, "demo")
    pf.grouped_bars(main, "e2e_p99", "E2E p99, mean of run p99s (s)",
                    "Main E2E p99 (Exp 1a)", tmp_path / "q1_fig2b.png", note, "demo")
    pf.low_load(low, tmp_path / "q1_fig2cd.png", "Low load (Exp 1b)", note, "demo")
    runs, summary = _q9()
    pf.kret_bars(runs, summary, tmp_path / "q9_fig7c.png", "Q9 throughput confirmation",
                 note, "demo")
    assert set(recorded) == {"q1_fig2a.png", "q1_fig2b.png", "q1_fig2cd.png", "q9_fig7c.png"}
    for name, fig in recorded.items():
        assert outside(fig) == [], name
        assert note in [t.get_text() for t in fig.texts], name  # the stage note kept whole
        assert (tmp_path / name).stat().st_size > 0
    # the long titles wrapped rather than shrank: the stage note is still whole, in order
    title = recorded["q9_fig7c.png"].axes[0].get_title()
    assert " ".join(title.split()).startswith(f"Q9 throughput confirmation ({note})")
    assert title.count("\n") >= 2


def test_fit_text_wraps_titles_and_figure_texts_that_overflow():
    fig, (left, right) = plt.subplots(1, 2, figsize=(6, 3))
    long = "a title that states every condition of its cell " * 4
    left.set_title(long)
    right.set_title("short")
    fig.suptitle(long)
    fig.text(0.02, 0.01, long, ha="left", va="bottom")  # as the stage note
    fig.canvas.draw()
    assert outside(fig)  # as drawn before: cut at the edges
    fit_text(fig, fig.tight_layout)
    assert outside(fig) == []
    assert "\n" in left.get_title() and right.get_title() == "short"
    assert " ".join(left.get_title().split()) == long.strip()
    plt.close(fig)
    assert matplotlib.get_backend().lower() == "agg"


def test_a_kept_phrase_is_not_broken_but_set_smaller():
    note = "DEMO STAGE, 300 requests per run: a pipeline check, not a result"
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_title(f"Title ({note})")
    fig.text(0.5, 0.0, note, ha="center", va="bottom", fontsize=10)
    fit_text(fig, fig.tight_layout, keep=[note])
    assert outside(fig) == []
    assert ax.get_title() == f"Title\n({note})"
    (text,) = fig.texts
    assert text.get_text() == note and text.get_fontsize() < 10
    plt.close(fig)
