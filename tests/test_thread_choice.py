"""`--threads auto`: the per-phase decision from injected timings, the measurement's shape,
and the executor's per-phase switch."""

import pytest
import torch

from serving_core.executor import threads
from serving_core.server import process_settings


def _scaling(counts, speedup):
    """Seconds per count of a product taking 1 s on one thread, sped up by speedup(n)."""
    return {n: 1.0 / speedup(n) for n in counts}


def test_candidates_cover_one_powers_of_two_and_all_but_one_core():
    assert threads.candidates(1) == [1]
    assert threads.candidates(2) == [1]
    assert threads.candidates(3) == [1, 2]
    assert threads.candidates(8) == [1, 2, 4, 7]
    assert threads.candidates(64) == [1, 2, 4, 8, 16, 32, 63]


def test_two_cores_take_the_second_thread_only_where_it_pays():
    t = {"prefill": {1: 10.0, 2: 7.0}, "decode": {1: 2.0, 2: 1.8}}  # 1.43x and 1.11x
    assert threads.choose(t, switch_s=1e-6) == {"prefill": 2, "decode": 1}
    slow = {"prefill": {1: 10.0, 2: 8.5}, "decode": {1: 2.0, 2: 2.4}}  # a loaded machine
    assert threads.choose(slow, switch_s=1e-6) == {"prefill": 1, "decode": 1}


def test_a_costly_switch_gives_both_phases_the_count_with_least_total_time():
    t = {"prefill": {1: 10.0, 2: 7.0}, "decode": {1: 2.0, 2: 1.8}}
    assert threads.choose(t, switch_s=0.5) == {"prefill": 2, "decode": 2}
    t = {"prefill": {1: 10.0, 2: 7.9}, "decode": {1: 2.0, 2: 6.0}}
    assert threads.choose(t, switch_s=0.5) == {"prefill": 1, "decode": 1}


def test_eight_cores_with_ideal_scaling_leave_one_core():
    t = {p: _scaling(threads.candidates(8), lambda n: n) for p in threads.PHASES}
    assert threads.choose(t, switch_s=0.0) == {"prefill": 7, "decode": 7}


def test_sixty_four_cores_stop_where_the_product_stops_scaling():
    t = {"prefill": _scaling(threads.candidates(64), lambda n: min(n, 18)),
         "decode": _scaling(threads.candidates(64), lambda n: min(n, 2.2))}
    assert threads.choose(t, switch_s=0.0) == {"prefill": 16, "decode": 2}


def test_measure_times_every_count_and_restores_the_thread_count(monkeypatch):
    monkeypatch.setattr(threads, "SHAPES", {"prefill": (32, 32, 64), "decode": (8, 32, 128)})
    before = torch.get_num_threads()
    m = threads.measure(cores=3, repeats=1)
    assert torch.get_num_threads() == before
    assert set(m["timings"]) == set(threads.PHASES)
    assert all(set(t) == {1, 2} and min(t.values()) > 0 for t in m["timings"].values())
    assert m["switch_s"] >= 0


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    threads.install(None)
    torch.set_num_threads(before)


def test_installed_counts_are_entered_per_phase(restore_threads):
    threads.install({"prefill": 2, "decode": 1})
    assert torch.get_num_threads() == 1
    threads.enter("prefill")
    assert torch.get_num_threads() == 2
    threads.enter("decode")
    assert torch.get_num_threads() == 1
    threads.install({"prefill": 1, "decode": 1})  # one count: nothing to switch
    torch.set_num_threads(2)
    threads.enter("decode")
    assert torch.get_num_threads() == 2


def test_auto_records_its_measurement_in_the_runtime_settings(restore_threads, monkeypatch):
    fake = {"timings": {"prefill": {1: 0.010, 2: 0.006}, "decode": {1: 0.002, 2: 0.0019}},
            "switch_s": 1e-6}
    monkeypatch.setattr(threads, "measure", lambda: fake)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the suite pins it: unpinned here
    monkeypatch.setattr(process_settings.os, "cpu_count", lambda: 3)  # 1 and 2 to try
    assert process_settings.apply_threads("auto") == 1
    auto = process_settings.runtime_settings()["threads_auto"]
    assert auto["per_phase"] == {"prefill": 2, "decode": 1}
    assert auto["timings_ms"]["prefill"] == {"1": 10.0, "2": 6.0}
    monkeypatch.setattr(process_settings, "_auto", None)


def test_auto_honours_a_pinned_omp_num_threads(restore_threads, monkeypatch):
    """`auto` measures nothing where OMP_NUM_THREADS pins the count (the suite pins 1)."""
    from serving_core.server import process_settings as ps

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert ps.pinned_threads() == 1
    monkeypatch.setattr("serving_core.executor.threads.measure",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert ps.apply_threads(0) == 1
    for text in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", text)
        assert ps.pinned_threads() is None


def test_auto_on_two_cores_measures_nothing(restore_threads, monkeypatch):
    """One count to try (cores - 1 = 1): auto takes it without a measurement."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(process_settings.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "measure",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured")))
    assert process_settings.apply_threads("auto") == 1
    assert "threads_auto" not in process_settings.runtime_settings()
