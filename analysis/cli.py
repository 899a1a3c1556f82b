"""Command-line plumbing of the analysis pages: the `--ledgers ROOT` argument and its check."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import ledgers


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """An argument parser with the required `--ledgers ROOT`."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    p.add_argument("--ledgers", required=True, help="ledger root")
    return p


def with_ledgers(root: str | Path, body: Callable) -> int:
    """`body(con)` on the catalog of `root` (its exit code); one line and exit 2 when `root`
    is not a directory."""
    if not Path(root).is_dir():
        print(f"error: --ledgers={str(root)!r}: not a directory", file=sys.stderr)
        return 2
    con = ledgers.connect(root)
    try:
        return body(con)
    finally:
        con.close()


def report_page_main(prog: str, doc: str | None, page: str, write_page: Callable,
                     passed: str, empty: Callable | None = None,
                     argv: list[str] | None = None) -> int:
    """A report page's command line: `--ledgers ROOT [--out DIR]`. Writes the page, prints
    it, its path and, as the LAST line, its JSON summary; exit 0 when the summary's
    `passed` count is not zero, else 1. A write_page that finds nothing returns None:
    `empty(args)` prints what is missing, the summary is `{passed: 0}`, exit 1."""
    p = parser(prog, doc)
    p.add_argument("--out", default="reports", help=f"report directory for {page}")
    args = p.parse_args(argv)

    def show(con) -> int:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        written = write_page(con, Path(args.out))
        if written is None:
            empty(args)
            print(json.dumps({passed: 0}))
            return 1
        path, info = written
        print(path.read_text(encoding="utf-8"))
        print(f"page: {path}")
        print(json.dumps(info))
        return 0 if info.get(passed) else 1

    return with_ledgers(args.ledgers, show)


def study_page_main(prog: str, doc: str | None, write_page: Callable, table: str, fill: str,
                    count: str, argv: list[str] | None = None) -> int:
    """A study page's command line: `--ledgers ROOT [--out DIR]`. Writes the page from the
    newest study run, prints its path and, as the LAST line, its JSON summary; exit 0 when
    `summary["ok"] == summary[count]`, 1 when not, 2 without the study table."""
    p = parser(prog, (doc or "").split("\n\n")[0])
    p.add_argument("--out", default="reports", help="report directory for the page")
    args = p.parse_args(argv)

    def show(con) -> int:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        written = write_page(con, Path(args.out))
        if written is None:
            print(f"error: --ledgers={args.ledgers!r}: no {table} table ({fill})",
                  file=sys.stderr)
            return 2
        path, info = written
        print(f"page: {path}")
        print(json.dumps(info), flush=True)
        return 0 if info["ok"] == info[count] else 1

    return with_ledgers(args.ledgers, show)


def study_page(table: str, page: str, render: Callable, summarize: Callable, fill: str,
               count: str, doc: str | None) -> tuple[Callable, Callable]:
    """(write_page, main) of a study page over the newest run of `table`: write_page(con,
    out) writes `page` = render(rows) and returns its path and summarize(rows) (None when
    the table is empty); main(argv) is its command line (study_page_main)."""

    def write_page(con, out: Path) -> tuple[Path, dict] | None:
        from analysis.pages import common

        return common.write_study_page(con, out, table, page, render, summarize)

    def main(argv: list[str] | None = None) -> int:
        return study_page_main(f"analysis.studies.{table}", doc, write_page, table, fill,
                               count, argv)

    return write_page, main


def write_section(con, out: Path, page: str, section: Callable) -> tuple[Path, dict]:
    """Write `section(con)`'s text to out/page; (path, its JSON summary)."""
    text, info = section(con)
    path = out / page
    path.write_text(text, encoding="utf-8")
    return path, info


def section_main(prog: str, doc: str | None, section: Callable, ok: Callable[[dict], bool],
                 argv: list[str] | None = None) -> int:
    """A campaign page's command line: `--ledgers ROOT`; prints the page and, as the LAST
    line, its JSON summary; exit 0 when `ok(summary)`, 1 when not."""
    args = parser(prog, doc).parse_args(argv)

    def show(con) -> int:
        text, info = section(con)
        print(text)
        print(json.dumps(info))
        return 0 if ok(info) else 1

    return with_ledgers(args.ledgers, show)


CHANGED_PLAN_NOTE = ("--allow-changed-plan was given: families whose runs carry an earlier "
                     "plan hash (runs collected before an amendment) are accepted and marked "
                     "so in their reasons.")


def question_page_main(prog: str, doc: str | None, question: str, analyze: Callable,
                       argv: list[str] | None = None) -> int:
    """A question page written alone (`--ledgers ROOT [--out DIR] [--allow-changed-plan]`):
    <out>/<question>.md and its tables; prints the page's path. With --allow-changed-plan
    (as analysis.report) a family whose runs carry an earlier plan hash is accepted, and the
    page says so at its top."""
    from analysis.pages import common

    p = parser(prog, doc)
    p.add_argument("--out", default="reports", help="report directory for the page")
    p.add_argument("--allow-changed-plan", action="store_true",
                   help="accept runs collected under an earlier hash of the plan (amended "
                        "after they ran); the page says so")
    args = p.parse_args(argv)

    def write(con) -> int:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = analyze(con, allow_changed_plan=args.allow_changed_plan)
        if args.allow_changed_plan:
            result.notes.append(f"**{CHANGED_PLAN_NOTE}**")
        common.write_tables(out, question, result.tables())
        page = out / f"{question}.md"
        page.write_text(result.markdown(relative_to=out), encoding="utf-8")
        print(page)
        return 0

    return with_ledgers(args.ledgers, write)
