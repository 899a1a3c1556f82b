"""A Falcon-H1 checkpoint folder's config.json, and the geometry it implies.

The serving geometry (conf/model/) and the checkpoint must describe the same
state: KV heads, head dims, Mamba heads, d_state, groups, d_conv and layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from serving_core.geometry import Geometry

CHECKPOINT_FIELDS = "config.json and *.safetensors"


def read_config(folder: str | Path, model_type: str = "falcon_h1") -> dict:
    """config.json of a checkpoint folder of `model_type`; ValueError (one line) when absent,
    unreadable or of another model type."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"checkpoint={str(folder)!r}: not a directory (needs {CHECKPOINT_FIELDS})")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"checkpoint={str(folder)!r}: no config.json (needs {CHECKPOINT_FIELDS})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint={str(folder)!r}: unreadable config.json ({err})") from None
    if cfg.get("model_type") != model_type:
        raise ValueError(
            f"checkpoint={str(folder)!r}: model_type={cfg.get('model_type')!r}, "
            f"expected {model_type!r}"
        )
    return cfg


def mamba_inner(cfg: dict) -> int:
    d_ssm = cfg.get("mamba_d_ssm")
    return int(d_ssm) if d_ssm is not None else int(cfg["mamba_expand"] * cfg["hidden_size"])


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def mamba_head_dim(cfg: dict) -> int:
    d_head = cfg.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        return mamba_inner(cfg) // int(cfg["mamba_n_heads"])
    return int(d_head)


def geometry_fields(cfg: dict) -> dict[str, int]:
    """The Geometry fields a checkpoint config determines."""
    return {
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        "head_dim": head_dim(cfg),
        "mamba_heads": int(cfg["mamba_n_heads"]),
        "mamba_head_dim": mamba_head_dim(cfg),
        "d_state": int(cfg["mamba_d_state"]),
        "n_groups": int(cfg["mamba_n_groups"]),
        "d_conv": int(cfg["mamba_d_conv"]),
    }


def check_geometry(cfg: dict, geometry: Geometry, folder: str | Path) -> None:
    """ValueError naming every field where the checkpoint and the model preset disagree."""
    diffs = [
        f"{name}: checkpoint {value}, preset {getattr(geometry, name)}"
        for name, value in geometry_fields(cfg).items()
        if getattr(geometry, name) != value
    ]
    if diffs:
        raise ValueError(
            f"checkpoint={str(folder)!r} does not match model={geometry.name!r} "
            f"({'; '.join(diffs)})"
        )
