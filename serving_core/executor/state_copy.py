"""The copy port between an engine's state and a state tier, and the copiers behind it.

A tier (serving_core.host_tier) holds entries by prefix key and never addresses device
memory: what it saves is read, and what it restores is written, through this port, called
by the state manager with the organization's objects (an attention block, a checkpoint
composite).

`ArenaCopier` (torch executor) moves an object's bytes as the units hold them: an object is
a few *regions*, each a byte range of whole units addressed by unit id (an attention block:
its unit's KV bytes; a composite: its SSM member pages, its conv page or S2 conv slot, or
its one unit for S0/D0/N0; an N0 member page per Mamba2 layer of a larger group). A read
is one gather per region (all layers at once) into a host buffer; a write is one indexed
copy per region into the destination units. No
per-token or per-layer Python loop; the bytes moved are exactly the state's bytes
(layers x (block tokens x KV bytes per token), or layers x (SSM + conv bytes)).
`poison` fills an object's units with NaN before a restore writes them (the continuation
audit: a byte the restore misses reads back NaN).

`ThreadCopier` runs the reads of a tier's saves on one worker thread, off the engine's step
loop (on a GPU the gather runs on a side CUDA stream; the host buffers are pinned, see
`host_buffer`). `ModelledCopier` (simulated executors) moves nothing: it knows each object's
bytes and charges transfer time over a host link (bytes / bandwidth + a per-transfer
latency, the executor profile's constants).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving_core.executor.state_arena import StateArena
from serving_core.memory.s2 import decode_conv_line


def host_buffer(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor for copies from/to `device`: page-locked (pinned) when the
    device is a GPU, so the copy is a DMA that can overlap compute."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


def to_host(t: torch.Tensor, stream=None) -> torch.Tensor:
    """A host copy of `t`: itself when it is already a fresh host tensor (a gather's
    output), else copied into a pinned buffer (asynchronously on `stream` when given)."""
    if t.device.type == "cpu":
        return t
    buf = host_buffer(t.shape, t.dtype, t.device)
    buf.copy_(t, non_blocking=stream is not None)
    return buf


@dataclass(frozen=True)
class Region:
    """A byte range [start, start + nbytes) of some units of one pool, over all layers."""

    pool: str
    units: tuple[int, ...]
    start: int
    nbytes: int


class ArenaCopier:
    """Reads, writes and poisons published objects in one StateArena."""

    def __init__(self, arena: StateArena) -> None:
        self.arena = arena
        elem = torch.empty((), dtype=arena.dtype).element_size()
        self.elem = elem
        self.block_bytes = arena.block_tokens * arena.token_bytes
        self.ssm_bytes = arena.ssm_elems * elem
        self.conv_bytes = arena.conv_elems * elem

    # ----- addressing -------------------------------------------------------------------------
    def regions(self, obj) -> list[Region]:
        """Where `obj`'s state bytes live, from the memory organization's mapping."""
        arena, mem = self.arena, self.arena.mem
        if not obj.kind:  # an attention block: the KV bytes of its unit
            return [Region(obj.pool, (obj.units[0],), 0, self.block_bytes)]
        if arena.contiguous:  # SSM state then conv window in one unit (per-layer pages: each)
            pages = tuple(mem.ssm_member_pages(obj)) if arena.layer_pages else (obj.units[0],)
            return [Region(obj.pool, pages, 0, (self.ssm_bytes + self.conv_bytes) // len(pages))]
        unit = mem.pools[obj.pool].unit_bytes
        members = mem.ssm_member_pages(obj)
        full, rest = divmod(self.ssm_bytes, unit)
        out = []
        if full:
            out.append(Region(obj.pool, tuple(members[:full]), 0, unit))
        if rest:
            out.append(Region(obj.pool, (members[full],), 0, rest))
        line = mem.conv_line(obj)
        if arena.slots:  # a 32-KiB slot of a slab page shared with other composites
            page, slot = decode_conv_line(line, arena.slots_per_slab)
            slot_bytes = arena.slot_elems * self.elem
            out.append(Region(obj.pool, (page,), slot * slot_bytes, self.conv_bytes))
        else:  # the conv window leads its dedicated conv page
            out.append(Region(obj.pool, (line,), 0, self.conv_bytes))
        return out

    def nbytes(self, obj) -> int:
        """Bytes of `obj`'s state over every layer (what a save or restore moves)."""
        layers = self.arena.layers
        return sum(layers * len(r.units) * r.nbytes for r in self.regions(obj))

    def _view(self, r: Region) -> torch.Tensor:
        return self.arena.raw[r.pool][:, :, r.start:r.start + r.nbytes]

    def _index(self, r: Region) -> torch.Tensor:
        return torch.tensor(r.units, dtype=torch.long, device=self.arena.device)

    def _source(self, r: Region) -> torch.Tensor:
        """The region's bytes as a (layers, units, bytes) tensor: a view of the arena when
        its units are consecutive (one unit, or S1/S2 member pages in a row), else a gather."""
        view = self._view(r)
        first, n = r.units[0], len(r.units)
        if r.units == tuple(range(first, first + n)):
            return view.narrow(1, first, n)
        return view.index_select(1, self._index(r))

    # ----- device -> tier ---------------------------------------------------------------------
    def gather(self, obj) -> list[torch.Tensor]:
        """Copies of `obj`'s regions, (layers, units, bytes) uint8 each, on the arena's
        device (one copy per region). On the CPU these are the host copies."""
        out = []
        for r in self.regions(obj):
            src = self._source(r)
            out.append(src.clone(memory_format=torch.contiguous_format)
                       if src._base is not None else src)
        return out

    def read(self, obj) -> list[torch.Tensor]:
        """Host copies of `obj`'s regions (what a tier holds for it)."""
        return [to_host(t) for t in self.gather(obj)]

    # ----- tier -> device ---------------------------------------------------------------------
    def poison(self, obj) -> int:
        """Fill every unit `obj` owns (and an S2 conv slot) with NaN (0xFF bytes: NaN in
        fp32, bf16 and a TQ4 norm); returns the units."""
        arena = self.arena
        raw = arena.raw[obj.pool]
        for unit in obj.units:  # basic indexing: a view per unit, filled in place
            raw[:, unit].fill_(0xFF)
        if obj.kind and arena.slots:
            r = self.regions(obj)[-1]
            self._view(r)[:, r.units[0]].fill_(0xFF)
        return len(obj.units)

    def write(self, obj, data: list[torch.Tensor]) -> int:
        """Write saved regions into `obj`'s units (one indexed copy per region); returns
        the bytes moved host-to-device."""
        regions = self.regions(obj)
        if len(regions) != len(data):
            raise ValueError(f"{len(data)} saved regions for an object of {len(regions)}")
        moved = 0
        device = self.arena.device
        for r, t in zip(regions, data, strict=True):
            view, first, n = self._view(r), r.units[0], len(r.units)
            if r.units == tuple(range(first, first + n)):  # consecutive units: a slice
                view.narrow(1, first, n).copy_(t, non_blocking=True)
            else:
                view.index_copy_(1, self._index(r), t.to(device, non_blocking=True))
            moved += t.numel()
        return moved

    def load_block(self, obj, data: list[torch.Tensor]) -> int:
        """Write a block's saved KV bytes into `obj`'s unit; returns bytes moved."""
        return self.write(obj, data)

    def load_checkpoint(self, obj, data: list[torch.Tensor]) -> int:
        """Write a checkpoint's saved SSM and conv bytes into `obj`; returns bytes moved."""
        return self.write(obj, data)


class ModelledCopier:
    """The copy port and copier of a simulated executor: objects' bytes from the memory
    organization and geometry, nothing moved. A save occupies the device-to-host direction
    of the link for bytes / bandwidth + latency after the link's previous save (one copy
    at a time, in order) and completes then (`done()` at the clock's time); a restore's
    transfer time is `seconds(bytes, transfers)` (the host-to-device direction)."""

    gpu = False

    def __init__(self, mem, geometry, bandwidth_Bps: float, latency_s: float,
                 clock: Callable[[], float]) -> None:
        if not bandwidth_Bps > 0 or latency_s < 0:
            raise ValueError(f"host link: bandwidth {bandwidth_Bps} B/s must be > 0 and "
                             f"latency {latency_s} s >= 0")
        # Storage-scope copies (serving_core/geometry.py): a Granite-4.0-H preset has 4 groups
        # of 1 attention and 9 Mamba2 layers, not 40 layers carrying both (Falcon-H1: 44 = 44).
        layers = geometry.scope_layers
        self.block_bytes = layers * mem.block_tokens * geometry.attention_bytes_per_token
        self.state_bytes = layers * (geometry.ssm_bytes + geometry.conv_bytes)
        self.bandwidth_Bps = float(bandwidth_Bps)
        self.latency_s = float(latency_s)
        self.clock = clock
        self._link_free = 0.0
        self._inflight: deque = deque()  # (ready_at, token), in completion order

    def seconds(self, nbytes: int, transfers: int = 1) -> float:
        """Transfer time of `nbytes` in `transfers` copies over the link."""
        return nbytes / self.bandwidth_Bps + transfers * self.latency_s if nbytes else 0.0

    def nbytes(self, obj) -> int:
        return self.state_bytes if obj.kind else self.block_bytes

    def read(self, obj) -> None:
        return None

    def poison(self, obj) -> int:
        return 0

    def load_block(self, obj, data) -> int:
        return self.block_bytes

    def load_checkpoint(self, obj, data) -> int:
        return self.state_bytes

    def submit(self, token, obj) -> None:
        start = max(self.clock(), self._link_free)
        self._link_free = start + self.seconds(self.nbytes(obj))
        self._inflight.append((self._link_free, token))

    def done(self) -> list:
        now, q, out = self.clock(), self._inflight, []
        while q and q[0][0] <= now:
            out.append((q.popleft()[1], None))
        return out

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def wait(self, timeout: float | None = None) -> bool:
        """Let every save in flight complete now (a device cache reset waits for them)."""
        self._inflight = deque((min(t, self.clock()), tok) for t, tok in self._inflight)
        return True


class ThreadCopier:
    """Runs copies off the engine thread: `submit(token, obj)` queues the read of one
    object; `done()` returns the (token, host data) of the reads that completed since the
    last call (on a GPU: whose side-stream copy has finished). The engine thread keeps the
    object's units from being reassigned until it has seen the read in `done()` (the state
    manager's copy hold). Injected slow copies (tests): the worker sleeps `delay_s` before
    each read, and waits for `gate` (a threading.Event) when one is given."""

    def __init__(self, copier: ArenaCopier, *, delay_s: float = 0.0,
                 gate: threading.Event | None = None) -> None:
        self.copier = copier
        self.delay_s = float(delay_s)
        self.gate = gate
        self.gpu = copier.arena.device.type == "cuda"
        self._stream = torch.cuda.Stream(copier.arena.device) if self.gpu else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: list = []
        self._lock = threading.Lock()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="state-copier", daemon=True)
        self._thread.start()

    def submit(self, token, obj) -> None:
        regions = self.copier.regions(obj)  # addressed now, on the engine thread
        event = None
        if self.gpu:  # the copy must see every write the compute stream issued so far
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._inflight += 1
        self._jobs.put((token, regions, event))

    def _run(self) -> None:
        copier = self.copier
        while True:
            job = self._jobs.get()
            if job is None:
                return
            token, regions, event = job
            if self.gate is not None:
                self.gate.wait()
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.gpu:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(event)
                    data = [to_host(copier._source(r), self._stream) for r in regions]
                    self._stream.synchronize()
            else:
                data = [copier._source(r).clone(memory_format=torch.contiguous_format)
                        for r in regions]
            with self._lock:
                self._done.append((token, data))
                self._inflight -= 1
                self._idle.notify_all()

    def done(self) -> list:
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted read completed (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
