"""The HTTP front end: POST /v1/completions, GET /v1/models, GET /health, GET /metrics,
POST /reset_prefix_cache (vLLM's name: drop the device prefix cache, keep the host tier;
409 while requests run).

Every completion's usage carries vLLM's `prompt_tokens_details.cached_tokens` (the
prefix it adopted) and `hsl_path`: its actual path (recompute, device_reuse, host_reload),
reused tokens and first batch (serving_core.server.paths); streams carry usage when
`stream_options.include_usage` is true.

Handlers never touch the engine directly: they submit through the runtime and read
their own token stream; /metrics renders the runtime's last snapshot. As vLLM's server:
a request naming another model gets 404, every error body is OpenAI's
{"error": {"message", "type", "param", "code"}}, and a request whose client disconnects
is aborted (its state freed at the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from serving_core.server.metrics import make_registry, render
from serving_core.server.protocol import (
    SSE_DONE,
    BadRequest,
    completion_body,
    parse_completion,
    sse_chunk,
    usage,
)
from serving_core.server.runtime import Busy, EngineRuntime, Rejected

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


class Detokenizer:
    """Token ids to text and back with a tokenizer exposing encode/decode (None: no text)."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest("prompt: this server has no tokenizer; send token ids")
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(ids)
        except Exception:  # ids outside the text vocabulary (random weights): no text
            return ""


def create_app(runtime: EngineRuntime, *, model_name: str, vocab_size: int,
               tokenizer=None, on_shutdown=None) -> FastAPI:
    """The app over a (not yet started) runtime; `on_shutdown()` runs after the engine
    stopped (writes the records)."""
    text = Detokenizer(tokenizer)
    registry = make_registry(runtime.snapshot, model_name)
    created = int(time.time())

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

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        return _error(exc.status_code, message)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error(400, f"request: {exc.errors()}")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created,
            "owned_by": "hybrid-state-lab", "root": model_name, "parent": None,
            "max_model_len": runtime.max_model_len,
        }]}

    @app.get("/health")
    async def health():
        snap = runtime.snapshot()
        if not runtime.healthy:
            return _error(503, f"engine not running: {runtime.error or 'stopped'}", "unavailable")
        if runtime.closing:  # draining after SIGTERM: in-flight requests only
            return _error(503, "server is shutting down", "unavailable")
        return {"status": "ok", "model": model_name, "clock_s": snap["clock_s"]}

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    def _usage(rid: int, n_prompt: int, produced: int) -> dict:
        body = usage(n_prompt, produced)
        path = runtime.request_path(rid)
        if path is not None:
            body["prompt_tokens_details"] = {"cached_tokens": path["reused_tokens"]}
            body["hsl_path"] = path
        return body

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        try:
            result = await asyncio.to_thread(runtime.reset_prefix_cache)
        except Busy as err:
            return _error(409, str(err))
        except Rejected as err:
            return _error(503, str(err), "unavailable")
        return result

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(400, f"request body: not valid JSON ({err})", "invalid_request_error")
        if isinstance(body, dict) and body.get("model") not in (None, model_name):
            return _error(404, f"The model `{body['model']}` does not exist.", param="model")
        try:
            req = parse_completion(body, vocab_size, text.encode)
            rid, stream = runtime.submit(req.prompt_ids, req.max_tokens, req.cache_salt,
                                         asyncio.get_running_loop())
        except Rejected as err:
            return _error(503, str(err), "unavailable")
        except ValueError as err:  # BadRequest, or a request the budget/model cannot hold
            return _error(400, str(err), "invalid_request_error")
        n_prompt = len(req.prompt_ids)
        if req.stream:
            return StreamingResponse(_sse(rid, stream, req, n_prompt),
                                     media_type="text/event-stream")
        ids: list[int] = []
        while True:
            try:
                kind, value = await asyncio.wait_for(stream.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    runtime.abort(rid)
                    return _error(499, f"request {rid}: client disconnected", "aborted")
                continue
            if kind == "token":
                ids.append(value)
            else:
                break
        if value != "length":
            return _error(503, f"request {rid} ended early ({value}) after {len(ids)} tokens",
                          "unavailable")
        body = completion_body(rid, model_name, text.decode(ids), ids, value, n_prompt)
        body["usage"] = _usage(rid, n_prompt, len(ids))
        return body

    async def _sse(rid, stream, req, n_prompt):
        produced = 0
        finished = False
        try:
            while True:
                kind, value = await stream.get()
                if kind == "token":
                    produced += 1
                    yield sse_chunk(rid, model_name, text.decode([value]), [value], None)
                else:
                    finished = True
                    yield sse_chunk(rid, model_name, "", [], value)
                    break
            if req.include_usage:
                yield sse_chunk(rid, model_name, "", [], None, _usage(rid, n_prompt, produced))
            yield SSE_DONE
        finally:  # the client went away (the generator was closed or cancelled)
            if not finished:
                runtime.abort(rid)

    return app
