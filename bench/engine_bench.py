"""Engine benchmarks: the default S2 b63 cell, 3,000 and 30,000 requests, start-up, profile.

Prints a table and writes bench/results/engine.json. Numbers, not assertions: the test
suite never times anything.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from experiments.runners.cell import run_cell

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _cfg(*overrides: str):
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="config", overrides=["write_ledgers=false", *overrides])


def time_cell(overrides: list[str], repeats: int) -> dict:
    """Engine wall seconds (workload loaded -> records complete), median of `repeats`."""
    walls, build = [], []
    summary = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = run_cell(_cfg(*overrides))
        total = time.perf_counter() - t0
        walls.append(result.summary["wall_seconds"])
        build.append(total - result.summary["wall_seconds"])
        summary = result.summary
    return {
        "overrides": overrides,
        "engine_wall_s": statistics.median(walls),
        "engine_wall_all_s": walls,
        "setup_s": statistics.median(build),
        "requests": summary["completed"] + summary["failed"],
        "sim_seconds": summary["sim_seconds"],
        "throughput_ledger": summary["throughput_ledger"],
    }


DEFAULT_CELL = ("org=s2", "budget=b63", "seed=42000", "write_ledgers=false")


def time_process() -> float:
    """Whole `python -m experiments.run` process for the default cell, seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "experiments.run", *DEFAULT_CELL], cwd=ROOT,
                   check=True, capture_output=True)
    return time.perf_counter() - t0


def profile_default(top: int = 15) -> str:
    cfg = _cfg("org=s2", "budget=b63")
    profiler = cProfile.Profile()
    profiler.enable()
    run_cell(cfg)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the 30,000-request cell")
    args = parser.parse_args(argv)
    rows = {"default_300": time_cell(["org=s2", "budget=b63"], repeats=5)}
    rows["n3000"] = time_cell(["org=s2", "budget=b63", "workload.num_requests=3000"], repeats=1)
    if not args.quick:
        rows["n30000"] = time_cell(
            ["org=s2", "budget=b63", "workload.num_requests=30000"], repeats=1
        )
    rows["process_default_s"] = time_process()
    profile = profile_default()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(rows, indent=2))
    (RESULTS / "engine_profile.txt").write_text(profile)
    print(
        f"{'cell':<14}{'requests':>9}{'engine s':>10}{'us/request':>12}{'setup s':>9}{'sim s':>9}"
    )
    for name, row in rows.items():
        if isinstance(row, dict):
            per = 1e6 * row["engine_wall_s"] / row["requests"]
            print(
                f"{name:<14}{row['requests']:>9}{row['engine_wall_s']:>10.3f}{per:>12.0f}"
                f"{row['setup_s']:>9.2f}{row['sim_seconds']:>9.1f}"
            )
    print(f"whole process, default cell: {rows['process_default_s']:.2f} s")
    print("\nprofile of the default cell (tottime):")
    print("\n".join(profile.splitlines()[:30]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
