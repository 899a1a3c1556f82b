"""CPU seconds and page faults of a process tree, read from /proc (Linux).

A server's own counters: vLLM's OpenAI server runs its engine core in a child process, so
the tree (the process and every live descendant) is what serves. `tree_usage(pid)` sums
user and system CPU seconds and minor / major page faults over it; the difference of two
readings around a timed batch is that batch's cost (`usage_delta`). Where /proc is not
there (not Linux) the readings are empty and so is the delta.
"""

from __future__ import annotations

import os
from pathlib import Path

FIELDS = ("cpu_s", "minor_faults", "major_faults")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _stat(pid: int) -> tuple[float, int, int] | None:
    """(user + system CPU s, minor faults, major faults) of one live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on
    tick = os.sysconf("SC_CLK_TCK")
    return (int(rest[11]) + int(rest[12])) / tick, int(rest[7]), int(rest[9])


def tree_usage(pid: int | None) -> dict[int, tuple[float, int, int]]:
    """Per live process of the tree rooted at `pid`: (CPU s, minor, major faults)."""
    seen: dict[int, tuple[float, int, int]] = {}
    todo = [pid] if pid else []
    while todo:
        p = todo.pop()
        stat = _stat(p)
        if stat is None or p in seen:
            continue
        seen[p] = stat
        todo += _children(p)
    return seen


def usage_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU s and page faults the tree used between two `tree_usage` readings (a process that
    started in between counts from zero); empty when there was nothing to read."""
    if not after:
        return {}
    zero = (0.0, 0, 0)
    sums = [sum(after[p][i] - before.get(p, zero)[i] for p in after) for i in range(3)]
    return dict(zip(FIELDS, sums, strict=True))
