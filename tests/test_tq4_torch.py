"""TQ4 attention state on the torch executor (model.kv_codec=tq4, the tiny Falcon-H1).

- the arena's pools are the planner's TQ4 units byte for byte, and the packed KV view
  is head_dim / 2 code bytes + 2 norm bytes per vector (hand arithmetic);
- the bounded prefill reconstruction (model.kv_group_heads) changes no token, and the
  executor's measured peak temporary is the hand-computed operand size;
- greedy generations with the codec on are deterministic and identical between
  S0/S1/S2/D0 (slow), and a reload continues exactly like the cold run with the codec
  on (slow: the continuation matrix); agreement with bf16 is printed, not asserted.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from engines import torch_engine

from experiments.workloads.workload import RequestSpec
from serving_core.geometry import Geometry, load_geometry
from serving_core.memory import org_layout
from serving_core.planner import plan_budget, units_for
from serving_core.scheduler import SchedulerConfig

ORGS = ("S0", "S1", "S2", "D0")
# 2 KV heads x (K, V) x (64 elements x 4 bits / 8 + a 2-byte fp16 norm)
TOKEN_BYTES = 2 * 2 * (64 * 4 // 8 + 2)


def _geometry(codec: str = "tq4", group: int | None = None) -> Geometry:
    return replace(load_geometry("falcon_h1_tiny").with_codec(codec), kv_group_heads=group)


def _engine(model, geometry: Geometry, org: str, budget: str = "b8", cap: int = 8,
            admission: str = "full_prompt"):
    units = units_for(plan_budget(geometry, budget), org)
    cfg = SchedulerConfig(cap=cap, max_num_batched_tokens=2048, headroom=0.0,
                          admission=admission)
    return torch_engine(model, geometry, org, units, cfg, clock="virtual")


def _generate(engine, prompts, output_tokens: int) -> dict[int, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(RequestSpec(i, 0.0, prompt, output_tokens, -1, ""))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while engine.num_finished < len(prompts):
        step = engine.step()
        if step is not None:
            for rid, tok in step.produced:
                out[rid].append(tok)
    return out


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 128_000, n).astype(np.int32) for n in lengths]


def test_packed_arena_is_the_planners_tq4_units(tiny_model):
    g = _geometry()
    assert TOKEN_BYTES == 136 == g.attention_bytes_per_token
    # hand: S1/S2 page = 512 tokens x 136 B; D0 attention unit = 16 x 136 B; S0's page is
    # the composite (1,536 KiB SSM + 21 KiB conv), larger than a 512-token TQ4 block
    hand = {"S0": {"shared": (1536 + 21) * 1024}, "S1": {"shared": 512 * 136},
            "S2": {"shared": 512 * 136}, "D0": {"attention": 16 * 136,
                                                 "recurrent": (1536 + 21) * 1024}}
    plan = plan_budget(g, "b8")
    for org in ORGS:
        arena = _engine(tiny_model, g, org).executor.arena
        pools = {p.pool: p for p in plan.pools_of(org)}
        assert {name: t.shape[2] for name, t in arena.raw.items()} == hand[org]
        for name, raw in arena.raw.items():
            assert raw.dtype == torch.uint8
            assert tuple(raw.shape) == (2, pools[name].num_units, pools[name].unit_bytes)
        assert arena.num_bytes == 2 * plan.org_bytes(org)  # two layers, the planner's bytes
        view = arena.kv_view(1)
        bt = org_layout(g, org).block_tokens
        assert view.dtype == torch.uint8 and tuple(view.shape[1:]) == (bt, 2, 2, 34)
        assert view[0].numel() == bt * TOKEN_BYTES  # one block's bytes


def test_kv_group_heads_is_checked():
    g = load_geometry("falcon_h1_tiny")
    with pytest.raises(ValueError, match="kv_group_heads=1: allowed only with kv_codec='tq4'"):
        replace(g, kv_group_heads=1)
    for bad in (0, 3, True, 1.5):
        with pytest.raises(ValueError, match=r"kv_group_heads=.*allowed values are null .* 1\.\.2"):
            replace(g.with_codec("tq4"), kv_group_heads=bad)


def test_group_size_changes_no_token_and_bounds_the_measured_temporary(tiny_model):
    """One 80-token prompt on D0 (16-token blocks), one chunk: the reconstruction holds K and
    V of (0 cached + 80) tokens for the group's heads, float32, and no page temporary."""
    prompt = _prompts([80], seed=3)
    runs = {}
    for group in (None, 1, 2):
        eng = _engine(tiny_model, _geometry(group=group), "D0")
        tokens = _generate(eng, prompt, 4)[0]
        runs[group] = (tokens, eng.executor.kv_peak_temp_bytes)
        assert eng.executor.describe()["kv_codec"] == "tq4"
        assert eng.executor.describe()["kv_group_heads"] == group
        assert eng.effective_rules()["kv_group_heads"] == group
    assert runs[None][0] == runs[1][0] == runs[2][0] and len(runs[1][0]) == 4
    assert runs[None][1] == runs[2][1] == 80 * 2 * 2 * 64 * 4
    assert runs[1][1] == 80 * 2 * 1 * 64 * 4
    bf16 = _generate(_engine(tiny_model, _geometry("bf16"), "D0"), prompt, 4)[0]
    print(f"tq4 vs bf16 greedy agreement (80-token prompt): "
          f"{sum(a == b for a, b in zip(bf16, runs[None][0], strict=True))}/4")


@pytest.mark.slow
def test_tq4_generations_are_deterministic_and_the_same_under_every_organization(
        tiny_model, capsys):
    """Prompts that cross pages, chunks and checkpoint boundaries, served together (decode
    batches of mixed lengths): the same tokens twice, and under S0/S1/S2/D0."""
    prompts = _prompts([1300, 700, 90, 2100], seed=1)
    outs = {org: _generate(_engine(tiny_model, _geometry(), org, "b63"), prompts, 12)
            for org in ORGS}
    again = _generate(_engine(tiny_model, _geometry(), "S2", "b63"), prompts, 12)
    assert again == outs["S2"]
    for org in ORGS:
        assert outs[org] == outs["S0"], org
    # preemption (a decode crossing into a new block finds no page; the victim recomputes
    # from the packed prefix it published) changes no token
    crossing = _prompts([505, 1020, 300, 700], seed=1)
    small = _engine(tiny_model, _geometry(), "S2", "b3", admission="first_chunk")
    ample = _engine(tiny_model, _geometry(), "S2", "b63")
    assert _generate(small, crossing, 12) == _generate(ample, crossing, 12)
    assert small.sched.preemptions_total > 0 == ample.sched.preemptions_total
    bf16 = _generate(_engine(tiny_model, _geometry("bf16"), "S2", "b63"), prompts, 12)
    same = sum(a == b for i in bf16 for a, b in zip(bf16[i], outs["S2"][i], strict=True))
    with capsys.disabled():
        print(f"\ntq4 vs bf16 greedy agreement: {same}/{12 * len(prompts)} tokens")


@pytest.mark.slow
def test_tq4_reload_continues_like_the_cold_run(tiny_checkpoint, tmp_path, capsys):
    """The continuation matrix with the codec on (S0/S1/S2/D0 x 9 reference lengths): the
    reload from packed host copies equals the same model's cold generation, byte audits
    at 136 B of KV per token."""
    from experiments.studies.continuation import main

    code = main(["--checkpoint", str(tiny_checkpoint), "--preset", "falcon_h1_tiny_tq4",
                 "--orgs", "s0,s1,s2,d0", "--output-tokens", "4",
                 "--ledger-root", str(tmp_path / "l"), "--report-dir", str(tmp_path / "r")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last == {"pairs": 36, "equal": 36, "B_equals_p": True,
                                  "audits_ok": True, "ok": 36}
