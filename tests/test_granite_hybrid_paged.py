"""The second architecture served by the torch executor over every organization's pages.

The Granite-4.0-H-style tiny checkpoint (attention in one layer of four, Mamba2 in three,
MoE blocks; conf/model/granite_hybrid_tiny.yaml) is one storage group of one attention and
three Mamba2 layers: its composite carries the three layers' states stacked. Our engine serves
the prompts with the model's KV and recurrent state in the organization's units and must
produce transformers' own greedy tokens (GraniteMoeHybridForCausalLM.generate) for S0, S1, S2,
D0, N0 (vLLM's per-layer pages: a checkpoint is one page per Mamba2 layer) and Jenga: when a
later request adopts the checkpoint a first one published, when a tiny budget forces
preemption and resumption, and when prefill is chunked at sizes that do not align with the
checkpoint interval.
"""

from __future__ import annotations

import engines
import pytest

from serving_core.geometry import load_geometry

PRESET = "granite_hybrid_tiny"
OUTPUT_TOKENS = 32
SHORT = (1000, (10, 15, 20))  # checkpoints at 512 (S orgs)
LONG = (1800, (10, 15))  # D0: its checkpoint at 1,792


@pytest.fixture(scope="module")
def checkpoint(granite_tiny_checkpoint):
    """The session's tiny Granite checkpoint (built once per test run, not once more here)."""
    return granite_tiny_checkpoint


@pytest.fixture(scope="module")
def model(granite_tiny_model):
    return granite_tiny_model


def test_the_reference_tokens_vary(reference, long_reference):
    """Token-for-token equality proves something only if the continuations are not one
    repeated token."""
    assert all(len(set(tokens)) > 4 for tokens in (*reference, *long_reference))


def _transformers_greedy(checkpoint, prompts):
    return engines.transformers_generate("GraniteMoeHybridForCausalLM", checkpoint, prompts,
                                         OUTPUT_TOKENS)[0]


prompts, long_prompts, reference, long_reference = engines.reference_fixtures(
    SHORT, LONG, _transformers_greedy, "checkpoint")


CHECKS = engines.GreedyChecks(PRESET, OUTPUT_TOKENS)


def test_one_group_of_one_attention_and_three_mamba2_layers():
    g = load_geometry(PRESET)
    assert (g.scope_layers, g.state_layer_counts["attention"], g.state_layer_counts["mamba2"]) \
        == (1, 1, 3)
    # KV 2 heads x 32 x (K, V) x 4 B; the composite 3 x (8 x 32 x 64 + 384 x 3) x 4 B
    assert (g.attention_bytes_per_token, g.composite_bytes) == (512, 3 * (65_536 + 4_608))


@pytest.mark.parametrize("org", ["S0", "S1", "S2"])
def test_greedy_equals_transformers_and_adopted_prefix_continues_exactly(
    model, prompts, reference, org
):
    CHECKS.adoption(model, prompts, reference, org, 512)


@pytest.mark.parametrize(("org", "adopted"), [("N0", 864), ("JENGA", 512)])
def test_n0_and_jenga_greedy_equal_transformers_with_adoption(
    model, prompts, reference, org, adopted
):
    """N0: vLLM's per-layer pages (one 144-token page per attention block, a checkpoint one
    page per Mamba2 layer of the group: 3), every boundary published, so the 1,000 shared
    tokens give 6 x 144 = 864; Jenga: S2's 512-token grid."""
    CHECKS.adoption(model, prompts, reference, org, adopted)


def test_d0_greedy_and_adoption_with_a_boundary_inside_a_chunk(
    model, long_prompts, long_reference
):
    result = CHECKS.adoption(model, long_prompts, long_reference, "D0", 1792, 1000)
    assert max(result.tables["steps"]["prefill_tokens_initial"]) == 1000


def test_preemption_and_resume_continue_exactly(model, prompts, reference):
    CHECKS.preemption(model, prompts, reference, "S2", "p7")


@pytest.mark.parametrize(("org", "chunk"),
                         [("S1", 300), ("S2", 700), ("S0", 450), ("N0", 300)])
def test_chunked_prefill_continues_exactly(model, prompts, reference, org, chunk):
    CHECKS.chunked_prefill(model, prompts, reference, org, chunk)
