"""Engines for tests, built the one way every path builds them: an EngineSpec through
serving_core.builder.build_engine (which checks the engine runs the requested rules).

The tests hand in what a run config would resolve: a geometry, an organization, explicit
pool units and the rules (a SchedulerConfig, or {section: rule dataclass} from
serving_core.engine_spec.rule_sections for rules of several layers), plus a step-time
model object (modelled executors) or an already loaded model (torch).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import numpy as np
import pytest

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import Engine, EngineResult, serve
from serving_core.engine_spec import EngineSpec, ExecutorSpec
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget, units_for
from serving_core.records import record_produced
from serving_core.scheduler import SchedulerConfig
from serving_core.server.runtime import ServedSpec

Spec = ServedSpec  # a request as the engine reads it (greedy, EOS ignored)


def prompt_set(seed: int, context: int, suffixes) -> list[np.ndarray]:
    """A shared random document of `context` tokens, then one random question per suffix
    length (token ids below 128,256)."""
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 128_256, context)
    return [np.concatenate([ctx, rng.integers(0, 128_256, n)]).astype(np.int32) for n in suffixes]


def transformers_generate(model_class: str, checkpoint, prompts, output_tokens: int):
    """transformers' own greedy continuation (`generate`, fp32, EOS ignored) of each prompt
    alone: (the continuations, the network)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    net = getattr(transformers, model_class).from_pretrained(checkpoint,
                                                             dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt.tolist()], dtype=torch.long)
            gen = net.generate(ids, max_new_tokens=output_tokens, min_new_tokens=output_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, ids.shape[1]:].tolist())
    return out, net


def reference_fixtures(short: tuple, long: tuple, greedy, checkpoint: str):
    """Module fixtures prompts, long_prompts (prompt_set of seeds 2026 and 2027 at the
    `short` and `long` sizes), reference and long_reference (`greedy(checkpoint folder,
    prompts)` over the fixture named `checkpoint`), for a module to assign by those names."""

    @pytest.fixture(scope="module")
    def prompts():
        return prompt_set(2026, *short)

    @pytest.fixture(scope="module")
    def long_prompts():
        return prompt_set(2027, *long)

    @pytest.fixture(scope="module")
    def reference(request, prompts):
        return greedy(request.getfixturevalue(checkpoint), prompts)

    @pytest.fixture(scope="module")
    def long_reference(request, long_prompts):
        return greedy(request.getfixturevalue(checkpoint), long_prompts)

    return prompts, long_prompts, reference, long_reference


def _sections(rules) -> dict:
    """{section: rule dataclass} of a SchedulerConfig or of rule_sections' mapping."""
    return dict(rules) if isinstance(rules, dict) else {"scheduler": rules}


def simulated_engine(geometry, org: str, pool_units: dict[str, int], sched_cfg, step_model, *,
                     kind: str = "simulated", clock: str | None = None, trace: bool = False,
                     budget: str = "explicit", on_step=None) -> Engine:
    """A modelled engine (`kind` simulated or paced) running `step_model`; `clock`
    virtual | wall | None (the kind's default)."""
    spec = EngineSpec(model=asdict(geometry), org=org, budget=budget,
                      **_sections(sched_cfg), executor=ExecutorSpec(kind), clock=clock,
                      trace=trace, pool_units=pool_units)
    return build_engine(spec, on_step=on_step, step_model=step_model)


def run_simulated(geometry, org: str, pool_units: dict[str, int], sched_cfg, specs,
                  step_model, *, trace: bool = False, budget: str = "explicit",
                  max_steps: int | None = None, on_step=None) -> EngineResult:
    """Serve `specs` (RequestSpec, arrival order) on the simulated executor."""
    engine = simulated_engine(geometry, org, pool_units, sched_cfg, step_model, trace=trace,
                              budget=budget, on_step=on_step)
    return serve(engine, specs, max_steps)


def torch_engine(model, geometry, org: str, pool_units: dict[str, int], sched_cfg, *,
                 clock: str | None = None, trace: bool = False, budget: str = "explicit",
                 on_step=None, host_tier: dict | None = None) -> Engine:
    """A torch engine over an already loaded `model` (`clock` virtual | wall | None:
    the torch executor's default, wall; `host_tier`: {capacity_bytes: N} or None)."""
    flat = {k: v for rules in _sections(sched_cfg).values() for k, v in asdict(rules).items()}
    spec = loaded_model_spec(model, geometry, org, budget, flat, clock=clock,
                             trace=trace, pool_units=pool_units)
    if host_tier is not None:
        spec = replace(spec, host_tier=host_tier)
    return build_engine(spec, on_step=on_step, model=model)


def serve_greedy(model, preset: str, org: str, budget: str, specs, max_tokens: int = 2048,
                 cap: int = 4, **rules) -> tuple[EngineResult, dict[int, list[int]]]:
    """Serve `specs` greedily on a virtual clock with the preset's pools at `budget`; the
    result and each request's produced tokens."""
    geometry = load_geometry(preset)
    units = units_for(plan_budget(geometry, budget), org)
    engine = torch_engine(model, geometry, org, units,
                          SchedulerConfig(cap=cap, max_num_batched_tokens=max_tokens, **rules),
                          clock="virtual")
    produced = record_produced(engine)
    return serve(engine, specs), produced


@dataclass(frozen=True)
class GreedyChecks:
    """The checks that serving on `preset`'s torch engine continues a reference exactly
    (each request `output_tokens` greedy tokens): adoption of a published prefix,
    preemption and resumption, chunked prefill."""

    preset: str
    output_tokens: int

    def specs(self, prompts, which, arrivals) -> list:
        return [Spec(i, a, prompts[w], self.output_tokens)
                for i, (w, a) in enumerate(zip(which, arrivals, strict=True))]

    def adoption(self, model, prompts, reference, org: str, adopted: int,
                 max_tokens: int = 2048) -> EngineResult:
        """The second request arrives after the first finished: it adopts the shared
        prefix's deepest checkpoint (`adopted` tokens, published by the first) and computes
        only the rest. (The engine's poller samples every virtual second up to the arrival:
        10^4 s, not 10^6, is still hours of the first request's measured step time, at 1 %
        of the samples.)"""
        specs = self.specs(prompts, (0, 1), (0.0, 1e4))
        result, produced = serve_greedy(model, self.preset, org, "b12", specs,
                                        max_tokens=max_tokens)
        assert result.tables["requests"]["adopted_prefix_tokens"] == [0, adopted]
        assert produced[0] == reference[0]
        assert produced[1] == reference[1]
        return result

    def preemption(self, model, prompts, reference, org: str, budget: str, **rules) -> None:
        """Three requests at once on a budget that preempts: every resumed one continues."""
        specs = self.specs(prompts, (0, 1, 2), (0.0, 0.0, 0.0))
        result, produced = serve_greedy(model, self.preset, org, budget, specs, **rules)
        assert result.summary["preemptions"] >= 1
        requests = result.tables["requests"]
        resumed = [i for i, n in enumerate(requests["preemptions"]) if n]
        assert resumed and all(requests["episodes"][i] >= 2 for i in resumed)
        for i in range(3):
            assert produced[i] == reference[i], f"request {i}"

    def chunked_prefill(self, model, prompts, reference, org: str, chunk: int) -> None:
        """The third prompt in prefill chunks of at most `chunk` tokens."""
        specs = self.specs(prompts, (2,), (0.0,))
        result, produced = serve_greedy(model, self.preset, org, "b12", specs, max_tokens=chunk)
        prefill_steps = [n for n in result.tables["steps"]["prefill_tokens_initial"] if n]
        assert max(prefill_steps) <= chunk and len(prefill_steps) == -(-len(prompts[2]) // chunk)
        assert produced[0] == reference[2]
