"""Products split over the worker thread give the unsplit products' bits (model/split.py);
the worker ends when closed; `--split-workers` is a checked setting."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from serving_core.model import mamba, split
from serving_core.model.dense_state import DenseState
from serving_core.model.falcon_h1 import causal_attention
from serving_core.server import process_settings


@pytest.fixture
def worker():
    split.install(1)
    yield
    split.close()


def _split_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hsl-split"]


# (rows, inner, outputs): the tiny Falcon-H1's in_proj, MLP, out_proj, attention, and odd sizes
LINEAR = [(m, k, n) for m in (1, 3, 4, 17, 64, 300, 1000, 2048)
          for k, n in ((128, 2572), (128, 256), (256, 128), (768, 128), (100, 333))]


def test_a_split_linear_equals_the_unsplit_product(worker):
    gen = torch.Generator().manual_seed(0)
    split_any = False
    for m, k, n in LINEAR:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        split_any |= m * n * k >= split.LINEAR_MIN_MACS and m >= split.LINEAR_MIN_ROWS
        assert torch.equal(split.linear(x, w), F.linear(x, w)), (m, k, n)
    x3 = torch.randn(2, 700, 128, generator=gen)[:, ::2]  # 3-D, strided rows
    w = torch.randn(2572, 128, generator=gen)
    assert torch.equal(split.linear(x3, w), F.linear(x3, w))
    assert split_any


@pytest.mark.parametrize(("b", "t", "h", "p", "g", "n", "chunk"), [
    (1, 300, 12, 64, 1, 512, 128),  # the tiny model's mixer, a ragged last chunk
    (2, 130, 8, 16, 2, 32, 64),
    (3, 96, 8, 8, 4, 16, 32),
])
def test_a_scan_split_by_heads_equals_the_whole_scan(worker, b, t, h, p, g, n, chunk):
    gen = torch.Generator().manual_seed(t)
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.rand(b, t, h, generator=gen)
    A, D = -4 * torch.rand(h, generator=gen), torch.randn(h, generator=gen)
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    init = torch.randn(b, h, p, n, generator=gen)
    whole = mamba.chunk_scan(x, dt, A, B, C, D, chunk, init)
    got = split.scan_heads(mamba.chunk_scan, x, dt, A, B, C, D, chunk, init)
    assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])


@pytest.mark.parametrize(("b", "h", "kvh", "t", "c", "padded"), [
    (1, 4, 2, 512, 0, False),  # the tiny model's first chunk
    (2, 4, 2, 300, 700, True),  # later chunks over context, padded context
    (1, 8, 8, 100, 0, False),  # no GQA
    (1, 4, 2, 600, 0, False),  # two query blocks
])
def test_attention_split_by_heads_equals_the_whole(worker, b, h, kvh, t, c, padded):
    gen = torch.Generator().manual_seed(t + c)
    q = torch.randn(b, t, h, 32, generator=gen).transpose(1, 2)
    k, v = (torch.randn(b, c + t, kvh, 32, generator=gen).transpose(1, 2) for _ in "kv")
    valid = torch.rand(b, c, generator=gen) > 0.2 if padded else None
    args = (c, valid, 32 ** -0.5, h != kvh)
    whole = causal_attention(q, k, v, *args)
    assert torch.equal(split.attention_heads(causal_attention, q, k, v, *args), whole)


def test_a_model_forward_is_bit_identical_with_the_worker(tiny_model):
    """Two sequences: a prefill chunk (every split taken), a chunk over that context, then
    decode; logits and state, with and without."""
    ids = torch.randint(0, 1000, (2, 400), generator=torch.Generator().manual_seed(3))
    runs = []
    for workers in (0, 1):
        split.install(workers)
        try:
            state = DenseState(tiny_model, batch=2)
            logits = [state.run(tiny_model, ids[:, :300]), state.run(tiny_model, ids[:, 300:]),
                      state.run(tiny_model, ids[:, :1])]
        finally:
            split.close()
        runs.append((logits, state.ssm, state.k))
    for a, b in zip(*(sum(r, []) for r in runs), strict=True):
        assert torch.equal(a, b)


def test_the_worker_ends_when_closed_and_raises_on_the_caller():
    split.install(1)
    assert len(_split_threads()) == 1 and split.settings()["workers"] == 1
    split.install(1)  # once
    assert len(_split_threads()) == 1
    with pytest.raises(ZeroDivisionError):
        split.pair(lambda: 1, lambda: 1 / 0)
    assert split.pair(lambda: 1, lambda: torch.is_inference_mode_enabled()) == (1, False)
    with torch.inference_mode():  # the caller's mode travels with the work
        assert split.pair(lambda: 1, lambda: torch.is_inference_mode_enabled()) == (1, True)
    split.close()
    assert not _split_threads() and split.settings()["workers"] == 0
    assert split.pair(lambda: 1, lambda: 2) == (1, 2)  # no worker: in order, here


def test_split_workers_auto_and_bad_values(monkeypatch):
    monkeypatch.setattr(process_settings, "_auto", None)
    monkeypatch.setattr(process_settings, "threads_in_effect", lambda: 1)
    assert [process_settings.split_workers("auto", c) for c in (1, 2, 8)] == [0, 1, 1]
    monkeypatch.setattr(process_settings, "threads_in_effect", lambda: 2)
    assert process_settings.split_workers("auto", 8) == 0  # intra-op threads use the cores
    assert process_settings.split_workers("1", 1) == 1  # asked for: given
    with pytest.raises(ValueError, match=r"split_workers='2': allowed values are 0, 1, auto"):
        process_settings.split_workers("2")
    with pytest.raises(ValueError, match="allowed values are 0, 1"):
        split.install(2)


def test_the_server_refuses_a_bad_split_workers_value(capsys):
    from serving_core.server.__main__ import main

    assert main(["--spec", "none.json", "--split-workers", "two"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --split-workers='two': allowed values are 0, 1, auto"


def test_the_runtime_record_states_the_split_read_back(monkeypatch):
    monkeypatch.setattr(process_settings, "_auto", None)
    monkeypatch.setattr(process_settings, "threads_in_effect", lambda: 1)
    monkeypatch.setattr(process_settings.os, "cpu_count", lambda: 2)
    try:
        assert process_settings.apply_split("auto") == 1
        stated = process_settings.runtime_settings()["split"]
        assert stated == dict(split.settings(), requested="auto") and stated["workers"] == 1
        assert len(_split_threads()) == 1
    finally:
        process_settings.close_split()
        monkeypatch.setattr(process_settings, "_split", None)
    assert not _split_threads()
    assert process_settings.apply_split("1", load_torch=False) == 0  # no torch kernels
    assert process_settings.runtime_settings()["split"] == {"workers": 0, "requested": "1"}
    monkeypatch.setattr(process_settings, "_split", None)


@pytest.mark.parametrize("side", ["attention", "mixer"])
def test_a_layer_pair_runs_one_side_on_the_worker_and_raises_after_both(worker, monkeypatch,
                                                                         side):
    """Decode-sized forwards pair (PAIR_WORKER_SIDE on the worker); longer ones run both
    sides here. Inside a pair the products' splits run on their own thread (no hand-off to
    the busy worker); an exception on either side is raised once both sides have ended, and
    the worker stays installed."""
    monkeypatch.setattr(split, "PAIR_WORKER_SIDE", side)

    def name():
        return threading.current_thread().name

    here = threading.current_thread().name
    paired = (here, "hsl-split") if side == "attention" else ("hsl-split", here)
    assert split.layer_pair(name, name, 64, 1) == paired
    assert split.layer_pair(name, name, 64, split.PAIR_MAX_TOKENS + 1) == (here, here)
    assert split.layer_pair(name, name, split.PAIR_MIN_ROWS - 1, 1) == (here, here)
    nested = split.layer_pair(lambda: split.pair(name, name), lambda: split.pair(name, name),
                              64, 1)
    assert nested == tuple((t, t) for t in paired)
    ended = threading.Event()

    def slow_attention():
        ended.wait(0.05)  # still running when the mixer raises
        ended.set()

    with pytest.raises(ZeroDivisionError):
        split.layer_pair(lambda: 1 / 0, slow_attention, 64, 1)
    assert ended.is_set()
    with pytest.raises(KeyError):
        split.layer_pair(lambda: 1, lambda: {}["k"], 64, 1)
    assert split.settings()["workers"] == 1 and split.pair(name, name) == (here, "hsl-split")


@pytest.mark.parametrize("org", ["S0", "S1", "S2", *(pytest.param(o, marks=pytest.mark.slow)
                                                     for o in ("N0", "D0"))])
def test_paired_layers_give_the_unpaired_bits_over_each_arena(tiny_model, monkeypatch, org):
    """The executor over each organization's arena (S0, S1, S2: the three conv addressings;
    N0 and D0 slow), three requests (prefill chunks, mixed steps, decode batches): every
    forward's final hidden states and LM-head logits equal those without the worker (main's
    order, one after the other), with pairs in every forward (the default's decode pairs
    among them; the prefill splits have their own tests above)."""
    import engines
    import numpy as np

    rng = np.random.default_rng(7)
    specs = [engines.Spec(i, 0.0, rng.integers(3, 1000, n).astype(np.int32), 3)
             for i, n in enumerate((40, 17, 70))]
    seen = _record_outputs(tiny_model, monkeypatch)
    runs = []
    monkeypatch.setattr(split, "PAIR_MIN_ROWS", 1)
    for workers, pair_max, side in ((0, 1, "attention"), (1, 1 << 20, "attention"),
                                    (1, 1 << 20, "mixer")):
        monkeypatch.setattr(split, "PAIR_MAX_TOKENS", pair_max)
        monkeypatch.setattr(split, "PAIR_WORKER_SIDE", side)
        seen.clear()
        split.install(workers)
        try:
            engines.serve_greedy(tiny_model, "falcon_h1_tiny", org, "b12", specs,
                                 max_tokens=32)
        finally:
            split.close()
        runs.append(list(seen))
    assert len(runs[0]) > 10
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def _record_outputs(model, monkeypatch) -> list[torch.Tensor]:
    """A list that collects every forward's and LM head's output of `model` from now on."""
    seen: list[torch.Tensor] = []
    cls = type(model)
    monkeypatch.setattr(model, "forward", lambda *a, **k: _kept(seen, cls.forward(model, *a, **k)))
    monkeypatch.setattr(model, "head", lambda h: _kept(seen, cls.head(model, h)))
    return seen


def _kept(seen: list, out):
    if out is not None:
        seen.append(out.clone())
    return out


def test_prefill_key_value_projections_run_on_the_worker_with_the_same_bits(tiny_model,
                                                                             monkeypatch):
    """A prefill of PROJ_MIN_TOKENS tokens computes each layer's key and value projections on
    the worker beside the query's (split.tasks); the logits and KV equal those without the
    worker (the old order, one after the other), and a shorter prefill does not pair."""
    ids = torch.randint(0, 1000, (1, split.PROJ_MIN_TOKENS), generator=torch.Generator()
                        .manual_seed(4))
    runs, threads = [], []
    tasks = split.tasks

    def spy(here, there):
        return tasks(here, lambda: (threads.append(threading.current_thread().name), there())[1])

    monkeypatch.setattr(split, "tasks", spy)
    for workers in (0, 1):
        split.install(workers)
        try:
            state = DenseState(tiny_model, batch=1)
            runs.append([state.run(tiny_model, ids), *state.k])
            state.run(tiny_model, ids[:, : split.PROJ_MIN_TOKENS - 1])
        finally:
            split.close()
    assert threads == ["hsl-split"] * tiny_model.num_layers
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_shared_items_run_each_chunk_once_and_the_caller_helps(worker, monkeypatch):
    """Inside a task pair the worker's `share.items` are taken in CHUNK-item chunks from the
    front by the worker and from the back by the calling thread once its side has returned;
    every item runs exactly once. An error in a helped chunk is raised after both ended;
    outside a pair (or on the calling thread) the items run here in one call."""
    import time

    from serving_core.model import share

    monkeypatch.setattr(share, "CHUNK", 4)
    here = threading.current_thread().name
    ran: list[tuple[int, int, str]] = []

    def run(first, end):
        ran.append((first, end, threading.current_thread().name))
        if threading.current_thread().name == "hsl-split":
            time.sleep(0.01)  # the worker slow: the caller takes chunks from the back

    split.tasks(lambda: None, lambda: share.items(42, run))
    items = sorted(i for a, b, _ in ran for i in range(a, b))
    assert items == list(range(42)) and all(b - a <= 4 for a, b, _ in ran)
    assert {t for *_, t in ran} == {here, "hsl-split"}
    assert max(b for a, b, t in ran if t == "hsl-split") <= min(a for a, b, t in ran if t == here)
    ran.clear()
    share.items(42, run)  # not in a pair: one call here
    assert ran == [(0, 42, here)]

    def failing(first, end):
        if threading.current_thread().name != "hsl-split":
            raise KeyError(first)
        time.sleep(0.01)

    with pytest.raises(KeyError):
        split.tasks(lambda: None, lambda: share.items(42, failing))
    assert split.pair(lambda: 1, lambda: 2) == (1, 2)  # the worker still serves


@pytest.mark.parametrize("org", ["S2", pytest.param("S1", marks=pytest.mark.slow)])
def test_a_shared_decode_state_update_gives_the_unshared_bits(tiny_model, monkeypatch, org):
    """Decode pairs over the S2 (S1 slow) arena with the worker's state-update chunks
    slowed so that the calling thread takes some: every forward's hidden states and logits
    equal those without the worker."""
    import time

    import engines
    import numpy as np

    from serving_core.model import share

    monkeypatch.setattr(share, "CHUNK", 2)
    items, helped = share.items, []

    def slowed(n, run):
        def chunk(first, end):
            if threading.current_thread().name == "hsl-split":
                time.sleep(0.002)
            else:
                helped.append(end - first)
            run(first, end)
        items(n, chunk)

    monkeypatch.setattr(share, "items", slowed)
    rng = np.random.default_rng(5)
    specs = [engines.Spec(i, 0.0, rng.integers(3, 1000, n).astype(np.int32), 4)
             for i, n in enumerate((40, 17, 70, 9, 33, 21))]
    seen = _record_outputs(tiny_model, monkeypatch)
    runs = []
    for workers in (0, 1):
        seen.clear()
        split.install(workers)
        try:
            engines.serve_greedy(tiny_model, "falcon_h1_tiny", org, "b12", specs,
                                 max_tokens=64, cap=6)
        finally:
            split.close()
        runs.append(list(seen))
    assert len(runs[0]) == len(runs[1]) > 10
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    assert sum(helped) > 0
