"""Budget planner: expected units worked out by hand from docs/engine_rules.md section 4."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving_core.geometry import load_geometry
from serving_core.memory import org_layout
from serving_core.planner import (
    Budget,
    headroom_units,
    nominal_bytes,
    parse_budget,
    plan_budget,
    plan_to_dict,
    units_for,
)

REPO = Path(__file__).resolve().parent.parent


# Falcon: U = 1,605,632 B; S0 page 1,594,368; S1/S2 page 524,288 (U = 3.0625 pages);
# D0 attention unit 16,384, composite 1,594,368, split 0.527383 / 0.472617.
#
# b63: nominal = 63 x 1,605,632 = 101,154,816
#   S0 101,154,816 / 1,594,368 = 63.445 -> 63
#   S1/S2 63 x 3.0625 = 192.9375 -> 193
#   D0 A 0.527383 x 101,154,816 = 53,347,330.3; / 16,384 = 3,256.06 -> 3,256
#   D0 R 0.472617 x 101,154,816 = 47,807,485.7; / 1,594,368 = 29.98 -> 29
#        (30 composites would need 47,831,040 B)
# b83: nominal = 83 x 1,605,632 = 133,267,456
#   S0 133,267,456 / 1,594,368 = 83.586 -> 84
#   S1/S2 83 x 3.0625 = 254.1875 -> 254
#   D0 A 0.527383 x 133,267,456 = 70,282,990.7; / 16,384 = 4,289.73 -> 4,289
#   D0 R 0.472617 x 133,267,456 = 62,984,465.3; / 1,594,368 = 39.50 -> 39
# b108: nominal = 108 x 1,605,632 = 173,408,256
#   S0 173,408,256 / 1,594,368 = 108.763 -> 109
#   S1/S2 108 x 3.0625 = 330.75 -> 331
#   D0 A 0.527383 x 173,408,256 = 91,452,566.3; / 16,384 = 5,581.82 -> 5,581
#   D0 R 0.472617 x 173,408,256 = 81,955,689.7; / 1,594,368 = 51.40 -> 51
FALCON_TABLE = {
    # label: (nominal, S0 pages, S1/S2 pages, D0 attention units, D0 composites)
    "b63": (101_154_816, 63, 193, 3_256, 29),
    "b83": (133_267_456, 84, 254, 4_289, 39),
    "b108": (173_408_256, 109, 331, 5_581, 51),
}


@pytest.mark.parametrize("label", sorted(FALCON_TABLE))
def test_falcon_budget_table(falcon, label):
    nominal, s0, s12, d0_a, d0_r = FALCON_TABLE[label]
    plan = plan_budget(falcon, label)
    assert plan.label == label
    assert plan.nominal_bytes == nominal
    assert units_for(plan, "s0") == {"shared": s0}
    assert units_for(plan, "s1") == units_for(plan, "S2") == {"shared": s12}
    assert units_for(plan, "d0") == {"attention": d0_a, "recurrent": d0_r}


def test_falcon_b63_bytes_and_diffs(falcon):
    plan = plan_budget(falcon, "b63")
    # S0 63 x 1,594,368 = 100,445,184 -> 709,632 below nominal
    assert plan.org_bytes("S0") == 100_445_184
    assert plan.diff_bytes("S0") == -709_632
    # S1 193 x 524,288 = 101,187,584 -> 32,768 above nominal
    assert plan.org_bytes("S1") == 101_187_584
    assert plan.diff_bytes("S1") == 32_768
    # D0 3,256 x 16,384 + 29 x 1,594,368 = 53,346,304 + 46,236,672 = 99,582,976
    assert plan.org_bytes("D0") == 99_582_976
    assert plan.diff_bytes("D0") == 99_582_976 - 101_154_816 == -1_571_840


def test_half_pages_round_up(falcon):
    # b8: 8 x 3.0625 = 24.5 S1 pages -> 25 (half up, not to even)
    assert units_for(plan_budget(falcon, "b8"), "S1") == {"shared": 25}


def test_page_budget_gives_s1_s2_exact_pages(falcon):
    plan = plan_budget(falcon, "254 pages")
    # nominal = 254 x 524,288 = 133,169,152
    assert plan.label == "p254"
    assert plan.nominal_bytes == 133_169_152
    assert units_for(plan, "S1") == units_for(plan, "S2") == {"shared": 254}
    assert plan.diff_bytes("S2") == 0
    # S0 133,169,152 / 1,594,368 = 83.525 -> 84
    assert units_for(plan, "S0") == {"shared": 84}
    # D0 A 0.527383 x 133,169,152 = 70,231,146.9; / 16,384 = 4,286.57 -> 4,286
    # D0 R 0.472617 x 133,169,152 = 62,938,005.1; / 1,594,368 = 39.47 -> 39
    assert units_for(plan, "D0") == {"attention": 4_286, "recurrent": 39}
    assert plan_budget(falcon, "p254") == plan


def test_granite_b63(granite):
    plan = plan_budget(granite, "b63")
    # nominal = 63 x 1,081,344 = 68,124,672
    assert plan.nominal_bytes == 68_124_672
    # S0 68,124,672 / 1,074,688 = 63.39 -> 63
    assert units_for(plan, "S0") == {"shared": 63}
    # S1/S2 page 1,048,576: 63 x 1.03125 = 64.97 -> 65
    assert units_for(plan, "S2") == {"shared": 65}
    # D0 A 0.199699 x 68,124,672 = 13,604,428.9; / 32,768 = 415.17 -> 415
    # D0 R 0.800301 x 68,124,672 = 54,520,243.1; / 1,074,688 = 50.73 -> 50
    assert units_for(plan, "D0") == {"attention": 415, "recurrent": 50}
    # 415 x 32,768 + 50 x 1,074,688 = 13,598,720 + 53,734,400
    assert plan.diff_bytes("D0") == 67_333_120 - 68_124_672


def test_attention_only_plan():
    plan = plan_budget(load_geometry("attention_only"), "b4")
    # U = one 512-token block = 524,288 B; D0 takes it all: 2,097,152 / 16,384 = 128
    assert plan.nominal_bytes == 4 * 524_288
    assert units_for(plan, "S0") == units_for(plan, "S1") == {"shared": 4}
    assert units_for(plan, "D0") == {"attention": 128, "recurrent": 0}


def test_budget_below_one_checkpoint_names_minimum(falcon, granite):
    # Falcon b1: S1 3.0625 -> 3 pages < 3 members + 1 conv page.
    # b2: D0 R 0.472617 x 3,211,264 / 1,594,368 = 0.95 -> 0 composites.
    # b3: D0 R 0.472617 x 4,816,896 / 1,594,368 = 1.43 -> 1; S1 9 pages; S0 3 pages.
    for label in ("b1", "b2"):
        with pytest.raises(ValueError, match=rf"budget='{label}'.*minimum is b3"):
            plan_budget(falcon, label)
    # S2 also needs one slab page beside its 3 member pages
    with pytest.raises(ValueError, match="S1 shared gets 3 units, needs 4; S2 shared gets 3"):
        plan_budget(falcon, "b1")
    assert units_for(plan_budget(falcon, "b3"), "D0")["recurrent"] == 1
    # p6: D0 R 0.472617 x 3,145,728 / 1,594,368 = 0.93; p7: 3,670,016 -> 1.09
    with pytest.raises(ValueError, match="minimum is p7"):
        plan_budget(falcon, "p6")
    # Granite b1: S1 1.03 -> 1 page < 1 member + 1 conv page; b2: S1 2, D0 R 1.61 -> 1
    with pytest.raises(ValueError, match="minimum is b2"):
        plan_budget(granite, "b1")


@pytest.mark.parametrize(
    "text, budget",
    [("b63", Budget("b", 63)), ("B108", Budget("b", 108)), ("p254", Budget("p", 254)),
     ("254 pages", Budget("p", 254)), ("254pages", Budget("p", 254)), ("1 page", Budget("p", 1))],
)
def test_parse_budget(text, budget):
    assert parse_budget(text) == budget


@pytest.mark.parametrize(
    "text", ["b0", "p0", "0 pages", "b-3", "-3 pages", "63", "bx", "", "b6.5", "x63", "b 63"]
)
def test_parse_budget_rejects(text):
    with pytest.raises(ValueError, match=r"budget=.*bN.*pN.*N pages"):
        parse_budget(text)


def test_headroom_units():
    assert headroom_units(254, 0.1) == 25  # floor(25.4)
    assert headroom_units(100, 0.29) == 29  # binary 0.29 x 100 = 28.999..., the decimal is 29
    assert headroom_units(3_256, 0.0) == 0
    assert headroom_units(0, 0.5) == 0


@pytest.mark.parametrize("total, f", [(10, 1.0), (10, -0.1), (10, 1.5), (10, "0.1")])
def test_headroom_rejects_fraction(total, f):
    with pytest.raises(ValueError, match="f=.*0 <= f < 1"):
        headroom_units(total, f)


def test_headroom_rejects_negative_total():
    with pytest.raises(ValueError, match="total_units"):
        headroom_units(-1, 0.1)


def test_units_for_rejects_unknown_org(falcon):
    with pytest.raises(ValueError, match="org=.*allowed values are S0, S1, S2, D0, N0"):
        units_for(plan_budget(falcon, "b63"), "s9")


# TQ4 (serving_core.kv_codec, one vector per head): 2 KV heads x (K, V) x (128 / 2 + 2) =
# 264 B per token. S1/S2 page 512 x 264 = 135,168; SSM members ceil(1,572,864 / 135,168) =
# ceil(11.64) = 12; conv slot 32,768 -> 135,168 // 32,768 = 4 slots per slab; S0 page
# max(135,168, 1,594,368) = 1,594,368 (unchanged); D0 attention unit 16 x 264 = 4,224;
# N0 block 16 x ceil(1,594,368 / (16 x 264)) = 16 x 378 = 6,048 tokens, page 1,596,672.
# Nominal bytes are the bf16 ones (a label names the same bytes under every codec):
# b63:  S1/S2 101,154,816 / 135,168 = 748.36 -> 748; D0 A 53,347,330.3 / 4,224 = 12,629.57
#       -> 12,629; D0 R 29 (unchanged); N0 101,154,816 // 1,596,672 = 63 -> 62 + null
# b83:  S1/S2 133,267,456 / 135,168 = 985.94 -> 986; D0 A 70,282,990.7 / 4,224 = 16,638.96
#       -> 16,638; D0 R 39; N0 83 -> 82 + null
# b108: S1/S2 173,408,256 / 135,168 = 1,282.91 -> 1,283; D0 A 91,452,566.3 / 4,224 =
#       21,650.70 -> 21,650; D0 R 51; N0 108 -> 107 + null
FALCON_TQ4_TABLE = {
    # label: (S0 pages, S1/S2 pages, D0 attention units, D0 composites, N0 pages)
    "b63": (63, 748, 12_629, 29, 62),
    "b83": (84, 986, 16_638, 39, 82),
    "b108": (109, 1_283, 21_650, 51, 107),
}


@pytest.mark.parametrize("label", sorted(FALCON_TQ4_TABLE))
def test_falcon_tq4_budget_table_by_hand(falcon, label):
    s0, s12, d0_a, d0_r, n0 = FALCON_TQ4_TABLE[label]
    plan = plan_budget(falcon.with_codec("tq4"), label)
    assert plan.kv_codec == "tq4"
    assert plan.nominal_bytes == FALCON_TABLE[label][0] == nominal_bytes(falcon, label)
    assert units_for(plan, "s0") == {"shared": s0}
    assert units_for(plan, "s1") == units_for(plan, "S2") == {"shared": s12}
    assert units_for(plan, "d0") == {"attention": d0_a, "recurrent": d0_r}
    assert units_for(plan, "n0") == {"shared": n0}
    units = {p.org + p.pool: p.unit_bytes for p in plan.pools}
    # Jenga: 16 tokens x 264 B = 4,224-B attention pages; the composite padded to whole
    # attention pages, ceil(1,594,368 / 4,224) = 378 pages = 1,596,672 B
    assert units == {"S0shared": 1_594_368, "S1shared": 135_168, "S2shared": 135_168,
                     "D0attention": 4_224, "D0recurrent": 1_594_368, "N0shared": 1_596_672,
                     "JENGAattention": 4_224, "JENGArecurrent": 1_596_672}


def test_tq4_layout_by_hand(falcon):
    tq4 = falcon.with_codec("tq4")
    s2, s1 = org_layout(tq4, "S2"), org_layout(tq4, "S1")
    assert (s2.page_bytes, s2.ssm_members, s2.conv_slot_bytes, s2.slots_per_slab) == (
        135_168, 12, 32_768, 4)
    assert (s1.ssm_members, s1.conv_pages, s1.units_per_composite) == (12, 1, 13)


def test_pages_label_names_bf16_pages_of_bytes(falcon):
    # p254 = 254 bf16 S1/S2 pages = 133,169,152 B; under tq4 that is 985.21 -> 985 pages
    plan = plan_budget(falcon.with_codec("tq4"), "p254")
    assert plan.nominal_bytes == 254 * 524_288 == 133_169_152
    assert units_for(plan, "s2") == {"shared": 985}


def test_cli_side_by_side_codecs():
    table = _cli("--model", "falcon_h1_7b", "--budget", "b63", "--kv-codec", "both")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "the same bytes under bf16 and tq4" in lines[0]
    assert lines[1].split()[:4] == ["org", "pool", "bf16", "units"]
    s2 = next(line.split() for line in lines if line.startswith("S2"))
    assert s2 == ["S2", "shared", "193", "524,288", "+32,768", "748", "135,168", "-49,152"]
    data = json.loads(_cli("--model", "falcon_h1_7b", "--budget", "b83", "--kv-codec", "both",
                           "--json").stdout)
    assert data["tq4"]["orgs"]["S2"]["units"] == 986 and data["bf16"]["orgs"]["S2"]["units"] == 254
    one = json.loads(_cli("--model", "falcon_h1_7b", "--budget", "b83", "--kv-codec", "tq4",
                          "--json").stdout)
    assert one["kv_codec"] == "tq4" and one["orgs"]["D0"]["attention"]["units"] == 16_638


def test_plan_to_dict_shape(falcon):
    data = plan_to_dict(plan_budget(falcon, "b63"))
    assert set(data) == {"model", "kv_codec", "state_codec", "budget", "nominal_bytes",
                         "scope_layers",
                         "model_nominal_bytes", "kv_bytes_per_token",
                         "recurrent_bytes_per_checkpoint", "orgs"}
    # Falcon-H1-7B: 44 layers, each 1,024 B of KV per token and a 1,594,368-B composite
    assert (data["scope_layers"], data["kv_bytes_per_token"]) == (44, 44 * 1_024)
    assert data["recurrent_bytes_per_checkpoint"] == 44 * 1_594_368
    assert data["kv_codec"] == "bf16" and data["state_codec"] == "auto"
    assert set(data["orgs"]) == {"S0", "S1", "S2", "D0", "N0", "JENGA"}
    assert data["orgs"]["S1"] == {"units": 193, "unit_bytes": 524_288, "bytes": 101_187_584}
    d0 = data["orgs"]["D0"]
    assert d0["attention"] == {"units": 3_256, "unit_bytes": 16_384, "bytes": 53_346_304}
    assert d0["recurrent"] == {"units": 29, "unit_bytes": 1_594_368, "bytes": 46_236_672}
    assert d0["bytes"] == 99_582_976
    # Jenga: 63 x 1,605,632 B = 63 large pages, each 98 attention pages or one state page;
    # the state pages are carved from the same bytes (counted once)
    jenga = data["orgs"]["JENGA"]
    assert jenga["attention"] == {"units": 63 * 98, "unit_bytes": 16_384, "bytes": 101_154_816}
    assert jenga["recurrent"] == {"units": 63, "unit_bytes": 1_605_632, "bytes": 0}
    assert jenga["bytes"] == 101_154_816


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serving_core.planner", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )


def test_cli_json():
    result = _cli("--model", "falcon_h1_7b", "--budget", "b83", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["model"], data["budget"], data["nominal_bytes"]) == (
        "falcon_h1_7b", "b83", 133_267_456,
    )
    assert data["orgs"]["S0"]["units"] == 84
    assert data["orgs"]["S2"]["units"] == 254
    assert data["orgs"]["D0"]["attention"]["units"] == 4_289
    assert data["orgs"]["D0"]["recurrent"]["units"] == 39


def test_cli_pages_and_table():
    pages = _cli("--model", "falcon_h1_7b", "--pages", "254", "--json")
    assert json.loads(pages.stdout)["budget"] == "p254"
    table = _cli("--model", "falcon_h1_7b", "--budget", "b63")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert "diff to nominal" in lines[1]
    s1 = next(line.split() for line in lines if line.startswith("S1"))
    assert s1 == ["S1", "shared", "193", "524,288", "101,187,584", "96.500", "+32,768"]


@pytest.mark.parametrize(
    "args, needle",
    [(("--model", "nope", "--budget", "b63"), "falcon_h1_7b"),
     (("--model", "falcon_h1_7b", "--budget", "b0"), "pN"),
     (("--model", "falcon_h1_7b", "--pages", "x"), "pN"),
     (("--model", "falcon_h1_7b", "--budget", "b1"), "minimum is b3")],
)
def test_cli_errors_exit_2(args, needle):
    result = _cli(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert needle in result.stderr
