"""Load a checkpoint folder into the torch model its config.json names (`model_type`).

falcon_h1: serving_core/model/falcon_h1.py; granitemoehybrid (attention and Mamba2 layers with
MoE blocks): serving_core/model/granite_moe_hybrid.py. Any other type is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_TYPES = ("falcon_h1", "granitemoehybrid")


def model_type(folder: str | Path) -> str:
    """The checkpoint's model_type (config.json); ValueError naming the allowed ones."""
    path = Path(folder) / "config.json"
    try:
        kind = json.loads(path.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint={str(folder)!r}: unreadable config.json ({err})") from None
    if kind not in MODEL_TYPES:
        raise ValueError(f"checkpoint={str(folder)!r}: model_type={kind!r}; allowed values are "
                         f"{', '.join(MODEL_TYPES)}")
    return kind


def model_class(folder: str | Path):
    if model_type(folder) == "granitemoehybrid":
        from serving_core.model.granite_moe_hybrid import GraniteMoeHybrid

        return GraniteMoeHybrid
    from serving_core.model.falcon_h1 import FalconH1

    return FalconH1


def load_model(folder: str | Path, device="cpu", dtype="float32", scan_chunk: int | None = None):
    """The checkpoint's model (FalconH1 or GraniteMoeHybrid), loaded."""
    return model_class(folder).load(folder, device, dtype, scan_chunk)
