"""The OpenAI sampling surface on the real executor (FastAPI TestClient over the tiny torch
model with the llama3 tokenizer): each accepted field's effect, seeded sampling repeatable
and seed-dependent, n and batch prompts, stop tokens and strings, EOS, echo, logprobs,
streams with one chunk per token, chat completions and /tokenize, /detokenize."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.geometry import load_geometry
from serving_core.server.app import create_app
from serving_core.server.chat import render_chat
from serving_core.server.runtime import EngineRuntime

PROMPT = [(37 * i) % 9000 + 11 for i in range(40)]
EOS = 2  # the tiny checkpoint's eos_token_id


ENGINE_CORE = os.environ.get("HSL_ENGINE_CORE", "thread")  # process: the engine core process


def served_runtime(tiny_model, tiny_checkpoint, engine_core: str):
    """(runtime, vocab size): the tiny model's S2 engine in this process (`thread`) or in an
    engine core process of its own built from the checkpoint (`process`)."""
    spec = loaded_model_spec(tiny_model, load_geometry("falcon_h1_tiny"), "S2", "b63",
                             {"cap": 8, "max_num_batched_tokens": 2048}, clock="wall")
    if engine_core == "process":
        from serving_core.server.engine_client import EngineCoreClient

        spec = replace(spec, executor=replace(spec.executor, checkpoint=str(tiny_checkpoint)))
        runtime = EngineCoreClient({"spec": spec.to_json(), "threads": 1})
        return runtime, runtime.vocab_size
    engine = build_engine(spec, model=tiny_model)
    return EngineRuntime(engine, max_model_len=engine.geometry.max_model_len), engine.vocab_size


@pytest.fixture(scope="module")
def client(tiny_model, tiny_checkpoint):
    import quicktok

    runtime, vocab_size = served_runtime(tiny_model, tiny_checkpoint, ENGINE_CORE)
    app = create_app(runtime, model_name="tiny", vocab_size=vocab_size,
                     tokenizer=quicktok.get_encoding("llama3"), eos_token_ids=[EOS])
    with TestClient(app) as c:
        yield c


def _post(client, body, path="/v1/completions"):
    r = client.post(path, json={"prompt": PROMPT, **body} if "messages" not in body else body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(client, **body):
    return _post(client, body)["choices"][0]["token_ids"]


def _stream(client, body, path="/v1/completions"):
    chunks = []
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


@pytest.fixture(scope="module")
def greedy(client):
    """The greedy tokens and text of PROMPT (24 tokens, EOS ignored)."""
    body = _post(client, {"max_tokens": 24, "temperature": 0, "ignore_eos": True})
    choice = body["choices"][0]
    return choice["token_ids"], choice["text"]


def test_greedy_paths_agree_and_logprobs_mark_the_argmax(client, greedy):
    ids, _ = greedy
    assert len(ids) == 24
    # logprobs take the sampler's full path (float32 row, raw log_softmax): the same tokens
    body = _post(client, {"max_tokens": 24, "temperature": 0, "ignore_eos": True,
                          "logprobs": 3})
    choice = body["choices"][0]
    assert choice["token_ids"] == ids
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 24
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert chosen <= 0 and len(top) <= 4 and chosen == max(top.values())
    assert lp["text_offset"][0] == 0
    assert all(b >= a for a, b in zip(lp["text_offset"], lp["text_offset"][1:], strict=False))


@pytest.mark.slow
def test_the_other_engine_core_serves_the_same_bits(client, tiny_model, tiny_checkpoint):
    """Thread and process engine cores (whichever the module's client is not): the same
    greedy tokens, logprobs and seeded samples, streamed and whole, bit for bit. One HTTP
    request at a time: the choices of one enter the engine together in either core
    (`admitting`), but which step admits each of several requests sent at once depends on
    timing, and a different batch may round a logprob differently."""
    import quicktok

    other = "thread" if ENGINE_CORE == "process" else "process"
    runtime, vocab_size = served_runtime(tiny_model, tiny_checkpoint, other)
    app = create_app(runtime, model_name="tiny", vocab_size=vocab_size,
                     tokenizer=quicktok.get_encoding("llama3"), eos_token_ids=[EOS])
    bodies = [{"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
               "logprobs": 3, "n": 2},
              {"prompt": PROMPT[:25], "max_tokens": 12, "temperature": 0.9, "seed": 7},
              {"prompt": PROMPT[5:], "max_tokens": 8, "temperature": 0, "stream": True,
               "ignore_eos": True}]
    def chunks(c, body):  # a chunk's id and time differ from server to server
        return [{k: v for k, v in chunk.items() if k not in ("id", "created")}
                for chunk in _stream(c, body)]

    with TestClient(app) as theirs:
        for body in bodies:
            if body.get("stream"):
                assert chunks(theirs, body) == chunks(client, body)
            else:
                assert _post(theirs, body)["choices"] == _post(client, body)["choices"]


def test_seeded_sampling_repeats_and_depends_on_the_seed(client, greedy):
    base = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.5, "top_k": 500}
    a = _ids(client, **base, seed=7)
    assert a == _ids(client, **base, seed=7)
    b = _ids(client, **base, seed=8)
    assert a != b and a != greedy[0]
    # n = 2: choice i samples with seed + i (vLLM's parallel sampling)
    two = _post(client, {**base, "seed": 7, "n": 2})
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert [c["token_ids"] for c in two["choices"]] == [a, b]
    assert two["usage"]["prompt_tokens"] == len(PROMPT)
    assert two["usage"]["completion_tokens"] == 48
    # unseeded: a fresh seed per request
    assert _ids(client, **base) != _ids(client, **base)


def test_batch_prompts_are_choices_in_order(client, greedy):
    other = PROMPT[:20]
    body = _post(client, {"prompt": [PROMPT, other], "max_tokens": 5, "temperature": 0,
                          "ignore_eos": True, "n": 2})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    ids = [c["token_ids"] for c in body["choices"]]
    assert ids[0] == ids[1] == greedy[0][:5]  # greedy: n identical choices
    assert ids[2] == ids[3] == _ids(client, prompt=other, max_tokens=5, temperature=0,
                                    ignore_eos=True)
    assert body["usage"]["prompt_tokens"] == len(PROMPT) + len(other)


def test_stop_tokens_eos_and_min_tokens(client, greedy):
    ids, _ = greedy
    k = next(i for i in range(3, 24) if ids[i] not in ids[:i])  # a first occurrence
    stop = ids[k]
    choice = _post(client, {"max_tokens": 24, "temperature": 0, "ignore_eos": True,
                            "stop_token_ids": [stop]})["choices"][0]
    assert choice["token_ids"] == ids[: k + 1]  # the stop token is the last one
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    # min_tokens masks the stop token until it is reached: the first tokens change
    choice = _post(client, {"max_tokens": 8, "temperature": 0, "ignore_eos": True,
                            "stop_token_ids": [ids[0]], "min_tokens": 3})["choices"][0]
    assert choice["token_ids"][0] != ids[0] and len(choice["token_ids"]) >= 3
    # EOS ends a request unless ignore_eos: force it with a logit bias
    choice = _post(client, {"max_tokens": 10, "temperature": 0,
                            "logit_bias": {str(EOS): 100}})["choices"][0]
    assert choice["token_ids"] == [EOS] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None  # EOS, not a stop_token_ids entry
    choice = _post(client, {"max_tokens": 10, "temperature": 0, "ignore_eos": True,
                            "logit_bias": {str(EOS): 100}})["choices"][0]
    assert choice["token_ids"] == [EOS] * 10 and choice["finish_reason"] == "length"


def test_allowed_ids_and_penalties_reach_the_sampler(client, greedy):
    allowed = [101, 202, 303]
    ids = _ids(client, max_tokens=12, temperature=0, ignore_eos=True,
               allowed_token_ids=allowed)
    assert set(ids) <= set(allowed)
    # two allowed tokens under the largest frequency and presence penalties: each use costs
    # its token 2 (frequency) + 2 once (presence), so after a few tokens the counts of the
    # two stay within a logit gap's worth of each other (the tiny model's gaps are < 8)
    rep = _ids(client, max_tokens=12, temperature=0, ignore_eos=True,
               allowed_token_ids=[101, 202], frequency_penalty=2.0, presence_penalty=2.0)
    assert set(rep) == {101, 202} and abs(rep.count(101) - rep.count(202)) <= 4, rep


def test_stop_strings_truncate_the_text(client, greedy):
    ids, text = greedy
    pos = len(text) // 2
    stop = text[pos: pos + 2]
    cut = text.index(stop)
    choice = _post(client, {"max_tokens": 24, "temperature": 0, "ignore_eos": True,
                            "stop": stop})["choices"][0]
    assert choice["text"] == text[:cut]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["token_ids"] == ids[: len(choice["token_ids"])]
    kept = _post(client, {"max_tokens": 24, "temperature": 0, "ignore_eos": True,
                          "stop": [stop, "\u2603never"], "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == text[: cut + len(stop)]
    # streamed: the same text, one chunk per token up to the stop
    chunks = _stream(client, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                              "ignore_eos": True, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == len(chunks)


def test_stream_counts_right_with_continuous_usage(client, greedy):
    ids, text = greedy
    chunks = _stream(client, {"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                              "ignore_eos": True, "stream": True, "logprobs": 1,
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}})
    tokens, usage_chunk = chunks[:-1], chunks[-1]
    assert len(tokens) == 24  # one chunk per token, none empty at the end
    assert [t for c in tokens for t in c["choices"][0]["token_ids"]] == ids
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 23 + ["length"]
    assert "".join(c["choices"][0]["text"] for c in tokens) == text
    assert [c["usage"]["completion_tokens"] for c in tokens] == list(range(1, 25))
    assert all(len(c["choices"][0]["logprobs"]["tokens"]) == 1 for c in tokens)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24


def test_echo_prepends_the_prompt(client, greedy):
    import quicktok

    enc = quicktok.get_encoding("llama3")
    prompt_text = enc.decode(PROMPT)
    choice = _post(client, {"max_tokens": 4, "temperature": 0, "ignore_eos": True,
                            "echo": True})["choices"][0]
    assert choice["text"].startswith(prompt_text)
    only = _post(client, {"max_tokens": 0, "echo": True})["choices"][0]
    assert only["text"] == prompt_text and only["token_ids"] == []


def test_text_prompt_gets_bos_and_refusals_name_their_field(client):
    body = _post(client, {"prompt": "Hello world", "max_tokens": 2, "temperature": 0})
    assert body["usage"]["prompt_tokens"] == 3  # <|begin_of_text|> Hello world
    body = _post(client, {"prompt": "Hello world", "max_tokens": 2, "temperature": 0,
                          "add_special_tokens": False})
    assert body["usage"]["prompt_tokens"] == 2
    for field, value in (("suffix", "x"), ("use_beam_search", True), ("prompt_logprobs", 1),
                         ("response_format", {"type": "json_object"}), ("priority", 3),
                         ("stream_interval", 4), ("bad_words", ["x"])):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                 field: value})
        assert r.status_code == 400, field
        assert r.json()["error"]["param"] == field
    # accepted at their defaults, and the no-op fields with any value
    ok = client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2, "suffix": None, "use_beam_search": False,
        "prompt_logprobs": None, "response_format": {"type": "text"}, "priority": 0,
        "user": "u-1", "request_id": "r-9", "return_token_ids": True, "stop": None,
        "logprobs": None, "best_of": 1, "stream_options": None, "length_penalty": 1.0,
        "spaces_between_special_tokens": False, "skip_special_tokens": True})
    assert ok.status_code == 200, ok.text


def test_chat_completions_whole_and_streamed(client):
    import quicktok

    enc = quicktok.get_encoding("llama3")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": " Hi there "}]}]
    rendered = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert render_chat(messages) == rendered
    want = enc.encode_with_special(rendered)
    tok = client.post("/tokenize", json={"messages": messages}).json()
    assert tok["tokens"] == want and tok["count"] == len(want)
    back = client.post("/detokenize", json={"tokens": want}).json()
    assert back["prompt"] == rendered
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    whole = _post(client, body, "/v1/chat/completions")
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    choice = whole["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert whole["usage"]["prompt_tokens"] == len(want)
    assert choice["token_ids"] == _ids(client, prompt=want, max_tokens=6, temperature=0,
                                       ignore_eos=True)
    chunks = _stream(client, {**body, "stream": True, "stream_options": {"include_usage": True}},
                     "/v1/chat/completions")
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert len(deltas) == 6 and deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == choice["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "robot"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_truncations_that_leave_one_token_are_greedy(client, greedy):
    """top_k 1, a tiny top_p and min_p 1 each keep only the most likely token: sampling at
    any temperature then gives the greedy tokens (each rule reaches the engine's sampler)."""
    ids, _ = greedy
    for rule in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert _ids(client, max_tokens=24, ignore_eos=True, temperature=1.7, seed=3,
                    **rule) == ids, rule


def test_prompt_and_format_fields(client, greedy):
    ids, _ = greedy
    # truncate_prompt_tokens keeps the last k prompt tokens (truncation_side left)
    cut = _post(client, {"prompt": [999, 998, *PROMPT], "truncate_prompt_tokens": len(PROMPT),
                         "max_tokens": 24, "temperature": 0, "ignore_eos": True})
    assert cut["usage"]["prompt_tokens"] == len(PROMPT)
    assert cut["choices"][0]["token_ids"] == ids
    lp = _post(client, {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 1,
                        "return_tokens_as_token_ids": True})["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids[:3]]
    messages = [{"role": "user", "content": "Hi"}]
    chat = _post(client, {"messages": messages, "max_completion_tokens": 3, "max_tokens": 9,
                          "temperature": 0, "ignore_eos": True}, "/v1/chat/completions")
    assert chat["usage"]["completion_tokens"] == 3  # max_completion_tokens wins, as OpenAI's
    bare = _post(client, {"messages": messages, "max_tokens": 1, "temperature": 0,
                          "add_generation_prompt": False}, "/v1/chat/completions")
    assert bare["usage"]["prompt_tokens"] == len(
        client.post("/tokenize", json={"messages": messages,
                                       "add_generation_prompt": False}).json()["tokens"])
    assert bare["usage"]["prompt_tokens"] < chat["usage"]["prompt_tokens"]


def _success(client) -> dict[str, float]:
    """vllm:request_success_total by finished_reason."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_stop_string_on_the_last_allowed_token_is_counted_as_stop(client):
    """The reported repro: the stop string "\\n" completes on the 12th and last allowed
    token, so the engine ends the request at its length; the response says stop, and
    vllm:request_success counts stop, as the response reports."""
    from conftest import wait_until

    def stable():  # the last snapshot counts every request answered so far
        first = _success(client)
        time.sleep(0.3)
        return first if first == _success(client) else None

    body = {"prompt": "The quick brown fox", "seed": 1234, "stop": ["\n"], "max_tokens": 12}
    before = wait_until(stable, what="steady counters")
    free = _post(client, {**body, "stop": None})["choices"][0]
    assert len(free["token_ids"]) == 12 and "\n" in free["text"]  # the repro holds
    choice = _post(client, body)["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "\n")
    assert len(choice["token_ids"]) == 12

    def counted():
        now = _success(client)
        return now if sum(now.values()) == sum(before.values()) + 2 else None

    after = wait_until(counted, what="both requests' counts")
    assert after["stop"] == before["stop"] + 1 and after["length"] == before["length"] + 1


def _reference_prompt_logprobs(checkpoint, prompt, k):
    """transformers' FalconH1ForCausalLM on the whole prompt: each token's logprob given
    the ones before it, and the top k token ids there."""
    import os

    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FalconH1ForCausalLM

    net = FalconH1ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        lsm = net(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    lps = [float(lsm[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    tops = [torch.topk(lsm[i - 1], k).indices.tolist() for i in range(1, len(prompt))]
    return lps, tops


@pytest.mark.parametrize("length", [40, 530])  # 530: the prefill crosses S2's 512
def test_echo_with_logprobs_scores_the_prompt_as_transformers(client, tiny_checkpoint,
                                                              length):
    """lm-eval's loglikelihood request (echo, max_tokens 0 or 1, logprobs k): the prompt's
    tokens with their logprobs from the prefill (the first None), equal to an independent
    reference, whether or not the prompt's prefix is cached (a second request reads no
    cached prefix), whole and streamed."""
    prompt = [(37 * i) % 9000 + 11 for i in range(length)]
    ref_lps, ref_tops = _reference_prompt_logprobs(str(tiny_checkpoint), prompt, 2)
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "temperature": 0}
    for _ in range(2):  # the second: the prompt's prefix is in the cache
        choice = _post(client, {**body, "max_tokens": 0})["choices"][0]
        lp = choice["logprobs"]
        assert choice["token_ids"] == [] and len(lp["tokens"]) == length
        assert choice["text"] == _post(client, {"prompt": prompt, "echo": True,
                                                "max_tokens": 0})["choices"][0]["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(ref_lps, abs=2e-4)
        enc_ids = [[int(t.removeprefix("token_id:")) for t in top] for top in
                   _post(client, {**body, "max_tokens": 0, "return_tokens_as_token_ids": True}
                         )["choices"][0]["logprobs"]["top_logprobs"][1:]]
        for i, (got, want) in enumerate(zip(enc_ids, ref_tops, strict=True)):
            assert set(want) <= set(got) | {prompt[i + 1]}, i
    one = _post(client, {**body, "max_tokens": 1})["choices"][0]
    assert len(one["token_ids"]) == 1 and len(one["logprobs"]["tokens"]) == length + 1
    assert one["logprobs"]["token_logprobs"][1:length] == pytest.approx(ref_lps, abs=2e-4)
    assert one["text"].startswith(choice["text"]) and len(one["text"]) > len(choice["text"])
    chunks = _stream(client, {**body, "max_tokens": 1, "stream": True})
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) == length + 1
    assert first["token_logprobs"][1:length] == pytest.approx(ref_lps, abs=2e-4)
    assert first["text_offset"][0] == 0
    assert chunks[0]["choices"][0]["text"] == one["text"]
