"""Report figures (matplotlib, Agg backend): every axis labelled with its unit.

Each function takes the analysis frames, writes one PNG and returns its path,
or None when the frames hold nothing to draw.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.common import METRICS, budget_rank, cell_order  # noqa: E402

ORG_COLORS = {"S0": "#8c8c8c", "S1": "#4c72b0", "S2": "#55a868", "D0": "#c44e52",
              "S2_RETENTION": "#8172b2"}
DPI = 100
_JITTER = np.random.default_rng(0)


def kept(drawn: list[tuple[str, Path | None]]) -> list[tuple[str, Path]]:
    """(caption, path) pairs of the figures actually drawn."""
    return [(caption, path) for caption, path in drawn if path is not None]


def _missing(*frames) -> bool:
    return any(frame is None or frame.empty for frame in frames)


def _color(org: str) -> str:
    return ORG_COLORS.get(str(org), "#dd8452")


def _save(fig, path: Path) -> Path:
    """PNG and SVG; the next figure starts a fresh jitter generator (one per figure)."""
    global _JITTER
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    fig.savefig(path.with_suffix(".svg"))
    plt.close(fig)
    _JITTER = np.random.default_rng(0)
    return path


def _dots(ax, x: float, values, color="black") -> None:
    values = np.asarray(values, dtype=float)
    offsets = _JITTER.uniform(-0.15, 0.15, values.size)
    ax.scatter(x + offsets, values, s=14, color=color, edgecolor="white", linewidth=0.5,
               zorder=3)


def _label_x(ax, labels: list[str]) -> None:
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([textwrap.fill(str(label), 14) for label in labels], rotation=0,
                       fontsize=7)


def throughput_bars(runs: pd.DataFrame, path: Path, title: str,
                    metric: str = "throughput_ledger") -> Path | None:
    """Geometric mean per cell (bar) with each seed's run value (dot)."""
    if _missing(runs):
        return None
    cells = cell_order(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(cells) + 2.5), 4.6))
    for i, cell in enumerate(cells):
        group = runs[runs["cell"] == cell]
        values = group[metric].astype(float).dropna()
        values = values[values > 0]
        height = float(np.exp(np.log(values).mean())) if len(values) else 0.0
        ax.bar(i, height, color=_color(group["org"].iloc[0]), alpha=0.75)
        _dots(ax, i, values)
    _label_x(ax, cells)
    ax.set_ylabel(f"{METRICS[metric].label} ({METRICS[metric].unit})")
    ax.set_xlabel("cell (bar: geometric mean over seeds; dots: seeds)")
    ax.set_title(title)
    return _save(fig, path)


def change_bars(changes: pd.DataFrame, seeds: pd.DataFrame, path: Path, title: str,
                metric: str = "throughput_ledger") -> Path | None:
    """Paired effect per comparison (bar, 95% paired-t interval) with per-seed changes (dots)."""
    if _missing(changes, seeds):
        return None
    rows = changes[changes["metric"] == metric].reset_index(drop=True)
    if rows.empty:
        return None
    scale = METRICS[metric].scale
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2.5), 4.6))
    for i, row in rows.iterrows():
        color = "#55a868" if row["effect"] >= 0 else "#c44e52"
        ax.bar(i, row["effect"] if np.isfinite(row["effect"]) else 0.0, color=color, alpha=0.7)
        if np.isfinite(row["ci_low"]):
            ax.errorbar(i, row["effect"], yerr=[[row["effect"] - row["ci_low"]],
                                                [row["ci_high"] - row["effect"]]],
                        color="black", capsize=4, linewidth=1)
        d = seeds[(seeds["comparison"] == row["comparison"]) & (seeds["metric"] == metric)]["d"]
        _dots(ax, i, 100 * np.expm1(d) if scale == "log" else d)
    ax.axhline(0, color="black", linewidth=0.8)
    _label_x(ax, rows["comparison"].tolist())
    unit = "%" if scale == "log" else METRICS[metric].unit
    ax.set_ylabel(textwrap.fill(f"paired change in {METRICS[metric].label} ({unit})", 40))
    ax.set_xlabel("treatment vs control (bar: effect, whiskers: 95% paired-t; dots: seeds)")
    ax.set_title(title)
    return _save(fig, path)


def _budget_panels(runs: pd.DataFrame, rows: int = 1):
    budgets = sorted(runs["budget"].unique(), key=budget_rank)
    fig, axes = plt.subplots(rows, len(budgets), figsize=(4.8 * len(budgets), 3.8 * rows),
                             squeeze=False)
    return fig, axes, budgets


def _curve(ax, runs: pd.DataFrame, x: str, metric: str) -> None:
    """Per org: mean of run values at each x (line) and the seeds (dots)."""
    for org, group in runs.groupby("org", sort=False):
        by_x = group.groupby(x)[metric].mean().sort_index()
        ax.plot(by_x.index, by_x.values, marker="o", color=_color(org), label=org)
        ax.scatter(group[x], group[metric], s=10, color=_color(org), alpha=0.5)


def load_curves(runs: pd.DataFrame, changes: pd.DataFrame, path: Path) -> Path | None:
    """Throughput vs offered load per budget (top) and the D0/S2 effect vs load (bottom)."""
    if _missing(runs):
        return None
    changes = pd.DataFrame() if changes is None else changes
    fig, axes, budgets = _budget_panels(runs, rows=2)
    for j, budget in enumerate(budgets):
        top, bottom = axes[0][j], axes[1][j]
        _curve(top, runs[runs["budget"] == budget], "rate", "throughput_ledger")
        top.set_title(f"budget {budget}")
        top.set_xlabel("offered load lambda (requests/s)")
        top.set_ylabel("throughput, ledger (tokens/s)")
        top.legend(fontsize=8)
        part = (changes[(changes["budget"] == budget) & (changes["metric"] == "throughput_ledger")]
                if len(changes) else changes)
        if len(part):
            part = part.sort_values("rate")
            low = (part["effect"] - part["ci_low"]).fillna(0).clip(lower=0)
            high = (part["ci_high"] - part["effect"]).fillna(0).clip(lower=0)
            bottom.errorbar(part["rate"], part["effect"], yerr=[low, high], marker="o",
                            capsize=3, color=_color("D0"))
        bottom.axhline(0, color="black", linewidth=0.8)
        bottom.set_xlabel("offered load lambda (requests/s)")
        bottom.set_ylabel("D0 vs S2 throughput change (%)")
    return _save(fig, path)


def headroom_curves(runs: pd.DataFrame, path: Path) -> Path | None:
    """Throughput (top) and TTFT p99 (bottom) vs admission headroom f, per budget."""
    if _missing(runs):
        return None
    fig, axes, budgets = _budget_panels(runs, rows=2)
    for j, budget in enumerate(budgets):
        part = runs[runs["budget"] == budget]
        _curve(axes[0][j], part, "f", "throughput_ledger")
        axes[0][j].set_title(f"budget {budget}")
        axes[0][j].set_ylabel("throughput, ledger (tokens/s)")
        axes[0][j].legend(fontsize=8)
        _curve(axes[1][j], part, "f", "ttft_p99")
        axes[1][j].set_ylabel("TTFT p99, mean of run p99s (s)")
        for ax in axes[:, j]:
            ax.set_xlabel("admission headroom f (fraction of units held back)")
    return _save(fig, path)


def relative_curves(changes: pd.DataFrame, path: Path, x: str, xlabel: str,
                    title: str) -> Path | None:
    """Within-seed relative throughput of each treatment vs its control, against `x`."""
    if _missing(changes):
        return None
    rows = changes[changes["metric"] == "throughput_ledger"].copy()
    rows["arm"] = rows["treatment"].str.split().str[0] + " / " + rows["control"].str.split().str[0]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    arms = list(dict.fromkeys(rows["arm"]))
    span = float(rows[x].max() - rows[x].min()) or 1.0
    for k, arm in enumerate(arms):  # a small horizontal dodge keeps equal series visible
        group = rows[rows["arm"] == arm].sort_values(x)
        low = (group["effect"] - group["ci_low"]).fillna(0).clip(lower=0)
        high = (group["ci_high"] - group["effect"]).fillna(0).clip(lower=0)
        dodge = (k - (len(arms) - 1) / 2) * 0.012 * span
        ax.errorbar(group[x] + dodge, 100 + group["effect"], yerr=[low, high], marker="o",
                    capsize=3, color=_color(arm.split(" / ")[0]), label=arm)
    ax.axhline(100, color="black", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative throughput, within seed (% of control)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def work_bars(cells: pd.DataFrame, path: Path) -> Path | None:
    """Recorded input work (stacked prefill initial/resume) and queue gauges per cell."""
    if _missing(cells):
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(9.0, 0.9 * len(cells) + 4), 4.6))
    x = np.arange(len(cells))
    left.bar(x, cells["prefill_tokens_initial_mean"], color="#4c72b0", label="first admission")
    left.bar(x, cells["prefill_tokens_resume_mean"], bottom=cells["prefill_tokens_initial_mean"],
             color="#dd8452", label="recomputed on resume")
    left.set_ylabel("prefill tokens computed per run (tokens)")
    left.legend(fontsize=8)
    width = 0.4
    right.bar(x - width / 2, cells["poller_running_mean_mean"], width, label="running")
    right.bar(x + width / 2, cells["poller_waiting_mean_mean"], width, label="waiting")
    right.set_ylabel("poller mean (requests)")
    right.legend(fontsize=8)
    for ax in (left, right):
        _label_x(ax, cells["cell"].tolist())
        ax.set_xlabel("cell (means over seeds)")
    return _save(fig, path)


DEPTH_BARS = (("jenter", "Jenter", None), ("jadopt", "Jadopt", ("j_m0", "j_m1")),
              ("a_m0", "Amax", ("a_m0", "a_m1")), ("rmax_m0", "Rmax", ("rmax_m0", "rmax_m1")),
              ("gap_m0", "GapR", ("gap_m0", "gap_m1")))
CLASS_COLORS = {"zero->zero": "#bbbbbb", "positive-equal": "#55a868", "zero->positive": "#4c72b0",
                "deeper": "#8172b2", "shallower": "#c44e52", "no entry record": "#000000"}


def depth_panels(depth_cells: pd.DataFrame, classes: pd.DataFrame, path: Path,
                 title: str) -> Path | None:
    """Mean depths per cell with M0/M1 brackets (left) and entry-vs-adopted classes (right)."""
    if _missing(depth_cells, classes):
        return None
    n = len(depth_cells)
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10.0, 2.2 * n + 5), 4.8))
    width = 0.8 / len(DEPTH_BARS)
    for k, (column, label, bracket) in enumerate(DEPTH_BARS):
        x = np.arange(n) + (k - (len(DEPTH_BARS) - 1) / 2) * width
        left.bar(x, depth_cells[f"{column}_mean"], width, label=label)
        if bracket:  # a bracket between the M0 and M1 values, not an interval
            lo = depth_cells[[f"{b}_mean" for b in bracket]].min(axis=1)
            hi = depth_cells[[f"{b}_mean" for b in bracket]].max(axis=1)
            left.vlines(x, lo, hi, color="black", linewidth=1)
            left.hlines([*lo, *hi], [*(x - width / 3)] * 2, [*(x + width / 3)] * 2,
                        color="black", linewidth=1)
    _label_x(left, depth_cells["cell"].tolist())
    left.set_ylabel("depth per admission episode (tokens)")
    left.set_xlabel("cell (bars: means of run means; black: M0..M1 bracket)")
    left.set_ylim(0, 1.25 * max(left.get_ylim()[1], 1.0))  # headroom for the legend row
    left.legend(fontsize=7, ncol=len(DEPTH_BARS), loc="upper center")
    bottom = np.zeros(len(classes))
    for name, color in CLASS_COLORS.items():
        column = f"share_{name}"
        if column in classes:
            values = classes[column].fillna(0).to_numpy()
            right.bar(np.arange(len(classes)), values, bottom=bottom, color=color, label=name)
            bottom += values
    _label_x(right, classes["cell"].tolist())
    right.set_ylabel("share of admission episodes (%)")
    right.set_xlabel("cell (entry depth vs adopted depth)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    return _save(fig, path)


def kret_panel(per_seed: pd.DataFrame, summary: pd.DataFrame, path: Path) -> Path | None:
    """Per-seed retention effects and K_ret (dots) with effect and 95% interval, per timebase."""
    if _missing(per_seed, summary):
        return None
    timebases = list(dict.fromkeys(summary["timebase"]))
    fig, axes = plt.subplots(1, len(timebases), figsize=(5.2 * len(timebases), 4.4),
                             squeeze=False)
    names = ["delta_share", "delta_isolate", "K_ret"]
    for ax, timebase in zip(axes[0], timebases, strict=True):
        for i, name in enumerate(names):
            row = summary[(summary["timebase"] == timebase) & (summary["estimand"] == name)]
            seeds = per_seed[(per_seed["timebase"] == timebase) & (per_seed["estimand"] == name)]
            _dots(ax, i, seeds["change_pct"])
            if not row.empty:
                r = row.iloc[0]
                ax.errorbar(i + 0.3, r["effect_pct"], yerr=[[r["effect_pct"] - r["ci_low_pct"]],
                                                            [r["ci_high_pct"] - r["effect_pct"]]],
                            fmt="s", color=_color("S2_RETENTION"), capsize=4)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(["Ret vs S2\nSHARE", "Ret vs S2\nISOLATE", "K_ret\nSHARE - ISOLATE"])
        ax.set_ylabel("retention effect on throughput (%)")
        ax.set_xlabel("estimand (dots: seeds; square: effect, 95% paired-t)")
        ax.set_title(f"timebase: {timebase}")
    return _save(fig, path)

