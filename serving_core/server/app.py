"""The HTTP front end, as vLLM's OpenAI server: POST /v1/completions, POST
/v1/chat/completions (the Llama-3 chat template: serving_core/server/chat.py), POST
/tokenize and /detokenize, GET /v1/models, /health, /metrics, POST /reset_prefix_cache
(drop the device prefix cache, keep the host tier; 409 while requests run).

Requests: every field of OpenAI's and vLLM's (serving_core/server/protocol.py says which
are applied, which cannot change anything here and which are refused); sampling runs in
the engine under each choice's SamplingParams (serving_core/sampling_params.py). A request
with n choices or a batch of prompts is one engine request per choice (choice index =
prompt index x n + choice), their prompts shared through the prefix cache.

Streams: one chunk per token, the finish reason on the last token's chunk (no empty
trailing chunk), text decoded incrementally (serving_core/server/text.py: a character split
across tokens arrives once complete; a token completing none has empty text), then the
usage chunk when `stream_options.include_usage` (usage on every chunk as well with
`continuous_usage_stats`), then `data: [DONE]`. Every choice carries its `token_ids`.
Usage carries vLLM's `prompt_tokens_details.cached_tokens` and `hsl_path` (one choice;
`hsl_paths` for several): the actual path (recompute, device_reuse, host_reload), reused
tokens and first batch (serving_core/server/paths.py).

`echo` with `logprobs` (lm-eval's loglikelihood requests) returns the prompt's tokens with
their logprobs ahead of the generated ones (the first None, as vLLM), computed by the
executor from the prompt's own prefill (SamplingParams.prompt_logprobs); with max_tokens 0
one token is run and dropped, as vLLM does. Context length as vLLM 0.32
(protocol.check_context_length): a prompt longer than max_model_len or max_tokens above it
is a 400 in vLLM's words, prompt + max_tokens beyond it is served up to max_model_len.

`OpenAIServer` holds the runtime, tokenizer and metrics registry, one method per route;
`create_app` routes to them. Handlers never touch the engine directly: they submit through
the runtime and read their own token stream; /metrics renders the runtime's last snapshot.
A stop string's finish reason is settled with the runtime (`EngineRuntime.settle`), so
vllm:request_success counts the reason the response reports. As vLLM's server: a
request naming another model gets 404, every error body is OpenAI's {"error": {"message",
"type", "param", "code"}}, and a request whose client disconnects is aborted (its state
freed at the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from serving_core.server.chat import render_chat
from serving_core.server.metrics import make_registry, render
from serving_core.server.protocol import (
    SSE_DONE,
    BadRequest,
    GenerationRequest,
    chat_logprobs,
    check_context_length,
    completion_id,
    completion_logprobs,
    parse_chat,
    parse_completion,
    stream_chunk,
    usage,
)
from serving_core.server.runtime import Busy, EngineRuntime, Rejected, TokenStream
from serving_core.server.text import Detokenizer, TextStream

ERROR_TYPES = {400: "invalid_request_error", 404: "NotFoundError", 405: "invalid_request_error",
               409: "conflict", 422: "invalid_request_error", 503: "unavailable"}
DISCONNECT_POLL_S = 0.25  # how often a whole (non-streamed) request checks for its client


def _error(status: int, message: str, kind: str | None = None, param: str | None = None
           ) -> JSONResponse:
    """OpenAI's error body."""
    kind = kind or ERROR_TYPES.get(status, "server_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


def _bad_request(err: BadRequest) -> JSONResponse:
    return _error(400, str(err), err.kind, err.param)


@dataclass
class _Choice:
    """One choice of an HTTP request: its engine request and what it produced so far."""

    index: int
    prompt_index: int
    rid: int
    text: TextStream
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # [(token, (lp, top))]
    pieces: list[str] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0
    prompt_lps: dict = field(default_factory=dict)  # prompt position -> (lp, top)
    drop: bool = False  # echo with max_tokens 0: the engine's one token is not returned


class OpenAIServer:
    """vLLM's OpenAI routes over one runtime: one method per route (see create_app)."""

    def __init__(self, runtime: EngineRuntime, *, model_name: str, vocab_size: int,
                 tokenizer=None, eos_token_ids=(), cache_info: dict | None = None) -> None:
        self.runtime = runtime
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.text = Detokenizer(tokenizer)
        self.registry = make_registry(runtime.snapshot, model_name, cache_info)
        self.created = int(time.time())
        self.eos = tuple(int(t) for t in eos_token_ids)

    # ----- errors -------------------------------------------------------------------------
    async def http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        return _error(exc.status_code, message)

    async def validation_error(self, request: Request, exc: RequestValidationError
                               ) -> JSONResponse:
        return _error(400, f"request: {exc.errors()}")

    # ----- GET routes and control ---------------------------------------------------------
    async def models(self) -> dict:
        name = self.model_name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created,
            "owned_by": "hybrid-state-lab", "root": name, "parent": None,
            "max_model_len": self.runtime.max_model_len,
        }]}

    async def health(self):
        runtime = self.runtime
        snap = runtime.snapshot()
        if not runtime.healthy:
            return _error(503, f"engine not running: {runtime.error or 'stopped'}", "unavailable")
        if runtime.closing:  # draining after SIGTERM: in-flight requests only
            return _error(503, "server is shutting down", "unavailable")
        return {"status": "ok", "model": self.model_name, "clock_s": snap["clock_s"]}

    async def metrics(self) -> Response:
        return Response(render(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self):
        try:
            result = await asyncio.to_thread(self.runtime.reset_prefix_cache)
        except Busy as err:
            return _error(409, str(err))
        except Rejected as err:
            return _error(503, str(err), "unavailable")
        return result

    # ----- POST routes --------------------------------------------------------------------
    async def _body(self, request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRequest(f"request body: not valid JSON ({err})") from None
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            raise LookupError(body["model"])
        return body

    async def _handle(self, request: Request, parse):
        """Parse the body with `parse(body)` and generate; 404 for another model's name,
        400 for a bad request."""
        try:
            req = check_context_length(parse(await self._body(request)),
                                       self.runtime.max_model_len)
        except LookupError as err:
            return _error(404, f"The model `{err.args[0]}` does not exist.", param="model")
        except BadRequest as err:
            return _bad_request(err)
        return await self._generate(request, req)

    async def completions(self, request: Request):
        text = self.text
        return await self._handle(request, lambda body: parse_completion(
            body, self.vocab_size, text.encode, max_model_len=self.runtime.max_model_len,
            eos_token_ids=self.eos, has_text=text.has_text))

    async def chat_completions(self, request: Request):
        text = self.text
        return await self._handle(request, lambda body: parse_chat(
            body, self.vocab_size, lambda t, special: text.encode(t, special, "messages"),
            lambda m, gen, cont: render_chat(m, add_generation_prompt=gen,
                                             continue_final_message=cont),
            max_model_len=self.runtime.max_model_len, eos_token_ids=self.eos,
            has_text=text.has_text))

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} -> token ids."""
        try:
            body = await self._body(request)
            ids = self._tokenize(body)
        except LookupError as err:
            return _error(404, f"The model `{err.args[0]}` does not exist.", param="model")
        except BadRequest as err:
            return _bad_request(err)
        strs = ([self.text.token_text(t) for t in ids] if body.get("return_token_strs")
                else None)
        return {"count": len(ids), "max_model_len": self.runtime.max_model_len, "tokens": ids,
                "token_strs": strs}

    def _tokenize(self, body) -> list[int]:
        if not isinstance(body, dict):
            raise BadRequest("request body: expected a JSON object")
        if "messages" in body:
            prompt = render_chat(body["messages"],
                                 add_generation_prompt=bool(body.get("add_generation_prompt",
                                                                     True)),
                                 continue_final_message=bool(
                                     body.get("continue_final_message", False)))
            return self.text.encode(prompt, bool(body.get("add_special_tokens", False)),
                                    "messages")
        if isinstance(body.get("prompt"), str):
            return self.text.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
        raise BadRequest("prompt: expected text (or messages)", "prompt")

    async def detokenize(self, request: Request):
        """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text}."""
        vocab_size = self.vocab_size
        try:
            body = await self._body(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                    for t in tokens):
                raise BadRequest(f"tokens: expected a list of token ids in [0, {vocab_size})",
                                 "tokens")
            if not self.text.has_text:
                raise BadRequest("tokens: this server has no tokenizer", "tokens")
        except LookupError as err:
            return _error(404, f"The model `{err.args[0]}` does not exist.", param="model")
        except BadRequest as err:
            return _bad_request(err)
        return {"prompt": self.text.decode(tokens, skip_special=False)}

    # ----- generation ---------------------------------------------------------------------
    def _submit(self, req: GenerationRequest, loop) -> tuple[TokenStream, list[_Choice]]:
        """One engine request per choice, all feeding one stream; echo with max_tokens 0
        and logprobs runs one token (the prompt's logprobs come from its prefill) and drops
        it, as vLLM does."""
        runtime = self.runtime
        stream = TokenStream(loop)
        choices: list[_Choice] = []
        try:
            with runtime.admitting():  # one step takes all the choices
                self._submit_choices(req, loop, stream, choices)
        except Exception:
            for c in choices:
                runtime.abort(c.rid)
            raise
        return stream, choices

    def _submit_choices(self, req: GenerationRequest, loop, stream: TokenStream,
                        choices: list[_Choice]) -> None:
        runtime = self.runtime
        parent = None
        for p, ids in enumerate(req.prompts):
            for j in range(req.n):
                params = req.choice_sampling(j)
                rid, _ = runtime.submit(ids, max(1, req.max_tokens[p]), req.cache_salt,
                                        loop, params, stream=stream, index=len(choices),
                                        n_param=req.n, parent=parent, settle=bool(req.stop))
                parent = rid if parent is None else parent
                choices.append(_Choice(len(choices), p, rid, TextStream(
                    self.text, stop=req.stop, include_stop=req.include_stop,
                    skip_special=req.skip_special, min_tokens=params.min_tokens),
                    drop=req.max_tokens[p] == 0))

    def _usage(self, req: GenerationRequest, choices: list[_Choice]) -> dict:
        body = usage(sum(len(p) for p in req.prompts), sum(len(c.ids) for c in choices))
        paths = [self.runtime.request_path(c.rid) for c in choices]
        if all(p is not None for p in paths):
            firsts = {}
            for c, p in zip(choices, paths, strict=True):
                firsts.setdefault(c.prompt_index, p)
            body["prompt_tokens_details"] = {
                "cached_tokens": sum(p["reused_tokens"] for p in firsts.values())}
            if len(paths) == 1:
                body["hsl_path"] = paths[0]
            else:
                body["hsl_paths"] = paths
        return body

    def _on_item(self, c: _Choice, kind: str, value) -> tuple[str, list]:
        """Apply one stream item to its choice: (new text, new [(token, logprobs)])."""
        if kind == "prompt":  # prompt logprobs (echo): [(position, (lp, top))]
            c.prompt_lps.update(value)
            return "", []
        delta, new_lps = self._apply(c, kind, value)
        if c.finish is not None and c.text.stop:
            # the engine may have ended it first (a stop string on its last allowed token):
            # the runtime counts the reason the response reports
            self.runtime.settle(c.rid, c.finish)
        return delta, new_lps

    def _apply(self, c: _Choice, kind: str, value) -> tuple[str, list]:
        if kind == "finish":
            c.finish, c.stop_reason = value
            return c.text.finish(), []
        token, lp, end = value
        if c.drop:  # echo with max_tokens 0: the prompt only (its one token is its last)
            c.finish, c.stop_reason = end if end is not None else ("length", None)
            return "", []
        c.ids.append(token)
        new_lps = [(token, lp)] if lp is not None else []
        c.logprobs.extend(new_lps)
        delta = c.text.add(token)
        if c.text.stop_hit is not None:  # a stop string: the choice ends here
            self.runtime.abort(c.rid, "stop")
            c.finish, c.stop_reason = "stop", c.text.stop_hit
            delta += c.text.finish()
        elif end is not None:
            c.finish, c.stop_reason = end
            delta += c.text.finish()
        return delta, new_lps

    def _prompt_text(self, req, p: int) -> str:
        """The prompt echoed: the text as sent, or its token ids decoded."""
        if p < len(req.prompt_texts) and req.prompt_texts[p] is not None:
            return req.prompt_texts[p]
        return self.text.decode(req.prompts[p], skip_special=req.skip_special)

    async def _generate(self, request: Request, req: GenerationRequest):
        if max(req.max_tokens) == 0 and req.logprobs is None:  # echo only: the prompts
            return self._echo_only(req)
        try:
            stream, choices = self._submit(req, asyncio.get_running_loop())
        except Rejected as err:
            return _error(503, str(err), "unavailable")
        except ValueError as err:  # a request the budget/model cannot hold
            return _error(400, str(err), "invalid_request_error")
        if req.stream:
            return StreamingResponse(self._sse(req, stream, choices),
                                     media_type="text/event-stream")
        gone = await self._collect(request, stream, choices)
        if gone is not None:
            return gone
        bad = [c for c in choices if c.finish not in ("length", "stop")]
        if bad:
            c = bad[0]
            return _error(503, f"request {c.rid} ended early ({c.finish}) after {len(c.ids)} "
                          "tokens", "unavailable")
        return self._whole(req, choices)

    async def _collect(self, request: Request, stream: TokenStream, choices: list[_Choice]):
        """Read the stream until every choice finished (None), or the 499 error when the
        client went away (its requests aborted)."""
        open_ = {c.index for c in choices}
        while open_:
            try:
                index, kind, value = await asyncio.wait_for(stream.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    for c in choices:
                        self.runtime.abort(c.rid)
                        self.runtime.settle(c.rid, None)
                    return _error(499, f"request {choices[0].rid}: client disconnected",
                                  "aborted")
                continue
            c = choices[index]
            if c.finish is not None:
                continue
            delta, _ = self._on_item(c, kind, value)
            c.pieces.append(delta)
            if c.finish is not None:
                open_.discard(index)
        return None

    def _echo_entries(self, req: GenerationRequest, c: _Choice) -> list:
        """The prompt's logprobs entries (echo): the first token has none (vLLM's None)."""
        prompt = req.prompts[c.prompt_index]
        return [(t, c.prompt_lps.get(i) if i else None) for i, t in enumerate(prompt)]

    def _whole(self, req: GenerationRequest, choices: list[_Choice]) -> dict:
        text, out = self.text, []
        for c in choices:
            body_text = "".join(c.pieces)
            item = {"index": c.index}
            if req.chat:
                item["message"] = {"role": "assistant", "content": body_text}
                item["logprobs"] = (chat_logprobs(c.logprobs, text, req.tokens_as_ids)
                                    if req.logprobs is not None else None)
            else:
                entries = c.logprobs
                if req.echo:
                    body_text = self._prompt_text(req, c.prompt_index) + body_text
                    entries = self._echo_entries(req, c) + entries
                item["text"] = body_text
                item["logprobs"] = (completion_logprobs(entries, text, 0, req.tokens_as_ids)
                                    if req.logprobs is not None else None)
            item.update(finish_reason=c.finish, stop_reason=c.stop_reason, token_ids=c.ids)
            out.append(item)
        return {"id": completion_id(choices[0].rid, req.chat),
                "object": "chat.completion" if req.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": out,
                "usage": self._usage(req, choices)}

    def _echo_only(self, req: GenerationRequest) -> dict:
        choices = [{"index": p * req.n + j, "text": self._prompt_text(req, p), "token_ids": [],
                    "logprobs": None, "finish_reason": "length", "stop_reason": None}
                   for p in range(len(req.prompts)) for j in range(req.n)]
        return {"id": "cmpl-echo", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage(sum(len(p) for p in req.prompts), 0)}

    def _chunk_choice(self, req, c: _Choice, delta: str, token_ids, lps, first: bool) -> dict:
        text = self.text
        if req.chat:
            d = {"role": "assistant", "content": delta} if first else {"content": delta}
            item = {"index": c.index, "delta": d,
                    "logprobs": chat_logprobs(lps, text, req.tokens_as_ids)
                    if req.logprobs is not None else None}
        else:
            if first and req.echo:
                delta = self._prompt_text(req, c.prompt_index) + delta
                lps = self._echo_entries(req, c) + lps
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(lps, text, c.text_offset, req.tokens_as_ids)
                if lp["tokens"]:
                    c.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            item = {"index": c.index, "text": delta, "logprobs": lp}
        item.update(finish_reason=c.finish, stop_reason=c.stop_reason, token_ids=token_ids)
        return item

    async def _sse(self, req: GenerationRequest, stream: TokenStream, choices: list[_Choice]):
        rid = choices[0].rid
        open_ = {c.index for c in choices}
        try:
            while open_:
                index, kind, value = await stream.get()
                c = choices[index]
                if c.finish is not None or kind == "prompt":
                    if kind == "prompt":
                        self._on_item(c, kind, value)
                    continue  # tokens after a stop string; prompt logprobs come first
                first = not c.ids
                delta, lps = self._on_item(c, kind, value)
                if c.finish is not None:
                    open_.discard(index)
                token_ids = [value[0]] if kind == "token" and not c.drop else []
                usage_body = None
                if req.continuous_usage:
                    usage_body = usage(len(req.prompts[c.prompt_index]), len(c.ids))
                yield stream_chunk(rid, self.model_name,
                                   [self._chunk_choice(req, c, delta, token_ids, lps, first)],
                                   req.chat, usage_body)
            if req.include_usage:
                yield stream_chunk(rid, self.model_name, [], req.chat, self._usage(req, choices))
            yield SSE_DONE
        finally:  # the client went away (the generator was closed or cancelled)
            for c in choices:
                if c.finish is None:
                    self.runtime.abort(c.rid)
                    self.runtime.settle(c.rid, None)


def create_app(runtime: EngineRuntime, *, model_name: str, vocab_size: int,
               tokenizer=None, on_shutdown=None, eos_token_ids=(),
               cache_info: dict | None = None) -> FastAPI:
    """The app over a (not yet started) runtime; `on_shutdown()` runs after the engine
    stopped (writes the records). `eos_token_ids` end a request unless it sets ignore_eos;
    `cache_info` labels vllm:cache_config_info."""
    server = OpenAIServer(runtime, model_name=model_name, vocab_size=vocab_size,
                          tokenizer=tokenizer, eos_token_ids=eos_token_ids,
                          cache_info=cache_info)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runtime.start()
        try:
            yield
        finally:
            await asyncio.to_thread(runtime.stop)
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="Hybrid State Lab server", lifespan=lifespan)
    app.state.runtime = runtime
    app.state.server = server
    app.add_exception_handler(HTTPException, server.http_error)
    app.add_exception_handler(RequestValidationError, server.validation_error)
    for path, route, method in (
            ("/v1/models", server.models, "GET"), ("/health", server.health, "GET"),
            ("/metrics", server.metrics, "GET"),
            ("/reset_prefix_cache", server.reset_prefix_cache, "POST"),
            ("/v1/completions", server.completions, "POST"),
            ("/v1/chat/completions", server.chat_completions, "POST"),
            ("/tokenize", server.tokenize, "POST"), ("/detokenize", server.detokenize, "POST")):
        app.add_api_route(path, route, methods=[method])
    return app
