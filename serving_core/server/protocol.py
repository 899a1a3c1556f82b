"""The OpenAI-compatible completions request: parsing with one clear message per error,
and the response bodies (whole and streamed as server-sent events)."""

from __future__ import annotations

import json
import numbers
import time
from dataclasses import dataclass

ALLOWED_FIELDS = ("model", "prompt", "max_tokens", "ignore_eos", "stream", "stream_options",
                  "cache_salt", "temperature", "n")
DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 and this message."""


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str


def _int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise BadRequest(f"{name}={value!r}: expected an integer >= {low}")
    return int(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name}={value!r}: expected true or false")
    return value


def parse_completion(body, vocab_size: int, tokenize) -> CompletionRequest:
    """Check a decoded JSON body; `tokenize(text)` turns a text prompt into token ids."""
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    unknown = sorted(set(body) - set(ALLOWED_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields {unknown}; allowed fields are {list(ALLOWED_FIELDS)}")
    if "prompt" not in body:
        raise BadRequest("prompt: required (text or a list of token ids)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = list(tokenize(prompt))
    elif isinstance(prompt, list) and all(
        isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
    ):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"prompt: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    else:
        raise BadRequest("prompt: expected text or a list of integer token ids")
    if not ids:
        raise BadRequest("prompt: must have at least one token")
    max_tokens = _int(body.get("max_tokens", DEFAULT_MAX_TOKENS), "max_tokens", 1)
    if not _bool(body, "ignore_eos", True):
        raise BadRequest("ignore_eos=false: not supported; the engine generates exactly "
                         "max_tokens tokens (allowed values: true)")
    temperature = body.get("temperature", 0)
    if temperature not in (0, None) or isinstance(temperature, bool):
        raise BadRequest(f"temperature={temperature!r}: decoding is greedy (allowed values: 0)")
    if body.get("n", 1) != 1 or isinstance(body.get("n", 1), bool):
        raise BadRequest(f"n={body.get('n')!r}: allowed values are 1")
    salt = body.get("cache_salt", "")
    if salt is None:
        salt = ""
    if not isinstance(salt, str):
        raise BadRequest(f"cache_salt={salt!r}: expected a string")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(f"stream_options={options!r}: allowed fields are ['include_usage']")
    return CompletionRequest(ids, max_tokens, _bool(body, "stream", False),
                             bool(options.get("include_usage", False)), salt)


def completion_id(rid: int) -> str:
    return f"cmpl-{rid}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: int, model: str, text: str, token_ids: list[int],
                    finish_reason: str, prompt_tokens: int) -> dict:
    return {
        "id": completion_id(rid),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, len(token_ids)),
    }


def sse_chunk(rid: int, model: str, text: str, token_ids: list[int],
              finish_reason: str | None, usage_body: dict | None = None) -> str:
    body = {
        "id": completion_id(rid),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [] if usage_body is not None else [
            {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None,
             "finish_reason": finish_reason}
        ],
    }
    if usage_body is not None:
        body["usage"] = usage_body
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
