"""Per-run manifest: `<ledger_root>/manifests/campaign=<c>/<run_id>.json`.

A manifest holds what the runs row cannot: the whole resolved config, the rules
the engine actually ran (read back from it), the workload's identity (tokenizer,
dataset, length statistics), the planned units and the printed summary, next to
the config hash, code version, package versions, CPU and prereg plan hash. It is
written atomically before the runs row, so every complete run has one; a redone
run overwrites it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from experiments.runners.ledger_io import RunKey
from experiments.runners.provenance import code_version, environment, prereg_plan_hash
from ledgers.writer import atomic_open

MANIFEST_DIR = "manifests"
_EXCLUDED = ("hydra",)


def manifest_path(root: str | os.PathLike, campaign: str, run_id: str) -> Path:
    return Path(root) / MANIFEST_DIR / f"campaign={campaign}" / f"{run_id}.json"


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def build_manifest(
    cfg: DictConfig,
    key: RunKey,
    *,
    status: str,
    summary: Mapping | None = None,
    workload_meta: Mapping | None = None,
    units: Mapping | None = None,
    engine: Mapping | None = None,
    error: str = "",
    resolved: Mapping | None = None,
) -> dict:
    """The manifest of one run; `engine` is the rules the built engine ran
    (Engine.effective_rules(), read back from the engine), empty for a failed run;
    `resolved`: the config already as plain Python (resolved_config; None: converted here)."""
    if resolved is None:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    return {
        "run_id": key.run_id,
        "campaign": key.campaign,
        "question": key.question,
        "config_hash": key.config_hash,
        "seed": key.seed,
        "replicate": key.replicate,
        "status": status,
        "error": error,
        "prereg_plan_hash": prereg_plan_hash(key.question),
        "code_version": code_version(),
        "environment": environment(),
        "units": dict(units or {}),
        "engine": dict(engine or {}),
        "summary": dict(summary or {}),
        "workload": dict(workload_meta or {}),
        "config": {k: v for k, v in resolved.items() if k not in _EXCLUDED},
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_manifest(root: str | os.PathLike, manifest: Mapping) -> Path:
    """Write a manifest atomically (temp file, fsync, rename)."""
    path = manifest_path(root, manifest["campaign"], manifest["run_id"])
    text = json.dumps(manifest, indent=1, sort_keys=True, default=_plain, allow_nan=True)
    with atomic_open(path, "w") as fh:
        fh.write(text + "\n")
    return path


def read_manifest(root: str | os.PathLike, campaign: str, run_id: str) -> dict:
    return json.loads(manifest_path(root, campaign, run_id).read_text(encoding="utf-8"))
