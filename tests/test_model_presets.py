"""Layer patterns and the presets of today's hybrids: state bytes and parameters by hand.

Every expectation is hand arithmetic on the public config fields quoted in the preset's
comment (conf/model/<name>.yaml). Every preset found there names its public source and
published size (its card, serving_core/model_card.py), and the parameter total its fields
derive is checked within 2 % of that size; where transformers builds the public
architecture on the meta device in a moment, the count is checked against its count.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from serving_core import layer_pattern as lp
from serving_core.executor.profiles import model_costs
from serving_core.geometry import MODEL_CONF_DIR, available_models, load_geometry
from serving_core.memory import org_layout
from serving_core.memory.n0 import n0_layout
from serving_core.model_card import card_params, counted_geometry, load_card, read_card
from serving_core.param_count import shared_block_params, shared_call_params
from serving_core.planner import nominal_bytes, plan_budget, plan_to_dict, units_for

REPO = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
# Published total sizes (model cards): 7B, 32B, 8B, 80B, 52B, 7.4B; every preset's card
# carries its own (test_every_preset_names_its_source_and_published_size).
PUBLISHED = {"granite_4_0_h_tiny": 7.0e9, "granite_4_0_h_small": 32.0e9,
             "nemotron_h_8b": 8.0e9, "qwen3_next_80b_a3b": 80.0e9, "jamba_v0_1": 52.0e9,
             "zamba2_7b": 7.4e9}
# A preset whose num_params is not its published size, and why.
NUM_PARAMS_DIFFERS = {
    "attention_only": "Falcon-H1-7B's count on purpose: the control prices the same dense "
                      "compute as the hybrid it is compared with",
}


def test_presets_are_discovered_from_the_config_directory():
    assert PRESETS == available_models() and len(PRESETS) >= 14
    assert {"zamba2_7b", "falcon_h1_7b", "nemotron_h_8b"} <= set(PRESETS)
    assert MODEL_CONF_DIR == REPO / "conf" / "model"


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_names_its_source_and_published_size(name):
    card = load_card(name)
    if card.source.startswith("hf:"):
        repo = card.source[3:].split()[0]
        owner, _, model = repo.partition("/")
        assert owner and model and "/" not in model, card.source
    else:  # not a public model: it says what it is built from
        assert any(word in card.source for word in ("control", "checkpoint")), card.source
    total, active = card_params(name)
    assert abs(total / card.published_params - 1) < 0.02, (total, card.published_params)
    if name in PUBLISHED:
        assert card.published_params == PUBLISHED[name]
    if name not in NUM_PARAMS_DIFFERS:
        assert abs(load_geometry(name).num_params / card.published_params - 1) < 0.02
    if not lp.shared_calls(counted_geometry(name).layer_strings):
        assert active <= total


def test_a_preset_without_its_card_is_refused_in_one_line():
    with pytest.raises(ValueError, match="model='x': no 'card' block; it needs card.source"):
        read_card("x", {"name": "x"})
    with pytest.raises(ValueError, match=r"card.published_params='7B': allowed values are"):
        read_card("x", {"card": {"source": "hf:a/b", "published_params": "7B"}})
    with pytest.raises(ValueError, match=r"card.source='': allowed values are hf:<repo id>"):
        read_card("x", {"card": {"source": "", "published_params": 1}})
    with pytest.raises(ValueError, match=r"count_fields has unknown fields \['vocab'\]"):
        read_card("x", {"card": {"source": "s", "published_params": 1,
                                 "count_fields": {"vocab": 1}}})


def test_the_card_is_not_part_of_a_run_identity():
    from conftest import compose_config
    from omegaconf import OmegaConf

    from experiments.runners.cell import config_hash

    for model in ("falcon_h1_7b", "zamba2_7b"):
        cfg = compose_config(f"model={model}")
        plain = OmegaConf.to_container(cfg, resolve=True)
        assert "card" in plain["model"]
        del plain["model"]["card"]
        assert config_hash(plain) == config_hash(cfg)
        plain["model"]["num_params"] += 1
        assert config_hash(plain) != config_hash(cfg)


def test_layer_strings_parse_and_runs_expand():
    assert lp.parse_layer("mamba2+moe") == ("mamba2", "moe")
    assert lp.parse_layer("attention") == ("attention", "none")
    assert lp.parse_layer("mlp") == ("none", "mlp")
    assert lp.expand_layers([[2, "gdn+moe"], "attention+moe"]) == (
        "gdn+moe", "gdn+moe", "attention+moe")
    for bad in ("mamba3", "attention+ffn", [0, "mlp"], [True, "mlp"], 7):
        with pytest.raises(ValueError, match="model.layers entry"):
            lp.expand_layers([bad])


@pytest.mark.parametrize("name, counts, g", [
    ("falcon_h1_7b", {"attention": 44, "mamba2": 44, "gdn": 0, "mamba1": 0}, 44),
    ("granite", {"attention": 40, "mamba2": 40, "gdn": 0, "mamba1": 0}, 40),
    ("granite_4_0_h_tiny", {"attention": 4, "mamba2": 36, "gdn": 0, "mamba1": 0}, 4),
    ("granite_4_0_h_small", {"attention": 4, "mamba2": 36, "gdn": 0, "mamba1": 0}, 4),
    ("nemotron_h_8b", {"attention": 4, "mamba2": 24, "gdn": 0, "mamba1": 0}, 4),
    ("qwen3_next_80b_a3b", {"attention": 12, "mamba2": 0, "gdn": 36, "mamba1": 0}, 12),
    ("jamba_v0_1", {"attention": 4, "mamba2": 0, "gdn": 0, "mamba1": 28}, 4),
    ("attention_only", {"attention": 44, "mamba2": 0, "gdn": 0, "mamba1": 0}, 44),
    # 13 shared-block calls keep KV of their own; all 81 layers keep a Mamba2 state
    ("zamba2_7b", {"attention": 13, "mamba2": 81, "gdn": 0, "mamba1": 0}, 1),
])
def test_pattern_sums_and_storage_groups(name, counts, g):
    geometry = load_geometry(name)
    assert geometry.state_layer_counts == counts
    assert geometry.scope_layers == g
    assert len(geometry.layer_strings) == geometry.num_layers


def test_nemotron_pattern_is_the_published_override_string():
    # hybrid_override_pattern of nvidia/Nemotron-H-8B-Base-8K: M mamba2, * attention, - mlp
    published = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    kinds = {"M": "mamba2", "*": "attention", "-": "mlp"}
    assert load_geometry("nemotron_h_8b").layers == tuple(kinds[c] for c in published)


def test_granite_tiny_attention_positions():
    layers = load_geometry("granite_4_0_h_tiny").layers
    assert [i for i, s in enumerate(layers) if s.startswith("attention")] == [5, 15, 25, 35]
    assert all(s.endswith("+moe") for s in layers)


# Whole-model KV bytes per token: attention layers x KV heads x head_dim x (K, V) x 2 B.
@pytest.mark.parametrize("name, kv", [
    ("falcon_h1_7b", 44 * 2 * 128 * 2 * 2),          # 45,056
    ("granite_4_0_h_tiny", 4 * 4 * 128 * 2 * 2),     # 8,192
    ("granite_4_0_h_small", 4 * 8 * 128 * 2 * 2),    # 16,384
    ("nemotron_h_8b", 4 * 8 * 128 * 2 * 2),          # 16,384
    ("qwen3_next_80b_a3b", 12 * 2 * 256 * 2 * 2),    # 24,576
    ("jamba_v0_1", 4 * 8 * 128 * 2 * 2),             # 16,384
    ("zamba2_7b", 13 * 32 * 224 * 2 * 2),            # 372,736: one KV per shared-block call
])
def test_kv_bytes_per_token_by_hand(name, kv):
    g = load_geometry(name)
    assert g.kv_bytes_per_token == kv
    assert g.attention_bytes_per_token * g.scope_layers == kv


def test_granite_tiny_kv_is_its_four_attention_layers():
    g = load_geometry("granite_4_0_h_tiny")
    assert g.kv_bytes_per_token == 4 * 2_048 == 8_192
    # the paper's Granite preset puts KV on all 40 layers: ten times as much
    assert load_geometry("granite").kv_bytes_per_token == 40 * 2_048 == 10 * 8_192


# Per-checkpoint recurrent bytes, whole model (bf16).
def test_recurrent_bytes_per_checkpoint_by_hand():
    # Granite-4.0-H-Tiny: 36 Mamba2 layers; SSM 48 x 64 x 128 x 2 = 786,432;
    # conv (48 x 64 + 2 x 1 x 128) x 3 x 2 = 3,328 x 6 = 19,968
    tiny = load_geometry("granite_4_0_h_tiny")
    assert tiny.recurrent_bytes_per_checkpoint == 36 * (786_432 + 19_968) == 29_030_400
    assert (tiny.ssm_bytes, tiny.conv_bytes) == (9 * 786_432, 9 * 19_968)  # one group
    # Granite-4.0-H-Small: SSM 128 x 64 x 128 x 2 = 2,097,152; conv (8,192 + 256) x 6 = 50,688
    small = load_geometry("granite_4_0_h_small")
    assert small.recurrent_bytes_per_checkpoint == 36 * (2_097_152 + 50_688)
    # Nemotron-H-8B: 24 layers; conv channels 8,192 + 2 x 8 x 128 = 10,240 -> 61,440
    nem = load_geometry("nemotron_h_8b")
    assert nem.recurrent_bytes_per_checkpoint == 24 * (2_097_152 + 61_440)
    # Qwen3-Next: 36 GDN layers; state 32 x 128 x 128 x 2 = 1,048,576;
    # conv (2 x 16 x 128 + 32 x 128) x 3 x 2 = 8,192 x 6 = 49,152
    qwen = load_geometry("qwen3_next_80b_a3b")
    assert qwen.recurrent_bytes_per_checkpoint == 36 * (1_048_576 + 49_152)
    assert (qwen.ssm_bytes, qwen.conv_bytes) == (3 * 1_048_576, 3 * 49_152)
    # Jamba: 28 Mamba layers; state 8,192 x 16 x 2 = 262,144; conv 8,192 x 3 x 2 = 49,152
    jamba = load_geometry("jamba_v0_1")
    assert jamba.recurrent_bytes_per_checkpoint == 28 * (262_144 + 49_152)


def test_falcon_scope_is_one_layer_as_before():
    f = load_geometry("falcon_h1_7b")
    assert (f.attention_bytes_per_token, f.ssm_bytes, f.conv_bytes) == (1_024, 1_572_864, 21_504)
    assert f.recurrent_bytes_per_checkpoint == 44 * 1_594_368


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameters_from_the_pattern_within_two_percent(name):
    total, active = load_geometry(name).pattern_params()
    assert abs(total / PUBLISHED[name] - 1) < 0.02, total
    assert active <= total or lp.shared_calls(load_geometry(name).layers)


def test_falcon_h1_7b_parameters_from_its_pattern():
    # tiiuae/Falcon-H1-7B-Instruct config.json: vocab_size 130048, intermediate_size 12288,
    # untied embeddings; every layer attention + Mamba2 + MLP (the preset has no pattern).
    f = dataclasses.replace(load_geometry("falcon_h1_7b"), layers=("hybrid+mlp",) * 44,
                            vocab_size=130_048, intermediate_size=12_288)
    total, _ = f.pattern_params()
    assert abs(total / 7.59e9 - 1) < 0.02


def test_nemotron_parameters_exactly_by_hand():
    # embeddings 2 x 131,072 x 4,096; Mamba2 layer: in_proj 4,096 x 18,560, conv 10,240 x 5,
    # A/D/dt 384, norm 8,192, out_proj 8,192 x 4,096; attention 4,096 x (4,096 + 2 x 1,024)
    # + 4,096 x 4,096; MLP 2 x 4,096 x 21,504; one norm per layer and a final one.
    mamba = 4_096 * 18_560 + 10_240 * 5 + 384 + 8_192 + 8_192 * 4_096
    attention = 4_096 * (4_096 + 2 * 1_024) + 4_096 * 4_096
    mlp = 2 * 4_096 * 21_504
    expected = 2 * 131_072 * 4_096 + 24 * mamba + 4 * attention + 24 * mlp + 53 * 4_096
    assert load_geometry("nemotron_h_8b").pattern_params() == (expected, expected)
    assert expected == 8_100_852_736


def test_moe_active_parameters_by_hand():
    # Granite-4.0-H-Tiny: per layer, 64 experts of 3 x 1,536 x 512 (6 active), router
    # 1,536 x 64, shared expert 3 x 1,536 x 1,024
    g = load_geometry("granite_4_0_h_tiny")
    total, active = g.pattern_params()
    assert total - active == 40 * (64 - 6) * 3 * 1_536 * 512


def test_step_model_terms_sum_over_the_layers_that_carry_them():
    g = load_geometry("granite_4_0_h_tiny")
    c = model_costs(g)
    assert c.kv_bytes_per_token == 8_192
    assert c.state_bytes_per_composite == 29_030_400
    assert c.attention_flops_per_pair == 4 * 12 * 128 * 4  # four attention layers
    assert c.scan_flops_per_token == 4 * 36 * 48 * 64 * 128  # 36 Mamba2 layers
    assert c.scan_flops_per_intra_pair == 2 * 36 * (48 * 64 + 1 * 128)
    assert c.dense_flops_per_token == 2 * g.pattern_params()[1]  # active parameters
    q = model_costs(load_geometry("qwen3_next_80b_a3b"))
    # GDN scans value heads x value dim x key dim, grouped over the key heads
    assert q.scan_flops_per_token == 4 * 36 * 32 * 128 * 128
    assert q.scan_flops_per_intra_pair == 2 * 36 * (32 * 128 + 16 * 128)


def test_falcon_step_model_terms_unchanged():
    c = model_costs(load_geometry("falcon_h1_7b"))
    assert c.kv_bytes_per_token == 44 * 1_024
    assert c.dense_flops_per_token == 2 * 7_590_000_000
    assert c.scan_flops_per_token == 4 * 24 * 128 * 256 * 44


def test_organization_layouts_over_granite_tiny():
    g = load_geometry("granite_4_0_h_tiny")
    group_state = 9 * (786_432 + 19_968)  # 7,257,600
    # S0: max(512 x 2,048, group composite)
    assert org_layout(g, "S0").page_bytes == max(512 * 2_048, group_state) == 7_257_600
    s1 = org_layout(g, "S1")
    assert (s1.page_bytes, s1.ssm_members) == (1_048_576, 7)  # ceil(7,077,888 / 1 MiB)
    s2 = org_layout(g, "S2")
    # one slot holds the group's 9 conv windows: 179,712 B -> 256 KiB, 4 per 1-MiB slab
    assert (s2.conv_slot_bytes, s2.slots_per_slab) == (262_144, 4)
    d0 = org_layout(g, "D0")
    assert (d0.page_bytes, d0.recurrent_unit_bytes) == (16 * 2_048, group_state)
    # N0 as vLLM pages it: per layer, 806,400 B of state -> 16 x ceil(806,400 / 32,768)
    # = 400-token blocks, a page of 819,200 B; a checkpoint is one page per Mamba2 layer
    n0 = n0_layout(g)
    assert (n0.block_tokens, n0.page_bytes, n0.units_per_composite) == (400, 819_200, 9)


def test_paper_granite_numbers_stay_exact():
    g = load_geometry("granite")
    plan = plan_budget(g, "b160")
    assert plan.nominal_bytes == 173_015_040
    assert org_layout(g, "D0").page_bytes == 32_768
    assert org_layout(g, "D0").recurrent_unit_bytes == 1_074_688
    assert g.d0_attention_fraction == 0.199699


def test_mib_budget_is_whole_model_bytes():
    g = load_geometry("granite_4_0_h_tiny")
    assert nominal_bytes(g, "4096MiB") == 4_096 * 2**20 // 4
    assert plan_budget(g, "4096MiB").model_nominal_bytes == 4_096 * 2**20
    # Falcon: 44 groups of one layer
    assert nominal_bytes(load_geometry("falcon_h1_7b"), "4400MiB") == 4_400 * 2**20 // 44


def test_planner_json_carries_whole_model_bytes():
    out = subprocess.run([sys.executable, "-m", "serving_core.planner", "--model",
                          "granite_4_0_h_tiny", "--budget", "4096MiB", "--json"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 8_192
    assert data["recurrent_bytes_per_checkpoint"] == 29_030_400
    assert (data["scope_layers"], data["model_nominal_bytes"]) == (4, 4_096 * 2**20)


def test_an_organization_that_cannot_hold_the_pattern_is_refused_alone():
    # one KV head: a 512-token page is 512 x 512 B = 256 KiB; the group's conv state
    # (6 x 61,440 = 368,640 B) fits neither S1's conv page nor S2's 512-KiB slot; S0, D0
    # and N0 still hold it
    g = dataclasses.replace(load_geometry("nemotron_h_8b"), num_kv_heads=1)
    plan = plan_budget(g, "4096MiB")
    assert {org for org, _ in plan.refused} == {"S1", "S2"}
    with pytest.raises(ValueError, match="org=s1 cannot hold model 'nemotron_h_8b'"):
        units_for(plan, "s1")
    assert units_for(plan, "s0")["shared"] > 0
    assert plan_to_dict(plan)["orgs"]["S2"]["refused"].startswith("org=s2 cannot hold")


def test_n0_refuses_a_group_with_two_attention_layers():
    # 8 attention and 36 Mamba2 layers: gcd 4, two attention layers per group
    layers = ("attention+mlp",) * 8 + ("mamba2+mlp",) * 36
    g = dataclasses.replace(load_geometry("nemotron_h_8b"), num_layers=44, layers=layers)
    assert g.scope_layers == 4
    with pytest.raises(ValueError, match="org=n0 cannot hold.*2 attention layers"):
        org_layout(g, "N0")


# The command line's one-line exit 2 for a bad layer pattern (num_layers, sliding_window,
# vocab_size) and for an organization that cannot hold a preset (Nemotron-H under S2, Zamba2
# under N0) is checked with the other bad input, in one batch: tests/test_bad_input.py.


def test_a_pattern_needs_its_mixer_fields():
    g = load_geometry("qwen3_next_80b_a3b")
    with pytest.raises(ValueError, match="model.gdn_key_heads=0"):
        dataclasses.replace(g, gdn_key_heads=0)
    with pytest.raises(ValueError, match="model.mamba1_d_inner=8"):
        dataclasses.replace(g, mamba1_d_inner=8)


def test_torch_arena_refuses_a_pattern():
    from serving_core.executor.state_arena import StateArena

    with pytest.raises(ValueError, match="torch arena holds storage groups of one attention"):
        StateArena(object(), load_geometry("qwen3_next_80b_a3b"))


# ----- weight-shared blocks (Zamba2-7B) -------------------------------------------------------
def test_shared_layer_strings_parse():
    assert lp.parse_layer("shared+mamba2") == ("mamba2", "none")
    assert lp.parse_layer("shared") == ("none", "none")
    assert lp.shared_calls(("shared+mamba2", "mamba2", "shared")) == 2
    assert lp.state_counts(("shared+mamba2", "mamba2"))["attention"] == 1
    for bad in ("shared+shared", "shared+ffn", "mamba2+shared"):
        with pytest.raises(ValueError, match="model.layers entry"):
            lp.parse_layer(bad)


def test_zamba2_parameters_by_hand():
    # h 3,584; a (the shared attention's input) 2 h = 7,168; 32 heads and 32 KV heads of
    # 224: q, k, v 7,168 x 7,168 each, o 7,168 x 3,584; MLP gate/up 3,584 x 28,672 and down
    # 14,336 x 3,584; norms 7,168 + 3,584. Per call: projection 3,584 x 3,584; LoRA rank 128
    # on q, k, v (7,168 x 128 + 128 x 7,168 each) and on gate/up (3,584 x 128 + 128 x 28,672).
    block = 3 * 7_168 * 7_168 + 7_168 * 3_584 + 3 * 3_584 * 14_336 + 7_168 + 3_584
    call = 3_584 * 3_584 + 3 * 2 * 7_168 * 128 + 3_584 * 128 + 128 * 28_672
    g = load_geometry("zamba2_7b")
    assert (shared_block_params(g), shared_call_params(g)) == (block, call)
    # Mamba2 layer: in_proj 3,584 x (2 x 7,168 + 2 x 2 x 64 + 112), conv 7,424 x 5,
    # A/D/dt 3 x 112, gated norm 7,168, out_proj 7,168 x 3,584, its input norm 3,584
    mamba = (3_584 * (2 * 7_168 + 256 + 112) + 7_424 * 5 + 336 + 7_168 + 7_168 * 3_584
             + 3_584)
    total, active = g.pattern_params()
    # tied embeddings, final norm, 81 Mamba2 layers, 2 blocks once, 13 calls' own weights
    assert total == 32_000 * 3_584 + 3_584 + 81 * mamba + 2 * block + 13 * call
    assert total == 7_428_314_960  # 0.4 % above the published 7.4B
    # a token runs through a shared block at each of its 13 calls
    assert active == total + 11 * block
    # counted per call instead, as before shared blocks could be written: 2.8B too many
    assert total + 11 * block > 1.35 * 7.4e9


def zamba2_config(g):
    """transformers' Zamba2Config of the preset's fields (no download)."""
    from transformers import Zamba2Config

    calls = [i for i, s in enumerate(g.layers) if s.startswith("shared")]
    return Zamba2Config(
        vocab_size=g.vocab_size, hidden_size=g.hidden_size, num_hidden_layers=g.num_layers,
        layers_block_type=["hybrid" if i in calls else "mamba" for i in range(g.num_layers)],
        mamba_d_state=g.d_state, mamba_d_conv=g.d_conv, mamba_ngroups=g.n_groups,
        mamba_expand=g.mamba_inner // g.hidden_size, n_mamba_heads=g.mamba_heads,
        intermediate_size=g.intermediate_size, num_attention_heads=g.num_attention_heads,
        num_key_value_heads=g.num_kv_heads, num_mem_blocks=g.shared_blocks,
        use_shared_attention_adapter=g.shared_attention_adapter,
        adapter_rank=g.shared_adapter_rank, use_mem_rope=True,
        tie_word_embeddings=g.tie_word_embeddings)


def granite_config(g):
    """transformers' GraniteMoeHybridConfig of the preset's fields (no download)."""
    from transformers import GraniteMoeHybridConfig

    types = ["attention" if s.startswith("attention") else "mamba" for s in g.layers]
    moe = g.num_experts > 0
    return GraniteMoeHybridConfig(
        vocab_size=g.vocab_size, hidden_size=g.hidden_size, num_hidden_layers=g.num_layers,
        num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_kv_heads,
        mamba_n_heads=g.mamba_heads, mamba_d_head=g.mamba_head_dim, mamba_d_state=g.d_state,
        mamba_n_groups=g.n_groups, mamba_d_conv=g.d_conv,
        mamba_expand=g.mamba_inner // g.hidden_size, layer_types=types,
        num_local_experts=g.num_experts, num_experts_per_tok=g.experts_per_token,
        intermediate_size=g.expert_intermediate_size if moe else g.intermediate_size,
        shared_intermediate_size=(g.shared_expert_intermediate_size if moe
                                  else g.intermediate_size),
        tie_word_embeddings=g.tie_word_embeddings, position_embedding_type="nope")


def nemotron_config(g):
    from transformers import NemotronHConfig

    marks = {"mamba2": "M", "attention": "*", "mlp": "-"}
    return NemotronHConfig(
        vocab_size=g.vocab_size, hidden_size=g.hidden_size, num_hidden_layers=g.num_layers,
        hybrid_override_pattern="".join(marks[s] for s in g.layers),
        num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_kv_heads,
        head_dim=g.head_dim, mamba_num_heads=g.mamba_heads, mamba_head_dim=g.mamba_head_dim,
        ssm_state_size=g.d_state, n_groups=g.n_groups, conv_kernel=g.d_conv,
        intermediate_size=g.intermediate_size, mlp_hidden_act="relu2",
        tie_word_embeddings=g.tie_word_embeddings)


@pytest.mark.parametrize("name, build", [
    ("zamba2_7b", zamba2_config),  # shared blocks once: 7,428,314,960
    ("granite_4_0_h_tiny", granite_config),
    ("granite_4_0_h_small", granite_config),
    ("granite", granite_config),  # Granite-4.0-H-Micro's pattern (the card's count_fields)
    ("nemotron_h_8b", nemotron_config),
])
def test_count_equals_transformers_on_the_meta_device(name, build):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    g = counted_geometry(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build(g))
    # num_parameters counts a tied tensor once: Zamba2's 13 calls hold 2 blocks
    assert model.num_parameters() == g.pattern_params()[0]


def test_zamba2_state_for_the_planner():
    g = load_geometry("zamba2_7b")
    # 81 Mamba2 states: SSM 112 x 64 x 64 x 2 = 917,504; conv (7,168 + 2 x 2 x 64) x 3 x 2
    # = 44,544; one storage group (gcd(13, 81) = 1)
    assert (g.ssm_bytes, g.conv_bytes) == (81 * 917_504, 81 * 44_544)
    assert g.recurrent_bytes_per_checkpoint == 81 * 962_048 == 77_925_888
    assert g.attention_bytes_per_token == g.kv_bytes_per_token == 13 * 28_672
    c = model_costs(g)
    assert c.attention_flops_per_pair == 4 * 32 * 224 * 13  # each call attends
    assert c.scan_flops_per_token == 4 * 81 * 112 * 64 * 64
    plan = plan_budget(g, "4096MiB")
    assert units_for(plan, "s0")["shared"] > 0 and units_for(plan, "d0")["recurrent"] > 0
    with pytest.raises(ValueError, match="org=n0 cannot hold model 'zamba2_7b'.*13 attention"):
        units_for(plan, "n0")


@pytest.mark.parametrize("change, message", [
    ({"shared_blocks": 0}, "model.shared_blocks=0: a pattern with shared\\+ layers needs it"),
    ({"shared_attention_hidden_size": 0}, "model.shared_attention_hidden_size=0"),
    ({"shared_adapter_rank": -1}, "model.shared_adapter_rank=-1"),
    ({"layers": ("mamba2",) * 81}, "model.shared_blocks=2: no layer of model.layers is shared"),
])
def test_shared_block_fields_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(load_geometry("zamba2_7b"), **change)
    with pytest.raises(ValueError, match="model.shared_blocks=2: no layer of model.layers"):
        load_geometry("falcon_h1_7b", shared_blocks=2)  # a preset without a pattern
