"""CPU seconds and page faults of a process tree, and of each of its threads, read from /proc
(Linux).

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
# per thread (`thread_usage`): counters that add up between two readings
THREAD_FIELDS = ("cpu_s", "sys_s", "minor_faults", "voluntary_switches",
                 "involuntary_switches", "run_s", "wait_s")


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


def _thread(task: Path) -> dict | None:
    """One thread's counters: CPU and system s and minor faults (stat), voluntary and
    involuntary context switches (status), s on a core and s runnable waiting for one
    (schedstat); its name and start (clock ticks after boot) tell threads apart."""
    try:
        stat, status = (task / "stat").read_text(), (task / "status").read_text()
        sched = (task / "schedstat").read_text().split()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    tick = os.sysconf("SC_CLK_TCK")
    switches = dict(line.split(":", 1) for line in status.splitlines() if "ctxt" in line)
    return {"comm": stat[stat.index("(") + 1:stat.rindex(")")], "start": int(rest[19]),
            "cpu_s": (int(rest[11]) + int(rest[12])) / tick, "sys_s": int(rest[12]) / tick,
            "minor_faults": int(rest[7]),
            "voluntary_switches": int(switches["voluntary_ctxt_switches"]),
            "involuntary_switches": int(switches["nonvoluntary_ctxt_switches"]),
            "run_s": int(sched[0]) / 1e9, "wait_s": int(sched[1]) / 1e9}


def thread_usage(pid: int | None) -> dict[tuple[int, int], dict]:
    """Per live thread of the tree rooted at `pid`, keyed (process id, thread id): `_thread`."""
    out = {}
    for p in tree_usage(pid):
        for task in Path(f"/proc/{p}/task").glob("*"):
            reading = _thread(task)
            if reading is not None:
                out[(p, int(task.name))] = reading
    return out


def thread_delta(before: dict, after: dict) -> list[dict]:
    """What each thread used between two `thread_usage` readings (one started in between
    counts from zero), busiest first; each with its process, id, name and start."""
    rows = []
    for (pid, tid), now in after.items():
        was = before.get((pid, tid), {})
        rows.append({"pid": pid, "tid": tid, "comm": now["comm"], "start": now["start"],
                     **{k: round(now[k] - was.get(k, 0), 6) for k in THREAD_FIELDS}})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def usage_delta(before: dict, after: dict) -> dict[str, float]:
    """CPU s and page faults the tree used between two `tree_usage` readings (a process that
    started in between counts from zero); empty when there was nothing to read."""
    if not after:
        return {}
    zero = (0.0, 0, 0)
    sums = [sum(after[p][i] - before.get(p, zero)[i] for p in after) for i in range(3)]
    return dict(zip(FIELDS, sums, strict=True))
