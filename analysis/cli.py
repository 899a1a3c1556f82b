"""Command-line plumbing of the analysis pages: the `--ledgers ROOT` argument and its check."""

from __future__ import annotations

import argparse
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
