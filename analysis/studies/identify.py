"""The identification search's page: `python -m analysis.studies.identify --ledgers ROOT
[--out DIR] [--smoke] [--search KEY]`.

Reads the `identify` study table (ledgers.studies; written by
experiments.studies.identify) and writes `identify.md`: the search's selection (adopted
default, identified set, reason), the search table (every combination with its fitted
constants, fitting- and checking-part losses, acceptance targets met and every throughput
ratio's gap), what each factor level moved alone against the refitted defaults, and the
full anchor comparison of the defaults and of the best combination. The newest search of
the chosen size is shown unless --search names one. The last output line is JSON.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd

from analysis import cli

PAGE = "identify.md"
TITLE = "Joint identification of engine rules and step-model constants"
TABLES = ("identify",)
CONSTANTS = ("memory_efficiency", "matmul_efficiency", "mixed_step_s", "per_step_overhead_s",
             "indirection_overhead", "state_page_s", "conv_slot_s")
RATIO_ORDER = ("A-control S1/S0", "A-control S2/S1", "B-L S1/S0", "B-L S2/S1", "C-L D0/S2",
               "B-H S1/S0", "B-H S2/S1", "C-H D0/S2", "C-M D0/S2")


def one_search(frame: pd.DataFrame, smoke: bool | None = None,
               search: str | None = None) -> pd.DataFrame:
    """The rows of one search: `search` when given, else the newest full-size search (of the
    newest smoke-size one with `smoke`; with None, full-size when there is one)."""
    if search:
        return frame[frame.search == search]
    if smoke is None:
        full = frame[frame.search.str.startswith("full-")]
        return one_search(frame, smoke=full.empty)
    frame = frame[frame.search.str.startswith("smoke-" if smoke else "full-")]
    if frame.empty:
        return frame
    newest = frame.sort_values("created_at").search.iloc[-1]
    return frame[frame.search == newest]


def newest_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Each combination's newest scoring (a rerun replaces, never adds)."""
    scoredf = frame[frame.kind != "selection"]
    keep = scoredf.groupby("combination").study_id.transform("max") == scoredf.study_id
    scoredf = scoredf[keep]
    last = scoredf.groupby("combination").created_at.transform("max") == scoredf.created_at
    return scoredf[last]


def summaries(rows: pd.DataFrame) -> pd.DataFrame:
    out = []
    for name, g in rows.groupby("combination", sort=False):
        loss = dict(zip(g[g.kind == "loss"].part, g[g.kind == "loss"].ours, strict=True))
        tg = g[g.kind == "target"]
        consts = dict(zip(g[g.kind == "constant"].metric, g[g.kind == "constant"].ours,
                          strict=True))
        ratios = g[(g.kind == "ratio") & (g.metric == "throughput")]
        gaps = {f"{s}-{p} {o}": e for s, p, o, e in zip(ratios.section, ratios.point,
                                                         ratios.org, ratios.error, strict=True)}
        out.append({"combination": name, "label": g.label.iloc[0], "form": g.form.iloc[0],
                    "fit loss": loss.get("fit", math.nan),
                    "check loss": loss.get("check", math.nan),
                    "targets": f"{int(tg.met.sum())}/{len(tg)}",
                    "throughput ok": bool(g[g.kind == "levels"].met.all()),
                    "fits": int(g.iterations.iloc[0]), "seconds": float(g.seconds.iloc[0]),
                    **{c: consts.get(c, math.nan) for c in CONSTANTS},
                    **{k: gaps.get(k, math.nan) for k in RATIO_ORDER}})
    return pd.DataFrame(out).sort_values(["fit loss", "combination"]).reset_index(drop=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.4g}"
    return str(v)


def markdown(frame: pd.DataFrame, columns=None) -> str:
    frame = frame if columns is None else frame[list(columns)]
    head = "| " + " | ".join(frame.columns) + " |"
    sep = "|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(_fmt(v) for v in row) + " |"
            for row in frame.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def moved_alone(rows: pd.DataFrame, summ: pd.DataFrame) -> pd.DataFrame:
    """Per one-factor combination: its throughput-ratio gaps and C_once errors minus the
    refitted defaults' (pp and percentage points of relative error)."""
    base = rows[rows.combination == "base"]
    if base.empty:
        return pd.DataFrame()

    def keyed(g):
        r = g[(g.kind == "ratio") & (g.metric == "throughput")]
        c = g[(g.kind == "level") & (g.metric == "c_once") & (g.section.isin(["B", "D"]))]
        out = {f"{s}-{p} {o}": e for s, p, o, e in zip(r.section, r.point, r.org, r.error,
                                                        strict=True)}
        out |= {f"C_once {p} {o}": 100 * e for p, o, e in zip(c.point, c.org, c.error,
                                                               strict=True)}
        return out

    ref = keyed(base)
    out = []
    for name, g in rows.groupby("combination", sort=False):
        label = g.label.iloc[0]
        if name == "base" or "," in label:
            continue
        k = keyed(g)
        out.append({"combination": name, "level": label,
                    **{key: k.get(key, math.nan) - v for key, v in ref.items()}})
    return pd.DataFrame(out)


def anchor_table(rows: pd.DataFrame, name: str) -> pd.DataFrame:
    g = rows[(rows.combination == name) & rows.kind.isin(["level", "ratio", "slab"])]
    return pd.DataFrame({"part": g.part, "sec": g.section, "point": g.point, "org": g.org,
                         "metric": g.metric, "measured": g.measured, "ours": g.ours,
                         "error": g.error, "z": g.residual})


def page(frame: pd.DataFrame) -> tuple[str, dict]:
    rows = newest_rows(frame)
    summ = summaries(rows)
    sel = frame[frame.kind == "selection"]
    sel = sel[sel.study_id == sel.study_id.max()] if not sel.empty else sel
    adopted = sel[sel.met].combination.tolist()
    identified = sel[sel.part == "identified"].combination.tolist()
    reason = sel.metric.iloc[0] if not sel.empty else "no selection written yet"
    moved = dict(zip(sel.combination, sel.ours, strict=True))
    summ["levels moved"] = [moved.get(c, math.nan) for c in summ.combination]
    best = summ.combination.iloc[0] if not summ.empty else None
    search = frame.search.iloc[0]
    seeds = int(rows.seeds_per_cell.max()) if not rows.empty else 0
    lines = [
        "# Identification of the engine's rules and step-model constants",
        "",
        f"Search `{search}`: {len(summ)} combinations, {seeds} seed(s) per cell; each refitted "
        "on sections A-C and scored on every anchor (experiments/studies/identify.py, "
        "conf/calibration/identify.yaml). Loss of a part: mean over its groups (kind, metric) "
        "of the mean squared residual over the declared tolerance. Fitting part: sections "
        "A-C; checking part: D (low load) and F (S2 slabs).",
        "",
        f"- best by fitting loss: **{best}**",
        f"- adopted as the default: **{adopted[0] if adopted else 'none'}** ({reason})",
        f"- identified set (within the declared tolerance of the best): "
        f"{', '.join(identified) or 'none'}",
        "",
        "## Search table",
        "",
        "Ratio columns: gap to the measured throughput ratio, pp (ours - measured); targets: "
        "the 19 acceptance targets (9 ratios within 3 pp, 10 C_once levels within 15 %).",
        "",
        "`throughput ok`: every throughput level within 10 %; `levels moved`: anchor levels "
        "the refitted defaults hold within 10 % that the combination moves outside it (the "
        "selection refuses any).",
        "",
        markdown(summ, ["combination", "form", "fit loss", "check loss", "targets",
                        "throughput ok", "levels moved", "fits", *RATIO_ORDER]),
        "",
        "Fitted constants:",
        "",
        markdown(summ, ["combination", *CONSTANTS]),
        "",
    ]
    alone = moved_alone(rows, summ)
    if not alone.empty:
        lines += ["## What each level moved alone (against the refitted defaults)", "",
                  "Throughput-ratio gaps in pp; C_once in percentage points of relative error.",
                  "", markdown(alone), ""]
    for name in dict.fromkeys([n for n in ("base", best, *adopted) if n]):
        lines += [f"## Anchors: {name}", "", markdown(anchor_table(rows, name)), ""]
    info = {"search": search, "combinations": len(summ), "best": best,
            "adopted": adopted[0] if adopted else None, "identified": identified}
    return "\n".join(lines), info


def write_page(con, out: Path, smoke: bool | None = None,
               search: str | None = None) -> tuple[Path, dict] | None:
    """Write identify.md from the identify study table; None when no search has run."""
    frame = one_search(con.execute(f"SELECT * FROM {TABLES[0]}").df(), smoke, search)
    if frame.empty:
        return None
    text, info = page(frame)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / PAGE
    path.write_text(text + "\n", encoding="utf-8")
    return path, info


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("analysis.studies.identify", __doc__.split("\n\n")[0])
    p.add_argument("--out", default="reports", help="report directory for identify.md")
    p.add_argument("--smoke", action="store_true", help="the newest smoke-size search")
    p.add_argument("--search", default=None, help="this search key instead of the newest")
    args = p.parse_args(argv)

    def show(con) -> int:
        written = write_page(con, Path(args.out), args.smoke, args.search)
        if written is None:
            print(f"error: --ledgers={args.ledgers!r}: no identify search there (run make "
                  "identify)", file=sys.stderr)
            return 2
        path, info = written
        print(f"report: {path}")
        print(json.dumps(info))
        return 0

    return cli.with_ledgers(args.ledgers, show)


if __name__ == "__main__":
    sys.exit(main())
