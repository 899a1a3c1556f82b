"""`python -m serving_core.server --model DIR --org s2 --budget b63 [--port 0]`.

Loads the checkpoint, builds the engine over the organization's pools and serves
it over HTTP on 127.0.0.1 (unless --host says otherwise). `--port 0` picks a free
port. The first line on stdout is `listening on http://HOST:PORT`. SIGTERM/SIGINT
shut down gracefully (`--drain finish|abort`; a second signal aborts) and write the
records (--records).
Bad arguments: one line on stderr, exit 2; a model that does not load: exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time

from serving_core.server.runtime import DRAIN_MODES

ORGS = ("s0", "s1", "s2", "d0", "s2_retention")
EXECUTORS = ("torch", "simulated")


class UsageError(ValueError):
    """Bad command-line input: exit 2."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving_core.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (config.json + *.safetensors)")
    p.add_argument("--preset", help="model preset in conf/model (default: the folder's name)")
    p.add_argument("--org", required=True, help=f"one of {', '.join(ORGS)}")
    p.add_argument("--budget", required=True, help="bN or pN")
    p.add_argument("--cap", type=int, default=63, help="max running requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--headroom", type=float, default=0.0, help="admission headroom f")
    p.add_argument("--retention-k", type=int, default=2, help="S2+Retention threshold K")
    p.add_argument("--pinning-k", type=int, default=None, help="pinning threshold (none: off)")
    p.add_argument("--trace", action="store_true", help="record the per-event trace")
    p.add_argument("--executor", default="torch", help=f"one of {', '.join(EXECUTORS)}")
    p.add_argument("--profile", default="a100",
                   help="device profile of --executor simulated (conf/executor)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--scan-chunk", type=int, default=128,
                   help="tokens per chunk of the prefill SSD scan (torch executor)")
    p.add_argument("--tokenizer", default="llama3", help="quicktok encoding for text, or none")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--records", help="folder for the engine's records at shutdown")
    p.add_argument("--drain", default="finish", help=f"one of {', '.join(DRAIN_MODES)}")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down (abort) when the launching process dies")
    return p


def _check(args) -> None:
    if args.org not in ORGS:
        raise UsageError(f"--org={args.org!r}: allowed values are {', '.join(ORGS)}")
    if args.executor not in EXECUTORS:
        raise UsageError(f"--executor={args.executor!r}: allowed values are {', '.join(EXECUTORS)}")
    if args.drain not in DRAIN_MODES:
        raise UsageError(f"--drain={args.drain!r}: allowed values are {', '.join(DRAIN_MODES)}")
    for name, low in (("cap", 1), ("max_num_batched_tokens", 1), ("retention_k", 1),
                      ("scan_chunk", 1)):
        if getattr(args, name) < low:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= {low}")
    if args.pinning_k is not None and args.pinning_k < 1:
        raise UsageError(f"--pinning-k={args.pinning_k}: expected >= 1")
    if not 0.0 <= args.headroom < 1.0:
        raise UsageError(f"--headroom={args.headroom}: expected 0 <= f < 1")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port={args.port}: expected 0..65535")
    if args.executor == "torch" and not args.model:
        raise UsageError("--model: a checkpoint folder is required with --executor torch")
    if not args.preset:
        if not args.model:
            raise UsageError("--preset: a model preset is required without --model")
        args.preset = os.path.basename(os.path.normpath(args.model))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); UsageError when the address is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
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


class PacedExecutor:
    """The simulated executor on a wall clock: each step sleeps its modelled duration."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def execute(self, plan, checkpoint_writes):
        out = self.inner.execute(plan, checkpoint_writes)
        time.sleep(out.duration_s)
        return out


def build_engine(args):
    """(engine, vocab_size) for the parsed arguments; ValueError names the bad input."""
    from serving_core.geometry import load_geometry
    from serving_core.layout import normalize_org
    from serving_core.planner import plan_budget, units_for
    from serving_core.scheduler import SchedulerConfig

    try:
        geometry = load_geometry(args.preset)
    except ValueError as err:
        raise UsageError(f"--preset: {err}") from None
    try:
        plan = plan_budget(geometry, args.budget)
    except ValueError as err:
        raise UsageError(f"--budget: {err}") from None
    org = normalize_org(args.org)
    units = units_for(plan, org)
    sched_cfg = SchedulerConfig(
        cap=args.cap, max_num_batched_tokens=args.max_num_batched_tokens,
        headroom=args.headroom,
        retention_k=args.retention_k if args.org == "s2_retention" else None,
        pinning_k=args.pinning_k,
    )
    if args.executor == "simulated":
        from serving_core.engine import Engine, SimulatedExecutor, WallClock
        from serving_core.executor.profiles import load_device_profile
        from serving_core.executor.simulated import StepTimeModel
        from serving_core.request import GENERATED_TOKEN_SPACE

        device = load_device_profile(args.profile)
        model = StepTimeModel(geometry, device, org, 0.0)
        engine = Engine(geometry, org, units, sched_cfg, PacedExecutor(SimulatedExecutor(model)),
                        clock=WallClock(), trace=args.trace, budget_label=args.budget)
        return engine, GENERATED_TOKEN_SPACE
    from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
    from serving_core.executor.torch_executor import build_torch_engine
    from serving_core.model.falcon_h1 import FalconH1

    tcfg = TorchExecutorConfig(args.model, args.device, args.dtype, args.max_num_batched_tokens,
                               scan_chunk=args.scan_chunk)
    try:
        cfg = check_checkpoint(tcfg, geometry)
    except ValueError as err:
        raise UsageError(f"--model: {err}") from None
    try:
        model = FalconH1.load(args.model, args.device, args.dtype, args.scan_chunk)
    except Exception as err:  # corrupt weights, wrong shapes: the folder does not load
        raise RuntimeError(f"--model={args.model!r}: the checkpoint does not load "
                           f"({type(err).__name__}: {err})") from None
    engine = build_torch_engine(model, geometry, org, units, sched_cfg, trace=args.trace,
                                budget_label=args.budget)
    return engine, int(cfg["vocab_size"])


def _watch_parent(server) -> None:
    parent = os.getppid()
    while not server.should_exit:
        if os.getppid() != parent:
            print("parent process gone: shutting down", file=sys.stderr, flush=True)
            server.handle_exit(signal.SIGTERM, None)
            return
        time.sleep(0.5)


def serve(args) -> int:
    import uvicorn

    from serving_core.server.app import create_app
    from serving_core.server.records_out import write_records
    from serving_core.server.runtime import EngineRuntime

    sock = bind(args.host, args.port)  # before the model loads: a taken port fails fast
    engine, vocab = build_engine(args)
    tokenizer = None
    if args.tokenizer != "none":
        import quicktok

        tokenizer = quicktok.get_encoding(args.tokenizer)
    runtime = EngineRuntime(engine, max_model_len=engine.geometry.max_model_len,
                            drain=args.drain)

    def on_shutdown() -> None:
        result = engine.result()  # ends the trace with END
        if args.records:
            summary = dict(result.summary, org=args.org, budget=args.budget,
                           clock_end_s=engine.clock.now(), engine_error=runtime.error)
            out = write_records(args.records, result.tables, summary)
            print(f"records written to {out}", flush=True)

    app = create_app(runtime, model_name=args.preset, vocab_size=vocab, tokenizer=tokenizer,
                     on_shutdown=on_shutdown)

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

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    server = Server(config)
    host, port = sock.getsockname()[:2]
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
