"""The hybrid-state manager: what a request holds of the organization's memory.

Between the scheduler (queue policy: who runs, in which order, how many tokens)
and the memory organization (pools, prefix cache, eviction) sits this manager,
on the model of a continuous-batching engine's KV-cache manager. It alone
allocates, adopts, publishes and releases a request's state objects: its
attention blocks, its working composite, the destinations reserved for the
checkpoint boundaries of a chunk, the checkpoint it adopted, the checkpoints it
retains (S2+Retention) and its preemption-time pin. The objects are recorded on
the request (`attn`, `working`, `dests`, `adopted`, `retained`, `pin`) as this
manager's record; only this manager changes them. It answers the scheduler with
demands (units per pool), small slotted results (`Adoption`) and token counts; the
scheduler reads only the organization's facts (block, interval, pool sizes, its class's
default rules), never changes its state itself and never reads these fields; it reads
one answer the manager leaves on the request, `room_end`, the position below which a
decode needs no new unit and publishes nothing (so most decodes skip `reserve`). An
executor that addresses state (the torch executor) gets a `ChunkState` per scheduled
chunk in the plan instead: the attention unit ids, the composites it reads and writes,
and after publication where each boundary's state went and where the chunk's final
state belongs (both filled here).

A state tier (serving_core.host_tier) sits beside this manager: with `log_publications`
on, the manager logs every entry it publishes (a checkpoint with the keys of its attention
chain; without recurrent state, each block with its chain) and every preempted request;
it starts the tier's saves of the logged entries (`start_saves`), holds the device
objects a save still reads (`hold_for_copy` / `end_copy_hold`: an execution reference,
so the allocator cannot reassign their units before the copy released them; the LRU
recency they had is given back), restores a held prefix from the tier into fresh units
(published, unreferenced: admission adopts it through the ordinary lookup) and resets the
device prefix cache; all copies go through the executor's copy port
(serving_core/executor/state_copy.py). The tier sees keys and tensors, never the
allocator, the arena or the scheduler's queues.

Release order (kept in one place, `release_all`; the organization's `release_order`,
serving_core.memory.base.RELEASE_ORDERS): attention blocks deepest first (so the
deepest enter the LRU first and are evicted first), then destinations, the working
composite, the adopted checkpoint and the retained ones; or the state first, then the
attention blocks deepest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving_core.memory import NULL, MemoryOrganization
from serving_core.memory.prefix_cache import PrefixHit
from serving_core.placement import Placement
from serving_core.request import Request
from serving_core.vllm_state_blocks import VllmStateBlocks

BLOCK, CHECKPOINT = "a", "c"  # kinds of the entries a state tier holds


@dataclass(slots=True)
class Adoption:
    """What a request could adopt at admission: the cached prefix of depth `jadopt`."""

    hit: PrefixHit
    keys: list[int]
    jadopt: int
    blocks: list  # cached attention blocks covering [0, jadopt)
    checkpoint: object  # the checkpoint at jadopt, or NULL
    pinned: dict[str, int]  # units adopting them would pull out of the LRU, per pool

    @property
    def objects(self) -> list:
        return self.blocks + ([self.checkpoint] if self.checkpoint else [])


@dataclass(slots=True)
class ChunkState:
    """The state one scheduled chunk [context, end) addresses, carried in the plan.

    blocks: attention unit ids of blocks 0 .. ceil(end / B) - 1 (the context and the
    chunk's own tokens); working: the composite the chunk computes into (NULL without
    recurrent state); adopted: the checkpoint read as the initial state (NULL: the
    working composite, or zeros at position 0); dests: composites reserved for the
    chunk's boundaries. Filled when the step completes: published, (boundary, composite
    published there) in order (a no-op publication is absent); final, the working
    composite the chunk's last state belongs in (NULL when the request finished).
    Composites are the organization's objects: the organization's mapping addresses
    their member pages."""

    blocks: list[int]
    working: object
    adopted: object
    dests: list
    published: list = field(default_factory=list)
    final: object = NULL


@dataclass(slots=True)
class RestoreResult:
    """What one restore from a tier put back: the restored prefix B (tokens), the new
    objects, the bytes copied host-to-device and the destination units poisoned first."""

    prefix_tokens: int
    blocks: list = field(default_factory=list)
    checkpoint: object = None
    bytes_h2d: int = 0
    poisoned_units: int = 0


def reads_no_cache(req: Request) -> bool:
    """A request whose prompt logprobs are computed from its own prefill reads no cached
    prefix until its first token (vLLM skips the prefix cache for prompt_logprobs too)."""
    params = req.sampling
    return (params is not None and params.prompt_logprobs is not None
            and req.num_generated == 0)


def boundaries_crossed(chunks, C: int, step_end: bool) -> int:
    """Composites the chunks (items with `context` and `num_new`) write at checkpoint
    boundaries of interval C (0: none): at a chunk's end only (step_end), or at every
    boundary it crosses."""
    if not C:
        return 0
    if step_end:
        return sum(1 for i in chunks if not (i.context + i.num_new) % C)
    return sum((i.context + i.num_new) // C - i.context // C for i in chunks)


class HybridStateManager:
    """State objects of the requests over one memory organization (see the module doc)."""

    def __init__(self, mem: MemoryOrganization, *, step_end: bool, retention_k: int | None,
                 pinning_k: int | None, placement: Placement | None = None,
                 vllm_blocks: bool = False, retention_blocks: int = 1) -> None:
        self.mem = mem
        # state_blocks=vllm_align (serving_core.state_blocks): vLLM's align-mode Mamba blocks
        self.vllm_blocks = vllm_blocks and bool(mem.checkpoint_interval)
        self.vllm = VllmStateBlocks(mem.checkpoint_interval, retention_blocks) if (
            self.vllm_blocks) else None
        if self.vllm_blocks:
            mem.queue_evicted_siblings()
        self.step_cached: set[int] = set()  # vllm_blocks: checkpoint keys cached this step
        self.B = mem.block_tokens
        self.C = mem.checkpoint_interval
        self.step_end = step_end
        # A placement other than step_end / every_boundary (serving_core/placement.py), or
        # a retention interval: boundaries are asked of it, per request (None: step_end).
        self.placement = placement
        self.retention_k = retention_k
        self.pinning_k = pinning_k  # preemption pins a checkpoint asked for by >= k requests
        # retention or pinning needs per-key demand counts
        self.track_demand = retention_k is not None or pinning_k is not None
        # engine.cache_policy=marconi: the checkpoint boundaries each running request may
        # publish (memory.cache_policy.CachePolicy.admitted_boundaries); None: every one.
        self.admitted: dict[int, frozenset[int]] | None = (
            None if mem.cache_policy is None else {})
        # Fault injection (tests, experiments/studies/continuation.py): when set,
        # adoption_hook(req, adoption) returns what admitting `req` adopts instead.
        self.adoption_hook = None
        # A state tier's logs (None: off, see log_publications): entries published as
        # (kind, key, chain keys), and requests preempted, since the tier last drained them.
        self.publications: list | None = None
        self.preempted: list | None = None

    # ----- geometry of a chunk ---------------------------------------------------------------
    def boundaries(self, start: int, end: int, req: Request | None = None):
        """Checkpoint indices j (boundary j C) published when [start, end) of `req` is
        computed."""
        C = self.C
        if not C or end <= start:
            return range(0)
        if self.placement is not None:
            return self.placement.boundaries(req, start, end)
        if self.step_end:
            return range(end // C, end // C + 1) if end % C == 0 else range(0)
        return range(start // C + 1, end // C + 1)

    def boundaries_crossed(self, chunks) -> int:
        """Composites the chunks (items with `context` and `num_new`) write at checkpoint
        boundaries. One pass over a whole step's plan (hot path: every step)."""
        if self.placement is not None and self.C:
            return sum(len(self.placement.boundaries(i.req, i.context, i.context + i.num_new))
                       for i in chunks)
        return boundaries_crossed(chunks, self.C, self.step_end)

    # ----- demand ------------------------------------------------------------------------------
    def chunk_demand(self, req: Request, start: int, n: int, working: int,
                     held_blocks: int | None = None) -> dict[str, int]:
        """Units for computing [start, start + n): new attention blocks beyond the
        `held_blocks` (default: what the request holds), one composite per boundary
        published, and `working` composites."""
        held = len(req.attn) if held_blocks is None else held_blocks
        blocks = math.ceil((start + n) / self.B) - held
        if self.vllm_blocks:
            return self.mem.demand(blocks, self.vllm.demand(req, start, start + n))
        return self.mem.demand(blocks, len(self.boundaries(start, start + n, req)) + working)

    def prompt_demand(self, req: Request, start: int, working: int, held_blocks: int,
                      reserve_output: int = 0, capped: bool = False) -> dict[str, int]:
        """full_prompt gate: attention for [start, N), one composite per checkpoint boundary
        strictly inside (start, N), and the working composite; `reserve_output` adds
        attention for that many output tokens (at most the request's remaining output);
        `capped` (capped_prompt) counts at most one composite for those boundaries."""
        end = req.num_tokens
        reserved = min(reserve_output, req.target_output - req.num_generated)
        blocks = math.ceil((end + max(reserved, 0)) / self.B) - held_blocks
        boundaries = (end - 1) // self.C - start // self.C if self.C else 0
        if self.placement is not None and boundaries:
            boundaries = self.placement.gate(req, start, end)
        if capped:
            boundaries = min(boundaries, 1)
        return self.mem.demand(blocks, boundaries + working)

    def can_allocate(self, need: dict[str, int], extra: dict[str, int] | None = None) -> bool:
        return self.mem.can_allocate(need, extra)

    def available(self) -> dict[str, int]:
        return {p: pool.num_available for p, pool in self.mem.pools.items()}

    # ----- lookup and adoption ------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.mem.cache.begin_step(step)
        if self.step_cached:
            self.step_cached.clear()

    def cached_this_step(self, req: Request, adoption: Adoption) -> bool:
        """state_blocks=vllm_align: whether the prefix `req` would adopt ends on a checkpoint
        cached in this step (vLLM caches at scheduling; its `MambaManager` refuses such a
        hit for the step, `cached_blocks_this_step`, which stops admission)."""
        if not self.step_cached:
            return False
        keys, cached = adoption.keys, self.step_cached
        return any(key in cached for key in keys[max(adoption.jadopt // self.B - 1, 0):])

    def peek(self, req: Request) -> PrefixHit:
        """The request's cached prefix now (no memo: a trace reading)."""
        return self.mem.lookup(req.lookup_keys())

    def lookup(self, req: Request) -> PrefixHit:
        """The request's cached prefix; a blocked head re-checks every step, so the answer is
        memoized until the cache changes."""
        mem = self.mem
        if req.memo_version == mem.cache.version and req.memo_hit is not None:
            return req.memo_hit
        req.memo_hit = mem.lookup(req.lookup_keys())
        req.memo_version = mem.cache.version
        return req.memo_hit

    def adoption(self, req: Request) -> Adoption:
        """What admitting `req` now would adopt (joint depth of attention and checkpoint)."""
        mem = self.mem
        keys = req.lookup_keys()
        hit = self.lookup(req)
        if reads_no_cache(req):
            hit = PrefixHit(0, 0, 0, 0)
        jadopt = hit.jadopt
        table = mem.cache.attention
        blocks = [table[key] for key in keys[: jadopt // self.B]]  # the hit says all are there
        ckpt = mem.cached_checkpoint(keys[jadopt // self.B - 1]) if jadopt and self.C else NULL
        adopted = blocks + ([ckpt] if ckpt else [])
        found = Adoption(hit, keys, jadopt, blocks, ckpt, mem.pinned_by_adoption(adopted))
        return found if self.adoption_hook is None else self.adoption_hook(req, found)

    def admit(self, req: Request, adoption: Adoption, n: int) -> None:
        """Adopt the cached prefix and allocate the first chunk [jadopt, jadopt + n) with a
        working composite. Execution references are taken on the adopted units before the
        request's own pin is dropped (the pin may be what keeps them)."""
        mem = self.mem
        for obj in adoption.objects:
            mem.acquire(obj)
            if obj.producer != req.rid:
                obj.shared = True  # another request's entry reused (private_blocks)
        if req.pin:
            mem.release(req.pin)
            req.pin = NULL
        req.attn = adoption.blocks
        req.adopted = adoption.checkpoint
        req.num_computed = adoption.jadopt
        if self.placement is not None:
            self.placement.admit(req)  # its positions are fixed before its first chunk's
        self._allocate(req, adoption.jadopt, n, bool(self.C))
        if self.admitted is not None:
            self.admitted[req.rid] = mem.cache_policy.admitted_boundaries(
                adoption.hit.attention, adoption.jadopt, req.num_tokens,
                req.num_prompt + req.target_output - 1, self.C)
        if self.track_demand:
            mem.cache.record_demand(adoption.keys, self.B, self.C, req.rid)

    def lookup_m1(self, keys: list[int]) -> PrefixHit:
        """The M1 reading of a lookup (trace only)."""
        return self.mem.cache.lookup(keys, self.B, self.C, m1=True)

    def chunk_state(self, req: Request, end: int) -> ChunkState:
        """What a chunk of `req` ending at `end` addresses (see ChunkState)."""
        return ChunkState([obj.units[0] for obj in req.attn[: -(-end // self.B)]],
                          req.working, req.adopted, list(req.dests))

    # ----- running requests --------------------------------------------------------------------
    def _allocate(self, req: Request, start: int, n: int, working: bool) -> None:
        mem = self.mem
        if self.vllm_blocks:
            self.vllm.allocate(mem, req, start, start + n)
            self.step_cached.update(self.vllm.cached_at_scheduling(req, start, start + n))
        elif working:
            req.working = mem.allocate_composite(req.rid)
        more = math.ceil((start + n) / self.B) - len(req.attn)
        if more > 0:
            req.attn.extend(mem.allocate_attention_blocks(req.rid, more))
        for _ in () if self.vllm_blocks else self.boundaries(start, start + n, req):
            req.dests.append(mem.allocate_composite(req.rid))
        # From start + n on, a decode at position p writes token p + 1: it stays within the
        # blocks held and publishes nothing while p + 1 is below the next multiple of C.
        room, C = len(req.attn) * self.B, self.C
        req.room_end = min(room, -(-(start + n + 1) // C) * C - 1) if C else room

    def reserve(self, req: Request, want: int, shorten: bool = True) -> int:
        """Allocate units for the next `want` tokens of a running request; shorten to the
        last servable boundary if short (unless `shorten` is false: vLLM's allocate_slots,
        all or nothing); 0 means the request cannot proceed (preemption)."""
        start = req.num_computed
        end = start + want
        if -(-end // self.B) <= len(req.attn):
            C = self.C  # fast path (most decode steps): no new block, no boundary
            if not C or (end % C if self.step_end and self.placement is None
                         else end // C == start // C):
                return want
        if self.mem.can_allocate(self.chunk_demand(req, start, want, 0)):
            self._allocate(req, start, want, False)
            return want
        if not shorten:
            return 0
        grid = self.C or self.B
        for b in range(((start + want - 1) // grid) * grid, start, -grid):
            if self.mem.can_allocate(self.chunk_demand(req, start, b - start, 0)):
                self._allocate(req, start, b - start, False)
                return b - start
        return 0

    def drop_retained(self, req: Request) -> bool:
        """Release the checkpoints `req` retains; True if it held any."""
        dropped = bool(req.retained)
        for obj in req.retained:
            self.mem.release(obj, producer=True)
        req.retained = []
        return dropped

    def any_pinned(self, requests) -> bool:
        """Whether any of `requests` holds a preemption-time pin."""
        return any(r.pin for r in requests)

    def release_pins(self, requests) -> None:
        """Release the pins of `requests`, in order (the order their units enter the LRU)."""
        for req in requests:
            if req.pin:
                self.mem.release(req.pin)
                req.pin = NULL

    def release_preempted(self, req: Request) -> None:
        """A preempted request: pin its rightmost checkpoint first when pinning is on (so
        it cannot be lost meanwhile), release everything, forget its lookup (its token
        count changed since)."""
        if self.pinning_k is not None:
            self.pin_rightmost(req, self.pinning_k)
        self.release_all(req)
        req.memo_hit = None
        if self.preempted is not None:
            self.preempted.append(req)

    def pin_rightmost(self, req: Request, k: int) -> None:
        """Preemption-time pin on the request's rightmost cached checkpoint when at least
        `k` requests have asked for it (before its release, so it cannot be lost meanwhile)."""
        if not self.C or req.pin:
            return
        keys = req.ensure_keys(req.num_computed // self.B)
        per = self.C // self.B
        for j in range(req.num_computed // self.C, 0, -1):
            key = keys[j * per - 1]
            obj = self.mem.cached_checkpoint(key)
            if obj is not None:
                if self.mem.cache.num_requesters(key) >= k:
                    self.mem.acquire(obj)
                    req.pin = obj
                return

    def release_all(self, req: Request, finishing: bool = False) -> None:
        """Everything a finishing or preempted request holds, in the release order."""
        if finishing and self.admitted is not None:  # Marconi's tuned weight logs it
            self.mem.cache_policy.observe(req, self.B, self.C, len(self.mem.cache.checkpoints))
        if finishing and self.placement is not None:
            self.placement.finish(req)
        if self.mem.attention_released_first:
            self._release_attention(req, finishing)
            self._release_state(req)
        else:
            self._release_state(req)
            self._release_attention(req, finishing)

    def _release_attention(self, req: Request, finishing: bool) -> None:
        self.mem.release_each(reversed(req.attn), finishing)
        req.attn = []
        req.room_end = 0

    def release_lagging(self, req: Request) -> None:
        """state_blocks=vllm_align: the state blocks a request kept past their step (its
        previous running state, its prefill checkpoint, its adopted checkpoint) return at
        its next allocation (vLLM's `MambaManager.remove_skipped_blocks`), newest first,
        group by group."""
        self.mem.release_by_group(list(reversed(req.lagging)))
        req.lagging = []

    def _release_vllm_state(self, req: Request) -> None:
        """state_blocks=vllm_align: the Mamba blocks in vLLM's order, the highest block index
        first (`pop_blocks_for_free`: the running state, the checkpoint, the earlier states,
        the prefix hit), one KV cache group after another (`KVCacheCoordinator.free`)."""
        objs = [o for o in (req.working, *reversed(req.dests), *reversed(req.lagging),
                            req.adopted) if o]
        self.mem.release_by_group(objs)
        req.working, req.dests, req.lagging, req.adopted = NULL, [], [], NULL

    def _release_state(self, req: Request) -> None:
        mem = self.mem
        if self.vllm_blocks:
            self._release_vllm_state(req)
        for obj in req.dests:
            mem.release(obj, producer=True)
        req.dests = []
        if req.working:
            mem.release(req.working, producer=True)
            req.working = NULL
        if req.adopted:
            mem.release(req.adopted)
            req.adopted = NULL
        self.drop_retained(req)
        if self.admitted is not None:
            self.admitted.pop(req.rid, None)

    # ----- after a step -------------------------------------------------------------------------
    def complete_chunk(self, req: Request, c0: int, c1: int,
                       view: ChunkState | None = None) -> None:
        """Publish what computing [c0, c1) produced: every attention block it filled and the
        checkpoints at its boundaries (recorded in `view`, when given, for the executor);
        the adopted checkpoint has been read and is released. A chunk that neither fills a
        block nor starts an episode has nothing here (the scheduler skips the call)."""
        B = self.B
        if c1 // B > c0 // B:  # iterate only when a block fills: decode steps mostly skip
            mem, C = self.mem, self.C
            keys = req.ensure_keys(c1 // B)
            attn = req.attn
            log = self.publications
            for bi in range(c0 // B, c1 // B):
                obj = attn[bi]
                if not obj.cached:
                    if mem.publish(obj, keys[bi], (bi + 1) * B) and log is not None and not C:
                        log.append((BLOCK, keys[bi], keys[: bi + 1]))
            for j in self._published(req, c0, c1):
                published = (self._publish_vllm(req, keys[j * C // B - 1], j * C, j * C < c1)
                             if self.vllm_blocks else
                             self._cross_boundary(req, keys[j * C // B - 1], j * C))
                if published and log is not None:
                    log.append((CHECKPOINT, keys[j * C // B - 1], keys[: j * C // B]))
                if view is not None and published:
                    view.published.append((j * C, published))
        if req.adopted:
            if self.vllm_blocks:  # vLLM frees the hit block (the lowest index) next time
                req.lagging.insert(0, req.adopted)
            else:
                self.mem.release(req.adopted)
            req.adopted = NULL

    def _published(self, req: Request, c0: int, c1: int):
        """Checkpoint indices [c0, c1) publishes: every boundary it crosses (placement), or
        under state_blocks=vllm_align its prefill checkpoint and its end on a boundary."""
        if not self.vllm_blocks:
            return self.boundaries(c0, c1, req)
        return [b // self.C for b in self.vllm.published(req, c0, c1)]

    def record_final_states(self, plan) -> None:
        """After a step completed: each chunk view's `final`, the working composite the
        chunk's last state belongs in (NULL once its request finished and released it)."""
        for item in plan:
            item.state.final = item.req.working

    def _cross_boundary(self, req: Request, key: int, boundary: int):
        """Publish the working composite at `boundary` and continue in the next destination;
        returns the composite published (NULL for a no-op publication)."""
        mem = self.mem
        dest = req.dests.pop(0)
        if (not mem.cache_duplicates and mem.cached_checkpoint(key) is not None) or (
                self.admitted is not None and boundary not in self.admitted.get(req.rid, ())):
            # already cached (or not admitted by the cache policy): publishing is a no-op,
            # the destination is freed
            mem.release(dest, producer=True)
            return NULL
        produced = req.working
        mem.publish(produced, key, boundary)
        req.working = dest
        k = self.retention_k
        if k is not None and mem.cache.num_requesters(key) >= k:
            req.retained.append(produced)  # producer keeps its reference until finish/preempt
        else:
            mem.release(produced, producer=True)
        return produced

    def _publish_vllm(self, req: Request, key: int, boundary: int, inside: bool):
        """state_blocks=vllm_align: the prefill checkpoint's block (`inside` the chunk) is
        published and kept until the next allocation; a chunk ending on `boundary`
        publishes its running state in place. Returns the composite published (NULL for a
        no-op publication: an entry exists)."""
        mem = self.mem
        obj = req.dests.pop(0) if inside else req.working
        if inside:
            req.lagging.append(obj)
        if not self.vllm.retained(req, boundary) or (
                mem.cached_checkpoint(key) is not None and not mem.cache_duplicates):
            return NULL
        mem.publish(obj, key, boundary)
        return obj

    # ----- a state tier ----------------------------------------------------------------------
    @property
    def cache_version(self) -> int:
        """Changes whenever the device prefix cache does (a tier saves only then)."""
        return self.mem.cache.version

    def log_publications(self) -> None:
        """Start logging publications and preemptions for a state tier (idempotent)."""
        if self.publications is None:
            self.publications, self.preempted = [], []

    def drain_preempted(self) -> list[Request]:
        """The requests preempted since the last call (a tier restores them on resume)."""
        out = self.preempted
        if not out:
            return []
        self.preempted = []
        return out

    def hold_for_copy(self, obj):
        """Keep `obj`'s units from being reassigned while a copy reads them (an execution
        reference). Returns the token `end_copy_hold` needs: the LRU stamps the units had
        when the object sat unreferenced in the LRU (None otherwise)."""
        pool = self.mem.pools[obj.pool]
        stamps = [pool.evictable.get(u) for u in obj.units] if not obj.ref_count else None
        self.mem.acquire(obj)
        return stamps

    def end_copy_hold(self, obj, stamps) -> None:
        """Drop a copy's hold; an object that goes back to the LRU gets the recency it had
        before the hold (a copy is not a use), so a tier does not reorder device eviction."""
        self.mem.release(obj)
        if stamps is not None and obj.cached and not obj.ref_count:
            pool = self.mem.pools[obj.pool]
            for unit, stamp in zip(obj.units, stamps, strict=True):
                if stamp is not None:
                    pool.add_evictable(unit, stamp)

    def start_saves(self, tier, copier, submit=None) -> int:
        """Start saving to `tier` every entry published since the last call (the log): a
        checkpoint with the blocks of its chain the tier lacks (an entry is whole or absent;
        one whose chain left the device is skipped), or a block with its chain without
        recurrent state. `submit(kind, key, obj)`: hand one part's copy to a copier that
        works off this thread (the caller holds the object, see hold_for_copy); None: copy
        now through `copier` (serving_core/executor/state_copy.py). Returns the parts
        started."""
        log = self.publications
        if not log:
            return 0
        self.publications = []
        mem, started = self.mem, 0
        for kind, key, chain in log:
            if tier.holds_entry(key):
                tier.touch(key)
                continue
            ckpt = mem.cached_checkpoint(key) if kind == CHECKPOINT else None
            blocks = [(k, mem.cached_attention(k)) for k in chain if not tier.holds(BLOCK, k)]
            if (kind == CHECKPOINT and ckpt is None) or any(o is None for _, o in blocks):
                tier.skipped_saves += 1  # part of the entry already left the device
                continue
            parts = [(BLOCK, k, o) for k, o in blocks]
            if ckpt is not None:
                parts.append((CHECKPOINT, key, ckpt))
            if not tier.begin_entry(key, chain, [(p, k, copier.nbytes(o)) for p, k, o in parts]):
                continue  # rejected: it does not fit the tier's capacity
            for part, k, obj in parts:
                if submit is None:
                    tier.save(part, k, copier.read(obj))
                else:
                    submit(part, k, obj)
                started += 1
        return started

    def save_published(self, tier, copier) -> int:
        """Start saving every entry published since the last call, copying now (see
        start_saves); logging is switched on at the first call."""
        self.log_publications()
        return self.start_saves(tier, copier)

    def restore_prefix(self, keys: list[int], tier, copier) -> RestoreResult:
        """Reload the deepest prefix of `keys` that `tier` holds completely into freshly
        allocated units (written through `copier`, poisoned first when the tier's audit
        asks) and publish it as cached entries (unreferenced, evictable), so admission
        adopts it through the ordinary lookup. Entries the device still holds are kept
        (held during the restore so its allocations cannot evict them) and not copied
        again. MemoryError when the device has no room for the rest."""
        bt, interval = self.B, self.C
        depth = tier.restorable_prefix(keys, bt, interval)
        result = RestoreResult(depth)
        if not depth:
            return result
        nblocks = depth // bt
        tier.pin(keys[nblocks - 1])  # the entry cannot be evicted while this reads it
        try:
            self._restore_into(keys, depth, tier, copier, result)
        finally:
            tier.unpin(keys[nblocks - 1])
        tier.record_restore(result)
        return result

    def _restore_into(self, keys: list[int], depth: int, tier, copier,
                      result: RestoreResult) -> None:
        mem, bt, interval = self.mem, self.B, self.C
        nblocks = depth // bt
        held = [mem.cached_attention(keys[i]) for i in range(nblocks)]
        ckpt_key = keys[nblocks - 1]
        held_ckpt = mem.cached_checkpoint(ckpt_key) if interval else None
        kept = [o for o in (*held, held_ckpt) if o is not None]
        need = mem.demand(sum(o is None for o in held),
                          1 if interval and held_ckpt is None else 0)
        for obj in kept:
            mem.acquire(obj)
        try:
            if not mem.can_allocate(need):
                raise MemoryError(f"restoring {depth} tokens needs {need} units; the device "
                                  f"has {self.available()}")
            for i in range(nblocks):
                if held[i] is not None:
                    continue
                obj = mem.allocate_attention(-1)
                if tier.poison:
                    result.poisoned_units += copier.poison(obj)
                result.bytes_h2d += copier.load_block(obj, tier.entry(BLOCK, keys[i]))
                if not mem.publish(obj, keys[i], (i + 1) * bt):
                    raise RuntimeError(f"block {i} of the restored prefix is already cached")
                result.blocks.append(obj)  # held until the whole prefix is in place
            if interval and held_ckpt is None:
                obj = mem.allocate_composite(-1)
                if tier.poison:
                    result.poisoned_units += copier.poison(obj)
                result.bytes_h2d += copier.load_checkpoint(obj,
                                                        tier.entry(CHECKPOINT, ckpt_key))
                if not mem.publish(obj, ckpt_key, depth):
                    raise RuntimeError(f"the checkpoint at {depth} is already cached")
                result.checkpoint = obj
        finally:
            # Restored objects are released (cached, evictable: the scheduler's lookup adopts
            # them) only now: released one by one, a later allocation of the same restore
            # could evict an earlier one (an organization that evicts its own cached pages
            # before free ones, or a single free queue), leaving the prefix half there.
            restored = (*result.blocks, *(() if result.checkpoint is None
                                          else (result.checkpoint,)))
            for obj in (*kept, *restored):
                mem.release(obj)

    def reset_prefix_cache(self) -> dict[str, int]:
        """Drop the device prefix cache: every cached, unreferenced entry is evicted through
        the allocator's own eviction path and its units freed. Returns the entries dropped
        and the cached units freed; RuntimeError when a cached entry is still referenced
        (a request holds it: the caller must wait until nothing runs)."""
        mem = self.mem
        cached = (*mem.cache.attention.values(), *mem.cache.checkpoints.values())
        busy = [o for o in cached if o.ref_count]
        if busy:
            raise RuntimeError(f"{len(busy)} cached entries are referenced by requests")
        entries = len(cached)
        freed = mem.drop_cached()
        return {"entries": entries - len(mem.cache.attention) - len(mem.cache.checkpoints),
                "units": freed}
