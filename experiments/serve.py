"""`python -m experiments.serve [overrides] [--port 0] [--records DIR] ...`: serve one cell.

Composes the run config from the same overrides a run takes (`org=s2 budget=b63
executor=torch model=falcon_h1_tiny engine.admission=first_chunk ...`), checks it
like a run (bad input: one line, exit 2), turns it into the engine spec
(experiments.runners.spec.engine_spec, the translation every run uses) and replaces this
process with `python -m serving_core.server --spec FILE` plus the server flags
given after the overrides. A device profile (executor=a100, ...) is served by the
paced executor: the step model on a wall clock. `--spec-out FILE` keeps the spec
(else it goes to a temporary file the server reads at start).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra overrides, server flags): flags start with `--`."""
    overrides = [a for a in argv if "=" in a and not a.startswith("--")]
    flags = [a for a in argv if a not in overrides]
    return overrides, flags


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8000")
    p.add_argument("--records")
    p.add_argument("--drain", default="finish")
    p.add_argument("--tokenizer", default="llama3")
    p.add_argument("--exit-with-parent", action="store_true")
    p.add_argument("--host-tier-capacity-bytes", type=int, default=None, metavar="N",
                   help="host tier on (torch) with N bytes of capacity: the spec's host_tier")
    p.add_argument("--threads", default="0", help="torch intra-op threads (0: auto)")
    p.add_argument("--engine-core", default="thread",
                   help="thread or process: where the engine steps (the server checks it)")
    p.add_argument("--omp-wait", default="default", help="default or passive (OpenMP)")
    p.add_argument("--split-workers", default="auto",
                   help="0, 1 or auto: a worker thread for half of each large product")
    p.add_argument("--packed-linear", default="auto",
                   help="auto or off: oneDNN-prepacked linear weights where same bits")
    p.add_argument("--warm-up", default="auto",
                   help="auto or off: a dummy prefill and decode before serving")
    p.add_argument("--spec-out", help="write the engine spec here (kept)")
    return p


def server_spec(overrides: list[str]):
    """The EngineSpec the server runs for these run overrides (ValueError: bad input)."""
    from hydra import compose, initialize_config_dir

    from experiments.config.validation import validate_config
    from experiments.runners.spec import engine_spec

    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose(config_name="config", overrides=[*overrides, "write_ledgers=false"])
    validate_config(cfg, check_root=False)
    spec = engine_spec(cfg)
    if spec.executor.kind == "simulated":  # a server answers on a wall clock
        spec = dataclasses.replace(spec, executor=dataclasses.replace(spec.executor,
                                                                     kind="paced"))
    if spec.executor.kind == "external":
        raise ValueError("executor=vllm: vLLM serves itself; choose torch or a device profile")
    return spec


def main(argv: list[str] | None = None) -> int:
    from experiments.config.bad_input import bad_input_message, exit_bad_input

    overrides, flags = _split(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(flags)
    try:
        spec = server_spec(overrides)
    except Exception as err:
        message = bad_input_message(err)
        if message is None:
            raise
        exit_bad_input(message)
    if args.host_tier_capacity_bytes is not None:
        from serving_core.engine_spec import HostTierSpec

        try:
            spec = dataclasses.replace(spec,
                                       host_tier=HostTierSpec(args.host_tier_capacity_bytes))
        except ValueError as err:
            print(f"error: --host-tier-capacity-bytes: {err}", file=sys.stderr)
            return 2
    path = args.spec_out or os.path.join(tempfile.mkdtemp(prefix="hsl-spec-"), "spec.json")
    Path(path).write_text(spec.to_json() + "\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "serving_core.server", "--spec", path, "--host", args.host,
           "--port", str(args.port), "--drain", args.drain, "--tokenizer", args.tokenizer,
           "--threads", str(args.threads), "--engine-core", args.engine_core,
           "--omp-wait", args.omp_wait, "--split-workers", args.split_workers,
           "--packed-linear", args.packed_linear, "--warm-up", args.warm_up]
    from experiments.runners.server_process import RECORDS_WRITER, allocator_env

    if args.records:
        cmd += ["--records", args.records, "--records-writer", RECORDS_WRITER]
    if args.exit_with_parent:
        cmd.append("--exit-with-parent")

    env, _ = allocator_env("auto")  # tcmalloc when installed, as every launched server
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)  # the server takes this process's place (same pid)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
