"""The torch side's environment switches and their allowed values, torch-free.

The paged loops (serving_core/model/paged_loops.py) and the arena's huge pages
(serving_core/executor/huge_pages.py) read their switch at first use, deep in an engine that
may run in a child process; the server's argument check and the runner's executor check call
`check` at start instead, so a bad value is one line and a nonzero exit before anything is
loaded or written (the API process never imports torch).
"""

from __future__ import annotations

import os

PAGED_LOOPS = "HSL_PAGED_LOOPS"
ARENA_HUGE_PAGES = "HSL_ARENA_HUGE_PAGES"
ALLOWED = {PAGED_LOOPS: ("auto", "compiled", "python"), ARENA_HUGE_PAGES: ("auto", "off")}


def value(name: str, env=None) -> str:
    """The switch's value (`auto` when unset); ValueError names it and the allowed values."""
    got = (os.environ if env is None else env).get(name, "auto")
    if got not in ALLOWED[name]:
        raise ValueError(f"{name}={got!r} (environment): allowed values are "
                         f"{', '.join(ALLOWED[name])}")
    return got


def check(env=None) -> None:
    """Every switch's value is allowed (ValueError names the first that is not)."""
    for name in ALLOWED:
        value(name, env)
