"""Per-layer state geometry of a hybrid attention + state-space model.

All storage arithmetic in the project happens in one normalized per-layer scope
(one representative layer). Byte counts are derived from model-config fields,
never typed in, so a new preset only needs its config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

MODEL_CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"

# K or V vector element count and packed size of the "tq4" codec: 256 elements
# stored as 128 packed bytes plus a 2-byte norm (130 / 512 of the bf16 payload).
TQ4_VECTOR_ELEMENTS = 256
TQ4_VECTOR_BYTES = 130
KV_CODECS = ("bf16", "tq4")
# A preset may carry the remaining architecture fields of a real checkpoint under this key
# (serving_core.model.make_tiny builds random-weight checkpoints from them).
ARCHITECTURE_KEY = "architecture"


@dataclass(frozen=True)
class Geometry:
    """Model fields and the per-layer state sizes derived from them."""

    name: str
    num_layers: int
    num_params: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    mamba_heads: int
    mamba_head_dim: int
    d_state: int
    n_groups: int
    d_conv: int
    dtype_bytes: int
    kv_codec: str = "bf16"
    d0_attention_fraction: float = 0.5
    max_model_len: int = 8192
    # N0's attention-kernel block alignment (tokens): 16 for vLLM's FlashAttention (A100),
    # 128 for its CPU backend (serving_core.layout); a backend property, set per run.
    n0_block_alignment: int = 16

    def __post_init__(self) -> None:
        if self.kv_codec not in KV_CODECS:
            raise ValueError(f"kv_codec={self.kv_codec!r}: allowed values are {KV_CODECS}")
        for f in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "max_model_len",
                  "n0_block_alignment"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f}={getattr(self, f)} must be positive")
        for f in ("mamba_heads", "mamba_head_dim", "d_state", "n_groups", "d_conv"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0")
        if self.mamba_heads > 0 and min(self.mamba_head_dim, self.d_state, self.d_conv) <= 0:
            raise ValueError("a recurrent model needs mamba_head_dim, d_state and d_conv > 0")
        if not 0.0 < self.d0_attention_fraction <= 1.0:
            raise ValueError(
                f"d0_attention_fraction={self.d0_attention_fraction} must lie in (0, 1]"
            )

    @property
    def has_recurrent(self) -> bool:
        return self.mamba_heads > 0

    @property
    def attention_bytes_per_token(self) -> int:
        """KV bytes of one token: KV heads x (K and V) x head dim elements.

        bf16 stores each element in dtype_bytes; tq4 packs every 256 elements into
        130 bytes (128 packed bytes + a 2-byte norm), 25.4% of the bf16 payload.
        """
        elements = self.num_kv_heads * 2 * self.head_dim
        if self.kv_codec == "tq4":
            return math.ceil(elements / TQ4_VECTOR_ELEMENTS) * TQ4_VECTOR_BYTES
        return elements * self.dtype_bytes

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def ssm_bytes(self) -> int:
        """Mamba2 SSM state: heads x head dim x d_state elements."""
        return self.mamba_inner * self.d_state * self.dtype_bytes

    @property
    def conv_bytes(self) -> int:
        """Causal-conv state over x, B and C channels for the last d_conv - 1 inputs."""
        if not self.has_recurrent:
            return 0
        conv_dim = self.mamba_inner + 2 * self.n_groups * self.d_state
        return conv_dim * (self.d_conv - 1) * self.dtype_bytes

    @property
    def composite_bytes(self) -> int:
        """Complete recurrent state of one sequence (SSM + conv)."""
        return self.ssm_bytes + self.conv_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def available_models() -> list[str]:
    return sorted(p.stem for p in MODEL_CONF_DIR.glob("*.yaml"))


def geometry_from_config(cfg: Any, **overrides: Any) -> Geometry:
    """Build a Geometry from a mapping (dict, OmegaConf node) of model fields."""
    data = dict(cfg.items()) if hasattr(cfg, "items") else dict(cfg)
    data.update(overrides)
    data.pop(ARCHITECTURE_KEY, None)  # checkpoint-building fields, not state geometry
    known = {f.name for f in fields(Geometry)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"model config: unknown fields {unknown}; allowed fields are {sorted(known)}"
        )
    return Geometry(**data)


def load_geometry(model: str, **overrides: Any) -> Geometry:
    """Load a preset from conf/model/<model>.yaml."""
    path = MODEL_CONF_DIR / f"{model}.yaml"
    if not path.exists():
        raise ValueError(f"model={model!r}: allowed values are {available_models()}")
    with path.open() as fh:
        return geometry_from_config(yaml.safe_load(fh), **overrides)
