"""Engine behaviour from first principles: completion, sharing, isolation, caps, ownership,
publication/loss accounting, preemption, determinism and fail-fast budgets."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from conftest import compose_config

from experiments.runners.cell import run_cell
from ledgers.arms import ARM_NAMES

# Synthetic prompts: a 1,200-token context (shared with probability q) + a 200-token question,
# so S-org checkpoints fall at 512 and 1,024 inside the shared context.
SYNTH = (
    "workload.source=synthetic",
    "workload.synthetic_prompt_tokens=1400",
    "workload.synthetic_context_tokens=1200",
    "workload.synthetic_output_tokens=48",
)
ORGS = ("s0", "s1", "s2", "d0", "s2_retention")  # the full-size ShareGPT cells


def synth_cfg(*overrides: str, n: int = 60):
    return compose_config(*SYNTH, f"workload.num_requests={n}", *overrides)


def check_ownership(sched, mem) -> None:
    """No object is held by two live requests unless it is shared through the cache,
    and every held object is valid and referenced at least once per holder."""
    holders = defaultdict(list)
    for req in sched.running:
        objs = list(req.attn) + list(req.dests) + list(req.retained)
        objs += [o for o in (req.working, req.adopted) if o]
        for obj in objs:
            holders[obj.oid].append((req.rid, obj))
    for req in sched.waiting:
        if req.pin:
            holders[req.pin.oid].append((req.rid, req.pin))
    for entries in holders.values():
        obj = entries[0][1]
        assert obj.valid, f"request {entries[0][0]} holds invalidated {obj}"
        assert obj.ref_count >= len(entries), f"{obj} held {len(entries)}x with ref {obj.ref_count}"
        if len({rid for rid, _ in entries}) > 1:
            assert obj.cached, f"unpublished {obj} shared by requests {entries}"
    for pool, (used, cached, free, total) in mem.usage().items():
        assert used + cached + free == total, pool
    assert len(sched.running) <= sched.cfg.cap


@pytest.mark.parametrize("org", ARM_NAMES)  # every arm of the table, new ones included
def test_every_org_completes_with_invariant_checks(org):
    res = run_cell(synth_cfg(f"org={org}", "budget=b63", "load.rate=4"), on_step=check_ownership)
    s = res.summary
    assert s["completed"] == 60 and s["failed"] == 0
    req = res.tables["requests"]
    assert all(
        o == t for o, t in zip(req["output_tokens"], req["target_output_tokens"], strict=True)
    )
    assert set(req["status"]) == {"finished"}


@pytest.mark.parametrize("org", ORGS)
@pytest.mark.parametrize("budget", ("b63", "b83", "b108"))
def test_default_sharegpt_cells_complete(org, budget):
    s = run_cell(compose_config(f"org={org}", f"budget={budget}")).summary
    assert (s["completed"], s["failed"]) == (300, 0)
    assert s["max_running"] <= 63


def test_memory_is_fully_released_at_the_end():
    """After every request finishes, no unit is referenced: everything is free or cached."""
    for org in ARM_NAMES:
        res = run_cell(synth_cfg(f"org={org}", "engine.pinning_k=1", "load.rate=6"))
        for pool, (used, _, _, _) in res.memory.usage().items():
            assert used == 0, (org, pool)


def test_low_load_delivers_offered_output_rate():
    """At lambda 0.8 the engine keeps up: every request finishes within seconds of arriving,
    so delivered tokens per second of request span equal the offered output rate."""
    for org in ("s0", "s1", "s2", "d0"):
        res = run_cell(
            compose_config(f"org={org}", "budget=b108", "load.rate=0.8", "engine.cap=109")
        )
        req = res.tables["requests"]
        arrivals = np.array(req["arrival_s"])
        offered = sum(req["target_output_tokens"]) / (arrivals.max() - arrivals.min())
        s = res.summary
        assert s["completed"] == 300
        assert s["throughput_span"] == pytest.approx(offered, rel=0.05), org
        assert s["e2e_p50"] < 30.0


def test_q0_has_no_cross_request_prefix_hits():
    for org in ("s2", "d0"):
        res = run_cell(synth_cfg(f"org={org}", "workload.q=0", "load.rate=4"))
        assert sum(res.tables["requests"]["adopted_prefix_tokens"]) == 0


def test_q1_shares_context_prefixes():
    res = run_cell(synth_cfg("org=s2", "budget=b108", "workload.q=1", "load.rate=1"))
    adopted = res.tables["requests"]["adopted_prefix_tokens"]
    # All requests share 8 contexts of 1,200 tokens: after the first user of each context,
    # the two full 512-token checkpoints (1,024 tokens) are found.
    assert sum(1 for a in adopted if a == 1024) >= 60 - 8 - 5


def test_isolate_never_adopts_another_requests_prefix_but_resume_reuses():
    # Long outputs grow KV in decode and force preemptions; D0's native checkpoints survive
    # long enough for some victims to resume from their own published prefix.
    res = run_cell(
        compose_config(
            *SYNTH[:3],
            "workload.synthetic_output_tokens=1000",
            "workload.num_requests=60",
            "org=d0",
            "budget=b30",
            "workload.reuse=isolate",
            "load.rate=2",
        )
    )
    req = res.tables["requests"]
    assert sum(req["adopted_prefix_tokens"]) == 0
    assert len(set(req["salt"])) == len(req["salt"])
    preempted = [i for i, p in enumerate(req["preemptions"]) if p > 0]
    assert preempted, "the scenario must preempt to exercise resume"
    assert sum(req["resume_adopted_tokens"][i] for i in preempted) > 0
    assert all(req["resume_adopted_tokens"][i] == 0 for i in range(60) if i not in preempted)


def test_running_never_exceeds_the_cap():
    res = run_cell(synth_cfg("org=s2", "budget=b108", "engine.cap=5", "load.rate=8"))
    assert max(res.tables["steps"]["num_running"]) == 5
    assert max(res.tables["poller"]["running"]) <= 5
    assert res.summary["max_running"] == 5


@pytest.mark.parametrize("org", ("s1", "s2", "d0"))
def test_every_published_entry_is_valid_or_lost_exactly_once(org):
    res = run_cell(
        synth_cfg(f"org={org}", "budget=b63", "trace=true", "load.rate=6", "workload.q=0.5")
    )
    tr = res.tables["trace"]
    assert tr["seq"] == list(range(len(tr["seq"])))
    assert tr["event"][-1] == "END"
    state: dict[tuple[str, str], str] = {}
    losses = 0
    for event, kind, key, cause in zip(
        tr["event"], tr["kind"], tr["key"], tr["cause_request_id"], strict=True
    ):
        if event == "PUBLISH":
            assert state.get((kind, key)) != "PUBLISH", "published twice without a loss"
            state[(kind, key)] = "PUBLISH"
        elif event == "LOSS":
            assert state.get((kind, key)) == "PUBLISH", "loss of an entry that was not published"
            assert cause >= 0
            state[(kind, key)] = "LOSS"
            losses += 1
    assert losses > 0, "the scenario must evict"
    cache = res.memory.cache
    live = {("attention", k) for k in map(_fmt, cache.attention)}
    live |= {("checkpoint", k) for k in map(_fmt, cache.checkpoints)}
    assert live, "the run must end with cached entries"
    assert {k for k, v in state.items() if v == "PUBLISH"} == live


def _fmt(key: int) -> str:
    from serving_core.records import format_key

    return format_key(key)


def test_preempted_requests_complete_their_output():
    res = run_cell(
        compose_config(
            *SYNTH[:3],
            "workload.synthetic_output_tokens=1000",
            "workload.num_requests=60",
            "org=s2",
            "budget=b30",
            "load.rate=4",
        )
    )
    req = res.tables["requests"]
    pre = [i for i, p in enumerate(req["preemptions"]) if p]
    assert pre, "scenario must preempt"
    for i in pre:
        assert req["output_tokens"][i] == req["target_output_tokens"][i]
        assert req["episodes"][i] == req["preemptions"][i] + 1


def test_same_config_same_records():
    a = run_cell(synth_cfg("org=s2", "trace=true", "load.rate=5"))
    b = run_cell(synth_cfg("org=s2", "trace=true", "load.rate=5"))
    sa = {k: v for k, v in a.summary.items() if k != "wall_seconds"}
    sb = {k: v for k, v in b.summary.items() if k != "wall_seconds"}
    assert sa == sb
    for table in a.tables:
        assert a.tables[table] == b.tables[table], table


def test_budget_that_cannot_hold_one_request_fails_fast():
    with pytest.raises(ValueError, match="budget='p8'.*cannot hold one maximal request"):
        run_cell(synth_cfg("org=s2", "budget=p8"))


def test_smallest_budget_with_large_headroom_still_completes_serially():
    """Progress guarantee: a budget that holds one maximal request completes every request,
    whatever the headroom and cap."""
    # 1,448 tokens = 3 attention pages + 2 composites of 3 pages + 1 slab page = 10 pages.
    res = run_cell(synth_cfg("org=s2", "budget=p10", "engine.headroom=0.35", "load.rate=20", n=12))
    s = res.summary
    assert s["completed"] == 12
    # Headroom 3 of 10 pages never admits beside a running request: strictly serial service.
    assert s["max_running"] == 1
    req = res.tables["requests"]
    spans = sorted(zip(req["start_s"], req["finish_s"], strict=True))
    pairs = zip(spans, spans[1:], strict=False)
    assert all(start >= prev_end for (_, prev_end), (start, _) in pairs)


@pytest.mark.parametrize("semantics", ("paper", "first_chunk"))
def test_repeated_preemption_is_recorded_and_victims_come_from_the_tail(semantics):
    # Long outputs grow KV in decode: full_prompt admission cannot foresee that, so both
    # gates preempt here.
    res = run_cell(synth_cfg("org=s0", "budget=b8", "load.rate=50", "trace=true",
                             f"semantics={semantics}", "workload.synthetic_output_tokens=1000",
                             n=40))
    req = res.tables["requests"]
    pre = req["preemptions"]
    assert res.summary["preemptions"] == sum(pre) > 0
    assert all(e == p + 1 for e, p in zip(req["episodes"], pre, strict=True))
    # Replay the trace: every victim is the latest admitted running request.
    tr = res.tables["trace"]
    running: list[int] = []
    victims = defaultdict(int)
    for event, rid in zip(tr["event"], tr["request_id"], strict=True):
        if event in ("LOOKUP", "RESUME"):
            running.append(rid)
        elif event == "FINISH":
            running.remove(rid)
        elif event == "PREEMPT":
            assert running and running[-1] == rid, (rid, running)
            running.pop()
            victims[rid] += 1
    assert dict(victims) == {i: p for i, p in enumerate(pre) if p}


def test_attention_only_geometry_runs():
    res = run_cell(synth_cfg("model=attention_only", "org=s2", "budget=b63", "trace=true"))
    assert res.summary["completed"] == 60
    assert "checkpoint" not in set(res.tables["trace"]["kind"])
    assert res.summary["prefix_hit_tokens"] > 0


def test_single_run_command_is_deterministic(tmp_path):
    """The same command twice prints the same last-line JSON apart from its timings."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "experiments.run", "org=s2", "budget=b63", "seed=42000",
           "write_ledgers=false", "workload.num_requests=120", f"hydra.run.dir={tmp_path}/h"]
    outputs = []
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True)
        last = json.loads(proc.stdout.strip().splitlines()[-1])
        assert last.pop("engine_seconds") > 0 and last.pop("run_seconds") > 0
        outputs.append(last)
    assert outputs[0] == outputs[1]
    assert outputs[0]["completed"] == 120 and outputs[0]["org"] == "s2"


def test_pinning_keeps_ownership_and_completes_in_a_tight_budget():
    """Preemption-time pinning (K=1) under preemption: ownership invariants hold after
    every step and every request completes."""
    res = run_cell(
        compose_config(
            *SYNTH[:3],
            "workload.synthetic_output_tokens=600",
            "workload.num_requests=40",
            "org=s2",
            "budget=p14",
            "load.rate=20",
            "engine.pinning_k=1",
        ),
        on_step=check_ownership,
    )
    assert res.summary["completed"] == 40
    assert res.summary["preemptions"] > 0
