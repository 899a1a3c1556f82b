"""The engine's clocks: virtual time for modelled steps, wall time for real ones."""

from __future__ import annotations

import time


class VirtualClock:
    """Simulated time: moves only when a step's modelled duration or an idle jump moves it."""

    wall = False
    kind = "virtual"

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def step_done(self, t0: float, modelled_s: float) -> float:
        self.t = t0 + modelled_s
        return self.t


class WallClock:
    """Wall time since the clock started; waiting sleeps, steps take what they take."""

    wall = True
    kind = "wall"

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Read time from now on (an engine built ahead of its run starts it at the run)."""
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)

    def step_done(self, t0: float, modelled_s: float) -> float:
        return self.now()


CLOCK_CLASSES = {cls.kind: cls for cls in (VirtualClock, WallClock)}
