"""The paged S1/S2 recurrent-state update equals the contiguous reference exactly.

A decode step of the Mamba2 mixer (conv window and SSM state) is run twice on the same
inputs: once on states gathered through the organization's page mapping (SSM members on
shuffled pages, S1 conv pages, S2 conv slots by line id) and written back in place, once on
contiguous per-sequence tensors. Outputs and destination states must be bit-identical, and
no unit outside the batch's composites may change.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from serving_core.executor.state_arena import StateArena
from serving_core.executor.torch_executor import PagedRecurrentIO
from serving_core.geometry import load_geometry
from serving_core.memory import NO_SLOT, ORG_TO_CLASS, build_memory, org_class
from serving_core.model.dense_state import DenseState

POOL_PAGES = 240  # 53 composites fit (S1: 4 pages each; S2: 3 + slabs), with pages to spare
# The registry's organizations by how the arena addresses their composites.
PAGED = [org for org, cls in ORG_TO_CLASS.items() if cls.conv_addressing != "unit"]
IN_UNIT = [org for org, cls in ORG_TO_CLASS.items() if cls.conv_addressing == "unit"]


def _pool_units(org: str, geometry, **per_pool: int) -> dict[str, int]:
    """Units of each of the organization's own pools (its class names them). A two-level
    layout (large pages carved into small ones) gets whole large pages: enough for the
    attention and recurrent units asked at once (a large page holds one type)."""
    cls = org_class(org)
    layout = cls.unit_layout(geometry)
    if hasattr(layout, "large_page_bytes"):
        large = (-(-per_pool["attention"] // layout.attention_per_large)
                 + -(-per_pool["recurrent"] // layout.state_per_large))
        return {"attention": large * layout.attention_per_large,
                "recurrent": large * layout.state_per_large}
    return {pool: per_pool[pool] for pool in cls.pool_names}


def _paged_batch(org: str, batch: int, seed: int):
    """A memory organization whose free queue is shuffled (page 0 handed out early), its
    arena filled with noise, and `batch` composites allocated on it."""
    geometry = load_geometry("falcon_h1_tiny", num_layers=1)
    mem = build_memory(geometry, org, {"shared": POOL_PAGES})
    rng = random.Random(seed)
    pages = list(range(1, POOL_PAGES))
    rng.shuffle(pages)
    pages.insert(rng.randrange(4), 0)  # page 0 is a valid page and is used
    mem.pools["shared"].free = deque(pages)
    arena = StateArena(mem, geometry)
    gen = torch.Generator().manual_seed(seed)
    for t in arena.pools.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    composites = [mem.allocate_composite(rid) for rid in range(batch)]
    return mem, arena, composites, gen


@pytest.mark.parametrize("org", PAGED)
@pytest.mark.parametrize("batch", [8, 32, 53])
def test_paged_decode_update_equals_contiguous(tiny_model, org, batch):
    model = tiny_model
    mem, arena, composites, gen = _paged_batch(org, batch, seed=batch)
    used = {u for obj in composites for u in obj.units} | {obj.slab_page for obj in composites}
    assert 0 in used
    members = [mem.ssm_member_pages(obj) for obj in composites]
    assert any(b != a + 1 for p in members for a, b in zip(p, p[1:], strict=False))  # not adjacent
    per = mem.layout.slots_per_slab
    if mem.has_slabs:
        assert per == 16  # hand: 512-KiB pages hold 16 slots of 32 KiB
        assert all(mem.conv_line(obj) >= 0 for obj in composites)
        assert len({obj.slab_page for obj in composites}) == -(-batch // per)
    before = {name: t.clone() for name, t in arena.pools.items()}

    # Contiguous reference holding exactly the paged initial states.
    dense = DenseState(model, batch)
    for i, obj in enumerate(composites):
        (conv, ssm), = arena.read(obj)
        dense.conv[0][i] = conv[0]
        dense.ssm[0][i] = ssm[0]
    x = torch.randn(batch, 1, model.hidden, generator=gen)

    y_paged = model._mamba(0, x, PagedRecurrentIO(arena, composites))
    y_ref = model._mamba(0, x, dense)
    assert torch.equal(y_paged, y_ref)
    for i, obj in enumerate(composites):
        (conv, ssm), = arena.read(obj)
        assert torch.equal(conv[0], dense.conv[0][i])
        assert torch.equal(ssm[0], dense.ssm[0][i])
        assert not torch.equal(ssm[0], before["shared"][0, members[i][0]][:1])  # it moved

    # Units outside the batch's composites are untouched.
    pool = arena.pools["shared"][0]
    untouched = [u for u in range(POOL_PAGES) if u not in used]
    assert untouched and torch.equal(pool[untouched], before["shared"][0][untouched])
    if mem.has_slabs:  # free slots of the batch's slab pages are untouched too
        slot = arena.slot_elems
        lines = {mem.conv_line(obj) for obj in composites}
        for page in {obj.slab_page for obj in composites}:
            for s in range(per):
                if per * page + s not in lines:
                    seg = slice(s * slot, (s + 1) * slot)
                    assert torch.equal(pool[page, seg], before["shared"][0, page, seg])


@pytest.mark.parametrize("org", list(ORG_TO_CLASS))
def test_composite_write_read_round_trip_is_exact(tiny_model, org):
    geometry = load_geometry("falcon_h1_tiny")
    units = _pool_units(org, geometry, shared=40, attention=64, recurrent=6)
    mem = build_memory(geometry, org, units)
    arena = StateArena(mem, geometry)
    objs = [mem.allocate_composite(r) for r in range(3)]
    gen = torch.Generator().manual_seed(7)
    states = {
        obj.oid: [
            (torch.randn(1, *arena.conv_shape, generator=gen),
             torch.randn(1, *arena.ssm_shape, generator=gen))
            for _ in range(geometry.num_layers)
        ]
        for obj in objs
    }
    for obj in objs:
        arena.write(obj, states[obj.oid])
    for obj in objs:
        for (c, s), (c2, s2) in zip(arena.read(obj), states[obj.oid], strict=True):
            assert torch.equal(c, c2) and torch.equal(s, s2)


def test_s2_sentinel_is_never_decoded(tiny_model):
    mem, arena, composites, _ = _paged_batch("S2", 2, seed=1)
    obj = composites[0]
    obj.slab_page = NO_SLOT  # a composite without conv state
    with pytest.raises(ValueError, match="sentinel"):
        arena.locate([obj])


def test_arena_bytes_equal_the_planned_units():
    geometry = load_geometry("falcon_h1_tiny")
    for org, units in (("S2", {"shared": 25}), ("D0", {"attention": 413, "recurrent": 3})):
        mem = build_memory(geometry, org, units)
        arena = StateArena(mem, geometry)
        planned = sum(n * mem.pools[p].unit_bytes for p, n in units.items())
        assert arena.num_bytes == planned * geometry.num_layers


@pytest.mark.parametrize("org", IN_UNIT)
def test_composite_decode_update_in_place_equals_contiguous(tiny_model, org):
    """S0/D0/N0: the SSM state leads its composite's unit and is updated there (no copy out
    and back); outputs and states equal the contiguous update bit for bit, and units
    outside the batch are untouched."""
    model = tiny_model
    geometry = load_geometry("falcon_h1_tiny", num_layers=1)
    units = _pool_units(org, geometry, shared=16, attention=64, recurrent=12)
    mem = build_memory(geometry, org, units)
    arena = StateArena(mem, geometry)
    assert arena.ssm_in_place
    gen = torch.Generator().manual_seed(11)
    for t in arena.pools.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    before = {name: t.clone() for name, t in arena.pools.items()}
    composites = [mem.allocate_composite(rid) for rid in range(5)]
    dense = DenseState(model, 5)
    for i, obj in enumerate(composites):
        (conv, ssm), = arena.read(obj)
        dense.conv[0][i] = conv[0]
        dense.ssm[0][i] = ssm[0]
    x = torch.randn(5, 1, model.hidden, generator=gen)
    assert torch.equal(model._mamba(0, x, PagedRecurrentIO(arena, composites)),
                       model._mamba(0, x, dense))
    for i, obj in enumerate(composites):
        (conv, ssm), = arena.read(obj)
        assert torch.equal(conv[0], dense.conv[0][i]) and torch.equal(ssm[0], dense.ssm[0][i])
    pool = arena.pools[mem.composite_pool][0]
    used = {u for obj in composites for u in obj.units}
    others = [u for u in range(pool.shape[0]) if u not in used]
    assert others and torch.equal(pool[others], before[mem.composite_pool][0][others])


def test_plain_kv_is_stored_head_major_in_its_unit():
    """Plain KV lies head-major in its unit, (2, KV heads, block tokens, head dim), viewed
    token-major by `kv_view`: a token's K and V written through the view land at their
    head-major offsets, and each head's keys of a block are one contiguous matrix (what the
    paged decode attention reads at full speed; strided per-token rows read 1.7x slower)."""
    mem, arena, _, _ = _paged_batch("S2", 1, 0)
    view = arena.kv_view(0)
    _, bt, _, kvh, d = view.shape
    unit, offset = 5, 3
    k = torch.arange(kvh * d, dtype=torch.float32).view(1, kvh, d)
    arena.store_kv(0, torch.tensor([unit]), torch.tensor([offset]), k, -k)
    raw = arena.pools[mem.attention_pool][0][unit, : 2 * kvh * bt * d].view(2, kvh, bt, d)
    assert torch.equal(raw[0, :, offset], k[0]) and torch.equal(raw[1, :, offset], -k[0])
    assert torch.equal(view[unit, offset, 0], k[0])
    assert view[:, :, 0].permute(0, 2, 3, 1)[unit].stride() == (bt * d, 1, d)  # K^T per head
