"""The SSM state codecs of serving_core/state_codec.py in torch: encode on write, decode on read.

A batch of SSM states (b, k x H, P, N) (a storage group's k Mamba2 layers stacked) is stored
per layer as H x P x N codes then, for int8, H fp32 scales; layers one after another, so a
layer's bytes are contiguous (N0's per-layer pages hold one layer each). Formats:

- fp32, bf16, fp16: the float format, round-to-nearest (torch's cast).
- bf16_sr, fp16_sr: bf16 / fp16 with stochastic rounding: each element rounds to the upper
  of its two neighbouring values in the format (magnitudes; fp16 saturated at 65,504) with
  probability (|x| - lo) / (hi - lo).
- fp8_e4m3: e4m3fn, magnitudes saturated at 448, stochastic rounding: each element rounds
  to the upper of its two neighbouring fp8 values with probability (|x| - lo) / (hi - lo),
  so the stored value is unbiased.
- int8: per head, scale = amax / 127 (0 for an all-zero head), codes round(x / scale).

Stochastic rounding draws its uniforms from a generator seeded per written row with
`row_seed(request seed, token position, layer)`: a state written at the same position of
the same request (seed) is the same bytes, whichever chunk, step or batch wrote it, so
runs are deterministic and a reused checkpoint is the bytes the writer's own run stored.
"""

from __future__ import annotations

import torch

from serving_core.state_codec import codec

FP8_MAX = 448.0
FLOATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROUNDED = {"bf16_sr": torch.bfloat16, "fp16_sr": torch.float16}  # stochastic rounding


def row_seed(request_seed: int, position: int, layer: int) -> int:
    """The generator seed of one row's stochastic rounding (a fixed integer mix)."""
    return ((int(request_seed) * 1_000_003 + int(position)) * 8_191 + int(layer)) % (1 << 63)


def fp8_stochastic(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) of x, rounded up with probability (|x| - lo) / (hi - lo).

    The neighbours lo, lo + ulp of |x| (saturated at 448) are found arithmetically: ulp is
    2^(e - 3) for |x| in [2^e, 2^(e+1)) (3 mantissa bits), e at least -6 (the subnormals'
    spacing, 2^-9), so the rounded value is exact in e4m3fn and its cast is exact."""
    a = x.abs().clamp(max=FP8_MAX)
    _, exponent = torch.frexp(a)  # a = m 2^E with m in [0.5, 1): e = E - 1
    ulp = torch.exp2((exponent - 1).clamp(min=-6).float() - 3)
    lo = torch.floor(a / ulp) * ulp
    rounded = torch.where(uniforms < (a - lo) / ulp, lo + ulp, lo).clamp(max=FP8_MAX)
    return torch.copysign(rounded, x).to(torch.float8_e4m3fn).view(torch.uint8)


def float_stochastic(x: torch.Tensor, uniforms: torch.Tensor, dtype) -> torch.Tensor:
    """x in `dtype` (bf16 or fp16), each magnitude rounded up to its upper neighbour with
    probability (|x| - lo) / (hi - lo). The neighbours are the nearest value r and the next
    one toward |x| (r's bit pattern plus or minus one: magnitudes are ordered as integers)."""
    a = x.abs().clamp(max=torch.finfo(dtype).max)
    r = a.to(dtype)
    step = r.view(torch.int16) + torch.where(r.float() > a, -1, 1).to(torch.int16)
    other = step.view(dtype)
    lo, hi = torch.minimum(r, other).float(), torch.maximum(r, other).float()
    up = torch.where(hi > lo, (a - lo) / (hi - lo), 0.0)
    return torch.copysign(torch.where(uniforms < up, hi, lo), x).to(dtype)


class StateEncoder:
    """Encodes and decodes a group's SSM states in one codec (see the module docstring)."""

    def __init__(self, name: str, shape: tuple[int, int, int], layers: int) -> None:
        self.codec = codec(name)
        self.name = name
        self.layers = layers
        self.shape = shape  # (k x H, P, N)
        self.heads = shape[0] // layers
        self.elements = self.heads * shape[1] * shape[2]  # per layer
        self.layer_bytes = (self.elements * self._element_bytes
                            + self.heads * self.codec.scale_bytes_per_head)

    @property
    def _element_bytes(self) -> int:
        return self.codec.element_bytes

    @property
    def num_bytes(self) -> int:
        """Encoded bytes of one sequence's group state (every layer)."""
        return self.layers * self.layer_bytes

    def encode(self, ssm: torch.Tensor, keys: list[tuple[int, int]] | None = None,
               layer: int = 0) -> torch.Tensor:
        """(b, num_bytes) uint8 of states (b, k x H, P, N); `keys` one (request seed, token
        position) per row (None: (0, 0)) for stochastic rounding, `layer` the storage group
        written."""
        b = ssm.shape[0]
        x = ssm.float().reshape(b, self.layers, self.heads, -1)
        if self.name in FLOATS:
            codes = x.to(FLOATS[self.name]).reshape(b, self.layers, -1).view(torch.uint8)
            return codes.reshape(b, -1)
        if self.name == "fp8_e4m3":
            u = self._uniforms(b, keys, layer, x.device).view_as(x)
            return fp8_stochastic(x, u).reshape(b, -1)
        if self.name in ROUNDED:
            u = self._uniforms(b, keys, layer, x.device).view_as(x)
            codes = float_stochastic(x, u, ROUNDED[self.name]).reshape(b, self.layers, -1)
            return codes.view(torch.uint8).reshape(b, -1)
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = amax / 127.0
        safe = torch.where(scale > 0, scale, 1.0)
        codes = (x / safe).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
        scales = scale.reshape(b, self.layers, self.heads).contiguous().view(torch.uint8)
        return torch.cat([codes.reshape(b, self.layers, -1), scales], dim=2).reshape(b, -1)

    def _uniforms(self, b: int, keys, layer: int, device) -> torch.Tensor:
        """Per row uniforms from its generator (`row_seed` of its (request seed, position)
        key and the layer)."""
        n = self.layers * self.elements
        out = torch.empty(b, n)
        for i in range(b):
            seed, position = keys[i] if keys else (0, 0)
            out[i] = torch.rand(n, generator=torch.Generator().manual_seed(
                row_seed(seed, position, layer)))
        return out.to(device)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 states (b, k x H, P, N) of (b, num_bytes) uint8."""
        b = raw.shape[0]
        per = raw.reshape(b, self.layers, self.layer_bytes)
        if self.name in FLOATS or self.name in ROUNDED:
            x = per.contiguous().view({**FLOATS, **ROUNDED}[self.name]).float()
        elif self.name == "fp8_e4m3":
            x = per.contiguous().view(torch.float8_e4m3fn).float()
        else:
            codes = per[:, :, : self.elements].contiguous().view(torch.int8).float()
            scales = per[:, :, self.elements:].contiguous().view(torch.float32)
            x = codes.view(b, self.layers, self.heads, -1) * scales[..., None]
        return x.reshape(b, *self.shape)
