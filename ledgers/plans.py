"""Preregistered plan identity: the hash every runs row carries and analysis checks.

A leaf module (PyYAML and the standard library only) that the runner
(experiments, writing `prereg_plan_hash`) and the analysis (analysis.inference.prereg,
comparing it) both import, so the hash is computed one way.
"""

from __future__ import annotations

import functools
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


def safe_loader():
    """yaml.safe_load's loader, in C where PyYAML has libyaml: the same objects from every
    conf/ and plan file (checked), in a seventh of the CPU of the pure-Python one."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def plan_file_hash(question: str, plan_dir: str | Path = PLAN_DIR) -> str:
    """Hash of conf/prereg/<question>.yaml as loaded, "" when the question has no plan;
    ValueError when the file is not a plan mapping. Read once per process while the file is
    unchanged (every run records it, twice)."""
    path = Path(plan_dir) / f"{question}.yaml"
    if not question or not path.is_file():
        return ""
    stat = path.stat()
    return _file_hash(str(path.resolve()), stat.st_mtime_ns, stat.st_size, question)


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, _mtime_ns: int, _size: int, question: str) -> str:
    import yaml

    raw = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=safe_loader())
    if not isinstance(raw, Mapping):
        raise ValueError(f"question={question!r}: invalid preregistered plan: {path} is not "
                         f"a mapping")
    return plan_hash(raw)
