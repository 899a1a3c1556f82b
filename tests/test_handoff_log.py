"""split.log_handoffs: each hand-off's times are charged to its call site, results unchanged."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from serving_core.model import split
from serving_core.model.handoff_log import FIELDS, HandoffLog


@pytest.fixture
def log():
    split.install(1)
    log = HandoffLog()
    split.log_handoffs(log)
    yield log
    split.log_handoffs(None)
    split.close()


def _busy(s: float) -> int:
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass
    return 1


def test_waits_and_worker_time_are_charged_to_the_call_site(log):
    assert split.pair(lambda: 1, lambda: _busy(0.05)) == (1, 1)
    time.sleep(0.03)  # the worker idles meanwhile
    x, w = torch.randn(512, 128), torch.randn(512, 128)
    assert torch.equal(split.linear(x, w), F.linear(x, w))  # cut: a second site
    with pytest.raises(ZeroDivisionError):
        split.pair(lambda: 1, lambda: 1 / 0)
    rows = log.table()
    here = "pair <- test_waits_and_worker_time_are_charged_to_the_call_site"
    cut = "linear <- test_waits_and_worker_time_are_charged_to_the_call_site"
    assert rows[here]["calls"] == 2 and rows[cut]["calls"] == 1
    assert rows[here]["worker_cpu_s"] >= 0.05 and rows[here]["engine_wait_s"] >= 0.04
    assert rows[cut]["worker_idle_before_s"] >= 0.03
    assert rows["total"]["calls"] == 3 and set(rows["total"]) == set(FIELDS)
