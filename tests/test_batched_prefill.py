"""Prefill chunks of several requests over the same token span run as one batched forward
and give what one forward per chunk gives: the same sampled tokens, and every pool (KV,
recurrent composites, published checkpoints) equal to fp32 rounding. Not bit for bit: the
projections are one matrix product over all b x T rows, and MKL's GEMM does not promise a
row the same bits whatever the number of rows (seen: 3e-12 absolute in SSM states after a
60-token batch of 3; as the decode batch, whose size varies step to step, already is)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from engines import torch_engine

from serving_core.engine import serve
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget, units_for
from serving_core.scheduler import SchedulerConfig
from serving_core.server.runtime import ServedSpec


def _serve(model, org, prompts, output, batch_tokens):
    geometry = load_geometry("falcon_h1_tiny")
    engine = torch_engine(model, geometry, org, units_for(plan_budget(geometry, "b12"), org),
                          SchedulerConfig(cap=4, max_num_batched_tokens=2048), clock="virtual")
    ex = engine.executor
    ex.prefill_batch_tokens = batch_tokens
    sizes, group = [], ex._prefill_groups
    ex._prefill_groups = lambda items: sizes.extend(len(g) for g in group(items)) or group(items)
    produced: dict[int, list[int]] = {}
    step = engine.step

    def recording_step():
        out = step()
        for rid, tok in (out.produced if out is not None else ()):
            produced.setdefault(rid, []).append(tok)
        return out

    engine.step = recording_step
    serve(engine, [ServedSpec(i, 0.0, p, output) for i, p in enumerate(prompts)])
    return produced, [t.clone() for t in ex.arena.pools.values()], sizes


def _check(model, org, prompts, output, batch_tokens):
    batched, pools_b, sizes_b = _serve(model, org, prompts, output, batch_tokens)
    single, pools_s, sizes_s = _serve(model, org, prompts, output, 0)
    assert max(sizes_b) == len(prompts) and max(sizes_s) == 1  # it did batch, then did not
    assert batched == single and len(batched) == len(prompts)
    for a, b in zip(pools_b, pools_s, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_short_prefills_batch_and_equal_the_unbatched_run(tiny_model):
    rng = np.random.default_rng(24)
    prompts = [rng.integers(0, 128_256, 60).astype(np.int32) for _ in range(3)]
    _check(tiny_model, "S2", prompts, 2, 256)


def test_chunks_over_different_spans_or_past_the_cap_run_alone(tiny_model):
    ex = torch_engine(tiny_model, load_geometry("falcon_h1_tiny"), "S0",
                      units_for(plan_budget(load_geometry("falcon_h1_tiny"), "b12"), "S0"),
                      SchedulerConfig(cap=4, max_num_batched_tokens=2048)).executor

    @dataclass(eq=False)
    class Item:
        context: int
        num_new: int

    items = [Item(0, 100), Item(0, 100), Item(0, 60), Item(0, 100), Item(40, 100)]
    ex.prefill_batch_tokens = 256
    index = {id(it): n for n, it in enumerate(items)}
    assert [[index[id(i)] for i in g] for g in ex._prefill_groups(items)] == [
        [0, 1], [2], [3], [4]]  # a third 100-token chunk would pass 256 tokens
    ex.prefill_batch_tokens = 0
    assert [len(g) for g in ex._prefill_groups(items)] == [1] * 5


@pytest.mark.slow
@pytest.mark.parametrize("org", ["S0", "S1", "S2", "D0"])
def test_batched_prefill_across_a_checkpoint_boundary_equals_unbatched(tiny_model, org):
    """700-token prompts: each batched chunk splits at the 512-token boundary (D0: its
    1,792-token interval is not reached), whose checkpoints are published and written."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 128_256, 700).astype(np.int32) for _ in range(2)]
    _check(tiny_model, org, prompts, 4, 10_000)


def test_prefill_batch_tokens_is_a_config_key_the_record_reads_back(tiny_checkpoint,
                                                                     tiny_model):
    from conftest import compose_config

    from experiments.runners.spec import engine_spec
    from serving_core.builder import build_engine

    def effective(*overrides):
        cfg = compose_config("model=falcon_h1_tiny", "budget=b12", "executor=torch_inproc",
                             f"executor.checkpoint={tiny_checkpoint}", *overrides)
        return build_engine(engine_spec(cfg), model=tiny_model).effective_rules()

    assert effective()["prefill_batch_tokens"] == 256  # null: the executor's default
    assert effective("executor.prefill_batch_tokens=0")["prefill_batch_tokens"] == 0
    assert effective("executor.prefill_batch_tokens=64")["prefill_batch_tokens"] == 64
    # Packed TQ4 KV prefills one request at a time: its default is 0, and an explicit cap
    # the executor would not honour is refused in one line naming the key.
    assert effective("model.kv_codec=tq4")["prefill_batch_tokens"] == 0
    with pytest.raises(ValueError, match="prefill_batch_tokens"):
        effective("model.kv_codec=tq4", "executor.prefill_batch_tokens=64")
    with pytest.raises(ValueError, match=r"executor.prefill_batch_tokens=-1: expected"):
        effective("executor.prefill_batch_tokens=-1")
