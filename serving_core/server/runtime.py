"""An Engine run by a driver thread for an async front end.

`EngineRuntime` owns the engine: HTTP handlers `submit` requests (thread-safe) and
read their tokens from a per-request `TokenStream`; the driver thread steps the
engine whenever it has work and publishes a metrics snapshot after every step, so
readers never touch the scheduler or the allocator while a step runs.

Shutdown is either `finish` (reject new requests, serve the in-flight ones to
completion) or `abort` (stop stepping now; in-flight streams end with
finish_reason "abort"). Either way the engine's records end with END.

`abort(rid)` (a client that went away) ends one request: the driver thread, between
steps, removes it if it is still waiting, or lets a running one finish at its next
step (its state is then released like any finished request's).

`reset_prefix_cache()` (POST /reset_prefix_cache) drops the device prefix cache and
every cached unit between steps, keeping the host tier; it refuses (`Busy`) while any
request is queued or running. Each request's actual path (recompute, device_reuse,
host_reload) and first batch are recorded after the step that admitted it
(serving_core.server.paths) and handed to the stream's final usage.

Latencies for the histograms are wall times taken by the driver thread: submit, the
start of the step that first scheduled the request, each token handed to the stream, the
last token (serving_core/server/request_stats.py: vLLM's per-request histograms).

A request's `SamplingParams` (serving_core/sampling_params.py) ride on its spec; a stop
token ends it in the step that produced it (finish reason `stop`), a stop string found by
the front end ends it through `abort(rid, "stop")`. A request submitted with `settle`
(it has stop strings) is counted in vllm:request_success by the reason the front end
`settle`s, since a stop string found on the last allowed token ends a request the engine
already finished at its length.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from serving_core.request import Status
from serving_core.sampling_params import SamplingParams
from serving_core.server.paths import PathRecorder
from serving_core.server.request_stats import RequestStats

DRAIN_MODES = ("finish", "abort")


@dataclass(frozen=True, slots=True)
class ServedSpec:
    """What the engine reads of a request (the fields of a workload RequestSpec)."""

    request_id: int
    arrival_s: float
    prompt: np.ndarray  # int32 token ids
    output_tokens: int  # exact tokens to generate (EOS ignored)
    context_id: int = -1
    salt: str = ""
    sampling: SamplingParams | None = None  # None: greedy, EOS ignored


class Rejected(Exception):
    """A request the server does not take (shutting down or engine failed): HTTP 503."""


class Busy(Exception):
    """A control request refused while requests run: HTTP 409."""


class TokenStream:
    """Tokens of one HTTP request's choices, handed from the driver thread to an event loop.

    Items are (index, "token", (id, logprobs or None, finish or None)) and (index,
    "finish", finish) where finish is (reason, stop_reason), reason "length", "stop",
    "abort" or "error": a request's last token carries its finish, a request ended
    without a token (abort, engine error) gets a finish item. A request with
    prompt_logprobs also gets (index, "prompt", [(position, logprobs)]) items, before its
    first token. `index` is the choice (one engine request each)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, index: int, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, kind, value))
        except RuntimeError:  # the consumer's loop is closed (client gone at shutdown)
            pass

    async def get(self):
        return await self.queue.get()


class EngineRuntime:
    """Drives `engine` in a thread; `submit` from any thread, `snapshot` for metrics."""

    def __init__(self, engine, *, max_model_len: int, drain: str = "finish",
                 idle_poll_s: float = 0.05) -> None:
        if drain not in DRAIN_MODES:
            raise ValueError(f"drain={drain!r}: allowed values are {', '.join(DRAIN_MODES)}")
        self.engine = engine
        self.max_model_len = int(max_model_len)
        self.drain = drain
        self.idle_poll_s = idle_poll_s
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[TokenStream, int]] = {}  # rid -> (stream, choice)
        self._next_rid = 0
        self._closing = False  # no new requests
        self._stop = threading.Event()  # driver thread: leave the loop
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.counters = {"requests_received": 0, "requests_finished": 0,
                         "requests_aborted": 0, "requests_rejected": 0,
                         "prefix_query_tokens_total": 0}
        self.stats = RequestStats(self.max_model_len)  # vLLM's request metrics
        self._reqs: dict = {}  # rid -> the engine's Request, from entry to its end
        self._seen = 0  # engine.requests[:_seen] are in _reqs (or ended)
        self._aborts: set[int] = set()  # client gone: end at the next step boundary
        self._settle: set[int] = set()  # the front end settles their finish reason
        self._unsettled: dict[int, str] = {}  # rid -> the engine's reason, not yet counted
        self._drained = threading.Event()
        self.paths = PathRecorder()
        self._control: list | None = None  # [done event, result] of a pending reset
        self.resets = 0
        self._snapshot = self._take_snapshot()

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def closing(self) -> bool:
        """Shutdown has begun: no new requests (in-flight ones may still be draining)."""
        return self._closing

    def begin_shutdown(self, mode: str | None = None) -> None:
        """Stop taking requests; `abort` also stops the engine (streams end now)."""
        mode = mode or self.drain
        self._closing = True
        if mode == "abort":
            self._stop.set()

    def stop(self, timeout: float | None = None) -> None:
        """Finish (or abort) and join the driver thread."""
        self.begin_shutdown()
        if self._thread is None:
            return
        if self.drain == "finish":
            # leaves the loop once no request is left
            self._thread.join(timeout)
        self._stop.set()
        self._thread.join(timeout)

    # ----- requests -----------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, salt: str,
               loop: asyncio.AbstractEventLoop, sampling: SamplingParams | None = None, *,
               stream: TokenStream | None = None, index: int = 0, n_param: int = 1,
               parent: int | None = None, settle: bool = False,
               rid: int | None = None) -> tuple[int, TokenStream]:
        """Enqueue one request (one choice: its tokens go to `stream` under `index`);
        ValueError for a request the engine cannot serve (400), Rejected when the server no
        longer takes requests (503). `n_param` is the HTTP request's n and `parent` the id of
        its first choice (None: this one), for the metrics. `settle`: the front end has the
        last word on its finish reason (stop strings: `settle`). `rid`: the id the API
        process gave it (engine core process), else the next one."""
        if self._closing or not self.healthy:
            with self._lock:
                self.counters["requests_rejected"] += 1
            raise Rejected("server is shutting down" if self._closing else
                           f"engine stopped: {self.error}")
        check_fits(len(prompt), max_tokens, self.max_model_len)
        stream = stream or TokenStream(loop)
        with self._lock:
            rid = self._next_rid if rid is None else rid
            spec = ServedSpec(rid, 0.0, np.asarray(prompt, dtype=np.int32), int(max_tokens),
                              -1, salt, sampling)
            self.engine.check_feasible([spec])  # ValueError: the budget cannot hold it
            self._next_rid = rid + 1
            self._streams[rid] = (stream, index)
            if settle:
                self._settle.add(rid)
            self.stats.submitted(rid, time.monotonic(), len(prompt), int(max_tokens), n_param,
                                 parent)
            self.counters["requests_received"] += 1
            self.counters["prefix_query_tokens_total"] += len(prompt)
        self.engine.submit(spec)
        return rid, stream

    @contextmanager
    def admitting(self):
        """Requests submitted inside enter the engine together: the step loop takes none of
        them before all are in (the choices of one HTTP request start in one step, whatever
        the thread switches; a different batch may round a logprob differently)."""
        with self.engine._cond:
            yield

    def abort(self, rid: int, reason: str = "abort") -> bool:
        """End request `rid` early: its client disconnected (`abort`) or the front end found
        a stop string (`stop`); False if it already ended. Thread-safe; the engine drops it
        at the next step boundary."""
        with self._lock:
            if self._streams.pop(rid, None) is None:
                return False
            self._aborts.add(rid)
            self._settle.discard(rid)
            if reason == "abort":
                self.counters["requests_aborted"] += 1
            else:
                self.counters["requests_finished"] += 1
            self.stats.ended(rid, time.monotonic(), reason, self._reqs.get(rid))
        with self.engine._cond:
            self.engine._cond.notify_all()
        return True

    def settle(self, rid: int, reason: str | None) -> None:
        """The finish reason the response of request `rid` (submitted with `settle`)
        reports: vllm:request_success counts it, not the engine's (a stop string found on
        the last allowed token is `stop`, though the engine ended the request at its
        length). None: the front end gave up on it (the engine's reason counts)."""
        with self._lock:
            engine_reason = self._unsettled.pop(rid, None)
            if engine_reason is not None:
                self.stats.success[reason or engine_reason] += 1

    def reset_prefix_cache(self, timeout: float = 60.0) -> dict:
        """Drop the device prefix cache (the driver thread does it between steps); Busy
        while any request is queued or running, Rejected when the engine is not running."""
        if self._closing or not self.healthy:
            raise Rejected("server is shutting down" if self._closing else
                           f"engine stopped: {self.error}")
        done = threading.Event()
        with self._lock:
            if self._streams or self._control is not None:
                raise Busy(f"{len(self._streams)} requests are running or queued; "
                           "reset the prefix cache when the server is idle")
            self._control = [done, None]
        with self.engine._cond:
            self.engine._cond.notify_all()
        if not done.wait(timeout):
            raise Rejected(f"the engine did not reach a step boundary within {timeout} s")
        result = self._control[1]
        self._control = None
        if isinstance(result, Exception):
            raise result
        return result

    def _run_control(self) -> None:
        """Driver thread, between steps: the pending reset, if nothing runs."""
        control = self._control
        eng = self.engine
        with self._lock:
            busy = bool(self._streams) or eng.has_work()
        if busy:
            control[1] = Busy("requests are running or queued; reset the prefix cache when "
                              "the server is idle")
        else:
            try:
                control[1] = dict(eng.reset_prefix_cache(), status="ok")
                self.resets += 1
            except RuntimeError as err:
                control[1] = Busy(str(err))
        control[0].set()

    def request_path(self, rid: int) -> dict | None:
        """The actual path and first batch of request `rid` (None before its admission)."""
        rec = self.paths.paths.get(rid)
        return None if rec is None else rec.to_dict()

    def wait_drained(self, timeout: float | None = None) -> bool:
        """Block until the driver thread has left its loop (drained, aborted or failed)."""
        return self._drained.wait(timeout)

    # ----- driver thread ------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        """Drop aborted requests: a waiting one that never ran leaves the queue; a running
        (or preempted) one finishes at its next step, which releases its state."""
        with self._lock:
            pending = set(self._aborts)
        if not pending:
            return
        eng, sched = self.engine, self.engine.sched
        done = set()
        for req in reversed(eng.requests):
            if req.rid not in pending:
                continue
            done.add(req.rid)
            if req.status == Status.FINISHED:
                continue
            if sched.abort_waiting(req, eng.clock.now()):  # held no state: gone now
                with self._lock:
                    self._reqs.pop(req.rid, None)
            else:
                req.target_output = max(1, req.num_generated)
        with self._lock:
            self._aborts -= done

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                if self._control is not None and self._control[1] is None:
                    self._run_control()
                self._apply_aborts()
                if not eng.has_work():
                    if self._closing:
                        break  # drained
                    eng.wait_for_work(self.idle_poll_s)
                    self._publish()
                    continue
                t_step = time.monotonic()
                before = (eng.sched.prompt_tokens_total, eng.sched.generation_tokens_total)
                out = eng.step()
                self._pick_up()
                admitted = self.paths.update(eng)  # before the tokens: a finished stream
                with self._lock:                   # has its path
                    self.stats.scheduled(admitted, t_step, self.paths.paths)
                if out is not None:
                    self._dispatch(out, before)
                self._publish()
        except Exception as err:  # the engine failed: every open stream ends with an error
            self.error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        self._end_streams("error" if self.error else "abort")
        if self._control is not None and self._control[1] is None:
            self._control[1] = Rejected("the engine stopped")
            self._control[0].set()
        self._publish()
        self._drained.set()

    def _dispatch(self, out, before: tuple[int, int]) -> None:
        """Hand the step's tokens to their streams; a request's last token carries its
        finish (reason, stop_reason), so the stream's last token chunk is its last chunk."""
        now = time.monotonic()
        eng = self.engine
        finished = set(out.finished)
        with self._lock:
            self.stats.iteration(eng.sched.prompt_tokens_total - before[0]
                                 + eng.sched.generation_tokens_total - before[1])
            streams = self._streams
            for rid, entries in out.prompt_logprobs.items():  # before the request's token
                entry = streams.get(rid)
                if entry is not None:
                    entry[0].push(entry[1], "prompt", entries)
            for rid, token in out.produced:
                last = rid in finished
                req = self._reqs.pop(rid, None) if last else None
                entry = streams.pop(rid, None) if last else streams.get(rid)
                if entry is None:  # aborted, or its stop string was found
                    continue
                self.stats.token(rid, now)
                end = None
                if last:
                    end = finish_reason(req, token)
                    self.counters["requests_finished"] += 1
                    settle = rid in self._settle
                    if settle:
                        self._settle.discard(rid)
                        self._unsettled[rid] = end[0]
                    self.stats.finished(rid, now, end[0], req, count=not settle)
                entry[0].push(entry[1], "token", (token, out.logprobs.get(rid), end))
            for rid in finished:  # finished without a token here: already ended
                self._reqs.pop(rid, None)

    def _pick_up(self) -> None:
        """Driver thread: index the requests that entered the engine since the last step."""
        reqs = self.engine.requests
        if self._seen < len(reqs):
            with self._lock:
                for req in reqs[self._seen:]:
                    self._reqs[req.rid] = req
            self._seen = len(reqs)

    def _end_streams(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            streams, self._streams = self._streams, {}
            self._settle.clear()
            self.counters["requests_aborted"] += len(streams)
            for rid in streams:
                self.stats.ended(rid, now, reason)
        for stream, index in streams.values():
            stream.push(index, "finish", (reason, None))

    # ----- metrics ------------------------------------------------------------------------
    def _take_snapshot(self) -> dict:
        eng = self.engine
        sched = eng.sched
        with self._lock:
            counters = dict(self.counters)
            stats = self.stats.snapshot()
        return {
            **stats,
            "clock_s": eng.clock.now(),
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(eng._inbox),
            "pools": eng.mem.usage(),
            "preemptions_total": sched.preemptions_total,
            "prompt_tokens_total": sched.prompt_tokens_total,
            "generation_tokens_total": sched.generation_tokens_total,
            "prefix_hit_tokens_total": sched.prefix_hit_tokens_total,
            "steps_total": sched.step,
            "prefix_cache_resets": self.resets,
            **self._path_counters(),
            **(eng.host_tier.counters() if eng.host_tier is not None else {}),
            **counters,
        }

    def _path_counters(self) -> dict[str, int]:
        out = {f"requests_path_{p}": n for p, n in self.paths.counts().items()}
        out["device_prefix_hit_tokens"] = self.paths.device_hit_tokens
        return out

    def _publish(self) -> None:
        self._snapshot = self._take_snapshot()

    def snapshot(self) -> dict:
        """The state after the last step (a dict replaced atomically, never mutated)."""
        return self._snapshot


def check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """ValueError (a 400) when prompt + max_tokens exceed the model's max_model_len."""
    total = prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
            f"the model's max_model_len {max_model_len}"
        )


def finish_reason(req, last_token: int | None) -> tuple[str, int | None]:
    """(finish reason, stop_reason) of a request the engine finished: `stop` when its last
    token is a stop token under its SamplingParams (vLLM's check_stop order: a stop token
    wins over the length limit; stop_reason is the token for stop_token_ids, None for
    EOS), else `length`."""
    params = getattr(getattr(req, "spec", None), "sampling", None)
    if params is None or last_token is None or not params.stops(last_token, req.num_generated):
        return "length", None
    return "stop", (last_token if last_token in params.stop_token_ids else None)
