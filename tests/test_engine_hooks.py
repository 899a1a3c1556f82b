"""The engine's two explicit hooks for studies and tests (experiments/studies/continuation.py
uses both instead of rebinding engine methods): `Engine.on_plan` sees every step's plan
before the executor runs it, and `HybridStateManager.adoption_hook` replaces what one
admission adopts. Expectations are hand-computed from the rules: S2 on the tiny model has
C = B = 512 and aligns chunks to C within the 2,048-token budget."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from experiments.workloads.workload import RequestSpec
from serving_core.builder import build_engine
from serving_core.engine_spec import EngineSpec
from serving_core.geometry import load_geometry
from serving_core.memory import NULL
from serving_core.state_manager import Adoption

PROMPT = (np.arange(1100) % 5000 + 1).astype(np.int32)


class _Step:
    def step_seconds(self, *args, **kwargs) -> float:
        return 0.01


def _engine():
    spec = EngineSpec.from_dict({
        "model": asdict(load_geometry("falcon_h1_tiny")), "org": "S2", "budget": "b63",
        "scheduler": {"cap": 4, "max_num_batched_tokens": 2048},
        "executor": {"kind": "simulated"}})
    engine = build_engine(spec, step_model=_Step())
    assert (engine.mem.checkpoint_interval, engine.sched.align) == (512, True)
    return engine


def _serve(engine, rid: int) -> None:
    engine.add_request(RequestSpec(rid, 0.0, PROMPT, 2, -1, ""))
    while engine.num_finished < rid + 1:
        engine.step()


def test_on_plan_sees_every_plan_before_it_runs():
    engine = _engine()
    plans = []

    def observe(plan) -> None:
        # before the executor: nothing of this step is computed yet
        plans.append([(i.req.rid, i.context, i.num_new, i.req.num_computed) for i in plan])

    engine.on_plan = observe
    _serve(engine, 0)
    # [0, 1024) aligned to 2 C, then the tail [1024, 1100), then one decode step
    assert plans == [[(0, 0, 1024, 0)], [(0, 1024, 76, 1024)], [(0, 1100, 1, 1100)]]
    assert len(plans) == engine.sched.step


def test_adoption_hook_replaces_what_an_admission_adopts():
    engine = _engine()
    _serve(engine, 0)  # publishes the checkpoint at 1024 (the end of an aligned chunk)
    firsts, seen, target = [], [], [1]

    def first_batch(plan) -> None:
        firsts.extend((i.context, i.num_new) for i in plan
                      if i.req.rid == target[0] and not firsts)

    engine.on_plan = first_batch

    def nothing(req, found):
        seen.append((req.rid, found.jadopt))
        return Adoption(found.hit, found.keys, 0, [], NULL, {})

    engine.sched.state.adoption_hook = nothing
    _serve(engine, 1)
    assert seen[0] == (1, 1024)  # what the cache offered
    assert firsts == [(0, 1024)]  # what it adopted: nothing, so it recomputes from 0
    engine.sched.state.adoption_hook = None
    firsts.clear()
    target[0] = 2
    _serve(engine, 2)
    assert firsts == [(1024, 76)]  # without the hook the same prompt adopts 1024
