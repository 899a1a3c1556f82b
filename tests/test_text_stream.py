"""Incremental decoding (serving_core/server/text.py): a character split across tokens is
emitted once complete, stop strings are held back and cut; and through the server, a
stream whose tokens split a character has one chunk per token and no U+FFFD."""

from __future__ import annotations

import json

import pytest
import quicktok
from fastapi.testclient import TestClient

from serving_core.executor.base import ExecutorOutput
from serving_core.server.text import Detokenizer, TextStream

ENC = quicktok.get_encoding("llama3")
BYTE_ID = {ENC.decode_single_token_bytes(i): i for i in range(ENC.n_vocab - 256)}
EURO = [BYTE_ID[bytes([b])] for b in "€".encode()]  # three single-byte tokens
A, B = BYTE_ID[b"a"], BYTE_ID[b"b"]


def test_split_character_is_emitted_once_complete():
    stream = TextStream(Detokenizer(ENC))
    assert [stream.add(t) for t in [A, *EURO, B]] == ["a", "", "", "€", "b"]
    assert stream.finish() == ""
    # decoding each token alone (the old stream) turned every byte into U+FFFD
    assert [ENC.decode([t]) for t in EURO] != ["", "", "€"]
    assert "\ufffd" in "".join(Detokenizer(ENC).decode([t]) for t in EURO)


def test_incomplete_character_at_the_end_and_special_tokens():
    text = Detokenizer(ENC)
    stream = TextStream(text)
    assert [stream.add(t) for t in EURO[:2]] == ["", ""]
    assert stream.finish() == "\ufffd"  # bytes that never completed a character
    eot = ENC.encode_single_token("<|eot_id|>")
    assert TextStream(text).add(eot) == ""  # skip_special_tokens (vLLM's default)
    assert TextStream(text, skip_special=False).add(eot) == "<|eot_id|>"


def test_stop_strings_are_held_back_and_cut():
    ids = ENC.encode("one two three four")
    stream = TextStream(Detokenizer(ENC), stop=("thr",))
    out = [stream.add(t) for t in ids]
    assert "".join(out) + stream.finish() == "one two "
    assert stream.stop_hit == "thr"
    # held back: the text before the stop came out only once it could not begin "thr"
    assert "".join(out) == "one two "
    kept = TextStream(Detokenizer(ENC), stop=("thr",), include_stop=True)
    assert "".join(kept.add(t) for t in ids) + kept.finish() == "one two thr"
    early = TextStream(Detokenizer(ENC), stop=("one",), min_tokens=len(ids))
    assert "".join(early.add(t) for t in ids) + early.finish() == "one two three four"


@pytest.fixture()
def scripted_client():
    """A server whose engine generates SCRIPT (the simulated step model on a wall clock,
    the tokens given)."""
    from engines import simulated_engine

    from serving_core.executor.modelled import SimulatedExecutor
    from serving_core.executor.profiles import load_device_profile
    from serving_core.executor.simulated import StepTimeModel
    from serving_core.geometry import load_geometry
    from serving_core.planner import plan_budget, units_for
    from serving_core.scheduler import SchedulerConfig
    from serving_core.server.app import create_app
    from serving_core.server.runtime import EngineRuntime

    script = [A, *EURO, B, *EURO]

    class Scripted(SimulatedExecutor):
        def execute(self, plan, checkpoint_writes=0):
            out = super().execute(plan, checkpoint_writes)
            sampled = {it.req.rid: script[it.req.num_generated % len(script)] for it in plan
                       if it.context + it.num_new == it.req.num_tokens}
            return ExecutorOutput(out.duration_s, sampled)

    geometry = load_geometry("falcon_h1_tiny")
    model = StepTimeModel(geometry, load_device_profile("a100"), "S2", 0.0)
    engine = simulated_engine(geometry, "S2", units_for(plan_budget(geometry, "b63"), "S2"),
                              SchedulerConfig(cap=8, max_num_batched_tokens=2048, headroom=0.0),
                              model, clock="wall", budget="b63")
    engine.executor = Scripted(model)  # the same step model, the scripted tokens
    runtime = EngineRuntime(engine, max_model_len=geometry.max_model_len)
    app = create_app(runtime, model_name="tiny", vocab_size=128_256, tokenizer=ENC)
    with TestClient(app) as client:
        yield client, script


def test_stream_of_split_characters_has_one_chunk_per_token(scripted_client):
    client, script = scripted_client
    n = len(script)
    chunks = []
    with client.stream("POST", "/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": n, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) == n  # one chunk per token, the last with the finish reason
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in script]
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "", "", "€", "b", "", "", "€"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (n - 1) + ["length"]
    whole = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": n})
    assert whole.json()["choices"][0]["text"] == "a€b€"
