"""Allocation cost and capacity: expected values worked out by hand from docs/engine_rules.md
section 3.1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving_core.geometry import load_geometry
from serving_core.memory import org_layout
from serving_core.memory.d0 import d0_split
from serving_core.memory.s2 import min_slabs
from serving_core.storage import (
    all_costs,
    allocation_cost,
    capacity,
    cost,
    fits,
    mib_to_bytes,
    parse_mix,
)

REPO = Path(__file__).resolve().parent.parent
KIB = 1024
MIB = 1024 * KIB
BUDGET_100_MIB = 100 * MIB  # 104,857,600 B = 102,400 KiB


def test_spec_example_one_block_one_checkpoint(falcon):
    costs = all_costs(falcon, 1, 1, slabs=1)
    # S0 1,557 KiB x 2 = 3,114 KiB = 3.041016 MiB
    assert costs["S0"].num_bytes == 3_114 * KIB
    assert costs["S0"].mib == pytest.approx(3.041016, abs=1e-6)
    # S1 512 + 2,048 = 2,560 KiB; S2 512 + 1,536 + 512 = 2,560 KiB
    assert costs["S1"].mib == costs["S2"].mib == 2.5
    # D0 32 units x 16 KiB + 1,557 KiB = 2,069 KiB
    assert costs["D0"].num_bytes == (32 * 16 + 1_557) * KIB == 2_118_656


def test_spec_example_sixteen_each(falcon):
    # S0 1,557 x 32 = 49,824 KiB; S1 512 x 16 + 2,048 x 16 = 40,960 KiB;
    # S2 512 x 16 + 1,536 x 16 + 512 x 1 = 33,280 KiB
    assert cost(falcon, "S0", 16, 16) == 49_824 * KIB
    assert cost(falcon, "S0", 16, 16) / MIB == 48.65625
    assert cost(falcon, "S1", 16, 16) / MIB == 40.0
    assert cost(falcon, "S2", 16, 16, slabs=1) / MIB == 32.5
    # D0 16 KiB x 32 x 16 + 1,557 KiB x 16 = 8,192 + 24,912 KiB
    assert cost(falcon, "D0", 16, 16) == 33_104 * KIB


def test_s2_slab_packing(falcon):
    # 17 checkpoints need ceil(17 / 16) = 2 slabs: 1,536 x 17 + 512 x 2 = 27,136 KiB
    assert min_slabs(org_layout(falcon, "S2"), 17) == 2
    assert min_slabs(org_layout(falcon, "S2"), 0) == 0
    ideal = allocation_cost(falcon, "S2", 0, 17)
    assert (ideal.num_bytes, ideal.num_slabs) == (27_136 * KIB, 2)
    # an explicit third slab is charged: 26,112 + 1,536 KiB
    assert cost(falcon, "S2", 0, 17, slabs=3) == 27_648 * KIB
    with pytest.raises(ValueError, match="slabs=1.*at least 2"):
        cost(falcon, "S2", 0, 17, slabs=1)


def test_attention_only_sets_need_no_slab(falcon):
    # 5 blocks x 512 KiB, no checkpoint, no slab
    assert allocation_cost(falcon, "S2", 5, 0).num_slabs == 0
    assert cost(falcon, "S2", 5, 0) == cost(falcon, "S1", 5, 0) == 2_560 * KIB


def test_granite_costs(granite):
    # page 1 MiB; 1 SSM member; S1 conv page 1 MiB; S2 one 32-slot slab
    assert cost(granite, "S1", 1, 1) == 3 * MIB
    assert cost(granite, "S2", 1, 1) == 3 * MIB
    assert cost(granite, "S2", 0, 33) == (33 + 2) * MIB
    assert cost(granite, "S0", 1, 1) == 2 * 1_074_688
    # D0 32 units x 32 KiB + composite
    assert cost(granite, "D0", 1, 1) == 32 * 32 * KIB + 1_074_688


def test_d0_split_and_feasibility(falcon):
    split = d0_split(BUDGET_100_MIB, 0.527383)
    # M_A = 0.527383 x 104,857,600 = 55,300,115.66; M_R = 49,557,484.34
    assert (split.attention_bytes, split.recurrent_bytes) == (55_300_115, 49_557_484)
    # 105 blocks x 524,288 = 55,050,240 fits; 106 -> 55,574,528 does not
    # 31 composites = 49,425,408 fit; 32 -> 51,019,776 do not
    assert fits(falcon, "D0", 105, 31, BUDGET_100_MIB)
    assert not fits(falcon, "D0", 106, 0, BUDGET_100_MIB)
    # each pool alone: 32 composites fail although 51 MB < 100 MiB
    assert not fits(falcon, "D0", 0, 32, BUDGET_100_MIB)
    assert fits(falcon, "D0", 0, 32, BUDGET_100_MIB, attention_fraction=0.5)
    # one shared pool: the whole cost against the whole budget (S0: 65 x 1,594,368 =
    # 103,633,920 B fit in 104,857,600; 66 do not)
    assert fits(falcon, "S0", 0, 65, BUDGET_100_MIB)
    assert not fits(falcon, "S0", 0, 66, BUDGET_100_MIB)


# Capacities under 100 MiB = 102,400 KiB (Falcon, KiB per copy of the mix):
# (1, 1):  S0 102,400 / 3,114 = 32.9 -> 32;  S1 102,400 / 2,560 = 40
#          S2 2,048 z + 512 ceil(z / 16): z = 49 -> 100,352 + 2,048 = 102,400 fits, z = 50 not
#          D0 min(55,300,115 // 524,288 = 105, 49,557,484 // 1,594,368 = 31) = 31
# (16, 1): S0 102,400 / (17 x 1,557) = 3.87 -> 3;  S1 102,400 / 10,240 = 10
#          S2 9,728 z + 512 ceil(z / 16): z = 10 -> 97,792 fits, z = 11 -> 107,520 not
#          D0 min(55,300,115 // 8,388,608 = 6, 31) = 6
# (0, 1):  S0 102,400 / 1,557 = 65.8 -> 65;  S1 102,400 / 2,048 = 50
#          S2 1,536 z + 512 ceil(z / 16): z = 65 -> 99,840 + 2,560 = 102,400 fits
#          D0 attention imposes no limit -> 31
# (1, 0):  S0 65;  S1 = S2 = 200;  D0 recurrent imposes no limit -> 105
FALCON_CAPACITY_100_MIB = {
    (1, 1): {"S0": 32, "S1": 40, "S2": 49, "D0": 31},
    (16, 1): {"S0": 3, "S1": 10, "S2": 10, "D0": 6},
    (0, 1): {"S0": 65, "S1": 50, "S2": 65, "D0": 31},
    (1, 0): {"S0": 65, "S1": 200, "S2": 200, "D0": 105},
}


@pytest.mark.parametrize("mix", sorted(FALCON_CAPACITY_100_MIB))
def test_falcon_capacity_100_mib(falcon, mix):
    got = {org: capacity(falcon, org, mix, BUDGET_100_MIB) for org in ("S0", "S1", "S2", "D0")}
    assert got == FALCON_CAPACITY_100_MIB[mix]


def test_granite_capacity_100_mib(granite):
    # S0 104,857,600 / 2,149,376 = 48.8 -> 48; S1 100 MiB / 3 MiB = 33
    # S2 2 z + ceil(z / 32) MiB: z = 49 -> 98 + 2 = 100 fits, z = 50 -> 102 not
    # D0 M_A = 0.199699 x 104,857,600 = 20,939,957.9 -> // 1 MiB = 19
    #    M_R = 83,917,642.1 // 1,074,688 = 78 -> min 19
    got = {org: capacity(granite, org, (1, 1), BUDGET_100_MIB) for org in ("S0", "S1", "S2", "D0")}
    assert got == {"S0": 48, "S1": 33, "S2": 49, "D0": 19}


def test_d0_capacity_with_stated_split(falcon):
    # f = 0.5: 52,428,800 // 524,288 = 100 blocks, 52,428,800 // 1,594,368 = 32 composites
    assert capacity(falcon, "D0", (1, 1), BUDGET_100_MIB, attention_fraction=0.5) == 32


def test_capacity_is_maximal(falcon):
    # z copies fit and z + 1 copies do not, for every shared-pool organization
    for org in ("S0", "S1", "S2"):
        for mix in ((3, 2), (7, 5), (1, 17)):
            z = capacity(falcon, org, mix, BUDGET_100_MIB)
            assert cost(falcon, org, z * mix[0], z * mix[1]) <= BUDGET_100_MIB
            assert cost(falcon, org, (z + 1) * mix[0], (z + 1) * mix[1]) > BUDGET_100_MIB


@pytest.mark.parametrize(
    "kwargs, field",
    [({"attention_blocks": -1, "checkpoints": 0}, "attention_blocks"),
     ({"attention_blocks": 0, "checkpoints": -2}, "checkpoints"),
     ({"attention_blocks": 1.5, "checkpoints": 0}, "attention_blocks")],
)
def test_cost_rejects_bad_counts(falcon, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cost(falcon, "S1", **kwargs)


def test_cost_rejects_slabs_outside_s2_and_checkpoints_without_recurrent(falcon):
    with pytest.raises(ValueError, match="slabs=.*S2"):
        cost(falcon, "S1", 1, 1, slabs=1)
    with pytest.raises(ValueError, match="checkpoints=1"):
        cost(load_geometry("attention_only"), "S0", 1, 1)
    with pytest.raises(ValueError, match="org="):
        cost(falcon, "S7", 1, 1)


def test_capacity_rejects_bad_input(falcon):
    with pytest.raises(ValueError, match="budget_bytes"):
        capacity(falcon, "S0", (1, 1), 0)
    with pytest.raises(ValueError, match="mix"):
        capacity(falcon, "S0", (0, 0), BUDGET_100_MIB)
    with pytest.raises(ValueError, match="d0_attention_fraction"):
        capacity(falcon, "D0", (1, 1), BUDGET_100_MIB, attention_fraction=1.5)


def test_parsers():
    assert parse_mix("16,1") == (16, 1)
    assert parse_mix(" 0 , 3 ") == (0, 3)
    assert mib_to_bytes("100") == 104_857_600
    assert mib_to_bytes("0.5") == 524_288
    for bad in ("1", "1,-1", "a,b", "0,0", "1,2,3"):
        with pytest.raises(ValueError, match="mix="):
            parse_mix(bad)
    for bad in ("0", "-3", "abc"):
        with pytest.raises(ValueError, match="capacity_mib="):
            mib_to_bytes(bad)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving_core.storage", "--model", "falcon_h1_7b", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_cli_cost_json():
    result = _cli("--attention-blocks", "16", "--checkpoints", "16", "--slabs", "1", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"S0", "S1", "S2", "D0", "N0"}
    assert data["S0"] == {"bytes": 51_019_776, "mib": 48.65625}
    assert data["S1"] == {"bytes": 41_943_040, "mib": 40.0}
    assert data["S2"] == {"bytes": 34_078_720, "mib": 32.5, "slabs": 1}
    assert data["D0"]["bytes"] == 33_104 * KIB


def test_cli_capacity_json():
    result = _cli("--capacity-mib", "100", "--mix", "16,1", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("S0", "S1", "S2", "D0")} == FALCON_CAPACITY_100_MIB[(16, 1)]
    assert data["d0_split"] == {
        "attention_fraction": 0.527383,
        "attention_bytes": 55_300_115,
        "recurrent_bytes": 49_557_484,
    }
    half = json.loads(_cli("--capacity-mib", "100", "--mix", "1,1",
                           "--d0-attention-fraction", "0.5", "--json").stdout)
    assert half["D0"] == 32


@pytest.mark.parametrize(
    "args, needle",
    [(("--attention-blocks", "-1", "--checkpoints", "1"), "attention_blocks"),
     (("--attention-blocks", "1", "--checkpoints", "17", "--slabs", "1"), "slabs"),
     (("--capacity-mib", "0", "--mix", "1,1"), "capacity_mib"),
     (("--capacity-mib", "100", "--mix", "x"), "mix"),
     (("--attention-blocks", "1"), "checkpoints")],
)
def test_cli_errors_exit_2(args, needle):
    result = _cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert needle in result.stderr


def test_tq4_costs_by_hand(falcon):
    # tq4 (264 B/token): S1/S2 page 135,168, 12 SSM members, 4 conv slots per slab;
    # D0 unit 4,224 (32 per block); N0 page 1,596,672 of 6,048 tokens.
    tq4 = falcon.with_codec("tq4")
    costs = all_costs(tq4, 16, 16)
    assert costs["S0"].num_bytes == 32 * 1_594_368 == 51_019_776  # unchanged: composite pages
    assert costs["S1"].num_bytes == (16 + 16 * 13) * 135_168 == 30_277_632
    assert costs["S2"].num_bytes == (16 + 16 * 12 + 4) * 135_168 == 28_655_616
    assert costs["S2"].num_slabs == 4
    assert costs["D0"].num_bytes == 16 * 32 * 4_224 + 16 * 1_594_368 == 27_672_576
    # N0: 16 x 512 = 8,192 tokens in ceil(8,192 / 6,048) = 2 pages, plus 16 checkpoint pages
    assert costs["N0"].num_bytes == 18 * 1_596_672 == 28_740_096


def test_cli_side_by_side_codecs():
    cost = _cli("--attention-blocks", "16", "--checkpoints", "16", "--kv-codec", "both")
    assert cost.returncode == 0, cost.stderr
    lines = cost.stdout.splitlines()
    assert lines[0].split() == ["org", "bf16", "bytes", "tq4", "bytes", "bf16", "MiB", "tq4",
                                "MiB"]
    assert lines[3].split()[:3] == ["S2", "34,078,720", "28,655,616"]
    data = json.loads(_cli("--capacity-mib", "100", "--mix", "7,1", "--kv-codec", "both",
                           "--json").stdout)
    assert (data["bf16"]["S2"], data["tq4"]["S2"]) == (19, 40)
