"""The order-balanced cold / repeat / reload TTFT study over HTTP (issue 21, section 3).

`python -m experiments.studies.reload_study` (make reload-study). Two fresh server pairs in
opposite orders, OFF then ON and ON then OFF (ON = a host tier of 1 GiB, TIER_CAPACITY_BYTES;
every server new, started and stopped here, never left running). The two servers of a pair
run at the same time and take turns (see run_pair): each gets one excluded warmup, then
per prompt length N (default 3,583, 3,584, 5,376: 2C-1, 2C, 3C for D0's C = 1,792 on
the tiny model) three trials, each a prompt with its own early document identity
(random token ids seeded by the document), greedy, EOS ignored, serial streaming
completions over loopback, a trial's requests on both servers back to back:
- cold: the prompt's first request on this server;
- repeat: the same prompt at once (the device prefix cache may serve it);
- reload (ON only): `POST /reset_prefix_cache`, then the prompt again (the host tier may
  restore it).
The servers run `engine.split_last_boundary=true` (their engine line says so), so a
prompt of exactly k C tokens publishes the state at N - C. Each request is classified
by its actual path from the server's record (usage.hsl_path, cross-checked with the
records the server writes at shutdown), never by the condition it was sent under.
Every prompt must give the same output ids under every condition and on every server;
any mismatch fails the study (exit 1). Rows go to the `reload_study` ledger table
(ledgers.studies); `python -m analysis.studies.reload_study` writes the report page. The LAST
output line is JSON {"requests", "paths": {path: count}, "mismatches", "ledger"}
(measured requests; the warmups are in the table, marked, but not counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from experiments.runners.http_client import ClientRecord, stream_one
from experiments.runners.server_process import ServerError, ServerProcess, hsl_server_command
from experiments.studies import study_parser
from experiments.workloads.workload import RequestSpec
from ledgers.arms import arm
from ledgers.studies import REQUEST_PATHS, new_study_id, now_iso, rows_to_columns, write_study

ORDERS = (("off_on", (False, True)), ("on_off", (True, False)))
VOCAB = 128_256
WARMUP_DOCUMENT = -1
TABLE = "reload_study"  # study table (ledgers.studies); page analysis/studies/
# The ON servers' host tier: 1 GiB holds every entry the study publishes (each prompt's
# chain and checkpoints, a few MiB on the tiny model), so no eviction interferes.
TIER_CAPACITY_BYTES = 1 << 30


def prompt_ids(n: int, document: int, seed: int) -> list[int]:
    """N token ids of one document: the whole prompt (from its first token) is the
    document's own, so no two documents share a prefix block."""
    rng = np.random.default_rng([seed, document + 1])
    return [int(t) for t in rng.integers(0, VOCAB, n)]


def server_spec(checkpoint: str, preset: str, org: str, budget: str, host_tier: bool,
                split: bool, max_batched: int = 2048, *,
                capacity_bytes: int = TIER_CAPACITY_BYTES, poison: bool = False):
    from serving_core.engine_spec import EngineSpec
    from serving_core.geometry import load_geometry

    return EngineSpec.from_dict({
        "model": asdict(load_geometry(preset)), "org": arm(org).org, "budget": budget,
        "scheduler": {"cap": 8, "max_num_batched_tokens": max_batched,
                      "split_last_boundary": split},
        "executor": {"kind": "torch", "checkpoint": checkpoint},
        "host_tier": {"capacity_bytes": capacity_bytes, "poison": poison} if host_tier else None,
    })


class Server:
    """One fresh server for a spec: started on enter, stopped (and its records read) on
    exit; `complete` sends one streamed request and waits for its last token."""

    def __init__(self, spec, tmp: Path) -> None:
        self.spec = spec
        self.dir = tmp
        self.records = tmp / "records"
        spec_path = tmp / "spec.json"
        spec_path.write_text(spec.to_json())
        self.proc = ServerProcess(hsl_server_command(spec=str(spec_path),
                                                     records=str(self.records)),
                                  health_timeout_s=300.0)
        self.effective: dict = {}
        self.recorded_paths: dict = {}

    def __enter__(self) -> Server:
        self.proc.start()
        self.effective = self.proc.engine_config() or {}
        for key in ("host_tier", "split_last_boundary"):
            want = self.spec.requested_rules()[key]
            if self.effective.get(key) != want:
                self.proc.stop(abort=True)
                raise ServerError(f"server runs {key}={self.effective.get(key)}, "
                                  f"requested {want}")
        return self

    def __exit__(self, *exc) -> None:
        code = self.proc.stop()
        paths = self.records / "request_paths.json"
        if paths.is_file():
            self.recorded_paths = json.loads(paths.read_text())
        if code not in (0, None) and exc[0] is None:
            raise ServerError(f"server exited with code {code}: {self.proc.stderr_tail()}")

    def complete(self, prompt: list[int], max_tokens: int) -> ClientRecord:
        spec = RequestSpec(0, 0.0, np.asarray(prompt, dtype=np.int32), max_tokens, -1, "")

        async def one():
            timeout = httpx.Timeout(10.0, read=1800.0)
            async with httpx.AsyncClient(timeout=timeout) as client:
                return await stream_one(client, self.proc.base_url + "/v1/completions", spec,
                                        time.perf_counter(),
                                        extra={"stream_options": {"include_usage": True}})

        rec = asyncio.run(one())
        if not rec.ok or not rec.path:
            raise ServerError(f"request failed ({rec.error or rec.finish_reason or 'no path'})"
                              f": {self.proc.stderr_tail()}")
        return rec

    def reset_prefix_cache(self) -> dict:
        r = httpx.post(self.proc.base_url + "/reset_prefix_cache", timeout=120.0)
        if r.status_code != 200:
            raise ServerError(f"POST /reset_prefix_cache: HTTP {r.status_code}: {r.text}")
        return r.json()


def run_pair(specs, *, pair: int, order: str, lengths: list[int], trials: int,
             output_tokens: int, warmup_tokens: int, seed: int,
             reference: dict[int, list[int]], interval: int, log) -> list[dict]:
    """Both servers of a pair up at once (`specs` in the pair's order); one warmup each, then
    per N and trial each condition on both servers back to back, so the OFF and ON cold
    requests of a trial see the same machine load. The server order alternates by trial
    (even: the pair's order; odd: reversed), and on the ON server so does the order of
    repeat and reload (even: cold, repeat, reset, reload; odd: cold, reset, reload, repeat;
    a repeat after a reload is served by the device as after a cold run, same B)."""
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = []
        for position, spec in enumerate(specs):
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="reload-study-"))
            servers.append((position, stack.enter_context(Server(spec, Path(tmp)))))

        def send(position: int, srv: Server, n: int, trial: int, document: int,
                 condition: str, tokens: int) -> None:
            tier = bool(srv.effective["host_tier"])
            split = bool(srv.effective["split_last_boundary"])
            prompt = prompt_ids(n, document, seed)
            rec = srv.complete(prompt, tokens)
            key = document if condition != "warmup" else None
            if key is not None:
                reference.setdefault(key, rec.token_ids)
            matches = key is None or rec.token_ids == reference[key]
            rows.append({
                "pair": pair, "order": order, "server": position, "host_tier": tier,
                "split_last_boundary": split, "n_tokens": n, "interval": interval,
                "trial": trial, "document": document, "condition": condition,
                **_served_fields(rec, n), "output_matches": matches, "_server": position,
            })
            log(f"pair {pair} ({order}) server {position} tier {'ON ' if tier else 'OFF'} "
                f"N={n} trial {trial} {condition:>6}: {rec.path} B/reused={rec.reused_tokens} "
                f"first batch {rec.first_batch_computed}/{rec.first_batch_scheduled} "
                f"TTFT {rows[-1]['ttft_s']:.3f} s{'' if matches else ' OUTPUT MISMATCH'}")

        for position, srv in servers:
            send(position, srv, warmup_tokens, -1, WARMUP_DOCUMENT, "warmup",
                 min(8, output_tokens))
        for i, n in enumerate(lengths):
            for trial in range(trials):
                document = i * trials + trial
                ordered = servers if trial % 2 == 0 else servers[::-1]
                for position, srv in ordered:
                    send(position, srv, n, trial, document, "cold", output_tokens)
                steps = ("repeat", "reload") if trial % 2 == 0 else ("reload", "repeat")
                for condition in steps:
                    for position, srv in ordered:
                        if condition == "reload":
                            if not srv.effective["host_tier"]:
                                continue
                            srv.reset_prefix_cache()
                        send(position, srv, n, trial, document, condition, output_tokens)
    _check_recorded_paths(rows, {position: srv.recorded_paths for position, srv in servers})
    return rows


def _served_fields(rec, n: int) -> dict:
    """A row's fields from the client's record of one request of N prompt tokens."""
    return {
        "path": rec.path, "reused_tokens": rec.reused_tokens,
        "restored_tokens": rec.restored_tokens, "suffix_tokens": n - rec.reused_tokens,
        "first_batch_computed": rec.first_batch_computed,
        "first_batch_scheduled": rec.first_batch_scheduled,
        "ttft_s": rec.first_token_s - rec.sent_s, "e2e_s": rec.finish_s - rec.sent_s,
        "output_tokens": len(rec.token_ids), "output_ids": json.dumps(rec.token_ids),
        "_server_id": rec.server_id,
    }


def _check_recorded_paths(rows: list[dict], recorded: dict) -> None:
    """Each server's own records (written at shutdown) must state the rows' paths; drops
    the rows' private _server and _server_id fields."""
    for row in rows:
        rid = row.pop("_server_id").rsplit("-", 1)[-1]
        got = recorded[row.pop("_server")].get(rid, {})
        if got.get("path") != row["path"]:
            raise ServerError(f"request {rid}: path {row['path']} in its usage, "
                              f"{got.get('path')} in the server's records")


def summary(rows: list[dict]) -> dict:
    measured = [r for r in rows if r["condition"] != "warmup"]
    return {"requests": len(measured),
            "paths": {p: sum(r["path"] == p for r in measured) for p in REQUEST_PATHS},
            "mismatches": sum(not r["output_matches"] for r in measured)}


def main(argv: list[str] | None = None) -> int:
    p = study_parser("reload_study", __doc__, model=True, run=True)
    p.add_argument("--org", default="d0")
    p.add_argument("--lengths", default="3583,3584,5376")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=1024)
    p.add_argument("--pairs", default="off_on,on_off",
                   help="server pairs to run, in order (off_on, on_off)")
    args = p.parse_args(argv)
    orders = dict(ORDERS)
    pairs = [s.strip() for s in args.pairs.split(",") if s.strip()]
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        lengths = []
    checks = [
        (not lengths or min(lengths) < 2, f"--lengths={args.lengths!r}: expected integers >= 2"),
        (args.trials < 1, f"--trials={args.trials}: expected >= 1"),
        (args.output_tokens < 1, f"--output-tokens={args.output_tokens}: expected >= 1"),
        (args.warmup_tokens < 1, f"--warmup-tokens={args.warmup_tokens}: expected >= 1"),
        (not pairs or any(x not in orders for x in pairs),
         f"--pairs={args.pairs!r}: allowed values are {', '.join(orders)}"),
    ]
    for bad, message in checks:
        if bad:
            print(f"error: {message}", file=sys.stderr)
            return 2
    try:
        arm(args.org)
        specs = {tier: server_spec(args.checkpoint, args.preset, args.org, args.budget, tier,
                                   True) for tier in (False, True)}
        from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
        from serving_core.memory import org_layout

        check_checkpoint(TorchExecutorConfig(args.checkpoint), specs[True].geometry())
        interval = org_layout(specs[True].geometry(), specs[True].org).checkpoint_interval
    except (ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    study_id = new_study_id()
    reference: dict[int, list[int]] = {}
    rows: list[dict] = []
    t0 = time.perf_counter()
    for pair, order in enumerate(pairs):
        rows += run_pair([specs[tier] for tier in orders[order]], pair=pair, order=order,
                         lengths=lengths, trials=args.trials, output_tokens=args.output_tokens,
                         warmup_tokens=args.warmup_tokens, seed=args.seed,
                         reference=reference, interval=interval,
                         log=lambda line: print(line, flush=True))
    path = write_study(args.ledger_root, TABLE, rows_to_columns(
        TABLE, rows, study_id=study_id, created_at=now_iso(), model=args.preset,
        org=specs[True].org, budget=args.budget))
    out = summary(rows)
    print(f"study {study_id}: {out['requests']} measured requests in "
          f"{time.perf_counter() - t0:.0f} s; ledger {path}", flush=True)
    print(json.dumps({**out, "ledger": str(path)}), flush=True)
    return 1 if out["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
