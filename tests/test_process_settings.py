"""Server process settings: the allocator the launcher preloads, intra-op threads, and the
settings the server reads back from its own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.runners import server_process as sp
from serving_core.server import __main__ as server_main
from serving_core.server.process_settings import apply_threads, default_threads

FAKE = "/opt/fake/libtcmalloc_minimal.so.4"


def test_auto_preloads_tcmalloc_when_installed_and_keeps_other_preloads(monkeypatch):
    monkeypatch.setattr(sp, "find_tcmalloc", lambda: FAKE)
    env, used = sp.allocator_env("auto", {"LD_PRELOAD": "/x/libfoo.so", "A": "1"})
    assert used == "tcmalloc" and env["LD_PRELOAD"] == f"{FAKE} /x/libfoo.so" and env["A"] == "1"


def test_glibc_drops_an_inherited_tcmalloc_preload(monkeypatch):
    monkeypatch.setattr(sp, "find_tcmalloc", lambda: FAKE)
    env, used = sp.allocator_env("glibc", {"LD_PRELOAD": f"{FAKE} /x/libfoo.so"})
    assert used == "glibc" and env["LD_PRELOAD"] == "/x/libfoo.so"
    env, used = sp.allocator_env("glibc", {"LD_PRELOAD": FAKE})
    assert used == "glibc" and "LD_PRELOAD" not in env


def test_without_tcmalloc_auto_is_glibc_and_tcmalloc_is_refused(monkeypatch):
    monkeypatch.setattr(sp, "find_tcmalloc", lambda: None)
    env, used = sp.allocator_env("auto", {})
    assert used == "glibc" and "LD_PRELOAD" not in env
    with pytest.raises(ValueError, match="allocator=tcmalloc: no libtcmalloc"):
        sp.allocator_env("tcmalloc", {})
    with pytest.raises(ValueError, match="allocator='jemalloc': allowed values are auto, "):
        sp.allocator_env("jemalloc", {})


def test_server_process_records_the_allocator_it_set(monkeypatch):
    monkeypatch.setattr(sp, "find_tcmalloc", lambda: FAKE)
    srv = sp.ServerProcess(["true"], env={}, allocator="auto")
    assert srv.allocator == "tcmalloc" and srv.env["LD_PRELOAD"] == FAKE
    assert sp.ServerProcess(["true"], env={}, allocator="glibc").allocator == "glibc"


def test_default_threads_fit_the_machine():
    assert [default_threads(c) for c in (1, 2, 3, 8)] == [1, 1, 2, 7]


def test_threads_are_applied_and_bad_values_refused():
    import torch

    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 == torch.get_num_threads()
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="allowed values are 0 \\(auto\\)"):
                apply_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_server_refuses_negative_threads_with_one_line(capsys):
    assert server_main.main(["--spec", "none.json", "--threads", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --threads=-1: allowed values are 0 (auto) or a whole number >= 1"]


@pytest.mark.slow
@pytest.mark.skipif(sp.find_tcmalloc() is None, reason="no libtcmalloc installed")
def test_a_preloaded_process_reads_back_tcmalloc():
    code = ("from serving_core.server.process_settings import runtime_settings as r; "
            "print(r()['allocator'])")
    for allocator in ("tcmalloc", "glibc"):
        env, _ = sp.allocator_env(allocator)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == allocator


def test_a_server_without_torch_kernels_keeps_its_threads_without_importing_torch():
    """The paced executor runs no torch kernels: its server never imports torch (about 2 CPU
    s per process), and still states the thread count torch would be given."""
    code = ("import sys; from serving_core.server import process_settings as ps; "
            "n = ps.apply_threads(3, load_torch=False); r = ps.runtime_settings(); "
            "print(n, r['threads'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["3", "3", "False"]


_REFAULT = """
import ctypes, resource, sys
from serving_core.server.process_settings import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def touched():
    block = libc.malloc(40 << 20); ctypes.memset(block, 1, 40 << 20); libc.free(block)
touched()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touched()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_glibc_keeps_a_freed_large_block_only_when_asked(mode):
    """A 40 MiB block (above glibc's largest mmap threshold) freed and taken again: glibc's
    defaults map it anew (10,240 pages faulted in again); kept, the heap serves it."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", _REFAULT, mode], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    kept, faults = out[0] == "True", int(out[1])
    assert kept == (mode == "keep")
    assert faults < 1000 if kept else faults > 10_000


_TCMALLOC_REFAULT = """
import ctypes, resource, sys
from serving_core.server import process_settings as ps
kept = ps.keep_freed_memory() if sys.argv[1] == "keep" else False
ps.apply_threads(1, load_torch=False)  # runtime_settings without importing torch
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 40 << 20
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
for _ in range(60):  # 2.4 GiB freed: past the page heap's first scavenge
    libc.free(libc.malloc(size))
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
      ps.runtime_settings()["malloc_release_rate"])
"""


@pytest.mark.skipif(sp.find_tcmalloc() is None, reason="no libtcmalloc installed")
@pytest.mark.parametrize("mode", ["keep", "default"])
def test_tcmalloc_keeps_a_freed_large_span_only_when_asked(mode):
    """tcmalloc's page heap, at its default release rate, hands a free 40 MiB span back to the
    kernel once about 2 GiB were freed, and the next use faults its 10,240 pages in again;
    kept (release rate 0, read back), it stays."""
    env, _ = sp.allocator_env("tcmalloc")
    out = subprocess.run([sys.executable, "-c", _TCMALLOC_REFAULT, mode], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    kept, faults, rate = out[0] == "True", int(out[1]), float(out[2])
    assert kept == (mode == "keep") and rate == (0.0 if kept else 1.0)
    assert faults < 1000 if kept else faults > 10_000


def test_proc_usage_reads_a_process_tree_and_its_faults():
    from bench.proc_usage import tree_usage, usage_delta

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        import os

        before = tree_usage(os.getpid())
        assert os.getpid() in before and child.pid in before
        # a fresh anonymous mapping (not the heap, which an earlier test may have kept),
        # 4,096 pages each faulted in by its first write
        import mmap

        block = mmap.mmap(-1, 16 << 20)
        for offset in range(0, 16 << 20, 4096):
            block[offset] = 1
        delta = usage_delta(before, tree_usage(os.getpid()))
        assert delta["minor_faults"] >= 4000 and delta["cpu_s"] >= 0
        assert usage_delta(before, {}) == {}
        block.close()
    finally:
        child.stdin.close()
        child.wait()


def test_proc_usage_reads_each_thread_of_a_process():
    """A thread that ran 0.1 CPU s between two readings shows it (and run-queue time on top
    of its run time adds up to no more than the wall time); the idle main thread does not."""
    import os
    import threading
    import time

    from bench.proc_usage import thread_delta, thread_usage

    ran, done = threading.Event(), threading.Event()

    def spin():
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.1:
            pass
        ran.set()
        done.wait()

    before = thread_usage(os.getpid())
    wall = time.perf_counter()
    worker = threading.Thread(target=spin)
    worker.start()
    ran.wait()
    rows = thread_delta(before, thread_usage(os.getpid()))
    wall = time.perf_counter() - wall
    done.set()
    worker.join()
    mine = next(r for r in rows if r["tid"] == worker.native_id)
    assert mine["pid"] == os.getpid() and mine["cpu_s"] >= 0.05 and mine["run_s"] >= 0.09
    assert mine["run_s"] + mine["wait_s"] <= wall + 0.01
    assert rows[0]["cpu_s"] >= rows[-1]["cpu_s"]
    main = next(r for r in rows if r["tid"] == threading.main_thread().native_id)
    assert main["run_s"] < mine["run_s"]
