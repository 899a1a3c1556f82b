"""What a new user reads from make: the help text names no unexpanded variable, and the
no-tcmalloc note belongs to the install (when .venv is (re)installed), not to every target.

Everything here is a dry run (`make -n`) or `make help`: nothing is installed or run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STAMP = ".venv/.installed"


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_help_shows_no_make_variable_unexpanded():
    proc = _make("-s", "help")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^serve +.*127\.0\.0\.1", proc.stdout, re.M)
    leftovers = [line for line in proc.stdout.splitlines() if re.search(r"\$[({]|\$\$", line)]
    assert leftovers == []


def test_the_tcmalloc_note_is_part_of_the_install():
    """A (re)install (pyproject.toml newer than the stamp) checks for tcmalloc; its recipe
    is what `make -n` prints then."""
    proc = _make("-n", "-W", "pyproject.toml", "setup")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line)
    note = next(i for i, line in enumerate(lines) if "no tcmalloc found" in line)
    assert install < note < next(i for i, line in enumerate(lines) if f"touch {STAMP}" in line)


@pytest.mark.parametrize("target", ["setup", "test", "lint", "plan", "demo", "serve"])
def test_a_target_over_an_installed_venv_says_nothing_of_tcmalloc(target):
    proc = _make("-n", "-o", STAMP, target, "LEDGER_ROOT=/nonexistent")
    assert proc.returncode == 0, proc.stderr
    assert "tcmalloc" not in proc.stdout + proc.stderr
