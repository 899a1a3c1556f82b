"""The HTTP server in process (FastAPI TestClient over the simulated executor on a wall
clock): completions whole and streamed, bad requests, cache_salt, /health, /metrics."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import wait_until
from engines import simulated_engine
from fastapi.testclient import TestClient

from experiments.runners.poller import parse_metrics
from serving_core.executor.profiles import load_device_profile
from serving_core.executor.simulated import StepTimeModel
from serving_core.planner import plan_budget, units_for
from serving_core.request import GENERATED_TOKEN_SPACE
from serving_core.scheduler import SchedulerConfig
from serving_core.server.app import create_app
from serving_core.server.runtime import EngineRuntime

VOCAB = GENERATED_TOKEN_SPACE


def _engine(geometry, org="S2", budget="b63", kind="simulated"):
    units = units_for(plan_budget(geometry, budget), org)
    model = StepTimeModel(geometry, load_device_profile("a100"), org, 0.0)
    cfg = SchedulerConfig(cap=8, max_num_batched_tokens=2048, headroom=0.0)
    return simulated_engine(geometry, org, units, cfg, model, kind=kind, clock="wall",
                            budget=budget, trace=True)


@pytest.fixture()
def served(request):
    from serving_core.geometry import load_geometry

    org = getattr(request, "param", "S2")
    engine = _engine(load_geometry("falcon_h1_tiny"), org)
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len)
    app = create_app(runtime, model_name="tiny", vocab_size=VOCAB)
    with TestClient(app) as client:
        yield client, engine, runtime
    assert not runtime._thread.is_alive()  # the lifespan stopped the engine loop


def _synthetic(rid: int, n: int) -> list[int]:
    """The simulated executor's generated ids for engine request `rid`."""
    return [(rid * 1_000_003 + j * 7_919 + 17) % VOCAB for j in range(n)]


def _metrics(client) -> dict:
    """/metrics rows by pool, once the engine is idle. The driver thread publishes its
    snapshot after it has handed a step's tokens out, so a response can end before the
    snapshot that counts its last token (seen under load): wait on that condition."""

    def idle():
        rows = {row["pool"]: row for row in parse_metrics(client.get("/metrics").text, "hsl")}
        return rows if all(r["running"] == 0 and r["waiting"] == 0 for r in rows.values()) \
            else None

    return wait_until(idle, timeout_s=120, poll_s=0.01, what="the engine's idle snapshot")


def _sse(client, body):
    events = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_completion_whole_and_streamed(served):
    client, engine, _ = served
    r = client.post("/v1/completions", json={"prompt": list(range(1, 40)), "max_tokens": 7})
    assert r.status_code == 200
    body = r.json()
    rid = int(body["id"].split("-")[1])
    choice = body["choices"][0]
    assert choice["token_ids"] == _synthetic(rid, 7)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 39, "completion_tokens": 7, "total_tokens": 46,
        "prompt_tokens_details": {"cached_tokens": 0},
        "hsl_path": {"path": "recompute", "reused_tokens": 0, "first_batch_computed": 0,
                     "first_batch_scheduled": 39, "restored_tokens": 0}}

    events = _sse(client, {"prompt": list(range(5, 30)), "max_tokens": 5, "stream": True,
                           "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    rid2 = int(chunks[0]["id"].split("-")[1])
    assert rid2 == rid + 1
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == _synthetic(rid2, 5)
    reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
    # one chunk per token, the finish reason on the last token's chunk, then the usage chunk
    assert reasons == [None] * 4 + ["length"]
    assert [len(ch["token_ids"]) for c in chunks[:-1] for ch in c["choices"]] == [1] * 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5

    m = _metrics(client)["shared"]
    assert m["generation_tokens_total"] == 12
    assert m["prompt_tokens_total"] == 39 + 25
    assert m["running"] == 0 and m["waiting"] == 0
    assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
        ({"prompt": [1, 2], "max_tokens": 2, "best_of": 2}, "best_of"),
        ({"prompt": [1, 2], "max_tokens": 2, "frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"prompt": [1, VOCAB], "max_tokens": 2}, "outside the vocabulary"),
        ({"prompt": [], "max_tokens": 2}, "at least one token"),
        ({"max_tokens": 2}, "prompt"),
        ({"prompt": [1] * 8193, "max_tokens": 2}, "maximum context length is 8192 tokens"),
        ({"prompt": [1, 2], "max_tokens": 8193}, "cannot be greater than max_model_len=8192"),
        ({"prompt": [1, 2], "max_tokens": 2, "ignore_eos": 0}, "ignore_eos"),
        ({"prompt": [1, 2], "max_tokens": 2, "temperature": -0.5}, "temperature"),
        ({"prompt": [1, 2], "max_tokens": 2, "top_p": 0}, "top_p"),
        ({"prompt": [1, 2], "max_tokens": 2, "logprobs": 21}, "logprobs"),
        ({"prompt": [1, 2], "max_tokens": 2, "stop": "x"}, "stop"),
        ({"prompt": [1, 2], "max_tokens": 2, "n": 0}, "n"),
        ({"prompt": [1, 2], "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"prompt": [1, 2], "max_tokens": 2, "stream_options": {"x": 1}}, "stream_options"),
        ({"prompt": [1, 2], "max_tokens": 2, "cache_salt": 5}, "cache_salt"),
        ({"prompt": "text", "max_tokens": 2}, "no tokenizer"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_requests_get_400_and_disturb_nothing(served, body, field):
    client, _, _ = served
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert field in r.json()["error"]["message"]
    ok = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
    m = _metrics(client)["shared"]
    assert m["generation_tokens_total"] == 3 and m["prompt_tokens_total"] == 3


def test_context_length_errors_are_vllms(served):
    """vLLM 0.32's words and error shape (vllm/renderers/params.py,
    vllm/v1/engine/input_processor.py): a prompt longer than the context, one that fills it,
    max_tokens above it; prompt + max_tokens beyond it is served up to the context."""
    client, _, _ = served
    cases = [
        ({"prompt": [1] * 8200, "max_tokens": 5},
         "This model's maximum context length is 8192 tokens. However, your prompt contains "
         "8200 input tokens, which exceeds this limit even without any output tokens. Please "
         "reduce the length of the input prompt. (parameter=input_tokens, value=8200)",
         "input_tokens"),
        ({"prompt": [1] * 8192, "max_tokens": 5},
         "The decoder prompt (length 8192) plus the number of requested output tokens (at "
         "least 1) is longer than the maximum model length of 8192. Make sure that "
         "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
         "output tokens).", None),
        ({"prompt": [1, 2], "max_tokens": 9000},
         "max_tokens=9000 cannot be greater than max_model_len=8192. Please request fewer "
         "output tokens. (parameter=max_tokens, value=9000)", "max_tokens"),
    ]
    for body, message, param in cases:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400
        assert r.json() == {"error": {"message": message, "type": "BadRequestError",
                                      "param": param, "code": 400}}
    r = client.post("/v1/completions", json={"prompt": [1] * 8190, "max_tokens": 50})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 2 and choice["finish_reason"] == "length"


def test_not_json_is_400(served):
    client, _, _ = served
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_request_the_budget_cannot_hold_is_400(geometry_tiny_b4):
    """Under b4 (12 units of S2) an 8,000-token request cannot fit: 400, and the server
    keeps serving requests that fit."""
    engine = geometry_tiny_b4
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len)
    with TestClient(create_app(runtime, model_name="tiny", vocab_size=VOCAB)) as client:
        r = client.post("/v1/completions", json={"prompt": [7] * 8000, "max_tokens": 100})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "budget='b4'" in msg and "has 12" in msg
        ok = client.post("/v1/completions", json={"prompt": [7] * 600, "max_tokens": 4})
        assert ok.status_code == 200


@pytest.fixture()
def geometry_tiny_b4():
    from serving_core.geometry import load_geometry

    return _engine(load_geometry("falcon_h1_tiny"), "S2", "b4")


def test_prefix_hits_and_cache_salt(served):
    """A repeated 1,100-token prompt restores C floor((N-1)/C) = 1,024 tokens (C = 512);
    a different cache_salt isolates it."""
    client, engine, _ = served
    prompt = [(7 * i) % 5000 + 1 for i in range(1100)]
    for _ in range(2):
        assert client.post("/v1/completions",
                           json={"prompt": prompt, "max_tokens": 2}).status_code == 200
    assert _metrics(client)["shared"]["prefix_hit_tokens_total"] == 1024
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                             "cache_salt": "tenant-b"})
    assert r.status_code == 200
    m = _metrics(client)["shared"]
    assert m["prefix_hit_tokens_total"] == 1024
    assert m["prompt_tokens_total"] == 1100 + (1100 - 1024) + 1100


def test_metrics_pools_match_the_allocator(served):
    client, engine, _ = served
    text = client.get("/metrics").text
    for name in ('vllm:num_requests_running{engine="0",model_name="tiny"}',
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "hsl:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_hits_total",
                 'hsl:pool_units_free{model_name="tiny",pool="shared"}',
                 'hsl:pool_usage_perc{model_name="tiny",pool="shared"}'):
        assert name in text
    rows = _metrics(client)
    totals = engine.mem.total_units()
    assert {p: r["units_total"] for p, r in rows.items()} == totals
    for row in rows.values():
        assert row["units_used"] + row["units_cached"] + row["units_free"] == row["units_total"]


@pytest.mark.parametrize("served", ["D0"], indirect=True)
def test_metrics_per_pool_under_d0(served):
    client, engine, _ = served
    client.post("/v1/completions", json={"prompt": list(range(1, 600)), "max_tokens": 4})
    rows = _metrics(client)
    assert set(rows) == {"attention", "recurrent"}
    assert rows["attention"]["units_cached"] > 0  # the finished prompt's blocks stay cached
    for pool, row in rows.items():
        assert row["units_total"] == engine.mem.total_units()[pool]


def test_abort_on_shutdown_ends_open_streams(served):
    """begin_shutdown('abort') stops the engine: an open request ends with 'abort', and
    new requests get 503."""
    client, engine, runtime = served
    results = {}

    def long_request():
        results["r"] = client.post("/v1/completions",
                                   json={"prompt": [1, 2, 3], "max_tokens": 5000})

    t = threading.Thread(target=long_request)
    t.start()
    while runtime.snapshot()["generation_tokens_total"] < 5:
        time.sleep(0.001)
    runtime.begin_shutdown("abort")
    t.join(30)
    assert results["r"].status_code == 503 and "abort" in results["r"].json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 503
    res = engine.result()
    assert res.tables["trace"]["event"][-1] == "END"
    assert res.tables["requests"]["status"] == ["unfinished"]


# ----- API parity with vLLM's server (issue 24) ----------------------------------------------
def test_models_lists_the_served_model(served):
    client, engine, runtime = served
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == "tiny" and model["object"] == "model"
    assert model["max_model_len"] == engine.geometry.max_model_len


def _is_openai_error(r, code):
    err = r.json()["error"]
    return (r.status_code == code and err["code"] == code and isinstance(err["message"], str)
            and "type" in err and "param" in err)


def test_unknown_model_is_404_and_the_served_name_is_accepted(served):
    client, engine, _ = served
    r = client.post("/v1/completions", json={"model": "gpt-9", "prompt": [1, 2], "max_tokens": 2})
    assert _is_openai_error(r, 404) and "gpt-9" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    assert engine.requests == []  # nothing was submitted
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_unknown_route_and_method_get_openai_error_bodies(served):
    client, _, _ = served
    assert _is_openai_error(client.get("/v1/nothing"), 404)
    assert _is_openai_error(client.get("/v1/completions"), 405)
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 0})
    assert _is_openai_error(r, 400)


def _samples(text, name):
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def test_latency_histograms_and_vllm_names_with_model_label(served):
    client, engine, _ = served
    for n in (3, 6):
        r = client.post("/v1/completions", json={"prompt": list(range(1, 30)), "max_tokens": n})
        assert r.status_code == 200
    _metrics(client)
    text = client.get("/metrics").text
    vllm_labels = {"model_name": "tiny", "engine": "0"}

    def count(name):
        (s,) = _samples(text, f"vllm:{name}_count")
        assert s.labels == vllm_labels
        return s.value

    def value(name, **labels):
        (s,) = [s for s in _samples(text, name) if all(s.labels[k] == v
                                                       for k, v in labels.items())]
        return s.value

    assert count("time_to_first_token_seconds") == 2  # one per request
    assert count("inter_token_latency_seconds") == (3 - 1) + (6 - 1)  # one per later token
    for name in ("e2e_request_latency_seconds", "request_time_per_output_token_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_params_n",
                 "request_max_num_generation_tokens", "request_num_preemptions",
                 "request_prefill_kv_computed_tokens"):
        assert count(name) == 2, name  # one per finished request
    assert value("vllm:request_generation_tokens_sum") == 3 + 6
    assert value("vllm:request_prompt_tokens_sum") == 2 * 29
    assert value("vllm:request_params_max_tokens_sum") == 3 + 6
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:request_success_total", finished_reason="stop") == 0
    # every engine step's tokens: prompt tokens computed + tokens generated
    assert value("vllm:iteration_tokens_total_sum") == \
        engine.sched.prompt_tokens_total + engine.sched.generation_tokens_total
    assert count("iteration_tokens_total") == engine.sched.step
    buckets = _samples(text, "vllm:e2e_request_latency_seconds_bucket")
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 2
    (queries,) = _samples(text, "vllm:prefix_cache_queries_total")
    (hits,) = _samples(text, "vllm:prefix_cache_hits_total")
    assert queries.value == 2 * 29 and queries.labels == vllm_labels
    assert hits.value == engine.sched.prefix_hit_tokens_total
    assert value("vllm:prompt_tokens_total") == 2 * 29
    assert value("vllm:prompt_tokens_by_source_total", source="local_compute") == \
        2 * 29 - hits.value
    (usage,) = _samples(text, "vllm:kv_cache_usage_perc")
    used = sum(u[0] for u in engine.mem.usage().values())
    total = sum(u[3] for u in engine.mem.usage().values())
    assert usage.value == pytest.approx(used / total)
    for s in _samples(text, "hsl:pool_units_total"):
        assert s.labels == {"model_name": "tiny", "pool": "shared"}


def test_drain_answers_503_while_in_flight_requests_finish(served):
    client, engine, runtime = served
    results = {}

    def long_request():
        results["r"] = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 300})

    t = threading.Thread(target=long_request)
    t.start()
    while runtime.snapshot()["generation_tokens_total"] < 2:
        time.sleep(0.001)
    runtime.begin_shutdown("finish")
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert _is_openai_error(r, 503)
    t.join(60)
    assert results["r"].status_code == 200  # the in-flight request was served to the end
    assert len(results["r"].json()["choices"][0]["token_ids"]) == 300
    assert runtime.wait_drained(10)


def test_client_disconnect_aborts_the_request_and_frees_its_state():
    """A real socket: the client reads two streamed tokens and hangs up; the server aborts
    the request and its units are free within two engine steps."""
    import http.client
    import socket

    import uvicorn

    from serving_core.geometry import load_geometry

    # Paced steps (each sleeps its modelled time): 5,000 tokens take far longer than the
    # disconnect needs to reach the server, however fast or slow the machine is.
    engine = _engine(load_geometry("falcon_h1_tiny"), "S2", kind="paced")
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len)
    app = create_app(runtime, model_name="tiny", vocab_size=VOCAB)
    aborted_at = []
    original_abort = runtime.abort

    def abort(rid):
        aborted_at.append(engine.sched.step)
        return original_abort(rid)

    runtime.abort = abort
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        conn = http.client.HTTPConnection(*sock.getsockname()[:2], timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": list(range(1, 600)), "max_tokens": 5000, "stream": True}),
            {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 2:
            if resp.readline().startswith(b"data: "):
                seen += 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 30
        while not (aborted_at and engine.requests[0].status.name == "FINISHED"):
            assert time.time() < deadline, "the request was not aborted"
            time.sleep(0.01)
        time.sleep(0.2)
        req = engine.requests[0]
        assert req.num_generated < 5000
        assert engine.sched.step - aborted_at[0] <= 2  # finished within a step or two
        assert not engine.sched.running and not engine.sched.waiting
        assert all(u[0] == 0 for u in engine.mem.usage().values())  # no unit held
        assert runtime.snapshot()["requests_aborted"] == 1
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
