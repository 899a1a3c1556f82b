"""Result objects of the per-question analyses and their Markdown rendering.

A question's analysis returns a `QuestionResult`: named DataFrames (written as
CSV by the report), Markdown sections that show some of them, the evaluated
preregistered families, and figure paths once the report has drawn them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from analysis.markdown import MISSING, fmt, md_table  # noqa: F401 (re-exported)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


@dataclass
class Section:
    """A titled block of text with tables: (caption, frame, columns or None)."""

    title: str
    text: str = ""
    tables: list[tuple[str, pd.DataFrame, Sequence[str] | None]] = field(default_factory=list)

    def markdown(self, level: int = 2) -> str:
        out = [f"{'#' * level} {self.title}", ""]
        if self.text:
            out += [self.text, ""]
        for caption, frame, columns in self.tables:
            if caption:
                out += [f"_{caption}_", ""]
            out += [md_table(frame, columns), ""]
        return "\n".join(out)


@dataclass
class QuestionResult:
    """What one question's analysis found; `frames` are the CSV tables."""

    question: str
    title: str
    reads: tuple[str, ...]  # questions whose runs are read (Q4 reads Q1's)
    campaigns: tuple[str, ...]  # campaigns those runs came from
    num_runs: int
    sections: list[Section] = field(default_factory=list)
    families: list = field(default_factory=list)  # analysis.inference.families.FamilyResult
    frames: dict[str, pd.DataFrame] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    figures: list[tuple[str, Path]] = field(default_factory=list)  # (caption, path)

    def add(self, name: str, frame: pd.DataFrame) -> pd.DataFrame:
        self.frames[name] = frame
        return frame

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every CSV table: the frames and each family's estimand tables."""
        out = {k: v for k, v in self.frames.items() if not k.startswith("_")}
        for fam in self.families:
            for estimand, frame in fam.tables.items():
                out[f"family_{slug(fam.name)}_{estimand}"] = frame
        return out

    def markdown(self, relative_to: Path | None = None) -> str:
        out = [f"# {self.question.upper()}: {self.title}", "",
               f"Runs of question(s) {', '.join(self.reads)} from campaign(s) "
               f"{', '.join(self.campaigns) or 'none'}; adopted complete runs: "
               f"{self.num_runs}.", ""]
        refused = [line for fam in self.families if (line := fam.headline())]
        out += [f"> {line}" for line in [*refused, *self.notes]]
        if self.notes or refused:
            out.append("")
        for section in self.sections:
            out.append(section.markdown())
        if self.figures:
            out += ["## Figures", ""]
            for caption, path in self.figures:
                shown = path.relative_to(relative_to) if relative_to else path
                out += [f"![{caption}]({shown.as_posix()})", "", f"_{caption}_", ""]
        if self.families:
            out += ["## Preregistered families", ""]
            out += [fam.markdown() for fam in self.families]
        return "\n".join(out).rstrip() + "\n"


def no_data_section(question: str, reads: Sequence[str]) -> Section:
    return Section(f"No data for {question.upper()}",
                   f"No data for {question.upper()}: the ledger has no adopted complete runs "
                   f"serving question(s) {', '.join(reads)}.")
