"""executor=vllm: settings, command line, effective-cache parsing (no vLLM needed), and,
with a vLLM venv, end-to-end runs through the runner and the CPU prefix-caching workaround.

Expected numbers are derived independently of experiments.runners.vllm_arm: the tiny model's
per-layer KV is 2 (K, V) x 2 KV heads x 64 dims x 4 bytes = 1,024 B per token; one Mamba2
state is 12 x 64 x 512 x 4 (SSM) + (768 + 2 x 512) x 3 x 4 (conv) = 1,594,368 B, so
vLLM's CPU block is the smallest multiple of 128 tokens whose KV holds it:
ceil(1,594,368 / 1,024 / 128) x 128 = 1,664 tokens, a page of 1,703,936 B.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.runners import vllm_arm
from experiments.runners.server_process import ServerError, ServerProcess
from experiments.runners.vllm_arm import (
    boot_log_facts,
    cache_config_info,
    effective_cache,
    engine_summary,
    free_port,
    kv_cache_bytes,
    vllm_command,
    vllm_env,
    vllm_executor_config,
)
from serving_core.geometry import load_geometry
from serving_core.planner import plan_budget
from tests.test_n0_vllm import REPO, VLLM_PYTHON
from tests.test_n0_vllm import pytestmark as needs_vllm  # skipped with the reason without vLLM
from tests.test_server_process import tag  # noqa: F401  (fixture: no process outlives the test)

KV_TOKEN = 2 * 2 * 64 * 4
STATE = 12 * 64 * 512 * 4 + (768 + 2 * 512) * 3 * 4
BLOCK = math.ceil(STATE / KV_TOKEN / 128) * 128
PAGE = BLOCK * KV_TOKEN

# vLLM 0.32's cache_config_info sample as exported on this machine (tiny model, b63).
METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="1664",enable_prefix_caching="True",engine="0",'
    'kv_cache_memory_bytes="202309632",kv_cache_size_tokens="69046",'
    'mamba_cache_mode="align",num_gpu_blocks="59",'
    'prefix_cache_retention_interval="1664"} 1.0\n'
)
LOG = (
    "(Worker pid=1) INFO [interface.py:1096] Setting attention block size to 1664 tokens to "
    "ensure that attention page size is >= mamba page size.\n"
    "(Worker pid=1) INFO [interface.py:1120] Padding mamba page size by 6.87% to ensure that "
    "mamba page size and attention page size are exactly equal.\n"
    "(Worker pid=1) WARNING [__init__.py:42] hsl: CPU Mamba2 prefix-caching workaround "
    "applied (pid 1)\n"
)


def _vcfg(**kw):
    return vllm_executor_config(OmegaConf.create({"name": "vllm", "kind": "vllm",
                                                  "checkpoint": "ckpt", **kw}))


# A stand-in for vLLM's server: binds 127.0.0.1:<argv[1]> (dying with the bind's error, as
# vLLM's launcher does) and answers 200 to every GET.
FAKE_SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a):\n"
    "        pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def test_free_port_is_below_the_ephemeral_range_and_binds():
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        port = free_port()
        assert vllm_arm.PORT_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_boot_that_lost_its_port_is_retried_on_a_new_one(monkeypatch, tag):  # noqa: F811
    """vLLM binds seconds after it starts; a port taken in between kills that start with
    "Address already in use", and the arm starts again on another port (any other failure
    is raised at once)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1], free_port()]
    monkeypatch.setattr(vllm_arm, "free_port", lambda: ports.pop(0))
    monkeypatch.setattr(vllm_arm, "vllm_command", lambda vcfg, *, served_name, port, **_:
                        [sys.executable, "-c", FAKE_SERVER, str(port)])
    try:
        srv, base = vllm_arm._boot(_vcfg(boot_timeout_s=60), "tiny")
        with srv:
            assert httpx.get(base + "/health").status_code == 200
            assert not ports and base != f"http://127.0.0.1:{taken.getsockname()[1]}"
    finally:
        taken.close()


def test_a_boot_that_fails_otherwise_is_not_retried(monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_arm, "vllm_command", lambda vcfg, *, served_name, port, **_:
                        calls.append(port) or [sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerError, match="exited with code 3"):
        vllm_arm._boot(_vcfg(boot_timeout_s=60), "tiny")
    assert len(calls) == 1


def test_geometry_constants_agree_with_the_preset():
    g = load_geometry("falcon_h1_tiny")
    assert g.attention_bytes_per_token == KV_TOKEN and g.composite_bytes == STATE
    assert (BLOCK, PAGE) == (1664, 1_703_936)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("dtype", "int8", "executor.dtype='int8': allowed values are"),
    ("prefix_caching", "yes", "executor.prefix_caching='yes': expected true or false"),
    ("retention_interval", -5, "executor.retention_interval=-5: expected an integer >= 0"),
    ("boot_timeout_s", 0, "executor.boot_timeout_s=0: expected a number > 0"),
    ("colour", 1, "executor: unknown fields ['colour']"),
])
def test_bad_settings_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _vcfg(**{field: value})


def test_command_line_carries_the_cell():
    g = load_geometry("falcon_h1_tiny")
    nominal = plan_budget(g, "b63").nominal_bytes
    kv = kv_cache_bytes(nominal, g.num_layers)
    assert kv == 2 * nominal
    cmd = vllm_command(_vcfg(), served_name="m", port=4321, cap=7, max_num_batched_tokens=512,
                       max_model_len=8192, kv_bytes=kv, block_tokens=BLOCK)
    pairs = dict(zip(cmd, cmd[1:], strict=False))
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert (pairs["--host"], pairs["--port"], pairs["--max-num-seqs"]) == ("127.0.0.1", "4321", "7")
    assert pairs["--kv-cache-memory-bytes"] == str(kv)
    assert pairs["--prefix-cache-retention-interval"] == str(BLOCK)
    assert "--enable-prefix-caching" in cmd and "--skip-tokenizer-init" in cmd
    off = vllm_command(_vcfg(prefix_caching=False, retention_interval=None), served_name="m",
                       port=1, cap=1, max_num_batched_tokens=1, max_model_len=1, kv_bytes=1,
                       block_tokens=BLOCK)
    assert "--no-enable-prefix-caching" in off
    assert "--prefix-cache-retention-interval" not in off
    env = vllm_env(_vcfg(cpu_mamba2_fix=False))
    assert env["HSL_VLLM_CPU_MAMBA2_FIX"] == "0" and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_effective_cache_from_metrics_and_log():
    info = cache_config_info(METRICS)
    facts = boot_log_facts(LOG)
    assert facts["log_block_size"] == BLOCK and facts["cpu_mamba2_fix_applied"]
    cache = effective_cache(info, facts, kv_bytes=202_309_632, kv_token_bytes=KV_TOKEN,
                            num_layers=2)
    # vLLM: blocks = bytes // (page x layers)
    assert cache["num_blocks"] == 202_309_632 // (PAGE * 2) == 59
    assert cache["kv_cache_memory_bytes_allocated"] == 59 * PAGE * 2
    assert cache["page_padding_percent"] == pytest.approx(100 * (PAGE / STATE - 1), abs=0.01)
    assert (cache["cache_mode"], cache["prefix_caching"], cache["retention_interval"]) == (
        "align", True, 1664)
    assert not boot_log_facts("nothing")["cpu_mamba2_fix_applied"]
    with pytest.raises(ValueError, match="cache_config_info"):
        cache_config_info("# nothing\n")


def test_engine_summary_reads_the_last_scrape():
    cols = {"running": [0, 3, 1], "waiting": [0, 2, 0], "preemptions_total": [0, 1, 2],
            "prefix_hit_tokens_total": [0, 1664, 3328], "prompt_tokens_total": [0, 4000, 6000]}
    s = engine_summary(cols)
    assert s == {"preemptions": 2, "prefix_hit_tokens": 3328, "prefill_tokens_computed": 2672,
                 "max_running": 3, "max_waiting": 2}


def _run(tmp_path, *overrides, timeout=900):
    cmd = [sys.executable, "-m", "experiments.run", "executor=vllm", "model=falcon_h1_tiny",
           "budget=b63", "workload.source=synthetic", "workload.synthetic_prompt_tokens=2000",
           "workload.synthetic_context_tokens=1800", "workload.num_contexts=1",
           f"executor.python={VLLM_PYTHON}", f"ledger_root={tmp_path / 'ledgers'}",
           "campaign_name=vllm_test", f"hydra.run.dir={tmp_path / 'hydra'}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_runner_rejects_other_orgs_and_a_missing_interpreter(tmp_path, tiny_checkpoint):
    res = _run(tmp_path, "org=s2", f"executor.checkpoint={tiny_checkpoint}")
    assert res.returncode == 2 and "org='s2'" in res.stderr
    assert "allowed values are n0" in res.stderr
    res = _run(tmp_path, "org=n0", f"executor.checkpoint={tiny_checkpoint}",
               "executor.python=/nonexistent/python")
    assert res.returncode == 2 and "executor.python='/nonexistent/python'" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "ledgers" / "runs").exists()


@needs_vllm
@pytest.mark.slow
def test_runner_serves_three_requests_on_vllm(tag, tmp_path, tiny_checkpoint):  # noqa: F811
    import ledgers
    from ledgers.check import check

    res = _run(tmp_path, "org=n0", f"executor.checkpoint={tiny_checkpoint}",
               "workload.num_requests=3", "load.rate=1")
    assert res.returncode == 0, res.stderr[-3000:]
    root = tmp_path / "ledgers"
    assert check(root).ok
    con = ledgers.connect(root)
    (executor, status, done, out, end, units, cfg), = con.sql(
        "SELECT executor, status, completed_requests, output_tokens, episode_end_s, units, "
        "engine_config FROM runs").fetchall()
    cfg = json.loads(cfg)
    nominal = plan_budget(load_geometry("falcon_h1_tiny"), "b63").nominal_bytes
    assert (executor, status, done, out) == ("vllm:cpu", "complete", 3, 3 * 32)
    assert cfg["version"] == "0.32.0" and cfg["block_size"] == BLOCK
    assert units == cfg["num_blocks"] == (2 * nominal) // (2 * PAGE)
    assert cfg["cache_mode"] == "align" and cfg["cpu_mamba2_fix_applied"]
    assert cfg["not_applicable"] == ["trace", "slab", "steps"] and cfg["boot_s"] > 0
    for table in cfg["not_applicable"]:
        assert not (root / table).exists()  # absent, not zeros
    ticks = [t for (t,) in con.sql("SELECT t_s FROM poller ORDER BY 1").fetchall()]
    assert ticks[0] == 0 and len(ticks) >= end - 1
    last = con.sql("SELECT generation_tokens_total, prompt_tokens_total FROM poller "
                   "ORDER BY t_s DESC LIMIT 1").fetchall()[0]
    assert last == (out, 3 * 2000)
    reqs = con.sql("SELECT status, output_tokens, adopted_prefix_tokens FROM requests "
                   "ORDER BY request_id").fetchall()
    assert [r[:2] for r in reqs] == [("finished", 32)] * 3
    # One shared 1,800-token context: a later request adopts its whole first block.
    assert reqs[0][2] == 0 and reqs[2][2] == BLOCK


@needs_vllm
@pytest.mark.slow
def test_a_server_that_never_gets_healthy_is_killed(tag, tmp_path, tiny_checkpoint):  # noqa: F811
    import ledgers

    res = _run(tmp_path, "org=n0", f"executor.checkpoint={tiny_checkpoint}",
               "workload.num_requests=3", "executor.boot_timeout_s=3")
    assert res.returncode != 0 and "not healthy after 3 s" in res.stderr
    con = ledgers.connect(tmp_path / "ledgers")  # runs: complete only; raw_runs: attempts
    assert con.sql("SELECT status FROM raw_runs").fetchall() == [("failed",)]
    assert con.sql("SELECT count(*) FROM runs").fetchall() == [(0,)]  # never counted
    # and the tag fixture checks that no vLLM process is left


async def _complete(client, url, prompt, salt=None):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True, "logprobs": 1,
            "return_tokens_as_token_ids": True}  # logprobs without a tokenizer
    if salt:
        body["cache_salt"] = salt
    r = await client.post(url, json=body, timeout=300)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], cached or 0


@needs_vllm
@pytest.mark.slow
def test_cpu_prefix_caching_workaround_reuses_blocks_with_equal_outputs(tag, tiny_checkpoint):  # noqa: F811
    """A 3,400-token prompt (two blocks) would crash vLLM 0.32 on CPU with prefix caching;
    with the plugin the second send adopts both blocks and its greedy tokens and logprobs
    equal an uncached computation of the same prompt (a salted send)."""
    vcfg = vllm_executor_config(OmegaConf.create({
        "name": "vllm", "kind": "vllm", "checkpoint": str(tiny_checkpoint),
        "python": str(VLLM_PYTHON)}))
    port = free_port()
    cmd = vllm_command(vcfg, served_name="tiny", port=port, cap=4, max_num_batched_tokens=2048,
                       max_model_len=8192, kv_bytes=2 * 59 * PAGE, block_tokens=BLOCK)
    base = f"http://127.0.0.1:{port}"
    prompt = [int(t) for t in np.random.default_rng(7).integers(1000, 120000, 3400)]

    async def sends():
        async with httpx.AsyncClient() as client:
            url = base + "/v1/completions"
            return [await _complete(client, url, prompt, salt) for salt in ("cold", None, None)]

    with ServerProcess(cmd, base_url=base, health_timeout_s=900, env=vllm_env(vcfg)) as srv:
        cold, first, warm = asyncio.run(sends())
        metrics = httpx.get(base + "/metrics").text
        log = srv.log_text() + "\n".join(srv.stdout_lines)
    assert boot_log_facts(log)["cpu_mamba2_fix_applied"]
    assert (cold[2], first[2], warm[2]) == (0, 0, 2 * BLOCK)
    assert cold[0] == first[0] == warm[0]
    assert warm[1] == pytest.approx(cold[1], abs=1e-3)
    hits = [line for line in metrics.splitlines()
            if line.startswith("vllm:prefix_cache_hits_total")]
    assert float(hits[0].rsplit(" ", 1)[1]) == 2 * BLOCK


@needs_vllm
@pytest.mark.slow
def test_without_the_workaround_prefix_caching_crashes_on_cpu(tag, tmp_path, tiny_checkpoint):  # noqa: F811
    """The defect the plugin works around: with it disabled, a 2,000-token prompt (longer
    than one block) kills vLLM's engine; the run fails naming the error, no process is left."""
    res = _run(tmp_path, "org=n0", f"executor.checkpoint={tiny_checkpoint}",
               "workload.num_requests=3", "load.rate=1", "executor.cpu_mamba2_fix=false")
    assert res.returncode != 0
    # the worker's IndexError at varlen_states[last_chunk_indices_p], re-raised by vLLM
    assert "requests failed" in res.stderr, res.stderr[-3000:]
    assert "is out of bounds for dimension 0 with size 1" in res.stderr, res.stderr[-3000:]
