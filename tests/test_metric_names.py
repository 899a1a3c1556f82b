"""Our /metrics against vLLM 0.32's (tests/data/vllm_0_32_metrics.json, scraped from its
server): every vLLM metric both servers can compute has vLLM's name, type, label names,
label values and histogram buckets; no other vllm: name is invented; what only we have is
under hsl:."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serving_core.server.app import create_app
from serving_core.server.metrics import cache_config_labels
from serving_core.server.runtime import EngineRuntime

REFERENCE = json.loads((Path(__file__).parent / "data" / "vllm_0_32_metrics.json").read_text())
# vLLM's metrics we cannot compute: multimodal cache, and vLLM's analytic FLOP/byte counts
NOT_OURS = {"vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:estimated_flops_per_gpu",
            "vllm:estimated_read_bytes_per_gpu", "vllm:estimated_write_bytes_per_gpu"}
# the names the issue found missing, and the per-token histogram vLLM 0.32 renamed
MUST_HAVE = {"vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
             "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
             "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
             "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
             "vllm:iteration_tokens_total", "vllm:request_success", "vllm:cache_config_info"}


def _families(text):
    out = {}
    for fam in text_string_to_metric_families(text):
        labels, values, buckets = set(), {}, []
        for s in fam.samples:
            labels |= {k for k in s.labels if k != "le"}
            for k in ("reason", "source", "finished_reason", "sleep_state"):
                if k in s.labels and s.labels[k] not in values.setdefault(k, []):
                    values[k].append(s.labels[k])
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
                buckets.append(float(s.labels["le"]))
        out[fam.name] = {"type": fam.type, "labels": sorted(labels),
                         "buckets": buckets, "label_values": values}
    return out


def test_metric_names_types_labels_and_buckets_match_vllm_0_32():
    from test_server import _engine

    from serving_core.geometry import load_geometry

    engine = _engine(load_geometry("falcon_h1_tiny"), "S2")
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len)
    app = create_app(runtime, model_name="falcon_h1_tiny", vocab_size=128_256,
                     cache_info=cache_config_labels(engine))
    with TestClient(app) as client:
        assert client.post("/v1/completions", json={"prompt": [1, 2, 3],
                                                    "max_tokens": 3}).status_code == 200
        ours = _families(client.get("/metrics").text)
    reference = REFERENCE["metrics"]
    assert len(reference) == 39
    want = set(reference) - NOT_OURS
    have = {name for name in ours if name.startswith("vllm:")}
    assert have == want, (sorted(want - have), sorted(have - want))
    assert MUST_HAVE <= have
    assert "vllm:time_per_output_token_seconds" not in ours  # the name vLLM 0.32 dropped
    for name in sorted(want - {"vllm:cache_config_info"}):
        ref, got = reference[name], ours[name]
        assert got["type"] == ref["type"], name
        assert got["labels"] == ref["labels"], name
        assert got["buckets"] == ref.get("buckets", []), name
        assert got["label_values"] == ref.get("label_values", {}), name
    info = ours["vllm:cache_config_info"]
    assert {"engine", "block_size", "num_gpu_blocks", "enable_prefix_caching"} <= \
        set(info["labels"])
    assert set(info["labels"]) - {"organization"} <= set(reference["vllm:cache_config_info"]
                                                        ["labels"])
    # ours, under our prefix, with the model label
    for name in ("hsl:pool_units_used", "hsl:requests_by_path", "hsl:prompt_tokens",
                 "hsl:engine_steps", "hsl:engine_clock_seconds"):
        assert name in ours and "model_name" in ours[name]["labels"], name
    assert not {n for n in ours if n.startswith("hsl:")} & {
        "hsl:" + n.removeprefix("vllm:") for n in have if n != "vllm:prompt_tokens"}
