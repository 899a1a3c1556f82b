"""Continuous-batching scheduler over a hybrid-state memory organization.

Per step: running requests first (decode = 1 token, else the next prefill
chunk) under a token budget; a request that cannot get its units shortens its
chunk to the last servable checkpoint boundary, else preempts from the tail of
the running list (latest admitted first); waiting requests are admitted FCFS
only in steps without preemption, under the cap, and only when available units
cover the admission gate plus headroom H. The scheduler talks to memory only
through the MemoryOrganization interface.

Rules (SchedulerConfig; SPEC section 5):
- admission `full_prompt`: the gate is the whole remaining prompt beyond the
  adopted prefix J (attention for [J, N), one composite per checkpoint boundary
  inside (J, N), the working composite); `first_chunk`: the first chunk only.
- checkpoint placement `step_end`: a checkpoint is published only where a step
  ends on an interval boundary; `every_boundary`: at each boundary a chunk crosses.
- align_chunks: a prefill chunk ends on the last checkpoint boundary (a multiple
  of C) within the budget, and the tail after the last boundary is a chunk of its
  own, so every full interval of a prompt is published at a step end.
Placement and alignment default per organization (ORG_SEMANTICS).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from serving_core.memory import NULL, SLAB_POLICIES, MemoryOrganization
from serving_core.memory.base import CHECKPOINT_RECENCIES
from serving_core.memory.pool import FREE_QUEUES
from serving_core.request import Request, Status

ADMISSION_GATES = ("full_prompt", "first_chunk")
CHECKPOINT_PLACEMENTS = ("step_end", "every_boundary")
# Per-organization defaults (placement, aligned chunks): the modified paths (S0/S1/S2,
# C = 512) publish at step ends with C-aligned chunks; the native path (D0, C = 1,792)
# publishes at every boundary a chunk crosses, with unaligned chunks.
ORG_SEMANTICS = {
    "S0": ("step_end", True),
    "S1": ("step_end", True),
    "S2": ("step_end", True),
    "D0": ("every_boundary", False),
}


@dataclass(frozen=True)
class SchedulerConfig:
    cap: int = 63
    max_num_batched_tokens: int = 2048
    headroom: float = 0.0  # f: admission keeps floor(f x units) free per pool
    retention_k: int | None = None  # S2+Retention threshold K (None: off)
    pinning_k: int | None = None  # preemption-time pin threshold (None: off)
    admission: str = "full_prompt"  # full_prompt | first_chunk
    checkpoint_placement: str | None = None  # step_end | every_boundary | None: org default
    align_chunks: bool | None = None  # None: org default
    slab_policy: str = "write_once"  # S2: write_once | refill | dense (memory.s2)
    free_queue: str = "free_first"  # free_first | single_queue (memory.pool)
    checkpoint_recency: str = "release"  # release | publication (memory.base)

    def memory_rules(self) -> dict[str, str]:
        """The allocator's rules (build_memory keyword arguments)."""
        return {"slab_policy": self.slab_policy, "free_queue": self.free_queue,
                "checkpoint_recency": self.checkpoint_recency}

    def __post_init__(self) -> None:
        choices = (
            ("admission", ADMISSION_GATES),
            ("checkpoint_placement", (*CHECKPOINT_PLACEMENTS, None)),
            ("slab_policy", SLAB_POLICIES),
            ("free_queue", FREE_QUEUES),
            ("checkpoint_recency", CHECKPOINT_RECENCIES),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                shown = ", ".join("null" if a is None else a for a in allowed)
                raise ValueError(
                    f"engine.{name}={getattr(self, name)!r}: allowed values are {shown}"
                )
        if self.align_chunks not in (True, False, None):
            raise ValueError(
                f"engine.align_chunks={self.align_chunks!r}: allowed values are true, false, null"
            )
        if self.cap < 1:
            raise ValueError(f"engine.cap={self.cap} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"engine.max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1"
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"engine.headroom={self.headroom} must lie in [0, 1)")
        for name in ("retention_k", "pinning_k"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 or null (off)")


@dataclass(slots=True)
class Scheduled:
    req: Request
    num_new: int
    context: int  # tokens already computed before this step


class Scheduler:
    def __init__(self, mem: MemoryOrganization, cfg: SchedulerConfig, recorder) -> None:
        self.mem = mem
        self.cfg = cfg
        self.rec = recorder
        self.trace = recorder.trace_enabled
        self.B = mem.block_tokens
        self.C = mem.checkpoint_interval
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.headroom = {p: math.floor(cfg.headroom * n) for p, n in mem.total_units().items()}
        placement, align = ORG_SEMANTICS.get(mem.org, ("every_boundary", False))
        self.step_end = (cfg.checkpoint_placement or placement) == "step_end"
        # Aligned chunks need a token budget that reaches a boundary (else nothing progresses).
        self.align = (
            bool(self.C)
            and cfg.max_num_batched_tokens >= self.C
            and (align if cfg.align_chunks is None else cfg.align_chunks)
        )
        self.full_prompt = cfg.admission == "full_prompt"
        self.step = 0
        self.now = 0.0
        self.num_preempted_step = 0
        self.num_admitted_step = 0
        self.num_finished_step = 0
        # cumulative counters (poller)
        self.preemptions_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefix_hit_tokens_total = 0
        self.prefix_hit_tokens_self = 0  # adopted on resume: a request's own prefix
        self.max_running = 0
        self.max_waiting = 0

    # ----- queue entry ------------------------------------------------------------------------
    def add_request(self, req: Request, now: float) -> None:
        self.waiting.append(req)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        if self.trace:
            self._trace_entry(req, now)

    def _trace_entry(self, req: Request, now: float) -> None:
        hit = self.mem.lookup(req.lookup_keys())
        self.rec.event("ENTER_WAITING", now, req.rid, req.episodes + 1, hit_m0=hit)

    # ----- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Scheduled]:
        self.step += 1
        self.now = now
        self.mem.cache.begin_step(self.step)
        self.num_preempted_step = self.num_admitted_step = 0
        budget = self.cfg.max_num_batched_tokens
        plan: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = req.num_tokens - req.num_computed
            if want > 1:  # decode (one token) needs no chunking
                want = self._chunk(req.num_computed, req.num_tokens, budget)
            if not want:
                i += 1  # an aligned chunk needs more budget than is left this step
                continue
            got = self._reserve(req, want)
            while not got:
                if self.running[-1] is req and self._drop_own_holds(req):
                    got = self._reserve(req, want)
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                if victim is req:
                    break
                got = self._reserve(req, want)
            if req.status != Status.RUNNING:
                break
            plan.append(Scheduled(req, got, req.num_computed))
            budget -= got
            i += 1
        # Admission only in a step without preemption (new work must not displace old),
        # unless nothing is left running (progress).
        if not self.num_preempted_step or not plan:
            while self.waiting and budget > 0 and len(self.running) < self.cfg.cap:
                item = self._try_admit(self.waiting[0], budget)
                if item is None:
                    break
                self.waiting.popleft()
                plan.append(item)
                budget -= item.num_new
        self.max_running = max(self.max_running, len(self.running))
        return plan

    # ----- chunks and reservations --------------------------------------------------------------
    def _chunk(self, start: int, total: int, budget: int) -> int:
        """Tokens of the next chunk from `start` of a sequence of `total` known tokens.

        Aligned chunks stop at the last checkpoint boundary within the budget, then the
        tail follows in its own chunk; 0 when the budget reaches neither a boundary nor
        the end."""
        end = min(total, start + budget)
        if self.align:
            aligned = end // self.C * self.C
            if aligned > start:
                end = aligned
            elif end < total:
                return 0
        return end - start

    def _boundaries(self, start: int, end: int) -> range:
        """Checkpoint indices j (boundary j C) published when [start, end) is computed."""
        C = self.C
        if not C or end <= start:
            return range(0)
        if self.step_end:
            return range(end // C, end // C + 1) if end % C == 0 else range(0)
        return range(start // C + 1, end // C + 1)

    def _chunk_demand(self, req: Request, start: int, n: int, working: int) -> dict[str, int]:
        blocks = math.ceil((start + n) / self.B) - len(req.attn)
        return self.mem.demand(blocks, len(self._boundaries(start, start + n)) + working)

    def _prompt_demand(self, req: Request, start: int, working: int) -> dict[str, int]:
        """full_prompt gate: attention for [start, N), one composite per checkpoint boundary
        strictly inside (start, N), and the working composite."""
        end = req.num_tokens
        blocks = math.ceil(end / self.B) - len(req.attn)
        boundaries = (end - 1) // self.C - start // self.C if self.C else 0
        return self.mem.demand(blocks, boundaries + working)

    def _allocate(self, req: Request, start: int, n: int, working: bool) -> None:
        mem = self.mem
        if working:
            req.working = mem.allocate_composite(req.rid)
        for _ in range(math.ceil((start + n) / self.B) - len(req.attn)):
            req.attn.append(mem.allocate_attention(req.rid))
        for _ in self._boundaries(start, start + n):
            req.dests.append(mem.allocate_composite(req.rid))

    def _drop_own_holds(self, req: Request) -> bool:
        """Progress: before a request would preempt itself, release what it holds beyond
        its execution (retained checkpoints) and, when it runs alone, waiting requests'
        pins. True if anything was released."""
        dropped = False
        for obj in req.retained:
            self.mem.release(obj, producer=True)
            dropped = True
        req.retained = []
        if len(self.running) == 1 and any(w.pin for w in self.waiting):
            self._release_waiting_pins()
            dropped = True
        return dropped

    def _reserve(self, req: Request, want: int) -> int:
        """Allocate units for `want` tokens of a running request; shorten to the last
        servable boundary if short; 0 means preemption is needed."""
        start = req.num_computed
        end = start + want
        if -(-end // self.B) <= len(req.attn):
            C = self.C  # fast path (most decode steps): no new block, no boundary
            if not C or (end % C if self.step_end else end // C == start // C):
                return want
        if self.mem.can_allocate(self._chunk_demand(req, start, want, 0)):
            self._allocate(req, start, want, False)
            return want
        grid = self.C or self.B
        for b in range(((start + want - 1) // grid) * grid, start, -grid):
            if self.mem.can_allocate(self._chunk_demand(req, start, b - start, 0)):
                self._allocate(req, start, b - start, False)
                return b - start
        if self.trace:
            self._trace_alloc_fail(req, self._chunk_demand(req, start, want, 0), {})
        return 0

    # ----- admission ----------------------------------------------------------------------------
    def _adoptable(self, req: Request, keys: list[int], jadopt: int) -> tuple[list, object]:
        mem = self.mem
        blocks = [mem.cached_attention(keys[i]) for i in range(jadopt // self.B)]
        ckpt = mem.cached_checkpoint(keys[jadopt // self.B - 1]) if jadopt and self.C else NULL
        return blocks, ckpt

    def _try_admit(self, req: Request, budget: int) -> Scheduled | None:
        mem = self.mem
        keys = req.lookup_keys()
        if req.memo_version == mem.cache.version and req.memo_hit is not None:
            hit = req.memo_hit  # a blocked head re-checks every step; the cache may not have moved
        else:
            hit = req.memo_hit = mem.lookup(keys)
            req.memo_version = mem.cache.version
        jadopt = hit.jadopt
        blocks, ckpt = self._adoptable(req, keys, jadopt)
        adopted = blocks + ([ckpt] if ckpt else [])
        n = self._chunk(jadopt, req.num_tokens, budget)
        if not n:
            return None  # an aligned first chunk needs more budget than is left this step
        saved_attn, req.attn = req.attn, blocks  # demand counts blocks beyond the adopted ones
        working = 1 if self.C else 0
        need = self._chunk_demand(req, jadopt, n, working)
        extra = mem.pinned_by_adoption(adopted)
        gate = need
        if self.running:
            if self.full_prompt:  # never below the first chunk's own need
                whole = self._prompt_demand(req, jadopt, working)
                gate = {p: max(units, whole[p]) for p, units in need.items()}
            for pool, h in self.headroom.items():
                extra[pool] += h
        elif not mem.can_allocate(need, extra):
            # Progress guarantee: an idle engine serves a shorter first chunk rather than stall.
            grid = self.C or self.B
            for b in range(((jadopt + n - 1) // grid) * grid, jadopt, -grid):
                if mem.can_allocate(self._chunk_demand(req, jadopt, b - jadopt, working), extra):
                    n = b - jadopt
                    need = gate = self._chunk_demand(req, jadopt, n, working)
                    break
        req.attn = saved_attn
        if not mem.can_allocate(gate, extra):
            if not self.running and any(w.pin for w in self.waiting):
                # Progress guarantee: with nothing running, pins must not block the head.
                self._release_waiting_pins()
                return self._try_admit(req, budget)
            if self.trace and not req.alloc_fail_logged:
                req.alloc_fail_logged = True
                self._trace_alloc_fail(req, gate, extra)
            if not self.running:
                raise RuntimeError(
                    f"request {req.rid} cannot be admitted into an idle engine: "
                    f"needs {need}, available {self._available()}; the budget is too small"
                )
            return None
        # Execution references on adopted units before any pin is dropped.
        for obj in adopted:
            mem.acquire(obj)
        if req.pin:
            mem.release(req.pin)
            req.pin = NULL
        req.attn = blocks
        req.adopted = ckpt
        req.num_computed = jadopt
        self._allocate(req, jadopt, n, bool(self.C))
        req.status = Status.RUNNING
        req.episodes += 1
        req.alloc_fail_logged = False
        req.prefill_target = req.num_tokens
        if req.episodes == 1:
            req.start_s = self.now
            req.adopted_first = jadopt
        else:
            req.adopted_resume += jadopt
            self.prefix_hit_tokens_self += jadopt
        if self.cfg.retention_k is not None or self.cfg.pinning_k is not None:
            mem.cache.record_demand(keys, self.B, self.C, req.rid)
        self.prefix_hit_tokens_total += jadopt
        self.running.append(req)
        self.num_admitted_step += 1
        if self.trace:
            m1 = mem.cache.lookup(keys, self.B, self.C, m1=True)
            kind = "RESUME" if req.episodes > 1 else "LOOKUP"
            self.rec.event(kind, self.now, req.rid, req.episodes, hit_m0=hit, hit_m1=m1)
            self.rec.event(
                "ADOPT", self.now, req.rid, req.episodes, hit_m0=hit, hit_m1=m1, boundary=jadopt
            )
        return Scheduled(req, n, jadopt)

    def _release_waiting_pins(self) -> None:
        for waiting in self.waiting:
            if waiting.pin:
                self.mem.release(waiting.pin)
                waiting.pin = NULL

    def _available(self) -> dict[str, int]:
        return {p: pool.num_available for p, pool in self.mem.pools.items()}

    def _trace_alloc_fail(self, req: Request, need: dict, extra: dict) -> None:
        for pool, units in need.items():
            want = units + extra.get(pool, 0)
            if want > self.mem.pools[pool].num_available:
                self.rec.event(
                    "ALLOC_FAIL",
                    self.now,
                    req.rid,
                    req.episodes,
                    need=want,
                    free=self.mem.pools[pool].num_available,
                    pool=pool,
                )

    # ----- release paths ------------------------------------------------------------------------
    def _release_all(self, req: Request) -> None:
        mem = self.mem
        # Reverse order: the deepest blocks enter the LRU first and are evicted first.
        for obj in reversed(req.attn):
            mem.release(obj)
        req.attn = []
        for obj in req.dests:
            mem.release(obj, producer=True)
        req.dests = []
        if req.working:
            mem.release(req.working, producer=True)
            req.working = NULL
        if req.adopted:
            mem.release(req.adopted)
            req.adopted = NULL
        for obj in req.retained:
            mem.release(obj, producer=True)
        req.retained = []

    def _maybe_pin(self, req: Request) -> None:
        """Preemption-time pin on the victim's rightmost cached checkpoint with enough demand."""
        k = self.cfg.pinning_k
        if k is None or not self.C or req.pin:
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

    def _preempt(self, req: Request) -> None:
        self._maybe_pin(req)  # pin before release so the checkpoint cannot be lost meanwhile
        self._release_all(req)
        req.num_computed = 0
        req.memo_hit = None  # its token count changed since the last lookup
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions_total += 1
        self.num_preempted_step += 1
        self.waiting.appendleft(req)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        if self.trace:
            self.rec.event("PREEMPT", self.now, req.rid, req.episodes)
            self._trace_entry(req, self.now)

    def _finish(self, req: Request, now: float) -> None:
        self._release_all(req)
        req.status = Status.FINISHED
        req.finish_s = now
        req.release_tokens()  # keep memory proportional to the live requests
        self.num_finished_step += 1
        self.running.remove(req)
        if self.trace:
            self.rec.event("FINISH", now, req.rid, req.episodes)

    def boundaries_crossed(self, plan: list[Scheduled]) -> int:
        """Checkpoint boundaries the planned chunks cross (each writes one extra composite)."""
        C = self.C
        if not C:
            return 0
        if self.step_end:
            return sum(1 for i in plan if not (i.context + i.num_new) % C)
        return sum((i.context + i.num_new) // C - i.context // C for i in plan)

    def plan_columns(self, plan: list[Scheduled]) -> dict[str, int]:
        """Steps-ledger columns describing the batch (what a step-time fit needs)."""
        num_decode = decode_ctx = pairs = 0
        for item in plan:
            n, c = item.num_new, item.context
            if n == 1:
                num_decode += 1
                decode_ctx += c
            else:
                pairs += n * c + n * (n + 1) // 2
        return {
            "num_decode_seqs": num_decode,
            "decode_context_tokens": decode_ctx,
            "prefill_attention_pairs": pairs,
            "checkpoint_writes": self.boundaries_crossed(plan),
        }

    # ----- after the executor ran the step ------------------------------------------------------
    def complete_step(self, plan: list[Scheduled], now: float) -> tuple[int, int, int]:
        """Publish what the step computed, sample tokens, finish requests.

        Returns (initial prefill, resume prefill, decode) token counts.
        """
        mem, B, C = self.mem, self.B, self.C
        retention_k = self.cfg.retention_k
        initial = resume = decode = 0
        self.num_finished_step = 0
        for item in plan:
            req, c0, n = item.req, item.context, item.num_new
            c1 = c0 + n
            target = req.prefill_target
            if c0 >= target:
                decode += n
            else:
                prefill = (c1 if c1 < target else target) - c0
                if req.episodes == 1:
                    initial += prefill
                else:
                    resume += prefill
                decode += n - prefill
            if c1 // B > c0 // B:  # iterate only when a block fills: decode steps mostly skip
                keys = req.ensure_keys(c1 // B)
                attn = req.attn
                for bi in range(c0 // B, c1 // B):
                    obj = attn[bi]
                    if not obj.cached:
                        mem.publish(obj, keys[bi], (bi + 1) * B)
                for j in self._boundaries(c0, c1):
                    self._cross_boundary(req, keys[j * C // B - 1], j * C, retention_k)
            req.num_computed = c1
            if req.adopted:
                mem.release(req.adopted)  # its state has been read
                req.adopted = NULL
            if c1 == req.num_prompt + req.num_generated:
                req.append_generated()
                self.generation_tokens_total += 1
                if req.num_generated == 1:
                    req.first_token_s = now
                if req.num_generated >= req.target_output:
                    self._finish(req, now)
        self.prompt_tokens_total += initial + resume
        return initial, resume, decode

    def _cross_boundary(
        self, req: Request, key: int, boundary: int, retention_k: int | None
    ) -> None:
        mem = self.mem
        dest = req.dests.pop(0)
        if mem.cached_checkpoint(key) is not None:
            # already cached: publishing is a no-op, the destination is freed
            mem.release(dest, producer=True)
            return
        produced = req.working
        mem.publish(produced, key, boundary)
        req.working = dest
        if retention_k is not None and mem.cache.num_requesters(key) >= retention_k:
            req.retained.append(produced)  # producer keeps its reference until finish/preempt
        else:
            mem.release(produced, producer=True)
