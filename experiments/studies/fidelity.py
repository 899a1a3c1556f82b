"""Simulator versus real: run cells for real, fit a step profile to them, simulate them.

`python -m experiments.studies.fidelity [--ledger-root ROOT] [--skip-real] [OVERRIDE ...]`
(`make fidelity`, which then writes the comparison with `analysis.studies.fidelity`):

1. campaign fidelity_real (conf/campaign/): every organization at a budget where memory
   binds and one where it does not, 3 seeds, the tiny checkpoint served over HTTP
   (executor=torch), one run at a time. Complete runs are kept; rerunning repairs the rest.
2. a bounded least-squares fit (serving_core.executor.fit_steps) of the CPU profile's free
   constants (logit_row_s held at 0: OMIT) to the steps ledgers of those runs; recorded
   with its residuals, the run ids it used and the overrides below in the `fidelity_fit`
   study table (ledgers.studies).
3. campaign fidelity_sim: the same cells in simulation under the fitted profile, passed as
   executor.* overrides (its name, sim:<name> in the runs ledger, tells fits apart).

OVERRIDEs go to both campaigns (e.g. hydra.sweeper.smoke=true); `--omit` names the fit's
terms held at 0 (default OMIT). The last line is JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import duckdb

import ledgers
from experiments.config.bad_input import EXIT_BAD_INPUT
from experiments.studies import study_parser
from ledgers.studies import new_study_id, now_iso, rows_to_columns, write_study
from serving_core.executor.fit_steps import OMITTABLE, STEP_COLUMNS, fit_steps
from serving_core.geometry import load_geometry

REAL, SIM = "fidelity_real", "fidelity_sim"
TABLE = "fidelity_fit"  # study table (ledgers.studies); page analysis/studies/
START_PROFILE = "cpu"  # conf/executor/cpu.yaml: the starting point of the fit
MODEL = "falcon_h1_tiny"
FITTED_FIELDS = ("name", "memory_efficiency", "matmul_efficiency", "attention_efficiency",
                 "scan_efficiency", "mixed_step_s", "per_step_overhead_s", "per_seq_overhead_s",
                 "indirection_overhead", "kv_page_s", "prefill_chunk_s", "logit_gemm_s",
                 "logit_row_s", "calibration")
# Held at 0 by the fit: the head's rows (sampling items padded to 4) exceed one block only in
# steps of more than 4 sampling sequences, so the row term is barely told from the pass and
# per-sequence terms; `--omit ''` frees it.
OMIT = ("logit_row_s",)


def _campaign(name: str, root: Path, overrides: list[str]) -> int:
    """One campaign through the runner (one run at a time: wall-clock timing)."""
    cmd = [sys.executable, "-m", "experiments.run", "-m", f"campaign={name}",
           f"ledger_root={root}", "hydra.launcher.n_jobs=1", *overrides]
    print("fidelity: " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def real_runs(root: Path) -> list[tuple[str, str, dict]]:
    """(run_id, org, steps table) of the adopted complete real runs of the newest executor."""
    con = ledgers.connect(root)
    try:
        runs = con.execute(
            "SELECT run_id, org, executor, created_at FROM runs WHERE campaign = ? AND "
            "status = 'complete' AND adopted ORDER BY created_at", [REAL]).df()
        if runs.empty:
            return []
        newest = runs["executor"].iloc[-1]
        runs = runs[runs["executor"] == newest]
        try:
            steps = con.execute(
                f"SELECT run_id, step, {', '.join(STEP_COLUMNS)} FROM steps WHERE campaign = ? "
                "ORDER BY run_id, step", [REAL]).df()
        except duckdb.BinderException:  # no file of the campaign has num_sampling
            steps = None
    finally:
        con.close()
    if steps is None or steps[steps["run_id"].isin(runs["run_id"])]["num_sampling"].isna().any():
        raise ValueError(f"campaign {REAL} under {root} has steps without num_sampling (runs "
                         "of the executor before the one LM head per step): refit on a fresh "
                         "ledger root")
    tables = dict(tuple(steps.groupby("run_id")))
    return [(str(run_id), str(org), tables[run_id].to_dict("list"))
            for run_id, org in zip(runs["run_id"], runs["org"], strict=True)
            if run_id in tables]


def fit_profile(root: Path, omit: tuple[str, ...] = OMIT) -> tuple[dict, list[str]]:
    """Fit the start profile to the real runs; record the fit in the `fidelity_fit` study
    table (one row per fitted numeric field of the profile the simulated half runs)."""
    runs = real_runs(root)
    if not runs:
        raise ValueError(f"campaign {REAL} has no complete runs under {root}")
    fit = fit_steps(load_geometry(MODEL), START_PROFILE, [(org, t) for _, org, t in runs],
                    source=f"campaign {REAL}", omit=omit)
    profile = asdict(fit.profile)
    record = {**profile, "fit": {
        "parameters": fit.parameters, "rows": fit.rows, "rms_rel_error": fit.rms_rel_error,
        "total_rel_error_by_org": fit.total_rel_error, "start": START_PROFILE,
        "runs": sorted(run_id for run_id, _, _ in runs)}}
    overrides = []
    for key in FITTED_FIELDS:
        value = profile[key]
        text = "'" + value.replace("'", "") + "'" if isinstance(value, str) else repr(value)
        overrides.append(f"executor.{key}={text}")
    fitted = [{"parameter": key, "value": float(profile[key])} for key in FITTED_FIELDS
              if not isinstance(profile[key], str)]
    write_study(root, TABLE, rows_to_columns(
        TABLE, fitted, study_id=new_study_id(), created_at=now_iso(), model=MODEL,
        start=START_PROFILE, profile=profile["name"], rows=fit.rows,
        rms_rel_error=fit.rms_rel_error, org_errors=json.dumps(fit.total_rel_error),
        runs=json.dumps(record["fit"]["runs"]), overrides=json.dumps(overrides)))
    return record, overrides


def main(argv: list[str] | None = None) -> int:
    p = study_parser("fidelity", __doc__)
    p.add_argument("--skip-real", action="store_true",
                   help="fit to the real runs already in the ledgers; run none")
    p.add_argument("--omit", default=",".join(OMIT),
                   help="fit terms held at 0, comma-separated (default %(default)s; "
                   "logit_gemm_s,logit_row_s: the step model without the logits GEMMs)")
    p.add_argument("overrides", nargs="*", help="overrides for both campaigns")
    args = p.parse_args(argv)
    root = Path(args.ledger_root)
    omit = tuple(x for x in args.omit.split(",") if x)
    bad = sorted(set(omit) - set(OMITTABLE))
    if bad:
        print(f"error: --omit={','.join(bad)}: allowed values are {', '.join(OMITTABLE)}",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.skip_real:
        rc = _campaign(REAL, root, args.overrides)
        if rc != 0:
            print(f"fidelity: campaign {REAL} exited {rc}; rerun to repair", file=sys.stderr)
            return rc
    try:
        record, overrides = fit_profile(root, omit)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    fit = record["fit"]
    print(f"fidelity: profile {record['name']} from {fit['rows']} steps of {len(fit['runs'])} "
          f"runs; rms relative step error {fit['rms_rel_error']:.3f}; summed step time "
          "error by org " + ", ".join(f"{o} {v:+.1%}" for o, v in
                                       fit["total_rel_error_by_org"].items()), file=sys.stderr)
    rc = _campaign(SIM, root, [*overrides, *args.overrides])
    if rc != 0:
        return rc
    print(json.dumps({"profile": record["name"], "real_runs": len(fit["runs"]),
                      "steps": fit["rows"], "rms_rel_error": fit["rms_rel_error"],
                      "ledger_root": str(root)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
