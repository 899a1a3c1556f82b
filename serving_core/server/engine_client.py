"""The API process's side of `--engine-core process`: `EngineCoreClient` is an
EngineRuntime to the HTTP front end (the same methods app.py and __main__ call) whose
engine runs in a child process (serving_core/server/engine_core.py).

The child is started with multiprocessing's `spawn` context (a fresh interpreter: no
thread or lock of this process is inherited) and builds the engine from the spec; the
API process never imports torch. Request ids are given here, in submit order, so a request
is known before the child has seen it; the requests submitted under `admitting()` (the
choices of one HTTP request) go in one message, which the child enters under the
engine's lock, so they start in one step, as in a thread core; a request
longer than the budget holds (`max_feasible`, from the child) is asked about once to get
the engine's own error. A
reader thread takes the child's one message per step and hands its tokens to their
TokenStreams, one call into each event loop per step. Sends go straight into the pipe
(bounded: a full pipe makes the sender wait). The child exits when this process does:
its pipe ends.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
import time
from contextlib import contextmanager

import numpy as np

from serving_core.server.runtime import DRAIN_MODES, Rejected, TokenStream, check_fits

START_TIMEOUT_S = 600.0  # the child's build (model load) must be done by then


class EngineCoreError(RuntimeError):
    """The engine core process did not start: `code` is the exit status to use."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineCoreClient:
    """An engine in a child process behind EngineRuntime's interface (module docstring)."""

    def __init__(self, config: dict, *, drain: str = "finish") -> None:
        if drain not in DRAIN_MODES:
            raise ValueError(f"drain={drain!r}: allowed values are {', '.join(DRAIN_MODES)}")
        self.drain = drain
        self.error: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._streams: dict[int, tuple[TokenStream, int]] = {}
        self._rids = itertools.count()
        self._seq = itertools.count()
        self._replies: dict[int, list] = {}  # seq -> [event, result]
        self._pending: list = []  # submitted, not yet sent (see admitting)
        self._holding = 0  # admitting() depth
        self._paths: dict[int, dict] = {}
        self._snapshot: dict = {}
        self._rejected = 0
        self._drained = threading.Event()
        self._closed = threading.Event()
        t0 = time.monotonic()
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        from serving_core.server.engine_core import engine_main

        self.proc = ctx.Process(target=engine_main, args=(child, dict(config, drain=drain)),
                                name="engine-core", daemon=True)
        self.proc.start()
        child.close()
        self.info = self._wait_ready()
        self.start_s = time.monotonic() - t0
        self.max_model_len = int(self.info["max_model_len"])
        self.vocab_size = int(self.info["vocab_size"])
        self._snapshot = self.info["snapshot"]
        self._reader = threading.Thread(target=self._read, name="engine-core-reader",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict:
        if not self._conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise EngineCoreError(1, f"engine core: not ready within {START_TIMEOUT_S} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self.proc.join(5)
            raise EngineCoreError(1, f"engine core exited during start (code "
                                     f"{self.proc.exitcode})") from None
        if msg[0] == "failed":
            self.proc.join(5)
            raise EngineCoreError(msg[1], msg[2])
        return msg[1]

    def settings(self) -> dict:
        """The engine process's runtime settings, read back there, and the start cost."""
        return {**self.info["settings"], "engine_core": "process",
                "engine_core_start_s": round(self.start_s, 3)}

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the child runs its step loop from its start."""

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._drained.is_set() and self.proc.is_alive()

    @property
    def closing(self) -> bool:
        return self._closing

    def begin_shutdown(self, mode: str | None = None) -> None:
        """Stop taking requests; the child drains (or aborts). Sent from a thread: this runs
        in a signal handler, which may have interrupted a send on this same thread."""
        self._closing = True
        threading.Thread(target=self._post, args=(("shutdown", mode or self.drain),),
                         daemon=True).start()

    def stop(self, timeout: float | None = None) -> None:
        """Drain (or abort), let the child write its records, and join it."""
        self.begin_shutdown()
        self._drained.wait(timeout)
        self._post(("close",))
        self._closed.wait(timeout)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def wait_drained(self, timeout: float | None = None) -> bool:
        return self._drained.wait(timeout)

    # ----- requests -----------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, salt: str,
               loop: asyncio.AbstractEventLoop, sampling=None, *,
               stream: TokenStream | None = None, index: int = 0, n_param: int = 1,
               parent: int | None = None, settle: bool = False) -> tuple[int, TokenStream]:
        """EngineRuntime.submit: the checks here, the request to the child."""
        if self._closing or not self.healthy:
            with self._lock:
                self._rejected += 1
            raise Rejected("server is shutting down" if self._closing else
                           f"engine stopped: {self.error}")
        check_fits(len(prompt), max_tokens, self.max_model_len)
        if len(prompt) + max_tokens > self.info["max_feasible"]:
            err = self._call("check", len(prompt), int(max_tokens))
            if isinstance(err, Exception):
                raise err
        stream = stream or TokenStream(loop)
        with self._lock:
            rid = next(self._rids)
            self._streams[rid] = (stream, index)
            self._pending.append((rid, np.asarray(prompt, dtype=np.int32), int(max_tokens),
                                  salt, sampling, n_param, parent, settle))
        if not self._holding:
            self._flush()
        return rid, stream

    @contextmanager
    def admitting(self):
        """EngineRuntime.admitting: the requests submitted inside go in one message, which
        the child enters under the engine's lock."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding:
                self._flush()

    def _flush(self) -> None:
        """Send the requests submitted since the last flush (one message)."""
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._post(("submit", batch))

    def abort(self, rid: int, reason: str = "abort") -> bool:
        with self._lock:
            if self._streams.pop(rid, None) is None:
                return False
        self._flush()  # the child must know the request before its abort
        self._post(("abort", rid, reason))
        return True

    def settle(self, rid: int, reason: str | None) -> None:
        self._post(("settle", rid, reason))

    def reset_prefix_cache(self, timeout: float = 60.0) -> dict:
        if self._closing or not self.healthy:
            raise Rejected("server is shutting down" if self._closing else
                           f"engine stopped: {self.error}")
        result = self._call("reset", timeout)
        if isinstance(result, Exception):
            raise result
        return result

    def request_path(self, rid: int) -> dict | None:
        return self._paths.get(rid)

    def snapshot(self) -> dict:
        snap = self._snapshot
        if not snap:
            return snap
        return dict(snap, requests_rejected=snap.get("requests_rejected", 0) + self._rejected)

    # ----- the pipe -----------------------------------------------------------------------
    def _post(self, msg) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError):  # the child is gone: the reader ends the streams
            pass

    def _call(self, kind: str, *args, timeout: float = 120.0):
        seq = next(self._seq)
        slot = self._replies[seq] = [threading.Event(), None]
        self._post((kind, seq, *args))
        if not slot[0].wait(timeout):
            self._replies.pop(seq, None)
            return Rejected(f"the engine core did not answer {kind} within {timeout} s")
        return self._replies.pop(seq)[1]

    def _read(self) -> None:
        """Reader thread: the child's messages until it exits."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "step":
                self._on_step(*msg[1:])
            elif kind == "reply":
                slot = self._replies.get(msg[1])
                if slot is not None:
                    slot[1] = msg[2]
                    slot[0].set()
            elif kind == "drained":
                self.error = self.error or msg[1]
                self._drained.set()
            elif kind == "closed":
                self._closed.set()
        self._child_gone()

    def _on_step(self, items: list, snapshot: dict | None, paths: dict) -> None:
        if snapshot is not None:
            self._snapshot = snapshot
        self._paths.update(paths)
        per_loop: dict = {}
        with self._lock:
            streams = self._streams
            for rid, kind, value in items:
                last = kind == "finish" or (kind == "token" and value[2] is not None)
                entry = streams.pop(rid, None) if last else streams.get(rid)
                if entry is not None:
                    stream, index = entry
                    per_loop.setdefault(stream.loop, []).append((stream.queue,
                                                                 (index, kind, value)))
        for loop, puts in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # that loop is closed (client gone at shutdown)
                pass

    def _child_gone(self) -> None:
        """The pipe ended: open streams end with an error unless the child closed cleanly."""
        if not self._closed.is_set() and self.error is None:
            self.proc.join(5)
            self.error = f"engine core process exited (code {self.proc.exitcode})"
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream, index in streams.values():
            stream.push(index, "finish", ("error" if self.error else "abort", None))
        self._drained.set()
        self._closed.set()
        for slot in list(self._replies.values()):
            slot[1] = Rejected("the engine core process exited")
            slot[0].set()


def _put_all(puts: list) -> None:
    for queue, item in puts:
        queue.put_nowait(item)
