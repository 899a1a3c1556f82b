"""Bounded prefill interleave (engine.interleave): the per-step decision pattern against one
worked out by hand, the default left unchanged, and the key checked and read back."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import pytest
from conftest import compose_config

from experiments.runners.spec import engine_spec
from experiments.workloads.workload import RequestSpec
from serving_core.builder import build_engine
from serving_core.engine import serve
from serving_core.engine_spec import EngineSpec, ExecutorSpec
from serving_core.scheduler import SchedulerConfig


class ConstantStep:
    """Every step takes 10 ms: the pattern does not depend on timing."""

    def step_seconds(self, new_tokens, context_tokens, checkpoint_writes=0):
        return 0.01


def _batches(falcon, interleave, specs, org="D0"):
    """[(request id, tokens)] per step of a simulated D0 engine (no chunk alignment)."""
    cfg = SchedulerConfig(cap=8, max_num_batched_tokens=2048, interleave=interleave)
    spec = EngineSpec(model=asdict(falcon), org=org, budget="b63", scheduler=cfg,
                      executor=ExecutorSpec("simulated"))
    engine = build_engine(spec, step_model=ConstantStep())
    steps = []
    schedule = engine.sched.schedule

    def recording(now):
        plan = schedule(now)
        steps.append([(it.req.rid, it.num_new) for it in plan])
        return plan

    engine.sched.schedule = recording
    serve(engine, specs)
    return steps


def _spec(rid, prompt, output, arrival):
    return RequestSpec(rid, arrival, np.arange(1, prompt + 1, dtype=np.int32) + 1000 * rid,
                       output, -1, "")


# A (100-token prompt, 10 output tokens) at t = 0; B (200, 3) arrives during step 1.
SPECS = [_spec(0, 100, 10, 0.0), _spec(1, 200, 3, 0.005)]


def test_interleave_pattern_by_hand(falcon):
    """k = 2, m = 64. Step 1: nothing decodes, A's whole prompt (its first token). Then A
    decodes: two decode-only steps, one step of A's decode + 64 of B's prompt, three
    times (B at 192); A's tenth token ends it at step 10. Step 11: B alone, no decoder,
    its last 8 prompt tokens (first token); steps 12-13: B decodes (decodes never wait)."""
    got = _batches(falcon, {"decode_steps": 2, "prefill_tokens": 64}, SPECS)
    a, b = 0, 1
    cycle = [[(a, 1)], [(a, 1)], [(a, 1), (b, 64)]]
    want = [[(a, 100)], *cycle, *cycle, *cycle, [(b, 8)], [(b, 1)], [(b, 1)]]
    assert got == want


def test_interleave_off_admits_at_once(falcon):
    """Default: B's whole prompt rides along A's first decode."""
    got = _batches(falcon, None, SPECS)
    assert got[:3] == [[(0, 100)], [(0, 1), (1, 200)], [(0, 1), (1, 1)]]


def test_interleave_is_checked_and_read_back(falcon):
    for bad, field in (({"decode_steps": 0, "prefill_tokens": 64}, "decode_steps=0"),
                       ({"decode_steps": 2, "prefill_tokens": True}, "prefill_tokens=True"),
                       ({"decode_steps": 2}, "="), ("4,64", "=")):
        with pytest.raises(ValueError, match=f"engine.interleave.?{field}"):
            SchedulerConfig(interleave=bad)
    cfg = compose_config("model=falcon_h1_tiny", "org=d0", "budget=b8",
                         "engine.interleave={decode_steps:4,prefill_tokens:64}")
    rules = build_engine(engine_spec(cfg)).effective_rules()
    assert rules["interleave"] == {"decode_steps": 4, "prefill_tokens": 64}
    assert build_engine(engine_spec(compose_config())).effective_rules()["interleave"] is None
    # S2 aligns chunks to 512 tokens: 64 prefill tokens could never progress beside decodes
    s2 = compose_config("model=falcon_h1_tiny", "org=s2", "budget=b8",
                        "engine.interleave={decode_steps:4,prefill_tokens:64}")
    with pytest.raises(ValueError, match="engine.interleave.prefill_tokens=64: below S2's"):
        build_engine(engine_spec(s2))
