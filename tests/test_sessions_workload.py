"""workload.source=sessions: turns that resend the whole history, their dependency on the
previous turn's finish, the structural bound, determinism and the refusals
(experiments/workloads/sessions.py, serving_core.engine.serve)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from experiments.workloads import sessions
from experiments.workloads.workload import build_workload, normalize_workload_config

REPO = Path(__file__).resolve().parent.parent
CONF = str(REPO / "conf")
STATED = {"source": "sessions", "num_requests": 40, "session_lengths": "stated",
          "session_system_tokens": 64, "session_mean_turns": 3.0, "session_user_tokens": 30,
          "session_output_tokens": 20, "session_think_s": 2.0}


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def test_turns_resend_the_history_and_the_bound_is_the_longest_earlier_prefix():
    w = build_workload(STATED, {"rate": 1.0}, 3)
    reqs, bound = w.requests, w.reusable_prefix
    system = reqs[0].prompt[:64]
    assert w.meta["sessions"]["count"] < len(reqs) == 40  # some session has several turns
    for i, r in enumerate(reqs):
        assert np.array_equal(r.prompt[:64], system)  # every session opens with the system
        if r.after >= 0:  # a later turn: previous prompt, its reply (workload's), a message
            prev = reqs[r.after]
            assert r.after == i - 1 and r.think_s > 0
            assert np.array_equal(r.prompt[: len(prev.prompt)], prev.prompt)
            assert len(r.prompt) > len(prev.prompt) + prev.output_tokens
        else:
            assert r.think_s == 0.0 and len(r.prompt) > 64
        # by hand: the longest prefix shared with any earlier prompt, in tokens
        expected = max((_lcp(r.prompt, q.prompt) for q in reqs[:i]), default=0)
        assert bound[i] == expected
    assert bound[0] == 0 and sum(bound) == w.meta["reusable_prefix_tokens"]


def test_sessions_are_a_pure_function_of_seed_and_config():
    def digest(seed, **extra):
        w = build_workload({**STATED, **extra}, {"rate": 1.0}, seed)
        return [(r.arrival_s, r.after, r.think_s, r.output_tokens, r.prompt.tobytes())
                for r in w.requests]

    assert digest(3) == digest(3)
    assert digest(3) != digest(4)
    # session starts follow the load's arrivals: a faster rate moves starts, not lengths
    slow = build_workload(STATED, {"rate": 1.0}, 3).requests
    fast = build_workload(STATED, {"rate": 4.0}, 3).requests
    assert [len(r.prompt) for r in slow] == [len(r.prompt) for r in fast]
    assert [4 * r.arrival_s for r in fast] == pytest.approx([r.arrival_s for r in slow])


def test_sharegpt_lengths_are_a_conversations_exchanges_in_order(monkeypatch):
    pool = sessions.SharegptTurns(np.array([0, 3, 4]), np.array([5, 6, 7, 8]),
                                  np.array([50, 2000, 70, 90]))
    monkeypatch.setattr(sessions, "sharegpt_turns", lambda tokenizer, cache_dir: pool)
    cfg = normalize_workload_config({"source": "sessions", "num_requests": 30,
                                     "max_output_tokens": 1000})
    turns = sessions.draw_turns(cfg, 5, Path("."))
    rows = {0: [(5, 50), (6, 1000), (7, 70)], 1: [(8, 90)]}  # replies capped at 1,000
    seen = set()
    for s in {t.session for t in turns}:
        got = [(t.user_tokens, t.output_tokens) for t in turns if t.session == s]
        match = [k for k, v in rows.items() if v[: len(got)] == got]
        assert match, got
        seen.add(match[0])
    assert seen == {0, 1} and len(turns) == 30


def test_exchanges_pair_each_human_turn_with_the_model_turn_after_it():
    record = {"conversations": [{"from": "gpt", "value": "orphan"},
                                {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                {"from": "human", "value": "q2"}, {"from": "human", "value": "q3"},
                                {"from": "chatgpt", "value": "a3"},
                                {"from": "human", "value": "x"}]}
    assert sessions.exchanges(record) == [("q1", "a1"), ("q3", "a3")]
    assert sessions.exchanges({"conversations": None}) == []


def test_session_limits_cut_sessions():
    w = build_workload({**STATED, "session_max_turns": 2, "session_max_tokens": 300},
                       {"rate": 1.0}, 3)
    for r in w.requests:
        assert len(r.prompt) + r.output_tokens <= 300
        assert r.after < 0 or w.requests[r.after].after < 0  # at most two turns


def _run(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from experiments.runners.cell import run_cell

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config", overrides=[*overrides, "write_ledgers=false"])
    return run_cell(cfg)


@pytest.mark.parametrize("org", ["s2", "d0"])
def test_a_turn_arrives_think_time_after_the_previous_turn_finished(org):
    result = _run(["workload=agentic", "workload.num_requests=30", "load.rate=0.5",
                   f"org={org}", "budget=b63"])
    w = build_workload(result.workload_meta["workload"], result.workload_meta["load"], 42000)
    req = result.tables["requests"]
    row = {rid: k for k, rid in enumerate(req["request_id"])}
    assert result.summary["completed"] == 30
    bound = result.workload_columns["reusable_prefix_tokens"]
    for spec in w.requests:
        k = row[spec.request_id]
        assert req["adopted_prefix_tokens"][k] <= bound[spec.request_id]
        if spec.after >= 0:
            finish = req["finish_s"][row[spec.after]]
            assert req["arrival_s"][k] == pytest.approx(finish + spec.think_s, abs=1e-9)
    assert sum(req["adopted_prefix_tokens"]) > 0.5 * sum(bound.values())


def test_a_turn_that_cannot_fit_alone_is_refused_with_every_later_turn_of_its_session():
    result = _run(["workload=agentic", "workload.num_requests=40", "load.rate=0.5",
                   "org=s2", "budget=p16"])
    req = result.tables["requests"]
    w = build_workload(result.workload_meta["workload"], result.workload_meta["load"], 42000)
    status = dict(zip(req["request_id"], req["status"], strict=True))
    assert result.summary["refused"] == sum(s == "refused" for s in status.values()) > 0
    assert result.summary["completed"] == 40 - result.summary["refused"]
    for spec in w.requests:  # a history only grows: after a refused turn, all are refused
        if spec.after >= 0 and status[spec.after] == "refused":
            assert status[spec.request_id] == "refused"


@pytest.mark.parametrize("cfg,message", [
    ({"source": "sharegpt", "session_think_s": 1.0},
     "workload.session_think_s: allowed only with workload.source=sessions"),
    ({"source": "sessions", "session_lengths": "zipf"},
     "workload.session_lengths='zipf': allowed values are sharegpt, stated"),
    ({"source": "sessions", "session_system_tokens": 100, "session_max_tokens": 101},
     "workload.session_system_tokens=100: allowed <= session_max_tokens - 2 = 99"),
    ({"source": "sessions", "session_mean_turns": 0.5},
     "workload.session_mean_turns=0.5: allowed values are [1, inf)"),
    ({"source": "synthetic", "session_max_turns": 3},
     "workload.session_max_turns: allowed only with workload.source=sessions"),
])
def test_bad_session_fields_are_refused(cfg, message):
    with pytest.raises(ValueError) as err:
        normalize_workload_config(cfg)
    assert str(err.value) == message


def test_sessions_are_refused_on_a_path_without_turn_dependencies():
    from hydra import compose, initialize_config_dir

    from experiments.config.validation import validate_config

    with initialize_config_dir(version_base="1.3", config_dir=CONF):
        cfg = compose(config_name="config", overrides=[
            "workload=sessions", "executor=torch", "budget=b63", "write_ledgers=false"])
    with pytest.raises(ValueError, match=r"^workload.source=sessions: allowed only with "
                       r"executor=a100 .* the torch_http path has no turn dependencies$"):
        validate_config(cfg, check_root=False, preflight=False)
