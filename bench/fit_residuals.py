"""Residuals of the fidelity step fit, per kind of step, with and without the logits term.

Reads the real runs of campaign fidelity_real under a ledger root (`make fidelity` writes
them; experiments/studies/fidelity.py `real_runs`), fits the CPU profile to their steps
(serving_core/executor/fit_steps.py) twice: without the LM head's logits GEMMs
(logit_gemm_s and logit_row_s held at 0, the step model before them) and with them
(logit_row_s held at 0, as make fidelity fits), and prints per step kind (decode-only steps
by decode batch size, prefill-only, mixed) the steps, their mean measured duration, the
summed fitted over summed measured duration minus 1 and the rms relative error of each fit.

`python -m bench.fit_residuals [--ledger-root ROOT]`; writes bench/results/fit_residuals.json.
Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from bench.kernel_bench import RESULTS

FITS = {"without logits": ("logit_gemm_s", "logit_row_s"), "with logits": ("logit_row_s",)}
DECODE_BATCHES = ((1, 1), (2, 2), (3, 3), (4, 7), (8, 10**9))


def step_kinds(steps: dict) -> np.ndarray:
    """Each row's kind: decode B (or B-C), prefill, mixed."""
    num = np.asarray(steps["num_scheduled"])
    dec = np.asarray(steps["num_decode_seqs"])
    kinds = np.where(dec == 0, "prefill", "mixed").astype(object)
    for lo, hi in DECODE_BATCHES:
        name = f"decode {lo}" if lo == hi else (f"decode {lo}-{hi}" if hi < 10**9
                                                 else f"decode {lo}+")
        kinds[(dec == num) & (dec >= lo) & (dec <= hi)] = name
    return kinds


def main(argv: list[str] | None = None) -> int:
    from experiments.studies.fidelity import MODEL, START_PROFILE, real_runs
    from serving_core.executor.fit_steps import fit_steps, predict_steps
    from serving_core.geometry import load_geometry

    p = argparse.ArgumentParser(prog="python -m bench.fit_residuals", description=__doc__)
    p.add_argument("--ledger-root", default="ledgers/data")
    args = p.parse_args(argv)
    runs = real_runs(Path(args.ledger_root))
    if not runs:
        print(f"error: --ledger-root={args.ledger_root}: no complete fidelity_real runs "
              "(make fidelity writes them)", file=sys.stderr)
        return 2
    geometry = load_geometry(MODEL)
    pairs = [(org, table) for _, org, table in runs]
    kinds = np.concatenate([step_kinds(t) for _, t in pairs])
    measured = np.concatenate([np.asarray(t["duration_s"], dtype=float) for _, t in pairs])
    out: dict = {"ledger_root": args.ledger_root, "runs": len(runs), "steps": len(measured),
                 "fits": {}}
    preds = {}
    for label, omit in FITS.items():
        fit = fit_steps(geometry, START_PROFILE, pairs, omit=omit)
        preds[label] = np.concatenate([predict_steps(geometry, fit.profile, org, t)
                                       for org, t in pairs])
        out["fits"][label] = {"parameters": fit.parameters, "rms_rel_error": fit.rms_rel_error,
                              "total_rel_error_by_org": fit.total_rel_error}
        print(f"{label}: rms relative step error {fit.rms_rel_error:.3f}; " + ", ".join(
            f"{k} {v:.4g}" for k, v in fit.parameters.items()))
    order = [f"decode {lo}" if lo == hi else (f"decode {lo}-{hi}" if hi < 10**9
                                              else f"decode {lo}+")
             for lo, hi in DECODE_BATCHES] + ["prefill", "mixed"]
    print(f"{'kind':12s} {'steps':>6s} {'mean ms':>8s}  "
          + "  ".join(f"{lab + ' sum err':>24s} {'rms':>6s}" for lab in FITS))
    out["kinds"] = []
    for kind in order:
        m = kinds == kind
        if not m.any():
            continue
        row = {"kind": kind, "steps": int(m.sum()), "mean_ms": float(1e3 * measured[m].mean())}
        cells = []
        for label in FITS:
            pr, y = preds[label][m], measured[m]
            total = float(pr.sum() / y.sum() - 1.0)
            rms = float(math.sqrt(np.mean(((pr - y) / y) ** 2)))
            row[label] = {"sum_rel_error": total, "rms_rel_error": rms}
            cells.append(f"{total:+24.1%} {rms:6.3f}")
        out["kinds"].append(row)
        print(f"{kind:12s} {row['steps']:6d} {row['mean_ms']:8.2f}  " + "  ".join(cells))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fit_residuals.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
