"""Geometry derived from model-config fields, and the per-organization layouts."""

from __future__ import annotations

import dataclasses

import pytest

from serving_core.geometry import (
    Geometry,
    available_models,
    geometry_from_config,
    load_geometry,
)
from serving_core.layout import uniform_page_bytes
from serving_core.memory import normalize_org, org_layout

KIB = 1024


@pytest.fixture(scope="module")
def falcon() -> Geometry:
    return load_geometry("falcon_h1_7b")


@pytest.fixture(scope="module")
def granite() -> Geometry:
    return load_geometry("granite")


def test_presets_are_listed():
    assert {"falcon_h1_7b", "granite", "attention_only"} <= set(available_models())


def test_falcon_bytes_from_fields(falcon):
    # 2 KV heads x 128 dim x (K, V) x 2 B
    assert falcon.attention_bytes_per_token == 2 * 128 * 2 * 2 == 1_024
    # 24 Mamba heads x 128 head dim x 256 d_state x 2 B = 1,536 KiB
    assert falcon.ssm_bytes == 24 * 128 * 256 * 2 == 1_572_864 == 1_536 * KIB
    # conv channels 24 x 128 + 2 x 1 group x 256 = 3,584; (d_conv - 1) = 3 inputs x 2 B = 21 KiB
    assert falcon.conv_bytes == 3_584 * 3 * 2 == 21_504 == 21 * KIB
    assert falcon.composite_bytes == 1_572_864 + 21_504 == 1_594_368 == 1_557 * KIB
    assert falcon.num_layers == 44


def test_granite_bytes_from_fields(granite):
    # 4 KV heads x 128 dim x (K, V) x 2 B
    assert granite.attention_bytes_per_token == 4 * 128 * 2 * 2 == 2_048
    # SSM 64 x 64 x 128 x 2 = 1,048,576; conv (4,096 + 2 x 128) x 3 x 2 = 26,112
    assert granite.ssm_bytes == 1_048_576
    assert granite.conv_bytes == 4_352 * 3 * 2 == 26_112
    assert granite.composite_bytes == 1_048_576 + 26_112 == 1_074_688


def test_tq4_codec_changes_attention_bytes_only(falcon):
    tq4 = dataclasses.replace(falcon, kv_codec="tq4")
    # 2 KV heads x (K, V) = 4 vectors of 128 elements, each 128 x 4 / 8 = 64 code bytes + a
    # 2-byte norm = 66 B: 264 B per token per layer (25.8 % of 1,024)
    assert tq4.attention_bytes_per_token == 4 * 66 == 264
    assert tq4.kv_elements_per_token == falcon.kv_elements_per_token == 512
    assert tq4.composite_bytes == falcon.composite_bytes
    assert tq4.with_codec("bf16") == falcon


def test_tq4_override_when_loading():
    assert load_geometry("falcon_h1_7b", kv_codec="tq4").attention_bytes_per_token == 264
    # tiny: 2 heads x (K, V) x (64 / 2 + 2) = 136 B (its fp32 bf16-equivalent is 1,024)
    assert load_geometry("falcon_h1_tiny", kv_codec="tq4").attention_bytes_per_token == 136


def test_tq4_needs_power_of_two_head_dim(falcon):
    with pytest.raises(ValueError, match="head_dim=96.*power of two"):
        dataclasses.replace(falcon, kv_codec="tq4", head_dim=96)


def test_attention_only_geometry_has_no_recurrent_bytes():
    g = load_geometry("attention_only")
    assert not g.has_recurrent
    assert (g.ssm_bytes, g.conv_bytes, g.composite_bytes) == (0, 0, 0)
    assert g.attention_bytes_per_token == 1_024


def test_bad_codec_names_field_and_allowed_values(falcon):
    with pytest.raises(ValueError, match="kv_codec.*tq4"):
        dataclasses.replace(falcon, kv_codec="fp8")


@pytest.mark.parametrize(
    "field, value",
    [("d_state", -1), ("mamba_heads", -2), ("d_conv", -4), ("num_kv_heads", 0), ("head_dim", -8)],
)
def test_negative_fields_name_the_field(falcon, field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(falcon, **{field: value})


def test_unknown_config_field_and_unknown_model(falcon):
    cfg = falcon.to_dict() | {"rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_theta"):
        geometry_from_config(cfg)
    with pytest.raises(ValueError, match="falcon_h1_7b"):
        load_geometry("no_such_model")


def test_falcon_paged_layouts(falcon):
    for org in ("S1", "S2"):
        layout = org_layout(falcon, org)
        assert layout.page_bytes == 512 * 1_024 == 524_288
        # ceil(1,572,864 / 524,288) = 3 member pages
        assert layout.ssm_members == 3
    assert org_layout(falcon, "S1").units_per_composite == 3 + 1
    s2 = org_layout(falcon, "S2")
    # smallest power of two >= 21,504 B is 32 KiB; 512 KiB / 32 KiB = 16 slots
    assert s2.conv_slot_bytes == 32 * KIB
    assert s2.slots_per_slab == 16
    # S0 page must hold the whole composite: max(524,288, 1,594,368)
    assert org_layout(falcon, "S0").page_bytes == 1_594_368
    d0 = org_layout(falcon, "D0")
    assert (d0.page_bytes, d0.recurrent_unit_bytes) == (16 * 1_024, 1_594_368)


def test_granite_paged_layouts(granite):
    s2 = org_layout(granite, "S2")
    # page 512 x 2,048 = 1 MiB; ceil(1,048,576 / 1,048,576) = 1 member; 1 MiB / 32 KiB = 32
    assert (s2.page_bytes, s2.ssm_members, s2.conv_slot_bytes, s2.slots_per_slab) == (
        1_048_576, 1, 32 * KIB, 32,
    )


def test_uniform_page(falcon, granite):
    # Falcon: 1,594,368 / 1,024 = 1,557 tokens -> 1,568 (multiple of 16) x 1,024
    assert uniform_page_bytes(falcon) == 1_568 * 1_024 == 1_605_632
    # Granite: 1,074,688 / 2,048 = 524.75 -> 525 -> 528 tokens x 2,048
    assert uniform_page_bytes(granite) == 528 * 2_048 == 1_081_344


@pytest.mark.parametrize(
    "name, org", [("s0", "S0"), ("S1", "S1"), (" s2 ", "S2"), ("d0", "D0"), ("n0", "N0")]
)
def test_normalize_org(name, org):
    assert normalize_org(name) == org


def test_normalize_org_names_storage_organizations_only():
    with pytest.raises(ValueError, match="allowed values are S0, S1, S2, D0, N0"):
        normalize_org("s3")
    with pytest.raises(ValueError):  # an experiment arm, mapped by ledgers.arms
        normalize_org("s2_retention")
