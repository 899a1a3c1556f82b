"""Simulated tables are a pure function of (config, seed), and stay what they were.

tests/data/engine_table_hashes.json holds the SHA-256 (first 16 hex) of every engine
table of a fixed set of smoke-size simulated cells (Q1's S0/S1/S2 cells at every budget,
Exp 1b's low-load cell, and D0, N0, S2+Retention, first_chunk and headroom cells),
computed on the code before the one-engine builder. A change of any table is a change
of behaviour: either a fix meant to change it (then the file is regenerated with
`python tests/test_table_hashes.py > tests/data/engine_table_hashes.json` and the
change is named in the commit), or a regression.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data" / "engine_table_hashes.json"
CONF = str(Path(__file__).resolve().parent.parent / "conf")


def cells() -> list[tuple[str, ...]]:
    out = []
    for org in ("s0", "s1", "s2"):
        for budget in ("b63", "b83", "b108"):
            out.append((f"org={org}", f"budget={budget}", "seed=42000", "engine.pinning_k=2"))
        out.append((f"org={org}", "budget=b108", "engine.cap=109", "load.rate=0.8", "seed=0",
                    "engine.pinning_k=2"))
    for extra in (("org=d0", "budget=b63"),
                  ("org=s2_retention", "budget=p254", "trace=true"),
                  ("org=n0", "budget=b83"),
                  ("org=s2", "budget=b63", "trace=true", "semantics=first_chunk"),
                  ("org=s1", "budget=b63", "engine.headroom=0.19")):
        out.append((*extra, "seed=42001"))
    return out


def digest(table: dict) -> str:
    return hashlib.sha256(json.dumps(table, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def table_hashes(cell: tuple[str, ...]) -> dict[str, str]:
    from hydra import compose, initialize_config_dir

    from experiments.runners.cell import run_cell

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config",
                      overrides=[*cell, "workload.num_requests=60", "write_ledgers=false"])
    return {name: digest(t) for name, t in sorted(run_cell(cfg).tables.items())}


EXPECTED = json.loads(DATA.read_text())


@pytest.mark.parametrize("cell", cells(), ids=" ".join)
def test_engine_tables_are_unchanged(cell):
    assert table_hashes(cell) == EXPECTED[" ".join(cell)]


if __name__ == "__main__":  # regenerate the reference
    json.dump({" ".join(c): table_hashes(c) for c in cells()}, sys.stdout, indent=1,
              sort_keys=True)
    print()
