"""TQ4 codec (serving_core.kv_codec): codebook, distortion, layout and edge cases.

Expected distortions come from scipy.integrate.quad over the coordinate density, a method
independent of both the sampled vectors and the codec's closed-form cell moments.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.integrate import quad

from serving_core import kv_codec
from serving_core.geometry import load_geometry
from serving_core.kv_codec import TQ4Codec, codebook, coordinate_density, expected_distortion


def _quad_distortion(dim: int) -> float:
    """E|y - y_hat|^2 of a random unit vector by adaptive quadrature, cell by cell."""
    levels, bounds = codebook(dim)
    edges = np.concatenate(([-1.0], bounds, [1.0]))
    per_coord = sum(
        quad(lambda t, c=c: (t - c) ** 2 * float(coordinate_density(t, dim)), lo, hi,
             epsabs=1e-15, epsrel=1e-12)[0]
        for c, lo, hi in zip(levels, edges[:-1], edges[1:], strict=True)
    )
    return dim * per_coord


def _unit_vectors(n: int, dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True)).to(torch.float32)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_density_is_a_density_with_variance_one_over_dim(dim):
    mass = quad(lambda t: float(coordinate_density(t, dim)), -1, 1)[0]
    var = quad(lambda t: t * t * float(coordinate_density(t, dim)), -1, 1)[0]
    assert mass == pytest.approx(1.0, abs=1e-10)
    assert var == pytest.approx(1.0 / dim, rel=1e-9)


@pytest.mark.parametrize("dim", [64, 128])
def test_codebook_satisfies_lloyd_max_conditions(dim):
    levels, bounds = codebook(dim)
    assert levels.shape == (16,) and bounds.shape == (15,)
    assert np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-15)  # symmetric density
    np.testing.assert_allclose(bounds, (levels[1:] + levels[:-1]) / 2)  # nearest-level cells
    edges = np.concatenate(([-1.0], bounds, [1.0]))
    for c, lo, hi in zip(levels, edges[:-1], edges[1:], strict=True):  # centroid condition
        mass = quad(lambda t: float(coordinate_density(t, dim)), lo, hi, epsabs=1e-15)[0]
        moment = quad(lambda t: t * float(coordinate_density(t, dim)), lo, hi, epsabs=1e-15)[0]
        assert moment / mass == pytest.approx(c, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_closed_form_distortion_equals_quadrature(dim):
    assert expected_distortion(dim) == pytest.approx(_quad_distortion(dim), rel=1e-8)


def test_distortion_approaches_the_gaussian_lloyd_max_value():
    # Large d: sqrt(d) y_i -> N(0, 1), whose 16-level Lloyd-Max MSE is 0.009497 (Max 1960).
    assert expected_distortion(4096) == pytest.approx(0.009497, rel=2e-3)
    assert expected_distortion(64) < expected_distortion(128) < expected_distortion(256)


@pytest.mark.parametrize("dim", [64, 128])
def test_mse_on_1e5_random_unit_vectors_matches_expected_distortion(dim):
    x = _unit_vectors(100_000, dim, seed=22)
    codec = TQ4Codec(dim)
    x_hat = codec.decode(*codec.encode(x))
    mse = float(((x.double() - x_hat.double()) ** 2).sum(-1).mean())
    expected = _quad_distortion(dim)
    assert abs(mse / expected - 1) < 0.05, (mse, expected)


def test_packed_layout_is_bits_times_length_over_8_plus_2():
    for dim in (64, 128, 256):
        codec = TQ4Codec(dim)
        packed = codec.encode_packed(_unit_vectors(3, dim, seed=1).reshape(3, 1, dim))
        assert packed.dtype == torch.uint8
        assert packed.shape == (3, 1, 4 * dim // 8 + 2) == (3, 1, kv_codec.packed_bytes(dim))
    assert kv_codec.packed_bytes(128) == 66 and kv_codec.packed_bytes(256) == 130


def test_nibble_order_and_norm_bytes_by_hand():
    codec = TQ4Codec(4)
    # A vector whose rotation is known: x = R^T y puts y in the rotated basis.
    y = torch.tensor([[0.9, -0.9, 0.1, -0.1]])
    x = codec.unrotate(y) * 2.0
    codes, norm = codec.encode(x)
    idx = torch.bucketize(y / y.norm(), codec.bounds)
    assert codes.tolist() == [[int(idx[0, 0] | idx[0, 1] << 4), int(idx[0, 2] | idx[0, 3] << 4)]]
    assert norm.dtype == torch.float16 and float(norm) == pytest.approx(2 * math.sqrt(1.64),
                                                                         rel=1e-3)
    packed = codec.pack(codes, norm)
    assert packed.shape == (1, 4)
    assert packed[0, 2:].tolist() == list(np.float16(float(norm)).tobytes())  # little-endian
    back_codes, back_norm = codec.unpack(packed)
    assert torch.equal(back_codes, codes) and torch.equal(back_norm, norm)


def test_geometry_bytes_agree_with_the_codec():
    for model in ("falcon_h1_7b", "falcon_h1_tiny", "granite"):
        g = load_geometry(model, kv_codec="tq4")
        per_vector = TQ4Codec(g.head_dim).bytes_per_vector
        assert g.attention_bytes_per_token == g.num_kv_heads * 2 * per_vector


def test_zero_vector_round_trips_to_exact_zero():
    codec = TQ4Codec(128)
    codes, norm = codec.encode(torch.zeros(2, 128))
    assert torch.equal(codes, torch.zeros(2, 64, dtype=torch.uint8))
    assert torch.equal(norm, torch.zeros(2, dtype=torch.float16))
    assert torch.equal(codec.decode(codes, norm), torch.zeros(2, 128))


def test_extreme_norms():
    codec = TQ4Codec(128)
    u = _unit_vectors(64, 128, seed=5)
    unit_codes, _ = codec.encode(u)
    unit_err = float(((codec.decode(*codec.encode(u)) - u) ** 2).sum(-1).mean())
    for scale in (1e-4, 1e-2, 1e3, 6e4):
        codes, norm = codec.encode(u * scale)
        assert torch.equal(codes, unit_codes)  # the direction does not depend on the scale
        rel = float(((codec.decode(codes, norm) / scale - u) ** 2).sum(-1).mean())
        assert rel == pytest.approx(unit_err, rel=0.02)  # plus fp16 rounding of the norm
    # above fp16's largest finite value: the norm saturates at 65504, the direction is kept
    codes, norm = codec.encode(u * 1e6)
    assert torch.equal(codes, unit_codes) and torch.all(norm == 65504)
    # below fp16's smallest subnormal (~6e-8): the norm rounds to 0 and decodes to zero
    codes, norm = codec.encode(u * 1e-9)
    assert torch.all(norm == 0) and torch.equal(codec.decode(codes, norm), torch.zeros_like(u))
    # non-finite input: a NaN norm, decoded as NaN (no exception on the hot path)
    bad = u[:2].clone()
    bad[0, 3], bad[1, 7] = float("nan"), float("inf")
    codes, norm = codec.encode(bad)
    assert torch.isnan(norm).all() and not codes.any()
    assert torch.isnan(codec.decode(codes, norm)).all()


def test_rotation_is_orthogonal_seeded_and_shared():
    r = kv_codec.rotation(128)
    assert torch.allclose(r @ r.T, torch.eye(128), atol=1e-6)
    assert torch.equal(r, kv_codec.rotation(128))
    assert not torch.equal(r, kv_codec.rotation(128, seed=1))
    assert torch.equal(TQ4Codec(128).rot, kv_codec.codec_for(128).rot)
    q, k = _unit_vectors(2, 128, seed=9)
    codec = TQ4Codec(128)
    assert float(codec.rotate(q) @ codec.rotate(k)) == pytest.approx(float(q @ k), abs=1e-6)


def test_encode_is_deterministic_and_accepts_bf16():
    codec = TQ4Codec(64)
    x = torch.randn(10, 3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    a, b = codec.encode(x), codec.encode(x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert codec.decode(*a).shape == (10, 3, 64)


@pytest.mark.parametrize("dim", [0, 3, 96, 130])
def test_bad_vector_length_names_the_field(dim):
    with pytest.raises(ValueError, match=f"dim={dim}.*power of two"):
        TQ4Codec(dim)


def test_wrong_input_width_is_refused():
    with pytest.raises(ValueError, match="last dimension 64"):
        TQ4Codec(128).encode(torch.zeros(1, 64))
