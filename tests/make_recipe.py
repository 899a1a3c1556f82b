"""A make target's recipe run in the test process: `make -n` prints the commands the target
would run; each `python -m <module> ARGS` among them is run here through the module's own
entry (no interpreter start and imports per command: about 2 CPU s each). The tests that
use it check what the commands leave; the make targets themselves run in slow tests, and
real make runs of the same kinds of recipe stay in tests/test_arms_campaign.py (`make
campaign`) and tests/test_attribution.py (a question target, then its page).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_dry_run(*args: str) -> str:
    """What `make -n ARGS` prints (the stamp of .venv taken as up to date: nothing installs)."""
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "-n",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def recipe_commands(dry_run: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of each `python -m <module> ...` line `make -n` printed (its
    continuation lines joined; a redirection ends the arguments)."""
    commands = []
    for line in dry_run.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if len(words) > 2 and words[0].endswith("/python") and words[1] == "-m":
            args = words[3:]
            commands.append((words[2], args[:args.index(">")] if ">" in args else args))
    return commands


def run_in_process(module: str, args: list[str]) -> tuple[int, str, str]:
    """`python -m module ARGS` in this process: (exit code, stdout, stderr). The Hydra app
    (experiments.run) through the campaign driver's in-process call
    (experiments/studies/identify.py), any other module through its `main(argv)`."""
    if module == "experiments.run":
        from experiments.studies.identify import campaign_in_process

        return campaign_in_process(args)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(module).main(args)
    return code, out.getvalue(), err.getvalue()
