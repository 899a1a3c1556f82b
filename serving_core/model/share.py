"""Items of one job shared by the split worker and the calling thread inside a task pair.

In a decode layer pair (serving_core/model/split.py `tasks`) the worker runs the Mamba mixer
while the calling thread runs attention; when attention ends first, the calling thread used
to wait. With a `Share` open for the pair, the worker's state update (mamba._update_pieces)
offers its pieces here in chunks of CHUNK pieces: the worker takes chunks from the front,
the calling thread, once its own side has ended, from the back (`help`). Each piece's
arithmetic is its own (the same calls on the same operands whichever thread runs them), so
the bits do not depend on who ran which chunk; tests/test_split.py compares them.
Outside an open share (no worker, or not on the worker in a pair) `items` runs everything
on the calling thread in one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

CHUNK = 8  # pieces per chunk (0: no sharing; mamba.state_update's pieces: one per sequence)


class Share:
    """One pair's shared job slot: the worker's `items`, the calling thread's `help`."""

    def __init__(self, worker: threading.Thread) -> None:
        self.worker = worker
        self.cond = threading.Condition()
        self.run: Callable[[int, int], None] | None = None
        self.n = self.lo = self.hi = self.busy = 0
        self.ended = False
        self.error: BaseException | None = None

    def items(self, n: int, run: Callable[[int, int], None]) -> None:
        """run(first, end) over [0, n) in chunks, the calling thread's help taking some;
        returns when every chunk has ended (an error in a helped chunk is raised here)."""
        chunks = -(-n // CHUNK)
        with self.cond:
            self.run, self.n, self.lo, self.hi = run, n, 0, chunks
            self.cond.notify_all()
        try:
            while (c := self._claim(front=True)) is not None:
                run(c * CHUNK, min(n, (c + 1) * CHUNK))
        finally:
            with self.cond:
                self.lo = self.hi  # nothing more to claim (after an error here too)
                while self.busy:
                    self.cond.wait()
                self.run, error, self.error = None, self.error, None
        if error is not None:
            raise error

    def _claim(self, front: bool) -> int | None:
        with self.cond:
            if self.lo >= self.hi:
                return None
            if front:
                self.lo += 1
                return self.lo - 1
            self.hi -= 1
            self.busy += 1
            return self.hi

    def end(self) -> None:
        """The worker's side has returned: `help` stops waiting."""
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def help(self) -> None:
        """Run chunks of the worker's shared jobs from the back until its side ends."""
        while True:
            with self.cond:
                while not self.ended and (self.run is None or self.lo >= self.hi):
                    self.cond.wait()
                if self.ended:
                    return
                run, n = self.run, self.n
            c = self._claim(front=False)
            if c is None:
                continue
            try:
                run(c * CHUNK, min(n, (c + 1) * CHUNK))
            except BaseException as err:  # raised on the worker, in its `items`
                with self.cond:
                    self.error = err
            finally:
                with self.cond:
                    self.busy -= 1
                    self.cond.notify_all()


_open: Share | None = None


def open_share(slot: Share | None) -> None:
    """The share of the pair now running (None: none)."""
    global _open
    _open = slot


def items(n: int, run: Callable[[int, int], None]) -> None:
    """run(first, end) over [0, n): shared with the calling thread when called on the worker
    inside an open share (CHUNK > 0), else in one call here."""
    share = _open
    if share is None or CHUNK <= 0 or threading.current_thread() is not share.worker:
        run(0, n)
        return
    share.items(n, run)
