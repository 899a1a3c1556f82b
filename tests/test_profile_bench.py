"""bench.profile_bench's hooks: CPU time, system time and page faults charged exclusively
(a hooked call's own usage minus that of the hooked calls it makes)."""

from __future__ import annotations

import mmap

from bench.profile_bench import _Timer


class _Work:
    def outer(self):
        return self.inner()

    def inner(self):
        block = mmap.mmap(-1, 8 << 20)  # fresh anonymous pages: each first write faults
        for off in range(0, 8 << 20, 4096):
            block[off] = 1
        block.close()


def test_faults_go_to_the_innermost_hooked_category():
    timer = _Timer()
    originals = {name: timer.wrap(_Work, name, name) for name in ("outer", "inner")}
    try:
        _Work().outer()
    finally:
        for name, fn in originals.items():
            setattr(_Work, name, fn)
    assert timer.calls == {"outer": 1, "inner": 1}
    assert timer.faults["inner"] >= 2000  # 2,048 pages written
    assert timer.faults["outer"] < 100
    assert timer.totals["inner"] > 0 and timer.totals["outer"] >= 0


def test_a_run_states_the_paged_loops_and_the_arenas_huge_pages(tiny_checkpoint):
    """The profile's record reads back what the engine ran with, as the server's runtime
    record does: which per-page loops, and the arena's advised bytes (read while it lives)."""
    from bench.profile_bench import run
    from serving_core.executor import huge_pages
    from serving_core.model import paged_loops
    from serving_core.model.falcon_h1 import FalconH1

    model = FalconH1.load(tiny_checkpoint)
    before = huge_pages.settings()["advised_bytes"]
    r = run(model, "S2", "b63", 2, 24, 2, 2048, False, "off")
    assert r["paged_loops"] == paged_loops.settings()
    assert r["paged_loops"]["loops"] in ("compiled", "python")
    got = r["arena_huge_pages"]
    assert got["mode"] == huge_pages.mode()
    if got["mode"] == "auto" and huge_pages.sys.platform.startswith("linux"):
        assert got["advised_bytes"] > before  # the run's arena, alive when read
