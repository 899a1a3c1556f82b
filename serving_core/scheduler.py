"""Continuous-batching scheduler over a hybrid-state memory organization.

Per step: running requests first (decode = 1 token, else the next prefill
chunk) under a token budget; a request that cannot get its units shortens its
chunk to the last servable checkpoint boundary, else preempts from the tail of
the running list (latest admitted first); waiting requests are admitted FCFS
only in steps without preemption, under the cap, and only when available units
cover the admission gate plus headroom H. The scheduler keeps queue policy only:
every allocation, adoption, publication and release of a request's state goes
through the HybridStateManager (serving_core.state_manager).

Rules (SchedulerConfig, each one declaration; docs/engine_rules.md sections 5-12):
- admission `full_prompt`: the gate is the whole remaining prompt beyond the
  adopted prefix J (attention for [J, N), one composite per checkpoint boundary
  inside (J, N), the working composite); `first_chunk`: the first chunk only;
  `reserve_output`: full_prompt's gate with attention for [J, N + r) instead, r the
  guaranteed output tokens (`reserve_output_tokens`, at most the request's remaining
  output), so an admitted request can decode r tokens without taking pages from others
  (a check at admission, not a hold; r = 0 is full_prompt); `capped_prompt`: full_prompt's
  gate with at most one composite for the boundaries inside (J, N) (vLLM 0.32's
  `MambaManager.get_num_blocks_to_allocate(apply_admission_cap=True)`: the running-state
  block and one prefill-checkpoint block), so running requests can run out later and be
  preempted.
- checkpoint placement `step_end`: a checkpoint is published only where a step
  ends on an interval boundary; `every_boundary`: at each boundary a chunk crosses; `align`,
  `all`, `junction`, `periodic:N`, `optimal` and the retention interval: the Placement of
  serving_core/placement.py, asked per request by the state manager.
- interleave (off by default) `{decode_steps: k, prefill_tokens: m}`: while a running
  request decodes, k steps carry decodes only, then one step carries the decodes plus at
  most m prefill tokens (running chunks and admissions together); with no decoder, chunks
  of up to the token budget as without it.
- align_chunks: a prefill chunk ends on the last checkpoint boundary (a multiple
  of C) within the budget, and the tail after the last boundary is a chunk of its
  own, so every full interval of a prompt is published at a step end.
- cross_final_chunk (off by default): with aligned chunks, the chunk that reaches the
  end of the known tokens may cross boundaries (vLLM's align-mode split: the Mamba2
  layer saves the last boundary's state inside that chunk); off, it ends on one too.
- stop_at_junction (off by default): where the cached attention prefix found at admission
  reaches beyond the adopted checkpoint, a prefill chunk ends at its end, so the state
  there is published (vLLM's `shared_prefix_boundary`, the junction its
  `_mamba_block_aligned_split` stops at).
- whole_chunks (off by default): a running request short of units for its chunk is
  preempted (vLLM's `allocate_slots`, all or nothing); off, it first shortens its chunk
  to the last servable boundary.
- state_blocks (`per_boundary` by default): `vllm_align` keeps vLLM's align-mode Mamba block
  lifecycle (`MambaManager`): a chunk publishes the state where it ends on a boundary in its running
  state and, when it reaches the prefill end, one prefill checkpoint at the last boundary
  inside it; a running state is new only in a new block, and the previous one, the
  checkpoint and the adopted one stay held until the request's next allocation;
  `retention_blocks` k keeps a checkpoint every k blocks (0: only the prompt's last boundary
  and the shared-prefix junction, vLLM's default retention).
- split_last_boundary (off by default): with aligned chunks, a prefill chunk that
  would end exactly at the end of a prompt of k C tokens ends at (k-1) C instead, so
  the state at N - C is published (p = C floor((N-1)/C) for a later identical
  prompt; vLLM runs such a prompt as one chunk and publishes only the state at N).
Placement and alignment default per organization: the organization's class says
(`checkpoint_placement`, `align_chunks` on serving_core.memory's classes).
The resolved rules are attributes (`full_prompt`, `step_end`, `align`, `cap`, ...)
that `Engine.effective_rules()` reads back for a run's record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from serving_core.memory import MemoryOrganization
from serving_core.placement import (
    PLACEMENT_SHOWN,
    RETENTION_SHOWN,
    Placement,
    is_placement,
    is_retention,
    parse_placement,
    retention_blocks,
)
from serving_core.planner import headroom_units
from serving_core.records import format_key
from serving_core.request import Request, Status
from serving_core.rules import check_rules, is_integer, is_number, optional_integer, rule
from serving_core.state_manager import ChunkState, HybridStateManager

ADMISSION_GATES = ("full_prompt", "first_chunk", "reserve_output", "capped_prompt")
CHECKPOINT_PLACEMENTS = ("step_end", "every_boundary")
STATE_BLOCKS = ("per_boundary", "vllm_align")


def _placement(value, ctx):
    """The organization's placement where none is asked; None without checkpoints."""
    return (value or ctx.org_class.checkpoint_placement) if ctx.layout.checkpoint_interval \
        else None


def _aligned(ctx) -> bool:
    """Whether chunks are asked to align: the organization's default aligns only where the
    token budget reaches a boundary (else nothing would progress); an explicit true must
    be honoured (the engine refuses it where it cannot)."""
    interval, rules = ctx.layout.checkpoint_interval, ctx.rules
    default = ctx.org_class.align_chunks and rules.max_num_batched_tokens >= interval
    return bool(interval) and bool(default if rules.align_chunks is None else rules.align_chunks)


def _admission(sched) -> str:
    if not sched.full_prompt:
        return "first_chunk"
    if sched.capped_prompt:
        return "capped_prompt"
    return "reserve_output" if sched.reserve_output else "full_prompt"


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's engine rules (queue, admission, chunking): one declaration each
    (serving_core/rules.py); the allocator's are memory.rules.AllocatorRules."""

    cap: int = rule(63, "most requests running at once (max_num_seqs)",
                    check=lambda v: is_integer(v, 1), shown="integers >= 1",
                    identity_neutral=False)
    max_num_batched_tokens: int = rule(
        2048, "token budget of one step (config null: the executor profile's)",
        check=lambda v: is_integer(v, 1), shown="integers >= 1", identity_neutral=False,
        config_null=True)
    headroom: float = rule(
        0.0, "f: admission keeps floor(f x units) free per pool",
        check=lambda v: is_number(v) and 0.0 <= v < 1.0, shown="numbers in [0, 1)",
        normalize=float, identity_neutral=False,
        effective=lambda sched: sched.headroom_fraction)
    retention_k: int | None = rule(
        None, "S2+Retention demand threshold K (set by the arm and retention.k; null: off)",
        check=optional_integer(1), shown="integers >= 1 or null (off)", config=False,
        identity_neutral=False)
    pinning_k: int | None = rule(
        None, "preemption-time pin threshold K (null: off)",
        check=optional_integer(1), shown="integers >= 1 or null (off)",
        identity_neutral=False)
    admission: str = rule(
        "full_prompt", "admission gate: whole remaining prompt, first chunk, prompt plus "
        "reserved output, or prompt with one boundary composite (vLLM's capped check)",
        allowed=ADMISSION_GATES, identity_neutral=False,
        effective=_admission)
    reserve_output_tokens: int = rule(
        0, "reserve_output: output tokens guaranteed at admission",
        check=lambda v: is_integer(v, 0), shown="integers >= 0")
    checkpoint_placement: str | None = rule(
        None, "where checkpoints are published (null: the organization's default; "
        "serving_core/placement.py)", check=lambda v: v is None or is_placement(v),
        shown=PLACEMENT_SHOWN, identity_neutral=False, requested=_placement,
        effective=lambda sched: sched.placement.name if sched.C else None)
    retention_interval: str | None = rule(
        None, "<k>block: checkpoints kept only at multiples of k checkpoint intervals and "
        "the prompt's last boundary (vLLM's prefix_cache_retention_interval); null: all",
        check=is_retention, shown=RETENTION_SHOWN,
        requested=lambda value, ctx: value if ctx.layout.checkpoint_interval else None)
    align_chunks: bool | None = rule(
        None, "prefill chunks end on checkpoint boundaries (null: the organization's default)",
        allowed=(True, False, None), identity_neutral=False,
        requested=lambda value, ctx: _aligned(ctx), effective=lambda sched: bool(sched.align))
    cross_final_chunk: bool = rule(
        False, "aligned: the chunk that reaches the end of the known tokens may cross "
        "boundaries (vLLM's align-mode split: only non-final chunks end on one)",
        allowed=(True, False), requested=lambda value, ctx: _aligned(ctx) and value,
        effective=lambda sched: sched.align and sched.cross_final_chunk)
    stop_at_junction: bool = rule(
        False, "a prefill chunk stops where the cached attention prefix found at admission "
        "ends beyond the adopted checkpoint (vLLM's shared-prefix junction)",
        allowed=(True, False))
    whole_chunks: bool = rule(
        False, "a running request short of units for its chunk is preempted (vLLM's "
        "allocate_slots, all or nothing; false: it shortens the chunk to a boundary first)",
        allowed=(True, False))
    state_blocks: str = rule(
        "per_boundary", "the recurrent state's blocks: per_boundary (a destination per "
        "boundary crossed, the "
        "working composite published and replaced) or vllm_align (vLLM's align-mode Mamba "
        "manager: state at chunk ends and one prefill checkpoint, released a step later)",
        allowed=STATE_BLOCKS,
        effective=lambda sched: "vllm_align" if sched.state.vllm_blocks else "per_boundary")
    retention_blocks: int = rule(
        1, "state_blocks=vllm_align: a checkpoint is kept every k blocks (vLLM's "
        "prefix_cache_retention_interval in blocks); 0: only the prompt's last boundary and "
        "the shared-prefix junction (vLLM's default)",
        check=lambda v: is_integer(v, 0), shown="integers >= 0",
        effective=lambda sched: sched.state.vllm.retention if sched.state.vllm else 1)
    split_last_boundary: bool = rule(
        False, "aligned: a chunk ending at N = k C ends at N - C", allowed=(True, False),
        requested=lambda value, ctx: _aligned(ctx) and value)
    # Bounded prefill interleave {decode_steps: k, prefill_tokens: m} (None: off): while any
    # running request decodes, k steps carry decodes only, then one step carries the decodes
    # plus at most m prefill tokens (running chunks and admissions together), and so on.
    interleave: Mapping[str, int] | None = rule(
        None, "null, or {decode_steps: k, prefill_tokens: m}: k decode-only steps, then at "
        "most m prefill tokens", check=lambda v: v is None or isinstance(v, Mapping),
        shown="values are null or {decode_steps: k, prefill_tokens: m} (integers >= 1)",
        normalize=lambda v: None if v is None else _interleave(v),
        effective=lambda sched: None if sched.interleave is None else dict(sched.interleave))

    def __post_init__(self) -> None:
        check_rules(self)
        if self.retention_blocks != 1 and self.state_blocks != "vllm_align":
            raise ValueError(f"engine.retention_blocks={self.retention_blocks}: applies only "
                             "with engine.state_blocks=vllm_align (allowed value here: 1)")
        r = self.reserve_output_tokens
        if r and self.admission != "reserve_output":
            raise ValueError(
                f"engine.reserve_output_tokens={r}: applies only with "
                "engine.admission=reserve_output (allowed value here: 0)"
            )


def _build_placement(mem: MemoryOrganization, cfg: SchedulerConfig) -> Placement:
    """The engine's placement: the asked one or the organization's; `optimal`'s M from the
    budget is the composites the composite pool holds (the pool the organization's layout
    puts recurrent state in, never its attention pool) less a full batch's working ones."""
    name, param = parse_placement(cfg.checkpoint_placement or type(mem).checkpoint_placement)
    per = mem.demand(0, 1)[mem.composite_pool] if mem.checkpoint_interval else 0
    held = mem.total_units()[mem.composite_pool] // per if per else 0
    return Placement(name, mem.checkpoint_interval, retention_blocks(cfg.retention_interval),
                     param, budget_checkpoints=max(1, held - cfg.cap), block=mem.block_tokens)


INTERLEAVE_KEYS = ("decode_steps", "prefill_tokens")


def _interleave(value) -> dict[str, int]:
    """engine.interleave as a plain {decode_steps, prefill_tokens} of integers >= 1."""
    if not isinstance(value, Mapping) or sorted(value) != sorted(INTERLEAVE_KEYS):
        raise ValueError(f"engine.interleave={value!r}: allowed values are null or "
                         "{decode_steps: k, prefill_tokens: m} (integers >= 1)")
    out = {}
    for key in INTERLEAVE_KEYS:
        v = value[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"engine.interleave.{key}={v!r}: allowed values are integers >= 1")
        out[key] = int(v)
    return out


def final_chunk_end(start: int, total: int, prefill_end: int, C: int) -> int:
    """End of the chunk from `start` that reaches `total` known tokens under vLLM's split
    (`_mamba_block_aligned_split`, C-token blocks): it crosses its boundaries where the
    Mamba2 layer saves the prefill checkpoint inside it (`is_mamba_prefill_checkpoint_valid`:
    the chunk starts on a boundary and the last boundary below `prefill_end`, the prompt's
    end or the known tokens less one on a resume, lies a block or more past the start);
    otherwise it stops at the next boundary (a start inside a block) or the last boundary
    below `total` (`last_cache_position`): a resumed request whose known tokens less one end
    on a boundary computes that boundary's state in a chunk of its own."""
    checkpoint = (prefill_end - 1) // C * C
    if not start % C and start + C <= checkpoint < total:
        return total
    stops = ((start // C + 1) * C if start % C else 0, (total - 1) // C * C)
    return min((s for s in stops if start < s < total), default=total)


@dataclass(slots=True)
class Scheduled:
    req: Request
    num_new: int
    context: int  # tokens already computed before this step
    state: ChunkState | None = None  # what the chunk addresses (executors that read state)
    admitted: bool = False  # the first chunk of an episode (it may read an adopted checkpoint)

    @property
    def samples(self) -> bool:
        """This step's forward completes the request's known tokens, so it samples one."""
        return self.context + self.num_new == self.req.num_tokens


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
        if cfg.retention_k is not None and not mem.supports_retention:
            raise ValueError(f"retention_k={cfg.retention_k}: checkpoint retention applies to "
                             f"S2 (arm s2_retention), not {mem.org}")
        self.cap = cfg.cap
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.retention_k = cfg.retention_k
        self.pinning_k = cfg.pinning_k
        self.headroom_fraction = cfg.headroom
        self.headroom = {p: headroom_units(n, cfg.headroom) for p, n in mem.total_units().items()}
        org = type(mem)
        self.placement = _build_placement(mem, cfg)
        self.step_end = self.placement.policy == "step_end"
        self.retention_interval = cfg.retention_interval if self.C else None
        # Aligned chunks need a token budget that reaches a boundary (else nothing progresses).
        self.align = (
            bool(self.C)
            and cfg.max_num_batched_tokens >= self.C
            and (org.align_chunks if cfg.align_chunks is None else cfg.align_chunks)
        )
        # Only aligned chunks end on boundaries by rule; elsewhere the split has no effect.
        self.split_last_boundary = self.align and bool(cfg.split_last_boundary)
        self.cross_final_chunk = bool(cfg.cross_final_chunk)
        self.whole_chunks = bool(cfg.whole_chunks)
        self.stop_at_junction = bool(cfg.stop_at_junction)
        self.full_prompt = cfg.admission in ("full_prompt", "reserve_output", "capped_prompt")
        self.capped_prompt = cfg.admission == "capped_prompt"
        self.reserve_output = cfg.admission == "reserve_output"
        self.reserve_output_tokens = cfg.reserve_output_tokens
        self.interleave = cfg.interleave  # None, or {decode_steps, prefill_tokens}
        self.decode_only_steps = 0  # interleave: decode-only steps since prefill was allowed
        if self.interleave and self.align and self.interleave["prefill_tokens"] < self.C:
            raise ValueError(
                f"engine.interleave.prefill_tokens={self.interleave['prefill_tokens']}: below "
                f"{mem.org}'s checkpoint interval {self.C} with aligned chunks no prefill "
                "could progress while requests decode; allowed: prefill_tokens >= "
                f"{self.C}, or engine.align_chunks=false")
        legacy = self.placement.name in CHECKPOINT_PLACEMENTS and not self.retention_interval
        self.state = HybridStateManager(mem, step_end=self.step_end,
                                        retention_k=cfg.retention_k, pinning_k=cfg.pinning_k,
                                        placement=None if legacy or not self.C
                                        else self.placement,
                                        vllm_blocks=cfg.state_blocks == "vllm_align",
                                        retention_blocks=cfg.retention_blocks)
        self.state_views = False  # attach a ChunkState to each planned chunk (Engine sets it)
        # memoize a blocked head's failed admission (_try_admit) where that is exact
        self.memo_blocked = mem.stable_demand
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
        hit = self.state.peek(req)
        self.rec.event("ENTER_WAITING", now, req.rid, req.episodes + 1, hit_m0=hit)
        if self.rec.lineage is not None:
            self.rec.lineage.entered(req.rid, req.episodes + 1, req.lookup_keys(), hit)

    # ----- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Scheduled]:
        self.step += 1
        self.now = now
        self.state.begin_step(self.step)
        self.num_preempted_step = self.num_admitted_step = 0
        budget = self.max_num_batched_tokens
        prefill = self._prefill_allowance() if self.interleave else budget
        plan: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = req.num_tokens - req.num_computed
            chunk = want > 1
            if chunk:  # decode (one token) needs no chunking
                want = self._chunk(req.num_computed, req.num_tokens, min(budget, prefill),
                                   req.junction, req.prefill_end)
            if req.lagging and want:  # state_blocks=vllm_align: allocate_slots frees them
                self.state.release_lagging(req)
            if not chunk and req.num_computed < req.room_end:  # held units suffice
                plan.append(Scheduled(req, 1, req.num_computed))
                budget -= 1
                i += 1
                continue
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
            if chunk:
                prefill -= got
            i += 1
        # Admission only in a step without preemption (new work must not displace old),
        # unless nothing is left running (progress).
        if not self.num_preempted_step or not plan:
            while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.cap:
                item = self._try_admit(self.waiting[0], min(budget, prefill))
                if item is None:
                    break
                self.waiting.popleft()
                plan.append(item)
                budget -= item.num_new
                prefill -= item.num_new
        self.max_running = max(self.max_running, len(self.running))
        if self.state_views:
            chunk_state = self.state.chunk_state
            for item in plan:
                item.state = chunk_state(item.req, item.context + item.num_new)
        return plan

    def _prefill_allowance(self) -> int:
        """Interleave: prefill tokens this step may carry. With a running request that decodes
        (one token left to compute), 0 for `decode_steps` steps, then `prefill_tokens` for
        one step; with none, the whole token budget (and the count starts again)."""
        if not any(r.num_tokens - r.num_computed == 1 for r in self.running):
            self.decode_only_steps = 0
            return self.max_num_batched_tokens
        if self.decode_only_steps < self.interleave["decode_steps"]:
            self.decode_only_steps += 1
            return 0
        self.decode_only_steps = 0
        return self.interleave["prefill_tokens"]

    # ----- chunks and reservations --------------------------------------------------------------
    def _chunk(self, start: int, total: int, budget: int, stop: int = 0,
               prefill_end: int = 0) -> int:
        """Tokens of the next chunk from `start` of a sequence of `total` known tokens.

        Aligned chunks stop at the last checkpoint boundary within the budget, then the
        tail follows in its own chunk; 0 when the budget reaches neither a boundary nor
        the end. With split_last_boundary, a chunk that would end at `total` on a boundary
        ends one interval earlier (when that is past `start`). With cross_final_chunk
        (vLLM's `_mamba_block_aligned_split`), a chunk that reaches `total` crosses where
        vLLM's does (`final_chunk_end`; `prefill_end`: the request's, 0 for `total`). A
        `stop` strictly inside the chunk ends it there (stop_at_junction)."""
        end = min(total, start + budget)
        if self.align and (end < total or not self.cross_final_chunk):
            aligned = end // self.C * self.C
            if self.split_last_boundary and aligned == total and aligned - self.C > start:
                aligned -= self.C
            if aligned > start:
                end = aligned
            elif end < total:
                return 0
        elif self.align:
            end = final_chunk_end(start, total, prefill_end or total, self.C)
        return (stop if start < stop < end else end) - start

    def _drop_own_holds(self, req: Request) -> bool:
        """Progress: before a request would preempt itself, release what it holds beyond
        its execution (retained checkpoints) and, when it runs alone, waiting requests'
        pins. True if anything was released."""
        dropped = self.state.drop_retained(req)
        if len(self.running) == 1 and self.state.any_pinned(self.waiting):
            self.state.release_pins(self.waiting)
            dropped = True
        return dropped

    def _reserve(self, req: Request, want: int) -> int:
        """Units for a running request's next `want` tokens: the tokens granted, 0 when
        preemption is needed."""
        return self.state.reserve(req, want, not self.whole_chunks) or self._reserve_failed(
            req, want)

    def _reserve_failed(self, req: Request, want: int) -> int:
        """A running request got no units for its next `want` tokens (the state manager's
        `reserve` returned 0): trace it; 0 means preemption is needed."""
        if self.trace:
            need = self.state.chunk_demand(req, req.num_computed, want, 0)
            self._trace_alloc_fail(req, need, {})
        return 0

    # ----- admission ----------------------------------------------------------------------------
    def _admission_gate(self, req: Request, adoption, n: int) -> tuple[int, dict, dict]:
        """(tokens of the first chunk, units it needs, units kept free besides) under the
        admission rule: with requests running, the full-prompt gate (never below the first
        chunk's own need) plus headroom H per pool; into an idle engine, the first chunk,
        shortened to a boundary rather than stall (progress guarantee)."""
        state, jadopt, held = self.state, adoption.jadopt, len(adoption.blocks)
        working = 1 if self.C else 0
        need = state.chunk_demand(req, jadopt, n, working, held)
        extra = dict(adoption.pinned)
        if self.running:
            gate = need
            if self.full_prompt:
                whole = state.prompt_demand(req, jadopt, working, held,
                                            self.reserve_output_tokens, self.capped_prompt)
                gate = {p: max(units, whole[p]) for p, units in need.items()}
            for pool, h in self.headroom.items():
                extra[pool] += h
            return n, gate, extra
        if not state.can_allocate(need, extra):
            grid = self.C or self.B
            for b in range(((jadopt + n - 1) // grid) * grid, jadopt, -grid):
                shorter = state.chunk_demand(req, jadopt, b - jadopt, working, held)
                if state.can_allocate(shorter, extra):
                    return b - jadopt, shorter, extra
        return n, need, extra

    def _try_admit(self, req: Request, budget: int) -> Scheduled | None:
        blocked, mem = req.blocked, self.mem
        if (blocked is not None and self.running and blocked[0] == self._cache_mark()
                and blocked[1] == mem.availability_gains() and budget >= blocked[2]
                and self.state.adoption_hook is None):
            # Failed before with requests running, and since then nothing it could adopt
            # appeared (see _cache_mark), no unit became free or evictable (no pool can
            # supply more) and the budget is no smaller (a chunk no shorter): it fails again.
            return None
        adoption = self.state.adoption(req)
        if self.state.vllm_blocks and self.state.cached_this_step(req, adoption):
            return None  # state_blocks=vllm_align: vLLM refuses the hit until the next step
        hit = adoption.hit.attention
        req.junction = hit if self.stop_at_junction and hit > adoption.jadopt else 0
        n = self._chunk(adoption.jadopt, req.num_tokens, budget, req.junction, req.prefill_end)
        if not n:
            return None  # an aligned first chunk needs more budget than is left this step
        n, gate, extra = self._admission_gate(req, adoption, n)
        if not self.state.can_allocate(gate, extra):
            if not self.running and self.state.any_pinned(self.waiting):
                # Progress guarantee: with nothing running, pins must not block the head.
                self.state.release_pins(self.waiting)
                return self._try_admit(req, budget)
            if self.trace and not req.alloc_fail_logged:
                req.alloc_fail_logged = True
                self._trace_alloc_fail(req, gate, extra)
            if not self.running:
                raise RuntimeError(
                    f"request {req.rid} cannot be admitted into an idle engine: "
                    f"needs {gate}, available {self.state.available()}; the budget is too small"
                )
            if self.memo_blocked:
                mark = (mem.cache.watch(adoption.keys, adoption.hit, self.B, self.C)
                        if self.full_prompt else mem.cache.version)
                req.blocked = (mark, mem.availability_gains(), budget)
            return None
        self.state.admit(req, adoption, n)
        self._start_episode(req, adoption)
        return Scheduled(req, n, adoption.jadopt, admitted=True)

    def _cache_mark(self) -> int:
        """What a blocked head's memo compares of the prefix cache. Under the full-prompt
        gate (full_prompt, reserve_output), the watch version of the head's chain: the gate
        covers the whole prompt, so a lost entry only adds to what admission needs (each
        block no longer adopted is one more to allocate, at most one fewer pulled out of
        the LRU; a checkpoint no longer adopted adds a boundary's composite at least) and
        only an entry appearing on the chain can help (PrefixCache.watch). Under
        first_chunk a shallower adoption can mean a shorter first chunk, so any change of
        the cache counts."""
        cache = self.mem.cache
        return cache.watch_version if self.full_prompt else cache.version

    def _start_episode(self, req: Request, adoption) -> None:
        """Queue bookkeeping of an admitted request: status, episode, hit counters, trace."""
        jadopt = adoption.jadopt
        req.status = Status.RUNNING
        req.episodes += 1
        req.alloc_fail_logged = False
        req.blocked = None
        req.prefill_target = req.num_tokens
        if req.episodes == 1:
            req.start_s = self.now
            req.adopted_first = jadopt
            if self.rec.attribution is not None:
                self.rec.attribution.admitted(req, adoption, self.mem.cache)
        else:
            req.adopted_resume += jadopt
            self.prefix_hit_tokens_self += jadopt
        self.prefix_hit_tokens_total += jadopt
        self.running.append(req)
        self.num_admitted_step += 1
        if self.trace:
            hit = adoption.hit
            m1 = self.state.lookup_m1(adoption.keys)
            kind = "RESUME" if req.episodes > 1 else "LOOKUP"
            self.rec.event(kind, self.now, req.rid, req.episodes, hit_m0=hit, hit_m1=m1)
            self.rec.event(
                "ADOPT", self.now, req.rid, req.episodes, hit_m0=hit, hit_m1=m1, boundary=jadopt
            )
            self._lineage_adopt(req, adoption)

    def _lineage_adopt(self, req: Request, adoption) -> None:
        lineage, ckpt = self.rec.lineage, adoption.checkpoint
        if lineage is not None:
            lineage.adoption(ckpt, req.rid, req.episodes, adoption.keys, self.now, self.step,
                            format_key(ckpt.key) if ckpt else "")

    def _trace_alloc_fail(self, req: Request, need: dict, extra: dict) -> None:
        available = self.state.available()
        for pool, units in need.items():
            want = units + extra.get(pool, 0)
            if want > available[pool]:
                self.rec.event("ALLOC_FAIL", self.now, req.rid, req.episodes, need=want,
                               free=available[pool], pool=pool)

    # ----- release paths ------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.state.release_preempted(req)  # pins first (pinning_k), then releases
        req.num_computed = 0
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
        self.state.release_all(req, finishing=True)
        if self.rec.attribution is not None:
            self.rec.attribution.finished(req)
        req.status = Status.FINISHED
        req.finish_s = now
        req.release_tokens()  # keep memory proportional to the live requests
        self.num_finished_step += 1
        self.running.remove(req)
        if self.trace:
            self.rec.event("FINISH", now, req.rid, req.episodes)

    def abort_waiting(self, req: Request, now: float) -> bool:
        """Finish a request that waits and has never run (no episode, holds no pin): it
        leaves the queue at once. False for any other request; the caller ends that one
        at its next step (its state is released by the normal finish path)."""
        if (req.status != Status.WAITING or req.episodes or req not in self.waiting
                or self.state.any_pinned((req,))):
            return False
        self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_s = now
        req.release_tokens()
        if self.rec.lineage is not None:
            self.rec.lineage.left(req.rid)
        if self.trace:
            self.rec.event("FINISH", now, req.rid, req.episodes)
        return True

    def boundaries_crossed(self, plan: list[Scheduled]) -> int:
        """Checkpoint boundaries the planned chunks cross (each writes one extra composite)."""
        return self.state.boundaries_crossed(plan)

    def plan_columns(self, plan: list[Scheduled], crossings: int | None = None) -> dict[str, int]:
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
            "checkpoint_writes": (self.boundaries_crossed(plan) if crossings is None
                                  else crossings),
        }

    # ----- after the executor ran the step ------------------------------------------------------
    def complete_step(self, plan: list[Scheduled], now: float) -> tuple[int, int, int]:
        """Publish what the step computed, sample tokens, finish requests.

        Returns (initial prefill, resume prefill, decode) token counts.
        """
        initial = resume = decode = 0
        self.num_finished_step = 0
        complete_chunk, B = self.state.complete_chunk, self.B
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
            # Publication (recorded in the chunk's state view) and the release of an adopted
            # checkpoint: only a chunk that fills a block or starts an episode has either, so
            # the manager is not called for the other decodes (most items of a step).
            if c1 // B > c0 // B or item.admitted:
                complete_chunk(req, c0, c1, item.state)
            req.num_computed = c1
            if c1 == req.num_prompt + req.num_generated:
                req.append_generated()
                self.generation_tokens_total += 1
                if req.num_generated == 1:
                    req.first_token_s = now
                if req.num_generated >= req.target_output:
                    self._finish(req, now)
        if self.state_views:  # where each chunk's last state goes (the executor's commit)
            self.state.record_final_states(plan)
        self.prompt_tokens_total += initial + resume
        return initial, resume, decode
