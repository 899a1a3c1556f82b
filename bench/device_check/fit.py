"""Stage 3: the measured steps fitted into a device profile (serving_core/executor/fit_steps.py)
next to the datasheet profile's predictions for the same steps.

The fit starts from the `h200` datasheet profile (conf/executor/h200.yaml) and fits one
additive profile to every organization's steps at once (bounded least squares); per row
the result keeps the measured seconds, the fitted and the datasheet predictions and both
relative errors. The fitted profile is written as YAML loadable by
`load_device_profile` (its fit report under `fit:`, which the loader skips).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from serving_core.executor.fit_steps import STEP_COLUMNS, fit_steps
from serving_core.executor.profiles import load_device_profile
from serving_core.executor.simulated import build_step_model
from serving_core.geometry import Geometry

START = "h200"


def _by_org(rows: list[dict]) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for r in rows:
        table = out.setdefault(r["org"], {c: [] for c in STEP_COLUMNS})
        for c in STEP_COLUMNS:
            table[c].append(r[c])
    return out


def predictions(geometry: Geometry, profile, rows: list[dict]) -> list[float]:
    """Seconds the profile's step model gives each row (its own model kind: the datasheet
    profile's roofline, the fitted profile's additive model)."""
    models = {}
    out = []
    for r in rows:
        model = models.get(r["org"])
        if model is None:
            model = models[r["org"]] = build_step_model(geometry, profile, r["org"])
        extra = {"num_sampling": r["num_sampling"]} if getattr(
            model, "prices_sampling", False) else {}
        out.append(float(model.step_seconds(r["new_tokens"], r["context_tokens"],
                                            r["checkpoint_writes"], **extra)))
    return out


def run(geometry: Geometry, rows: list[dict], name: str, source: str) -> dict:
    tables = _by_org(rows)
    fit = fit_steps(geometry, START, sorted(tables.items()), name=name, source=source)
    profile = fit.profile
    measured = np.array([r["duration_s"] for r in rows])
    fitted = np.array(predictions(geometry, profile, rows))
    datasheet = np.array(predictions(geometry, load_device_profile(START), rows))
    table = [{"org": r["org"], "kind": r["kind"], "batch": r["num_decode_seqs"],
              "context": (r["decode_context_tokens"] // r["num_decode_seqs"]
                          if r["num_decode_seqs"] else 0),
              "prefill_tokens": r["prefill_tokens_initial"] + r["prefill_tokens_resume"],
              "measured_s": float(m), "fitted_s": float(f), "datasheet_s": float(d),
              "fitted_rel_error": float(f / m - 1.0), "datasheet_rel_error": float(d / m - 1.0)}
             for r, m, f, d in zip(rows, measured, fitted, datasheet, strict=True)]

    def rms(pred):
        return float(np.sqrt(np.mean((pred / measured - 1.0) ** 2)))

    return {
        "start": START, "rows": fit.rows, "parameters": fit.parameters,
        "rms_rel_error": fit.rms_rel_error, "total_rel_error": fit.total_rel_error,
        "rms_rel_error_check": rms(fitted), "datasheet_rms_rel_error": rms(datasheet),
        "profile": asdict(profile), "table": table,
    }


def profile_yaml(result: dict, header: str) -> str:
    """The fitted profile as a conf/executor/ YAML (fit report under `fit:`)."""
    import yaml

    body = yaml.safe_dump(result["profile"], sort_keys=False, width=100)
    report = {k: result[k] for k in ("start", "rows", "parameters", "rms_rel_error",
                                      "total_rel_error", "datasheet_rms_rel_error")}
    return header + body + "\n" + yaml.safe_dump({"fit": report}, sort_keys=False, width=100)
