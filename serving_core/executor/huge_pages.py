"""Transparent huge pages for the state arena's pools (Linux, CPU).

A paged decode reads each sequence's KV pages and SSM member pages at scattered addresses in
the arena; with 4-KiB pages every 4 KiB read takes a TLB miss and a page walk whose entries
are scattered too. Where transparent huge pages are enabled `madvise` (the usual default) or
`always`, a pool advised before it is first written is faulted in 2-MiB pages: at S2 batch
53 the paged mixer's ratio to the contiguous one went 1.140 -> 1.064 / 1.058 and the whole
model's 1.125 -> 1.082 / 1.043 (docs/benchmarks.md section 7). Only the mapping changes, never
a value, so the bits are the same.

`HSL_ARENA_HUGE_PAGES=auto` (default): advise the pools' 2-MiB-aligned interiors; `off`: do
not. `settings()` reads back, from /proc/self/smaps, how many bytes of the advised ranges the
kernel holds in huge pages (the runtime record).
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import torch

from serving_core import env_switches

ENV = env_switches.ARENA_HUGE_PAGES
MODES = env_switches.ALLOWED[ENV]
HUGE = 1 << 21
MADV_HUGEPAGE = 14

_ranges: list[tuple[int, int]] = []  # advised [start, end) of live tensors in this process


def mode() -> str:
    return env_switches.value(ENV)


def zeros(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape), a CPU tensor's 2-MiB-aligned interior advised for huge pages
    before it is first written (mode `auto`, Linux)."""
    device = torch.device(device)
    if device.type != "cpu" or mode() == "off" or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    start = -(-t.data_ptr() // HUGE) * HUGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE * HUGE
    if end > start and _madvise(start, end - start):
        _ranges.append((start, end))
        weakref.finalize(t, _ranges.remove, (start, end))  # freed with the tensor
    return t.zero_()


def _madvise(start: int, length: int) -> bool:
    try:
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(start, length, MADV_HUGEPAGE) == 0


def settings() -> dict:
    """{"mode", "advised_bytes", "huge_bytes"}: the bytes advised in this process and those
    of them the kernel maps in huge pages now (AnonHugePages of the mappings they lie in)."""
    advised = sum(e - s for s, e in _ranges)
    return {"mode": mode(), "advised_bytes": advised,
            "huge_bytes": _huge_bytes() if advised else 0}


def _huge_bytes() -> int:
    """AnonHugePages of the /proc/self/smaps mappings that overlap an advised range, each
    mapping's counted up to its overlap with the advised ranges (a mapping may hold huge
    pages outside them, e.g. where THP is `always`): at most the advised bytes."""
    total, overlap = 0, 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    overlap = sum(max(0, min(hi, e) - max(lo, s)) for s, e in _ranges)
                elif overlap and head == "AnonHugePages:":
                    total += min(int(line.split()[1]) * 1024, overlap)
    except OSError:
        return 0
    return total
