"""Stage 2: engine steps of the timing geometry on the device, through the torch executor.

Per organization, one arena sized for the largest decode batch at the longest context
(pools built by the organization itself, every unit filled with random values: never
timed on zeros), sequences placed through the organization's allocator, and steps run by
`TorchExecutor.execute` + `commit` exactly as the engine runs them (the plan items carry
the same ChunkState an engine's state manager fills). Each shape is timed `repeats` times
after `warmup` runs, with the device synchronised before and after (a step that samples
already reads its tokens back); the median is the step's duration. Shapes:

- prefill: one chunk of n tokens from position 0 (split at the organization's checkpoint
  interval, boundary states kept, as the executor does), alone and with `prefill_decodes`
  decodes beside it (the mixed steps of chunked prefill);
- decode: batch b of one-token steps at context c for every (b, c) of the plan.

Each shape becomes a steps-ledger row (serving_core/executor/fit_steps.py STEP_COLUMNS,
the scheduler's `plan_columns` arithmetic) for the fit.

Paged versus contiguous recurrent state: the same whole-model decode step (KV through the
block tables either way) with the recurrent state read and written through the page
mapping (`PagedRecurrentIO`, the executor's) or held in contiguous per-sequence tensors of
the same dtype, timed in alternation; ratio = paged / contiguous median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from serving_core.executor.device import synchronize
from serving_core.executor.state_arena import StateArena
from serving_core.executor.torch_executor import TorchExecutor, _DecodeIO
from serving_core.geometry import Geometry
from serving_core.memory import build_memory
from serving_core.memory.objects import NULL
from serving_core.scheduler import Scheduled
from serving_core.state_manager import ChunkState, boundaries_crossed

VOCAB = 128_256


@dataclass
class _Request:
    """The part of a Request the executor reads: its token ids and sampling."""

    rid: int
    tokens: list
    spec: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt(self) -> int:  # every token is prompt here: no request asks for logprobs
        return len(self.tokens)

    def token_ids(self, start: int, end: int) -> list:
        return self.tokens[start:end]


@dataclass
class _Sequence:
    rid: int
    composite: object
    blocks: list = field(default_factory=list)


def pool_units(geometry: Geometry, org: str, seqs: int, tokens: int) -> dict[str, int]:
    """Units for `seqs` sequences of `tokens` tokens each (their blocks and one composite),
    read from a probe of the organization's own layout."""
    probe = build_memory(geometry, org, {"attention": 1, "recurrent": 1} if org == "D0"
                         else {"shared": 8})
    blocks = -(-tokens // probe.block_tokens)
    if org == "D0":
        return {"attention": seqs * blocks + 4, "recurrent": seqs + 2}
    per_composite = max(1, probe.layout.ssm_members) + (1 if org in ("S1", "S2") else 0)
    return {"shared": seqs * (blocks + per_composite) + 4}


class OrgBench:
    """One organization's arena on the device, its sequences and an executor over it."""

    def __init__(self, model, geometry: Geometry, org: str, seqs: int, tokens: int,
                 seed: int = 0) -> None:
        self.org = org
        self.mem = build_memory(geometry, org, pool_units(geometry, org, seqs + 1, tokens))
        self.arena = StateArena(self.mem, geometry, model.device)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        for pool in self.arena.pools.values():
            for layer in pool:  # layer by layer: no temporary as large as the pool
                layer.normal_(generator=gen)
        self.executor = TorchExecutor(model, self.arena)
        self.model = model
        bt = self.mem.block_tokens
        self.seqs = []
        for r in range(seqs + 1):  # the last one prefills
            seq = _Sequence(r, self.mem.allocate_composite(r))
            seq.blocks = [self.mem.allocate_attention(r).units[0] for _ in range(-(-tokens // bt))]
            self.seqs.append(seq)
        self.interval = self.mem.checkpoint_interval
        self.step_end = type(self.mem).checkpoint_placement == "step_end"
        self._gen = torch.Generator().manual_seed(seed + 1)

    def _tokens(self, n: int) -> list:
        return torch.randint(0, VOCAB, (n,), generator=self._gen).tolist()

    def decode_items(self, batch: int, context: int) -> list[Scheduled]:
        bt = self.mem.block_tokens
        items = []
        for seq in self.seqs[:batch]:
            state = ChunkState(seq.blocks[: -(-(context + 1) // bt)], seq.composite, NULL, [])
            items.append(Scheduled(_Request(seq.rid, self._tokens(context + 1)), 1, context,
                                   state))
        return items

    def prefill_item(self, n: int) -> Scheduled:
        seq = self.seqs[-1]
        bt = self.mem.block_tokens
        state = ChunkState(seq.blocks[: -(-n // bt)], seq.composite, NULL, [])
        return Scheduled(_Request(seq.rid, self._tokens(n)), n, 0, state)

    def crossings(self, items) -> int:
        """Composites the chunks write at boundaries (the state manager's count)."""
        return boundaries_crossed(items, self.interval, self.step_end)

    def run(self, items) -> None:
        self.executor.execute(items, self.crossings(items))
        self.executor.commit(items)

    def row(self, kind: str, items, seconds: list[float]) -> dict:
        """A steps-ledger row of the plan (Scheduler.plan_columns' arithmetic) and its
        timings."""
        dec = [i for i in items if i.num_new == 1]
        pre = [i for i in items if i.num_new > 1]
        return {
            "org": self.org, "kind": kind, "num_scheduled": len(items),
            "num_decode_seqs": len(dec), "decode_context_tokens": sum(i.context for i in dec),
            "prefill_tokens_initial": sum(i.num_new for i in pre if i.context == 0),
            "prefill_tokens_resume": sum(i.num_new for i in pre if i.context > 0),
            "decode_tokens": len(dec),
            "prefill_attention_pairs": sum(i.num_new * i.context + i.num_new * (i.num_new + 1)
                                           // 2 for i in pre),
            "checkpoint_writes": self.crossings(items),
            "num_sampling": sum(i.samples for i in items),
            "new_tokens": [i.num_new for i in items], "context_tokens": [i.context for i in items],
            "duration_s": statistics.median(seconds), "samples_s": seconds,
        }

    def close(self) -> None:
        self.arena = self.executor = None
        self.seqs = []


def timed(fn, device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def sync_audit(bench: OrgBench, batch: int, context: int) -> dict:
    """Host synchronisations of one decode step, counted by torch's CUDA sync debug mode
    (every synchronising call warns): the sampler's read of the tokens is the one
    expected. On a CPU there is nothing to count."""
    if bench.model.device.type != "cuda":
        return {"syncs": None, "note": "no accelerator: nothing to synchronise"}
    import warnings

    items = bench.decode_items(batch, context)
    bench.run(items)  # warm: allocator and kernels first used outside the count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            bench.run(items)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = [str(w.message).splitlines()[0] for w in caught
                if "synchroniz" in str(w.message).lower()]
    return {"syncs": len(messages), "messages": sorted(set(messages))[:5],
            "batch": batch, "context": context}


def step_grid(model, geometry: Geometry, plan, deadline: float, emit) -> dict:
    """Every organization's prefill and decode shapes; `emit(rows)` after each organization
    (partial results survive a stop)."""
    dev = model.device
    rows: list[dict] = []
    audits: dict[str, dict] = {}
    stopped = None
    tokens = max(max(plan.decode_contexts) + 1, max(plan.prefill_chunks))
    for org in plan.orgs:
        if time.perf_counter() > deadline:
            stopped = f"time limit reached before {org}"
            break
        bench = OrgBench(model, geometry, org, max(plan.decode_batches), tokens)
        audits[org] = sync_audit(bench, plan.decode_batches[-1], plan.decode_contexts[0])
        shapes = [("prefill", n, 0) for n in plan.prefill_chunks]
        shapes += [("mixed", n, plan.prefill_decodes) for n in plan.prefill_chunks]
        shapes += [("decode", b, c) for b in plan.decode_batches for c in plan.decode_contexts]
        for kind, a, b in shapes:
            if time.perf_counter() > deadline:
                stopped = f"time limit reached in {org} at {kind} {a} {b}"
                break
            if kind == "decode":
                items = bench.decode_items(a, b)
            else:
                items = bench.decode_items(b, plan.decode_contexts[0]) + [bench.prefill_item(a)]
            seconds = timed(lambda items=items, bench=bench: bench.run(items), dev,
                            plan.warmup, plan.repeats)
            rows.append(bench.row(kind, items, seconds))
        bench.close()
        del bench
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        emit({"rows": rows, "sync_audit": audits, "stopped": stopped})
        if stopped:
            break
    return {"rows": rows, "sync_audit": audits, "stopped": stopped, "complete": stopped is None}


class ContiguousRecurrentDecodeIO(_DecodeIO):
    """The executor's decode IO with the recurrent state in contiguous per-sequence tensors
    (b, ...) of the arena's dtype instead of the page mapping: the reference the paged
    recurrent state is timed against (KV through the block tables either way)."""

    def __init__(self, arena, items, dense, gathered: bool) -> None:
        super().__init__(arena, items, gathered=gathered)
        self.dense = dense

    def recurrent(self, layer):
        conv, ssm = self.dense[layer]
        if conv.dtype != torch.float32:
            return conv.float(), ssm.float()
        return conv, ssm

    def store_recurrent(self, layer, conv, ssm):
        dconv, dssm = self.dense[layer]
        if conv.data_ptr() != dconv.data_ptr():
            dconv.copy_(conv)
        if ssm.data_ptr() != dssm.data_ptr():
            dssm.copy_(ssm)


def _alternated_medians(fns, device, warmup: int, repeats: int) -> list[float]:
    """Median seconds of each function, timed in turn (one after the other, repeats + 1
    rounds) after `warmup` calls of each, so drift touches all alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats + 1):
        for fn, acc in zip(fns, times, strict=True):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def paged_vs_contiguous(model, geometry: Geometry, plan, deadline: float) -> dict:
    """Per organization and decode batch at `paged_context`: the whole-model decode step
    with paged and with contiguous recurrent state, alternated."""
    from serving_core.executor.torch_executor import PagedRecurrentIO
    from serving_core.model.sampler import sample

    dev = model.device
    out: list[dict] = []
    stopped = None
    ctx = plan.paged_context
    for org in plan.orgs:
        if time.perf_counter() > deadline:
            stopped = f"time limit reached before {org}"
            break
        bench = OrgBench(model, geometry, org, max(plan.decode_batches), ctx + 1, seed=7)
        ex = bench.executor
        for b in plan.decode_batches:
            if time.perf_counter() > deadline:
                stopped = f"time limit reached in {org} at batch {b}"
                break
            items = bench.decode_items(b, ctx)
            ids = torch.tensor([[it.req.tokens[-1]] for it in items], device=dev)
            pos = torch.full((b, 1), ctx, device=dev)
            gathered = ex.decode_attention == "gathered"
            a = bench.arena
            dense = [(torch.randn(b, *a.conv_shape, device=dev).to(a.dtype),
                      torch.randn(b, *a.ssm_shape, device=dev).to(a.dtype))
                     for _ in range(model.num_layers)]
            rows = [(None, it.req) for it in items]

            def paged(items=items, ids=ids, pos=pos, gathered=gathered, rows=rows, a=a):
                io = _DecodeIO(a, items, gathered=gathered)
                assert isinstance(io, PagedRecurrentIO)
                sample(model.forward(ids, pos, io), rows)

            def contiguous(items=items, ids=ids, pos=pos, gathered=gathered, dense=dense,
                           rows=rows, a=a):
                sample(model.forward(ids, pos, ContiguousRecurrentDecodeIO(a, items, dense,
                                                                           gathered)), rows)

            p, c = _alternated_medians((paged, contiguous), dev, plan.warmup, plan.repeats)
            out.append({"org": org, "batch": b, "context": ctx, "paged_s": p,
                        "contiguous_s": c, "ratio": p / c,
                        "ssm_in_place": bool(a.ssm_in_place)})
        bench.close()
        del bench
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if stopped:
            break
    return {"rows": out, "stopped": stopped, "complete": stopped is None}


def ceilings(device: torch.device, n: int, copy_bytes: int, repeats: int = 10) -> dict:
    """The device's two measured ceilings (the yardsticks of the fitted efficiencies): a bf16
    n x n x n matrix product on random data (FLOP/s) and a device-to-device copy of
    `copy_bytes` (bytes read plus written per second), each the median of `repeats` timed
    runs after three warm-ups, timed with the device synchronised around each run."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).normal_(
        generator=gen)
    dst = torch.empty_like(src)
    mm = statistics.median(timed(lambda: torch.matmul(a, b), device, 3, repeats))
    cp = statistics.median(timed(lambda: dst.copy_(src), device, 3, repeats))
    return {"matmul_n": n, "matmul_s": mm, "bf16_flops": 2 * n ** 3 / mm,
            "copy_bytes": copy_bytes, "copy_s": cp, "copy_bytes_per_s": 2 * copy_bytes / cp}
