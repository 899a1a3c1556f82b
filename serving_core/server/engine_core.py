"""The engine core process (`--engine-core process`): the engine, its step loop and its
metrics snapshot, in a process of its own, as vLLM's EngineCore.

The API process (serving_core/server/engine_client.py) keeps HTTP, tokenization,
detokenization, stop strings and SSE; it talks to this process over one duplex pipe.
Commands in (tuples, first item the kind): submit (a list of requests), abort, settle,
check (a request's feasibility error), reset, shutdown (begin draining), close (stop,
write the records, exit). Out: ("ready", info) or ("failed", exit code, message) once;
one ("step", items, snapshot, paths) per engine step that produced something (items:
(rid, kind, value) as TokenStream.push gets them; paths: the requests admitted in that
step), ("reply", seq, result) for a command that waits, ("drained", error) when the step
loop ends.

The child never outlives the API process: the pipe's end-of-file (its parent exited,
however) ends it at once; SIGINT and SIGTERM are the parent's to handle (a signal sent to
the process group does not cut the drain short). `OMP_WAIT_POLICY` and the other
environment of `config["env"]` are set before torch is imported here.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from serving_core.server.runtime import EngineRuntime

IDLE_SNAPSHOT_S = 1.0  # an idle engine core sends its snapshot at most this often


class _Outbox:
    """A request's TokenStream in the engine core: items wait for the step's message."""

    __slots__ = ("rid", "items")

    def __init__(self, rid: int, items: list) -> None:
        self.rid, self.items = rid, items

    def push(self, index: int, kind: str, value) -> None:
        self.items.append((self.rid, kind, value))


class CoreRuntime(EngineRuntime):
    """EngineRuntime whose streams are the step's message: `_publish` (after every step,
    and while idle) sends the tokens, the snapshot and the newly admitted paths."""

    def __init__(self, engine, send, **kwargs) -> None:
        self._send = send
        self.outbox: list = []
        self._new_paths: list[int] = []
        self._dirty = False
        self._sent_at = 0.0
        super().__init__(engine, **kwargs)
        record = self.paths.update

        def update(eng) -> list[int]:
            done = record(eng)
            self._new_paths += done
            return done

        self.paths.update = update

    def touch(self) -> None:
        """Counters changed outside a step (an abort, a settle): send the next snapshot."""
        self._dirty = True

    def _publish(self) -> None:
        super()._publish()
        now = time.monotonic()
        if not (self.outbox or self._new_paths or self._dirty
                or now - self._sent_at >= IDLE_SNAPSHOT_S):
            return
        items = self.outbox[:]  # the requests' _Outbox objects hold this list
        self.outbox.clear()
        paths = {rid: self.paths.paths[rid].to_dict() for rid in self._new_paths}
        self._new_paths, self._dirty, self._sent_at = [], False, now
        self._send(("step", items, self._snapshot, paths))


def _die_with_parent() -> None:
    """Signals are the API process's to handle; Linux: SIGKILL when the parent dies."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _build(config: dict):
    """(spec, engine, effective rules, runtime settings) of the spec, as `serve` builds them."""
    from serving_core.engine_spec import EngineSpec
    from serving_core.server.__main__ import build_served

    spec = EngineSpec.from_json(config["spec"])
    return (spec, *build_served(spec, config.get("threads", 0), config.get("malloc", "keep"),
                                config.get("split_workers", "auto"),
                                config.get("packed_linear", "auto"),
                                config.get("warm_up", "auto")))


def _ready_info(engine, effective: dict, settings: dict) -> dict:
    from serving_core.server.metrics import cache_config_labels

    return {"effective": effective, "settings": settings, "vocab_size": engine.vocab_size,
            "max_model_len": engine.geometry.max_model_len,
            "max_feasible": max_feasible(engine), "cache_info": cache_config_labels(engine),
            "pid": os.getpid()}


def max_feasible(engine) -> int:
    """The longest request (prompt + output tokens) the budget holds alone; the API
    process refuses longer ones with the engine's own message (a `check`)."""
    from serving_core.engine import shortfall

    lo, hi = 0, int(engine.geometry.max_model_len)
    if not shortfall(engine.mem, hi):
        return hi
    while lo < hi:  # shortfall grows with the length: the last length without one
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if not shortfall(engine.mem, mid) else (lo, mid - 1)
    return lo


def engine_main(conn, config: dict) -> None:
    """The engine core process: build, serve commands until `close` or the pipe's end."""
    _die_with_parent()
    os.environ.update(config.get("env") or {})
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)

    try:
        spec, engine, effective, settings = _build(config)
    except Exception as err:  # noqa: BLE001 - every failure goes back as one line
        from serving_core.server.__main__ import UsageError

        send(("failed", 2 if isinstance(err, UsageError) else 1, str(err)))
        return
    runtime = CoreRuntime(engine, send, max_model_len=engine.geometry.max_model_len,
                          drain=config.get("drain", "finish"))
    runtime.start()
    threading.Thread(target=_report_drained, args=(runtime, send), daemon=True).start()
    send(("ready", dict(_ready_info(engine, effective, settings),
                        snapshot=runtime.snapshot())))
    _serve(conn, send, runtime)
    runtime.stop()
    _write_records(config, spec, engine, runtime, effective)
    send(("closed",))


def _report_drained(runtime: CoreRuntime, send) -> None:
    runtime.wait_drained()
    send(("drained", runtime.error))


def _serve(conn, send, runtime: CoreRuntime) -> None:
    """Commands until `close`; the pipe's end (the API process is gone) ends the process."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the API process is gone: nobody to serve or to write for
        kind = msg[0]
        if kind == "close":
            return
        if kind == "submit":
            with runtime.admitting():  # the step loop takes them all, or none yet
                for request in msg[1]:
                    _submit(runtime, send, *request)
        elif kind == "abort":
            runtime.abort(msg[1], msg[2])
            runtime.touch()
        elif kind == "settle":
            runtime.settle(msg[1], msg[2])
            runtime.touch()
        elif kind == "shutdown":
            runtime.begin_shutdown(msg[1])
        elif kind in ("check", "reset"):
            threading.Thread(target=_reply, args=(runtime, send, *msg), daemon=True).start()


def _submit(runtime: CoreRuntime, send, rid, prompt, max_tokens, salt, sampling, n_param,
            parent, settle) -> None:
    """A request the API process numbered `rid`; one it can no longer take ends at once."""
    try:
        runtime.submit(prompt, max_tokens, salt, None, sampling,
                       stream=_Outbox(rid, runtime.outbox), n_param=n_param, parent=parent,
                       settle=settle, rid=rid)
    except Exception:  # noqa: BLE001 - shutting down or failed since the API process checked
        send(("step", [(rid, "finish", ("error", None))], None, {}))


def _reply(runtime: CoreRuntime, send, kind: str, seq: int, *args) -> None:
    """A command the API process waits for: the result, or the exception to raise there."""
    try:
        if kind == "check":
            runtime.engine.check_feasible([_Length(*args)])
            result = None
        else:
            result = runtime.reset_prefix_cache(*args)
    except Exception as err:  # noqa: BLE001 - raised again in the API process
        result = err
    send(("reply", seq, result))


class _Length:
    """What check_feasible reads of a request: its prompt and output lengths."""

    def __init__(self, prompt_tokens: int, output_tokens: int) -> None:
        self.prompt = range(int(prompt_tokens))
        self.output_tokens = int(output_tokens)


def _write_records(config: dict, spec, engine, runtime, effective: dict) -> None:
    from serving_core.server.__main__ import end_records
    from serving_core.server.records_out import load_writer

    writer = load_writer(config["records_writer"]) if config.get("records") else None
    end_records(config.get("records"), writer, spec, engine, runtime, effective)
