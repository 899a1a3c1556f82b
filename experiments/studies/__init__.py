"""Studies: drivers that are not campaign cells (`python -m experiments.studies.<name>`).

Every study writes its record through ledgers.studies, the module's TABLE naming its
study table (documented schema in STUDY_SCHEMAS, atomic write, audited by ledgers.check)
beside any campaign runs it makes, and has its page in analysis/studies/<name>.py. The
fits in CONFIG_FITS write configuration instead (conf/executor/, or print only) and no
study table. `study_parser` is their one argument parser: the options every study
spells the same way, before the study adds its own.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

CONFIG_FITS = ("calibrate", "codec_fit")
TINY_CHECKPOINT = "models/falcon_h1_tiny"
TINY_PRESET = "falcon_h1_tiny"


def default_ledger_root() -> Path:
    """$LEDGER_ROOT, else ledgers/data (the Makefile's default)."""
    return Path(os.environ.get("LEDGER_ROOT", "ledgers/data"))


def study_parser(name: str, doc: str | None, *, ledgers: bool = True, model: bool = False,
                 run: bool = False, smoke: str | None = None) -> argparse.ArgumentParser:
    """The parser of study `name` (its description: `doc`'s first paragraph).

    ledgers: --ledger-root (also --ledgers), the ledger root the study reads and writes.
    model: --checkpoint and --preset of the model a torch study loads (the tiny one).
    run: --budget and --seed of a torch study's runs.
    smoke: --smoke (help: this text), --seeds and --requests (None: the study's sizes).
    """
    p = argparse.ArgumentParser(prog=f"python -m experiments.studies.{name}",
                                description=(doc or "").split("\n\n")[0])
    if ledgers:
        p.add_argument("--ledger-root", "--ledgers", dest="ledger_root", type=Path,
                       default=default_ledger_root(), help="ledger root (default: %(default)s)")
    if model:
        p.add_argument("--checkpoint", default=TINY_CHECKPOINT)
        p.add_argument("--preset", default=TINY_PRESET)
    if run:
        p.add_argument("--budget", default="b63")
        p.add_argument("--seed", type=int, default=0)
    if smoke is not None:
        p.add_argument("--smoke", action="store_true", help=smoke)
        p.add_argument("--seeds", type=int, default=None, help="the first N seeds of every cell")
        p.add_argument("--requests", type=int, default=None, help="requests per run")
    return p
