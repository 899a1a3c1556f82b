"""The server process's runtime settings: torch intra-op threads and the allocator.

A server process runs three kinds of work: the engine thread's torch kernels (intra-op
threads), the event loop (HTTP, SSE) and, on a benchmark machine, the client. OpenMP's
intra-op workers spin between kernels; with as many workers as cores they compete with the
event loop for the core it needs to stream tokens. `--threads auto` (0) therefore decides
from a measurement at start (serving_core/executor/threads.py): per phase (prefill, decode),
a larger count only where it makes that phase's product >= 1.25x faster, the counts and the
timings stated in `runtime_settings()["threads_auto"]`. Earlier measurements on the 2-core
machine under load (8-28): bench serve, S2, tcmalloc, 1 thread 87.4 / 86.5 output tok/s,
2 threads 84.8 / 78.8 (alternating runs); process CPU ms per call 1 -> 2 threads: LM head
decode 64 x 128 x 128,256 45.5 -> 68.0, prefill in_proj 2,048 x 128 x 2,572 25.0 -> 37.5, a
scan bmm 48 x 256 x 256 x 64 7.0 -> 10.5 (a second thread costs 50 % more CPU for at most
1.33x). The allocator is set by the launcher (LD_PRELOAD,
experiments.runners.server_process.allocator_env); the server reads back which one its process
actually has mapped.

glibc malloc serves every allocation above its mmap threshold (at most 32 MiB, e.g. a
decode step's 64 x 128,256 fp32 logits) with a fresh mmap and returns it on free, and trims
the heap's top back to the kernel: each step page-faults its large tensors in again (a third
of the CPU time as system time in the first measurements). `keep_freed_memory` (applied by
the server and the profile benchmark) sets glibc's mallopt so that memory, once taken,
stays with the process: no mmap for large blocks, no trimming, one arena (the engine
thread's blocks come from the same heap the main thread freed them to). The step loop's
working set is reused from the heap instead of faulted in every step; peak resident memory
is the same, it is simply not returned between steps. tcmalloc (gperftools)
keeps freed spans in its page heap but, at its default release rate 1, hands a free span
back to the kernel once about 2 GiB were freed (a 64-row step's logits alone are 32 MiB),
to be page-faulted in again at its next use: served, 1.4-4.7 minor faults per output token
against 0.24 under glibc kept (docs/benchmarks.md "tcmalloc served, per thread"). Under
tcmalloc `keep_freed_memory` sets the release rate to 0 (what TCMALLOC_RELEASE_RATE=0 sets
at start); the runtime record reads it back (`malloc_release_rate`).

A server whose engine runs no torch kernels (the paced executor) does not import torch
(about 2 CPU seconds per process): its thread count is kept and set on torch if the
engine's build loads it after all (a host tier's copies).
"""

from __future__ import annotations

import ctypes
import os
import sys

_threads: int | None = None  # the count apply_threads settled on, None before it ran
_auto: dict | None = None  # what `--threads auto` measured and chose (per-phase counts)
# mallopt parameters (malloc.h): value set by keep_freed_memory.
_KEEP = (("M_ARENA_MAX", -8, 1), ("M_MMAP_MAX", -4, 0), ("M_TRIM_THRESHOLD", -1, 2**31 - 1),
         ("M_TOP_PAD", -2, 64 << 20))
_kept: bool = False  # keep_freed_memory has set glibc's mallopt (tcmalloc's rate) here
# gperftools' release-rate flag (a double; TCMALLOC_RELEASE_RATE sets it at start, and the page
# heap reads it at every scavenge: 0 disables releasing free spans to the kernel).
TCMALLOC_RELEASE_RATE = ("_ZN62FLAG__namespace_do_not_use_directly_use_DECLARE_double_instead"
                         "27FLAGS_tcmalloc_release_rateE")
_split: dict | None = None  # the split's workers and thresholds (apply_split), None before


def default_threads(cores: int | None = None) -> int:
    """Intra-op threads of a server whose engine runs no torch kernels (`--threads auto`
    without a measurement): all cores but one."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores - 1)


def pinned_threads() -> int | None:
    """The intra-op count OMP_NUM_THREADS pins (a whole number >= 1), else None. `auto`
    honours it as torch does: a measured choice can differ from one start to the next (machine
    load), and a different count can round a product differently, so a process whose outputs
    are compared bit for bit with another's (the test suite, exactness studies) pins it."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None


def apply_threads(threads: int | str, *, load_torch: bool = True) -> int:
    """Set torch's intra-op threads; returns the count in effect. `auto` (or 0) with
    `load_torch`: per-phase counts decided from a short measurement (serving_core/executor/
    threads.py), the decode count set now and the prefill count entered before each prefill;
    without `load_torch`, `default_threads()`, set only if torch is already imported (else
    kept, for `threads_in_effect` and a later call)."""
    global _threads, _auto
    if threads == "auto":
        threads = 0
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads={threads!r}: allowed values are 0 (auto) or a whole "
                         "number >= 1")
    _auto = None  # what an earlier call measured no longer holds
    pinned = pinned_threads()
    if threads == 0 and pinned is not None:
        threads = pinned  # the environment pins the count: no measurement
    if threads == 0 and load_torch:
        from serving_core.executor import threads as phase_threads

        tried = phase_threads.candidates(os.cpu_count() or 1)
        if len(tried) > 1:  # on 1-2 cores one count is tried: nothing to measure
            measured = phase_threads.measure()
            counts = phase_threads.choose(measured["timings"], measured["switch_s"])
            phase_threads.install(counts)
            _auto = {"per_phase": counts, "switch_us": round(1e6 * measured["switch_s"], 2),
                     "timings_ms": {p: {str(n): round(1e3 * t, 3) for n, t in ts.items()}
                                    for p, ts in measured["timings"].items()}}
            _threads = counts["decode"]
            return threads_in_effect()
        threads = tried[0]
    _threads = threads or default_threads()
    if not load_torch and "torch" not in sys.modules:
        return _threads
    import torch

    torch.set_num_threads(_threads)
    return torch.get_num_threads()


SPLIT_WORKERS = ("0", "1", "auto")  # `--split-workers` values


def split_workers(requested: int | str, cores: int | None = None) -> int:
    """Worker threads `--split-workers` gives (serving_core/model/split.py): auto is 1 when
    every phase runs one intra-op thread on two or more cores (the second core is otherwise
    idle while the engine thread computes), else 0 (one core: nothing to split onto; several
    intra-op threads: those cores are taken already). ValueError names the allowed values."""
    if str(requested) not in SPLIT_WORKERS:
        raise ValueError(f"split_workers={requested!r}: allowed values are "
                         f"{', '.join(SPLIT_WORKERS)}")
    if str(requested) != "auto":
        return int(requested)
    most = max(_auto["per_phase"].values()) if _auto else threads_in_effect()
    return int((cores or os.cpu_count() or 1) >= 2 and most == 1)


def apply_split(requested: int | str, *, load_torch: bool = True) -> int:
    """Install the split's worker (after apply_threads); returns the workers in effect.
    Without `load_torch` (an engine with no torch kernels) nothing is split."""
    global _split
    workers = split_workers(requested)  # a bad value fails with or without torch kernels
    if not load_torch:
        _split = {"workers": 0, "requested": str(requested)}
        return 0
    from serving_core.model import split

    split.install(workers)
    _split = dict(split.settings(), requested=str(requested))
    return workers


WARM_UP = ("auto", "off")  # `--warm-up` values (serving_core/model/warmup.py)
PACKED_LINEAR = ("auto", "off")  # `--packed-linear` values (serving_core/model/packed_linear.py)


def apply_packed_linear(mode: str, *, load_torch: bool = True) -> str:
    """Pack the linear weights of models built from now on (`auto`, where they give the plain
    bits) or none (`off`); ValueError names the allowed values. Returns the mode."""
    if mode not in PACKED_LINEAR:
        raise ValueError(f"packed_linear={mode!r}: allowed values are {', '.join(PACKED_LINEAR)}")
    if load_torch:
        from serving_core.model import packed_linear

        packed_linear.install(mode)
    return mode


def close_split() -> None:
    """End the split's worker thread, if this process started one (at shutdown)."""
    if "serving_core.model.split" in sys.modules:
        from serving_core.model import split

        split.close()


def threads_in_effect() -> int:
    """torch's intra-op threads, read back; in a process that never imported torch, the
    count `apply_threads` kept (torch's own default if it never ran)."""
    if "torch" in sys.modules or _threads is None:
        import torch

        return torch.get_num_threads()
    return _threads


def allocator_in_use() -> str:
    """`tcmalloc` when a libtcmalloc is mapped into this process, else `glibc`."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            return "tcmalloc" if "libtcmalloc" in fh.read() else "glibc"
    except OSError:  # no /proc (not Linux): the launcher preloads nothing there
        return "glibc"


def keep_freed_memory() -> bool:
    """Freed memory stays with the process (module docstring): glibc's mallopt, or tcmalloc's
    release rate 0; returns whether it is in effect (False under another allocator, or where
    the library has no such setting)."""
    global _kept
    if _kept:
        return _kept
    if allocator_in_use() == "tcmalloc":
        rate = _tcmalloc_release_rate()
        if rate is not None:
            rate.value = 0.0
        _kept = rate is not None and rate.value == 0.0
        return _kept
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = all(mallopt(code, value) == 1 for _, code, value in _KEEP)
    return _kept


def _tcmalloc_release_rate() -> ctypes.c_double | None:
    """The preloaded gperftools tcmalloc's release-rate flag, or None (no such symbol: another
    tcmalloc build, or none loaded)."""
    try:
        return ctypes.c_double.in_dll(ctypes.CDLL(None), TCMALLOC_RELEASE_RATE)
    except (OSError, ValueError):
        return None


def runtime_settings() -> dict:
    """What this process runs with, read back (not the request)."""
    rate = _tcmalloc_release_rate() if allocator_in_use() == "tcmalloc" else None
    return {"threads": threads_in_effect(), "allocator": allocator_in_use(),
            "cpus": os.cpu_count(), "malloc_keeps_freed": _kept,
            **({"malloc_release_rate": rate.value} if rate is not None else {}),
            **({"threads_auto": _auto} if _auto is not None else {}),
            **({"split": _split} if _split is not None else {}),
            **_model_settings()}


def warm_engine(engine, mode: str) -> dict:
    """The torch engine's warm-up (serving_core/model/warmup.py): one prefill of its
    max_num_batched_tokens and one decode of its max_num_seqs before it serves; returns
    what it ran (the runtime record's `warmup`; {} for an engine without a torch model)."""
    if mode not in WARM_UP:
        raise ValueError(f"warm_up={mode!r}: allowed values are {', '.join(WARM_UP)}")
    model = getattr(engine.executor, "model", None)
    if model is None:
        return {}
    from serving_core.model import warmup

    return warmup.warm_up(model, engine.sched.max_num_batched_tokens, engine.sched.cap, mode)


# Record key -> the torch-side module whose settings() states, read back in this process,
# what the model and arena loaded here run with: packed linear weights, the paged decode's
# per-page loops (compiled or Python), the state arena's bytes in huge pages. A module not
# imported here (no model loaded) adds nothing; this module never imports torch itself.
_READ_BACK = (("packed_linear", "serving_core.model.packed_linear"),
              ("paged_loops", "serving_core.model.paged_loops"),
              ("arena_huge_pages", "serving_core.executor.huge_pages"))


def _model_settings() -> dict:
    """{key: module.settings()} for each `_READ_BACK` module imported in this process."""
    return {key: sys.modules[name].settings() for key, name in _READ_BACK
            if name in sys.modules}
