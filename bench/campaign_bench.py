"""Campaign speed (P2): Q1 Exp 1a (S0, S1, S2 x b63, b83, b108 x 12 seeds = 108 runs of 300
requests) with 2 workers plus its analysis, and one whole `experiments.run` process.

Targets: campaign + analysis <= 90 s; one run process <= 1.0 s. Both are wall times
on a machine others may be loading too, so the load average is printed next to each. The
single run is split into import, compose, workload, engine and other seconds (medians).
Writes bench/results/campaign.json. `--part campaign|single` runs one part only;
`--start exec` times the fresh-process launcher for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
EXP1A = ("campaign=q1", "hydra.sweeper.only=[exp1a]", "org=s0,s1,s2")
PARTS = ("campaign", "single")


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} (1/5 min, {os.cpu_count()} cores)"


def time_campaign(workers: int, start: str) -> dict:
    """Q1 Exp 1a into a fresh ledger root, then the Q1 analysis (tables and figures)."""
    with tempfile.TemporaryDirectory(prefix="hsl-bench-") as tmp:
        root = Path(tmp) / "ledgers"
        cmd = [sys.executable, "-m", "experiments.run", "-m", *EXP1A, f"ledger_root={root}",
               f"hydra.sweep.dir={tmp}/sweep", f"hydra.launcher.n_jobs={workers}",
               f"hydra.launcher.start={start}"]
        before = load()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        campaign_s = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"campaign failed: {proc.stderr[-2000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        t1 = time.perf_counter()
        analysis = subprocess.run(
            [sys.executable, "-c", "import sys; from bench.campaign_bench import analyse; "
             "analyse(sys.argv[1], sys.argv[2])", str(root), f"{tmp}/report"],
            cwd=ROOT, capture_output=True, text=True)
        analysis_s = time.perf_counter() - t1
        if analysis.returncode != 0:
            raise RuntimeError(f"analysis failed: {analysis.stderr[-2000:]}")
        return {"runs": summary["planned"], "done": summary["done"], "workers": workers,
                "start": start, "campaign_s": campaign_s, "analysis_s": analysis_s,
                "total_s": campaign_s + analysis_s, "load_before": before, "load_after": load()}


def analyse(root: str, out: str) -> None:
    """The Q1 analysis as the report runs it: catalog, readouts, families, figures."""
    import ledgers
    from analysis.questions import q1

    con = ledgers.connect(root)
    result = q1.analyze(con)
    Path(out).mkdir(parents=True, exist_ok=True)
    q1.draw(result, Path(out))
    con.close()


SINGLE = ("org=s2", "budget=b63", "seed=42000")  # the default cell, named as users type it
PHASES = ("import", "compose", "workload", "engine", "other")


def _single_process(args: tuple[str, ...]) -> dict:
    """One whole `python -m experiments.run` process; its wall time split by the marks it
    writes (HSL_PHASES): import = interpreter start + experiments.run's imports; compose =
    Hydra (plugins, composition, logging) up to the task; workload = the cell before the
    engine (geometry, plan, profile, workload build from the mapped cache); engine = the
    engine loop; other = validation, ledger writes, output and exit."""
    with tempfile.TemporaryDirectory(prefix="hsl-bench-") as tmp:
        marks = Path(tmp) / "phases.json"
        cmd = [sys.executable, "-m", "experiments.run", *args, f"ledger_root={tmp}/ledgers"]
        used0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start, t0 = time.time(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "HSL_PHASES": str(marks)})
        wall = time.perf_counter() - t0
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"run failed: {proc.stderr[-2000:]}")
        m = json.loads(marks.read_text())
    split = {"import": m["imported"] - start, "compose": m["composed"] - m["imported"],
             "workload": m["run_seconds"] - m["engine_seconds"], "engine": m["engine_seconds"]}
    split["other"] = wall - sum(split.values())
    cpu = used.ru_utime + used.ru_stime - used0.ru_utime - used0.ru_stime
    # The same split in CPU seconds (what a loaded machine does not inflate); the cell's
    # engine/workload split is applied to its CPU time.
    cell_cpu = m["cpu_cell_end"] - m["cpu_cell_start"]
    engine_share = m["engine_seconds"] / max(m["cell_end"] - m["cell_start"], 1e-9)
    cpu_split = {"import": m["cpu_imported"], "compose": m["cpu_composed"] - m["cpu_imported"],
                 "engine": cell_cpu * engine_share, "workload": cell_cpu * (1 - engine_share)}
    cpu_split["other"] = cpu - sum(cpu_split.values())
    return {"process": wall, "cpu": cpu, **split,
            **{f"cpu_{k}": v for k, v in cpu_split.items()}}


def time_single(repeats: int) -> dict:
    """The default cell as one whole process, `repeats` times each without ledgers
    (write_ledgers=false) and writing them to a fresh root; medians of every phase. One
    unmeasured run first builds the workload cache if it is missing."""
    _single_process(("write_ledgers=false", *SINGLE))
    out = {"load_before": load()}
    for name, args in (("no_ledgers", ("write_ledgers=false", *SINGLE)), ("ledgers", SINGLE)):
        runs = [_single_process(args) for _ in range(repeats)]
        out[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out[name]["process_all"] = [r["process"] for r in runs]
    out["load_after"] = load()
    return out


def format_single(s: dict, repeats: int) -> str:
    lines = []
    for name, label in (("no_ledgers", "write_ledgers=false"), ("ledgers", "with ledgers")):
        r = s[name]
        parts = ", ".join(f"{p} {r[p]:.3f}" for p in PHASES)
        cpu_parts = ", ".join(f"{p} {r['cpu_' + p]:.3f}" for p in PHASES)
        lines.append(f"P2 single run ({label}, {' '.join(SINGLE)}, 300 requests): "
                     f"{r['process']:.2f} s median of {repeats} (target <= 1.0 s on a quiet "
                     f"machine) = {parts} s; CPU {r['cpu']:.2f} s = {cpu_parts} s")
    lines.append(f"  {s['load_before']} before, {s['load_after']} after")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.campaign_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=PARTS, action="append",
                        help="run only this part (repeatable; default: both)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--start", choices=("fork", "exec"), default="fork",
                        help="how the launcher starts each run (default fork)")
    parser.add_argument("--repeats", type=int, default=5, help="single-process repeats")
    args = parser.parse_args(argv)
    parts = args.part or list(PARTS)
    rows: dict = {}
    if "single" in parts:
        rows["single"] = s = time_single(args.repeats)
        print(format_single(s, args.repeats), flush=True)
    if "campaign" in parts:
        key = "campaign" if args.start == "fork" else f"campaign_{args.start}"
        rows[key] = c = time_campaign(args.workers, args.start)
        print(f"P2 Q1 Exp 1a: {c['runs']} runs ({c['done']} done) with {c['workers']} workers "
              f"({c['start']}): campaign {c['campaign_s']:.1f} s + analysis "
              f"{c['analysis_s']:.1f} s = {c['total_s']:.1f} s (target <= 90 s); "
              f"{c['load_before']} before, {c['load_after']} after", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "campaign.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
