"""The order in which the suite's files are handed to the xdist workers: costliest first.

`--dist loadfile` gives each worker a whole file at a time, in collection order; a costly
file collected last keeps one worker busy while the other has nothing left (the idle tail).
Ordering the files by the seconds each held its worker in a recent run (`tests/durations.json`,
written by `make test-cpu`), costliest first, leaves the cheap files for the end, where they
fill the gaps. A file not in the table (new, or renamed) goes in the middle, at the median
cost. Within a file the tests keep their order, so module and class fixtures are shared as
before.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

COSTS = Path(__file__).resolve().parent / "durations.json"


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """Seconds by test file (relative to the repository), {} without a table."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def write_costs(seconds: dict[str, float], path: Path = COSTS) -> None:
    """The table, costliest first (one line a file, so a rerun diffs by line)."""
    rows = sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))
    path.write_text(json.dumps({k: round(v, 1) for k, v in rows}, indent=0) + "\n")


def file_order(files: list[str], costs: dict[str, float]) -> list[str]:
    """`files` (distinct, in collection order), costliest first; unknown ones at the median
    cost of the known; ties keep collection order."""
    known = [costs[f] for f in files if f in costs]
    middle = median(known) if known else 0.0
    return sorted(files, key=lambda f: -costs.get(f, middle))


def order_items(items: list, costs: dict[str, float]) -> None:
    """Reorder pytest's collected `items` in place: whole files by `file_order`."""
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    items[:] = [item for f in file_order(list(by_file), costs) for item in by_file[f]]
