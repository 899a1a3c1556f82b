"""The real executor: a Falcon-H1 model whose state lives in the organization's units.

Per engine step:
- decodes of running requests (one token, no checkpoint boundary) run as one batch
  that gathers each request's working composite through the page mapping, updates
  it and writes it back in place; their KV goes to the request's block table;
- every other scheduled chunk (prefill, resume, the first step after adopting a
  checkpoint, a token that lands on a boundary) starts from the adopted checkpoint
  or the working composite (zeros at position 0), read into scratch, and runs
  split at every interval boundary inside the chunk, keeping the state at each;
- after the scheduler has published the step (`commit`), the state at each boundary
  whose checkpoint was published is written into the composite that was published
  there, and the chunk's final state into the request's working composite.
Whatever the placement rule, only published composites receive boundary states, and
scratch lives for one step only: no state outlives the units that hold it. All state is
addressed through the plan: each scheduled item's `ChunkState` (the state manager's
answer: attention unit ids, working/adopted/destination composites, and after
publication where each boundary's state went); the request gives only its tokens.
A request whose SamplingParams set prompt_logprobs gets, until its first token, every
prompt position's logits from the chunks that compute them (the LM head over the chunk's
final hidden states, PROMPT_LOGPROB_ROWS rows at a time): the logprob of each prompt
token given the ones before it, and the top alternatives (ExecutorOutput.prompt_logprobs).
The token is chosen from the last position's logits by the sampler
(serving_core/model/sampler.py) under each request's SamplingParams (`spec.sampling`); a
request without them is greedy: the argmax (`argmax_rows`, the same index as torch.argmax,
vectorized on CPU).
"""

from __future__ import annotations

import time

import torch

from serving_core.executor import threads
from serving_core.executor.base import ExecutorOutput
from serving_core.executor.device import host_index, synchronize
from serving_core.executor.state_arena import StateArena
from serving_core.model import split
from serving_core.model.paged_attention import (
    DecodeLayout,
    decode_attention,
    fused_decode_attention,
)
from serving_core.model.sampler import sample, token_logprobs

PROMPT_LOGPROB_ROWS = 256  # prompt positions per LM-head product (bounds the logits' size)


class PagedRecurrentIO:
    """Recurrent state of a batch of composites, updated in the units the page mapping
    names (the paged decode update).

    When the arena allows it (`StateArena.ssm_in_place`: fp32; S0/D0, or S1/S2 with whole
    heads per member page) the SSM state is handed to the model as views of its units and
    updated there; only the small conv windows are gathered and written back (one indexed
    copy per layer, S2's slab slots included). Otherwise the composite is gathered into a
    copy and scattered back."""

    def __init__(self, arena: StateArena, composites, keys=None) -> None:
        self.arena = arena
        self.loc = arena.locate(composites)
        self.keys = keys  # per composite (request seed, position) of a state codec's rounding
        self.fp32 = arena.dtype == torch.float32
        self.in_place = arena.ssm_in_place
        self._gathered = {}

    def recurrent(self, layer):
        if self.in_place:
            return self.arena.gather_conv(layer, self.loc), self.arena.ssm_views(layer, self.loc)
        conv, ssm, gathered = self.arena.gather(layer, self.loc)
        self._gathered[layer] = gathered
        if not self.fp32:
            conv, ssm = conv.float(), ssm.float()
        return conv, ssm

    def store_recurrent(self, layer, conv, ssm):
        if self.in_place:
            self.arena.scatter_conv(layer, self.loc, conv)  # the SSM state is already there
            return
        gathered = self._gathered.pop(layer)
        dtype = self.arena.dtype
        if self.arena.encoder is None:
            ssm = ssm.to(dtype)
        self.arena.scatter(layer, self.loc, gathered, conv.to(dtype), ssm, self.keys)


class _OneTokenAttention:
    """Attention of one new token per sequence over its KV pages: the decode step's kernels.
    A one-token prefill segment (the first chunk after adopting a checkpoint, a token that
    lands on a boundary) runs the same ones, so a token's bits do not depend on whether it
    was decoded or computed as a chunk (a reload continues the cold run bit for bit)."""

    def _new_token_tables(self, arena: StateArena, blocks, ctx: list[int],
                          gathered: bool) -> None:
        """Per sequence its block table `blocks` and context `ctx` before the new token."""
        dev = arena.device
        bt = arena.block_tokens
        self.max_ctx = max(ctx)
        # Block tables covering each context plus its new token (`decode_attention`; packed
        # and gathered: padded to one tensor).
        self.tables = [b[: c // bt + 1] for b, c in zip(blocks, ctx, strict=True)]
        self.lengths = [c + 1 for c in ctx]
        self.layout = None if gathered or arena.packed else DecodeLayout(
            self.tables, self.lengths, bt)  # every layer's pages and score rows, built once
        nb1 = self.max_ctx // bt + 1
        self.units_new = host_index([u + [0] * (nb1 - len(u)) for u in self.tables], dev)
        new = [b[c // bt] for b, c in zip(blocks, ctx, strict=True)]
        self.new_units = host_index(new, dev)
        self.new_offsets = host_index([c % bt for c in ctx], dev)
        self.packed_kv = arena.packed
        self.seq_lens = host_index(ctx, dev) + 1
        # Gathered decode attention: every sequence's pages copied into one padded buffer and
        # one fused attention per layer (a fixed number of kernels per step, whatever the
        # batch); the mask is needed only when the contexts differ.
        self.gathered = gathered
        self.valid_new = None if min(ctx) == self.max_ctx else (
            torch.arange(self.max_ctx + 1, device=dev)[None, :] < self.seq_lens[:, None])

    def attend_one(self, layer, q, k, v):
        """Packed KV: store the new tokens encoded, then attend page by page (b, 1, H hd)."""
        self.arena.store_kv(layer, self.new_units, self.new_offsets, k[:, 0], v[:, 0])
        out = self.arena.decode_attention(layer, q[:, 0], self.units_new, self.seq_lens)
        return out.reshape(q.shape[0], 1, -1)

    def decode_attention(self, layer, q, k, v, scale):
        """Store the new tokens' K, V, then attend over each sequence's KV pages: where they
        lie (serving_core.model.paged_attention: no gathered copy of the context, one small
        product per page), or gathered (`gathered`: the pages copied into one padded buffer,
        one fused attention for the batch)."""
        self.arena.store_kv(layer, self.new_units, self.new_offsets, k[:, 0], v[:, 0])
        if self.gathered:
            keys, vals = self.arena.gather_kv_heads(layer, self.units_new, self.max_ctx + 1)
            return fused_decode_attention(q, keys, vals, self.valid_new, scale)
        return decode_attention(q, self.arena.kv_view(layer), self.tables, self.lengths, scale,
                                self.layout, self.arena.kv_units(layer))


class _DecodeIO(_OneTokenAttention, PagedRecurrentIO):
    """State access of a batch of one-token decodes, in place through the mapping."""

    def __init__(self, arena: StateArena, items, gathered: bool = False) -> None:
        super().__init__(arena, [it.state.working for it in items],
                         [codec_key(it, it.context + 1) for it in items])
        dev = arena.device
        bt = arena.block_tokens
        ctx = [it.context for it in items]
        blocks = [it.state.blocks for it in items]  # cover [0, context + 1)
        self._new_token_tables(arena, blocks, ctx, gathered)
        nb = max(1, -(-self.max_ctx // bt))
        units = [b[: -(-c // bt)] for b, c in zip(blocks, ctx, strict=True)]
        self.units = host_index([u + [0] * (nb - len(u)) for u in units], dev)  # padding masked
        lengths = host_index(ctx, dev)
        self.valid = torch.arange(self.max_ctx, device=dev)[None, :] < lengths[:, None]

    def attend(self, layer, q, k, v):
        return self.attend_one(layer, q, k, v)

    def kv(self, layer):
        if not self.max_ctx:
            empty = torch.zeros(self.units.shape[0], 0, self.arena.kv_heads, self.arena.head_dim,
                                dtype=self.arena.dtype, device=self.arena.device)
            return empty, empty, None
        k, v = self.arena.gather_kv(layer, self.units, self.max_ctx)
        return k, v, self.valid

    def store_kv(self, layer, k, v):
        self.arena.store_kv(layer, self.new_units, self.new_offsets, k[:, 0], v[:, 0])


class _SegmentIO(_OneTokenAttention):
    """State access of b requests' segments over the same span [start, end): KV through
    their block tables (`tables`: per request the attention unit ids covering at least
    [0, end)), recurrent state in per-step scratch ((b, ...) tensors per layer). A
    one-token segment attends with the decode step's kernels (`_OneTokenAttention`,
    `gathered` as the executor's decode)."""

    def __init__(self, arena: StateArena, tables: list[list[int]], start: int, end: int,
                 states, gathered: bool = False) -> None:
        self.arena = arena
        dev = arena.device
        bt = arena.block_tokens
        self.start = start
        self.b = len(tables)
        self.units = host_index([t[: -(-start // bt)] for t in tables], dev)
        pos = range(start, end)
        self.new_units = host_index([t[p // bt] for t in tables for p in pos], dev)
        self.new_offsets = host_index([p % bt for _ in tables for p in pos], dev)
        self.states = states
        self.packed_kv = arena.packed
        self.peak_temp_bytes = 0
        if end - start == 1:
            self._new_token_tables(arena, tables, [start] * self.b, gathered)

    def attend(self, layer, q, k, v):
        """Packed KV: store the segment encoded, then attend causally over the prefix (rebuilt
        `kv_group_heads` KV heads at a time) and the segment's own rows as stored; one token:
        as a decode step does (`attend_one`)."""
        if q.shape[1] == 1:
            return self.attend_one(layer, q, k, v)
        kv_new = self.arena.store_kv(layer, self.new_units, self.new_offsets, k[0], v[0])
        out, peak = self.arena.prefill_attention(layer, q[0], kv_new, self.units[0], self.start)
        self.peak_temp_bytes = max(self.peak_temp_bytes, peak)
        return out.reshape(1, q.shape[1], -1)

    def kv(self, layer):
        if not self.start:
            a = self.arena
            empty = torch.zeros(self.b, 0, a.kv_heads, a.head_dim, dtype=a.dtype,
                                device=a.device)
            return empty, empty, None
        k, v = self.arena.gather_kv(layer, self.units, self.start)
        return k, v, None

    def store_kv(self, layer, k, v):
        self.arena.store_kv(layer, self.new_units, self.new_offsets, k.flatten(0, 1),
                            v.flatten(0, 1))

    def recurrent(self, layer):
        return self.states[layer]

    def store_recurrent(self, layer, conv, ssm):
        pass  # scratch updated in place; committed after publication


class TorchExecutor:
    """Runs scheduled steps on a FalconH1 model over a StateArena. It addresses state only
    through each scheduled item's ChunkState (unit ids and composites from the plan)."""

    reads_state = True

    PREFILL_BATCH_TOKENS = 256  # the default cap (measured: longer groups gained nothing)
    # How a decode batch attends over plain KV pages: "paged" (per sequence, one product per
    # page, where the pages lie: no copy, but a host loop of ~2 kernels per page, cheap on a
    # CPU) or "gathered" (the batch's pages copied into one padded buffer, one fused kernel
    # per layer: a fixed launch count, what an accelerator needs). Default per device type.
    DECODE_ATTENTION = ("paged", "gathered")

    def __init__(self, model, arena: StateArena, prefill_batch_tokens: int | None = None,
                 decode_attention: str | None = None) -> None:
        self.model = model
        self.arena = arena
        if decode_attention is None:
            decode_attention = "paged" if model.device.type == "cpu" else "gathered"
        if decode_attention not in self.DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r}: allowed values are "
                             f"{', '.join(self.DECODE_ATTENTION)}")
        self.decode_attention = decode_attention
        # chunks over the same span share a forward up to this many tokens (0: never;
        # None: the default, 0 over packed KV)
        self.prefill_batch_tokens = prefill_batch_tokens
        self.mem = arena.mem
        self.interval = self.mem.checkpoint_interval
        self._pending: list[tuple] = []
        # Packed KV: the largest prefill reconstruction temporary so far (bytes, measured
        # from the tensors kv_pages.prefill_attention allocated).
        self.kv_peak_temp_bytes = 0

    # ----- execution --------------------------------------------------------------------------
    def _fast(self, item) -> bool:
        c1 = item.context + item.num_new
        return (
            item.num_new == 1
            and item.context > 0
            and not item.state.adopted
            and (not self.interval or c1 % self.interval)
            and (c1 >= item.req.num_prompt or _prompt_logprobs_k(item) is None)
        )

    def execute(self, plan, checkpoint_writes: int = 0) -> ExecutorOutput:
        t0 = time.perf_counter()
        fast = [it for it in plan if self._fast(it)]
        slow = [it for it in plan if not self._fast(it)]
        sampled: dict[int, int] = {}
        logprobs: dict[int, tuple] = {}
        prompt_lps: dict[int, list] = {}
        heads: list[tuple] = []  # (final hidden rows (n, D), their items)
        if fast:
            dev = self.model.device
            ids = host_index([it.req.token_ids(it.context, it.context + 1) for it in fast], dev)
            pos = host_index([[it.context] for it in fast], dev)
            io = _DecodeIO(self.arena, fast, gathered=self.decode_attention == "gathered")
            threads.enter("decode")
            heads.append((self.model.forward(ids, pos, io, hidden=True)[:, -1], fast))
        if slow:
            threads.enter("prefill")
        for group in self._prefill_groups(slow):
            self._run_chunks(group, heads, prompt_lps)
        self._sample_heads(heads, sampled, logprobs)
        if not sampled:  # a step that reads no token back has not finished on an accelerator
            synchronize(self.model.device)
        return ExecutorOutput(time.perf_counter() - t0, sampled, logprobs, prompt_lps)

    def _sample_heads(self, heads: list[tuple], sampled: dict, logprobs: dict) -> None:
        """The step's LM head as one product over the rows that sample (each item whose
        forward completes its request's known tokens; a chunk inside a prompt samples
        nothing), then each forward's items sampled in order. The 128,256-wide head reads
        its whole weight per product, so a prefill's single row cost about what 64 decode
        rows did. The head pads its rows (serving_core/model/head_rows.py), so a row's logits
        are the same bits whatever else samples in the step (docs/benchmarks.md)."""
        picks = [(h[i], it) for h, items in heads for i, it in enumerate(items) if it.samples]
        if not picks:
            return
        rows = torch.stack([h for h, _ in picks])
        self._sample(self.model.head(rows), [it for _, it in picks], sampled, logprobs)

    @staticmethod
    def _sample(logits, items, sampled: dict, logprobs: dict) -> None:
        """The token (and logprobs, where asked) of each item, one logits row each, under
        its SamplingParams (serving_core/model/sampler.py); every item given samples
        (`_sample_heads` passes only those)."""
        rows = [(getattr(it.req.spec, "sampling", None), it.req) for it in items]
        tokens, lps = sample(logits, rows)
        for it, tok, lp in zip(items, tokens, lps, strict=True):
            sampled[it.req.rid] = tok
            if lp is not None:
                logprobs[it.req.rid] = lp

    def _prefill_groups(self, items) -> list[list]:
        """The step's other chunks, those over the same token span [context, context + n)
        together (equal lengths and positions: one batched forward, the same split at
        boundaries) up to `prefill_batch_tokens` tokens per forward, in plan order of each
        group's first item (0: one chunk per forward).

        Batched equals unbatched to fp32 rounding, not bit for bit (GEMM rows depend on the
        row count; tests/test_batched_prefill.py), as the decode batch already does. It pays
        where a forward's fixed costs dominate: short chunks, whose forwards each read every
        weight once (64 x 16-token prompts: -23 % engine CPU with tcmalloc, measured when each
        forward also ran its own LM head; the head is one product per step now). Long chunks
        gain nothing on a CPU, and under glibc malloc larger temporaries cost page faults
        (16 x 200 tokens in pairs: +15 %), hence the cap."""
        cap = self.effective_prefill_batch_tokens
        groups: dict[tuple[int, int], list] = {}
        out: list[list] = []
        for it in items:
            group = groups.get((it.context, it.num_new))
            if group is None or (len(group) + 1) * it.num_new > cap:
                group = groups[(it.context, it.num_new)] = []
                out.append(group)
            group.append(it)
        return out

    @property
    def effective_prefill_batch_tokens(self) -> int:
        """The cap in force: 0 over packed (TQ4) KV, whose prefill attention runs one
        request at a time (an explicit cap there is not honoured, so a run asking for one
        is refused by the builder's check)."""
        if self.arena.packed:
            return 0
        cap = self.prefill_batch_tokens
        return self.PREFILL_BATCH_TOKENS if cap is None else int(cap)

    def _initial_source(self, item):
        """Where an item's starting state lies: its adopted or working composite, located
        (None: a fresh prompt's zeros)."""
        state = item.state
        if state.adopted:
            return self.arena.locate([state.adopted])
        if item.context > 0:
            return self.arena.locate([state.working])
        return None

    def _initial_layer(self, loc, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv (1, ...), ssm (1, ...)) fp32 copies of one layer's starting state."""
        if loc is not None:
            return self.arena.read_layer(loc, layer)
        m = self.model
        dev = m.device
        return (torch.zeros(1, m.conv_dim, m.d_conv - 1, device=dev),
                torch.zeros(1, m.m_heads, m.m_head_dim, m.d_state, device=dev))

    def _initial_states(self, items):
        """Per layer (conv (b, ...), ssm (b, ...)) scratch of the items' starting states,
        the layers in two halves over the split worker (copies: the same bytes)."""
        sources = [self._initial_source(it) for it in items]
        out: list = [None] * self.model.num_layers

        def run(first: int, end: int) -> None:
            for layer in range(first, end):
                parts = [self._initial_layer(loc, layer) for loc in sources]
                out[layer] = parts[0] if len(parts) == 1 else (
                    torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))

        split.layer_halves(len(out), run)
        return out

    def _run_chunks(self, items, heads: list, prompt_lps: dict) -> None:
        """Chunks of b requests over the same span [c0, c1) (b = 1: one chunk), as one
        batched forward per segment between interval boundaries; each request's boundary
        and final states are kept for `commit`, its final hidden row goes to `heads` (for
        the step's one LM head) and, where asked, its prompt logprobs to `prompt_lps`."""
        c0, c1 = items[0].context, items[0].context + items[0].num_new
        rec = self.mem.has_recurrent
        states = self._initial_states(items) if rec else None
        cuts = []
        if rec and self.interval:
            first = (c0 // self.interval + 1) * self.interval
            cuts = list(range(first, c1 + 1, self.interval))
        edges = [c0] + [b for b in cuts if b < c1] + [c1]
        peak = 0
        boundary_states = []
        last = None
        dev = self.model.device
        tables = [it.state.blocks for it in items]
        want = [_prompt_logprobs_k(it) for it in items]
        hidden = any(k is not None for k in want)
        for s, e in zip(edges[:-1], edges[1:], strict=True):
            ids = host_index([it.req.token_ids(s, e) for it in items], dev)
            pos = torch.arange(s, e, device=dev)[None].expand(len(items), -1)
            io = _SegmentIO(self.arena, tables, s, e, states,
                            self.decode_attention == "gathered")
            need = hidden or e == c1
            out = self.model.forward(ids, pos, io, logits=need, hidden=need)
            if hidden:
                self._prompt_logprobs(out, items, want, s, e, prompt_lps)
            if e == c1:
                last = out[:, -1]
            peak = max(peak, io.peak_temp_bytes)
            if rec and e in cuts:
                boundary_states.append((e, [(c.clone(), m.clone()) for c, m in states]))
        self.kv_peak_temp_bytes = max(self.kv_peak_temp_bytes, peak)
        if rec:
            for i, it in enumerate(items):
                def own(layers, i=i):
                    return [(c[i : i + 1], m[i : i + 1]) for c, m in layers]

                self._pending.append((it.state, [(e, own(st)) for e, st in boundary_states],
                                      own(states), it, c1))
        heads.append((last, items))

    def _prompt_logprobs(self, h, items, want, s: int, e: int, out: dict) -> None:
        """Prompt logprobs of the segment [s, e) from its final hidden states `h` (b, e - s,
        D): position p's logits score prompt token p + 1."""
        for i, (it, k) in enumerate(zip(items, want, strict=True)):
            end = min(e, it.req.num_prompt - 1)
            if k is None or end <= s:
                continue
            targets = [int(t) for t in it.req.token_ids(s + 1, end + 1)]
            entries = out.setdefault(it.req.rid, [])
            for a in range(s, end, PROMPT_LOGPROB_ROWS):
                b = min(end, a + PROMPT_LOGPROB_ROWS)
                rows = self.model.head(h[i, a - s : b - s]).log_softmax(-1)
                for r in range(b - a):
                    entries.append((a + r + 1, token_logprobs(rows[r], targets[a - s + r], k)))

    def describe(self) -> dict:
        """What this executor runs, read from its model."""
        return {"executor": "torch", "device": str(self.model.device),
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "scan_chunk": int(self.model.chunk), "kv_codec": self.arena.kv_codec,
                "kv_group_heads": self.arena.kv_group_heads,
                **({"state_codec": self.arena.state_codec}
                   if self.arena.state_codec != "auto" else {}),
                "prefill_batch_tokens": self.effective_prefill_batch_tokens,
                "decode_attention": "packed_pages" if self.arena.packed else self.decode_attention}

    # ----- after publication ------------------------------------------------------------------
    def commit(self, plan) -> None:
        """Write each boundary's state into the composite published there and the final
        state into the working composite, as the state manager recorded them in the chunk's
        ChunkState when the scheduler completed the step (a no-op publication and a
        finished request receive nothing)."""
        pending, self._pending = self._pending, []
        writes = []  # (composite, per-layer states, codec key)
        for state, boundary_states, final, item, end in pending:
            published = dict(state.published)
            for boundary, states in boundary_states:
                target = published.get(boundary)
                if target:
                    if not (target.valid and target.cached and target.boundary == boundary):
                        raise RuntimeError(f"composite published at {boundary} is not cached "
                                           "there at commit")
                    writes.append((target, states, codec_key(item, boundary)))
            if state.final:
                writes.append((state.final, final, codec_key(item, end)))
        if not writes:
            return
        located = [(self.arena.locate([obj]), states, key) for obj, states, key in writes]

        def run(first: int, end: int) -> None:
            for loc, states, key in located:
                self.arena.write_layers(loc, states, key, first, end)

        # Copies only: the layers' units are disjoint, so two halves give the same bytes.
        split.layer_halves(self.arena.layers, run)


def codec_key(item, position: int) -> tuple[int, int]:
    """The (request seed, token position) that seeds a state codec's stochastic rounding
    of the state written after `position` tokens of the item's request (seed 0 without
    one; serving_core/executor/state_encoding.py)."""
    params = getattr(item.req.spec, "sampling", None)
    seed = getattr(params, "seed", None)
    return (0 if seed is None else int(seed), int(position))


def _prompt_logprobs_k(item) -> int | None:
    """The prompt logprobs a chunk's request asks for (top alternatives), while it has
    produced no token; else None."""
    params = getattr(item.req.spec, "sampling", None)
    if params is None or params.prompt_logprobs is None or item.req.num_generated:
        return None
    return params.prompt_logprobs
