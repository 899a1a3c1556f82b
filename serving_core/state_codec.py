"""How the recurrent (SSM) state is stored: the `model.state_codec` axis.

A codec sets the bytes of every layer's SSM state (serving_core.geometry.layer_state_bytes),
so the planner, the storage accounting and every organization's units follow from it; the
conv window is kept at the model's dtype under every codec (vLLM's mamba_ssm_cache_dtype
also applies to the temporal state only, model_executor/layers/mamba/mamba_utils.py).

- auto: the model's dtype_bytes, today's accounting (bf16 on the 7B presets, fp32 on the
  tiny real-path models); vLLM's `auto`.
- fp32, bf16, fp16: that float format, written round-to-nearest.
- bf16_sr, fp16_sr: bf16 or fp16 written with stochastic rounding (SGLang's state rounding
  for bf16/fp16; vLLM 0.32's `--enable-mamba-cache-stochastic-rounding`, which requires
  `--mamba-ssm-cache-dtype float16`): the same bytes as bf16 / fp16.
- fp8_e4m3: one byte per element (e4m3fn, saturated at +-448), written with stochastic
  rounding (vLLM pull request 52962; SGLang's state rounding).
- int8: one byte per element plus one fp32 scale per head per layer (amax / 127), written
  round-to-nearest; bytes per layer = heads x head_dim x d_state + 4 x heads.

Work per SSM element, NOMINAL (`ops`: elementary operations, priced by the device
profile's `state_codec_s_per_op`; none where the stored format is the model's own,
`transcodes`): a float format converts in the scan kernel's registers (decode 1,
encode 1); fp8_e4m3 decodes with one convert and encodes with 5 (random bits, about 1 op
per element from a counter-based generator's 4 x 32-bit words; neighbour selection and
compare, 2; saturate, 1; convert, 1); bf16_sr and fp16_sr decode with 1 and encode with 4
(fp8_e4m3's without the saturation); int8 decodes with 2 (convert, scale) and encodes with
5 (the head's amax, 1; scale, 1; round, 1; clamp, 1; convert, 1).
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_CODECS = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8", "bf16_sr", "fp16_sr")
DEFAULT_STATE_CODEC = "auto"
INT8_SCALE_BYTES = 4  # one fp32 scale per head per layer


@dataclass(frozen=True)
class StateCodec:
    """Bytes and nominal work of one SSM state codec (element_bytes None: the model's)."""

    name: str
    element_bytes: int | None
    scale_bytes_per_head: int
    decode_ops: int
    encode_ops: int
    stochastic: bool


CODECS = {
    "auto": StateCodec("auto", None, 0, 0, 0, False),
    "fp32": StateCodec("fp32", 4, 0, 1, 1, False),
    "bf16": StateCodec("bf16", 2, 0, 1, 1, False),
    "fp16": StateCodec("fp16", 2, 0, 1, 1, False),
    "fp8_e4m3": StateCodec("fp8_e4m3", 1, 0, 1, 5, True),
    "int8": StateCodec("int8", 1, INT8_SCALE_BYTES, 2, 5, False),
    "bf16_sr": StateCodec("bf16_sr", 2, 0, 1, 4, True),
    "fp16_sr": StateCodec("fp16_sr", 2, 0, 1, 4, True),
}
assert tuple(CODECS) == STATE_CODECS


def codec(name: str) -> StateCodec:
    """The codec `name`; ValueError names model.state_codec and the allowed values."""
    if name not in CODECS:
        raise ValueError(f"model.state_codec={name!r}: allowed values are "
                         f"{', '.join(STATE_CODECS)}")
    return CODECS[name]


def ssm_bytes(name: str, elements: int, heads: int, dtype_bytes: int) -> int:
    """Stored bytes of `elements` SSM elements over `heads` heads (one layer)."""
    c = codec(name)
    per = dtype_bytes if c.element_bytes is None else c.element_bytes
    return elements * per + heads * c.scale_bytes_per_head


# The model's own representation per dtype_bytes (serving_core.executor.state_arena stores
# 4 as fp32, 2 as bf16): a codec naming it stores the state as auto does.
NATIVE = {4: "fp32", 2: "bf16"}


def transcodes(name: str, dtype_bytes: int) -> bool:
    """True when the stored format differs from the model's own: the real path then
    encodes on write and decodes on read, and the simulator prices that work."""
    return name != "auto" and NATIVE.get(dtype_bytes) != codec(name).name


def ops_per_element(name: str, dtype_bytes: int) -> int:
    """Nominal decode + encode operations per SSM element of one read-and-write."""
    c = codec(name)
    return c.decode_ops + c.encode_ops if transcodes(name, dtype_bytes) else 0
