"""Two-way splits of a forward's large products, the second half on one worker thread.

With `install(1)` a persistent worker thread (torch intra-op threads = 1, like the engine
thread) takes the second half of each product above a size threshold while the calling
thread computes the first; ATen releases the GIL inside the kernels, so the two halves run on
two cores. Every split gives the bits of the unsplit product (tests/test_split.py compares
them on many shapes): the LM head's vocabulary blocks are the same products whichever thread
runs them; a linear layer is cut by output features at a multiple of CUT_ALIGN (MKL's
per-element sums do not depend on the cut there; below 4 rows a cut at a non-multiple of 8
rounds differently, so small products are never cut); the prefill SSD scan and prefill
attention are cut by heads (each head's arithmetic is its own; attention by key/value heads
with their query heads). Small products (decode's projections and attention) stay on the
calling thread: handing work to the worker costs tens of microseconds and wakes a core.

Layer pairs (task parallelism): Falcon-H1's attention and Mamba mixer of one layer read the
same normed input and write disjoint state (KV pages, recurrent pages), so `layer_pair` runs
one of them on the worker while the calling thread runs the other, each the same ops as when
run one after the other (the same bits by construction), in the forwards PAIR_MAX_TOKENS and
PAIR_MIN_ROWS select (decode). Within a pair the product splits above run unsplit (the
worker is busy, and a nested hand-off from the worker to itself would never run).
Within a task pair (`tasks`, so decode layer pairs) the worker's state update offers its
pieces to the calling thread once that thread's own side has returned (serving_core/model/
share.py, chunks of share.CHUNK pieces; each piece's arithmetic is its own). The executor's
recurrent-state copies (a step's commits, a prefill's starting states) go in two halves of
the layers (`layer_halves`, STATE_LAYER_HALVES: copies, the same bytes); a split in_proj
scales each half by its muP factors on its own thread (`linear`'s `scale`).
Without `install(1)` (the server's `--split-workers`, serving_core/server/process_settings.py)
nothing is split and no thread exists.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from serving_core.model import handoff_log, mamba, packed_linear, share
from serving_core.model.packed_linear import Pack

CUT_ALIGN = 64  # output features of a linear layer's cut: a multiple of this
# Smallest products split (measured on the 2-core machine, docs/benchmarks.md "The split
# worker"): rows and multiply-adds of a linear layer's product; rows of the LM head's
# product; tokens of a prefill scan; queries of a prefill attention.
LINEAR_MIN_MACS = 16_000_000
LINEAR_MIN_ROWS = 256
HEAD_MIN_ROWS = 1
SCAN_MIN_TOKENS = 64
ROWS_MIN_TOKENS = 128
ATTENTION_MIN_TOKENS = 64
# Layer pairs: forwards of at most PAIR_MAX_TOKENS tokens per sequence (1: decode batches
# and one-token segments) over PAIR_MIN_ROWS sequences or more run one side of each layer
# (PAIR_WORKER_SIDE: "attention" or "mixer") on the worker beside the other; longer forwards
# split their products instead (measured, docs/benchmarks.md "Layer pairs").
PAIR_MAX_TOKENS = 1
PAIR_MIN_ROWS = 1
PAIR_WORKER_SIDE = "mixer"
# Prefill attention of PROJ_MIN_TOKENS tokens or more per sequence: the query projection
# (and its rotary embedding) here, the key and value projections on the worker (`tasks`).
PROJ_MIN_TOKENS = 256
# The executor's copies of recurrent states (a step's commits into the units, a prefill's
# reads of its starting states) in two halves of the layers over the worker.
STATE_LAYER_HALVES = True


class _Worker:
    """One daemon thread running submitted calls in order; `close` ends it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="hsl-split", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append(fn())
            except BaseException as err:  # re-raised on the calling thread
                box.append(err)
                box.append(None)
            done.set()

    def run(self, fn: Callable[[], object]) -> Callable[[], object]:
        """Start fn() on the worker; returns a wait() that gives its result (or raises)."""
        box: list = []
        done = threading.Event()
        modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()  # thread-local

        def call():
            with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                return fn()

        self._jobs.put((call, box, done))

        def wait():
            done.wait()
            if len(box) == 2:
                raise box[0]
            return box[0]

        return wait

    def close(self) -> None:
        self._jobs.put(None)
        self.thread.join()


_worker: _Worker | None = None
_log: handoff_log.HandoffLog | None = None


def log_handoffs(log: handoff_log.HandoffLog | None) -> None:
    """Time every hand-off into `log` from now on (None: stop; for profiling)."""
    global _log
    _log = log


def install(workers: int) -> None:
    """Split large products over `workers` (0 or 1) worker threads from now on."""
    if workers not in (0, 1):
        raise ValueError(f"split_workers={workers!r}: allowed values are 0, 1")
    global _worker
    if workers and _worker is None:
        _worker = _Worker()
    elif not workers:
        close()


def close() -> None:
    """End the worker thread (no-op without one); products run unsplit afterwards."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None:
        worker.close()


def active() -> bool:
    """Whether work can be handed to the worker now (installed, and not busy in a pair)."""
    return _worker is not None


def settings() -> dict:
    """The split in effect and its thresholds (for the run's runtime record)."""
    return {"workers": int(_worker is not None), "linear_min_macs": LINEAR_MIN_MACS,
            "linear_min_rows": LINEAR_MIN_ROWS, "head_min_rows": HEAD_MIN_ROWS,
            "scan_min_tokens": SCAN_MIN_TOKENS, "rows_min_tokens": ROWS_MIN_TOKENS,
            "attention_min_tokens": ATTENTION_MIN_TOKENS,
            "cut_align": CUT_ALIGN, "pair_max_tokens": PAIR_MAX_TOKENS,
            "pair_min_rows": PAIR_MIN_ROWS, "pair_worker_side": PAIR_WORKER_SIDE,
            "proj_min_tokens": PROJ_MIN_TOKENS, "state_layer_halves": STATE_LAYER_HALVES,
            "share_chunk": share.CHUNK}


def pair(first: Callable[[], object], second: Callable[[], object]) -> tuple:
    """(first(), second()), second on the worker when there is one."""
    if _worker is None:
        return first(), second()
    return _on(_worker, first, second)


def _on(worker: _Worker, here: Callable[[], object], there: Callable[[], object]) -> tuple:
    """(here(), there()), there on `worker` while this thread runs here; an exception on
    either side is raised after both have ended."""
    if _log is not None:
        return _timed(_log, worker, here, there)
    wait = worker.run(there)
    try:
        a = here()
    finally:
        b = wait()
    return a, b


def _timed(log: handoff_log.HandoffLog, worker: _Worker, here: Callable[[], object],
           there: Callable[[], object]) -> tuple:
    """`_on` with each side's times charged to the hand-off's site in `log`."""
    key = handoff_log.site(1)

    def job():
        (start, cpu0), out = handoff_log.now(), None
        try:
            out = there()
        finally:
            end, cpu1 = handoff_log.now()
            log.worker(key, start, end, cpu1 - cpu0)
        return out

    wait = worker.run(job)
    t0 = handoff_log.now()[0]
    try:
        a = here()
    finally:
        t1 = handoff_log.now()[0]
        try:
            b = wait()
        finally:
            log.caller(key, t1 - t0, handoff_log.now()[0] - t1)
    return a, b


def layer_pair(mixer: Callable[[], object], attention: Callable[[], object], rows: int,
               tokens: int) -> tuple:
    """(mixer(), attention()) of one layer; for a forward of `rows` >= PAIR_MIN_ROWS
    sequences of `tokens` <= PAIR_MAX_TOKENS tokens, the PAIR_WORKER_SIDE on the worker
    while the calling thread runs the other. Meanwhile the module holds no worker, so every
    product on either thread runs unsplit (the same bits: each split equals its unsplit op)
    and nothing is handed to the busy worker. An exception on either side is raised here
    after both have ended."""
    if _worker is None or tokens > PAIR_MAX_TOKENS or rows < PAIR_MIN_ROWS:
        return mixer(), attention()
    mixer_here = PAIR_WORKER_SIDE == "attention"
    here, there = (mixer, attention) if mixer_here else (attention, mixer)
    first, second = tasks(here, there)
    return (first, second) if mixer_here else (second, first)


def tasks(here: Callable[[], object], there: Callable[[], object]) -> tuple:
    """(here(), there()), `there` on the worker when there is one, and meanwhile the module
    holds no worker: every product on either thread runs unsplit (each split gives its
    unsplit op's bits) and nothing is handed to the busy worker. An exception on either
    side is raised after both have ended."""
    global _worker
    worker = _worker
    if worker is None:
        return here(), there()
    _worker = None
    try:
        return _shared(worker, here, there) if share.CHUNK > 0 else _on(worker, here, there)
    finally:
        _worker = worker


def _shared(worker: _Worker, here: Callable[[], object], there: Callable[[], object]) -> tuple:
    """`_on` with a share.Share open: the worker's shared items (the decode state update)
    are taken from the back by this thread once `here` has returned."""
    slot = share.Share(worker.thread)

    def worker_side():
        try:
            return there()
        finally:
            slot.end()

    def helping():
        out = here()
        slot.help()
        return out

    share.open_share(slot)
    try:
        return _on(worker, helping, worker_side)
    finally:
        share.open_share(None)


def projections(tokens: int) -> bool:
    """Whether a forward of `tokens` tokens per sequence computes its attention's query
    projection here and its key and value projections on the worker (`tasks`)."""
    return _worker is not None and tokens >= PROJ_MIN_TOKENS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Pack | None = None, scale: torch.Tensor | None = None):
    """F.linear(x, weight, bias), cut by output features over the worker when large; a
    product not cut runs over `packed` (the weight's oneDNN copy) where that serves it.
    `scale` (n,): the product then multiplied by it in place (`mul_`), each half of a cut
    product by its own features' scales on its own thread (an elementwise product: the
    same bits in parts)."""
    n, k = weight.shape
    rows = x.numel() // k
    cut = n // 2 // CUT_ALIGN * CUT_ALIGN
    if (_worker is None or bias is not None or rows < LINEAR_MIN_ROWS or cut == 0
            or rows * n * k < LINEAR_MIN_MACS):
        out = packed_linear.linear(x, weight, bias, packed)
        return out if scale is None else out.mul_(scale)
    flat = x.reshape(rows, k)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)

    def part(lo: int, hi: int) -> None:
        torch.matmul(flat, weight[lo:hi].t(), out=out[:, lo:hi])
        if scale is not None:
            out[:, lo:hi].mul_(scale[lo:hi])

    pair(lambda: part(0, cut), lambda: part(cut, n))
    return out.view(*x.shape[:-1], n)


def head_blocks(rows: int, blocks: int, run: Callable[[int, int], None]) -> None:
    """run(first, end) over the LM head's vocabulary blocks [0, blocks), in two halves over
    the worker when `rows` sample rows reach HEAD_MIN_ROWS."""
    _halves(blocks, run, rows >= HEAD_MIN_ROWS)


def layer_halves(layers: int, run: Callable[[int, int], None]) -> None:
    """run(first, end) over the layers [0, layers) of the executor's recurrent-state copies,
    in two halves over the worker when STATE_LAYER_HALVES (each layer's state lies in its
    own units and tensors: the same bytes in any order)."""
    _halves(layers, run, STATE_LAYER_HALVES)


def token_halves(t: int, width: int, run: Callable[[int, int], None]) -> None:
    """run(first, end) over the tokens [0, t) of a row-wise elementwise op on rows of
    `width` floats (the prefill conv and gated norm), in two halves over the worker from
    ROWS_MIN_TOKENS tokens when `width` is a multiple of mamba.ROW_ALIGN (every part then
    runs the vectorized kernels on whole vectors, so the parts give the bits of the whole;
    a ragged tail takes a scalar path whose silu rounds differently)."""
    _halves(t, run, t >= ROWS_MIN_TOKENS and width % mamba.ROW_ALIGN == 0)


def _halves(n: int, run: Callable[[int, int], None], cut: bool) -> None:
    """run(0, n), or run over [0, n) in two halves over the worker when `cut` and there are
    a worker and two or more items."""
    if _worker is None or not cut or n < 2:
        run(0, n)
        return
    mid = n // 2
    pair(lambda: run(0, mid), lambda: run(mid, n))


def scan_heads(scan: Callable, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
               B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, chunk: int,
               initial: torch.Tensor, final: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """scan(x, dt, A, B, C, D, chunk, initial) (mamba.chunk_scan's arguments and results),
    cut by heads over the worker for a prefill of SCAN_MIN_TOKENS or more: with one group
    each half of the heads reads the shared B and C, and their chunks' C.B, computed once
    (its chunks in two halves over the worker); with several, the cut is at a group. The
    halves write their heads of y and of the final state into one buffer each; `final`: the
    buffer for the final state (it may be `initial`), else a new one."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    final = torch.empty(b, h, p, n, dtype=torch.float32, device=x.device) if final is None \
        else final
    if _worker is None or t < SCAN_MIN_TOKENS or h < 2 or (g > 1 and g % 2):
        return scan(x, dt, A, B, C, D, chunk, initial, out=(None, final))
    cut, gc = (h // 2, None) if g == 1 else (h // 2, g // 2)
    groups = _shared_group_terms(B, C, chunk) if g == 1 else None
    y = torch.empty(b, t, h, p, dtype=torch.float32, device=x.device)

    def half(hs: slice, gs: slice):
        bg, cg = (B, C) if gc is None else (B[:, :, gs], C[:, :, gs])
        return scan(x[:, :, hs], dt[..., hs], A[hs], bg, cg, D[hs], chunk, initial[:, hs],
                    groups=groups, out=(y[:, :, hs], final[:, hs]))

    pair(lambda: half(slice(0, cut), slice(0, gc)), lambda: half(slice(cut, h), slice(gc, None)))
    return y, final


def _shared_group_terms(B: torch.Tensor, C: torch.Tensor, chunk: int) -> tuple:
    """mamba.chunk_scan's `groups` for B and C (b, T, 1, N): their chunks and causal C.B, the
    products of the first half of the chunks on this thread, the rest on the worker; where
    T needs padding each half also copies its chunks into the padded buffers (the values and
    layout of group_chunks' padded copies: the same bits)."""
    b, t, g, n = B.shape
    pad = (chunk - t % chunk) % chunk
    mid = (t + pad) // chunk // 2
    if mid == 0:
        Bg, Cg = mamba.group_chunks(B, C, chunk)
        return Bg, Cg, mamba.causal_products(Bg, Cg)
    if pad:  # the zero-padded copies group_chunks makes, each half copying its own chunks
        padded = [torch.empty(b, t + pad, g, n, dtype=torch.float32, device=B.device)
                  for _ in "BC"]
        Bg, Cg = (v.view(b, -1, chunk, g, n).permute(0, 1, 3, 2, 4) for v in padded)
    else:
        Bg, Cg = mamba.group_chunks(B, C, chunk)

    def products(first: int, end: int) -> torch.Tensor:
        if pad:
            lo, hi = first * chunk, end * chunk
            for src, dst in zip((B, C), padded, strict=True):
                dst[:, lo : min(hi, t)].copy_(src[:, lo:hi])
                dst[:, min(hi, t) : hi].zero_()
        return mamba.causal_products(Bg[:, first:end], Cg[:, first:end])

    lo, hi = pair(lambda: products(0, mid), lambda: products(mid, Bg.shape[1]))
    return Bg, Cg, torch.cat([lo, hi], dim=1)


def worker_cpu_s() -> float:
    """CPU seconds the worker thread has used so far (0.0 without one)."""
    if _worker is None or _worker.thread.ident is None:
        return 0.0
    import time

    return time.clock_gettime(time.pthread_getcpuclockid(_worker.thread.ident))


def attention_heads(attend: Callable, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                    *rest) -> torch.Tensor:
    """attend(q (b, H, t, d), keys, vals (b, KVH, s, d), *rest) -> (b, H, t, d), cut by
    key/value heads (each with its query heads) over the worker for a prefill of
    ATTENTION_MIN_TOKENS or more queries."""
    kvh, h, t = keys.shape[1], q.shape[1], q.shape[2]
    if _worker is None or t < ATTENTION_MIN_TOKENS or kvh % 2:
        return attend(q, keys, vals, *rest)
    kc, qc = kvh // 2, h // 2
    lo, hi = pair(lambda: attend(q[:, :qc], keys[:, :kc], vals[:, :kc], *rest),
                  lambda: attend(q[:, qc:], keys[:, kc:], vals[:, kc:], *rest))
    return torch.cat([lo, hi], dim=1)
