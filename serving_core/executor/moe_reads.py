"""The expert weights a MoE step reads: the experts its tokens are routed to, not all of them.

With top-k routing over E experts, a token reaches a given expert with probability k/E; taken
as independent across the n tokens of a step, the expected number of distinct experts a layer
reads is E (1 - (1 - k/E)^n) (tests/test_device_fit.py holds it to a brute-force count). A
step then streams the model's non-expert weights once and, per MoE layer, that many experts.
"""

from __future__ import annotations


def expected_experts(num_experts: int, top_k: int, tokens: float):
    """E (1 - (1 - k/E)^n): expected distinct experts n tokens reach (numbers or arrays)."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: allowed 1..num_experts ({num_experts})")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def moe_split(geometry) -> tuple[int, int, int]:
    """(bytes of one expert of one layer, MoE layers, non-expert weight bytes) of a model;
    (0, 0, weight_bytes) for a dense one. The non-expert bytes are the published total
    less every expert, so the whole model is read once when every expert is touched."""
    from serving_core import layer_pattern as lp

    g = geometry
    if not g.num_experts or g.layers is None:
        return 0, 0, g.weight_bytes
    moe_layers = sum(lp.parse_layer(text)[1] == "moe" for text in g.layer_strings)
    expert = (3 if g.mlp_gated else 2) * g.hidden_size * g.expert_intermediate_size
    expert_bytes = expert * g.dtype_bytes
    return expert_bytes, moe_layers, g.weight_bytes - moe_layers * g.num_experts * expert_bytes


def weight_bytes_read(costs, tokens):
    """Weight bytes a step of `tokens` routed tokens streams (whole model when dense)."""
    if not costs.moe_layers:
        return costs.weight_bytes
    reached = expected_experts(costs.num_experts, costs.experts_per_token, tokens)
    return costs.dense_weight_bytes + costs.moe_layers * reached * costs.expert_bytes
