"""The torch side's environment switches: checked at start (server, runner) with one line
naming the variable and its allowed values; the modules that read them use the same table."""

from __future__ import annotations

import pytest

from serving_core import env_switches
from serving_core.executor import huge_pages
from serving_core.executor.torch_config import torch_executor_config
from serving_core.model import paged_loops

CASES = [("HSL_PAGED_LOOPS", "fast", "auto, compiled, python"),
         ("HSL_ARENA_HUGE_PAGES", "yes", "auto, off")]


def test_the_readers_use_the_table():
    assert (paged_loops.ENV, paged_loops.MODES) == ("HSL_PAGED_LOOPS",
                                                    ("auto", "compiled", "python"))
    assert (huge_pages.ENV, huge_pages.MODES) == ("HSL_ARENA_HUGE_PAGES", ("auto", "off"))


@pytest.mark.parametrize(("name", "bad", "allowed"), CASES)
def test_a_bad_value_is_named_with_the_allowed_ones(name, bad, allowed, monkeypatch):
    assert env_switches.value(name, {}) == "auto"
    for good in allowed.split(", "):
        assert env_switches.value(name, {name: good}) == good
    line = f"{name}={bad!r} (environment): allowed values are {allowed}"
    with pytest.raises(ValueError) as err:
        env_switches.check({name: bad})
    assert str(err.value) == line
    monkeypatch.setenv(name, bad)  # the runner's executor check, before any model loads
    with pytest.raises(ValueError) as err:
        torch_executor_config({"checkpoint": "x", "kind": "torch"})
    assert str(err.value) == line
