"""`python -m serving_core.server --spec SPEC.json [--port 0] [--host-tier-capacity-bytes N]`.

Builds the engine the spec describes (serving_core.builder: the same builder
every run uses; the spec is serving_core.engine_spec.EngineSpec as JSON, written
by `python -m experiments.serve` or the runner) and serves it over HTTP on
127.0.0.1 (unless --host says otherwise). `--port 0` picks a free port. Stdout
starts with `engine {JSON}` (the effective rules read back from the built
engine), `runtime {JSON}` (intra-op threads and allocator, read back from the process)
and then `listening on http://HOST:PORT`. SIGTERM/SIGINT shut down
gracefully (`--drain finish|abort`; a second signal aborts) and write the records
(--records). `--host-tier-capacity-bytes N` turns the spec's `host_tier` on with a
capacity of N bytes (save every published entry to a host tier, evicting least recently
used entries beyond N; restore held prefixes on admission and on resume; torch executor),
or sets the capacity of the spec's tier; the engine line states it either way. With
--records, `request_paths.json` holds every request's actual path and first batch.
Bad arguments or a bad spec: one line on stderr, exit 2; a model that does not load: exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time

from serving_core import env_switches
from serving_core.server.process_settings import PACKED_LINEAR, SPLIT_WORKERS, WARM_UP
from serving_core.server.runtime import DRAIN_MODES

ENGINE_LINE = "engine "  # stdout prefix of the effective rules
RUNTIME_LINE = "runtime "  # stdout prefix of the process settings (threads, allocator)


ENGINE_CORES = ("thread", "process")
OMP_WAITS = ("default", "passive")


class UsageError(ValueError):
    """Bad command-line input: exit 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving_core.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True,
                   help="engine spec JSON file (python -m experiments.serve writes one)")
    p.add_argument("--tokenizer", default="llama3", help="quicktok encoding for text, or none")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--records", help="folder for the engine's records at shutdown")
    p.add_argument("--records-writer", metavar="MODULE:FUNCTION",
                   help="the function that writes --records (required with it; see "
                        "server/records_out.py: the launchers in experiments/ name theirs)")
    p.add_argument("--drain", default="finish", help=f"one of {', '.join(DRAIN_MODES)}")
    p.add_argument("--host-tier-capacity-bytes", type=int, default=None, metavar="N",
                   help="host tier on with N bytes of capacity (else the spec's host_tier, "
                        "default off)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down (abort) when the launching process dies")
    p.add_argument("--malloc", default="keep", choices=("keep", "default"),
                   help="keep freed memory in the process (keep: glibc's mallopt, or "
                        "tcmalloc's release rate 0) or the allocator's defaults (see "
                        "server/process_settings.py)")
    p.add_argument("--threads", type=_threads_arg, default=0,
                   help="torch intra-op threads: auto (or 0: per phase, from a measurement at "
                        "start, see serving_core/executor/threads.py) or a count")
    p.add_argument("--split-workers", default="auto",
                   help="worker threads that take half of each large product (0, 1 or auto: "
                        "1 with one intra-op thread on >= 2 cores; serving_core/model/split.py)")
    p.add_argument("--packed-linear", default="auto",
                   help="oneDNN-prepacked linear weights where they give the plain bits (auto) "
                        "or none (off); serving_core/model/packed_linear.py")
    p.add_argument("--warm-up", default="auto",
                   help="a dummy prefill of max_num_batched_tokens and a decode of max_num_seqs "
                        "before serving (auto) or none (off); serving_core/model/warmup.py")
    p.add_argument("--engine-core", default="thread",
                   help=f"where the engine steps: one of {', '.join(ENGINE_CORES)} (a thread "
                        "of this process, or a child process of its own: docs/real_path.md)")
    p.add_argument("--omp-wait", default="default",
                   help=f"OpenMP waiting of a process engine core: one of "
                        f"{', '.join(OMP_WAITS)}")
    return p


def _threads_arg(text: str) -> int | str:
    """`--threads`: auto is 0; text that is no whole number stays text (_check refuses it)."""
    if text == "auto":
        return 0
    try:
        return int(text)
    except ValueError:
        return text


def _check(args) -> None:
    for flag, allowed in (("drain", DRAIN_MODES), ("engine-core", ENGINE_CORES),
                          ("omp-wait", OMP_WAITS), ("split-workers", SPLIT_WORKERS),
                          ("packed-linear", PACKED_LINEAR), ("warm-up", WARM_UP)):
        value = getattr(args, flag.replace("-", "_"))
        if value not in allowed:
            raise UsageError(f"--{flag}={value!r}: allowed values are {', '.join(allowed)}")
    try:
        env_switches.check()  # the engine's torch side reads them at first use
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port={args.port}: expected 0..65535")
    if not isinstance(args.threads, int) or args.threads < 0:
        raise UsageError(f"--threads={args.threads}: allowed values are 0 (auto) or a whole "
                         "number >= 1")
    if args.records and not args.records_writer:
        raise UsageError("--records: needs --records-writer MODULE:FUNCTION (python -m "
                         "experiments.serve passes the ledger's writer)")
    args.write_records = None  # no records asked for: the shutdown only ends the trace
    if args.records:
        from serving_core.server.records_out import load_writer

        try:
            args.write_records = load_writer(args.records_writer)
        except ValueError as err:
            raise UsageError(str(err)) from None


def load_spec(path: str):
    """The EngineSpec in a JSON file; UsageError names what is wrong."""
    from serving_core.engine_spec import EngineSpec

    try:
        with open(path, encoding="utf-8") as fh:
            return EngineSpec.from_json(fh.read())
    except OSError as err:
        raise UsageError(f"--spec={path!r}: cannot read ({err.strerror})") from None
    except (ValueError, TypeError) as err:
        raise UsageError(f"--spec={path!r}: {err}") from None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); UsageError when the address is taken.
    SO_REUSEADDR, as uvicorn sets on its own sockets: a server restarted on the port of one
    that just exited (gracefully or killed) binds at once instead of waiting out the old
    connections' TIME_WAIT; a port another process listens on is still refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(f"--port={port}: address {host}:{port} is already in use") from None
        raise UsageError(f"--host={host!r} --port={port}: cannot bind ({err.strerror})") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def build_engine(spec):
    """The engine of `spec` (serving_core.builder); a bad spec is a UsageError, a model that
    does not load a RuntimeError."""
    from serving_core.builder import build_engine as build

    if spec.executor.kind not in ("torch", "paced"):
        raise UsageError(f"--spec: executor.kind={spec.executor.kind!r}: the server runs "
                         f"torch (a model) or paced (the step model on a wall clock)")
    try:
        return build(spec)
    except ValueError as err:
        raise UsageError(f"--spec: {err}") from None


def eos_token_ids(spec, tokenizer) -> list[int]:
    """The ids that end a request (unless it sets ignore_eos), as vLLM gathers them: the
    checkpoint's generation_config.json (else config.json) eos_token_id, and the
    tokenizer's end of turn (`<|eot_id|>` for llama3: the chat template ends each turn
    with it, and serving_core/model/hf_tokenizer.py writes it as the checkpoint
    tokenizer's eos_token). None for an executor that does not run a model (paced): its
    tokens are the workload's synthetic ids, whose lengths are max_tokens exactly."""
    if spec.executor.kind != "torch":
        return []
    ids: list[int] = []
    checkpoint = getattr(spec.executor, "checkpoint", None)
    if checkpoint:
        from pathlib import Path

        for name in ("generation_config.json", "config.json"):
            path = Path(checkpoint) / name
            if path.is_file():
                value = json.loads(path.read_text()).get("eos_token_id")
                if value is not None:
                    ids += [value] if isinstance(value, int) else list(value)
                    break
    if tokenizer is not None:
        from serving_core.server.chat import EOT

        try:
            ids.append(int(tokenizer.encode_single_token(EOT)))
        except (KeyError, ValueError, RuntimeError):
            pass
    return sorted(set(ids))


def _watch_parent(server) -> None:
    parent = os.getppid()
    while not server.should_exit:
        if os.getppid() != parent:
            print("parent process gone: shutting down", file=sys.stderr, flush=True)
            server.handle_exit(signal.SIGTERM, None)
            return
        time.sleep(0.5)


def with_host_tier(spec, capacity_bytes: int | None):
    """`spec` with its host tier on at `capacity_bytes` (None: the spec as it is)."""
    if capacity_bytes is None:
        return spec
    from dataclasses import replace

    from serving_core.engine_spec import HostTierSpec

    poison = spec.host_tier.poison if spec.host_tier is not None else False
    try:
        return replace(spec, host_tier=HostTierSpec(capacity_bytes, poison))
    except ValueError as err:
        raise UsageError(f"--host-tier-capacity-bytes: {err}") from None


def write_records(folder, writer, spec, engine, runtime, effective: dict) -> None:
    """The engine's records (ending the trace with END) through `writer` into `folder`,
    with every request's actual path (request_paths.json)."""
    result = engine.result()
    summary = dict(result.summary, org=spec.org, budget=spec.budget,
                   clock_end_s=engine.clock.now(), engine_error=runtime.error,
                   engine_config=effective)
    out = writer(folder, result.tables, summary)
    paths = {str(rid): rec.to_dict() for rid, rec in runtime.paths.paths.items()}
    (out / "request_paths.json").write_text(json.dumps(paths))
    print(f"records written to {out}", flush=True)


def make_app(args, spec, runtime, *, vocab_size: int, cache_info: dict, on_shutdown=None):
    """The FastAPI app over `runtime`; `on_shutdown()` runs after the engine stopped."""
    from serving_core.server.app import create_app

    tokenizer = None
    if args.tokenizer != "none":
        import quicktok

        tokenizer = quicktok.get_encoding(args.tokenizer)
    return create_app(runtime, model_name=str(spec.model["name"]), vocab_size=vocab_size,
                      tokenizer=tokenizer, on_shutdown=on_shutdown,
                      eos_token_ids=eos_token_ids(spec, tokenizer), cache_info=cache_info)


def make_server(app, runtime):
    """A uvicorn server over `app` whose SIGTERM/SIGINT drain `runtime` (see the module
    docstring) and exit 0."""
    import uvicorn

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            # finish: keep listening and answer new requests 503 until the in-flight ones
            # are served, then exit; abort (or a second signal): end streams now
            if runtime.drain == "finish" and not (self.draining or self.should_exit):
                self.draining = True
                runtime.begin_shutdown()
                threading.Thread(target=self._exit_when_drained, args=(sig, frame),
                                 daemon=True).start()
                return
            runtime.begin_shutdown("abort" if (self.draining or self.should_exit) else None)
            super().handle_exit(sig, frame)

        def _exit_when_drained(self, sig, frame) -> None:
            runtime.wait_drained()
            uvicorn.Server.handle_exit(self, sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # A graceful shutdown exits 0: uvicorn's own handler re-raises the signal after
            # shutting down (exit status -SIGTERM); ours only records that it came.
            previous = {s: signal.signal(s, self.handle_exit)
                        for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))


def build_served(spec, threads, malloc: str, split_workers: str = "auto",
                 packed_linear: str = "auto", warm_up: str = "auto"):
    """(engine, effective rules, runtime settings) as either core builds its engine: the
    allocator kept, the intra-op threads applied, the engine built and warmed up (a torch
    model), its rules read back. OMP_* must already be in the environment (before torch is
    imported)."""
    from serving_core.server.process_settings import (
        apply_packed_linear,
        apply_split,
        apply_threads,
        keep_freed_memory,
        runtime_settings,
        warm_engine,
    )

    torch_kernels = spec.executor.kind == "torch"
    if torch_kernels and malloc == "keep":
        keep_freed_memory()
    apply_threads(threads, load_torch=torch_kernels)
    apply_split(split_workers, load_torch=torch_kernels)
    apply_packed_linear(packed_linear, load_torch=torch_kernels)
    engine = build_engine(spec)
    warmed = warm_engine(engine, warm_up) if torch_kernels else {}
    if not torch_kernels:  # set on a torch the build imported after all (a host tier)
        apply_threads(threads, load_torch=False)
    settings = dict(runtime_settings(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", ""),
                    **({"warmup": warmed} if warmed else {}))
    return engine, engine.effective_rules(), settings


def end_records(folder, writer, spec, engine, runtime, effective: dict) -> None:
    """At shutdown: the records into `folder` (write_records), or, with none asked for,
    only the trace ended with END."""
    from serving_core.server.process_settings import close_split

    close_split()  # the engine has stopped stepping: its split worker ends with it
    if folder:
        write_records(folder, writer, spec, engine, runtime, effective)
    else:
        engine.result()


def thread_core(args, spec):
    """(runtime, app, effective rules, runtime settings): the engine in this process,
    stepped by a thread (`--engine-core thread`)."""
    from serving_core.server.metrics import cache_config_labels
    from serving_core.server.runtime import EngineRuntime

    os.environ.update(omp_env(args.omp_wait))  # before torch is imported
    engine, effective, settings = build_served(spec, args.threads, args.malloc,
                                               args.split_workers, args.packed_linear,
                                               args.warm_up)
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len,
                            drain=args.drain)

    def on_shutdown() -> None:
        end_records(args.records, args.write_records, spec, engine, runtime, effective)

    app = make_app(args, spec, runtime, vocab_size=engine.vocab_size,
                   cache_info=cache_config_labels(engine), on_shutdown=on_shutdown)
    return runtime, app, effective, dict(settings, engine_core="thread")


def process_core(args, spec):
    """The same as `thread_core` with the engine in a child process (`--engine-core
    process`, serving_core/server/engine_client.py); the child writes the records."""
    from serving_core.server.engine_client import EngineCoreClient, EngineCoreError

    config = {"spec": spec.to_json(), "threads": args.threads, "malloc": args.malloc,
              "split_workers": args.split_workers, "packed_linear": args.packed_linear,
              "warm_up": args.warm_up,
              "records": args.records, "records_writer": args.records_writer,
              "env": omp_env(args.omp_wait)}
    try:
        runtime = EngineCoreClient(config, drain=args.drain)
    except EngineCoreError as err:
        if err.code == 2:
            raise UsageError(str(err)) from None
        raise RuntimeError(str(err)) from None
    app = make_app(args, spec, runtime, vocab_size=runtime.vocab_size,
                   cache_info=runtime.info["cache_info"])
    return runtime, app, runtime.info["effective"], runtime.settings()


def omp_env(policy: str) -> dict[str, str]:
    """The engine core's OpenMP waiting (`--omp-wait`): `passive` sleeps between kernels
    instead of spinning (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=0); `default` sets nothing."""
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"} if policy == "passive" else {}


def serve(args) -> int:
    spec = with_host_tier(load_spec(args.spec), args.host_tier_capacity_bytes)
    sock = bind(args.host, args.port)  # before the model loads: a taken port fails fast
    make_core = process_core if args.engine_core == "process" else thread_core
    runtime, app, effective, settings = make_core(args, spec)
    server = make_server(app, runtime)
    host, port = sock.getsockname()[:2]
    print(ENGINE_LINE + json.dumps(effective, sort_keys=True), flush=True)
    print(RUNTIME_LINE + json.dumps(settings, sort_keys=True), flush=True)
    print(f"listening on http://{host}:{port}", flush=True)
    if args.exit_with_parent:
        threading.Thread(target=_watch_parent, args=(server,), daemon=True).start()
    server.run(sockets=[sock])
    return 1 if runtime.error else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check(args)
        return serve(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
