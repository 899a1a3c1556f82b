"""The OpenAI-compatible requests (completions, chat completions): every field of OpenAI's
and vLLM 0.32's request, checked with one clear message naming it, and the response
bodies (whole and streamed as server-sent events).

Each field is in one of three tables. APPLIED fields change what the engine does or what
the response holds. NO_OP fields are accepted with any value of their type and cannot
change anything here (what each means is said next to it). DEFAULT_ONLY fields are
accepted at their default (null, false, empty or the value given) and any other value is
refused with 400, OpenAI's error body and the field in `param`: the feature does not exist
in this engine. A field in no table is refused the same way.

Defaults are vLLM's: temperature 1.0 (OpenAI's), top_p 1, top_k 0 (all), min_p 0, no
penalties, ignore_eos false (the server's EOS ids end a request), max_tokens 16 for
completions and max_model_len - prompt for chat. A request without a seed gets a random
one (vLLM: unseeded); with n > 1, choice i uses seed + i (vLLM's parallel sampling).
"""

from __future__ import annotations

import json
import math
import numbers
import secrets
import time
from dataclasses import dataclass, replace

from serving_core.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

DEFAULT_MAX_TOKENS = 16  # completions (OpenAI, vLLM); chat: up to max_model_len
MAX_N = 64  # choices per request
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range [-100, 100] (vLLM clamps to it)

COMMON_APPLIED = (
    "model", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "allowed_token_ids", "skip_special_tokens", "cache_salt",
    "truncate_prompt_tokens", "truncation_side", "return_tokens_as_token_ids", "echo",
)
COMPLETION_APPLIED = COMMON_APPLIED + ("prompt", "logprobs", "add_special_tokens")
CHAT_APPLIED = COMMON_APPLIED + ("messages", "logprobs", "top_logprobs",
                                 "max_completion_tokens", "add_generation_prompt",
                                 "continue_final_message", "add_special_tokens")
NO_OP = {
    "user": "an end-user id for the caller's own records",
    "request_id": "the response id is the engine's request id (cmpl-N)",
    "session_id": "routing hint for multi-instance deployments; one engine here",
    "return_token_ids": "every choice carries its token_ids already",
    "spaces_between_special_tokens": "byte-level BPE decodes special tokens without spaces",
    "length_penalty": "beam search only (use_beam_search=false)",
    "parallel_tool_calls": "no tools are called",
    "reasoning_effort": "no reasoning parser",
    "include_reasoning": "no reasoning parser",
    "chat_template_kwargs": "the Llama-3 template takes no arguments",
    "documents": "the Llama-3 template has no documents section",
    "media_io_kwargs": "no media inputs",
    "mm_processor_kwargs": "no multimodal processor",
}
# field -> the values accepted (any other is refused)
DEFAULT_ONLY = {
    "suffix": (None,), "best_of": (None, "n"), "use_beam_search": (False, None),
    "watermarking": (False, None), "prompt_logprobs": (None,), "logprob_token_ids": (None,),
    "bad_words": (None, ()), "prompt_embeds": (None,), "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}), "priority": (0, None),
    "return_token_offsets": (False, None), "routed_experts_prompt_start": (0, None),
    "mm_payload": (None,), "return_mm_kwargs": (False, None), "kv_transfer_params": (None,),
    "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
    "thinking_token_budget": (None, -1), "stream_interval": (None, 1), "tools": (None, ()),
    "tool_choice": (None, "none"), "chat_template": (None,), "return_prompt_text": (False, None),
}
UNSUPPORTED_WHY = {
    "suffix": "insertion is not supported", "best_of": "best_of other than n is not supported",
    "use_beam_search": "no beam search", "watermarking": "no watermarking",
    "prompt_logprobs": "use echo=true with logprobs: the prompt's logprobs lead `logprobs`",
    "logprob_token_ids": "use logprobs", "bad_words": "no bad-words filter",
    "prompt_embeds": "token or text prompts only", "structured_outputs": "no guided decoding",
    "response_format": "no guided decoding (allowed: null or {\"type\": \"text\"})",
    "priority": "FCFS admission (allowed: 0)", "return_token_offsets": "not supported",
    "routed_experts_prompt_start": "no experts", "mm_payload": "no multimodal inputs",
    "return_mm_kwargs": "no multimodal inputs", "kv_transfer_params": "no disaggregation",
    "ec_transfer_params": "no disaggregation", "vllm_xargs": "no extensions",
    "repetition_detection": "not supported", "thinking_token_budget": "no reasoning model",
    "stream_interval": "every token is streamed (allowed: 1)", "tools": "no tool calling",
    "tool_choice": "no tool calling", "chat_template": "the server's Llama-3 template only",
    "return_prompt_text": "not supported",
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 and this message; `param` names the
    field and `kind` is the body's type (OpenAI's error body)."""

    def __init__(self, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.kind = kind


@dataclass(frozen=True)
class GenerationRequest:
    """One HTTP request: its prompts, choices per prompt and what each choice asks for."""

    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt (0: echo only, nothing generated)
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str
    sampling: SamplingParams  # seed: the request's (None: drawn per choice)
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special: bool = True
    echo: bool = False
    logprobs: int | None = None
    tokens_as_ids: bool = False
    chat: bool = False
    max_tokens_param: int | None = None
    max_tokens_name: str = "max_tokens"  # the field max_tokens_param came from
    prompt_texts: tuple[str | None, ...] = ()  # a text prompt as sent (echo), else None

    def choice_sampling(self, i: int) -> SamplingParams:
        """Choice i's parameters: seed + i (vLLM), or a fresh random seed."""
        seed = self.sampling.seed
        return self.sampling.with_seed(secrets.randbits(63) if seed is None
                                       else (seed + i) & MAX_SEED)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(value, name: str, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name}={value!r}: expected an integer {span}", name)
    return int(value)


def _float(body: dict, name: str, default: float, low: float | None = None,
           high: float | None = None, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BadRequest(f"{name}={value!r}: expected a number", name)
    value = float(value)
    if (low is not None and (value <= low if low_open else value < low)) or \
            (high is not None and value > high):
        lo = "(" if low_open else "["
        raise BadRequest(f"{name}={value!r}: allowed values are in {lo}{low}, {high}]", name)
    return value


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name}={value!r}: expected true or false", name)
    return value


def _ids(value, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"{name}: expected a list of integer token ids", name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{name}: token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                         name)
    return [int(t) for t in value]


def check_fields(body: dict, applied: tuple[str, ...]) -> None:
    """Refuse a field in no table, and a DEFAULT_ONLY field away from its default."""
    known = set(applied) | set(NO_OP) | set(DEFAULT_ONLY)
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: not a field of OpenAI's or vLLM's "
                         "request", unknown[0])
    for name, allowed in DEFAULT_ONLY.items():
        if name not in body:
            continue
        value = body[name]
        ok = [body.get("n", 1) if a == "n" else a for a in allowed]
        if isinstance(value, list):
            value = tuple(value)
        if value not in ok:
            shown = ", ".join("null" if a is None else json.dumps(a) for a in ok)
            raise BadRequest(f"{name}={body[name]!r}: {UNSUPPORTED_WHY[name]} "
                             f"(allowed: {shown})", name)


def _stop(body: dict, has_text: bool) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop={stop!r}: expected null, a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise BadRequest("stop: a stop string must not be empty", "stop")
    if stop and not has_text:
        raise BadRequest("stop: this server has no tokenizer (stop strings need text); "
                         "use stop_token_ids", "stop")
    return tuple(stop)


def _sampling(body: dict, vocab_size: int, eos_token_ids, max_logprobs: int | None
              ) -> SamplingParams:
    temperature = _float(body, "temperature", 1.0, 0.0)
    top_p = _float(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = body.get("top_k")
    top_k = 0 if top_k is None else _int(top_k, "top_k", -1)
    min_p = _float(body, "min_p", 0.0, 0.0, 1.0)
    presence = _float(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _float(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _float(body, "repetition_penalty", 1.0, 0.0, None, low_open=True)
    seed = body.get("seed")
    if seed is not None:
        seed = _int(seed, "seed", -(2**63), 2**63 - 1)
    bias = body.get("logit_bias")
    pairs: list[tuple[int, float]] = []
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias: expected an object of token id -> bias", "logit_bias")
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise BadRequest(f"logit_bias: key {key!r} is not a token id",
                                 "logit_bias") from None
            if not 0 <= token < vocab_size:
                raise BadRequest(f"logit_bias: token id {token} outside the vocabulary "
                                 f"[0, {vocab_size})", "logit_bias")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise BadRequest(f"logit_bias[{key!r}]={value!r}: expected a number",
                                 "logit_bias")
            pairs.append((token, max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))))
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        allowed = tuple(_ids(allowed, "allowed_token_ids", vocab_size))
        if not allowed:
            raise BadRequest("allowed_token_ids: must not be empty", "allowed_token_ids")
    stop_ids = body.get("stop_token_ids")
    stop_ids = frozenset(_ids(stop_ids, "stop_token_ids", vocab_size)) if stop_ids else frozenset()
    min_tokens = body.get("min_tokens")
    min_tokens = 0 if min_tokens is None else _int(min_tokens, "min_tokens", 0)
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p, seed=seed,
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=tuple(pairs), allowed_token_ids=allowed, logprobs=max_logprobs,
        stop_token_ids=stop_ids, eos_token_ids=frozenset(eos_token_ids),
        ignore_eos=_bool(body, "ignore_eos", False), min_tokens=min_tokens)


def _stream_options(body: dict) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS):
        raise BadRequest(f"stream_options={options!r}: allowed fields are "
                         f"{list(STREAM_OPTIONS)}", "stream_options")
    for key in STREAM_OPTIONS:
        if options.get(key) is not None and not isinstance(options[key], bool):
            raise BadRequest(f"stream_options.{key}={options[key]!r}: expected true or false",
                             "stream_options")
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


def _truncate(ids: list[int], body: dict) -> list[int]:
    k = body.get("truncate_prompt_tokens")
    side = body.get("truncation_side") or "left"
    if side not in ("left", "right"):
        raise BadRequest(f"truncation_side={side!r}: allowed values are left, right",
                         "truncation_side")
    if k is None or k == -1:
        return ids
    k = _int(k, "truncate_prompt_tokens", -1)
    if k == 0 or len(ids) <= k:
        return ids
    return ids[-k:] if side == "left" else ids[:k]


def _prompts(body: dict, vocab_size: int, encode) -> tuple[list[list[int]], list]:
    """The batch of prompts (text, token ids, or a list of either) as token ids, and each
    text prompt as sent (None for token ids, or text cut by truncate_prompt_tokens)."""
    if "prompt" not in body:
        raise BadRequest("prompt: required (text, token ids, or a list of either)", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list)
                                   and all(_is_int(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt
    else:
        raise BadRequest("prompt: expected text, a list of integer token ids, or a list of "
                         "either", "prompt")
    add_special = _bool(body, "add_special_tokens", True)
    out, texts = [], []
    for p in batch:
        ids = encode(p, add_special) if isinstance(p, str) else _ids(p, "prompt", vocab_size)
        if not ids:
            raise BadRequest("prompt: must have at least one token", "prompt")
        kept = _truncate(ids, body)
        out.append(kept)
        texts.append(p if isinstance(p, str) and len(kept) == len(ids) else None)
    return out, texts


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None, prompts,
                max_model_len: int, echo: bool) -> tuple[list[int], int | None, str]:
    """Per prompt max_tokens, the value sent (None: absent) and the field it came from."""
    value = None
    name = names[-1]
    for candidate in names:
        if body.get(candidate) is not None:
            value, name = body[candidate], candidate
            break
    if value is None and default is None:
        return [max(1, max_model_len - len(p)) for p in prompts], None, name
    value = default if value is None else _int(value, name, 0 if echo else 1)
    return [value] * len(prompts), value, name


def _common(body, applied, vocab_size, eos_token_ids, logprobs, has_text,
            prompt_logprobs=None):
    check_fields(body, applied)
    n = _int(body.get("n", 1) if body.get("n") is not None else 1, "n", 1, MAX_N)
    stream = _bool(body, "stream", False)
    include_usage, continuous = _stream_options(body)
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise BadRequest(f"cache_salt={salt!r}: expected a string", "cache_salt")
    sampling = replace(_sampling(body, vocab_size, eos_token_ids, logprobs),
                       prompt_logprobs=prompt_logprobs)
    return dict(n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous,
                cache_salt=salt, sampling=sampling, stop=_stop(body, has_text),
                include_stop=_bool(body, "include_stop_str_in_output", False),
                skip_special=_bool(body, "skip_special_tokens", True),
                tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False))


def parse_completion(body, vocab_size: int, encode, *, max_model_len: int = 1 << 62,
                     eos_token_ids=(), has_text: bool = True) -> GenerationRequest:
    """A /v1/completions body; `encode(text, add_special_tokens)` tokenizes a text prompt."""
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _int(logprobs, "logprobs", 0, MAX_LOGPROBS)
    echo = _bool(body, "echo", False)
    # echo with logprobs: the prompt tokens' logprobs lead (vLLM's prompt_logprobs = logprobs)
    common = _common(body, COMPLETION_APPLIED, vocab_size, eos_token_ids, logprobs, has_text,
                     logprobs if echo else None)
    prompts, texts = _prompts(body, vocab_size, encode)
    max_tokens, param, name = _max_tokens(body, ("max_tokens",), DEFAULT_MAX_TOKENS, prompts,
                                          max_model_len, echo)
    _check_min_tokens(common["sampling"], max_tokens)
    return GenerationRequest(prompts, max_tokens, echo=echo, logprobs=logprobs,
                             max_tokens_param=param, max_tokens_name=name,
                             prompt_texts=tuple(texts), **common)


def parse_chat(body, vocab_size: int, encode, render, *, max_model_len: int = 1 << 62,
               eos_token_ids=(), has_text: bool = True) -> GenerationRequest:
    """A /v1/chat/completions body; `render(messages, add_generation_prompt,
    continue_final_message)` is the chat template's text."""
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    if not has_text:
        raise BadRequest("messages: this server has no tokenizer (chat needs text)", "messages")
    want = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    top = 0 if top is None else _int(top, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not want:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if _bool(body, "echo", False):
        raise BadRequest("echo=true: not supported for chat (allowed: false)", "echo")
    common = _common(body, CHAT_APPLIED, vocab_size, eos_token_ids, top if want else None,
                     has_text)
    if "messages" not in body:
        raise BadRequest("messages: required", "messages")
    text = render(body["messages"], _bool(body, "add_generation_prompt", True),
                  _bool(body, "continue_final_message", False))
    ids = _truncate(encode(text, _bool(body, "add_special_tokens", False)), body)
    max_tokens, param, name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None,
                                          [ids], max_model_len, False)
    _check_min_tokens(common["sampling"], max_tokens)
    return GenerationRequest([ids], max_tokens, logprobs=top if want else None, chat=True,
                             max_tokens_param=param, max_tokens_name=name, **common)


def _check_min_tokens(sampling: SamplingParams, max_tokens: list[int]) -> None:
    if sampling.min_tokens and sampling.min_tokens > min(max_tokens):
        raise BadRequest(f"min_tokens={sampling.min_tokens}: must be <= max_tokens "
                         f"({min(max_tokens)})", "min_tokens")


def check_context_length(req: GenerationRequest, max_model_len: int) -> GenerationRequest:
    """The request under vLLM 0.32's context-length rules, in its words and error shape
    (type BadRequestError, code 400, param; vllm/renderers/params.py TokenizeParams
    __post_init__ and _token_len_check, vllm/v1/engine/input_processor.py
    _validate_model_input, vllm/entrypoints/serve/utils/api_utils.py get_max_tokens,
    the message's "(parameter=..., value=...)" tail from vllm/exceptions.py): max_tokens
    above the context length and a prompt longer than it are refused, a prompt that fills it
    leaves no room for a token, and otherwise max_tokens is clamped to the room the prompt
    leaves (vLLM answers prompt + max_tokens beyond the context with a shorter completion,
    finish_reason "length", not an error)."""
    name, value = req.max_tokens_name, req.max_tokens_param
    if value is not None and value > max_model_len:
        raise BadRequest(f"{name}={value} cannot be greater than max_model_len={max_model_len}."
                         f" Please request fewer output tokens. (parameter={name}, "
                         f"value={value})", name, "BadRequestError")
    for ids in req.prompts:
        n = len(ids)
        if n > max_model_len:
            raise BadRequest(f"This model's maximum context length is {max_model_len} tokens. "
                             f"However, your prompt contains {n} input tokens, which exceeds "
                             "this limit even without any output tokens. Please reduce the "
                             f"length of the input prompt. (parameter=input_tokens, value={n})",
                             "input_tokens", "BadRequestError")
        if n == max_model_len:
            raise BadRequest(f"The decoder prompt (length {n}) plus the number of requested "
                             "output tokens (at least 1) is longer than the maximum model "
                             f"length of {max_model_len}. Make sure that `max_model_len` is no "
                             "smaller than the number of text tokens (prompt + requested "
                             "output tokens).", None, "BadRequestError")
    room = [min(m, max_model_len - len(ids)) for m, ids in zip(req.max_tokens, req.prompts,
                                                                strict=True)]
    if room == req.max_tokens:
        return req
    _check_min_tokens(req.sampling, room)
    return replace(req, max_tokens=room)


# ----- responses -----------------------------------------------------------------------------
def completion_id(rid: int, chat: bool = False) -> str:
    return f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries, text, offset: int, as_ids: bool) -> dict:
    """OpenAI's completions logprobs of tokens `entries` [(token, (lp, top) or None)]:
    tokens, token_logprobs, top_logprobs (the token and its top alternatives, as vLLM: up to
    logprobs + 1 entries; None for a token without logprobs) and text_offset from
    `offset`."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, scored in entries:
        name = f"token_id:{token}" if as_ids else text.token_text(token)
        out["text_offset"].append(offset)
        offset += len(name)
        out["tokens"].append(name)
        if scored is None:  # an echoed prompt's first token: no logprob (vLLM's None)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, top = scored
        out["token_logprobs"].append(max(lp, -9999.0))
        alts = {name: max(lp, -9999.0)}
        for alt, alt_lp in top:
            alt_name = f"token_id:{alt}" if as_ids else text.token_text(alt)
            alts.setdefault(alt_name, max(alt_lp, -9999.0))
        out["top_logprobs"].append(alts)
    return out


def chat_logprobs(entries, text, as_ids: bool) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token, (lp, top) in entries:
        def one(t, v):
            name = f"token_id:{t}" if as_ids else text.token_text(t)
            return {"token": name, "logprob": max(v, -9999.0),
                    "bytes": list(text.token_bytes(t, skip_special=False))}
        item = one(token, lp)
        item["top_logprobs"] = [one(t, v) for t, v in top]
        content.append(item)
    return {"content": content}


def stream_chunk(rid: int, model: str, choices: list[dict], chat: bool = False,
                 usage_body: dict | None = None) -> str:
    body = {"id": completion_id(rid, chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_body is not None:
        body["usage"] = usage_body
    return f"data: {json.dumps(body)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
