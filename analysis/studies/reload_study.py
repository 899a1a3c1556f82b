"""The reload study's report page: `python -m analysis.studies.reload_study [ROOT] [--out DIR]`.

Reads the newest study run of the `reload_study` table (ledgers.studies) and writes
`reload_study.md` with one figure (`figures/reload_study_ttft.png`): TTFT per (condition,
actual path), one panel per prompt length N, every trial a dot, coloured by actual path.
Requests are grouped by the path the server recorded, never by the condition they were
sent under. The two server pairs are two paired repetitions, not independent samples: no
confidence intervals, per-trial values are shown. The LAST output line is JSON
{"requests", "paths", "mismatches", "study_id"} (measured requests; warmups excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

import ledgers
from analysis.pages import common
from analysis.pyplot import plt
from ledgers.studies import RELOAD_CONDITIONS, REQUEST_PATHS

PATH_COLORS = {"recompute": "#4c72b0", "device_reuse": "#55a868", "host_reload": "#c44e52"}
PAGE = "reload_study.md"
TITLE = "Reload study: cold, repeat and reload TTFT over HTTP"
TABLES = ("reload_study",)
FIGURE = "figures/reload_study_ttft.png"
FILL = "make reload-study (python -m experiments.studies.reload_study)"


def measured(full: pd.DataFrame) -> pd.DataFrame:
    return full[full["condition"] != "warmup"].copy()


def ttft_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (N, condition, path, tier): n, restored B and suffix N - B, TTFT
    median / min / max and every trial's value (pair, server order) in order."""
    rows = []
    keys = ["n_tokens", "condition", "path", "host_tier"]
    for (n, cond, path, tier), g in frame.groupby(keys, sort=False):
        g = g.sort_values(["pair", "server", "trial"])
        rows.append({
            "N": n, "condition": cond, "path": path, "tier": "ON" if tier else "OFF",
            "n": len(g), "reused (B)": "/".join(str(v) for v in sorted(set(g.reused_tokens))),
            "suffix N - B": "/".join(str(v) for v in sorted(set(g.suffix_tokens))),
            "first batch": "/".join(sorted({f"{a}+{b}" for a, b in zip(
                g.first_batch_computed, g.first_batch_scheduled, strict=True)})),
            "TTFT median s": float(np.median(g.ttft_s)),
            "min s": float(g.ttft_s.min()), "max s": float(g.ttft_s.max()),
            "trials s": ", ".join(f"{v:.3f}" for v in g.ttft_s),
        })
    order = {c: i for i, c in enumerate(RELOAD_CONDITIONS)}
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    out["_c"] = out.condition.map(order)
    return out.sort_values(["N", "_c", "tier", "path"]).drop(columns="_c")


def _paired(frame: pd.DataFrame, num: tuple[str, str, bool], den: tuple[str, str, bool]
            ) -> list[float]:
    """Per (pair, trial): TTFT of the numerator request over the denominator's, each given
    as (condition, actual path, tier); trials lacking either are skipped."""
    def pick(cond, path, tier):
        g = frame[(frame.condition == cond) & (frame.path == path) & (frame.host_tier == tier)]
        return g.set_index(["pair", "trial"]).ttft_s

    a, b = pick(*num), pick(*den)
    both = a.index.intersection(b.index)
    return [float(a[k] / b[k]) for k in sorted(both)]


RATIOS = (  # name, numerator, denominator, acceptance bound (None: none)
    ("ON cold / OFF cold", ("cold", "recompute", True), ("cold", "recompute", False), 1.05),
    ("reload / repeat (ON, same B)", ("reload", "host_reload", True),
     ("repeat", "device_reuse", True), 1.10),
    ("OFF cold / ON reload", ("cold", "recompute", False), ("reload", "host_reload", True), None),
)


def ratio_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Per N and ratio: the median over trials of the per-trial ratio (the two requests of a
    trial ran back to back, so machine load cancels), the ratio of the medians, every
    per-trial ratio, and the acceptance bound the median ratio is read against."""
    def med(g: pd.DataFrame, spec: tuple[str, str, bool]) -> float:
        cond, path, tier = spec
        return float(np.median(g[(g.condition == cond) & (g.path == path)
                                 & (g.host_tier == tier)].ttft_s))

    rows = []
    for n, g in frame.groupby("n_tokens"):
        for name, num, den, bound in RATIOS:
            paired = _paired(g, num, den)
            if not paired:
                continue
            median = float(np.median(paired))
            rows.append({"N": int(n), "ratio": name, "n": len(paired),
                         "median of per-trial ratios": median,
                         "ratio of medians": med(g, num) / med(g, den),
                         "bound": "" if bound is None else f"<= {bound:.2f}",
                         "within": "" if bound is None else ("yes" if median <= bound
                                                             else "NO"),
                         "per-trial": ", ".join(f"{v:.3f}" for v in paired)})
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame, path: Path) -> Path:
    lengths = sorted(frame.n_tokens.unique())
    groups = [(c, p) for c in RELOAD_CONDITIONS for p in REQUEST_PATHS
              if ((frame.condition == c) & (frame.path == p)).any()]
    fig, axes = plt.subplots(1, len(lengths), figsize=(max(7.5, 4.2 * len(lengths)), 4.4),
                             sharey=True,
                             squeeze=False)
    rng = np.random.default_rng(0)
    for ax, n in zip(axes[0], lengths, strict=True):
        sub = frame[frame.n_tokens == n]
        for x, (cond, p) in enumerate(groups):
            cell = sub[(sub.condition == cond) & (sub.path == p)]
            vals = cell.ttft_s.to_numpy()
            if vals.size:
                for tier, marker in ((False, "s"), (True, "o")):
                    v = cell[cell.host_tier == tier].ttft_s.to_numpy()
                    ax.scatter(x + rng.uniform(-0.15, 0.15, v.size), v, s=18, marker=marker,
                               color=PATH_COLORS[p], edgecolor="white", linewidth=0.5,
                               zorder=3)
                ax.hlines(np.median(vals), x - 0.25, x + 0.25, color="black", linewidth=1)
                ax.annotate(f"n={vals.size}", (x, 0), xytext=(0, 2), textcoords="offset points",
                            ha="center", fontsize=7, xycoords=("data", "axes fraction"))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{c}\n{p}" for c, p in groups], rotation=0, fontsize=7)
        ax.set_title(f"N = {n:,} tokens", fontsize=9)
        ax.set_xlabel("condition sent / actual path")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("TTFT (s)")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=c, label=p)
               for p, c in PATH_COLORS.items()]
    handles += [plt.Line2D([], [], marker=m, linestyle="", color="gray", label=label)
                for m, label in (("s", "tier OFF server"), ("o", "tier ON server"))]
    handles.append(plt.Line2D([], [], color="black", label="median"))
    fig.legend(handles=handles, loc="upper right", fontsize=7, title="actual path",
               title_fontsize=7)
    servers = frame.groupby(["pair", "server"]).ngroups
    fig.suptitle(f"TTFT by condition and actual path; {servers} servers in 2 order-balanced "
                 f"pairs, trials as dots", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 0.9, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary(frame: pd.DataFrame, study_id: str) -> dict:
    return {"requests": int(len(frame)),
            "paths": {p: int((frame.path == p).sum()) for p in REQUEST_PATHS},
            "mismatches": int((~frame.output_matches).sum()), "study_id": study_id}


def page(frame: pd.DataFrame, table: pd.DataFrame, info: dict) -> str:
    out = summary(frame, info["study_id"])
    lines = [
        f"# {TITLE}",
        "",
        f"Study {info['study_id']}; model {info['model']}, org {info['org']} (C = "
        f"{info['interval']}), budget {info['budget']}; effective split_last_boundary "
        f"{'on' if info['split'] else 'off'} (requested on; it acts on aligned chunks only, "
        "S0/S1/S2). Two order-balanced server pairs (OFF then ON, ON "
        "then OFF; ON = host tier), each server fresh with one excluded warmup; the two "
        "servers of a pair run at the same time and take turns, a trial's requests on both "
        "back to back (server order and repeat/reload order alternate by trial); per N, "
        f"{info['trials']} trials with distinct early documents, {info['output_tokens']} "
        "generated tokens, serial streaming over loopback. Conditions: cold, immediate repeat, "
        "and (tier on) reload after POST /reset_prefix_cache. Rows are grouped by the ACTUAL "
        "path the server recorded. The two pairs are paired repetitions, not independent "
        "samples: no intervals; every trial's TTFT is listed.",
        "",
        f"Measured requests: {out['requests']}; by actual path: "
        + ", ".join(f"{p} {n}" for p, n in out["paths"].items())
        + f"; output mismatches: {out['mismatches']}.",
        "",
        "| N | condition | tier | actual path | n | reused (B) | suffix N - B | first batch "
        "(computed+scheduled) | TTFT median s | min s | max s | trials s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples(index=False):
        lines.append(f"| {r.N} | {r.condition} | {r.tier} | {r.path} | {r.n} | {r[5]} | {r[6]} "
                     f"| {r[7]} | {r[8]:.3f} | {r[9]:.3f} | {r[10]:.3f} | {r[11]} |")
    repeats = frame[frame.condition == "repeat"]
    reused = int((repeats.path == "device_reuse").sum())
    reloads = frame[frame.condition == "reload"]
    lines += [
        "",
        f"Repeats that reused the device prefix: {reused} of {len(repeats)}. Reloads that "
        f"restored from the host tier: {int((reloads.path == 'host_reload').sum())} of "
        f"{len(reloads)}; restored B per N: "
        + "; ".join(f"N={n}: B={'/'.join(map(str, sorted(set(g.restored_tokens))))}, "
                    f"recomputed N - B={'/'.join(map(str, sorted(set(g.suffix_tokens))))}"
                    for n, g in reloads.groupby("n_tokens")) + ".",
        "",
        "TTFT ratios per N (acceptance: ON cold at most 1.05x OFF cold; a reload at most 1.10x "
        "the device-reuse repeat of the same B on the same server), read on the median of the "
        "per-trial ratios:",
        "",
        "| N | ratio | n | median of per-trial ratios | ratio of medians | bound | within "
        "| per-trial |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ratio_table(frame).itertuples(index=False):
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.3f} | {r[5]} | {r[6]} "
                     f"| {r[7]} |")
    lines += [
        "",
        f"![TTFT per condition and actual path]({FIGURE})",
        "",
    ]
    return "\n".join(lines)


def write_page(con, out: Path) -> tuple[Path, dict] | None:
    """Write reload_study.md and its figure from the newest study run; None without one."""
    full = common.latest_study(con, TABLES[0])
    if full.empty:
        return None
    frame = measured(full)
    info = {"study_id": str(full.study_id.iloc[0]), "model": str(full.model.iloc[0]),
            "org": str(full.org.iloc[0]), "budget": str(full.budget.iloc[0]),
            "interval": int(full.interval.iloc[0]),
            "split": bool(full.split_last_boundary.all()),
            "trials": int(frame.trial.max() + 1) if len(frame) else 0,
            "output_tokens": int(frame.output_tokens.max()) if len(frame) else 0}
    out = Path(out)
    figure(frame, out / FIGURE)
    path = out / PAGE
    path.write_text(page(frame, ttft_table(frame), info), encoding="utf-8")
    return path, summary(frame, info["study_id"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.studies.reload_study",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", default=os.environ.get("LEDGER_ROOT", "ledgers/data"))
    p.add_argument("--out", default="reports")
    args = p.parse_args(argv)
    if not Path(args.root).is_dir():
        print(f"error: root={args.root!r}: not a directory", file=sys.stderr)
        return 2
    Path(args.out).mkdir(parents=True, exist_ok=True)
    con = ledgers.connect(args.root)
    try:
        written = write_page(con, Path(args.out))
    finally:
        con.close()
    if written is None:
        print(f"error: root={args.root!r}: no reload_study table ({FILL})", file=sys.stderr)
        return 2
    path, info = written
    print(f"report: {path}; figure: {Path(args.out) / FIGURE}")
    print(json.dumps(info))
    return 1 if info["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
