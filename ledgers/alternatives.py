"""The sensitivity alternatives, as the runner and the analysis both read them.

conf/sensitivity/alternatives.yaml declares alternatives by hand; its `identified` key names
the file `make identify` writes (conf/calibration/identified.yaml), whose combinations (rules
per organization and fitted step-model constants) are added as `identified_<name>`, after
the hand-declared ones. A leaf module (PyYAML only): experiments.studies.sensitivity runs the
alternatives and analysis.studies.sensitivity evaluates them, so both see the same list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ALTERNATIVES_YAML = ROOT / "conf" / "sensitivity" / "alternatives.yaml"
IDENTIFIED_PREFIX = "identified_"


def identified_alternatives(path: str | Path) -> dict[str, dict[str, Any]]:
    """{identified_<name>: {overrides, by_org, why}} of an identified.yaml ({} if absent)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        return {}
    doc = yaml.safe_load(path.read_text()) or {}
    out = {}
    for name, spec in (doc.get("identified") or {}).items():
        rules = spec.get("rules") or {}
        executor = spec.get("executor") or {}
        overrides = [*(f"executor.{k}={float(v)!r}" for k, v in executor.items()),
                     f"executor.name=a100-identified-{name}", "executor.step_model=additive",
                     *rules.get("all", ())]
        out[f"{IDENTIFIED_PREFIX}{name}"] = {
            "overrides": overrides,
            "by_org": {org: list(v) for org, v in rules.items() if org != "all" and v},
            "why": (f"identified by make identify ({spec.get('label', name)}; fitting loss "
                    f"{spec.get('fit_loss')}, search {doc.get('search')})"),
        }
    return out


def load_alternatives(path: str | Path = ALTERNATIVES_YAML) -> dict[str, Any]:
    """The alternatives file as a mapping, its `identified` combinations merged in."""
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    extra = raw.get("identified")
    if extra:
        found = identified_alternatives(ROOT / extra)
        clash = sorted(set(found) & set(raw["alternatives"]))
        if clash:
            raise ValueError(f"{path}: alternatives {clash} are declared by hand and identified")
        raw["alternatives"] = {**raw["alternatives"], **found}
    return raw


__all__ = ["ALTERNATIVES_YAML", "IDENTIFIED_PREFIX", "identified_alternatives",
           "load_alternatives"]
