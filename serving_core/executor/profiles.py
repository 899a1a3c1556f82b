"""Device profiles and model cost coefficients for the simulated executor.

A `DeviceProfile` holds datasheet peaks, the achievable fractions of them and
host overheads; its values live in conf/executor/<name>.yaml, where each one is
documented. `ModelCosts` turns a Geometry into per-step byte and FLOP
coefficients (whole model, all layers), so the step-time model only multiplies
them by per-step token sums.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from serving_core.geometry import Geometry

EXECUTOR_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "executor"

# Tokens per chunk of the Mamba-2 chunked scan (SSD): the `chunk_size` default of the
# Mamba2 layer in the reference mamba_ssm implementation (Dao & Gu, 2024).
SSD_CHUNK_TOKENS = 256

STEP_MODELS = ("roofline", "additive")

# TQ4 codec work per K/V element (serving_core.kv_codec), NOMINAL A100 values, not fitted: the
# only real TQ4 steps are the torch executor's on this machine's CPU (experiments.studies.codec_fit
# fits them there, fit_steps.fit_codec), whose reference codec's cost says nothing about an
# A100 kernel, and no A100 is available to time one. The work runs on CUDA cores (A100
# datasheet: 19.5 TFLOP/s fp32 non-tensor), taken at half that rate. Decoding one element is
# about 4 operations (shift and mask out the nibble, codebook lookup, multiply by the norm;
# the attention product stays in the rotated basis, so no inverse rotation per key): 4 / 9.75e12.
# Encoding is about 17 (fast Walsh-Hadamard butterfly, log2(128) = 7, and the sign flip; the
# squared norm, 2; the scale, 1; a 4-step binary search over 15 boundaries; packing, 2; and a
# margin of 1): 17 / 9.75e12.
NOMINAL_KV_DECODE_S_PER_ELEMENT = 4 / 9.75e12
NOMINAL_KV_ENCODE_S_PER_ELEMENT = 17 / 9.75e12

# Profile fields that are fractions of a peak, in (0, 1].
_EFFICIENCY_FIELDS = (
    "memory_efficiency",
    "matmul_efficiency",
    "attention_efficiency",
    "scan_efficiency",
)


@dataclass(frozen=True)
class DeviceProfile:
    """One target device; see conf/executor/*.yaml for each value's source."""

    name: str
    hbm_bytes_per_s: float  # peak HBM bandwidth, bytes/s (datasheet)
    peak_flops: float  # peak dense bf16 tensor-core FLOP/s (datasheet)
    memory_efficiency: float  # sustained fraction of hbm_bytes_per_s
    matmul_efficiency: float  # achieved fraction of peak_flops in dense GEMMs
    attention_efficiency: float  # achieved fraction of peak_flops in attention kernels
    scan_efficiency: float  # achieved fraction of peak_flops in the Mamba-2 scan
    per_step_overhead_s: float  # host time per engine step not overlapped with the GPU
    per_seq_overhead_s: float  # host time per scheduled sequence per step
    max_num_batched_tokens: int  # engine token budget per step
    hbm_capacity_bytes: int  # device memory
    step_model: str = "roofline"  # roofline (max of memory and compute) | additive
    mixed_step_s: float = 0.0  # additive: extra seconds of a step mixing prefill and decode
    indirection_overhead: float = 0.0  # additive: S1/S2 fraction added to device time
    # additive: device seconds per scheduled sequence and step for each piece of paged
    # recurrent state its kernel gathers through the page mapping: per member page (S1: SSM
    # members + conv page; S2: SSM members) and per conv slot (S2). S0 and D0 keep a composite
    # contiguous (no gather). See serving_core.executor.simulated.paged_state_pieces.
    state_page_s: float = 0.0
    conv_slot_s: float = 0.0
    # additive: seconds per KV page a decode sequence's attention visits (an executor that
    # attends page by page, one kernel or dispatch per page: the torch executor's
    # serving_core.model.paged_attention.decode_attention) and per prefill chunk scheduled
    # (a forward's fixed cost). 0 for an engine with one fused kernel and one forward a step.
    kv_page_s: float = 0.0
    prefill_chunk_s: float = 0.0
    calibration: str = "datasheet"  # how the constants were obtained (provenance)
    # TQ4 codec seconds per K/V element decoded (read) and encoded (written); used only when
    # the geometry's kv_codec is not bf16. Default: the nominal A100 values above.
    kv_decode_s_per_element: float = NOMINAL_KV_DECODE_S_PER_ELEMENT
    kv_encode_s_per_element: float = NOMINAL_KV_ENCODE_S_PER_ELEMENT

    def __post_init__(self) -> None:
        if self.step_model not in STEP_MODELS:
            raise ValueError(
                f"step_model={self.step_model!r}: allowed values are {', '.join(STEP_MODELS)}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        for f in ("hbm_bytes_per_s", "peak_flops", "hbm_capacity_bytes"):
            value = getattr(self, f)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{f}={value} must be positive and finite")
        for f in _EFFICIENCY_FIELDS:
            value = getattr(self, f)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{f}={value} must lie in (0, 1]")
        for f in ("per_step_overhead_s", "per_seq_overhead_s", "mixed_step_s",
                  "indirection_overhead", "state_page_s", "conv_slot_s", "kv_page_s",
                  "prefill_chunk_s",
                  "kv_decode_s_per_element", "kv_encode_s_per_element"):
            value = getattr(self, f)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f}={value} must be finite and >= 0")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive"
            )

    @property
    def effective_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.memory_efficiency


_PROFILE_CASTS = {
    "name": str,
    "hbm_bytes_per_s": float,
    "peak_flops": float,
    "memory_efficiency": float,
    "matmul_efficiency": float,
    "attention_efficiency": float,
    "scan_efficiency": float,
    "per_step_overhead_s": float,
    "per_seq_overhead_s": float,
    "max_num_batched_tokens": int,
    "hbm_capacity_bytes": int,
    "step_model": str,
    "mixed_step_s": float,
    "indirection_overhead": float,
    "state_page_s": float,
    "conv_slot_s": float,
    "kv_page_s": float,
    "prefill_chunk_s": float,
    "calibration": str,
    "kv_decode_s_per_element": float,
    "kv_encode_s_per_element": float,
}
_OPTIONAL_FIELDS = {f.name for f in fields(DeviceProfile) if f.default is not MISSING}
assert set(_PROFILE_CASTS) == {f.name for f in fields(DeviceProfile)}


def available_devices() -> list[str]:
    return sorted(p.stem for p in EXECUTOR_CONF_DIR.glob("*.yaml"))


def device_profile_from_config(cfg: Any) -> DeviceProfile:
    """Build a profile from a mapping (dict, OmegaConf node); every field is required."""
    data = dict(cfg.items())
    data.pop("fit", None)  # a calibrated profile's fit report: provenance, not a parameter
    allowed = sorted(_PROFILE_CASTS)
    unknown = sorted(set(data) - set(_PROFILE_CASTS))
    if unknown:
        raise ValueError(f"executor config: unknown fields {unknown}; allowed fields are {allowed}")
    missing = sorted(set(_PROFILE_CASTS) - set(data) - _OPTIONAL_FIELDS)
    if missing:
        raise ValueError(f"executor config: missing fields {missing}")
    values = {}
    for key, cast in _PROFILE_CASTS.items():
        if key not in data:
            continue
        raw = data[key]
        # Reject bools (an int subclass) and fractional values of integer fields.
        if isinstance(raw, bool) or (
            cast is int and isinstance(raw, float) and not raw.is_integer()
        ):
            raise ValueError(f"{key}={raw!r} is not a valid {cast.__name__}")
        try:
            values[key] = cast(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key}={raw!r} is not a valid {cast.__name__}") from None
    return DeviceProfile(**values)


def load_device_profile(name_or_mapping: str | Any) -> DeviceProfile:
    """Load conf/executor/<name>.yaml by name, or build a profile from a mapping."""
    if isinstance(name_or_mapping, DeviceProfile):
        return name_or_mapping
    if isinstance(name_or_mapping, str):
        key = name_or_mapping.strip().lower()
        path = EXECUTOR_CONF_DIR / f"{key}.yaml"
        if not key or not path.exists():
            raise ValueError(
                f"executor={name_or_mapping!r}: allowed values are {available_devices()}"
            )
        with path.open() as fh:
            return device_profile_from_config(yaml.safe_load(fh))
    if hasattr(name_or_mapping, "items"):
        return device_profile_from_config(name_or_mapping)
    raise ValueError(
        f"executor={name_or_mapping!r}: expected a device name {available_devices()} or a mapping"
    )


@dataclass(frozen=True)
class ModelCosts:
    """Whole-model byte and FLOP coefficients of one serving step.

    Symbols: L layers, Ha attention heads, d head dim, H Mamba heads, P Mamba
    head dim, N d_state, G groups, Q the SSD chunk length.
    """

    weight_bytes: int  # num_params x dtype bytes; streamed once per step
    kv_bytes_per_token: int  # attention K+V of one token, all L layers
    state_bytes_per_composite: int  # one recurrent composite (SSM + conv), all L layers
    dense_flops_per_token: int  # 2 x num_params (one multiply-add per weight)
    attention_flops_per_pair: int  # 4 Ha d L: QK^T and PV per (query, key) pair
    scan_flops_per_token: int  # 4 H P N L: chunk-state build and read-out
    scan_flops_per_chunk: int  # 2 H P N L: passing the state across one chunk
    scan_flops_per_intra_pair: int  # 2 (H P + G N) L: intra-chunk C B^T and its product with X
    ssd_chunk_tokens: int  # Q
    codec_elements_per_token: int = 0  # K/V elements of one token, all L layers (0: bf16)

    @property
    def has_recurrent(self) -> bool:
        return self.state_bytes_per_composite > 0


def model_costs(geometry: Geometry, ssd_chunk_tokens: int = SSD_CHUNK_TOKENS) -> ModelCosts:
    """Derive a model's per-step cost coefficients from its geometry.

    Scan FLOPs follow the four stages of the Mamba-2 SSD algorithm for a chunk
    of q tokens (per layer): intra-chunk C B^T per group (2 q^2 N G) and its
    masked product with X per head (2 q^2 P H), chunk states B^T X (2 q N P H),
    output from the carried state C h (2 q N P H), and state passing
    (2 N P H per chunk). Per token: 4 HPN + 2 q (HP + GN) + 2 HPN / q; n new
    tokens split into chunks of at most Q. A single
    decode token (q = 1) gives ~6 HPN, close to the 5 HPN of the recurrent update
    (decay, outer product, add; read-out).
    """
    if ssd_chunk_tokens <= 0:
        raise ValueError(f"ssd_chunk_tokens={ssd_chunk_tokens} must be positive")
    g = geometry
    layers = g.num_layers
    recurrent = g.has_recurrent
    hpn = g.mamba_heads * g.mamba_head_dim * g.d_state
    intra = (g.mamba_inner + g.n_groups * g.d_state) if recurrent else 0
    return ModelCosts(
        weight_bytes=g.weight_bytes,
        kv_bytes_per_token=g.attention_bytes_per_token * layers,
        state_bytes_per_composite=g.composite_bytes * layers,
        dense_flops_per_token=2 * g.num_params,
        attention_flops_per_pair=4 * g.num_attention_heads * g.head_dim * layers,
        scan_flops_per_token=4 * hpn * layers,
        scan_flops_per_chunk=2 * hpn * layers,
        scan_flops_per_intra_pair=2 * intra * layers,
        ssd_chunk_tokens=ssd_chunk_tokens,
        codec_elements_per_token=(
            g.kv_elements_per_token * layers if g.kv_codec != "bf16" else 0
        ),
    )
