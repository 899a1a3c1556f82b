"""Per-layer state geometry of a hybrid attention + state-space model.

All storage arithmetic in the project happens in one normalized per-layer scope
(one representative layer). Byte counts are derived from model-config fields,
never typed in, so a new preset only needs its config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

MODEL_CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"

# The "tq4" codec (serving_core.kv_codec) stores each head's K or V vector of head_dim
# elements as 4-bit codes plus a 2-byte fp16 norm: head_dim / 2 + 2 bytes (66 for 128).
TQ4_BITS = 4
TQ4_NORM_BYTES = 2
KV_CODECS = ("bf16", "tq4")
# The representation a budget label's bytes are named in (serving_core.planner): bN and pN
# mean the same bytes under every codec, so arms with different codecs share a budget.
REFERENCE_KV_CODEC = "bf16"
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
    # tq4 on the torch executor: KV heads whose K/V a prefill rebuilds from packed pages at
    # once (None: all). Bounds the reconstruction's temporary; results do not depend on it.
    kv_group_heads: int | None = None
    d0_attention_fraction: float = 0.5
    max_model_len: int = 8192
    # N0's attention-kernel block alignment (tokens): 16 for vLLM's FlashAttention (A100),
    # 128 for its CPU backend (serving_core.memory.n0); a backend property, set per run.
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
        if self.kv_codec == "tq4" and (self.head_dim < 4 or self.head_dim & (self.head_dim - 1)):
            raise ValueError(
                f"head_dim={self.head_dim}: kv_codec='tq4' needs a power of two >= 4 "
                "(one Hadamard-rotated vector per head)"
            )
        if self.kv_group_heads is not None:
            g = self.kv_group_heads
            if self.kv_codec != "tq4":
                raise ValueError(f"kv_group_heads={g!r}: allowed only with kv_codec='tq4' "
                                 "(null otherwise)")
            if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= self.num_kv_heads:
                raise ValueError(f"kv_group_heads={g!r}: allowed values are null (all heads) "
                                 f"or 1..{self.num_kv_heads} (num_kv_heads)")
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
        """KV bytes of one token: KV heads x (K and V) vectors of head_dim elements.

        bf16 stores each element in dtype_bytes; tq4 stores each vector as head_dim x 4 / 8
        bytes of codes plus a 2-byte norm (Falcon-H1-7B: 2 x 2 x 66 = 264 B, 25.8 % of 1,024).
        """
        vectors = self.num_kv_heads * 2
        if self.kv_codec == "tq4":
            return vectors * (self.head_dim * TQ4_BITS // 8 + TQ4_NORM_BYTES)
        return vectors * self.head_dim * self.dtype_bytes

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements of one token (what the codec encodes and decodes)."""
        return self.num_kv_heads * 2 * self.head_dim

    def with_codec(self, kv_codec: str) -> Geometry:
        """The same model with another KV representation (kv_group_heads kept for tq4)."""
        group = self.kv_group_heads if kv_codec == "tq4" else None
        return replace(self, kv_codec=kv_codec, kv_group_heads=group)

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
