"""Step-time models of the simulated executor.

`build_step_model` picks the profile's model (`step_model`): `AdditiveStepModel`, terms
added (the calibrated A100 profile conf/executor/a100.yaml; its class docstring gives the
terms, docs/calibration.md section 4), or `StepTimeModel`, the datasheet roofline
(a100_roofline, h200). The executor calls `step_seconds` once per engine step with the
scheduled batch and the virtual clock advances by the result. The roofline is over the
step's memory traffic and FLOPs plus host overhead:

    step = max(memory_s, compute_s) + per_step_overhead + per_seq_overhead x B

    memory_s  = [W + kv (sum(c + n) + sum(n)) + state (1 + x) (2 B + k)] / (BW eff_mem)
    compute_s = 2 P_model sum(n) / (F eff_mm)
              + 4 Ha d L sum(n c + n (n + 1) / 2) / (F eff_attn)
              + [4 HPN L sum(n) + 2 HPN L sum(ceil(n / Q))
                 + 2 (HP + GN) L sum(s^2 over chunks s of n)] / (F eff_scan)
              + E [t_dec sum(c + n) + t_enc sum(n)]                  (compressed KV only)
              + B O t_op                                      (transcoded SSM state only)

for B scheduled sequences with n new and c cached tokens each, k checkpoints
published this step, W weight bytes, kv / state the whole-model bytes of one
token's KV / one recurrent composite, and x the indirection overhead (S1/S2
only). Coefficients come from `ModelCosts`; device constants from the profile. With a
compressed KV representation (kv_codec tq4) kv is the packed bytes, and E = 2 Hkv d L K/V
elements per token are decoded where read (t_dec s each) and encoded where written (t_enc).
With a transcoded SSM state (model.state_codec, serving_core/state_codec.py) state is its
stored bytes, and each scheduled sequence decodes and encodes its composite once a step:
O = SSM elements x the codec's decode + encode operations, t_op the profile's
state_codec_s_per_op (a published checkpoint is a copy of encoded bytes: bytes only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral
from operator import mul
from typing import Any

from serving_core.executor.moe_reads import weight_bytes_read
from serving_core.executor.profiles import DeviceProfile, load_device_profile, model_costs
from serving_core.executor.tensor_parallel import allreduce_terms
from serving_core.geometry import Geometry
from serving_core.memory import org_class

# The indirection overhead applies to organizations whose recurrent state is reached through
# an extra level of indirection (their class says `indirect`): S1 SSM member pages and its
# conv page, S2 member pages and packed conv slots. S0 keeps a composite contiguous in one
# page; D0 stores native composites. Attention blocks are paged the same way in S0/S1/S2,
# so KV traffic carries no org-specific overhead.


def _indirection(value: Any) -> float:
    """A validated indirection overhead fraction (finite, >= 0)."""
    try:
        overhead = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"indirection_overhead={value!r} must be a number") from None
    if not math.isfinite(overhead) or overhead < 0:
        raise ValueError(f"indirection_overhead={overhead} must be finite and >= 0")
    return overhead


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, bool))


def _long_chunks(new_tokens: Sequence[int], q: int, num_chunks: int,
                 intra_pairs: int) -> tuple[int, int]:
    """Chunk and intra-chunk pair counts corrected for the sequences longer than one chunk
    of `q`: n tokens are `full` chunks of q and a remainder, s^2 pairs per chunk of s."""
    for n in [n for n in new_tokens if n > q]:
        full, rest = divmod(n, q)
        num_chunks += full - (rest == 0)
        intra_pairs += full * q * q + rest * rest - n * n
    return num_chunks, intra_pairs


class StepTimeModel:
    """Roofline step time of one model on one device under one memory organization.

    Cost is O(B) per call in a few builtin passes over the batch lists (measured
    faster than numpy for serving batch sizes). Deterministic: no randomness, no
    state between calls.
    """

    kind = "roofline"  # what an engine's record names as its step model
    __slots__ = (
        "geometry",
        "device",
        "org",
        "indirect",
        "indirection_overhead",
        "effective_indirection",
        "costs",
        "_weights_s",
        "_kv_s_per_token",
        "_state_s_per_composite",
        "_dense_s_per_token",
        "_attention_s_per_pair",
        "_scan_s_per_token",
        "_scan_s_per_chunk",
        "_scan_s_per_intra_pair",
        "_chunk_tokens",
        "_step_overhead_s",
        "_seq_overhead_s",
        "_decode_s_per_token",
        "_encode_s_per_token",
        "_state_codec_s",
        "_bw",
        "_allreduce",
    )

    def __init__(
        self,
        geometry: Geometry,
        device: DeviceProfile | str | Any,
        org: str,
        indirection_overhead: float = 0.0,
    ) -> None:
        self.geometry = geometry
        self.device = load_device_profile(device)
        cls = org_class(org)
        self.org, self.indirect = cls.org, cls.indirect
        overhead = _indirection(indirection_overhead)
        self.indirection_overhead = overhead
        self.effective_indirection = overhead if self.indirect else 0.0
        self.costs = costs = model_costs(geometry)

        # Fold every device constant into per-unit seconds once, so a call only
        # multiplies token sums by them.
        dev = self.device
        # a tensor-parallel device: every byte and FLOP split over tensor_parallel GPUs
        tp = dev.tensor_parallel
        bw = dev.effective_bytes_per_s * tp
        self._bw = bw
        self._allreduce = allreduce_terms(geometry, dev)
        self._weights_s = costs.weight_bytes / bw
        self._kv_s_per_token = costs.kv_bytes_per_token / bw
        self._state_s_per_composite = (
            costs.state_bytes_per_composite * (1.0 + self.effective_indirection) / bw
        )
        peak = dev.peak_flops * tp
        self._dense_s_per_token = costs.dense_flops_per_token / (peak * dev.matmul_efficiency)
        self._attention_s_per_pair = costs.attention_flops_per_pair / (
            peak * dev.attention_efficiency
        )
        scan_flops_per_s = peak * dev.scan_efficiency
        self._scan_s_per_token = costs.scan_flops_per_token / scan_flops_per_s
        self._scan_s_per_chunk = costs.scan_flops_per_chunk / scan_flops_per_s
        self._scan_s_per_intra_pair = costs.scan_flops_per_intra_pair / scan_flops_per_s
        self._chunk_tokens = costs.ssd_chunk_tokens
        self._step_overhead_s = dev.per_step_overhead_s
        self._seq_overhead_s = dev.per_seq_overhead_s
        self._decode_s_per_token = costs.codec_elements_per_token * dev.kv_decode_s_per_element
        self._encode_s_per_token = costs.codec_elements_per_token * dev.kv_encode_s_per_element
        self._state_codec_s = costs.state_codec_ops_per_composite * dev.state_codec_s_per_op

    def step_seconds(
        self,
        new_tokens: Sequence[int],
        context_tokens: Sequence[int],
        checkpoint_writes: int = 0,
    ) -> float:
        """Seconds of one engine step.

        new_tokens[i]: tokens computed for scheduled sequence i (decode 1, prefill chunk n).
        context_tokens[i]: tokens already in that sequence's KV before this step.
        checkpoint_writes: recurrent composites published this step (each written once extra).
        """
        weights_s, kv_s, state_s, dense_s, attention_s, scan_s, codec_s, overhead_s = self._times(
            self._aggregate(new_tokens, context_tokens, checkpoint_writes), checkpoint_writes
        )
        memory_s = weights_s + kv_s + state_s
        compute_s = dense_s + attention_s + scan_s + codec_s
        step_s = (memory_s if memory_s >= compute_s else compute_s) + overhead_s
        if self.device.tensor_parallel > 1:
            step_s += self._allreduce[0] * sum(new_tokens) + self._allreduce[1]
        return step_s

    def breakdown(
        self,
        new_tokens: Sequence[int],
        context_tokens: Sequence[int],
        checkpoint_writes: int = 0,
    ) -> dict[str, Any]:
        """The step_seconds computation with its bytes, FLOPs and times itemized. For
        inspection: the engine calls step_seconds; tests/test_step_model.py holds each item
        to bytes and FLOPs computed by hand."""
        agg = self._aggregate(new_tokens, context_tokens, checkpoint_writes)
        num_seqs, sum_new, sum_ctx, _, _, num_chunks, intra_pairs, attention_pairs = agg
        weights_s, kv_s, state_s, dense_s, attention_s, scan_s, codec_s, overhead_s = self._times(
            agg, checkpoint_writes
        )
        c = self.costs
        memory_s = weights_s + kv_s + state_s
        compute_s = dense_s + attention_s + scan_s + codec_s
        state_read = num_seqs * c.state_bytes_per_composite
        state_write = (num_seqs + checkpoint_writes) * c.state_bytes_per_composite
        bw = self._bw
        return {
            "tensor_parallel": self.device.tensor_parallel,
            "allreduce_s": (self._allreduce[0] * sum_new + self._allreduce[1]
                            if self.device.tensor_parallel > 1 else 0.0),
            "num_seqs": num_seqs,
            "new_tokens": sum_new,
            "context_tokens": sum_ctx,
            "checkpoint_writes": checkpoint_writes,
            "weight_bytes": weight_bytes_read(c, sum_new),
            "kv_read_bytes": (sum_ctx + sum_new) * c.kv_bytes_per_token,
            "kv_write_bytes": sum_new * c.kv_bytes_per_token,
            "state_read_bytes": state_read,
            "state_write_bytes": state_write,
            "memory_bytes": weight_bytes_read(c, sum_new)
            + (sum_ctx + 2 * sum_new) * c.kv_bytes_per_token
            + state_read
            + state_write,
            "attention_pairs": attention_pairs,
            "dense_flops": sum_new * c.dense_flops_per_token,
            "attention_flops": attention_pairs * c.attention_flops_per_pair,
            "scan_flops": sum_new * c.scan_flops_per_token
            + num_chunks * c.scan_flops_per_chunk
            + intra_pairs * c.scan_flops_per_intra_pair,
            "weights_s": weights_s,
            "kv_s": kv_s,
            "state_s": state_s,
            "indirection_s": (state_read + state_write) * self.effective_indirection / bw,
            "memory_s": memory_s,
            "dense_s": dense_s,
            "attention_s": attention_s,
            "scan_s": scan_s,
            "codec_decode_elements": (sum_ctx + sum_new) * c.codec_elements_per_token,
            "codec_encode_elements": sum_new * c.codec_elements_per_token,
            "state_codec_ops": num_seqs * c.state_codec_ops_per_composite,
            "codec_s": codec_s,
            "compute_s": compute_s,
            "step_overhead_s": self._step_overhead_s,
            "seq_overhead_s": num_seqs * self._seq_overhead_s,
            "overhead_s": overhead_s,
            "bound": "memory" if memory_s >= compute_s else "compute",
            "step_s": (memory_s if memory_s >= compute_s else compute_s) + overhead_s,
        }

    def _aggregate(
        self,
        new_tokens: Sequence[int],
        context_tokens: Sequence[int],
        checkpoint_writes: int,
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """Validate a batch and reduce it to the token sums the cost terms need."""
        num_seqs = len(new_tokens)
        if len(context_tokens) != num_seqs:
            raise ValueError(
                f"context_tokens has {len(context_tokens)} entries; new_tokens has {num_seqs}"
            )
        if num_seqs == 0:
            raise ValueError("new_tokens is empty: a step schedules at least one sequence")
        if not _is_int(checkpoint_writes) or checkpoint_writes < 0:
            raise ValueError(f"checkpoint_writes={checkpoint_writes!r} must be an integer >= 0")
        if checkpoint_writes and not self.costs.has_recurrent:
            raise ValueError(
                f"checkpoint_writes={checkpoint_writes}: geometry {self.geometry.name!r} "
                "has no recurrent state"
            )
        new_min = min(new_tokens)
        if new_min < 1:
            raise ValueError(f"new_tokens: entries must be >= 1 (got {new_min})")
        if min(context_tokens) < 0:
            raise ValueError(f"context_tokens: entries must be >= 0 (got {min(context_tokens)})")
        sum_new = sum(new_tokens)
        sum_ctx = sum(context_tokens)
        if not _is_int(sum_new):
            raise ValueError("new_tokens: entries must be integers")
        if not _is_int(sum_ctx):
            raise ValueError("context_tokens: entries must be integers")

        new_max = max(new_tokens)
        if new_max == 1:
            # Decode-only step: n = 1 reduces every product below to a plain sum.
            sum_new_ctx = sum_ctx
            sum_new_sq = num_seqs
        else:
            sum_new_ctx = sum(map(mul, new_tokens, context_tokens))
            sum_new_sq = sum(map(mul, new_tokens, new_tokens))
        # SSD chunks: n new tokens split into full chunks of Q and a remainder r, with
        # s^2 intra-chunk pairs per chunk of s. A sequence with n <= Q is one chunk
        # (n^2 pairs); only the few longer prefill chunks need correcting, so visit just those.
        q = self._chunk_tokens
        num_chunks = num_seqs
        intra_pairs = sum_new_sq
        if new_max > q:
            num_chunks, intra_pairs = _long_chunks(new_tokens, q, num_chunks, intra_pairs)
        # Causal attention within the chunk: token j of n attends to c + j + 1 keys.
        attention_pairs = sum_new_ctx + (sum_new_sq + sum_new) // 2
        return (num_seqs, sum_new, sum_ctx, sum_new_ctx, sum_new_sq, num_chunks, intra_pairs,
                attention_pairs)

    def _times(
        self, agg: tuple[int, ...], checkpoint_writes: int
    ) -> tuple[float, float, float, float, float, float, float, float]:
        """Seconds of each roofline term: weights, kv, state | dense, attention, scan, codec |
        host."""
        num_seqs, sum_new, sum_ctx, _, _, num_chunks, intra_pairs, attention_pairs = agg
        codec_s = ((sum_ctx + sum_new) * self._decode_s_per_token
                   + sum_new * self._encode_s_per_token)
        if self._state_codec_s:  # a compressed SSM state: each sequence decodes and encodes it
            codec_s += num_seqs * self._state_codec_s
        return (
            self._weights_s if not self.costs.moe_layers
            else weight_bytes_read(self.costs, sum_new) / self._bw,
            # Read the cached context and the chunk's own keys; write the chunk's KV.
            (sum_ctx + 2 * sum_new) * self._kv_s_per_token,
            # Each sequence reads and writes its working composite once; each published
            # checkpoint is written once more.
            (2 * num_seqs + checkpoint_writes) * self._state_s_per_composite,
            sum_new * self._dense_s_per_token,
            attention_pairs * self._attention_s_per_pair,
            sum_new * self._scan_s_per_token
            + num_chunks * self._scan_s_per_chunk
            + intra_pairs * self._scan_s_per_intra_pair,
            # A compressed KV decodes every key it reads and encodes every key it writes.
            codec_s,
            self._step_overhead_s + num_seqs * self._seq_overhead_s,
        )


# ----- additive step model ------------------------------------------------------------------
# Names of the per-step features the additive model is linear in (device seconds at
# efficiency 1 for the two fitted efficiencies; seconds at the profile's fixed attention and
# scan efficiencies; a 0/1 mixed-step indicator). `calibrate` fits against these.
FEATURES = ("memory_s", "dense_s", "fixed_s", "mixed")


def paged_state_pieces(geometry: Geometry, org: str) -> tuple[int, int]:
    """(member pages, conv slots) of one sequence's recurrent state that a kernel reaches
    through the page mapping (docs/engine_rules.md section 3.2: S1/S2 read member j of a
    checkpoint at page_of(b, j), S2's conv state at line 16 p + s). S1: its SSM member pages
    and its dedicated conv page; S2: its SSM member pages and one conv slot; S0 (one contiguous page
    per composite), D0 (native composites) and N0 (one page) gather nothing: (0, 0)."""
    cls = org_class(org)
    if not geometry.has_recurrent or not cls.indirect:
        return 0, 0
    layout = cls.unit_layout(geometry)
    return layout.ssm_members + layout.conv_pages, 1 if cls.has_slabs else 0


class AdditiveStepModel:
    """Step time as a sum of terms (measured steps add up; they do not overlap as a max).

        device = memory_s / eff_mem + dense_s / eff_mm + fixed_s + mixed_step_s [mixed]
        step   = device (1 + x_org) + (g_org + per_seq_overhead) B + per_step_overhead

    An executor that dispatches per page or per forward (the torch executor on a CPU) adds
    kv_page_s per KV page its decode sequences visit and prefill_chunk_s per prefill chunk
    (`dispatch_seconds`; both 0 on the A100 profile), and its LM head's logits GEMMs
    (`logit_seconds`: one product per step over the items that sample, logit_gemm_s per
    pass over the head's weight, logit_row_s per padded row; 0 on the A100 profile).

    g_org = state_page_s x member pages + conv_slot_s x conv slots (paged_state_pieces): the
    gathers of a paged organization's kernel, per scheduled sequence (each reads and writes
    its state through the mapping once a step), so the cost grows with the batch and with
    the pieces each state spans (S1: 3 SSM pages + a conv page, S2: 3 + a slot; S0/D0: 0).

    memory_s: the weights, streamed once by a step with decode sequences, plus per
    decode sequence its KV read ((c + 1) tokens) and its composite read and write, plus
    per prefill sequence its composite read and write, plus one composite per published
    checkpoint; all at the peak bandwidth. dense_s: 2 P FLOPs per prefill token at peak;
    fixed_s: causal attention pairs of the prefill chunks and the SSD scan per prefill
    token (full chunks of Q), at the profile's attention and scan efficiencies, plus with a
    compressed KV (tq4) the codec's work at the profile's per-element seconds: the decode
    sequences' KV reads ((c + 1) tokens each) decoded and every new token's K/V encoded,
    E = 2 Hkv d L elements per token, added without overlap. A prefill chunk's reconstruction
    of its cached context is not charged: prefill KV reads are not in memory_s either (the fit
    absorbs them), and at 4 CUDA-core operations per element against 4 Ha d tensor-core FLOPs
    per (query, key) pair it is about 1 % of the chunk's attention time for n >= 512.
    A transcoded SSM state (model.state_codec) adds its codec work per scheduled sequence
    (`ModelCosts.state_codec_ops_per_composite` x state_codec_s_per_op) to fixed_s.
    A step is mixed when it carries both prefill and decode sequences. x_org is the
    profile's indirection overhead (plus `extra_indirection`) for S1/S2, else 0.
    A sequence with one new token is a decode sequence.
    """

    kind = "additive"  # what an engine's record names as its step model

    __slots__ = (
        "geometry",
        "device",
        "org",
        "indirect",
        "indirection",
        "state_pages",
        "conv_slots",
        "paged_s_per_seq",
        "kv_block_tokens",
        "costs",
        "_w",
        "_kv",
        "_state",
        "_dense",
        "_attn",
        "_scan",
        "_inv_mem",
        "_inv_mm",
        "_mixed",
        "_scale",
        "_step_s",
        "_seq_s",
        "_dec",
        "_enc",
        "_state_codec",
        "_kv_page_s",
        "_chunk_s",
        "_logit_gemm_s",
        "_logit_row_s",
        "logit_block_rows",
        "prices_sampling",
        "_dispatch",
        "_allreduce",
        "_bw",
    )

    def __init__(self, geometry: Geometry, device, org: str, extra_indirection: float = 0.0):
        self.geometry = geometry
        self.device = dev = load_device_profile(device)
        cls = org_class(org)
        self.org, self.indirect = cls.org, cls.indirect
        extra = _indirection(extra_indirection)
        self.indirection = dev.indirection_overhead + extra if self.indirect else 0.0
        self.costs = c = model_costs(geometry)
        # a tensor-parallel device: every byte and FLOP split over tensor_parallel GPUs
        tp = dev.tensor_parallel
        bw, peak = dev.hbm_bytes_per_s * tp, dev.peak_flops * tp
        self._bw = bw
        self._allreduce = allreduce_terms(geometry, dev)
        self._w = c.weight_bytes / bw
        self._kv = c.kv_bytes_per_token / bw
        self._state = c.state_bytes_per_composite / bw
        self._dense = c.dense_flops_per_token / peak
        self._attn = c.attention_flops_per_pair / (peak * dev.attention_efficiency)
        q = c.ssd_chunk_tokens
        scan_per_token = (
            c.scan_flops_per_token + c.scan_flops_per_intra_pair * q + c.scan_flops_per_chunk / q
        )
        self._scan = scan_per_token / (peak * dev.scan_efficiency)
        self._inv_mem = 1.0 / dev.memory_efficiency
        self._inv_mm = 1.0 / dev.matmul_efficiency
        self._mixed = dev.mixed_step_s
        self._scale = 1.0 + self.indirection
        self._step_s = dev.per_step_overhead_s
        self._seq_s = dev.per_seq_overhead_s
        self._dec = c.codec_elements_per_token * dev.kv_decode_s_per_element
        self._enc = c.codec_elements_per_token * dev.kv_encode_s_per_element
        self._state_codec = c.state_codec_ops_per_composite * dev.state_codec_s_per_op
        self.state_pages, self.conv_slots = paged_state_pieces(geometry, self.org)
        self.paged_s_per_seq = (self.state_pages * dev.state_page_s
                                + self.conv_slots * dev.conv_slot_s)
        self.kv_block_tokens = org_class(self.org).unit_layout(geometry).block_tokens
        self._kv_page_s = dev.kv_page_s
        self._chunk_s = dev.prefill_chunk_s
        self._logit_gemm_s = dev.logit_gemm_s
        self._logit_row_s = dev.logit_row_s
        self.logit_block_rows = dev.logit_block_rows
        self.prices_sampling = bool(self._logit_gemm_s or self._logit_row_s)
        self._dispatch = bool(self._kv_page_s or self._chunk_s or self.prices_sampling)

    def plan_features(
        self, new_tokens: Sequence[int], context_tokens: Sequence[int], checkpoint_writes: int = 0
    ) -> tuple[float, float, float, int]:
        """(memory_s, dense_s, fixed_s, mixed) of one step from its batch."""
        if len(new_tokens) != len(context_tokens):
            raise ValueError("new_tokens and context_tokens differ in length")
        if max(new_tokens) == 1:  # decode-only step (most steps): builtin sums
            n = len(new_tokens)
            return self.features(n, n, sum(context_tokens), 0, 0, checkpoint_writes)
        num_decode = decode_ctx = prefill_tokens = pairs = 0
        for n, c in zip(new_tokens, context_tokens, strict=True):
            if n == 1:
                num_decode += 1
                decode_ctx += c
            else:
                prefill_tokens += n
                pairs += n * c + n * (n + 1) // 2
        return self.features(
            len(new_tokens), num_decode, decode_ctx, prefill_tokens, pairs, checkpoint_writes
        )

    def features(
        self,
        num_seqs: int,
        num_decode: int,
        decode_context: int,
        prefill_tokens: int,
        attention_pairs: int,
        checkpoint_writes: int,
    ) -> tuple[float, float, float, int]:
        """(memory_s, dense_s, fixed_s, mixed) from step totals (also a steps-ledger row)."""
        memory = (
            (self._weights(num_decode + prefill_tokens) if num_decode else 0.0)
            + (decode_context + num_decode) * self._kv
            + (2 * num_seqs + checkpoint_writes) * self._state
        )
        dense = prefill_tokens * self._dense
        fixed = attention_pairs * self._attn + prefill_tokens * self._scan
        if self._dec or self._enc:
            fixed += (decode_context + num_decode) * self._dec + (
                prefill_tokens + num_decode) * self._enc
        if self._state_codec:
            fixed += num_seqs * self._state_codec
        mixed = 1 if num_decode and num_decode < num_seqs else 0
        return memory, dense, fixed, mixed

    def _weights(self, tokens):
        """Seconds of the weights a step of `tokens` routed tokens streams (at the peak)."""
        if not self.costs.moe_layers:
            return self._w
        return weight_bytes_read(self.costs, tokens) / self._bw

    def kv_pages(self, num_decode, decode_context):
        """KV pages the decode sequences' attention visits: (c + 1) tokens each in pages of
        B tokens, ceil((c + 1) / B), taken at its mean over the last page's fill,
        (c + 1) / B + (B - 1) / 2B, so a steps-ledger row (sums only) gives the same count
        as the batch."""
        b = self.kv_block_tokens
        return (decode_context + num_decode) / b + num_decode * (b - 1) / (2 * b)

    def dispatch_seconds(self, num_decode, decode_context, num_chunks) -> float:
        """Seconds of the per-page and per-chunk terms (kv_page_s, prefill_chunk_s)."""
        return (self._kv_page_s * self.kv_pages(num_decode, decode_context)
                + self._chunk_s * num_chunks)

    def logit_counts(self, num_sampling):
        """(passes over the LM head's weight, rows) of a step whose `num_sampling` items
        sample: the torch executor's one head product per step over the sampling rows,
        padded to a multiple of logit_block_rows (serving_core/model/head_rows.py), reads
        the weight once (bench/logits_bench.py: the blocked, padded head of 1-24 rows fits
        one pass + a cost per padded row within rms 0.026). A step that samples nothing
        (mid-prompt chunks only) runs no head. Numbers or numpy arrays (ledger columns)."""
        import numpy as np

        s = np.asarray(num_sampling, dtype=np.float64)
        block = self.logit_block_rows
        passes, rows = (s > 0).astype(np.float64), block * np.ceil(s / block)
        return (passes, rows) if s.ndim else (passes.item(), rows.item())

    def per_forward_logit_counts(self, num_decode, num_chunks):
        """(passes, rows) of the executor before num_sampling was recorded (a steps ledger
        without the column): one head GEMM per forward, one row per scheduled item; the
        decode batch's GEMM streamed the weight once per row below logit_block_rows rows and
        once from there on, each prefill chunk's once."""
        import numpy as np

        d = np.asarray(num_decode, dtype=np.float64)
        passes = np.where(d < self.logit_block_rows, d, np.minimum(d, 1)) + num_chunks
        return passes, d + num_chunks

    def logit_seconds(self, num_sampling: int) -> float:
        """Seconds of the step's LM head (`logit_counts`, in plain integers: once a step):
        logit_gemm_s for its one pass plus logit_row_s per padded row; 0 without a head."""
        if not num_sampling:
            return 0.0
        block = self.logit_block_rows
        return self._logit_gemm_s + self._logit_row_s * block * -(-num_sampling // block)

    def ledger_logit_counts(self, steps, num, dec):
        """(passes, rows) per steps-ledger row: from num_sampling where the row has it; the
        executor's earlier per-forward counts where the ledger predates the column (absent,
        or NaN where a query unites older files with newer)."""
        import numpy as np

        old = self.per_forward_logit_counts(dec, num - dec)
        if "num_sampling" not in steps:
            return old
        s = np.asarray(steps["num_sampling"], dtype=np.float64)
        known = ~np.isnan(s)
        new = self.logit_counts(np.where(known, s, 0.0))
        return tuple(np.where(known, n, o) for n, o in zip(new, old, strict=True))

    def ledger_features(self, steps) -> dict:
        """Per row of a steps table (ledger columns), as numpy arrays: memory_s and dense_s
        at the peaks, attention_s and scan_s at the profile's efficiencies, codec_s (0 for
        bf16 KV) and the mixed flag; the vectorized `features` of every row, with its fixed_s
        split in three; and the counts the per-page, per-chunk and logits terms multiply
        (kv_pages, prefill_chunks, logit_passes, logit_rows: `ledger_logit_counts`)."""
        import numpy as np  # off the engine's hot path: fits and calibration only

        c = {k: np.asarray(steps[k], dtype=np.float64) for k in (
            "num_scheduled", "num_decode_seqs", "decode_context_tokens", "decode_tokens",
            "prefill_tokens_initial", "prefill_tokens_resume", "prefill_attention_pairs",
            "checkpoint_writes")}
        num, dec = c["num_scheduled"], c["num_decode_seqs"]
        prefill = (c["prefill_tokens_initial"] + c["prefill_tokens_resume"]
                   + c["decode_tokens"] - dec)
        passes, rows = self.ledger_logit_counts(steps, num, dec)
        return {
            "memory": (self._weights(dec + prefill) * (dec > 0)
                       + self._kv * (c["decode_context_tokens"] + dec)
                       + self._state * (2 * num + c["checkpoint_writes"])),
            "dense": self._dense * prefill,
            "attention": self._attn * c["prefill_attention_pairs"],
            "scan": self._scan * prefill,
            "codec": (self._dec * (c["decode_context_tokens"] + dec)
                      + self._enc * (prefill + dec) + self._state_codec * num),
            "mixed": ((dec > 0) & (dec < num)).astype(np.float64),
            "kv_pages": self.kv_pages(dec, c["decode_context_tokens"]),
            "prefill_chunks": num - dec,
            "logit_passes": passes,
            "logit_rows": rows,
        }

    def device_seconds(self, features: tuple[float, float, float, int],
                       num_seqs: float = 0) -> float:
        """Device seconds of a step (or of summed steps) from its features and its
        scheduled sequences (the paged-state gathers)."""
        memory, dense, fixed, mixed = features
        return (
            memory * self._inv_mem + dense * self._inv_mm + fixed + mixed * self._mixed
        ) * self._scale + num_seqs * self.paged_s_per_seq

    def step_seconds(
        self,
        new_tokens: Sequence[int],
        context_tokens: Sequence[int],
        checkpoint_writes: int = 0,
        num_sampling: int | None = None,
    ) -> float:
        """Seconds of one engine step (same call as the roofline model); `num_sampling`:
        the scheduled items that sample (None: every one), for the LM head's terms."""
        if not new_tokens:
            raise ValueError("new_tokens is empty: a step schedules at least one sequence")
        feats = self.plan_features(new_tokens, context_tokens, checkpoint_writes)
        seconds = self.device_seconds(feats) + self._step_s + (
            self._seq_s + self.paged_s_per_seq) * len(new_tokens)
        if self.device.tensor_parallel > 1:
            seconds += self._allreduce[0] * sum(new_tokens) + self._allreduce[1]
        if self._dispatch:
            num_decode = decode_ctx = 0
            for n, c in zip(new_tokens, context_tokens, strict=True):
                if n == 1:
                    num_decode += 1
                    decode_ctx += c
            chunks = len(new_tokens) - num_decode
            sampling = len(new_tokens) if num_sampling is None else num_sampling
            seconds += (self.dispatch_seconds(num_decode, decode_ctx, chunks)
                        + self.logit_seconds(sampling))
        return seconds


def build_step_model(geometry: Geometry, device, org: str, extra_indirection: float = 0.0):
    """The profile's step model: additive (calibrated profiles) or the datasheet roofline."""
    profile = load_device_profile(device)
    if profile.step_model == "additive":
        return AdditiveStepModel(geometry, profile, org, extra_indirection)
    return StepTimeModel(geometry, profile, org, extra_indirection)
