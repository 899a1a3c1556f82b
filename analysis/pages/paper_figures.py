"""The paper's figures (docs/paper_design.md section 6), drawn from the analysis frames.

Every figure draws one collection stage (`figure_stages`: main when present; a smoke or
demo figure says so on the figure with its request count and carries the stage in its file
name), states its cell conditions and n in its title, uses horizontal tick labels and the
organizations' display names (S2+Retention), has a legend for every colour or marker, draws
its jitter from one generator created for that figure, and is written as PNG and SVG. Each
function returns the PNG path, or None when the frames hold nothing to draw.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.pages.common import budget_rank
from analysis.pages.text_fit import fit_text
from analysis.pyplot import plt
from ledgers import arms

ORG_NAMES = {a.ledger_org: a.display for a in arms.ARMS.values()}  # legend names, in order
DPI = 100
JITTER_SEED = 0  # each figure starts its own generator from this seed
CONDITION_COLUMNS = (("cap", "cap {:g}"), ("rate", "λ {:g}"), ("q", "q {:g}"), ("f", "f {:g}"),
                     ("pinning_k", "pin K {:g}"), ("arrival", "{}"))


STAGES = ("main", "smoke", "demo")  # analysis.pages.common.stage_of
STAGE_NOTE_GID = "stage-note"


def figure_stages(frame) -> list[str]:
    """The stages a figure is drawn for: main alone when the frame holds main-stage rows,
    otherwise each stage present, one figure each (stages never pool)."""
    if _empty(frame):
        return []
    if "stage" not in frame:
        return ["main"]
    present = list(dict.fromkeys(frame["stage"].astype(str)))
    if "main" in present:
        return ["main"]
    return sorted(present, key=lambda s: STAGES.index(s) if s in STAGES else len(STAGES))


def stage_rows(frame, stage: str):
    """The rows of one stage (all rows of a frame without a stage column)."""
    if _empty(frame) or "stage" not in frame:
        return frame
    return frame[frame["stage"].astype(str) == stage]


def stage_path(path: Path, stage: str) -> Path:
    """Main-stage figures keep their name; others carry the stage: q1_fig2a_..._smoke.png."""
    return path if stage == "main" else path.with_name(f"{path.stem}_{stage}{path.suffix}")


def stage_note(frame, stage: str) -> str:
    """"main stage, 300 requests per run", or for a pipeline-check stage
    "SMOKE STAGE, 60 requests per run: a pipeline check, not a result"."""
    count = ""
    if not _empty(frame) and "num_requests" in frame and frame["num_requests"].notna().any():
        low, high = int(frame["num_requests"].min()), int(frame["num_requests"].max())
        count = f", {low if low == high else f'{low}-{high}'} requests per run"
    if stage == "main":
        return f"main stage{count}"
    return f"{stage.upper()} STAGE{count}: a pipeline check, not a result"


def mark_stage(fig, note: str, stage: str) -> None:
    """Write a pipeline-check stage's note across the bottom of the figure itself."""
    if stage != "main":
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=10, color="#b00000",
                 fontweight="bold", gid=STAGE_NOTE_GID)


def staged(frame, path: Path, draw) -> list[tuple[str, Path]]:
    """`draw(rows, path, note, stage)` once per stage of `figure_stages(frame)`; returns
    (stage, png path) for each figure written."""
    out = []
    for stage in figure_stages(frame):
        rows = stage_rows(frame, stage)
        png = draw(rows, stage_path(path, stage), stage_note(rows, stage), stage)
        if png is not None:
            out.append((stage, png))
    return out


def pick_stage(frame, runs=None):
    """(rows, stage, note) for a figure drawn once from a table: the first of
    `figure_stages(frame)`, its rows, and its note with the request count read from `runs`
    (the question's run frame; a table of means carries no request count)."""
    if _empty(frame):
        return frame, "main", ""
    stage = figure_stages(frame)[0]
    counted = stage_rows(runs, stage) if runs is not None and "stage" in runs else None
    return stage_rows(frame, stage), stage, stage_note(
        counted if not _empty(counted) else stage_rows(frame, stage), stage)


def org_name(org: str) -> str:
    return arms.display_name(org)


def _color(org: str) -> str:
    return arms.color(org)


def _empty(frame) -> bool:
    return frame is None or len(frame) == 0


def conditions(runs: pd.DataFrame, skip: Sequence[str] = ()) -> str:
    """The design values every run shares, e.g. "cap 63, λ 3, q 1, f 0, pin K 2"."""
    parts = []
    for column, fmt in CONDITION_COLUMNS:
        if column in skip or column not in runs or runs[column].nunique(dropna=False) != 1:
            continue
        value = runs[column].iloc[0]
        if column == "pinning_k" and float(value) < 0:
            parts.append("no pinning")
        else:
            parts.append(fmt.format(value))
    return ", ".join(parts)


def n_text(runs: pd.DataFrame, by: Sequence[str]) -> str:
    """"n = 12 seeds per bar" (or a range when groups differ)."""
    sizes = runs.groupby(list(by))["seed"].nunique()
    low, high = int(sizes.min()), int(sizes.max())
    return f"n = {low} seeds" if low == high else f"n = {low}-{high} seeds"


def save(fig, path: Path) -> Path:
    """Write PNG and SVG; return the PNG path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    notes = [t.get_text() for t in fig.texts if t.get_gid() == STAGE_NOTE_GID]
    # room for the stage note; titles wider than the canvas wrapped, the note kept whole
    # (analysis/pages/text_fit.py)
    fit_text(fig, lambda: fig.tight_layout(rect=(0, 0.06, 1, 1) if notes else None),
             keep=notes)
    fig.savefig(path, dpi=DPI)
    fig.savefig(path.with_suffix(".svg"))
    plt.close(fig)
    return path


def _note(note: str) -> str:
    return f" ({note})" if note else ""


def _dots(ax, rng, x: float, values, color="black", width: float = 0.08) -> None:
    values = np.asarray(values, dtype=float)
    ax.scatter(x + rng.uniform(-width, width, values.size), values, s=12, color=color,
               edgecolor="white", linewidth=0.4, zorder=3)


def _orgs(runs: pd.DataFrame) -> list[str]:
    order = list(ORG_NAMES)
    return sorted(runs["org"].unique(), key=lambda o: order.index(o) if o in order else 99)


def _budgets(runs: pd.DataFrame) -> list[str]:
    return sorted(runs["budget"].unique(), key=budget_rank)


def grouped_bars(runs: pd.DataFrame, metric: str, ylabel: str, title: str,
                 path: Path, note: str = "", stage: str = "main") -> Path | None:
    """Fig. 2(a, b): arithmetic run means per organization grouped by budget, run dots."""
    if _empty(runs):
        return None
    rng = np.random.default_rng(JITTER_SEED)
    budgets, orgs = _budgets(runs), _orgs(runs)
    width = 0.8 / len(orgs)
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(budgets) + 2), 4.4))
    for j, org in enumerate(orgs):
        label = org_name(org)  # on the org's first drawn bar (it may lack the first budget)
        for i, budget in enumerate(budgets):
            values = runs[(runs["org"] == org) & (runs["budget"] == budget)][metric].dropna()
            x = i + (j - (len(orgs) - 1) / 2) * width
            if len(values):
                ax.bar(x, values.mean(), width, color=_color(org), alpha=0.8, label=label)
                label = None
                _dots(ax, rng, x, values, width=width / 4)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlabel("budget (bars: arithmetic mean over runs; dots: runs)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}{_note(note)}\n{conditions(runs)}; "
                 f"{n_text(runs, ['org', 'budget'])} per bar", fontsize=10)
    ax.legend(title="organization", fontsize=8)
    mark_stage(fig, note, stage)
    return save(fig, path)


def low_load(runs: pd.DataFrame, path: Path, title: str, note: str = "",
             stage: str = "main") -> Path | None:
    """Fig. 2(c, d): per budget, throughput bars (left), TTFT p99 diamonds and E2E p99
    circles (right), and the waiting gauge's run maxima per organization (micro-table)."""
    if _empty(runs):
        return None
    rng = np.random.default_rng(JITTER_SEED)
    budgets, orgs = _budgets(runs), _orgs(runs)
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 4.6), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        part = runs[runs["budget"] == budget]
        right = ax.twinx()
        rows = []
        for i, org in enumerate(orgs):
            group = part[part["org"] == org]
            if group.empty:
                continue
            ax.bar(i, group["throughput_span"].mean(), 0.6, color=_color(org), alpha=0.8)
            _dots(ax, rng, i, group["throughput_span"])
            right.scatter(i - 0.12, group["ttft_p99"].mean(), marker="D", color="black", zorder=4)
            right.scatter(i + 0.12, group["e2e_p99"].mean(), marker="o", facecolor="white",
                          edgecolor="black", zorder=4)
            rows.append(f"{org_name(org)}: {group['waiting_max'].min():g}-"
                        f"{group['waiting_max'].max():g}")
        ax.set_xticks(range(len(orgs)), [org_name(o) for o in orgs])
        ax.set_xlabel("organization")
        ax.set_ylabel("throughput, request span (output tokens/s)")
        right.set_ylabel("latency p99, mean of run p99s (s)")
        right.set_ylim(0, 1.35 * right.get_ylim()[1])
        ax.text(0.02, 0.98, "Waiting gauge · run maxima\n" + "\n".join(rows),
                transform=ax.transAxes, va="top", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "#999999"})
        ax.set_ylim(0, 1.35 * max(ax.get_ylim()[1], 1.0))
        ax.set_title(textwrap.fill(f"Low load · {budget}: {conditions(part)}; "
                                   f"{n_text(part, ['org'])} per bar", 60), fontsize=9)
    handles = [plt.Line2D([], [], marker="D", color="black", linestyle="", label="TTFT p99"),
               plt.Line2D([], [], marker="o", markerfacecolor="white", color="black", linestyle="",
                      label="E2E p99"),
               *[plt.Line2D([], [], marker="s", color=_color(o), linestyle="", label=org_name(o))
                 for o in orgs]]
    axes[0][-1].legend(handles=handles, loc="upper right", ncol=2, fontsize=7)
    fig.suptitle(f"{title}{_note(note)}", fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)


def _grouped(frame: pd.DataFrame, bar: str, bars: list, group: str, groups: list,
             width: float):
    """(group index, bar value, x, row) of every grouped bar that has a row in `frame`:
    bars of each `bar` value side by side within each `group` position, bar by bar."""
    for j, b in enumerate(bars):
        for i, g in enumerate(groups):
            row = frame[(frame[bar] == b) & (frame[group] == g)]
            if not row.empty:
                yield i, b, i + (j - (len(bars) - 1) / 2) * width, row


def c_once_bars(cells: pd.DataFrame, path: Path, title: str, note: str = "",
                stage: str = "main") -> Path | None:
    """Fig. 3(a): C_once bars (10^3 tokens/run) with hollow throughput symbols per
    organization, groups by operating point (three-run means)."""
    if _empty(cells):
        return None
    points = list(dict.fromkeys(cells["point"]))
    orgs = _orgs(cells)
    width = 0.8 / len(orgs)
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    right = ax.twinx()
    for i, org, x, row in _grouped(cells, "org", orgs, "point", points, width):
        ax.bar(x, row["c_once_tokens"].iloc[0] / 1e3, width, color=_color(org), alpha=0.8,
               label=org_name(org) if i == 0 else None)
        right.scatter(x, row["throughput_span"].iloc[0], marker="o", facecolor="white",
                      edgecolor="black", zorder=4)
    ax.set_xticks(range(len(points)), points)
    ax.set_xlabel("operating point (three-run means)")
    ax.set_ylabel("C_once (10³ tokens/run)")
    right.set_ylabel("throughput, request span (tokens/s)")
    right.set_ylim(bottom=0)
    handles = [*ax.get_legend_handles_labels()[0],
               plt.Line2D([], [], marker="o", markerfacecolor="white", color="black", linestyle="")]
    labels = [*ax.get_legend_handles_labels()[1], "throughput"]
    ax.legend(handles, labels, fontsize=8, loc="upper left")
    n = int(cells["n"].min())
    ax.set_title(f"{title}{_note(note)}\nq 1, f 0, pin K 2; n = {n} seeds per bar", fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)


def index_panel(index: pd.DataFrame, path: Path, title: str, note: str = "",
                stage: str = "main") -> Path | None:
    """Fig. 3(b): normalized C_once bars and the S0-normalized throughput index line."""
    if _empty(index):
        return None
    x = np.arange(len(index))
    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    ax.bar(x, index["c_once_index"], 0.6, color=[_color(o) for o in index["org"]], alpha=0.7,
           label="C_once / C_once(S0), within seed")
    ax.plot(x, index["t_index"], marker="o", color="black", label="throughput index (S0 = 1)")
    ax.set_xticks(x, [org_name(o) for o in index["org"]])
    ax.set_xlabel("organization")
    ax.set_ylabel("index relative to S0 (ratio, S0 = 1)")
    ax.axhline(1.0, color="#999999", linewidth=0.8)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"{title}{_note(note)}\nn = {int(index['n'].min())} seeds", fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)


def endpoint_bars(table: pd.DataFrame, path: Path, title: str, note: str = "",
                  stage: str = "main") -> Path | None:
    """Fig. 4: mean seedwise throughput effect (%) at q = 0 and q = 1 for S1 over S0 and
    S2 over S1 (table columns: q, step, effect, n, and per-seed `values`)."""
    if _empty(table):
        return None
    rng = np.random.default_rng(JITTER_SEED)
    qs = sorted(table["q"].unique())
    steps = list(dict.fromkeys(table["step"]))
    width = 0.8 / len(steps)
    colors = {"S1 over S0": _color("S1"), "S2 over S1": _color("S2"), "D0 over S2": _color("D0")}
    fig, ax = plt.subplots(figsize=(6.0, 4.4))
    for i, step, x, row in _grouped(table, "step", steps, "q", qs, width):
        q = qs[i]
        value = float(row["effect"].iloc[0])
        ax.bar(x, value, width, color=colors.get(step, "#dd8452"),
               label=step if i == 0 else None)
        ax.annotate(f"{value:.3f}" if q == 0 else f"{value:.1f}", (x, value), ha="center",
                    va="bottom" if value >= 0 else "top", fontsize=8)
        _dots(ax, rng, x, row["values"].iloc[0], width=width / 4)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(qs)), [f"q = {q:g}" for q in qs])
    ax.set_xlabel("shared-context fraction q (dots: seeds)")
    ax.set_ylabel("mean seedwise throughput effect (%)")
    ax.legend(fontsize=8)
    ax.set_title(f"{title}{_note(note)}\nb83, λ 3, cap 63, f 0, pin K 2; "
                 f"n = {int(table['n'].min())} seeds",
                 fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)


def curves(runs: pd.DataFrame, x: str, xlabel: str, path: Path, title: str,
           rings: dict | None = None, note: str = "", stage: str = "main") -> Path | None:
    """Fig. 5 and 6: one panel per budget, arithmetic means of run throughput against `x`
    per organization; `rings` {(budget, org): x} marks preselected values with open rings."""
    if _empty(runs):
        return None
    budgets = _budgets(runs)
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.8 * len(budgets), 4.0), squeeze=False)
    for k, (ax, budget) in enumerate(zip(axes[0], budgets, strict=True)):
        part = runs[runs["budget"] == budget]
        for org in _orgs(part):
            means = part[part["org"] == org].groupby(x)["throughput_span"].mean().sort_index()
            ax.plot(means.index, means.values, marker="o", color=_color(org),
                    label=org_name(org))
            if rings and (budget, org) in rings and rings[(budget, org)] in means.index:
                at = rings[(budget, org)]
                ax.scatter([at], [means[at]], s=220, facecolor="none", edgecolor=_color(org),
                           linewidth=1.6, zorder=4)
        ax.set_xticks(sorted(part[x].unique()))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput, request span (output tokens/s)")
        ax.set_title(textwrap.fill(f"({chr(97 + k)}) {budget}: {conditions(part, skip=(x,))}; "
                                   f"{n_text(part, ['org', x])} per point", 56), fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        if rings:
            handles.append(plt.Line2D([], [], marker="o", markersize=11, markerfacecolor="none",
                                  color="black", linestyle=""))
            labels.append("preselected f")
        ax.legend(handles, labels, fontsize=8)
    fig.suptitle(f"{title}{_note(note)}", fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)


def depth_per_seed(table: pd.DataFrame, path: Path, title: str, by: str,
                   metrics: Sequence[tuple[str, str, str]], open_value, note: str = "",
                   stage: str = "main") -> Path | None:
    """Fig. 7(a, b): mean request depth over INITIAL admissions per seed. `by` separates
    open (== open_value) from filled markers; `metrics` are (column, label, marker).
    A column `rmax_m0` draws a downward bar from the plotted M1 value to M0."""
    if _empty(table):
        return None
    seeds = sorted(table["seed"].unique())
    groups = list(dict.fromkeys(table[by]))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    offsets = np.linspace(-0.2, 0.2, len(metrics) * len(groups))
    handles = []
    for k, (column, label, marker) in enumerate(metrics):
        color = ("#8172b2", "#7f7f7f", "#c44e52")[k % 3]
        for g, group in enumerate(groups):
            rows = table[table[by] == group].set_index("seed").reindex(seeds)
            x = np.arange(len(seeds)) + offsets[k * len(groups) + g]
            filled = group != open_value
            ax.scatter(x, rows[column], marker=marker, s=60, edgecolor=color,
                       facecolor=color if filled else "white", linewidth=1.4, zorder=3)
            if column == "rmax_m1" and "rmax_m0" in rows:
                ax.vlines(x, rows["rmax_m0"], rows["rmax_m1"], color=color, linewidth=1)
        handles.append(plt.Line2D([], [], marker=marker, color=color, linestyle="", label=label))
    for group in groups:
        handles.append(plt.Line2D([], [], marker="o", color="black", linestyle="",
                              markerfacecolor="black" if group != open_value else "white",
                              label=str(group)))
    ax.set_xticks(range(len(seeds)), [str(s) for s in seeds])
    ax.set_xlabel("workload seed")
    ax.set_ylabel("mean depth over INITIAL admissions (tokens/request)")
    ax.legend(handles=handles, fontsize=8, loc="best")
    count = ""
    if "initial_episodes" in table:
        low, high = int(table["initial_episodes"].min()), int(table["initial_episodes"].max())
        count = f"; n = {low}{'' if low == high else f'-{high}'} INITIAL requests per point"
    ax.set_title(textwrap.fill(f"{title}{count}{_note(note)}", 80), fontsize=9)
    mark_stage(fig, note, stage)
    return save(fig, path)


def kret_bars(runs: pd.DataFrame, summary: pd.DataFrame | None, path: Path,
              title: str, note: str = "", stage: str = "main") -> Path | None:
    """Fig. 7(c): six-seed geometric-mean ledger throughput bars for S2 and S2+Retention by
    reuse mode, every run as a dot, and the boxed K_ret with its 95% CI."""
    if _empty(runs):
        return None
    rng = np.random.default_rng(JITTER_SEED)
    modes = [m for m in ("isolate", "share") if m in set(runs["reuse"])]
    orgs = [o for o in ("S2", "S2_RETENTION") if o in set(runs["org"])]
    fig, ax = plt.subplots(figsize=(6.0, 4.6))
    for j, org in enumerate(orgs):
        for i, mode in enumerate(modes):
            values = runs[(runs["org"] == org) & (runs["reuse"] == mode)]["throughput_ledger"]
            values = values[values > 0]
            if values.empty:
                continue
            x = i + (j - 0.5) * 0.38
            ax.bar(x, float(np.exp(np.log(values).mean())), 0.36, color=_color(org),
                   alpha=0.8, label=org_name(org) if i == 0 else None)
            _dots(ax, rng, x, values, width=0.06)
    ax.set_xticks(range(len(modes)), [m.upper() for m in modes])
    ax.set_xlabel("reuse mode (bars: geometric mean over seeds; dots: runs)")
    ax.set_ylabel("throughput, ledger timebase (output tokens/s)")
    ax.legend(fontsize=8, loc="lower right")
    if summary is not None and len(summary):
        rows = summary.set_index("estimand")
        lines = [f"Δ_{m}: {rows.loc[f'delta_{m.lower()}', 'effect_pct']:+.2f}% (secondary)"
                 for m in ("SHARE", "ISOLATE") if f"delta_{m.lower()}" in rows.index]
        if "K_ret" in rows.index:
            k = rows.loc["K_ret"]
            lines.append(f"K_ret {k['effect_pct']:+.2f}% [{k['ci_low_pct']:+.2f}, "
                         f"{k['ci_high_pct']:+.2f}] 95% CI, ledger timebase")
        ax.text(0.02, 0.98, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "black"})
        ax.set_ylim(0, 1.3 * ax.get_ylim()[1])
    n = runs.groupby(["org", "reuse"])["seed"].nunique().min()
    ax.set_title(f"{title}{_note(note)}\n254 S2 pages, λ 3, cap 63, f 0, pin K 1; "
                 f"n = {n} seeds per bar",
                 fontsize=10)
    mark_stage(fig, note, stage)
    return save(fig, path)
