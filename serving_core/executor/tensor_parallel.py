"""A simulated tensor-parallel device: t GPUs, each holding 1/t of the model.

Megatron-style tensor parallelism splits every projection's weights, the attention heads
(KV) and the recurrent heads (state) evenly over the t GPUs, so each GPU streams 1/t of the
bytes and runs 1/t of the FLOPs of a step, all in parallel: the step model prices a step on
t x the one-GPU peaks (bandwidth, FLOP/s). Each block's output is summed across the GPUs by
one all-reduce per mixer and one per FFN of every layer (`allreduce_count`), of the step's
tokens x hidden x dtype bytes; a ring all-reduce sends 2 (t - 1) / t of those bytes per GPU
over its link, and each all-reduce pays the link's latency once.
"""

from __future__ import annotations


def allreduce_count(geometry) -> int:
    """All-reduces of one forward: one per mixer and one per FFN present in each layer
    (Falcon-H1's parallel hybrid layer: its summed mixers, then its MLP: 2 per layer)."""
    from serving_core import layer_pattern as lp

    g = geometry
    if g.layers is None:
        return 2 * g.num_layers
    return sum((mixer != "none") + (ffn != "none")
               for mixer, ffn in map(lp.parse_layer, g.layer_strings))


def allreduce_bytes_per_gpu(geometry, tokens: int, tp: int) -> float:
    """Bytes one GPU sends over its link for one step of `tokens` tokens (ring all-reduce)."""
    return allreduce_count(geometry) * tokens * geometry.hidden_size * geometry.dtype_bytes * (
        2 * (tp - 1) / tp)


def allreduce_terms(geometry, device) -> tuple[float, float]:
    """(seconds per step token, seconds per step) of a step's all-reduces; (0, 0) on one GPU."""
    tp = device.tensor_parallel
    if tp == 1:
        return 0.0, 0.0
    per_token = allreduce_bytes_per_gpu(geometry, 1, tp) / device.tp_link_bandwidth_Bps
    return per_token, allreduce_count(geometry) * device.tp_link_latency_s


def weight_bytes_per_gpu(geometry, tp: int) -> float:
    """The bytes of weights each of t GPUs holds: 1/t of the model."""
    return geometry.weight_bytes / tp
