"""executor=vllm_virtual: settings and model configs (no vLLM needed), and, with a vLLM venv,
vLLM's own KV cache layout against N0's, the stand-ins' guard, and a deterministic cell that
writes ledgers that check clean.

The expected block and page come from serving_core.memory.n0 (our reading of vLLM), the
answers from vLLM's own functions in the worker; N0's units for a budget are its planner's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from experiments.runners.vllm_virtual import (
    REPO,
    crossings,
    hf_config,
    init_message,
    kv_cache_bytes,
    virtual_executor_config,
    worker_env,
)
from serving_core.geometry import load_geometry
from serving_core.memory.n0 import N0_BLOCK_ALIGNMENT, N0UniformPages, n0_layout
from serving_core.planner import plan_budget
from tests.conftest import compose_config
from tests.test_n0_vllm import VLLM_PYTHON
from tests.test_n0_vllm import pytestmark as needs_vllm  # skipped with the reason without vLLM

MODELS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))


def _vllm_presets() -> list[str]:
    """The presets the arm builds (a vLLM architecture and bf16 KV) that N0 also holds."""
    out = []
    for name in MODELS:
        g = load_geometry(name)
        try:
            hf_config(g)
            n0_layout(g)
        except ValueError:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize(("field", "value", "words"), [
    ("platform", "tpu", "allowed values are gpu, cpu"),
    ("mamba_cache_mode", "all", "allowed values are align, none"),
    ("mamba_cache_mode", "none", "vLLM 0.32 runs align whenever prefix caching is on"),
    ("retention_interval", -1, "allowed values are block, null"),
    ("retention_interval", "0block", "<k>block (every k blocks"),
    ("prefix_caching", "yes", "expected true or false"),
    ("max_num_batched_tokens", 0, "integer >= 1"),
    ("bogus", 1, "unknown key"),
])
def test_bad_settings_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=f"executor.{field}") as err:
        virtual_executor_config({"kind": "vllm_virtual", field: value})
    assert words in str(err.value)


def test_a_bad_cell_is_refused_in_one_line():
    from experiments.config.validation import validate_config

    with pytest.raises(ValueError, match="org='s2': executor=vllm_virtual"):
        validate_config(compose_config("executor=vllm_virtual", "org=s2",
                                       "executor.python=/bin/sh"), check_root=False)
    with pytest.raises(ValueError, match="model='jamba_v0_1'"):
        validate_config(compose_config("executor=vllm_virtual", "org=n0", "model=jamba_v0_1",
                                       "executor.python=/bin/sh"), check_root=False)


def test_model_configs_name_vllm_architectures():
    falcon = hf_config(load_geometry("falcon_h1_7b"))
    assert falcon["architectures"] == ["FalconH1ForCausalLM"]
    assert (falcon["num_hidden_layers"], falcon["mamba_d_ssm"], falcon["head_dim"]) == (
        44, 24 * 128, 128)
    granite = hf_config(load_geometry("granite_4_0_h_tiny"))
    assert granite["architectures"] == ["GraniteMoeHybridForCausalLM"]
    assert granite["mamba_expand"] == 2  # 48 heads x 64 = 2 x 1,536
    attention = [i for i, t in enumerate(granite["layer_types"]) if t == "full_attention"]
    assert attention == [5, 15, 25, 35]
    assert {"falcon_h1_7b", "granite_4_0_h_tiny", "granite_4_0_h_small",
            "nemotron_h_8b"} <= set(_vllm_presets())
    nemotron = hf_config(load_geometry("nemotron_h_8b"))
    assert nemotron["architectures"] == ["NemotronHForCausalLM"]
    pattern = nemotron["hybrid_override_pattern"]
    assert len(pattern) == 52 and pattern.count("M") == 24 and pattern.count("*") == 4
    assert pattern.startswith("M-M-M-M*-") and nemotron["mamba_num_heads"] == 128
    for name in ("jamba_v0_1", "qwen3_next_80b_a3b", "falcon_h1_7b_tq4"):
        with pytest.raises(ValueError):
            hf_config(load_geometry(name))


def test_vllm_layer_names_group_the_cache_as_the_models_register_them():
    """The stand-in's layer names (no vLLM needed): Nemotron-H's MLP layers hold no cache."""
    from types import SimpleNamespace

    from experiments.runners.vllm_standins import layer_names

    cfg = SimpleNamespace(**hf_config(load_geometry("nemotron_h_8b")))
    names = layer_names(cfg)
    assert len(names) == 28 and names[0] == ("model.layers.0.mixer", "mamba")
    assert [n for n, kind in names if kind == "attention"] == [
        f"model.layers.{i}.mixer.attn" for i in (7, 18, 29, 40)]


def test_retention_in_blocks_passes_the_multiple_to_vllm():
    g = load_geometry("falcon_h1_7b")
    for value, blocks in (("block", 1), ("2block", 2), (None, 0), (3136, 0)):
        cfg = virtual_executor_config({"retention_interval": value})
        init = init_message(cfg, g, budget="b63", cap=63, max_num_batched_tokens=2048,
                            specs=[])
        assert init["vllm"]["retention_block"] == blocks, value
        assert init["vllm"]["retention_interval"] == (3136 if value == 3136 else 0)


def test_the_guard_hash_changes_with_the_source(tmp_path, monkeypatch):
    """What the guard test compares: a mirrored function's or class's source hash moves
    with any edit of it (an upgrade that changes a mirrored function fails the guard)."""
    from experiments.runners.vllm_standins import source_hash

    monkeypatch.syspath_prepend(str(tmp_path))
    hashes = []
    for i, body in enumerate(("return 1", "return 1", "return 2")):
        (tmp_path / f"mirrored_{i}.py").write_text(f"class C:\n    def f(self):\n        {body}\n")
        hashes.append((source_hash(f"mirrored_{i}:C.f"), source_hash(f"mirrored_{i}:C")))
    assert hashes[0] == hashes[1] and hashes[1][0] != hashes[2][0]
    assert hashes[1][1] != hashes[2][1]


def test_budget_bytes_and_block_crossings():
    g = load_geometry("falcon_h1_7b")
    assert kv_cache_bytes(g, "b63") == plan_budget(g, "b63").nominal_bytes * 44
    assert crossings([1568, 1, 100], [0, 1567, 3100], 1568) == 1 + 1 + 1
    cfg = virtual_executor_config({"retention_interval": None})
    init = init_message(cfg, g, budget="b63", cap=63, max_num_batched_tokens=2048, specs=[])
    assert init["vllm"]["retention_interval"] == 0 and not init["vllm"]["retention_block"]


def _worker(*args: str, stdin: str = "") -> dict | list:
    res = subprocess.run([str(VLLM_PYTHON), "-m", "experiments.runners.vllm_virtual_worker",
                          *args], input=stdin, capture_output=True, text=True, timeout=900,
                         cwd=REPO, env=worker_env())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_vllm
def test_mirrored_vllm_functions_are_unchanged():
    """The stand-ins mirror these vLLM functions; an upgrade that changes one fails here
    (read the new source, update experiments/runners/vllm_standins.py, then the hash)."""
    from experiments.runners.vllm_standins import MIRRORED, source_hashes

    # the installed vLLM's package folder (found, not imported); its files are read here
    where = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.util as u; "
                            "print(u.find_spec('vllm').origin)"], capture_output=True,
                           text=True, timeout=120, check=True)
    got = source_hashes(Path(where.stdout.strip()).parent)
    changed = sorted(k for k in MIRRORED if got[k] != MIRRORED[k])
    assert not changed, f"vLLM changed what the stand-ins mirror: {changed}"


@needs_vllm
@pytest.mark.slow
def test_vllm_derives_n0s_block_page_and_blocks():
    """For every preset the arm builds, vLLM's own block size, page bytes and block count
    (less its null block) equal N0's (GPU alignment, b63 and b108)."""
    presets = _vllm_presets()
    cfg = virtual_executor_config({})
    inits = [init_message(cfg, load_geometry(name), budget=budget, cap=63,
                          max_num_batched_tokens=2048, specs=[])
             for name in presets for budget in ("b63", "b108")]
    answers = _worker("--settings", stdin=json.dumps(inits))
    for (name, budget), got in zip([(n, b) for n in presets for b in ("b63", "b108")],
                                   answers, strict=True):
        g = load_geometry(name)
        layout = n0_layout(g, N0_BLOCK_ALIGNMENT)
        units = N0UniformPages.plan_pools(g, layout, plan_budget(g, budget).nominal_bytes)
        assert got["version"] == "0.32.0"
        assert got["block_size"] == got["mamba_block_size"] == layout.block_tokens, name
        assert got["page_bytes"] == got["mamba_page_size_padded"] == layout.page_bytes, name
        assert got["num_blocks"] - 1 == units[0].num_units, (name, budget)
        assert got["retention_interval"] == layout.block_tokens  # "block"
    falcon = answers[presets.index("falcon_h1_7b") * 2]
    assert (falcon["block_size"], falcon["page_bytes"]) == (1568, 1_605_632)
    assert falcon["kv_cache_groups"] == [["FullAttentionSpec", 44], ["MambaSpec", 44]]
    tiny = answers[presets.index("granite_4_0_h_tiny") * 2]
    assert tiny["block_size"] == 400 and len(tiny["kv_cache_groups"]) == 10
    nemotron = answers[presets.index("nemotron_h_8b") * 2]
    assert (nemotron["block_size"], nemotron["page_bytes"]) == (528, 2_162_688)
    assert nemotron["kv_cache_groups"] == [["MambaSpec", 4]] * 6 + [["FullAttentionSpec", 4]]


def _run(root, *overrides: str) -> None:
    from experiments.run import main_run

    main_run(compose_config("org=n0", "executor=vllm_virtual", "budget=b83",
                            f"ledger_root={root}", "campaign_name=vllm_virtual", *overrides))


@needs_vllm
@pytest.mark.slow
def test_a_cell_is_deterministic_and_its_ledgers_check(tmp_path):
    """Two runs of one 300-request cell write identical requests, steps and poller tables,
    and both ledger roots check clean."""
    import ledgers
    from ledgers.check import check

    tables = []
    for name in ("a", "b"):
        root = tmp_path / name
        _run(root)
        assert check(root).ok
        con = ledgers.connect(root)
        got = {}
        for table, order in (("requests", "request_id"), ("steps", "step"),
                             ("poller", "t_s")):
            cols = [c for c in con.sql(f"SELECT * FROM {table} LIMIT 0").columns
                    if c not in ("run_id", "campaign", "attempt", "created_at")]
            rows = con.sql(f"SELECT {', '.join(cols)} FROM {table} ORDER BY {order}"
                           ).fetchall()
            got[table] = [tuple("nan" if v != v else v for v in row) for row in rows]  # NaN
        (cfg, executor, units), = con.sql(
            "SELECT engine_config, executor, units FROM runs").fetchall()
        got["engine_config"] = json.loads(cfg)
        tables.append(got)
        # the steps add up to the requests: first episodes compute at most the prompts less
        # the prefixes adopted at first admission (all of it unless preempted mid-prefill,
        # the rest is recomputed on resume); a token that ends a prefill chunk is no decode
        # token, and each request's last episode and at most every episode ends one
        (initial, resume, decode, steps, sampled), = con.sql(
            "SELECT sum(prefill_tokens_initial), sum(prefill_tokens_resume), "
            "sum(decode_tokens), count(*), sum(num_sampling) FROM steps").fetchall()
        (c_once, out, episodes, preempted, runs_steps), = con.sql(
            "SELECT sum(prompt_tokens - adopted_prefix_tokens), sum(output_tokens), "
            "sum(episodes), sum(preemptions), (SELECT engine_steps FROM runs) FROM requests"
        ).fetchall()
        assert initial <= c_once <= initial + resume and out - episodes <= decode <= out - 300
        assert steps == runs_steps
        assert sampled == out  # each request that samples in a step adds one output token
        assert episodes == 300 + preempted
        assert executor == "vllm_virtual:a100" and units == 82
    a, b = tables
    assert a == b
    assert len(a["requests"]) == 300 and len(a["steps"]) > 1000
    cfg = a["engine_config"]
    assert (cfg["engine"], cfg["block_size"], cfg["num_blocks"]) == ("vllm_virtual", 1568, 83)
    assert (cfg["clock"], cfg["profile"]) == ("virtual", "a100-calibrated")
