"""Regenerate the report from the ledgers: `python -m analysis.report --ledgers ROOT --out DIR`.

Writes DIR/index.md (links and provenance: ledger root, run counts, code versions, plan
hashes, the readings of the AMBIGUOUS items; `--intro FILE` opens it with that file's
text), one page per registered question (analysis/questions/__init__.py: <QUESTION>.md, a
question without data says so), one per campaign and study page whose data are present
(analysis/questions/__init__.py, analysis/studies/__init__.py), DIR/tables/*.csv and
DIR/figures/*.png and *.svg. Before writing it removes the files it owns (`owned_files()`,
derived from the same registries). Reads the ledgers only, through the DuckDB catalog, and
the plans in conf/prereg. A page whose analysis raises gets an error page and the command
exits 1 after writing everything else. Prints the wall time as its last line.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import pandas as pd

import ledgers
from analysis.flips import add_flip_columns
from analysis.inference import prereg
from analysis.pages import common, readouts
from analysis.pages.render import md_table
from analysis.questions import campaign_pages, question_pages
from analysis.studies import study_pages

QUESTIONS = question_pages()
CAMPAIGN_PAGES = campaign_pages()
STUDY_PAGES = study_pages()
OUTPUT_GLOBS = ("tables/*.csv", "figures/*.png", "figures/*.svg")


def owned_files() -> tuple[str, ...]:
    """File names and globs under the report directory that the report writes (and removes
    before writing): the index, every registered page, the tables and figures."""
    return ("index.md", *(f"{q.QUESTION}.md" for q in QUESTIONS),
            *(p.PAGE for p in (*CAMPAIGN_PAGES, *STUDY_PAGES)), *OUTPUT_GLOBS)


_CAMPAIGN_COUNTS = """
    SELECT campaign, count(*) AS runs_rows, count(DISTINCT run_id) AS run_ids,
           count(*) FILTER (WHERE status = 'complete') AS complete,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'complete' AND adopted) AS adopted_complete,
           string_agg(DISTINCT code_version, ', ' ORDER BY code_version) AS code_versions,
           string_agg(DISTINCT executor, ', ' ORDER BY executor) AS executors
    FROM raw_runs GROUP BY campaign ORDER BY campaign
"""
_RUN_HASHES = """
    SELECT question, campaign, prereg_plan_hash, count(*) AS runs
    FROM runs WHERE status = 'complete' AND adopted GROUP BY ALL ORDER BY ALL
"""


@dataclass
class ReportSummary:
    out: Path
    pages: list[Path] = field(default_factory=list)
    tables: list[Path] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def analysis_version() -> str:
    """Package version plus a digest of the analysis sources that produced the report."""
    try:
        version = metadata.version("hybrid-state-lab")
    except metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256()
    package = Path(__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return f"hybrid-state-lab {version}, analysis sources sha256:{digest.hexdigest()[:12]}"


def plan_hashes(con, plan_dir: Path) -> pd.DataFrame:
    """Per question: the plan's current hash and the hashes its runs carry, per campaign."""
    stamped = con.execute(_RUN_HASHES).df()
    rows = []
    for module in QUESTIONS:
        plan = readouts.load_plan(module.QUESTION, plan_dir)
        found = stamped[stamped["question"] == module.QUESTION]
        carried = "; ".join(f"{c}: {(h or '<none>')[:12]} x{n}" for c, h, n in
                            zip(found["campaign"], found["prereg_plan_hash"], found["runs"],
                                strict=True))
        status = ("no runs" if found.empty else "match"
                  if (found["prereg_plan_hash"] == plan.plan_hash).all() else "CHANGED")
        rows.append({"question": plan.question, "campaign": plan.campaign,
                     "plan_hash": plan.plan_hash[:12], "run_hashes": carried or "-",
                     "status": status})
    return pd.DataFrame(rows)


def _clean(out: Path) -> None:
    for pattern in owned_files():
        for path in out.glob(pattern):
            path.unlink()


def _write_tables(result, out: Path, summary: ReportSummary) -> None:
    summary.tables.extend(common.write_tables(out, result.question, result.tables()))


def _question_page(module, con, out: Path, plan_dir: Path, allow_changed_plan: bool,
                   summary: ReportSummary) -> dict:
    """Analyse, draw and write one question; returns its index row."""
    row = {"question": f"[{module.QUESTION.upper()}]({module.QUESTION}.md)",
           "title": module.TITLE, "runs": 0, "families": "", "figures": 0}
    page = out / f"{module.QUESTION}.md"
    try:
        result = module.analyze(con, plan_dir=plan_dir, allow_changed_plan=allow_changed_plan)
        add_flip_columns(result.families, con, plan_dir)  # where each winner flips
        result.figures = module.draw(result, out / "figures")
        _write_tables(result, out, summary)
        page.write_text(result.markdown(relative_to=out), encoding="utf-8")
    except Exception:  # one question's failure must not hide the others
        text = traceback.format_exc()
        summary.errors[module.QUESTION] = text.strip().splitlines()[-1]
        page.write_text(f"# {module.QUESTION.upper()}: analysis failed\n\n```\n{text}```\n",
                        encoding="utf-8")
        row["families"] = "analysis failed"
        summary.pages.append(page)
        return row
    summary.pages.append(page)
    summary.figures += [path for _, path in result.figures]
    row.update(runs=result.num_runs, figures=len(result.figures),
               families="; ".join(f"{f.name}: {f.status}" for f in result.families))
    return row


def write_report(root: str | Path, out: str | Path, *, allow_changed_plan: bool = False,
                 plan_dir: str | Path | None = None, intro: str = "") -> ReportSummary:
    """Analyse every registered page from the ledger root and write the report under `out`;
    `intro` (Markdown) opens the index."""
    root, out = Path(root), Path(out)
    plan_dir = Path(plan_dir) if plan_dir else prereg.PLAN_DIR
    out.mkdir(parents=True, exist_ok=True)
    _clean(out)
    summary = ReportSummary(out)
    con = ledgers.connect(root)
    try:
        with common.cached_runs():
            rows = [_question_page(m, con, out, plan_dir, allow_changed_plan, summary)
                    for m in QUESTIONS]
            campaigns = [m for m in CAMPAIGN_PAGES if _page(m, con, out, summary)]
            studies = [m for m in STUDY_PAGES if _page(m, con, out, summary)]
        index = index_markdown(con, root, plan_dir, allow_changed_plan, pd.DataFrame(rows),
                               summary, intro)
    finally:
        con.close()
    for heading, pages in (("Campaigns without a preregistered question", campaigns),
                           ("Studies", studies)):
        if pages:
            index += f"\n## {heading}\n\n" + "".join(
                f"- [{m.TITLE}]({m.PAGE})\n" for m in pages)
    (out / "index.md").write_text(index, encoding="utf-8")
    summary.pages.insert(0, out / "index.md")
    summary.tables = sorted(out.glob("tables/*.csv"))
    summary.figures = sorted(out.glob("figures/*.png"))
    return summary


def _page(module, con, out: Path, summary: ReportSummary) -> bool:
    """Write one campaign or study page (`module.write_page`); True when it wrote one (None:
    no data). One that raises gets an error page, like a question page."""
    path = out / module.PAGE
    try:
        written = module.write_page(con, out)
    except Exception:  # one page's failure must not hide the others
        text = traceback.format_exc()
        summary.errors[module.__name__.rsplit(".", 1)[-1]] = text.strip().splitlines()[-1]
        path.write_text(f"# {module.TITLE}: analysis failed\n\n```\n{text}```\n",
                        encoding="utf-8")
        written = path
    if written is None:
        return False
    summary.pages.append(path)
    return True


def index_markdown(con, root: Path, plan_dir: Path, allow_changed_plan: bool,
                   questions: pd.DataFrame, summary: ReportSummary, intro: str = "") -> str:
    campaigns = con.execute(_CAMPAIGN_COUNTS).df()
    hashes = plan_hashes(con, plan_dir)
    analysable = int(campaigns["adopted_complete"].sum()) if len(campaigns) else 0
    out = ["# Hybrid State Lab report", ""]
    if intro.strip():
        out += [intro.strip(), ""]
    out += [f"Generated {datetime.now(UTC).isoformat(timespec='seconds')} from the ledgers only.",
           "", "## Provenance", "",
           f"- ledger root: `{root.resolve()}`",
           f"- analysis code: {analysis_version()}",
           f"- preregistration plans: `{plan_dir.resolve()}`",
           f"- adopted complete runs analysable: {analysable}",
           ("- **--allow-changed-plan was given: families whose runs carry a different plan "
            "hash are accepted and marked so.**" if allow_changed_plan else
            "- plan-hash check: strict (families collected under a changed plan are refused)."),
           ""]
    if summary.errors:
        out += ["**Analysis errors:** " + "; ".join(f"{q}: {e}" for q, e in
                                                   summary.errors.items()), ""]
    out += ["## Questions", "", md_table(questions), "",
            "## Runs per campaign", "",
            md_table(campaigns) if len(campaigns) else "No data: the ledger root holds no runs.",
            "", "Run code versions are the `code_version` values stamped by the runner.", "",
            "## Plan hashes", "", md_table(hashes), ""]
    readings = prereg.load_readings(plan_dir)
    if readings:
        out += ["## Readings of the AMBIGUOUS items", "",
                f"The paper leaves these open (docs/paper_design.md, section 8); the reading "
                f"each analysis uses "
                f"and the one it names as the alternative ({prereg.READINGS_FILE} in the plan "
                f"directory).", "", md_table(pd.DataFrame(readings)), ""]
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m analysis.report",
                                     description="Regenerate reports from the ledgers.")
    parser.add_argument("--ledgers", required=True, help="ledger root")
    parser.add_argument("--out", default="reports", help="output directory (default reports)")
    parser.add_argument("--allow-changed-plan", action="store_true",
                        help="accept families whose runs carry another plan hash (stated)")
    parser.add_argument("--plans", default=None, help="plan directory (default conf/prereg)")
    parser.add_argument("--intro", default=None,
                        help="Markdown file whose text opens the index (make demo: "
                             "conf/campaign/demo.md)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not Path(args.ledgers).is_dir():
        print(f"error: --ledgers={args.ledgers!r}: no such directory", file=sys.stderr)
        return 2
    if args.intro is not None and not Path(args.intro).is_file():
        print(f"error: --intro={args.intro!r}: no such file", file=sys.stderr)
        return 2
    intro = Path(args.intro).read_text(encoding="utf-8") if args.intro else ""
    start = time.perf_counter()
    summary = write_report(args.ledgers, args.out, allow_changed_plan=args.allow_changed_plan,
                           plan_dir=args.plans, intro=intro)
    print(f"wrote {len(summary.pages)} pages, {len(summary.tables)} tables, "
          f"{len(summary.figures)} figures to {summary.out}")
    for question, error in summary.errors.items():
        print(f"error in {question}: {error}", file=sys.stderr)
    print(f"report wall time: {time.perf_counter() - start:.2f} s")
    return 1 if summary.errors else 0


if __name__ == "__main__":
    sys.exit(main())
