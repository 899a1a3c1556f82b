"""vLLM's native uniform-page organization (N0) next to S0, S1, S2 and D0 (campaign n0_a100).

Per collection stage, condition (budget) and organization: the mean over seeds of run-level
readouts with a Student-t 95% interval over seeds; per condition, N0 paired by seed with
each of S0, S1, S2 and D0: the mean of seedwise percent changes 100 (N0/X - 1) with its
paired-t 95% interval (counts that can be zero, prefix-hit tokens and preemptions, as
seedwise differences N0 - X instead). Descriptive: the campaign has no preregistered plan
and the page draws no decision. `python -m analysis.questions.n0_native --ledgers ROOT` prints the
page; the report writes it as n0_native.md with its tables and one figure.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import cli
from analysis.inference.paired import CONFIDENCE, diff_interval
from analysis.pages import common, paper_figures
from analysis.pages.render import fmt, md_table
from ledgers.arms import ARMS

QUESTION = "n0_a100"
CAMPAIGN = "n0_a100"
COMMAND = "make n0"
PAGE = "n0_native.md"
TITLE = "vLLM's native organization (N0) at A100 scale"
TREATMENT = "N0"
# Every other organization without retention, in table order (ledgers.arms).
CONTROLS = tuple(a.ledger_org for a in ARMS.values() if a.org != TREATMENT and not a.retention)
FIGURE_METRIC = "throughput_span"


@dataclass(frozen=True, slots=True)
class Readout:
    """A run-level readout of the page; `effect` "pct" (seedwise % change) or "diff"."""

    name: str
    label: str
    unit: str
    effect: str


READOUTS = (
    Readout("throughput_span", "throughput, request span", "tokens/s", "pct"),
    Readout("throughput_ledger", "throughput, ledger", "tokens/s", "pct"),
    Readout("ttft_p99", "TTFT p99", "s", "pct"),
    Readout("e2e_p99", "E2E p99", "s", "pct"),
    Readout("prefix_hit_tokens", "prefix-hit tokens", "tokens", "diff"),
    Readout("preemptions", "preemptions", "count", "diff"),
    Readout("c_once_tokens", "C_once", "tokens", "pct"),
)

# Prompt tokens served from cache at each request's first admission (the vllm_native page's
# definition); C_once = admitted prompt tokens minus this sum.
_PREFIX_HITS = """
    SELECT run_id, sum(greatest(adopted_prefix_tokens, 0)) AS prefix_hit_tokens
    FROM requests WHERE {campaigns} AND run_id IN ({adopted}) GROUP BY run_id
"""


def load(con) -> pd.DataFrame:
    """Adopted complete runs of question n0_a100 (one per cell and seed) with the readouts."""
    runset = common.load_runs(con, [QUESTION])
    runs = runset.runs
    if runs.empty:
        return runs
    hits = common.query(con, _PREFIX_HITS, runset)
    return runs.merge(hits, on="run_id", how="left")


def _stages(runs: pd.DataFrame) -> list[str]:
    found = list(dict.fromkeys(runs["stage"]))
    return sorted(found, key=lambda s: (s != common.MAIN_STAGE, s))


def _with_conditions(runs: pd.DataFrame) -> pd.DataFrame:
    """One stage's runs with cell labels of that stage and the condition (label minus org)."""
    runs = runs.copy()
    runs["cell"] = common.cell_labels(runs)
    runs["condition"] = [cell.partition(" ")[2] or "all" for cell in runs["cell"]]
    return runs


def _condition_order(runs: pd.DataFrame) -> list[str]:
    cells = common.cell_order(runs)
    return list(dict.fromkeys(runs.set_index("cell").loc[cells, "condition"]))


def _interval(values: np.ndarray) -> tuple[float, float]:
    return diff_interval(values, CONFIDENCE) if values.size >= 2 else (math.nan, math.nan)


def per_org(runs: pd.DataFrame) -> pd.DataFrame:
    """Per condition and organization: n, seeds, and per readout mean with its 95% interval.

    The interval is the Student-t interval of the mean over seeds (df = n - 1).
    """
    rows = []
    for condition in _condition_order(runs):
        part = runs[runs["condition"] == condition]
        for org in sorted(part["org"].unique(), key=common.org_rank):
            group = part[part["org"] == org]
            row = {"condition": condition, "org": org, "n": int(group["seed"].nunique()),
                   "seeds": common.seeds_text(group["seed"])}
            for r in READOUTS:
                values = group[r.name].astype(float).dropna().to_numpy()
                low, high = _interval(values)
                row.update({r.name: float(values.mean()) if values.size else math.nan,
                            f"{r.name}_low": low, f"{r.name}_high": high})
            rows.append(row)
    return pd.DataFrame(rows)


def _seedwise(t: pd.Series, c: pd.Series, effect: str) -> tuple[np.ndarray, str]:
    """Per common seed: 100 (t/c - 1) or t - c; a note when a percent change is undefined."""
    joined = pd.concat([t.rename("t"), c.rename("c")], axis=1, join="inner").dropna()
    if effect == "diff":
        return (joined["t"] - joined["c"]).to_numpy(), ""
    bad = joined.index[(joined["c"] <= 0) | (joined["t"] <= 0)].tolist()
    if bad:
        return np.array([]), f"nonpositive values for seeds {bad}"
    return (100.0 * (joined["t"] / joined["c"] - 1.0)).to_numpy(), ""


def effects(runs: pd.DataFrame) -> pd.DataFrame:
    """N0 versus each control per condition, paired by seed: n, and per readout the mean of
    seedwise changes with its paired-t 95% interval and sign counts."""
    rows = []
    for condition in _condition_order(runs):
        part = runs[runs["condition"] == condition]
        by_org = {org: g.set_index("seed") for org, g in part.groupby("org")}
        if TREATMENT not in by_org:
            continue
        for control in (c for c in CONTROLS if c in by_org):
            row = {"condition": condition, "comparison": f"{TREATMENT} vs {control}",
                   "control": control}
            notes, sizes = [], []
            for r in READOUTS:
                d, note = _seedwise(by_org[TREATMENT][r.name].astype(float),
                                    by_org[control][r.name].astype(float), r.effect)
                low, high = _interval(d)
                row.update({r.name: float(d.mean()) if d.size else math.nan,
                            f"{r.name}_low": low, f"{r.name}_high": high,
                            f"{r.name}_pos": int((d > 0).sum()),
                            f"{r.name}_neg": int((d < 0).sum())})
                sizes.append(d.size)
                if note:
                    notes.append(f"{r.name}: {note}")
            row["n"] = max(sizes)
            row["note"] = "; ".join(notes)
            rows.append(row)
    return pd.DataFrame(rows)


def _with_interval(frame: pd.DataFrame, name: str) -> list[str]:
    return [f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]" if not math.isnan(lo) else fmt(m)
            for m, lo, hi in zip(frame[name], frame[f"{name}_low"], frame[f"{name}_high"],
                                 strict=True)]


def _org_markdown(table: pd.DataFrame) -> str:
    shown = table[["condition", "n"]].copy()
    shown.insert(1, "organization", table["org"].map(paper_figures.org_name))
    for r in READOUTS:
        shown[f"{r.label} ({r.unit})"] = _with_interval(table, r.name)
    return md_table(shown)


def _effect_markdown(table: pd.DataFrame) -> str:
    shown = table[["condition", "comparison", "n"]].copy()
    for r in READOUTS:
        unit = "%" if r.effect == "pct" else f"Δ {r.unit}"
        shown[f"{r.label} ({unit})"] = _with_interval(table, r.name)
    if table["note"].astype(bool).any():
        shown["note"] = table["note"]
    return md_table(shown)


def _setting(runs: pd.DataFrame, column: str) -> str:
    return ", ".join(sorted(map(str, runs[column].unique())))


def _requests(runs: pd.DataFrame) -> str:
    sizes = (runs["completed_requests"] + runs["failed_requests"]).astype(int)
    low, high = sizes.min(), sizes.max()
    return f"{low}" if low == high else f"{low}-{high}"


def _figure(runs: pd.DataFrame, stage: str, figures: Path) -> tuple[Path | None, str]:
    """The throughput figure of one stage, or None and the reason it is not drawn."""
    if runs.groupby(["org", "budget"])["cell"].nunique().max() > 1:
        return None, "no figure: cells differ beyond organization and budget"
    suffix = "" if stage == common.MAIN_STAGE else f"_{stage}"
    title = (f"N0 (vLLM native) next to S0-S2 and D0: request-span throughput"
             f"{'' if stage == common.MAIN_STAGE else f' ({stage})'}\n"
             f"{_setting(runs, 'model')}, executor {_setting(runs, 'executor')}")
    path = paper_figures.grouped_bars(
        runs, FIGURE_METRIC, "throughput, request span (output tokens/s)", title,
        figures / f"{CAMPAIGN}{suffix}_throughput.png")
    return path, ""


@dataclass
class Page:
    """The page text and the tables and figures written with it."""

    text: str
    tables: dict[str, pd.DataFrame]
    figures: list[Path]


def build(con, figures: Path | None = None) -> Page:
    """The page; figures are drawn under `figures` when given (the report's figures/)."""
    runs = load(con)
    out = ["# N0 (vLLM native) next to S0, S1, S2 and D0 at A100 scale", ""]
    main_empty = runs.empty or common.MAIN_STAGE not in set(runs["stage"])
    if main_empty:
        out += [f"No complete runs in campaign {CAMPAIGN}: `{COMMAND}` fills it.", ""]
    if runs.empty:
        return Page("\n".join(out), {}, [])
    out += ["Descriptive comparison: this campaign has no preregistered plan, and the page "
            "draws no decision. N0 is vLLM's native hybrid organization (one page size for "
            "attention and Mamba layers, recurrent checkpoints only at block boundaries), "
            "simulated as our organizations are.", ""]
    tables, figures_drawn = {}, []
    for stage in _stages(runs):
        part = _with_conditions(runs[runs["stage"] == stage])
        orgs, paired = per_org(part), effects(part)
        tag = "" if stage == common.MAIN_STAGE else f"{stage}_"
        tables[f"{tag}orgs"] = orgs.assign(stage=stage)
        tables[f"{tag}effects"] = paired.assign(stage=stage)
        campaigns = ", ".join(sorted(part["campaign"].unique()))
        conditions = paper_figures.conditions(part)
        out += [f"## Stage {stage}: campaign {campaigns}", "",
                f"{len(part)} runs, seeds {common.seeds_text(part['seed'].unique())}; "
                f"model {_setting(part, 'model')}, executor {_setting(part, 'executor')}"
                + (f", {conditions}" if conditions else "")
                + f", reuse {_setting(part, 'reuse')}, {_requests(part)} requests per run.", "",
                "### Per organization", "",
                "Mean over seeds [Student-t 95% interval over seeds]: output tokens/s over the "
                "request span and over the ledger episode, run-level TTFT and E2E p99 over "
                "finished requests (s), prefix-hit tokens (prompt tokens served from cache at "
                "first admission, summed per run), preemptions per run, C_once (admitted "
                "prompt tokens minus that prefix, per run).", "",
                _org_markdown(orgs), ""]
        out += ["### N0 versus S0, S1, S2 and D0, paired by seed", ""]
        if paired.empty:
            out += ["No condition holds N0 and a control.", ""]
        else:
            out += ["Mean of seedwise percent changes 100 (N0/X - 1) [paired-t 95% interval, "
                    "df = n - 1]; prefix-hit tokens and preemptions as seedwise differences "
                    "N0 - X (they can be zero). Positive throughput: N0 serves more; positive "
                    "latency: N0 is slower.", "", _effect_markdown(paired), ""]
        if figures is not None:
            path, why = _figure(part, stage, figures)
            if path is not None:
                figures_drawn.append(path)
                out += [f"![{stage} throughput](figures/{path.name})", "",
                        "Bars: arithmetic mean over seeds; dots: each seed's run.", ""]
            elif why:
                out += [why + ".", ""]
    return Page("\n".join(out), tables, figures_drawn)


def write_page(con, out: Path) -> Page:
    """Write `out/n0_native.md`, its CSVs (tables/n0_a100_*.csv) and its figure."""
    out = Path(out)
    page = build(con, out / "figures")
    common.write_tables(out, CAMPAIGN, page.tables)
    (out / PAGE).write_text(page.text, encoding="utf-8")
    return page


def main(argv: list[str] | None = None) -> int:
    args = cli.parser("analysis.questions.n0_native", __doc__).parse_args(argv)

    def show(con) -> int:
        print(build(con).text)
        return 0

    return cli.with_ledgers(args.ledgers, show)


if __name__ == "__main__":
    sys.exit(main())
