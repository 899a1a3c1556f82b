"""Per-call-site timing of the split worker's hand-offs (split.py), for profiling.

`split.log_handoffs(HandoffLog())` turns it on: every hand-off (`split._on`: pair,
layer_pair, the halves, the scan and attention cuts) is charged, under its site (the split.py
function the model called and the model function that called it), with the calling
thread's time computing its own side, its time then waiting for the worker (engine wait),
the worker's wall and CPU time on the job, and the worker's idle time before the job began
(the engine thread working alone since the worker's previous job ended). Wall times from
perf_counter, CPU from thread_time. Off (the default) nothing is timed.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

_HANDOFF = {"_on", "_timed", "job", "pair", "_halves", "<lambda>"}
_HELPERS = {"<lambda>", "_lin", "run", "packed"}  # the model's closures and wrappers
FIELDS = ("calls", "here_s", "engine_wait_s", "worker_s", "worker_cpu_s", "worker_idle_before_s")


def site(depth: int = 2) -> str:
    """'split function <- model function' of the hand-off being made `depth` frames up."""
    f = sys._getframe(depth)
    split_fn = None
    while f is not None:
        name = f.f_code.co_name
        if f.f_code.co_filename.endswith("split.py"):
            if name not in _HANDOFF:
                split_fn = name
        elif name not in _HELPERS:
            return f"{split_fn or 'pair'} <- {name}"
        f = f.f_back
    return split_fn or "pair"


class HandoffLog:
    """Sums per site (FIELDS); the worker's idle gaps are charged to the next job's site."""

    def __init__(self) -> None:
        self.sites: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
        self._worker_free = None  # perf_counter when the worker's last job ended

    def caller(self, key: str, here_s: float, wait_s: float) -> None:
        row = self.sites[key]
        row["calls"] += 1
        row["here_s"] += here_s
        row["engine_wait_s"] += wait_s

    def worker(self, key: str, start: float, end: float, cpu_s: float) -> None:
        row = self.sites[key]
        row["worker_s"] += end - start
        row["worker_cpu_s"] += cpu_s
        if self._worker_free is not None:
            row["worker_idle_before_s"] += start - self._worker_free
        self._worker_free = end

    def table(self) -> dict[str, dict[str, float]]:
        """The sums per site, largest engine wait first, with a 'total' row."""
        rows = dict(sorted(self.sites.items(), key=lambda kv: -kv[1]["engine_wait_s"]))
        rows["total"] = {k: sum(r[k] for r in self.sites.values()) for k in FIELDS}
        return rows


def now() -> tuple[float, float]:
    """(perf_counter, thread_time) of the calling thread."""
    return time.perf_counter(), time.thread_time()
