"""Preregistered plan identity: the hash every runs row carries and analysis checks.

A leaf module (PyYAML and the standard library only) that the runner
(experiments, writing `prereg_plan_hash`) and the analysis (analysis.inference.prereg,
comparing it) both import, so the hash is computed one way.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAN_DIR = Path(__file__).resolve().parent.parent / "conf" / "prereg"


def canonical_json(plan: Mapping[str, Any]) -> str:
    """Sorted keys, no whitespace, UTF-8 text, no NaN: the form that is hashed."""
    try:
        return json.dumps(plan, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"plan: not representable as canonical JSON ({exc})") from exc


def plan_hash(plan: Mapping[str, Any]) -> str:
    """sha256 hex digest of the plan's canonical JSON."""
    return hashlib.sha256(canonical_json(plan).encode("utf-8")).hexdigest()


def plan_file_hash(question: str, plan_dir: str | Path = PLAN_DIR) -> str:
    """Hash of conf/prereg/<question>.yaml as loaded, "" when the question has no plan;
    ValueError when the file is not a plan mapping."""
    import yaml

    path = Path(plan_dir) / f"{question}.yaml"
    if not question or not path.is_file():
        return ""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, Mapping):
        raise ValueError(f"question={question!r}: invalid preregistered plan: {path} is not "
                         f"a mapping")
    return plan_hash(raw)
