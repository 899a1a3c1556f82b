"""Parameter counts of a layer pattern (total and active per token), from its fields.

Bias-free projections as in the public models; one RMSNorm per block present (mixer, FFN)
and a final norm. Counted per block (hidden h):

- attention: q h x (heads x dh, twice with an output gate), k and v h x kv x dh each, o
  heads x dh x h;
- mamba2: in_proj h x (2 inner + 2 G N + H), depthwise conv (inner + 2 G N) x (k + 1 bias),
  A, D, dt bias (3 H), gated norm (inner), out_proj inner x h;
- gdn: in_proj h x (2 Hk dk + 2 Hv dv) and h x 2 Hv (beta, a), conv (2 Hk dk + Hv dv) x k,
  A and dt bias (2 Hv), norm (dv), out_proj Hv dv x h;
- mamba1: in_proj h x 2 inner, conv inner x (k + 1), x_proj inner x (R + 2 N), dt_proj
  (R + 1) x inner, A inner x N, D inner, out_proj inner x h;
- mlp: 3 h I gated (gate, up, down), 2 h I otherwise;
- moe: router h x E, E experts of 3 h Ie (k of them active), a shared expert 3 h Is and its
  gate (h) when present.

Weight-shared blocks (layers written `shared+...`, Zamba2): each of the `shared_blocks`
blocks is counted once however many layers call it: attention on an input of
`shared_attention_hidden_size` (Zamba2: 2 h, the layer input and the original embedding),
q a x heads dh, k and v a x kv dh each, o heads dh x h; an MLP as above; two norms (a, h).
Each call has its own h x h output projection and LoRA adapters of rank r: gate/up
(h x r + r x 2 I, or r x I ungated) and, with shared_attention_adapter, q, k and v
(3 x 2 a r).

The active count replaces the E experts by the k a token is routed to and counts a shared
block at every call (a token multiplies through it each time), so a model with shared
blocks has more active parameters than parameters. A test (tests/test_model_presets.py)
holds every preset's total within 2 % of its published size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving_core import layer_pattern as lp

if TYPE_CHECKING:
    from serving_core.geometry import Geometry


def _attention(g: Geometry, width: int) -> int:
    """q, k, v from an input of `width`, o back to hidden."""
    q = g.num_attention_heads * g.head_dim
    return (width * q * (2 if g.attention_output_gate else 1)
            + 2 * width * g.num_kv_heads * g.head_dim + q * g.hidden_size)


def mixer_params(g: Geometry, mixer: str) -> int:
    h = g.hidden_size
    if mixer == "none":
        return 0
    if mixer == "attention":
        return _attention(g, h)
    if mixer == "mamba2":
        inner, gn, heads = g.mamba_inner, g.n_groups * g.d_state, g.mamba_heads
        conv_dim = inner + 2 * gn
        return (h * (2 * inner + 2 * gn + heads) + conv_dim * (g.d_conv + 1) + 3 * heads
                + inner + inner * h)
    if mixer == "hybrid":
        return mixer_params(g, "attention") + mixer_params(g, "mamba2")
    if mixer == "gdn":
        kd = g.gdn_key_heads * g.gdn_key_head_dim
        vd = g.gdn_value_heads * g.gdn_value_head_dim
        return (h * (2 * kd + 2 * vd) + h * 2 * g.gdn_value_heads + (2 * kd + vd) * g.gdn_conv
                + 2 * g.gdn_value_heads + g.gdn_value_head_dim + vd * h)
    if mixer == "mamba1":
        inner, n, r = g.mamba1_d_inner, g.mamba1_d_state, g.mamba1_dt_rank
        return (h * 2 * inner + inner * (g.mamba1_d_conv + 1) + inner * (r + 2 * n)
                + (r + 1) * inner + inner * n + inner + inner * h)
    raise ValueError(f"mixer={mixer!r}: allowed values are {', '.join(lp.MIXERS)}")


def ffn_params(g: Geometry, ffn: str) -> tuple[int, int]:
    """(total, active) parameters of one FFN block."""
    h = g.hidden_size
    if ffn == "none":
        return 0, 0
    if ffn == "mlp":
        n = (3 if g.mlp_gated else 2) * h * g.intermediate_size
        return n, n
    if ffn == "moe":
        expert = (3 if g.mlp_gated else 2) * h * g.expert_intermediate_size
        shared = 3 * h * g.shared_expert_intermediate_size
        shared += h if g.shared_expert_gate and g.shared_expert_intermediate_size else 0
        router = h * g.num_experts
        return (router + g.num_experts * expert + shared,
                router + g.experts_per_token * expert + shared)
    raise ValueError(f"ffn={ffn!r}: allowed values are {', '.join(lp.FFNS)}")


def shared_block_params(g: Geometry) -> int:
    """One weight-shared block: attention on its wide input, the MLP, two norms."""
    width = g.shared_attention_hidden_size
    return _attention(g, width) + ffn_params(g, "mlp")[0] + width + g.hidden_size


def shared_call_params(g: Geometry) -> int:
    """What each call of a shared block has of its own: the output projection and the
    LoRA adapters (gate/up; q, k, v with shared_attention_adapter)."""
    h, r, width = g.hidden_size, g.shared_adapter_rank, g.shared_attention_hidden_size
    gate_up = (2 if g.mlp_gated else 1) * g.intermediate_size
    adapters = (h * r + r * gate_up) if r else 0
    if r and g.shared_attention_adapter:
        adapters += 3 * 2 * width * r
    return h * h + adapters


def count_params(g: Geometry) -> tuple[int, int]:
    """(total, active) parameters of the whole model."""
    h = g.hidden_size
    embed = g.vocab_size * h * (1 if g.tie_word_embeddings else 2)
    total = active = embed + h  # embeddings (+ untied head) and the final norm
    calls = lp.shared_calls(g.layer_strings)
    if calls:
        block, own = shared_block_params(g), shared_call_params(g)
        total += min(g.shared_blocks, calls) * block + calls * own
        active += calls * (block + own)
    for text in g.layer_strings:
        mixer, ffn = lp.parse_layer(text)
        norms = h * ((mixer != "none") + (ffn != "none"))
        ffn_total, ffn_active = ffn_params(g, ffn)
        m = mixer_params(g, mixer)
        total += norms + m + ffn_total
        active += norms + m + ffn_active
    return total, active
