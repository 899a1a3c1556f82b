"""Ledger scale (P4): a synthetic trace table of 10^7 rows across 100 runs, written by the
ledger writer, and the catalog's typical queries timed on it.

Queries (through `ledgers.connect`): trace events counted by type; ADOPT depth joined
to runs (by org and budget); per-run p99 of request latency and of ADOPT depth.
Target: <= 2 s each. Prints connect time, each query's first and median-of-3 warm
times, and the load average; writes bench/results/ledger.json. `--root DIR` keeps
(and reuses) the synthetic ledger; `--rows` and `--runs` change its size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ledgers import writer
from ledgers.arms import ARMS
from ledgers.schemas import TRACE_EVENTS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CAMPAIGN = "scale"
ORGS = tuple(a.name for a in ARMS.values() if not a.retention and a.org != "N0")
BUDGETS = ("b63", "b83", "b108")
REQUESTS_PER_RUN = 1000

QUERIES = {
    "count by event": "SELECT event, count(*) AS n FROM trace GROUP BY event ORDER BY event",
    "ADOPT depth joined to runs": """
        SELECT r.org, r.budget, count(*) AS adopts, avg(t.j_m1) AS mean_depth,
               quantile_cont(t.j_m1, 0.5) AS median_depth
        FROM trace t JOIN runs r USING (campaign, run_id)
        WHERE t.event = 'ADOPT' GROUP BY ALL ORDER BY ALL""",
    "per-run p99 latency (requests)": """
        SELECT run_id, quantile_cont(e2e_s, 0.99) AS e2e_p99,
               quantile_cont(ttft_s, 0.99) AS ttft_p99
        FROM requests WHERE status = 'finished' GROUP BY run_id ORDER BY run_id""",
    "per-run p99 ADOPT depth (trace)": """
        SELECT run_id, quantile_cont(j_m1, 0.99) AS depth_p99
        FROM trace WHERE event = 'ADOPT' GROUP BY run_id ORDER BY run_id""",
}


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f} (1/5 min, {os.cpu_count()} cores)"


def _strings(rng, values, n: int, p=None) -> pa.Array:
    index = pa.array(rng.choice(len(values), size=n, p=p).astype(np.int32))
    return pa.DictionaryArray.from_arrays(index, pa.array(values)).cast(pa.string())


def trace_columns(rng, n: int, num_requests: int) -> dict:
    """n trace events of one run (END last), vectorized; depths only on ADOPT/LOOKUP."""
    events = [e for e in TRACE_EVENTS if e != "END"]
    weights = np.array([3, 3, 2, 2, 1, 1, 1, 1, 0.5])[: len(events)]
    event = _strings(rng, events, n - 1, weights / weights.sum())
    event = pa.concat_arrays([event, pa.array(["END"])])
    is_depth = np.isin(np.asarray(event.to_numpy(zero_copy_only=False)), ["ADOPT", "LOOKUP"])
    depth = np.where(is_depth, rng.integers(0, 64, n) * 256, -1)
    request = np.where(np.arange(n) < n - 1, rng.integers(0, num_requests, n), -1)
    minus = np.full(n, -1)
    return {
        "seq": np.arange(n), "t_s": np.sort(rng.uniform(0, 300, n)), "step": np.arange(n) // 8,
        "event": event, "request_id": request, "episode": np.where(request >= 0, 0, -1),
        "kind": _strings(rng, ["attention", "checkpoint", ""], n),
        "boundary": depth, "key": _strings(rng, [f"k{i}" for i in range(64)] + [""], n),
        "a_m0": depth, "rmax_m0": depth, "j_m0": depth, "a_m1": depth, "rmax_m1": depth,
        "j_m1": depth, "cause_request_id": minus, "need": minus, "free": minus,
        "pool": _strings(rng, ["", "shared"], n), "dropped": np.zeros(n, dtype=np.int64),
        "write_errors": np.zeros(n, dtype=np.int64),
    }


def requests_columns(rng, n: int) -> dict:
    arrival = np.sort(rng.uniform(0, 300, n))
    ttft = rng.exponential(2.0, n)
    out = rng.integers(2, 1024, n)
    e2e = ttft + out * 0.03
    return {
        "request_id": np.arange(n), "arrival_s": arrival, "start_s": arrival + 0.1,
        "first_token_s": arrival + ttft, "finish_s": arrival + e2e,
        "prompt_tokens": rng.integers(100, 8000, n), "output_tokens": out,
        "target_output_tokens": out, "adopted_prefix_tokens": np.zeros(n, dtype=np.int64),
        "resume_adopted_tokens": np.zeros(n, dtype=np.int64),
        "preemptions": np.zeros(n, dtype=np.int64), "episodes": np.ones(n, dtype=np.int64),
        "context_id": rng.integers(-1, 8, n), "salt": [""] * n, "ttft_s": ttft, "e2e_s": e2e,
        "tpot_s": (e2e - ttft) / (out - 1), "status": ["finished"] * n,
    }


def runs_row(i: int) -> dict:
    org, budget = ORGS[i % len(ORGS)], BUDGETS[(i // len(ORGS)) % len(BUDGETS)]
    return {
        "question": "scale", "arm": org.upper(), "org": org.upper(), "budget": budget,
        "units": 63, "units_detail": {"shared": 63}, "cap": 63, "rate": 3.0,
        "arrival": "poisson", "q": 1.0, "f": 0.0, "retention_k": -1, "pinning_k": -1,
        "d0_attention_fraction": float("nan"), "reuse": "share", "seed": i, "replicate": 0,
        "trace": True, "executor": "sim:synthetic", "model": "falcon_h1_7b",
        "config_hash": f"cfg-{org}-{budget}", "prereg_plan_hash": "", "code_version": "bench",
        "environment": {}, "episode_start_s": 0, "episode_end_s": 300, "span_start_s": 0.0,
        "span_end_s": 300.0, "completed_requests": REQUESTS_PER_RUN, "failed_requests": 0,
        "output_tokens": 1, "throughput_ledger": 1.0, "throughput_span": 1.0,
        "status": "complete", "run_seconds": 0.0, "engine_seconds": 0.0,
    }


def build(root: Path, runs: int, rows: int) -> float:
    """Write `runs` runs of rows/runs trace events each; seconds taken (0 when reused)."""
    if len(writer.completed_run_ids(root, CAMPAIGN)) == runs:
        return 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(20260)
    for i in range(runs):
        tables = {"trace": trace_columns(rng, rows // runs, REQUESTS_PER_RUN),
                  "requests": requests_columns(rng, REQUESTS_PER_RUN)}
        writer.write_run(root, CAMPAIGN, f"run{i:04d}", tables, runs_row(i))
    return time.perf_counter() - t0


def time_queries(root: Path) -> dict:
    import ledgers

    t0 = time.perf_counter()
    con = ledgers.connect(root)
    out = {"connect_s": time.perf_counter() - t0}
    total = con.execute("SELECT count(*) FROM trace").fetchone()[0]
    out["trace_rows"] = total
    for name, sql in QUERIES.items():
        t1 = time.perf_counter()
        con.execute(sql).fetchall()
        first = time.perf_counter() - t1
        warm = []
        for _ in range(3):
            t1 = time.perf_counter()
            con.execute(sql).fetchall()
            warm.append(time.perf_counter() - t1)
        out[name] = {"first_s": first, "warm_s": statistics.median(warm)}
    con.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--root", help="keep the synthetic ledger here (reused when complete)")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--rows", type=int, default=10_000_000, help="trace rows in total")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsl-ledger-bench-") as tmp:
        root = Path(args.root) if args.root else Path(tmp) / "ledgers"
        built = build(root, args.runs, args.rows)
        before = load()
        result = {"runs": args.runs, "build_s": built, "load_before": before,
                  **time_queries(root), "load_after": load()}
    print(f"P4 ledger scale: {result['trace_rows']:,} trace rows in {args.runs} runs "
          f"(built in {built:.1f} s{' (reused)' if not built else ''}); catalog connect "
          f"{result['connect_s']:.2f} s; {before}")
    for name in QUERIES:
        q = result[name]
        print(f"P4   {name:<32} first {q['first_s']:.2f} s, warm {q['warm_s']:.2f} s "
              "(target <= 2 s)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ledger.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
