"""Commands printed in hints and usage lines, spelled so that they work when pasted.

A bare `python` is not the project's interpreter outside the virtual environment;
`python_command()` names the interpreter running now (`.venv/bin/python` from
the repository root), so `python_command() + " -m ledgers.check ROOT"` works.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def python_command() -> str:
    """The running interpreter, relative to the working directory when inside it."""
    exe = Path(sys.executable or "python3")
    try:
        rel = Path(os.path.relpath(exe, Path.cwd()))
    except ValueError:
        return str(exe)
    return str(exe) if rel.parts[:1] == ("..",) else rel.as_posix()


def module_command(module: str, *args: str) -> str:
    """`<interpreter> -m <module> [args]` as a user can paste it."""
    return " ".join([python_command(), "-m", module, *args])


__all__ = ["module_command", "python_command"]
