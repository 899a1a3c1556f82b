"""Report figures (matplotlib, Agg backend): every axis labelled with its unit.

Each function takes the analysis frames, writes one PNG and returns its path,
or None when the frames hold nothing to draw.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.pages.common import METRICS, cell_order
from analysis.pages.text_fit import fit_text
from analysis.pyplot import plt
from ledgers import arms

DPI = 100
_JITTER = np.random.default_rng(0)


def kept(drawn: list[tuple[str, Path | None]]) -> list[tuple[str, Path]]:
    """(caption, path) pairs of the figures actually drawn."""
    return [(caption, path) for caption, path in drawn if path is not None]


def _missing(*frames) -> bool:
    return any(frame is None or frame.empty for frame in frames)


def _color(org: str) -> str:
    return arms.color(org)


def _save(fig, path: Path) -> Path:
    """PNG and SVG; the next figure starts a fresh jitter generator (one per figure)."""
    global _JITTER
    path.parent.mkdir(parents=True, exist_ok=True)
    fit_text(fig, fig.tight_layout)  # titles wider than the canvas wrapped
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
        # K_ret is a ratio of ratios (SHARE over ISOLATE), not a difference of the two effects
        ax.set_xticklabels(["Ret vs S2\nSHARE", "Ret vs S2\nISOLATE",
                            "K_ret: ratio of ratios\n(Ret/S2 SHARE) /\n(Ret/S2 ISOLATE)"],
                           fontsize=8)
        ax.set_ylabel("retention effect on throughput (%)")
        ax.set_xlabel("estimand (dots: seeds; square: effect, 95% paired-t)")
        ax.set_title(f"timebase: {timebase}")
    return _save(fig, path)

