"""State geometry of a hybrid attention + state-space model, from its layer pattern.

All storage arithmetic in the project happens in one normalized scope: one group of the
layer pattern (serving_core/layer_pattern.py), which the model holds `scope_layers` copies
of. For a model whose every layer carries attention and Mamba2 (Falcon-H1, no `layers`
key) the group is one layer, as before; for Granite-4.0-H (4 attention, 36 Mamba2 layers)
it is 1 attention and 9 Mamba2 layers, held 4 times. Byte counts are derived from
model-config fields, never typed in, so a new preset only needs its config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from serving_core import layer_pattern as lp
from serving_core import state_codec as sc
from serving_core.rules import rule

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
# Its public source and published size (serving_core/model_card.py): documentation only.
CARD_KEY = "card"


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
    # How the SSM state is stored (serving_core/state_codec.py); conv stays at dtype_bytes.
    state_codec: str = rule(sc.DEFAULT_STATE_CODEC, "how the recurrent SSM state is stored "
                            "(auto: the model's dtype)", allowed=sc.STATE_CODECS, config=False)
    d0_attention_fraction: float = 0.5
    max_model_len: int = 8192
    # N0's attention-kernel block alignment (tokens): 16 for vLLM's FlashAttention (A100),
    # 128 for its CPU backend (serving_core.memory.n0); a backend property, set per run.
    n0_block_alignment: int = 16
    # ----- the layer pattern (serving_core/layer_pattern.py); None: every layer hybrid+mlp
    layers: tuple[str, ...] | None = None
    sliding_window: int | None = None  # attention window (tokens); null: full attention
    attention_output_gate: bool = False  # q_proj also emits a per-head gate (Qwen3-Next)
    # Gated DeltaNet: key heads x key dim (q, k), value heads x value dim (v); conv kernel.
    gdn_key_heads: int = 0
    gdn_key_head_dim: int = 0
    gdn_value_heads: int = 0
    gdn_value_head_dim: int = 0
    gdn_conv: int = 0
    # Mamba (v1, Jamba): inner width, state size, dt rank, conv kernel.
    mamba1_d_inner: int = 0
    mamba1_d_state: int = 0
    mamba1_dt_rank: int = 0
    mamba1_d_conv: int = 0
    # Parameter-count fields (weights, not state): vocabulary, dense MLP and MoE blocks.
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense MLP width
    mlp_gated: bool = True  # gate, up, down (SwiGLU); false: up, down (Nemotron-H relu^2)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert (Qwen3-Next)
    # Weight-shared transformer blocks (Zamba2), called by the layers written `shared+...`:
    # distinct blocks, used in turn (num_mem_blocks); the width of their attention input
    # (Zamba2: 2 x hidden, the layer input concatenated with the original embedding); the
    # rank of the LoRA adapters each call has on the MLP's gate/up (0: none) and, with
    # shared_attention_adapter, on q, k and v. The attention fields above (heads, KV heads,
    # head_dim) and intermediate_size / mlp_gated describe the shared block.
    shared_blocks: int = 0
    shared_attention_hidden_size: int = 0
    shared_adapter_rank: int = 0
    shared_attention_adapter: bool = False

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", lp.expand_layers(self.layers))
            if len(self.layers) != self.num_layers:
                raise ValueError(f"model.layers lists {len(self.layers)} layers but "
                                 f"num_layers={self.num_layers}: they must agree")
        self._check_pattern_fields()
        if self.sliding_window is not None:
            raise ValueError(f"model.sliding_window={self.sliding_window!r}: no memory "
                             "organization holds sliding-window attention (each keeps every "
                             "block of a context); allowed value: null")
        if self.kv_codec not in KV_CODECS:
            raise ValueError(f"kv_codec={self.kv_codec!r}: allowed values are {KV_CODECS}")
        sc.codec(self.state_codec)  # one line naming model.state_codec and its values
        if self.state_codec == "int8" and self.state_layer_counts["mamba1"]:
            raise ValueError("model.state_codec='int8': a mamba1 layer has no heads to scale; "
                             "allowed values for this model are "
                             + ", ".join(c for c in sc.STATE_CODECS if c != "int8"))
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

    def _check_pattern_fields(self) -> None:
        """A pattern's mixers need their fields; a field no layer uses must stay 0."""
        if self.layers is None:
            self._check_shared_fields(0)
            return
        mixers = lp.mixer_counts(self.layers)
        ffns = lp.ffn_counts(self.layers)
        needs = {
            "gdn": ("gdn_key_heads", "gdn_key_head_dim", "gdn_value_heads",
                    "gdn_value_head_dim", "gdn_conv"),
            "mamba1": ("mamba1_d_inner", "mamba1_d_state", "mamba1_dt_rank", "mamba1_d_conv"),
        }
        for mixer, names in needs.items():
            for name in names:
                value = getattr(self, name)
                if mixers[mixer] and value <= 0:
                    raise ValueError(f"model.{name}={value}: a pattern with {mixer} layers "
                                     "needs it positive")
                if not mixers[mixer] and value:
                    raise ValueError(f"model.{name}={value}: no layer of model.layers is "
                                     f"{mixer}; allowed value is 0")
        if (mixers["mamba2"] or mixers["hybrid"]) and self.mamba_heads <= 0:
            raise ValueError(f"model.mamba_heads={self.mamba_heads}: a pattern with mamba2 "
                             "layers needs it positive")
        if not (mixers["mamba2"] or mixers["hybrid"]) and self.mamba_heads:
            raise ValueError(f"model.mamba_heads={self.mamba_heads}: no layer of model.layers "
                             "is mamba2 or hybrid; allowed value is 0")
        self._check_shared_fields(lp.shared_calls(self.layers))
        if ffns["moe"] and min(self.num_experts, self.experts_per_token,
                               self.expert_intermediate_size) <= 0:
            raise ValueError("model.num_experts, experts_per_token and "
                             "expert_intermediate_size: a pattern with moe layers needs them "
                             "positive")
        if ffns["mlp"] and self.intermediate_size <= 0:
            raise ValueError(f"model.intermediate_size={self.intermediate_size}: a pattern "
                             "with mlp layers needs it positive")
        if self.vocab_size <= 0:
            raise ValueError(f"model.vocab_size={self.vocab_size}: a preset with model.layers "
                             "needs it positive (its parameters are derived from the pattern)")

    def _check_shared_fields(self, calls: int) -> None:
        """Shared-block fields are positive with `shared+` layers and unset without them."""
        names = ("shared_blocks", "shared_attention_hidden_size")
        for name in names:
            value = getattr(self, name)
            if calls and value <= 0:
                raise ValueError(f"model.{name}={value}: a pattern with shared+ layers needs it "
                                 "positive")
        for name in (*names, "shared_adapter_rank", "shared_attention_adapter"):
            value = getattr(self, name)
            if not calls and value:
                raise ValueError(f"model.{name}={value}: no layer of model.layers is shared+; "
                                 f"allowed value is {False if isinstance(value, bool) else 0}")
        if self.shared_adapter_rank < 0:
            raise ValueError(f"model.shared_adapter_rank={self.shared_adapter_rank}: allowed "
                             "values are integers >= 0")
        if calls and self.intermediate_size <= 0:
            raise ValueError(f"model.intermediate_size={self.intermediate_size}: a pattern "
                             "with shared+ layers needs it positive (the shared block's MLP)")

    # ----- the pattern and its storage scope --------------------------------------------
    @property
    def layer_strings(self) -> tuple[str, ...]:
        """Every layer's `mixer+ffn` (a preset without a pattern: hybrid+mlp throughout)."""
        if self.layers is not None:
            return self.layers
        return (("hybrid+mlp" if self.mamba_heads > 0 else "attention+mlp"),) * self.num_layers

    @property
    def state_layer_counts(self) -> dict[str, int]:
        """Whole-model layers carrying attention KV and each recurrent state shape."""
        return lp.state_counts(self.layer_strings)

    @property
    def scope_layers(self) -> int:
        """g: copies of the storage scope (one group of the pattern) the model holds."""
        return lp.scope_copies(self.layer_strings)

    def _per_scope(self, kind: str) -> int:
        return self.state_layer_counts[kind] // self.scope_layers

    @property
    def attention_layers(self) -> int:
        return self.state_layer_counts["attention"]

    @property
    def has_recurrent(self) -> bool:
        return any(self.state_layer_counts[k] for k in ("mamba2", "gdn", "mamba1"))

    @property
    def layer_kv_bytes_per_token(self) -> int:
        """KV bytes of one token in one attention layer: KV heads x (K and V) vectors of
        head_dim elements.

        bf16 stores each element in dtype_bytes; tq4 stores each vector as head_dim x 4 / 8
        bytes of codes plus a 2-byte norm (Falcon-H1-7B: 2 x 2 x 66 = 264 B, 25.8 % of 1,024).
        """
        vectors = self.num_kv_heads * 2
        if self.kv_codec == "tq4":
            return vectors * (self.head_dim * TQ4_BITS // 8 + TQ4_NORM_BYTES)
        return vectors * self.head_dim * self.dtype_bytes

    @property
    def attention_bytes_per_token(self) -> int:
        """KV bytes of one token in the storage scope (its attention layers)."""
        return self._per_scope("attention") * self.layer_kv_bytes_per_token

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token, whole model (Granite-4.0-H: 4 layers x 2,048 = 8,192)."""
        return self.attention_bytes_per_token * self.scope_layers

    @property
    def recurrent_bytes_per_checkpoint(self) -> int:
        """One sequence's complete recurrent state, whole model (every recurrent layer)."""
        return self.composite_bytes * self.scope_layers

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements of one token in one attention layer (what the codec encodes)."""
        return self.num_kv_heads * 2 * self.head_dim

    def with_codec(self, kv_codec: str) -> Geometry:
        """The same model with another KV representation (kv_group_heads kept for tq4)."""
        group = self.kv_group_heads if kv_codec == "tq4" else None
        return replace(self, kv_codec=kv_codec, kv_group_heads=group)

    def with_state_codec(self, state_codec: str) -> Geometry:
        """The same model with its SSM state stored in another codec."""
        return replace(self, state_codec=state_codec)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def layer_ssm_shape(self, kind: str) -> tuple[int, int]:
        """(elements, heads) of one layer's SSM state of `kind` (mamba1: one head)."""
        if kind == "mamba2":
            return self.mamba_inner * self.d_state, self.mamba_heads
        if kind == "gdn":
            return (self.gdn_value_heads * self.gdn_key_head_dim * self.gdn_value_head_dim,
                    self.gdn_value_heads)
        if kind == "mamba1":
            return self.mamba1_d_inner * self.mamba1_d_state, 1
        raise ValueError(f"recurrent kind={kind!r}: allowed values are mamba2, gdn, mamba1")

    def layer_state_bytes(self, kind: str) -> tuple[int, int]:
        """(SSM, conv) bytes of one layer's recurrent state of `kind`.

        mamba2: heads x head dim x d_state; conv over x, B and C (inner + 2 G N channels).
        gdn: value heads x key dim x value dim; conv over q, k, v (2 Hk dk + Hv dv channels).
        mamba1: inner x d_state; conv over x (inner channels). Conv keeps d_conv - 1 inputs.
        The SSM elements are stored in the state codec's bytes (plus its per-head scales);
        the conv window at dtype_bytes.
        """
        e = self.dtype_bytes
        elements, heads = self.layer_ssm_shape(kind)
        ssm = sc.ssm_bytes(self.state_codec, elements, heads, e)
        if kind == "mamba2":
            conv_dim = self.mamba_inner + 2 * self.n_groups * self.d_state
            return ssm, conv_dim * (self.d_conv - 1) * e
        if kind == "gdn":
            conv_dim = (2 * self.gdn_key_heads * self.gdn_key_head_dim
                        + self.gdn_value_heads * self.gdn_value_head_dim)
            return ssm, conv_dim * (self.gdn_conv - 1) * e
        return ssm, self.mamba1_d_inner * (self.mamba1_d_conv - 1) * e

    @property
    def ssm_elements_per_checkpoint(self) -> int:
        """SSM elements of one sequence's recurrent state, whole model (what a codec
        encodes and decodes)."""
        counts = self.state_layer_counts
        return sum(counts[k] * self.layer_ssm_shape(k)[0] for k in ("mamba2", "gdn", "mamba1")
                   if counts[k])

    def _scope_state(self, part: int) -> int:
        return sum(self._per_scope(kind) * self.layer_state_bytes(kind)[part]
                   for kind in ("mamba2", "gdn", "mamba1") if self.state_layer_counts[kind])

    @property
    def ssm_bytes(self) -> int:
        """SSM state of the storage scope: every recurrent layer's, summed (one shape per
        layer kind; a scope with several shapes holds them side by side)."""
        return self._scope_state(0)

    @property
    def conv_bytes(self) -> int:
        """Causal-conv state of the storage scope, every recurrent layer's summed."""
        return self._scope_state(1)

    @property
    def composite_bytes(self) -> int:
        """Complete recurrent state of one sequence in the storage scope (SSM + conv)."""
        return self.ssm_bytes + self.conv_bytes

    def pattern_params(self) -> tuple[int, int]:
        """(total, active) parameters derived from the pattern (serving_core/param_count.py)."""
        from serving_core.param_count import count_params

        return count_params(self)

    @property
    def compute_params(self) -> int:
        """Parameters one token multiplies through: the published count for a preset
        without a pattern (Falcon-H1, as before); the pattern's active count otherwise."""
        return self.num_params if self.layers is None else self.pattern_params()[1]

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
    data.pop(CARD_KEY, None)  # source and published size, not state geometry
    if data.get("layers") is not None:
        data["layers"] = tuple(e if isinstance(e, str) else list(e) for e in data["layers"])
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
