"""Every reference in the repository resolves inside it, so a clone can follow it.

Scanned: the docstrings, comments and other string literals of every Python file, and the
whole text of every Markdown, YAML, TOML and Makefile in the repository (tracked and
untracked, git-ignored paths excluded). A violation is:

- a path outside the repository (an absolute path to a Markdown document, a path into
  the workspace or the shared folder beside the checkout);
- the name of a design note that lives outside the repository (the project's first
  specification and the reference paper's design and anchor notes) on a line that names no
  existing `docs/` file; the notes' content is in docs/ (docs/paper_design.md,
  docs/calibration.md, docs/engine_rules.md, docs/statistics.md);
- a `docs/<name>.md` path, or a Markdown link, to a file that does not exist, to a heading
  anchor the file does not have, or followed by "section(s) X" naming a section the file
  does not have (a section is the first word of a heading: `## 3.2 ...` is section 3.2);
- a relative Markdown link that leaves the repository or names a missing file.

Every `docs/*.md` page is among the scanned files, and a chain of Markdown links from
README.md reaches it (the README links the manual, results and design pages directly).

Frozen text: the values of the preregistered plans (conf/prereg/<plan>.yaml) are hashed
into every run's `prereg_plan_hash` (ledgers/plans.py), and the fitted A100 profile
(conf/executor/a100.yaml, written by `make calibrate`) is part of every simulated run's
identity (experiments/runners/cell.py, `config_hash`), so their older citations of the
design and anchor notes are kept. There a citation must name sections that exist in the
page that keeps the notes' numbering (docs/paper_design.md, docs/calibration.md); the
comments of those files are checked like any other text.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

TEXT_SUFFIXES = (".md", ".yaml", ".yml", ".toml")
TEXT_NAMES = ("Makefile",)
SKIP_DIRS = {".git", ".venv", ".venv-vllm", ".cache", "node_modules", "__pycache__"}

# Names of the design notes that live outside the repository, spelled so that this file
# does not name them itself.
_DESIGN, _ANCHORS, _SPEC = "PAPER" + "_DESIGN", "PAPER" + "_ANCHORS", "SP" + "EC"
NOTE_NAME = re.compile(
    rf"(?<![\w]){_SPEC}(?:\.md)?(?![\w]|\.json)|(?<![\w])PAPER_(?:DESIGN|ANCHORS)\b"
    r"(?:\.md)?|(?<![\w])STYLE\.md")
NOTE_DOCS = {_DESIGN: "paper_design.md", _ANCHORS: "calibration.md"}
OUTSIDE_PATH = re.compile(
    r"/work/|\.\./shared\b|(?<![\w.-])shared/(?:SP|PAPER_|STYLE)"
    r"|(?:^|(?<=[\s'\"`(=<]))/(?:[\w.-]+/)*[\w.-]+\.md\b")
DOCS_REF = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.md)(#[\w-]+)?")
# Text that every match of OUTSIDE_PATH, DOCS_REF or NOTE_NAME contains: a Python file
# without any of them has no segment the line rules could flag.
MATCH_LITERALS = ("/work/", "shared", ".md", "docs/", _SPEC, "PAPER_", "STYLE.md")
MD_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|^\s*\[[^\]\n]+\]:\s*(\S+)", re.M)
LABEL = r"(?:Q\d+|A\d+|\d+(?:\.\d+)*|[A-F](?![\w]))"
SECTIONS = re.compile(rf"\A,?\s+sections?\s+({LABEL}(?:(?:\s*,\s*|\s+and\s+|\s*-\s*)"
                      rf"{LABEL})*)")
FROZEN_REF = re.compile(
    rf"(?P<name>PAPER_(?:DESIGN|ANCHORS))(?:\.md)?(?:'s)?(?:\s+sections?)?"
    rf"(?P<labels>(?:(?:\s*,\s*|\s+and\s+|\s*-\s*|\s+){LABEL})*)")


def frozen_files(root: Path) -> list[Path]:
    """Files whose values are hashed into run records (see the module docstring)."""
    plans = [p for p in sorted((root / "conf" / "prereg").glob("*.yaml"))
             if p.name != "readings.yaml"]
    return [*plans, root / "conf" / "executor" / "a100.yaml"]


@dataclass(frozen=True)
class Segment:
    """One line of scanned text: a Markdown/YAML line, or a line of a Python comment or
    string literal."""

    path: Path
    line: int
    text: str


# ----- which files -------------------------------------------------------------------------
def repo_files(root: Path = REPO) -> list[Path]:
    """Tracked and untracked files, git-ignored ones excluded (a walk without git)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=root, capture_output=True,
                             check=True).stdout.decode()
        files = [root / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in root.rglob("*") if not SKIP_DIRS & set(p.relative_to(root).parts)]
    return sorted(p for p in files if p.is_file() and _scanned(p))


def _scanned(path: Path) -> bool:
    return path.suffix in (".py", *TEXT_SUFFIXES) or path.name in TEXT_NAMES


# ----- segments ----------------------------------------------------------------------------
def python_segments(path: Path) -> list[Segment]:
    """Lines of the comments and string literals (docstrings included) of a Python file."""
    out = []
    source = path.read_text(encoding="utf-8")
    if not any(literal in source for literal in MATCH_LITERALS):
        return out  # no line of it can match a reference rule: skip the tokenizer
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(
                tokenize, "FSTRING_MIDDLE", -1):
            for i, text in enumerate(tok.string.split("\n")):
                out.append(Segment(path, tok.start[0] + i, text))
    return out


def text_segments(path: Path) -> list[Segment]:
    lines = path.read_text(encoding="utf-8").split("\n")
    return [Segment(path, i + 1, text) for i, text in enumerate(lines)]


# ----- the docs' sections and anchors ------------------------------------------------------
def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> tuple[set[str], set[str]]:
    """(anchors, section labels) of a Markdown file; code blocks skipped."""
    anchors, labels, seen = set(), set(), {}
    fenced = False
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        match = re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)
        if match:
            title = match.group(1)
            base = slug(title)
            count = seen.get(base, 0)
            seen[base] = count + 1
            anchors.add(base if not count else f"{base}-{count}")
            labels.add(title.split()[0].rstrip(".:"))
        row = re.match(r"\|\s*(A\d+)\s*\|", line)  # the AMBIGUOUS register's rows
        if row:
            labels.add(row.group(1))
    return anchors, labels


def _labels(text: str) -> list[str]:
    """Labels of 'A-C', '3.2 and 4', 'Q1, 2.6': ranges of single letters expanded."""
    out = []
    for match in re.finditer(rf"({LABEL})(?:\s*-\s*({LABEL}))?", text):
        first, last = match.group(1), match.group(2)
        if last and len(first) == len(last) == 1 and first.isalpha():
            out += [chr(c) for c in range(ord(first), ord(last) + 1)]
        else:
            out += [first] + ([last] if last else [])
    return out


class Checker:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self._cache: dict[Path, tuple[set[str], set[str]]] = {}

    def doc(self, path: Path) -> tuple[set[str], set[str]]:
        if path not in self._cache:
            self._cache[path] = headings(path)
        return self._cache[path]

    def target(self, path: Path, anchor: str, after: str, where: str) -> list[str]:
        """Problems of a reference to `path` with an optional #anchor and 'section X'."""
        if not path.is_file():
            return [f"{where}: {path.relative_to(self.root)} does not exist"]
        if path.suffix != ".md":
            return []
        anchors, labels = self.doc(path)
        problems = []
        if anchor and anchor.lstrip("#") not in anchors:
            problems.append(f"{where}: {path.relative_to(self.root)} has no heading {anchor}")
        sections = SECTIONS.match(after)
        if sections:
            missing = [lab for lab in _labels(sections.group(1)) if lab not in labels]
            if missing:
                problems.append(f"{where}: {path.relative_to(self.root)} has no section "
                                f"{', '.join(missing)}")
        return problems

    # ----- rules applied to one line ------------------------------------------------------
    def line_problems(self, seg: Segment, *, notes_allowed: bool = False) -> list[str]:
        where = f"{seg.path.relative_to(self.root)}:{seg.line}"
        text, problems = seg.text, []
        for match in OUTSIDE_PATH.finditer(text):
            problems.append(f"{where}: path outside the repository {match.group(0)!r}")
        docs_named = False
        for match in DOCS_REF.finditer(text):
            path = self.root / "docs" / match.group(1)
            problems += self.target(path, match.group(2) or "", text[match.end():], where)
            docs_named = docs_named or path.is_file()
        if not notes_allowed and not docs_named:
            for match in NOTE_NAME.finditer(text):
                problems.append(f"{where}: {match.group(0)!r} names a design note outside "
                                "the repository; cite the docs/ page that holds it")
        return problems

    def is_report_intro(self, path: Path) -> bool:
        """A campaign's report intro (`conf/campaign/<name>.md`, `analysis.report --intro`)
        opens the report's index, so its links name pages of the report directory."""
        return path.parent == self.root / "conf" / "campaign"

    def markdown_links(self, path: Path) -> list[str]:
        """Relative links of a Markdown file: inside the repository, existing, anchors too."""
        text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"),
                      path.read_text(encoding="utf-8"), flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        problems = []
        for match in MD_LINK.finditer(text):
            target = match.group(1) or match.group(2)
            where = f"{path.relative_to(self.root)}:{text.count(chr(10), 0, match.start()) + 1}"
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            if file_part.startswith("/"):
                problems.append(f"{where}: absolute link {target!r}")
                continue
            if self.is_report_intro(path) and file_part:
                if file_part not in report_pages():
                    problems.append(f"{where}: {target!r} is not a page the report writes")
                continue
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            if not dest.is_relative_to(self.root):
                problems.append(f"{where}: link {target!r} leaves the repository")
                continue
            problems += self.target(dest, f"#{anchor}" if anchor else "",
                                    text[match.end():match.end() + 80], where)
        return problems

    def frozen_problems(self, path: Path) -> list[str]:
        """Frozen values may cite the notes by section when the section exists in docs/;
        a citation outside the values (an inline comment) is checked like any text."""
        where = str(path.relative_to(self.root))
        values: list[str] = []

        def walk(node):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(k)
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
            elif isinstance(node, str):
                values.append(" ".join(node.split()))

        walk(yaml.safe_load(path.read_text(encoding="utf-8")))
        problems, cited = [], 0
        for value in values:
            for match in FROZEN_REF.finditer(value):
                cited += 1
                doc = self.root / "docs" / NOTE_DOCS[match.group("name")]
                labels = _labels(match.group("labels"))
                if not doc.is_file():
                    problems.append(f"{where}: frozen citation {match.group(0)!r} needs "
                                    f"{doc.relative_to(self.root)}")
                    continue
                missing = [lab for lab in labels if lab not in self.doc(doc)[1]]
                if not labels or missing:
                    problems.append(f"{where}: frozen citation {match.group(0)!r}: "
                                    f"{doc.relative_to(self.root)} has no section "
                                    f"{', '.join(missing) or '(none named)'}")
            for match in NOTE_NAME.finditer(value):
                if not match.group(0).startswith("PAPER_"):
                    problems.append(f"{where}: frozen value names {match.group(0)!r}, which "
                                    "no docs/ page keeps the numbering of")
        lines = path.read_text(encoding="utf-8").split("\n")
        outside = sum(len(NOTE_NAME.findall(line)) for line in lines
                      if not line.lstrip().startswith("#"))
        in_values = sum(len(NOTE_NAME.findall(v)) for v in values)
        if outside > in_values:
            problems.append(f"{where}: {outside - in_values} design-note name(s) outside the "
                            "frozen values (an inline comment?)")
        return problems


def linked_pages(path: Path) -> set[Path]:
    """The Markdown files a Markdown file links to (code spans and blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = set()
    for match in MD_LINK.finditer(text):
        file_part = (match.group(1) or match.group(2)).partition("#")[0]
        if file_part.endswith(".md") and not re.match(r"[a-z][a-z0-9+.-]*:", file_part):
            out.add((path.parent / file_part).resolve())
    return out


def unreachable_docs(root: Path = REPO) -> list[str]:
    """docs/*.md pages no chain of Markdown links from README.md reaches."""
    root = root.resolve()
    seen, todo = set(), [root / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        todo += [p for p in linked_pages(page) if p.is_relative_to(root)]
    return [str(p.relative_to(root)) for p in sorted((root / "docs").glob("*.md"))
            if p.resolve() not in seen]


def report_pages() -> set[str]:
    """The page files `analysis.report` writes (its registries)."""
    from analysis.report import owned_files

    return {name for name in owned_files() if "*" not in name}


def violations(root: Path = REPO, files: list[Path] | None = None) -> list[str]:
    """Every reference problem of the files under `root` (default: the repository's, this
    file excluded: its fixtures plant bad references on purpose)."""
    root = root.resolve()
    if files is None:
        files = [p for p in repo_files(root) if p.resolve() != Path(__file__).resolve()]
    frozen = {p.resolve() for p in frozen_files(root)}
    checker = Checker(root)
    problems: list[str] = []
    for path in files:
        path = path.resolve()
        is_frozen = path in frozen
        if path.suffix == ".py":
            segments = python_segments(path)
        else:
            segments = text_segments(path)
        for seg in segments:
            value_line = is_frozen and not seg.text.lstrip().startswith("#")
            problems += checker.line_problems(seg, notes_allowed=value_line)
        if path.suffix == ".md":
            problems += checker.markdown_links(path)
        if is_frozen:
            problems += checker.frozen_problems(path)
    return problems


# ----- tests -------------------------------------------------------------------------------
def test_no_reference_points_outside_the_repository():
    problems = violations()
    assert problems == [], "\n".join(problems)


def test_the_design_documents_exist_and_are_linked_from_the_readme():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name in ("architecture", "engine_rules", "calibration", "statistics", "paper_design",
                 "usage", "serving", "real_path", "benchmarks", "results"):
        assert (REPO / "docs" / f"{name}.md").is_file()
        assert f"docs/{name}.md" in readme
        assert REPO / "docs" / f"{name}.md" in linked_pages(REPO / "README.md")


def test_every_docs_page_is_scanned_and_reachable_from_the_readme():
    """Every docs/*.md is among the scanned files (so its links, anchors and sections are
    checked by the test above) and a chain of Markdown links from README.md reaches it."""
    pages = sorted((REPO / "docs").glob("*.md"))
    assert pages and set(pages) <= set(repo_files())
    assert unreachable_docs() == []


def test_the_readme_is_a_front_door():
    """At most 250 lines; its two commands and the engine-rule recipe."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    assert "**An engine rule**" in readme and "docs/engine_rules.md" in readme


def test_the_register_in_the_docs_covers_every_reading():
    """docs/paper_design.md section 8 has a row for every item of conf/prereg/readings.yaml."""
    readings = yaml.safe_load((REPO / "conf" / "prereg" / "readings.yaml").read_text())
    _, labels = headings(REPO / "docs" / "paper_design.md")
    assert sorted(readings, key=lambda a: int(a[1:])) == sorted(
        (lab for lab in labels if re.fullmatch(r"A\d+", lab)), key=lambda a: int(a[1:]))


def _plant(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def planted(tmp_path):
    """A small repository: a docs page, a plan, and one good file of each kind."""
    _plant(tmp_path, "docs/engine_rules.md", "# Engine rules\n\n## 3 Memory\n\n## 5 Step\n")
    _plant(tmp_path, "docs/paper_design.md", "# Design\n\n### 3.2 EXT-22\n\n| A1 | x |\n")
    _plant(tmp_path, "docs/calibration.md", "# Calibration\n\n### A. Control\n")
    _plant(tmp_path, "conf/prereg/q1.yaml",
           f"# plan\ndescription: 'the family ({_DESIGN} 3.2; AMBIGUOUS A1)'\n")
    _plant(tmp_path, "conf/executor/a100.yaml", f"calibration: fitted to {_ANCHORS}.md section A\n")
    _plant(tmp_path, "good.py", '"""Invariants (docs/engine_rules.md section 3)."""\n'
           "# the step loop: docs/engine_rules.md#5-step\n")
    _plant(tmp_path, "README.md", "See [rules](docs/engine_rules.md#3-memory), section 3.\n")
    return tmp_path


def test_the_planted_repository_is_clean(planted):
    assert violations(planted, sorted(p for p in planted.rglob("*") if p.is_file())) == []


def test_a_docs_page_no_link_reaches_is_reported(planted):
    assert unreachable_docs(planted) == ["docs/calibration.md", "docs/paper_design.md"]
    _plant(planted, "docs/engine_rules.md", "# Engine rules\n\n[design](paper_design.md)\n")
    assert unreachable_docs(planted) == ["docs/calibration.md"]


@pytest.mark.parametrize("relative, text, expected", [
    ("bad.py", '"""Invariants (' + _SPEC + ' section 3)."""\n', "names a design note"),
    ("bad.py", "# see " + _ANCHORS + ".md F\n", "names a design note"),
    ("bad.py", 'X = "/work/shared/' + _DESIGN + '.md"\n', "outside the repository"),
    ("bad.py", "# ../shared/notes\n", "outside the repository"),
    ("bad.py", '"""See docs/missing.md."""\n', "does not exist"),
    ("bad.py", '"""See docs/engine_rules.md section 4."""\n', "has no section 4"),
    ("bad.py", "# docs/engine_rules.md#no-such-heading\n", "has no heading"),
    ("conf/other.yaml", "why: " + _SPEC + " 5's gate\n", "names a design note"),
    ("notes.md", "[rules](/abs/docs/engine_rules.md)\n", "absolute link"),
    ("notes.md", "[up](../../outside.md)\n", "leaves the repository"),
    ("notes.md", "[gone](docs/gone.md)\n", "does not exist"),
    ("docs/usage.md", "[gone](gone.md)\n", "does not exist"),
    ("docs/usage.md", "[rules](engine_rules.md#nope)\n", "has no heading"),
    ("docs/usage.md", "[rules](docs/engine_rules.md)\n", "does not exist"),
    ("conf/campaign/intro.md", "See [Q99](q99.md).\n", "not a page the report writes"),
    ("notes.md", "[rules](docs/engine_rules.md#nope)\n", "has no heading"),
    ("notes.md", "[rules](docs/engine_rules.md), section 9\n", "has no section 9"),
    ("conf/prereg/q1.yaml", f"description: '({_DESIGN} 7.7)'\n", "has no section 7.7"),
    ("conf/prereg/q1.yaml", f"title: x  # {_DESIGN} 3.2\n", "outside the frozen values"),
    ("conf/prereg/q1.yaml", f"# {_DESIGN} 3.2\ntitle: x\n", "names a design note"),
])
def test_a_planted_bad_reference_is_reported(planted, relative, text, expected):
    _plant(planted, relative, text)
    problems = violations(planted, sorted(p for p in planted.rglob("*") if p.is_file()))
    assert any(expected in p for p in problems), problems
