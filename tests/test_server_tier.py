"""The host tier in the server, in process (FastAPI TestClient over the tiny torch model):
cold, device reuse, /reset_prefix_cache, host reload; each request's actual path and first
batch in its usage; the tier's counters; a reset refused (409) while a request runs."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace

import numpy as np
import pytest
from conftest import wait_until
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine_spec import EngineSpec
from serving_core.geometry import load_geometry
from serving_core.server.app import create_app
from serving_core.server.runtime import EngineRuntime


def _client(engine):
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len)
    app = create_app(runtime, model_name="tiny", vocab_size=engine.vocab_size)
    return TestClient(app), runtime


def _complete(client, prompt, max_tokens=3) -> dict:
    """One streamed completion with usage: (token ids, usage)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    ids, usage = [], None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for ch in chunk["choices"]:
                ids += ch["token_ids"]
    return {"ids": ids, **usage["hsl_path"], "cached": usage["prompt_tokens_details"]}


def _counters(client) -> dict:
    out = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            if (s.labels.get("model_name") == "tiny" and s.name.endswith("_total")
                    and not set(s.labels) - {"model_name", "engine", "path"}):
                key = s.name.removeprefix("hsl:").removeprefix("vllm:")
                if "path" in s.labels:
                    key += ":" + s.labels["path"]
                out[key] = s.value
    return out


@pytest.fixture(scope="module")
def tier_engine(tiny_model):
    """S2 (C = 512, aligned chunks) with the host tier and the last boundary split."""
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63",
                             {"cap": 4, "max_num_batched_tokens": 2048,
                              "split_last_boundary": True}, clock="wall")
    return build_engine(replace(spec, host_tier=True), model=tiny_model)


def test_cold_repeat_reset_reload_paths_and_counters(tier_engine):
    """N = 1,024 = 2 C: the split publishes the state at 512 (p = C floor((N-1)/C)). Cold:
    recompute, first batch 0 / 512. Repeat: device_reuse 512. After the reset, the device
    holds nothing cached; the reload restores B = 512 and computes N - B = 512 first.
    Every output equals the cold one."""
    engine = tier_engine
    rules = engine.effective_rules()
    assert rules["host_tier"] is True and rules["split_last_boundary"] is True
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 128_256, 1024)]
    client, runtime = _client(engine)
    with client:
        cold = _complete(client, prompt)
        repeat = _complete(client, prompt)
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["entries"] > 0
        assert all(cached == 0 for _, cached, _, _ in engine.mem.usage().values())
        reload = _complete(client, prompt)
        got = [(x["path"], x["reused_tokens"], x["first_batch_computed"],
                x["first_batch_scheduled"]) for x in (cold, repeat, reload)]
        assert got == [("recompute", 0, 0, 512), ("device_reuse", 512, 512, 512),
                       ("host_reload", 512, 512, 512)]
        assert reload["restored_tokens"] == 512 and reload["cached"]["cached_tokens"] == 512
        assert cold["ids"] == repeat["ids"] == reload["ids"] and len(cold["ids"]) == 3
        c = wait_until(lambda: (m := _counters(client))["requests_by_path_total:host_reload"]
                       and m, what="the reload in /metrics")
    tier = engine.host_tier.tier
    assert c["external_tier_saves_started_total"] == tier.saves_started > 0
    assert c["external_tier_saves_completed_total"] == tier.saves_completed == tier.saves_started
    # 1,024 tokens: 2 S2 blocks + checkpoints at 512 and 1,024, then the decode's blocks
    assert len(tier.blocks) >= 2 and len(tier.checkpoints) == 2
    assert c["external_tier_restores_total"] == 1
    assert c["external_prefix_cache_hits_total"] == 512
    assert c["device_prefix_cache_hits_total"] == 512
    assert c["prefix_cache_resets_total"] == 1
    assert [c[f"requests_by_path_total:{p}"] for p in
            ("recompute", "device_reuse", "host_reload")] == [1, 1, 1]


def test_reset_is_refused_while_a_request_runs(tiny_model):
    """409 with one line while a request is running; afterwards 200. Without the tier the
    server still records paths (a repeat after the reset recomputes)."""
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63",
                             {"cap": 4, "max_num_batched_tokens": 2048}, clock="wall")
    engine = build_engine(spec, model=tiny_model)
    assert engine.effective_rules()["host_tier"] is False
    held = threading.Event()  # the engine's next step waits until the test lets go
    step = engine.step

    def paused_step():
        held.wait(30)
        return step()

    engine.step = paused_step
    prompt = list(range(1, 600))
    client, runtime = _client(engine)
    with client:
        loop = asyncio.new_event_loop()
        try:
            runtime.submit(prompt, 4, "", loop)  # queued: the engine holds before its step
            refused = client.post("/reset_prefix_cache")
            assert refused.status_code == 409
            message = refused.json()["error"]["message"]
            assert "running or queued" in message and "\n" not in message
            held.set()
            wait_until(lambda: not runtime._streams, what="the request to finish")
        finally:
            loop.close()
        assert client.post("/reset_prefix_cache").status_code == 200
        again = _complete(client, prompt, 2)
        assert (again["path"], again["reused_tokens"]) == ("recompute", 0)


def test_host_tier_needs_the_torch_executor():
    from dataclasses import asdict

    with pytest.raises(ValueError, match="host_tier=true: .* needs executor.kind=torch"):
        EngineSpec(model=asdict(load_geometry("falcon_h1_tiny")), org="S2", budget="b63",
                   host_tier=True)
