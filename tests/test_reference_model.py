"""Greedy generation through the engine on the tiny checkpoint equals transformers.

The reference is transformers' own FalconH1ForCausalLM (fp32, torch-native path, its own
cache) generating greedily on each prompt alone. Our engine serves the same prompts with
the model's KV and recurrent state in the organization's units, and must produce the same
32 tokens for every request: for S0, S1, S2 and D0, when a later request adopts the
shared-prefix checkpoint a first one published, when a tiny budget forces preemption and
resumption, and when prefill is chunked at sizes that do not align with the interval.
"""

from __future__ import annotations

import engines
import pytest

OUTPUT_TOKENS = 32
# Prompts: a shared document plus a question. S orgs: a 1,000-token document (checkpoints at
# 512), decoding crosses the 1,024-token block and checkpoint boundary (the shortest prompt,
# 1,010 tokens, decodes to 1,042; 32 tokens, not 64: decoding is most of the CPU here).
# D0: a 1,800-token document (its checkpoint at 1,792).
SHORT = (1000, (10, 15, 20))
LONG = (1800, (10, 15))


def _transformers_greedy(checkpoint, prompts):
    """transformers' greedy continuation of each prompt alone (`generate`, EOS ignored):
    the same tokens as feeding it token by token with its cache, in 70 % of the CPU."""
    return engines.transformers_generate("FalconH1ForCausalLM", checkpoint, prompts,
                                         OUTPUT_TOKENS)[0]


prompts, long_prompts, reference, long_reference = engines.reference_fixtures(
    SHORT, LONG, _transformers_greedy, "tiny_checkpoint")


CHECKS = engines.GreedyChecks("falcon_h1_tiny", OUTPUT_TOKENS)


@pytest.mark.parametrize("org", ["S0", "S1", "S2", "JENGA"])
def test_greedy_equals_transformers_and_adopted_prefix_continues_exactly(
    tiny_model, prompts, reference, org
):
    CHECKS.adoption(tiny_model, prompts, reference, org, 512)


def test_d0_greedy_and_adoption_with_a_boundary_inside_a_chunk(
    tiny_model, long_prompts, long_reference
):
    # 1,000-token chunks: the 1,792 boundary falls inside the second chunk.
    result = CHECKS.adoption(tiny_model, long_prompts, long_reference, "D0", 1792, 1000)
    assert max(result.tables["steps"]["prefill_tokens_initial"]) == 1000


# Jenga: 5 large pages, first-chunk admission and 256-token chunks, so that three requests
# run at once and must preempt (whole-prompt admission would make them wait instead)
@pytest.mark.parametrize(("org", "budget", "rules"), [
    ("S2", "p13", {}), ("JENGA", "b5", {"admission": "first_chunk", "max_tokens": 256})])
def test_preemption_and_resume_continue_exactly(tiny_model, prompts, reference, org, budget,
                                                 rules):
    CHECKS.preemption(tiny_model, prompts, reference, org, budget, **rules)


@pytest.mark.parametrize(("org", "chunk"), [("S1", 300), ("S2", 700), ("JENGA", 700)])
def test_chunked_prefill_continues_exactly(tiny_model, prompts, reference, org, chunk):
    CHECKS.chunked_prefill(tiny_model, prompts, reference, org, chunk)
