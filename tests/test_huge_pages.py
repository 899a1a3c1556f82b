"""The arena's pools advised for transparent huge pages (serving_core/executor/huge_pages.py):
zeros as before, the 2-MiB-aligned interior advised and forgotten when the tensor is freed,
`off` advises nothing, a bad mode is refused with its allowed values."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from serving_core.executor import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                               reason="transparent huge pages are a Linux feature")


@linux_thp
def test_a_pool_is_zeros_with_its_interior_advised(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "auto")
    gc.collect()
    before = set(huge_pages._ranges)  # other tests' arenas in this process may still live
    t = huge_pages.zeros((3, 5 << 20), torch.uint8, "cpu")
    assert t.shape == (3, 5 << 20) and not t.any()
    got = huge_pages.settings()
    mine = set(huge_pages._ranges) - before
    advised = sum(e - s for s, e in mine)
    assert len(mine) == 1 and 12 << 20 <= advised <= 15 << 20 and advised % huge_pages.HUGE == 0
    (start, end), = mine
    assert start >= t.data_ptr() and end <= t.data_ptr() + t.numel()
    assert 0 <= got["huge_bytes"] <= got["advised_bytes"]
    del t
    gc.collect()
    assert not mine & set(huge_pages._ranges)  # forgotten with the tensor


def test_off_advises_nothing_and_a_bad_mode_is_refused(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "off")
    before = huge_pages.settings()["advised_bytes"]
    t = huge_pages.zeros((4 << 20,), torch.float32, "cpu")
    got = huge_pages.settings()
    assert not t.any() and got["mode"] == "off" and got["advised_bytes"] == before
    monkeypatch.setenv(huge_pages.ENV, "yes")
    with pytest.raises(ValueError, match=r"HSL_ARENA_HUGE_PAGES='yes' \(environment\): allowed "
                                         "values are "
                                         "auto, off"):
        huge_pages.zeros((4,), torch.float32, "cpu")


@linux_thp
def test_the_runtime_record_reads_the_paged_path_back(monkeypatch):
    """process_settings' runtime record states the arena's huge pages and the paged loops as
    this process has them (the modules' own read-back), not as requested."""
    from serving_core.model import paged_loops
    from serving_core.server import process_settings

    monkeypatch.setenv(huge_pages.ENV, "auto")
    t = huge_pages.zeros((5 << 20,), torch.uint8, "cpu")
    record = process_settings.runtime_settings()
    assert record["arena_huge_pages"]["advised_bytes"] >= 2 << 20  # a 2-MiB-aligned interior
    now = huge_pages.settings()  # huge_bytes may move between two reads (khugepaged)
    assert {k: record["arena_huge_pages"][k] for k in ("mode", "advised_bytes")} == {
        k: now[k] for k in ("mode", "advised_bytes")}
    assert 0 <= record["arena_huge_pages"]["huge_bytes"] <= now["advised_bytes"]
    assert record["paged_loops"] == paged_loops.settings()
    assert record["paged_loops"]["loops"] in ("compiled", "python")
    del t
