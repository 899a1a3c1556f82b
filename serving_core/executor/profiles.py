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

from serving_core.executor.moe_reads import moe_split
from serving_core.geometry import Geometry
from serving_core.state_codec import ops_per_element

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
# The host link a host tier's copies cross (serving_core/host_tier.py), NOMINAL A100 values,
# not fitted (nothing here measured an A100's copies): PCIe 4.0 x16, the A100-PCIE-40GB's host
# interface (NVIDIA A100 datasheet: "PCIe Gen4: 64 GB/s", both directions together), is
# 16 GT/s per lane x 16 lanes with 128b/130b encoding (PCI-SIG PCIe 4.0 base specification):
# 16e9 x 16 x 128 / 130 / 8 = 31.5e9 B/s per direction, before protocol overhead. The
# per-transfer latency, 10 us, is a nominal round figure for issuing one DMA copy (no
# datasheet states it).
NOMINAL_HOST_LINK_BANDWIDTH_BPS = 16e9 * 16 * 128 / 130 / 8
NOMINAL_HOST_LINK_LATENCY_S = 10e-6
NOMINAL_KV_DECODE_S_PER_ELEMENT = 4 / 9.75e12
NOMINAL_KV_ENCODE_S_PER_ELEMENT = 17 / 9.75e12
# SSM state codec work (model.state_codec, serving_core/state_codec.py), NOMINAL A100 value,
# not fitted (no A100 here): seconds per elementary operation on CUDA cores, the TQ4 rate
# above (19.5 TFLOP/s fp32 non-tensor at half), 1 / 9.75e12; the codec states its operations
# per element (fp8_e4m3: 1 to decode, 5 to encode with stochastic rounding).
NOMINAL_STATE_CODEC_S_PER_OP = 1 / 9.75e12

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
    # additive: the LM head, one product per step over the items that sample (the torch
    # executor's `_sample_heads`; none for a step of mid-prompt chunks), its rows padded to
    # a multiple of logit_block_rows (serving_core/model/head_rows.py; bench/logits_bench.py
    # times it): logit_gemm_s per pass over the head's weight, logit_row_s per padded row
    # (AdditiveStepModel.logit_seconds). 0 for an engine whose head costs are in its memory
    # and dense terms (the A100 profile).
    logit_gemm_s: float = 0.0
    logit_row_s: float = 0.0
    logit_block_rows: int = 4
    calibration: str = "datasheet"  # how the constants were obtained (provenance)
    # TQ4 codec seconds per K/V element decoded (read) and encoded (written); used only when
    # the geometry's kv_codec is not bf16. Default: the nominal A100 values above.
    kv_decode_s_per_element: float = NOMINAL_KV_DECODE_S_PER_ELEMENT
    kv_encode_s_per_element: float = NOMINAL_KV_ENCODE_S_PER_ELEMENT
    # SSM state codec seconds per operation (serving_core/state_codec.py ops per element);
    # used only when the state codec transcodes. Default: the nominal A100 value above.
    state_codec_s_per_op: float = NOMINAL_STATE_CODEC_S_PER_OP
    # The host link of a host tier (bytes/s per direction, seconds per copy); default: the
    # nominal A100 PCIe 4.0 x16 values above.
    host_link_bandwidth_Bps: float = NOMINAL_HOST_LINK_BANDWIDTH_BPS
    host_link_latency_s: float = NOMINAL_HOST_LINK_LATENCY_S
    # Tensor parallelism over `tensor_parallel` identical GPUs (the peaks and the capacity
    # above are one GPU's): weights, KV, state and FLOPs split evenly, every GPU working in
    # parallel, plus the all-reduces (serving_core.executor.tensor_parallel) over a link of
    # tp_link_bandwidth_Bps per direction and tp_link_latency_s per all-reduce. 1: one GPU.
    tensor_parallel: int = 1
    tp_link_bandwidth_Bps: float = 0.0
    tp_link_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.step_model not in STEP_MODELS:
            raise ValueError(
                f"step_model={self.step_model!r}: allowed values are {', '.join(STEP_MODELS)}"
            )
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        for f in ("hbm_bytes_per_s", "peak_flops", "hbm_capacity_bytes",
                  "host_link_bandwidth_Bps"):
            value = getattr(self, f)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{f}={value} must be positive and finite")
        for f in _EFFICIENCY_FIELDS:
            value = getattr(self, f)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{f}={value} must lie in (0, 1]")
        for f in ("per_step_overhead_s", "per_seq_overhead_s", "mixed_step_s",
                  "indirection_overhead", "state_page_s", "conv_slot_s", "kv_page_s",
                  "prefill_chunk_s", "logit_gemm_s", "logit_row_s", "kv_decode_s_per_element",
                  "kv_encode_s_per_element", "host_link_latency_s", "state_codec_s_per_op"):
            value = getattr(self, f)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f}={value} must be finite and >= 0")
        if isinstance(self.logit_block_rows, bool) or not isinstance(
                self.logit_block_rows, int) or self.logit_block_rows < 1:
            raise ValueError(f"logit_block_rows={self.logit_block_rows!r}: allowed whole "
                             "numbers >= 1")
        if isinstance(self.tensor_parallel, bool) or not isinstance(
                self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={self.tensor_parallel!r}: allowed whole "
                             "numbers >= 1")
        for f in ("tp_link_bandwidth_Bps", "tp_link_latency_s"):
            value = getattr(self, f)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f}={value} must be finite and >= 0")
        if self.tensor_parallel > 1 and self.tp_link_bandwidth_Bps <= 0:
            raise ValueError(f"tp_link_bandwidth_Bps={self.tp_link_bandwidth_Bps}: a "
                             "tensor-parallel device needs a link bandwidth > 0")
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
    "logit_gemm_s": float,
    "logit_row_s": float,
    "logit_block_rows": int,
    "calibration": str,
    "kv_decode_s_per_element": float,
    "kv_encode_s_per_element": float,
    "state_codec_s_per_op": float,
    "host_link_bandwidth_Bps": float,
    "host_link_latency_s": float,
    "tensor_parallel": int,
    "tp_link_bandwidth_Bps": float,
    "tp_link_latency_s": float,
}
_OPTIONAL_FIELDS = {f.name for f in fields(DeviceProfile) if f.default is not MISSING}
assert set(_PROFILE_CASTS) == {f.name for f in fields(DeviceProfile)}


def available_devices() -> list[str]:
    return sorted(p.stem for p in EXECUTOR_CONF_DIR.glob("*.yaml"))


def device_profile_from_config(cfg: Any) -> DeviceProfile:
    """Build a profile from a mapping (dict, OmegaConf node); every field is required."""
    data = resolve_derived(dict(cfg.items()))
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


def _profile_fields(name: str) -> dict:
    """The fields of conf/executor/<name>.yaml (its `derive_from` base resolved first)."""
    path = EXECUTOR_CONF_DIR / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"derive_from={name!r}: allowed values are {available_devices()}")
    data = yaml.safe_load(path.read_text())
    base = data.pop("derive_from", None)
    data.pop("fit", None)
    return {**_profile_fields(str(base)), **data} if base is not None else data


def resolve_derived(data: dict) -> dict:
    """A profile mapping with its `derive_from` base's fields filled in (its own win), so a
    run's record states every constant it ran with; a mapping without one is returned as is."""
    if "derive_from" not in data:
        return data
    rest = {k: v for k, v in data.items() if k != "derive_from"}
    return {**_profile_fields(str(data["derive_from"])), **rest}


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

    Symbols: La attention layers, Ha attention heads, d head dim; per recurrent layer H
    heads, P head dim, N state size, G groups (serving_core.executor.profiles.scan_shape),
    summed over the recurrent layers; Q the SSD chunk length.
    """

    # num_params x dtype bytes; a dense model streams them once per step, a MoE model its
    # non-expert bytes and the experts its tokens reach (serving_core.executor.moe_reads)
    weight_bytes: int
    kv_bytes_per_token: int  # attention K+V of one token, all La attention layers
    state_bytes_per_composite: int  # one recurrent composite (SSM + conv), every layer
    dense_flops_per_token: int  # 2 x the parameters a token passes (MoE: the active ones)
    attention_flops_per_pair: int  # 4 Ha d La: QK^T and PV per (query, key) pair
    scan_flops_per_token: int  # 4 sum(H P N): chunk-state build and read-out
    scan_flops_per_chunk: int  # 2 sum(H P N): passing the state across one chunk
    scan_flops_per_intra_pair: int  # 2 sum(H P + G N): intra-chunk C B^T and its product
    ssd_chunk_tokens: int  # Q
    codec_elements_per_token: int = 0  # K/V elements of one token, all La layers (0: bf16)
    # SSM state codec operations of one composite read and written once (every recurrent
    # layer's SSM elements x the codec's decode + encode operations; 0: not transcoded)
    state_codec_ops_per_composite: int = 0
    expert_bytes: int = 0  # one expert of one MoE layer (0: a dense model)
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    dense_weight_bytes: int = 0  # weight_bytes less every expert of every MoE layer

    @property
    def has_recurrent(self) -> bool:
        return self.state_bytes_per_composite > 0


def scan_shape(geometry: Geometry, kind: str) -> tuple[int, int, int, int]:
    """(H, P, N, G) a recurrent layer of `kind` scans with: Mamba2 heads x head dim x
    d_state over G groups; Gated DeltaNet value heads x value dim x key dim over its key
    heads (the chunked delta rule has the same four stages); Mamba (v1) inner channels of
    one element each x d_state, one group (its selective scan has no intra-chunk matmul:
    the intra term is an approximation kept so that every recurrent layer is costed)."""
    g = geometry
    if kind == "mamba2":
        return g.mamba_heads, g.mamba_head_dim, g.d_state, g.n_groups
    if kind == "gdn":
        return g.gdn_value_heads, g.gdn_value_head_dim, g.gdn_key_head_dim, g.gdn_key_heads
    if kind == "mamba1":
        return g.mamba1_d_inner, 1, g.mamba1_d_state, 1
    raise ValueError(f"recurrent kind={kind!r}: allowed values are mamba2, gdn, mamba1")


def model_costs(geometry: Geometry, ssd_chunk_tokens: int = SSD_CHUNK_TOKENS) -> ModelCosts:
    """Derive a model's per-step cost coefficients from its geometry's layer pattern.

    Scan FLOPs follow the four stages of the Mamba-2 SSD algorithm for a chunk
    of q tokens (per layer): intra-chunk C B^T per group (2 q^2 N G) and its
    masked product with X per head (2 q^2 P H), chunk states B^T X (2 q N P H),
    output from the carried state C h (2 q N P H), and state passing
    (2 N P H per chunk). Per token: 4 HPN + 2 q (HP + GN) + 2 HPN / q; n new
    tokens split into chunks of at most Q. A single
    decode token (q = 1) gives ~6 HPN, close to the 5 HPN of the recurrent update
    (decay, outer product, add; read-out). Every term is summed over the layers that
    carry it (attention terms over attention layers, scan terms over each recurrent
    layer with its own shape, `scan_shape`); dense FLOPs are 2 x the parameters a token
    multiplies through (Geometry.compute_params: a MoE model's active count). A model
    whose every layer is alike (Falcon-H1) gives L x its per-layer terms, as before.
    """
    if ssd_chunk_tokens <= 0:
        raise ValueError(f"ssd_chunk_tokens={ssd_chunk_tokens} must be positive")
    g = geometry
    counts = g.state_layer_counts
    hpn = intra = 0
    for kind in ("mamba2", "gdn", "mamba1"):
        if counts[kind]:
            heads, head_dim, state, groups = scan_shape(g, kind)
            hpn += counts[kind] * heads * head_dim * state
            intra += counts[kind] * (heads * head_dim + groups * state)
    attention_layers = counts["attention"]
    expert_bytes, moe_layers, dense_bytes = moe_split(g)
    return ModelCosts(
        weight_bytes=g.weight_bytes,
        kv_bytes_per_token=g.kv_bytes_per_token,
        state_bytes_per_composite=g.recurrent_bytes_per_checkpoint,
        dense_flops_per_token=2 * g.compute_params,
        attention_flops_per_pair=4 * g.num_attention_heads * g.head_dim * attention_layers,
        scan_flops_per_token=4 * hpn,
        scan_flops_per_chunk=2 * hpn,
        scan_flops_per_intra_pair=2 * intra,
        ssd_chunk_tokens=ssd_chunk_tokens,
        codec_elements_per_token=(
            g.kv_elements_per_token * attention_layers if g.kv_codec != "bf16" else 0
        ),
        state_codec_ops_per_composite=g.ssm_elements_per_checkpoint * ops_per_element(
            g.state_codec, g.dtype_bytes),
        expert_bytes=expert_bytes,
        moe_layers=moe_layers,
        num_experts=g.num_experts if moe_layers else 0,
        experts_per_token=g.experts_per_token if moe_layers else 0,
        dense_weight_bytes=dense_bytes,
    )
