"""vLLM 0.32's CPU build serving the Granite-4.0-H-style tiny checkpoint (slow; skipped with
the reason when no vLLM venv exists, as tests/test_vllm_arm.py).

Expected numbers are derived by hand from conf/model/granite_hybrid_tiny.yaml, not from the
runner: one attention layer's KV is 2 (K, V) x 2 KV heads x 32 dims x 4 B = 512 B per token;
one Mamba2 layer's state is 8 x 32 x 64 x 4 (SSM) + (8 x 32 + 2 x 64) x 3 x 4 (conv) =
70,144 B, so vLLM's CPU block is the smallest multiple of 128 tokens whose KV holds it:
ceil(70,144 / 512 / 128) x 128 = 256 tokens, a page of 131,072 B (the Mamba page padded by
86.9 %). vLLM pages every layer on its own (one KV-cache group per layer: 1 attention, 3
Mamba2), all groups from one block pool, so its blocks are floor(cache bytes / page).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from experiments.runners.server_process import ServerProcess
from experiments.runners.vllm_arm import free_port, vllm_command, vllm_env, vllm_executor_config
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget
from tests.test_n0_vllm import REPO, VLLM_PYTHON
from tests.test_n0_vllm import pytestmark as needs_vllm  # skipped with the reason without vLLM
from tests.test_server_process import tag  # noqa: F401  (fixture: no process outlives the test)

PRESET = "granite_hybrid_tiny"
KV_TOKEN = 2 * 2 * 32 * 4
STATE = 8 * 32 * 64 * 4 + (8 * 32 + 2 * 64) * 3 * 4
BLOCK = math.ceil(STATE / KV_TOKEN / 128) * 128
PAGE = BLOCK * KV_TOKEN
NEW_TOKENS = 16

pytestmark = [needs_vllm, pytest.mark.slow]


def test_hand_numbers():
    assert (KV_TOKEN, STATE, BLOCK, PAGE) == (512, 70_144, 256, 131_072)


def _transformers_greedy(checkpoint, prompt):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GraniteMoeHybridForCausalLM

    net = GraniteMoeHybridForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt], dtype=torch.long)
        gen = net.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return gen[0, ids.shape[1]:].tolist()


async def _complete(client, url, prompt, salt=None):
    body = {"model": "granite", "prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}
    if salt:
        body["cache_salt"] = salt
    r = await client.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    data = r.json()
    cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return data["choices"][0]["token_ids"], cached or 0


def test_vllm_serves_granite_with_transformers_tokens_and_reuse(tag, granite_tiny_checkpoint):  # noqa: F811
    """A 700-token prompt sent cold (salted), then three times unsalted: every send's greedy
    tokens equal transformers' generate; every hit is whole blocks, and the last send adopts
    the deepest block boundary inside the prompt, 256 floor(699 / 256) = 512 tokens. (With
    the CPU workaround a prompt's first sends can miss: the state at a boundary is kept only
    where a prefill chunk ends there, docs/real_path.md section 8.1; measured here 0, 0, 0,
    512.) Its cache is the block and block count computed by hand."""
    vcfg = vllm_executor_config(OmegaConf.create({
        "name": "vllm", "kind": "vllm", "checkpoint": str(granite_tiny_checkpoint),
        "python": str(VLLM_PYTHON)}))
    nominal = plan_budget(load_geometry(PRESET), "b63").nominal_bytes  # one storage group
    port = free_port()
    cmd = vllm_command(vcfg, served_name="granite", port=port, cap=4,
                       max_num_batched_tokens=2048, max_model_len=8192, kv_bytes=nominal,
                       block_tokens=BLOCK)
    base = f"http://127.0.0.1:{port}"
    prompt = [int(t) for t in np.random.default_rng(11).integers(1000, 120000, 700)]
    expected = _transformers_greedy(granite_tiny_checkpoint, prompt)

    async def sends():
        async with httpx.AsyncClient() as client:
            url = base + "/v1/completions"
            return [await _complete(client, url, prompt, salt)
                    for salt in ("cold", None, None, None)]

    with ServerProcess(cmd, base_url=base, health_timeout_s=900, env=vllm_env(vcfg)):
        got = asyncio.run(sends())
        metrics = httpx.get(base + "/metrics").text
    assert [tokens for tokens, _ in got] == [expected] * 4
    hits = [cached for _, cached in got]
    deepest = BLOCK * ((len(prompt) - 1) // BLOCK)
    assert hits[0] == 0 and hits[-1] == deepest == 512
    assert all(h % BLOCK == 0 and h <= deepest for h in hits)
    (info,) = [line for line in metrics.splitlines()
               if line.startswith("vllm:cache_config_info{")]
    assert f'block_size="{BLOCK}"' in info
    assert f'num_gpu_blocks="{nominal // PAGE}"' in info


def test_runner_serves_granite_on_vllm(tag, tmp_path, granite_tiny_checkpoint):  # noqa: F811
    """executor=vllm model=granite_hybrid_tiny: 3 requests through the runner, complete runs
    row, the ledgers check, and vLLM's effective cache as computed by hand."""
    import ledgers
    from ledgers.check import check

    cmd = [sys.executable, "-m", "experiments.run", "executor=vllm", f"model={PRESET}",
           "org=n0", "budget=b63", "workload.source=synthetic", "workload.num_requests=3",
           "load.rate=1", f"executor.checkpoint={granite_tiny_checkpoint}",
           f"executor.python={VLLM_PYTHON}", f"ledger_root={tmp_path / 'ledgers'}",
           "campaign_name=vllm_granite_test", f"hydra.run.dir={tmp_path / 'hydra'}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    root = tmp_path / "ledgers"
    assert check(root).ok
    (executor, status, done, out, units, cfg), = ledgers.connect(root).sql(
        "SELECT executor, status, completed_requests, output_tokens, units, engine_config "
        "FROM runs").fetchall()
    cfg = json.loads(cfg)
    nominal = plan_budget(load_geometry(PRESET), "b63").nominal_bytes
    assert (executor, status, done, out) == ("vllm:cpu", "complete", 3, 3 * 32)
    assert cfg["block_size"] == BLOCK and cfg["page_bytes"] == PAGE
    assert units == cfg["num_blocks"] == nominal // PAGE
    assert cfg["cache_mode"] == "align" and cfg["cpu_mamba2_fix_applied"]
