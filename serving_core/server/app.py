"""The HTTP front end: POST /v1/completions, GET /health, GET /metrics.

Handlers never touch the engine directly: they submit through the runtime and read
their own token stream; /metrics renders the runtime's last snapshot.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from serving_core.server.metrics import make_registry, render
from serving_core.server.protocol import (
    SSE_DONE,
    BadRequest,
    completion_body,
    parse_completion,
    sse_chunk,
    usage,
)
from serving_core.server.runtime import EngineRuntime, Rejected


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


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
    registry = make_registry(runtime.snapshot)

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

    @app.get("/health")
    async def health():
        snap = runtime.snapshot()
        if not runtime.healthy:
            return _error(503, f"engine not running: {runtime.error or 'stopped'}", "unavailable")
        return {"status": "ok", "model": model_name, "clock_s": snap["clock_s"]}

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(400, f"request body: not valid JSON ({err})", "invalid_request_error")
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
            kind, value = await stream.get()
            if kind == "token":
                ids.append(value)
            else:
                break
        if value != "length":
            return _error(503, f"request {rid} ended early ({value}) after {len(ids)} tokens",
                          "unavailable")
        return completion_body(rid, model_name, text.decode(ids), ids, value, n_prompt)

    async def _sse(rid, stream, req, n_prompt):
        produced = 0
        while True:
            kind, value = await stream.get()
            if kind == "token":
                produced += 1
                yield sse_chunk(rid, model_name, text.decode([value]), [value], None)
            else:
                yield sse_chunk(rid, model_name, "", [], value)
                break
        if req.include_usage:
            yield sse_chunk(rid, model_name, "", [], None, usage(n_prompt, produced))
        yield SSE_DONE

    return app
