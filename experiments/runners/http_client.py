"""The benchmark client: sends a workload at its planned arrival times to an
OpenAI-compatible /v1/completions endpoint and measures each request at the client.

Prompts go as token ids (the engine sees exactly the workload's tokens), with
max_tokens = the planned output length, ignore_eos, greedy (temperature 0: both servers
default to 1, OpenAI's default), streaming, and the request's cache_salt when it has one.
Per request the client records send time, first-token time, every token's arrival
(inter-token times) and the finish time, all in seconds since the episode start t0
(perf_counter based).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class ClientRecord:
    request_id: int  # workload id
    sent_s: float = math.nan
    first_token_s: float = math.nan
    finish_s: float = math.nan
    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    server_id: str = ""  # the response id (cmpl-<engine request id> on our server)
    finish_reason: str = ""
    error: str = ""
    cached_prompt_tokens: int = -1  # the server's usage report (vLLM), -1 when absent
    # Our server's record of the request (usage.hsl_path; "" / -1 when absent): its actual
    # path (recompute | device_reuse | host_reload), the prefix it reused, what the host
    # tier restored for it and its first batch (tokens computed before, scheduled in it).
    path: str = ""
    reused_tokens: int = -1
    restored_tokens: int = -1
    first_batch_computed: int = -1
    first_batch_scheduled: int = -1

    @property
    def ok(self) -> bool:
        return not self.error and self.finish_reason == "length"

    def inter_token_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]


def completion_payload(spec, model: str | None = None, extra: dict | None = None) -> dict:
    """The request body of one workload request (same for our server and vLLM); `extra`
    adds server-specific fields (vLLM: return_token_ids, stream_options)."""
    body = {
        "prompt": [int(t) for t in spec.prompt],
        "max_tokens": int(spec.output_tokens),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    if spec.salt:
        body["cache_salt"] = spec.salt
    if model:
        body["model"] = model
    if extra:
        body.update(extra)
    return body


async def stream_one(client: httpx.AsyncClient, url: str, spec, t0: float,
                     model: str | None = None, extra: dict | None = None) -> ClientRecord:
    """Send one request at t0 + arrival_s and read its SSE stream to the end."""
    rec = ClientRecord(int(spec.request_id))
    delay = t0 + float(spec.arrival_s) - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", url, json=completion_payload(spec, model, extra)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                rec.error = f"HTTP {resp.status_code}: {body}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                rec.server_id = chunk.get("id", rec.server_id)
                details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                if "cached_tokens" in details:
                    rec.cached_prompt_tokens = int(details["cached_tokens"] or 0)
                record = (chunk.get("usage") or {}).get("hsl_path")
                if record:
                    rec.path = str(record["path"])
                    for name in ("reused_tokens", "restored_tokens", "first_batch_computed",
                                 "first_batch_scheduled"):
                        setattr(rec, name, int(record[name]))
                for choice in chunk.get("choices", []):
                    now = time.perf_counter() - t0
                    ids = choice.get("token_ids")
                    n = len(ids) if ids is not None else int(bool(choice.get("text")))
                    if n:
                        if math.isnan(rec.first_token_s):
                            rec.first_token_s = now
                        rec.token_times_s.extend([now] * n)
                        rec.token_ids.extend(ids or [])
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
        rec.finish_s = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        rec.error = f"{type(err).__name__}: {err}"
    return rec


async def send_workload(base_url: str, specs, t0: float, *, model: str | None = None,
                        extra: dict | None = None,
                        read_timeout_s: float = 600.0) -> list[ClientRecord]:
    """Every spec at its arrival time, concurrently; records in workload order."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(10.0, read=read_timeout_s)
    url = base_url + "/v1/completions"
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        return list(await asyncio.gather(*(stream_one(client, url, s, t0, model, extra)
                                           for s in specs)))
