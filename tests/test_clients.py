"""Third-party clients against our server as `make serve` starts it (the tiny Falcon-H1 on
the torch executor, S2, the llama3 tokenizer): the openai SDK (a dev dependency) and vLLM's
own benchmark client (its `vllm bench serve` module, run by .venv-vllm's interpreter when
that venv exists; skipped, saying so, otherwise), and aiperf's mooncake_trace replay (where
aiperf is installed: $AIPERF or .venv-aiperf/bin/aiperf). Every request must succeed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.runners.server_process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("HSL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
AIPERF = Path(os.environ.get("AIPERF", ROOT / ".venv-aiperf" / "bin" / "aiperf"))
MODEL = "falcon_h1_tiny"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """`make serve`'s server without its warm-up (about 1 CPU s; it leaves the weights,
    state and seeds untouched, so the clients see the same answers; tests/test_warmup.py)."""
    cmd = [sys.executable, "-m", "experiments.serve", f"model={MODEL}", "executor=torch",
           f"executor.checkpoint={tiny_checkpoint}", "org=s2", "budget=b63", "engine.cap=16",
           "--port", "0", "--exit-with-parent", "--warm-up", "off"]
    with ServerProcess(cmd, health_timeout_s=300) as srv:
        yield srv


def test_openai_sdk_calls_parse(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4,
                                     temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[15339, 1070], max_tokens=4,
                                    temperature=0)
    assert text.usage.completion_tokens == ids.usage.completion_tokens == 4
    assert text.usage.prompt_tokens == 3  # BOS + "Hello" + " there"
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert len([c for c in chunks if c.choices]) == 5  # one chunk per token
    assert chunks[-1].usage.completion_tokens == 5
    full = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    many = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, n=2, temperature=0.7, top_p=0.9, seed=5,
        stop=["\n\n"], logprobs=2, user="tester", presence_penalty=0.1,
        frequency_penalty=0.1, extra_body={"top_k": 50, "repetition_penalty": 1.1,
                                           "min_p": 0.01, "ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in many.choices)
    echo = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, echo=True,
                                     temperature=0)
    assert echo.choices[0].text.startswith("Echo me")
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
    streamed = list(client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == \
        chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, suffix="y")
    assert err.value.body["param"] == "suffix"


def test_openai_sdk_seeded_sampling_repeats_and_differs_across_seeds(server):
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)

    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="The", max_tokens=16, seed=seed,
                                      temperature=1.0, extra_body={"ignore_eos": True})
        return r.choices[0].token_ids  # our extra field (vLLM's return_token_ids)

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


@pytest.mark.skipif(not VLLM_PYTHON.exists(),
                    reason=f"vLLM's benchmark client needs {VLLM_PYTHON} (make setup-vllm "
                           "VLLM_DEVICE=cpu)")
def test_vllm_bench_serve_completes_every_request(server, tiny_checkpoint, tmp_path):
    """vLLM's client, unmodified (bench/vllm_bench_client.py calls its module): random
    dataset, text prompts tokenized with the checkpoint's tokenizer, streamed."""
    n = 8
    cmd = [str(VLLM_PYTHON), str(ROOT / "bench" / "vllm_bench_client.py"), "--backend", "vllm",
           "--base-url", server.base_url, "--model", MODEL, "--tokenizer",
           str(tiny_checkpoint), "--dataset-name", "random", "--random-input-len", "64",
           "--random-output-len", "8", "--num-prompts", str(n), "--disable-tqdm",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == n and result["failed"] == 0, result.get("errors")
    assert result["total_output_tokens"] <= n * 8


def hf_cache_layout(checkpoint: Path, hub: Path, repo: str) -> None:
    """The checkpoint's tokenizer as a snapshot of `repo` in a Hugging Face cache at `hub`:
    aiperf 0.13's decode workers load a tokenizer by repo id from the cache in offline mode
    (a local folder fails there; docs/benchmarks.md)."""
    model = hub / f"models--{repo.replace('/', '--')}"
    (model / "refs").mkdir(parents=True)
    (model / "refs" / "main").write_text("local")
    (model / "snapshots" / "local").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json"):
        shutil.copy(checkpoint / name, model / "snapshots" / "local" / name)


@pytest.mark.slow  # aiperf's services start in about 30 s on two cores; the replay in minutes
@pytest.mark.skipif(not AIPERF.exists(), reason=f"aiperf 0.13 not found at {AIPERF} (set "
                    "$AIPERF or install it into .venv-aiperf)")
def test_aiperf_replays_a_mooncake_trace_window(server, tiny_checkpoint, tmp_path):
    """Five requests of the vendored conversation trace (short prompts, 4 s apart) replayed
    by aiperf's mooncake_trace mode at their timestamps: every request completes, and the
    requests after the first share the trace's first hash block (equal hash ids, equal text
    in aiperf's synthesis), which our server reports as cached prompt tokens (usage)."""
    from experiments.workloads import trace

    lines = trace.TRACES["conversation"].read_text().splitlines()
    rows = [json.loads(lines[i]) for i in (10345, 10346, 10347, 10354, 10355)]
    assert all(r["hash_ids"][0] == 0 and r["input_length"] < 2000 for r in rows)
    window = tmp_path / "window.jsonl"
    window.write_text("".join(json.dumps({**r, "timestamp": 4000 * k}) + "\n"
                              for k, r in enumerate(rows)))
    hf_cache_layout(Path(tiny_checkpoint), tmp_path / "hub", "local/falcon_h1_tiny")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    cmd = [str(AIPERF), "profile", "--model", MODEL, "--url", server.base_url,
           "--endpoint-type", "chat", "--streaming", "--input-file", str(window),
           "--custom-dataset-type", "mooncake_trace", "--fixed-schedule",
           "--tokenizer", "local/falcon_h1_tiny", "--artifact-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-3000:]
    records = [json.loads(x) for x in (tmp_path / "out" / "profile_export.jsonl").open()]
    assert len(records) == 5 and not any("error" in r and r["error"] for r in records)
    cached = [r["metrics"].get("usage_prompt_cache_read_tokens", {}).get("value", 0)
              for r in records]
    assert set(cached) <= {0, 512} and sum(cached) >= 512
