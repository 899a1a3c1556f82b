"""TQ4: TurboQuant-style 4-bit codec for attention K/V vectors (MSE variant).

A vector x of length d is stored as its norm (fp16) and the 4-bit codes of the unit vector
y = R x / |x| rotated by R = H D / sqrt(d) (H the d x d Sylvester-Hadamard matrix, D a seeded
diagonal of random signs, one R for the whole model). After a uniformly random rotation every
coordinate of a unit vector has the density

    f(t) = Gamma(d/2) / (sqrt(pi) Gamma((d - 1)/2)) (1 - t^2)^((d - 3)/2),  t in [-1, 1]

(the marginal of the uniform distribution on the sphere; (t + 1)/2 ~ Beta((d-1)/2, (d-1)/2)),
so each coordinate is quantized independently with the 16-level Lloyd-Max codebook of f,
computed once per d from f alone (no data). Decoding is x_hat = |x| R^T c[codes].

Vector length: one head's K or V vector (d = head_dim), not two heads joined to 256. A
per-head vector (1) keeps the attention product in the rotated basis, q.k = (R q).(R k), so a
page-native decode rotates the query once per head and reads scores straight from codebook
values and norms, and returns R^T (sum_t p_t |v_t| c[v_t]) with one inverse rotation per head,
never rebuilding K or V; a rotation across two heads would not split into per-head products;
(2) gives each head its own norm, so a small-norm head is not quantized on its neighbour's
scale; (3) fits every preset (the tiny model's two KV heads of 64 elements are 128 per token,
not 256) without joining K and V. The price is one 2-byte norm per 128 elements instead of per
256: 264 instead of 260 B per token per layer on Falcon-H1-7B (25.8 % instead of 25.4 % of
bf16).

Packed layout of one vector: d * 4 / 8 bytes of codes (two per byte, element 2i in the low
nibble, 2i + 1 in the high one), then the fp16 norm's two bytes (little-endian).

Edge cases: a zero vector (or one whose norm rounds to 0 in fp16, below ~3e-8) encodes as
norm 0 with every code 0 and decodes to exactly zero; a norm above fp16's largest finite value
(65504) saturates to 65504 (the direction is kept); a vector with a NaN or infinite element
encodes to a NaN norm with every code 0 and decodes to NaN (no exception on the hot path).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

BITS = 4
ROTATION_SEED = 20_260_401  # one rotation for the whole model (any fixed value)
FP16_MAX = 65504.0
_LLOYD_TOL = 1e-13
_LLOYD_MAX_ITER = 10_000


def packed_bytes(dim: int, bits: int = BITS) -> int:
    """Bytes of one packed vector: bits x dim / 8 of codes plus a 2-byte fp16 norm."""
    _check_dim(dim)
    return bits * dim // 8 + 2


def _check_dim(dim: int) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 4 or dim & (dim - 1):
        raise ValueError(f"dim={dim!r}: the TQ4 vector length must be a power of two >= 4")


# ----- codebook ------------------------------------------------------------------------------
def _log_norm_const(dim: int) -> float:
    from scipy.special import gammaln

    return gammaln(dim / 2) - 0.5 * math.log(math.pi) - gammaln((dim - 1) / 2)


def coordinate_density(t: np.ndarray | float, dim: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector of length `dim`.

    A test oracle: the codebook uses the closed-form cell masses and moments; the tests
    (tests/test_kv_codec.py) integrate this density numerically to check them."""
    _check_dim(dim)
    t = np.asarray(t, dtype=np.float64)
    inside = np.abs(t) < 1
    safe = np.where(inside, 1 - t * t, 1.0)
    return np.where(inside, np.exp(_log_norm_const(dim) + (dim - 3) / 2 * np.log(safe)), 0.0)


def _cdf(t: np.ndarray, dim: int) -> np.ndarray:
    from scipy.special import betainc

    a = (dim - 1) / 2
    return betainc(a, a, np.clip((np.asarray(t) + 1) / 2, 0.0, 1.0))


def _partial_first_moment(t: np.ndarray, dim: int) -> np.ndarray:
    """Integral of s f(s) ds from -1 to t: -C (1 - t^2)^((d-1)/2) / (d - 1), exactly."""
    t = np.clip(np.asarray(t, dtype=np.float64), -1.0, 1.0)
    log_c = _log_norm_const(dim)
    power = (dim - 1) / 2
    return -np.exp(log_c + power * np.log(np.maximum(1 - t * t, 1e-300))) / (dim - 1)


@functools.lru_cache(maxsize=32)
def codebook(dim: int, bits: int = BITS) -> tuple[np.ndarray, np.ndarray]:
    """(levels, boundaries) of the Lloyd-Max quantizer of `coordinate_density(., dim)`.

    levels: 2^bits centroids, ascending; boundaries: the 2^bits - 1 midpoints between them.
    Lloyd's iteration with exact cell masses (regularized incomplete beta) and exact cell
    first moments (closed form), from uniform quantiles of the density, to 1e-13.
    """
    _check_dim(dim)
    n = 1 << bits
    from scipy.special import betaincinv

    a = (dim - 1) / 2
    probs = (np.arange(n) + 0.5) / n
    levels = 2 * betaincinv(a, a, probs) - 1
    for _ in range(_LLOYD_MAX_ITER):
        edges = np.concatenate(([-1.0], (levels[1:] + levels[:-1]) / 2, [1.0]))
        mass = np.diff(_cdf(edges, dim))
        moment = np.diff(_partial_first_moment(edges, dim))
        new = moment / mass
        done = np.max(np.abs(new - levels)) < _LLOYD_TOL
        levels = new
        if done:
            break
    levels = (levels - levels[::-1]) / 2  # the density is symmetric: make the book exactly so
    return levels, (levels[1:] + levels[:-1]) / 2


def expected_distortion(dim: int, bits: int = BITS) -> float:
    """E |y - y_hat|^2 for a uniformly random unit vector y: dim x the per-coordinate MSE.

    Per coordinate: the sum over cells of E[X^2] - 2 c E[X] + c^2 P on the cell, all in
    closed form (incomplete beta functions). A test oracle: the engine never needs it;
    tests/test_kv_codec.py holds it against quadrature, the published value and the
    measured MSE of the codec on random vectors.
    """
    from scipy.special import betainc

    levels, bounds = codebook(dim, bits)
    edges = np.concatenate(([-1.0], bounds, [1.0]))
    mass = np.diff(_cdf(edges, dim))
    first = np.diff(_partial_first_moment(edges, dim))
    # E[X^2 1{X < t}] = (1 + sign(t) I_{t^2}(3/2, (d-1)/2)) / (2 d): X^2 ~ Beta(1/2, (d-1)/2)
    # and its size-biased law is Beta(3/2, (d-1)/2), with E[X^2] = 1/d.
    second_below = (1 + np.sign(edges) * betainc(1.5, (dim - 1) / 2, edges * edges)) / (2 * dim)
    second = np.diff(second_below)
    per_coord = float(np.sum(second - 2 * levels * first + levels * levels * mass))
    return dim * per_coord


# ----- rotation ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _rotation_cpu(dim: int, seed: int) -> torch.Tensor:
    _check_dim(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (dim,), generator=gen, dtype=torch.int64) * 2 - 1
    return (h * signs.to(torch.float64) / math.sqrt(dim)).to(torch.float32)


def rotation(dim: int, seed: int = ROTATION_SEED, device: torch.device | str = "cpu"):
    """R = H diag(s) / sqrt(dim), orthogonal; y = x @ R.T rotates row vectors x."""
    return _rotation_cpu(dim, seed).to(device)


# ----- codec ---------------------------------------------------------------------------------
class TQ4Codec:
    """Encode/decode vectors of length `dim` along the last axis (any leading shape)."""

    def __init__(self, dim: int, seed: int = ROTATION_SEED, device: torch.device | str = "cpu"):
        _check_dim(dim)
        self.dim, self.seed = dim, seed
        self.bytes_per_vector = packed_bytes(dim)
        self.rot = rotation(dim, seed, device)  # rows: y = x @ rot.T
        levels, bounds = codebook(dim)
        self.levels = torch.tensor(levels, dtype=torch.float32, device=device)
        self.bounds = torch.tensor(bounds, dtype=torch.float32, device=device)

    # rotated basis (page-native attention: q.k = rotate(q).rotate(k))
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) @ self.rot.T

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self.rot

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> (codes uint8 [..., dim/2] packed, norm fp16 [...])."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has last dimension {x.shape[-1]}; the codec's dim is {self.dim}")
        x = x.to(torch.float32)
        norm = torch.linalg.vector_norm(x, dim=-1)
        finite = torch.isfinite(norm)
        norm16 = torch.where(finite, norm.clamp(max=FP16_MAX), torch.nan).to(torch.float16)
        blank = (norm16 == 0) | ~finite  # zero or non-finite: every code 0
        y = self.rotate(x) / torch.where(blank, torch.ones_like(norm), norm).unsqueeze(-1)
        idx = torch.bucketize(y, self.bounds).to(torch.uint8)
        idx = torch.where(blank.unsqueeze(-1), torch.zeros_like(idx), idx)
        return idx[..., 0::2] | (idx[..., 1::2] << 4), norm16

    def unpack_indices(self, codes: torch.Tensor) -> torch.Tensor:
        """codes uint8 [..., dim/2] -> level indices int64 [..., dim]."""
        low, high = codes & 0x0F, codes >> 4
        return torch.stack((low, high), dim=-1).flatten(-2).to(torch.int64)

    def decode_rotated(self, codes: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """|x| c[codes] in the rotated basis (float32 [..., dim])."""
        return self.levels[self.unpack_indices(codes)] * norm.to(torch.float32).unsqueeze(-1)

    def decode(self, codes: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """(codes, norm) -> x_hat float32 [..., dim]."""
        return self.unrotate(self.decode_rotated(codes, norm))

    # byte layout
    def pack(self, codes: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """(codes, norm) -> uint8 [..., dim/2 + 2]: codes then the norm's fp16 bytes."""
        norm_bytes = norm.to(torch.float16).contiguous().unsqueeze(-1).view(torch.uint8)
        return torch.cat((codes, norm_bytes), dim=-1)

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if packed.shape[-1] != self.bytes_per_vector:
            raise ValueError(
                f"packed has last dimension {packed.shape[-1]}; a vector is "
                f"{self.bytes_per_vector} bytes"
            )
        half = self.dim // 2
        norm = packed[..., half:].contiguous().view(torch.float16).squeeze(-1)
        return packed[..., :half], norm

    def encode_packed(self, x: torch.Tensor) -> torch.Tensor:
        return self.pack(*self.encode(x))

    def decode_packed(self, packed: torch.Tensor) -> torch.Tensor:
        return self.decode(*self.unpack(packed))


def codec_for(head_dim: int, seed: int = ROTATION_SEED, device="cpu") -> TQ4Codec:
    """The model's codec: one head's K or V vector, one seeded rotation."""
    return TQ4Codec(head_dim, seed, device)
