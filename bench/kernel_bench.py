"""Real-executor benchmarks on the tiny Falcon-H1 (CPU unless --device says otherwise).

1. Paged vs contiguous decode step, batches 8 / 32 / 53, S1 and S2:
   - "mixer": one Mamba2 mixer decode update (projections, conv window, SSM state), state
     gathered through the page mapping and written back vs contiguous per-sequence tensors;
     each paged call also pays the page lookup (`StateArena.locate`, in PagedRecurrentIO's
     constructor), which the engine pays once per step for every layer; "mixer located"
     times the same paged call with the lookup made once beforehand, as a layer of an
     engine step sees it (the per-call row stays the issue's target row);
   - "model": a whole-model decode step (every layer, paged KV by block table and paged
     recurrent state) vs contiguous state: a preallocated head-major KV buffer per layer
     that attention reads in place, and per-sequence recurrent tensors ("cat": also against
     DenseState as it is, whose KV grows by concatenation each step, the issue's baseline).
   Ratio = paged / contiguous median seconds (target <= 1.10 on CPU), timed in
   alternation. The paged side's arena is advised for huge pages as the engine's is
   (serving_core/executor/huge_pages.py; the share granted is printed); the contiguous
   tensors are plain allocations, and once more advised for huge pages too (`huge`, the
   matched ratio: what paging costs, not what huge pages save). Times are the
   calling thread's CPU time when one intra-op thread is used (the default, --threads 1),
   so that a busy shared machine does not distort them; the load average is reported.
2. Tokens per second: our engine (S2, all requests at t=0, greedy, exact lengths) against
   transformers' batched `generate` at the same batch size, prompt and output lengths.

3. TQ4 (bench/tq4_bench.py): page-native decode over packed pages against plain paged
   decode at batches 8 / 32 / 53, and the prefill reconstruction's peak temporary bytes for
   KV-head groups of 1, 2 and all (--skip-tq4 leaves it out).

Prints a table and writes bench/results/kernels.json. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench import tq4_bench
from bench.tiny import tiny_checkpoint
from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import serve
from serving_core.executor import huge_pages
from serving_core.executor.state_arena import StateArena
from serving_core.executor.torch_executor import PagedRecurrentIO
from serving_core.geometry import load_geometry
from serving_core.memory import build_memory
from serving_core.model import paged_loops
from serving_core.model.dense_state import DenseState
from serving_core.model.falcon_h1 import FalconH1
from serving_core.model.paged_attention import DecodeLayout, decode_attention
from serving_core.server.runtime import ServedSpec

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL = "falcon_h1_tiny"
BATCHES = (8, 32, 53)
CONTEXT = 1024  # tokens of KV per sequence in the whole-model decode step



def _median_s(fn, repeats: int) -> float:
    """Median seconds of `fn()`: thread CPU time with one intra-op thread, else wall."""
    return _paired_median_s([fn], repeats)[0]


def _paired_median_s(fns, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, timed in alternation (a, b, a, b, ...) so that a
    shared machine's changing load (memory bandwidth, caches) weighs on each alike."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            t0 = clock()
            fn()
            out.append(clock() - t0)
    return [statistics.median(t) for t in times]


class _PagedDecode:
    """A whole-model decode io over arenas: KV by block table, recurrent state paged."""

    def __init__(self, arena, blocks, composites, context):
        self.rec = PagedRecurrentIO(arena, composites)
        self.arena = arena
        bt = arena.block_tokens
        self.units = torch.tensor([[b.units[0] for b in row] for row in blocks])
        self.context = context
        self.new_units = torch.tensor([row[context // bt].units[0] for row in blocks])
        self.new_offsets = torch.full((len(blocks),), context % bt)
        self.tables = self.units.tolist()
        self.lengths = [context + 1] * len(blocks)
        self.layout = DecodeLayout(self.tables, self.lengths, bt)

    def kv(self, layer):
        k, v = self.arena.gather_kv(layer, self.units, self.context)
        return k, v, None

    def store_kv(self, layer, k, v):
        self.arena.store_kv(layer, self.new_units, self.new_offsets, k[:, 0], v[:, 0])

    def decode_attention(self, layer, q, k, v, scale):
        self.store_kv(layer, k, v)
        return decode_attention(q, self.arena.kv_view(layer), self.tables, self.lengths, scale,
                                self.layout, self.arena.kv_units(layer))

    def recurrent(self, layer):
        return self.rec.recurrent(layer)

    def store_recurrent(self, layer, conv, ssm):
        self.rec.store_recurrent(layer, conv, ssm)


class _ContiguousDecode:
    """The contiguous reference of a decode step: per layer a preallocated KV buffer
    (b, KVH, capacity, hd) that attention reads in place, and per-sequence recurrent
    tensors (DenseState's)."""

    def __init__(self, dense: DenseState, context: int, place=lambda t: t) -> None:
        self.dense = dense
        self.context = context
        self.k = [place(torch.cat([k, torch.zeros_like(k[:, :1])], 1).transpose(1, 2)
                        .contiguous()) for k in dense.k]
        self.v = [place(torch.cat([v, torch.zeros_like(v[:, :1])], 1).transpose(1, 2)
                        .contiguous()) for v in dense.v]

    def decode_kv(self, layer, k, v):
        c = self.context
        self.k[layer][:, :, c] = k[:, 0]
        self.v[layer][:, :, c] = v[:, 0]
        return self.k[layer][:, :, : c + 1], self.v[layer][:, :, : c + 1], None

    def recurrent(self, layer):
        return self.dense.recurrent(layer)

    def store_recurrent(self, layer, conv, ssm):
        pass


def _huge_copy(t: torch.Tensor) -> torch.Tensor:
    """t copied into memory advised for huge pages as the arena's pools are."""
    return huge_pages.zeros(tuple(t.shape), t.dtype, t.device).copy_(t)


def _on_huge_pages(dense: DenseState, model, batch: int) -> DenseState:
    """A copy of `dense` whose tensors lie in huge-page-advised memory."""
    out = DenseState(model, batch)
    out.k, out.v = [_huge_copy(k) for k in dense.k], [_huge_copy(v) for v in dense.v]
    out.conv, out.ssm = [_huge_copy(c) for c in dense.conv], [_huge_copy(s) for s in dense.ssm]
    out.length = dense.length
    return out


def _shuffled_arena(model, org: str, batch: int, blocks_per_seq: int):
    """(memory, arena) for `batch` sequences, the free list shuffled (the fragmentation
    modelled: a sequence's pages scattered over the arena), the pools random."""
    geometry = load_geometry(MODEL)
    per_seq = blocks_per_seq + (4 if org == "S1" else 3) + 1
    mem = build_memory(geometry, org, {"shared": batch * per_seq + 8})
    rng = np.random.default_rng(batch)
    free = list(mem.pools["shared"].free)
    rng.shuffle(free)
    mem.pools["shared"].free.clear()
    mem.pools["shared"].free.extend(free)
    arena = StateArena(mem, geometry, model.device)
    for t in arena.pools.values():
        t.normal_()
    return mem, arena


def _random_dense(model, batch: int) -> DenseState:
    """Contiguous state of `batch` sequences at CONTEXT tokens, random."""
    dense = DenseState(model, batch)
    for layer in range(model.num_layers):
        dense.k[layer] = torch.randn(batch, CONTEXT, model.kv_heads, model.head_dim)
        dense.v[layer] = torch.randn(batch, CONTEXT, model.kv_heads, model.head_dim)
        dense.conv[layer].normal_()
        dense.ssm[layer].normal_()
    dense.length = CONTEXT
    return dense


def paged_vs_contiguous(model, org: str, batch: int, repeats: int) -> dict:
    blocks_per_seq = CONTEXT // 512 + 1
    mem, arena = _shuffled_arena(model, org, batch, blocks_per_seq)
    arena_huge = huge_pages.settings()  # the arena's advised bytes and their huge share
    composites = [mem.allocate_composite(r) for r in range(batch)]
    blocks = [[mem.allocate_attention(r) for _ in range(blocks_per_seq)] for r in range(batch)]
    dense = _random_dense(model, batch)
    # The contiguous side once more placed as the arena is (huge pages advised), so that the
    # matched ratio counts what paging costs and not what huge pages save.
    dense_huge = _on_huge_pages(dense, model, batch)
    x = torch.randn(batch, 1, model.hidden)
    ids = torch.randint(0, 128_256, (batch, 1))
    pos = torch.full((batch, 1), CONTEXT)

    def mixer(io_of):
        def run():
            with torch.inference_mode():
                model._mamba(0, x, io_of())
        return run

    def whole(io_of):
        return lambda: model.forward(ids, pos, io_of())

    contiguous_io = _ContiguousDecode(dense, CONTEXT)
    contiguous_huge_io = _ContiguousDecode(dense_huge, CONTEXT, _huge_copy)

    def model_dense_cat():  # DenseState as it is: KV grown by concatenation every step
        saved = [(k, v) for k, v in zip(dense.k, dense.v, strict=True)]
        model.forward(ids, pos, dense)
        dense.k = [k for k, _ in saved]
        dense.v = [v for _, v in saved]

    out = {"org": org, "batch": batch, "arena_huge_pages": arena_huge}
    located = PagedRecurrentIO(arena, composites)  # the step's lookup, made once
    p, c = _paired_median_s([mixer(lambda: located), mixer(lambda: dense)], repeats)
    out["mixer_located_paged_ms"], out["mixer_located_contiguous_ms"] = 1000 * p, 1000 * c
    out["mixer_located_ratio"] = p / c
    for name, make, paged_io, contiguous, huge in (
            ("mixer", mixer, lambda: PagedRecurrentIO(arena, composites), dense, dense_huge),
            ("model", whole, lambda: _PagedDecode(arena, blocks, composites, CONTEXT),
             contiguous_io, contiguous_huge_io)):
        p, c, h = _paired_median_s([make(paged_io), make(lambda c=contiguous: c),
                                    make(lambda h=huge: h)], repeats)
        out[f"{name}_paged_ms"] = 1000 * p
        out[f"{name}_contiguous_ms"] = 1000 * c
        out[f"{name}_ratio"] = p / c
        out[f"{name}_contiguous_huge_ms"] = 1000 * h
        out[f"{name}_ratio_matched"] = p / h
    out["model_densestate_cat_ms"] = 1000 * _median_s(model_dense_cat, repeats)
    out["model_ratio_vs_cat"] = out["model_paged_ms"] / out["model_densestate_cat_ms"]
    return out


def engine_vs_generate(model, checkpoint, batch: int, prompt_len: int, output: int) -> dict:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 128_256, prompt_len).astype(np.int32) for _ in range(batch)]
    geometry = load_geometry(MODEL)
    spec = loaded_model_spec(model, geometry, "S2", "b63",
                             {"cap": batch, "max_num_batched_tokens": max(2048, prompt_len)})
    engine = build_engine(spec, model=model)
    specs = [ServedSpec(i, 0.0, p, output) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    serve(engine, specs)
    ours = time.perf_counter() - t0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FalconH1ForCausalLM

    net = FalconH1ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor(np.stack(prompts), dtype=torch.long)
    t0 = time.perf_counter()
    with torch.inference_mode():
        net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output,
                     min_new_tokens=output, do_sample=False, pad_token_id=0)
    theirs = time.perf_counter() - t0
    tokens = batch * output
    return {
        "batch": batch, "prompt_tokens": prompt_len, "output_tokens": output,
        "engine_s": ours, "engine_tok_s": tokens / ours,
        "transformers_s": theirs, "transformers_tok_s": tokens / theirs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_bench", description=__doc__)
    parser.add_argument("--checkpoint", default=str(ROOT / "models" / MODEL),
                        help="tiny checkpoint folder (built in a temp dir when absent)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--gen-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--skip-generate", action="store_true",
                        help="only the paged / contiguous table")
    parser.add_argument("--skip-tq4", action="store_true",
                        help="without the TQ4 part (bench/tq4_bench.py)")
    parser.add_argument("--paged-loops", choices=paged_loops.MODES, default="auto",
                        help="the paged path's per-page loops (serving_core/model/paged_loops.py;"
                        " auto: compiled when built, `python -m serving_core.model.paged_loops`)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    paged_loops.install(args.paged_loops)
    with tiny_checkpoint(args.checkpoint) as checkpoint:
        model = FalconH1.load(checkpoint)
        rows = [paged_vs_contiguous(model, org, b, args.repeats) for org in ("S1", "S2")
                for b in BATCHES]
        print(f"{'org':4} {'batch':>5} {'mixer paged':>12} {'contig':>8} {'ratio':>6} "
              f"{'huge':>8} {'ratio':>6} {'model paged':>12} {'contig':>8} {'ratio':>6} "
              f"{'huge':>8} {'ratio':>6} {'cat':>8} {'ratio':>6}   (ms, median; huge: the "
              "contiguous side on huge pages too)")
        for r in rows:
            print(f"{r['org']:4} {r['batch']:>5} " + " ".join(
                f"{r[f'{n}_paged_ms']:>12.2f} {r[f'{n}_contiguous_ms']:>8.2f} "
                f"{r[f'{n}_ratio']:>6.3f} {r[f'{n}_contiguous_huge_ms']:>8.2f} "
                f"{r[f'{n}_ratio_matched']:>6.3f}" for n in ("mixer", "model"))
                + f" {r['model_densestate_cat_ms']:>8.2f} {r['model_ratio_vs_cat']:>6.3f}")
        loops = paged_loops.settings()
        huge = sum(r["arena_huge_pages"]["huge_bytes"] for r in rows) / max(1, sum(
            r["arena_huge_pages"]["advised_bytes"] for r in rows))
        print(f"{'org':4} {'batch':>5} {'mixer located':>14} {'contig':>8} {'ratio':>6}   "
              "(ms, median; the page lookup made once per step, not per call)")
        for r in rows:
            print(f"{r['org']:4} {r['batch']:>5} {r['mixer_located_paged_ms']:>14.2f} "
                  f"{r['mixer_located_contiguous_ms']:>8.2f} {r['mixer_located_ratio']:>6.3f}")
        print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f} "
              f"({os.cpu_count()} CPUs), paged loops {loops['loops']} ({loops['reason']}), "
              f"arena in huge pages {100 * huge:.0f} % ({huge_pages.mode()})")
        gen = None if args.skip_generate else engine_vs_generate(
            model, checkpoint, args.gen_batch, args.prompt, args.output)
        if gen:
            print(f"batch {gen['batch']}, {gen['prompt_tokens']} prompt + "
                  f"{gen['output_tokens']} output tokens: engine {gen['engine_tok_s']:.1f} "
                  f"tok/s ({gen['engine_s']:.2f} s), transformers generate "
                  f"{gen['transformers_tok_s']:.1f} tok/s ({gen['transformers_s']:.2f} s)")
        # 3. TQ4: page-native decode vs plain paged decode at batches 8/32/53, and the
        # prefill reconstruction's peak temporary for groups of 1, 2 and all KV heads.
        tq4 = None if args.skip_tq4 else tq4_bench.run(repeats=max(1, args.repeats // 3))
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = {"threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0],
               "paged_loops": loops,
               "paged_vs_contiguous": rows, "generate": gen, "tq4": tq4}
        (RESULTS / "kernels.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
