"""Physical addressing a paged kernel reads (docs/engine_rules.md section 3.2).

S1/S2 SSM: address(b, j, u) = base + page_of(b, j) * page_stride + offset(j, u), member
pages not necessarily adjacent. S2 conv: line l = 16 p + s (Falcon; slots per slab in
general), address = conv_base + l * 32 KiB + o. The negative sentinel is never decoded
and page 0 is a valid page.
"""

from __future__ import annotations

import pytest

from serving_core.memory import NO_SLOT, NULL, StateObject, build_memory
from serving_core.memory.objects import Kind
from serving_core.memory.s2 import decode_conv_line, encode_conv_line

KIB = 1024
PAGE = 512 * KIB
SLOT = 32 * KIB


def fragmented(geometry, org: str, num_units: int, free_order: list[int]):
    """A pool whose free queue is exactly `free_order` (every unit held, then these freed)."""
    mem = build_memory(geometry, org, {"shared": num_units})
    blocks = [mem.allocate_attention(1) for _ in range(num_units)]
    for unit in free_order:
        mem.release(blocks[unit])  # unpublished: freed at once, in this order
    assert list(mem.pools["shared"].free) == free_order
    return mem


# ----- conv line ids --------------------------------------------------------------------
@pytest.mark.parametrize("per", [16, 32])
def test_conv_line_round_trips(per):
    for page in range(40):
        for slot in range(per):
            line = encode_conv_line(page, slot, per)
            assert line == per * page + slot
            assert decode_conv_line(line, per) == (page, slot)


def test_page_0_slot_0_is_line_0_and_valid(falcon):
    assert encode_conv_line(0, 0, 16) == 0 and decode_conv_line(0, 16) == (0, 0)
    mem = build_memory(falcon, "S2", {"shared": 8})
    comp = mem.allocate_composite(1)
    assert (comp.slab_page, comp.slot) == (0, 0)
    assert mem.conv_line(comp) == 0
    assert mem.conv_address(comp, 0, conv_base=4096) == 4096
    assert mem.conv_address(comp, SLOT - 1) == SLOT - 1
    second = mem.allocate_composite(1)
    assert mem.conv_line(second) == 1 and mem.conv_address(second, 5) == SLOT + 5


@pytest.mark.parametrize("line", [NO_SLOT, -1, -16, -17])
def test_the_sentinel_is_never_decoded(line):
    assert NO_SLOT == -1
    with pytest.raises(ValueError, match="sentinel"):
        decode_conv_line(line, 16)


@pytest.mark.parametrize("page, slot", [(-1, 0), (0, -1), (0, 16), (3, 99)])
def test_encode_refuses_locations_outside_the_slab(page, slot):
    with pytest.raises(ValueError, match="outside"):
        encode_conv_line(page, slot, 16)


def test_conv_address_of_a_composite_without_conv_state_raises(falcon):
    mem = build_memory(falcon, "S2", {"shared": 8})
    comp = mem.allocate_composite(1)
    mem.release(comp)  # unpublished: destroyed, slot returned
    assert (comp.slab_page, comp.slot) == (NO_SLOT, NO_SLOT)
    assert mem.conv_line(comp) == NO_SLOT
    with pytest.raises(ValueError, match="sentinel"):
        mem.conv_address(comp, 0)


def test_conv_address_on_a_fragmented_slab_page(falcon):
    mem = fragmented(falcon, "S2", 12, [9, 4, 7, 2])
    comp = mem.allocate_composite(1)
    assert comp.slab_page == 9 and comp.units == [4, 7, 2]  # slab first, then the members
    assert mem.conv_line(comp) == 16 * 9
    assert mem.conv_address(comp, 100, conv_base=1 << 30) == (1 << 30) + 144 * SLOT + 100
    for offset in (-1, SLOT):
        with pytest.raises(ValueError, match="offset"):
            mem.conv_address(comp, offset)


# ----- SSM member addressing ------------------------------------------------------------
def test_s2_ssm_address_follows_non_adjacent_member_pages(falcon):
    mem = fragmented(falcon, "S2", 12, [2, 5, 7, 1, 10])
    comp = mem.allocate_composite(1)
    members = mem.ssm_member_pages(comp)
    assert comp.slab_page == 2 and members == [5, 7, 1]  # neither adjacent nor increasing
    base = 3 << 40
    for member, page in enumerate(members):
        for offset in (0, 12_345, PAGE - 1):
            assert mem.ssm_address(comp, member, offset, base) == base + page * PAGE + offset
    assert mem.ssm_address(comp, 2, 0) == 1 * PAGE


def test_s1_ssm_address_and_conv_page(falcon):
    mem = fragmented(falcon, "S1", 8, [6, 3, 0, 5])
    comp = mem.allocate_composite(1)
    assert mem.ssm_member_pages(comp) == [6, 3, 0] and mem.conv_line(comp) == 5
    assert mem.ssm_address(comp, 2, 7) == 7  # member on page 0: a valid page
    assert mem.ssm_address(comp, 0, 0, base=PAGE) == PAGE + 6 * PAGE


def test_conv_page_0_is_a_valid_location(falcon):
    mem = fragmented(falcon, "S1", 4, [1, 2, 3, 0])
    comp = mem.allocate_composite(1)
    assert comp.units == [1, 2, 3, 0] and mem.conv_line(comp) == 0


@pytest.mark.parametrize("member, offset", [(0, -1), (0, PAGE), (3, 0), (-1, 0)])
def test_ssm_address_refuses_out_of_range_members_and_offsets(falcon, member, offset):
    mem = build_memory(falcon, "S2", {"shared": 8})
    comp = mem.allocate_composite(1)
    with pytest.raises(ValueError):
        mem.ssm_address(comp, member, offset)


def test_d0_ssm_address_strides_by_the_native_composite(falcon):
    mem = build_memory(falcon, "D0", {"attention": 2, "recurrent": 3})
    mem.allocate_composite(1)
    comp = mem.allocate_composite(1)
    unit = 1_594_368
    assert mem.ssm_member_pages(comp) == [1]
    assert mem.ssm_address(comp, 0, 10, base=100) == 100 + unit + 10
    assert mem.ssm_address(comp, 0, unit - 1) == 2 * unit - 1
    with pytest.raises(ValueError):
        mem.ssm_address(comp, 0, unit)


def test_s0_composite_address_is_its_coarse_page(falcon):
    mem = build_memory(falcon, "S0", {"shared": 3})
    mem.allocate_attention(1)
    comp = mem.allocate_composite(1)
    assert mem.ssm_member_pages(comp) == [1] and mem.conv_line(comp) == 1
    assert mem.ssm_address(comp, 0, 5) == 1_594_368 + 5


# ----- absence is a sentinel, never 0 ---------------------------------------------------
def test_null_is_absence_and_not_unit_0():
    assert NULL.is_null and not NULL and NULL != 0 and repr(NULL) == "NULL"
    obj = StateObject(0, Kind.COMPOSITE, "shared", [0], producer=0)
    assert not obj.is_null and obj.units == [0]
    assert (obj.slab_page, obj.slot) == (NO_SLOT, NO_SLOT)


# ----- N0 per-layer pages (a storage group of several Mamba2 layers) --------------------
def test_n0_member_page_j_holds_mamba2_layer_j_of_the_group():
    """Granite tiny (conf/model/granite_hybrid_tiny.yaml: 1 attention and 3 Mamba2 layers per
    group) under N0: a composite is 3 pages of 144 x 512 = 73,728 B, anywhere in the pool;
    page j holds layer j's SSM state (8 x 32 x 64 fp32 = 65,536 B) then its conv window
    ((8 x 32 + 2 x 64) x 3 fp32 = 4,608 B), as vLLM pages each Mamba layer on its own."""
    import torch

    from serving_core.executor.state_arena import StateArena
    from serving_core.executor.state_copy import ArenaCopier
    from serving_core.geometry import load_geometry

    g = load_geometry("granite_hybrid_tiny")
    mem = fragmented(g, "N0", 8, [6, 1, 4, 0, 2, 3, 5, 7])
    obj = mem.allocate_composite(1)
    assert list(obj.units) == [6, 1, 4] and mem.pools["shared"].unit_bytes == 73_728
    arena = StateArena(mem, g)
    ssm_l, conv_l = 8 * 32 * 64, 384 * 3  # elements of one layer
    ssm = torch.cat([torch.full((1, 8, 32, 64), j + 1.0) for j in range(3)], dim=1)
    conv = torch.cat([torch.full((1, 384, 3), -(j + 1.0)) for j in range(3)], dim=1)
    arena.write(obj, [(conv, ssm)])
    pool = arena.pools["shared"][0]
    for j, page in enumerate(obj.units):
        assert torch.all(pool[page, :ssm_l] == j + 1)
        assert torch.all(pool[page, ssm_l:ssm_l + conv_l] == -(j + 1))
        assert torch.all(pool[page, ssm_l + conv_l:] == 0)  # the page's padding untouched
    (got_conv, got_ssm), = arena.read(obj)
    assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm)
    regions = ArenaCopier(arena).regions(obj)
    assert [(r.units, r.start, r.nbytes) for r in regions] == [((6, 1, 4), 0, 70_144)]
    assert ArenaCopier(arena).nbytes(obj) == 3 * 70_144
