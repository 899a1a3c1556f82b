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
