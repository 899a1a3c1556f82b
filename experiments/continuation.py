"""Continuation correctness: a reloaded state continues exactly like recomputation.

`python -m experiments.continuation` (make continuation). Per organization with
checkpoints and per prompt length N in {C-1, C, C+1, 2C-1, 2C, 2C+1} (C = its
checkpoint interval), on the tiny model with greedy decoding, EOS ignored:
1. generate the target cold, saving every published entry to the host tier
   (a save counts once its copy completed);
2. generate two interposer requests (other prompts, also saved);
3. reset the device cache (a new engine: fresh pools and arenas), keeping the tier;
4. reload the target's deepest held prefix into freshly allocated units and
   regenerate the target; compare every generated token id.
Per reload, B (restored prefix) must equal p (the prefix the scheduler credited at
admission), and p = C floor((N-1)/C) for a fully cached prompt. Rows go to the
`continuation` ledger table (<ledger_root>/continuation/), a report section to
<report_dir>/continuation.md; the LAST output line is
{"pairs": N, "equal": N, "B_equals_p": true}. Exit 1 when any pair differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.workload import RequestSpec
from ledgers.arms import ARMS, arm

# The arms with checkpoints this check covers (N0 and S2+Retention are not in it yet).
ORGS = tuple(a.name for a in ARMS.values() if not a.retention and a.org != "N0")
OFFSETS = ("C-1", "C", "C+1", "2C-1", "2C", "2C+1")
_OFFSET_VALUES = {"C-1": (1, -1), "C": (1, 0), "C+1": (1, 1), "2C-1": (2, -1), "2C": (2, 0),
                  "2C+1": (2, 1)}
VOCAB = 128_256
INTERPOSER_TOKENS = 2


@dataclass
class PairResult:
    org: str
    length_case: str
    n_tokens: int
    interval: int
    output_tokens: int
    restored_prefix_b: int
    credited_prefix_p: int
    expected_p: int
    tokens_equal: bool
    first_mismatch: int
    cold_tokens: str
    reload_tokens: str
    host_saves: int
    reload_units_fresh: bool

    @property
    def ok(self) -> bool:
        return (self.tokens_equal and self.restored_prefix_b == self.credited_prefix_p
                == self.expected_p and self.reload_units_fresh)


SCHEMA = pa.schema([
    ("org", pa.string()), ("length_case", pa.string()), ("n_tokens", pa.int64()),
    ("interval", pa.int64()), ("output_tokens", pa.int64()),
    ("restored_prefix_b", pa.int64()), ("credited_prefix_p", pa.int64()),
    ("expected_p", pa.int64()), ("tokens_equal", pa.bool_()), ("first_mismatch", pa.int64()),
    ("cold_tokens", pa.string()), ("reload_tokens", pa.string()), ("host_saves", pa.int64()),
    ("reload_units_fresh", pa.bool_()), ("model", pa.string()), ("created_at", pa.string()),
])


def _spec(rid: int, arrival: float, prompt: np.ndarray, output_tokens: int) -> RequestSpec:
    return RequestSpec(rid, arrival, prompt, output_tokens, -1, "")


def _generate(engine, specs, host=None) -> tuple[list[int], object]:
    """Serve requests together to completion; the first one's generated ids and Request.
    With a host tier, every step's published entries are saved (copies completed)."""
    for spec in specs:
        engine.add_request(spec)
    first = specs[0].request_id
    tokens: list[int] = []
    target = engine.num_finished + len(specs)
    arena = engine.executor.arena
    while engine.num_finished < target:
        out = engine.step()
        if out is not None:
            tokens += [tok for rid, tok in out.produced if rid == first]
        if host is not None:
            host.save_published(engine.mem, arena)
            host.complete(arena.device)
    req = next(r for r in engine.requests if r.rid == first)
    return tokens, req


def run_pair(model, geometry, org: str, budget: str, case: str, output_tokens: int,
             seed: int) -> PairResult:
    """The protocol for one organization and one prompt length."""
    from serving_core.builder import build_engine
    from serving_core.engine_spec import EngineSpec
    from serving_core.executor.host_tier import HostTier
    from serving_core.request import Request

    spec = EngineSpec.from_dict({
        "model": asdict(geometry), "org": arm(org).org, "budget": budget,
        "scheduler": {"cap": 8, "max_num_batched_tokens": 2048, "headroom": 0.0},
        "executor": {"kind": "torch", "checkpoint": "<in-memory model>",
                     "device": str(model.device), "dtype": str(model.dtype).split(".")[-1]},
        "clock": "virtual",
    })

    def fresh_engine():
        return build_engine(spec, model=model)

    cold = fresh_engine()
    C = cold.mem.checkpoint_interval
    k, d = _OFFSET_VALUES[case]
    n = k * C + d
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32) for _ in range(3)]
    target = _spec(0, 0.0, prompts[0], output_tokens)
    host = HostTier()
    cold_tokens, _ = _generate(cold, [target], host)
    # Interposers: two other prompts through the same device (their own state published).
    _generate(cold, [_spec(i, 0.0, prompts[i], INTERPOSER_TOKENS) for i in (1, 2)], host)
    saves = host.saves_completed

    warm = fresh_engine()  # device cache reset; the host tier is kept
    keys = Request(target, warm.mem.block_tokens).lookup_keys()
    empty = all(used == cached == 0 for used, cached, _, _ in warm.mem.usage().values())
    restored = host.restore(warm.mem, warm.executor.arena, keys)
    objs = restored.blocks + ([restored.checkpoint] if restored.checkpoint else [])
    # Fresh units: the reset device held nothing, and the reload's objects live there now.
    fresh = empty and all(o.valid and o.cached and warm.mem.live.get(o.oid) is o for o in objs)
    again = _spec(0, 0.0, prompts[0], output_tokens)
    reload_tokens, req = _generate(warm, [again])
    mismatch = next((i for i, (a, b) in enumerate(zip(cold_tokens, reload_tokens,
                                                      strict=False)) if a != b), -1)
    if mismatch < 0 and len(cold_tokens) != len(reload_tokens):
        mismatch = min(len(cold_tokens), len(reload_tokens))
    return PairResult(
        org=org, length_case=case, n_tokens=n, interval=C, output_tokens=output_tokens,
        restored_prefix_b=restored.prefix_tokens, credited_prefix_p=req.adopted_first,
        expected_p=C * ((n - 1) // C), tokens_equal=cold_tokens == reload_tokens,
        first_mismatch=mismatch, cold_tokens=json.dumps(cold_tokens),
        reload_tokens=json.dumps(reload_tokens), host_saves=saves, reload_units_fresh=fresh,
    )


def write_ledger(root: str | os.PathLike, rows: list[PairResult], model: str) -> Path:
    out = Path(root) / "continuation"
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    data = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name, value in {**asdict(row), "model": model, "created_at": now}.items():
            data[name].append(value)
    table = pa.Table.from_pydict(data, schema=SCHEMA)
    path = out / f"continuation-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.parquet"
    tmp = path.with_name("." + path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def report_section(rows: list[PairResult], model: str) -> str:
    lines = [
        "## Continuation correctness",
        "",
        f"Model {model}; greedy, EOS ignored; per organization and prompt length N the target",
        "is generated cold, two interposers run, the device cache is reset keeping the host",
        "tier, and the target is regenerated from the reloaded prefix. B: restored prefix;",
        "p: prefix the scheduler credited; expected p = C floor((N-1)/C).",
        "",
        "| org | N | C | B | p | expected p | tokens equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.org} | {r.n_tokens} ({r.length_case}) | {r.interval} | "
                     f"{r.restored_prefix_b} | {r.credited_prefix_p} | {r.expected_p} | "
                     f"{'yes' if r.tokens_equal else f'no (first at {r.first_mismatch})'} |")
    ok = sum(r.ok for r in rows)
    lines += ["", f"{ok} of {len(rows)} pairs continue exactly with B = p = expected p.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.continuation",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="models/falcon_h1_tiny")
    p.add_argument("--preset", default="falcon_h1_tiny")
    p.add_argument("--orgs", default=",".join(ORGS))
    p.add_argument("--cases", default=",".join(OFFSETS))
    p.add_argument("--budget", default="b63")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ledger-root", default=os.environ.get("LEDGER_ROOT", "ledgers/data"))
    p.add_argument("--report-dir", default="reports")
    args = p.parse_args(argv)
    orgs = [o.strip() for o in args.orgs.split(",") if o.strip()]
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [o for o in orgs if o not in ORGS]
    if bad or not orgs:
        print(f"error: --orgs={args.orgs!r}: allowed values are {', '.join(ORGS)}",
              file=sys.stderr)
        return 2
    bad = [c for c in cases if c not in OFFSETS]
    if bad or not cases:
        print(f"error: --cases={args.cases!r}: allowed values are {', '.join(OFFSETS)}",
              file=sys.stderr)
        return 2
    if args.output_tokens < 1:
        print(f"error: --output-tokens={args.output_tokens}: expected >= 1", file=sys.stderr)
        return 2
    from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
    from serving_core.geometry import load_geometry
    from serving_core.model.falcon_h1 import FalconH1

    try:
        geometry = load_geometry(args.preset)
        check_checkpoint(TorchExecutorConfig(args.checkpoint), geometry)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = FalconH1.load(args.checkpoint)
    rows = []
    for org in orgs:
        for i, case in enumerate(cases):
            t = time.perf_counter()
            row = run_pair(model, geometry, org, args.budget, case, args.output_tokens,
                           args.seed + i)
            rows.append(row)
            print(f"{org:>3} N={row.n_tokens:>5} ({case:>4}) C={row.interval}: "
                  f"B={row.restored_prefix_b} p={row.credited_prefix_p} "
                  f"expected {row.expected_p}; tokens {'equal' if row.tokens_equal else 'DIFFER'} "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    path = write_ledger(args.ledger_root, rows, args.preset)
    report = Path(args.report_dir)
    report.mkdir(parents=True, exist_ok=True)
    (report / "continuation.md").write_text(report_section(rows, args.preset))
    print(f"ledger: {path}; report: {report / 'continuation.md'}")
    equal = sum(r.tokens_equal for r in rows)
    b_eq_p = all(r.restored_prefix_b == r.credited_prefix_p == r.expected_p for r in rows)
    print(json.dumps({"pairs": len(rows), "equal": equal, "B_equals_p": b_eq_p}), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
