"""Continuation correctness: a reloaded state continues exactly like recomputation.

`python -m experiments.studies.continuation` (make continuation). Per organization with
checkpoints (S0, S1, S2, D0, N0) and per prompt length N at the reference offsets
from its checkpoint interval C (2C-1, 2C, 2C+1, 2C+3, 2C+4, 2C+5, 3C-1, 3C, 3C+1:
for D0, C = 1,792, the lengths 3,583 ... 5,377; S0/S1/S2 C = 512; N0 C = 1,568 on
the tiny model), greedy decoding, EOS ignored:
1. generate the target cold, saving every published entry to the host tier
   (a save counts once its copy completed);
2. generate two interposer requests (other prompts of min(N, C+1) tokens, also saved);
3. reset the device cache (a new engine: fresh pools and arenas), keeping the tier;
4. reload the target's deepest held prefix into freshly allocated units, each filled
   with NaN before the restore writes it (poisoning), and regenerate the target;
   compare every generated token id.

Expected p follows the placement rule the engine runs (read back from it): the
deepest checkpoint boundary strictly inside the prompt that the rule publishes for
a lone cold prefill. `every_boundary` (D0, N0) publishes every boundary a chunk
crosses, so p = C floor((N-1)/C). `step_end` with aligned chunks (S0/S1/S2, vLLM's
align mode) publishes only at chunk ends: a prompt of exactly kC tokens that fits
one step runs as one chunk ending at N, so the state at N - C is never published
and p is smaller (`reuse_lost` = C floor((N-1)/C) - p). A tier entry at B = N (the
state after the whole prompt) is never used: the last prompt token is always
computed. Per pair every column must hold (exit 1 otherwise): tokens equal,
B = p = expected p, the first reload batch computes B and schedules the expected
first chunk from B, the restore wrote every poisoned byte (read back bit-exact, no
NaN), and it copied exactly layers x (B x KV bytes per token + SSM + conv bytes)
host-to-device into the units the organization's layout gives B. On the
`--delayed-save-cases`, saves are held incomplete for `--save-delay` seconds of the
tier's clock and a request arriving in that window must recompute (B = p = 0).
Rows go to the `continuation` study table (ledgers.studies, <ledger_root>/continuation/);
`python -m analysis.studies.continuation` writes the page (continuation.md). The LAST
output line is JSON {"pairs", "equal", "B_equals_p", "audits_ok", "ok"}.

Faults and observations go through the engine's explicit hooks, never by rebinding its
methods: `Engine.on_plan` sees each step's plan (the reload's first batch), and
`HybridStateManager.adoption_hook` replaces what one request adopts (the credit fault).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.studies import study_parser
from experiments.workloads.workload import RequestSpec
from ledgers.arms import arm
from ledgers.studies import (
    CONTINUATION_FAULTS,
    CONTINUATION_ORGS,
    PLACEMENTS,
    new_study_id,
    now_iso,
    rows_to_columns,
    write_study,
)
from serving_core.sampling_params import SamplingParams

# The arms with checkpoints this check covers (S2+Retention runs S2's storage).
ORGS = CONTINUATION_ORGS
# The reference lengths as offsets from multiples of C (for C = 1,792: 3,583 ... 5,377).
OFFSETS = ("2C-1", "2C", "2C+1", "2C+3", "2C+4", "2C+5", "3C-1", "3C", "3C+1")
_CASE = re.compile(r"^(\d*)C([+-]\d+)?$")
FAULTS = CONTINUATION_FAULTS
VOCAB = 128_256
INTERPOSER_TOKENS = 2  # generated tokens per interposer
MAX_BATCHED_TOKENS = 2048
TIER_CAPACITY_BYTES = 1 << 30  # holds every entry a pair publishes: nothing is evicted
TABLE = "continuation"  # study table (ledgers.studies); page analysis/studies/


def parse_case(label: str) -> tuple[int, int]:
    """'2C+3' -> (2, 3): N = k C + d. ValueError for anything else or N < 1."""
    m = _CASE.match(str(label).strip().upper())
    if not m:
        raise ValueError(f"case {label!r} is not of the form kC, kC+d or kC-d")
    k, d = int(m.group(1) or 1), int(m.group(2) or 0)
    if k < 1:
        raise ValueError(f"case {label!r}: k must be >= 1")
    return k, d


# ----- the placement rule, computed independently of the scheduler ---------------------------
def chunk_ends(start: int, n: int, C: int, budget: int, align: bool,
               split: bool = False) -> list[int]:
    """Ends of the prefill chunks of a lone request computing [start, n) under a token
    budget: aligned chunks stop at the last multiple of C within the budget, then the
    tail after the last boundary runs alone; with `split` (split_last_boundary), an
    aligned chunk that would end at n = k C ends at n - C when that is past its start."""
    ends, pos = [], start
    while pos < n:
        end = min(n, pos + budget)
        aligned = end // C * C
        if align and split and aligned == n and aligned - C > pos:
            aligned -= C
        if align and aligned > pos:
            end = aligned
        ends.append(end)
        pos = end
    return ends


def published_boundaries(n: int, C: int, budget: int, step_end: bool, align: bool,
                         split: bool = False, placement: str = "") -> list[int]:
    """Checkpoint boundaries a cold prefill of n tokens (the engine's first request)
    publishes: chunk ends on a multiple of C (step_end); every multiple of C a chunk
    reaches (every_boundary, all); those and, in the last chunk when it starts on the grid,
    the last multiple of C below n at least C past its start (align, vLLM 0.32); the
    prompt's last boundary below n and those after it (junction: nothing seen before, so
    no branch point, only the tail)."""
    placement = placement or ("step_end" if step_end else "every_boundary")
    ends = chunk_ends(0, n, C, budget, align, split)
    if placement in ("step_end", "align"):
        out = [e for e in ends if e % C == 0]
        start = ends[-2] if len(ends) > 1 else 0
        last = (n - 1) // C * C
        if placement == "align" and start % C == 0 and last >= start + C:
            out.append(last)
        return sorted(set(out))
    if placement == "junction":
        return list(range(max((n - 1) // C, 1) * C, n + 1, C))
    return list(range(C, n + 1, C))


def expected_prefix(n: int, C: int, budget: int, step_end: bool, align: bool,
                    split: bool = False, placement: str = "") -> int:
    """p: the deepest published boundary strictly inside the prompt (0 if none)."""
    inside = [b for b in published_boundaries(n, C, budget, step_end, align, split, placement)
              if b < n]
    return max(inside, default=0)


@dataclass
class PairResult:
    budget: str
    seed: int
    org: str
    length_case: str
    n_tokens: int
    interval: int
    placement: str
    align_chunks: bool
    split_last_boundary: bool
    output_tokens: int
    restored_prefix_b: int
    credited_prefix_p: int
    expected_p: int
    full_prefix: int  # C floor((N-1)/C)
    reuse_lost: int  # full_prefix - expected_p
    tier_full_depth: int  # deepest prefix the tier held over ALL the prompt's blocks
    first_context: int  # tokens the first reload batch had computed (must be B)
    first_scheduled: int  # tokens it scheduled for the target
    expected_first: int  # the rule's first chunk from B (N - B when it fits the budget)
    bytes_h2d: int
    expected_bytes: int  # layers x (B x KV bytes/token + SSM + conv bytes)
    unit_capacity_bytes: int  # bytes of the destination units the restore allocated
    restored_units: int
    expected_units: int  # the organization's demand for B (attention blocks + a composite)
    poisoned_units: int
    restored_exact: bool  # every restored view equals the host copy bit for bit, no NaN
    window_b: int  # delayed-save audit: B / p of a request inside the window (-1: not run)
    window_p: int
    window_pending: int  # saves still incomplete when it arrived
    window_tokens_equal: bool
    fault: str
    tokens_equal: bool
    first_mismatch: int
    cold_tokens: str
    reload_tokens: str
    host_saves: int
    reload_units_fresh: bool
    state_codec: str  # model.state_codec the pair ran
    chunk_tokens: int  # max_num_batched_tokens
    same_chunks: bool  # the cold run ended a chunk at B and then ran the reload's chunks
    logprobs_equal: bool  # the reload's token logprobs equal the cold run's bit for bit

    @property
    def b_equals_p(self) -> bool:
        return self.restored_prefix_b == self.credited_prefix_p == self.expected_p

    @property
    def window_ok(self) -> bool:
        if self.window_b < 0:
            return True
        return (self.window_pending > 0 and self.window_b == self.window_p == 0
                and self.window_tokens_equal)

    @property
    def audits_ok(self) -> bool:
        return (self.restored_exact and self.bytes_h2d == self.expected_bytes
                and self.bytes_h2d <= self.unit_capacity_bytes
                and self.restored_units == self.expected_units
                and self.poisoned_units == self.restored_units and self.window_ok)

    @property
    def ok(self) -> bool:
        return (self.tokens_equal and self.b_equals_p and self.reload_units_fresh
                and (self.logprobs_equal or not self.same_chunks)
                and self.first_context == self.restored_prefix_b
                and self.first_scheduled == self.expected_first and self.audits_ok)


@dataclass(frozen=True, slots=True)
class SampledSpec(RequestSpec):
    """A workload request with SamplingParams: greedy, each token's own logprob returned."""

    sampling: SamplingParams | None = None


def _spec(rid: int, arrival: float, prompt: np.ndarray, output_tokens: int) -> RequestSpec:
    return SampledSpec(rid, arrival, prompt, output_tokens, -1, "",
                       sampling=SamplingParams(logprobs=0))


def _generate(engine, specs, host=None) -> tuple[list[int], object, list[float]]:
    """Serve requests together to completion; the first one's generated ids, Request and
    token logprobs. With a host tier, every step's published entries are saved (and the due
    copies completed)."""
    for spec in specs:
        engine.add_request(spec)
    first = specs[0].request_id
    tokens: list[int] = []
    logprobs: list[float] = []
    target = engine.num_finished + len(specs)
    copier = _copier(engine)
    while engine.num_finished < target:
        out = engine.step()
        if out is not None:
            tokens += [tok for rid, tok in out.produced if rid == first]
            logprobs += [out.logprobs[first][0]] if first in out.logprobs else []
        if host is not None:
            engine.sched.state.save_published(host, copier)
            host.complete()
    req = next(r for r in engine.requests if r.rid == first)
    return tokens, req, logprobs


def _copier(engine):
    """The copy port over the engine's state arena (what the host tier saves and restores
    through, called by the engine's state manager)."""
    from serving_core.executor.state_copy import ArenaCopier

    return ArenaCopier(engine.executor.arena)


def _restore(engine, host, keys: list[int]):
    """Restore the deepest prefix of `keys` the tier holds into `engine` (its state
    manager allocates, writes and publishes)."""
    return engine.sched.state.restore_prefix(keys, host, _copier(engine))


def _first_batch(engine, rid: int) -> dict:
    """Record (context, scheduled tokens) of the first batch that schedules `rid`, read
    from each step's plan through the engine's plan observer (`Engine.on_plan`)."""
    seen: dict = {}

    def observe(plan) -> None:
        for item in plan:
            if item.req.rid == rid and not seen:
                seen.update(context=item.context, scheduled=item.num_new)

    engine.on_plan = observe
    return seen


def _restored_exact(host, arena, keys: list[int], restored) -> bool:
    """Every restored attention block and the checkpoint read back equal to the host
    copies byte for byte, with no NaN left from the poisoning."""
    import torch

    from serving_core.executor.state_copy import ArenaCopier

    copier = ArenaCopier(arena)

    def equal(obj, saved) -> bool:
        got = copier.read(obj)
        return len(got) == len(saved) and all(
            torch.equal(a.cpu(), b) for a, b in zip(got, saved, strict=True))

    for i, obj in enumerate(restored.blocks):
        for layer in range(arena.layers):
            if torch.isnan(arena.kv_view(layer)[obj.units[0]].float()).any():
                return False
        if not equal(obj, host.blocks[keys[i]]):
            return False
    if restored.checkpoint is not None:
        for c, s in arena.read(restored.checkpoint):
            if torch.isnan(c).any() or torch.isnan(s).any():
                return False
        if not equal(restored.checkpoint, host.checkpoints[keys[len(restored.blocks) - 1]]):
            return False
    return True


def _restore_sizes(mem, geometry, restored) -> tuple[int, int, int, int]:
    """(expected bytes, unit capacity bytes, units restored, units the layout gives B)."""
    b, layers = restored.prefix_tokens, geometry.scope_layers
    state = geometry.ssm_bytes + geometry.conv_bytes if b and mem.checkpoint_interval else 0
    expected = layers * (b * geometry.attention_bytes_per_token + state)
    objs = restored.blocks + ([restored.checkpoint] if restored.checkpoint else [])
    capacity = units = 0
    for obj in objs:
        units += len(obj.units)
        capacity += len(obj.units) * mem.pools[obj.pool].unit_bytes * layers
        if obj.kind and mem.has_slabs:
            capacity += mem.layout.conv_slot_bytes * layers
    # The layout's units for B: one attention unit per block, one composite's units (an S2
    # composite's conv state is a slot in a shared slab page, not a unit of its own).
    need = b // mem.block_tokens + (mem.units_per_composite() if state else 0)
    return expected, capacity, units, need


def _force_credit(engine, rid: int, keys: list[int], p: int) -> None:
    """Fault injection through the state manager's adoption hook: admit `rid` crediting
    p tokens over the blocks of `keys` and the checkpoint at the last of them (what a
    tier entry at B = N offers)."""
    from serving_core.state_manager import Adoption

    mem = engine.mem

    def forced(req, found):
        if req.rid != rid:
            return found
        blocks = [mem.cached_attention(k) for k in keys]
        ckpt = mem.cached_checkpoint(keys[-1])
        return Adoption(found.hit, found.keys, p, blocks, ckpt,
                        mem.pinned_by_adoption(blocks + [ckpt]))

    engine.sched.state.adoption_hook = forced


def case_tokens(case: str, C: int) -> int:
    """N, the prompt length of a length case (`2C+1`) at checkpoint interval C."""
    k, d = parse_case(case)
    n = k * C + d
    if n < 1:
        raise ValueError(f"case {case!r} gives N = {n} < 1 for C = {C}")
    return n


def _publishing_engine(spec, model):
    """A fresh engine of `spec` whose state manager logs what it publishes (the host tier
    saves it)."""
    from serving_core.builder import build_engine

    engine = build_engine(spec, model=model)
    engine.sched.state.log_publications()
    return engine


NO_WINDOW = {"b": -1, "p": -1, "pending": 0, "equal": False}  # no delayed-save audit


def draw_prompts(seed: int, n: int, side: int) -> list[np.ndarray]:
    """The target prompt (n tokens) and the two interposers' (side tokens each)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, n).astype(np.int32)]
    return prompts + [rng.integers(0, VOCAB, side).astype(np.int32) for _ in range(2)]


def _save_window(early, host, clock: list[float], save_delay_s: float, lookup_keys,
                 target_spec, cold_tokens: list[int]) -> dict:
    """The delayed-save audit: halfway through the save delay, what a request on a fresh
    engine (`early`) restores (b), is credited (p) and generates (equal to the cold run's);
    then the delay passes and the copies land."""
    clock[0] += save_delay_s / 2
    host.complete()
    pending = host.num_pending
    got = _restore(early, host, lookup_keys)
    early_tokens, early_req, _ = _generate(early, [target_spec])
    clock[0] += save_delay_s  # the window has passed: the copies land
    host.complete()
    return {"b": got.prefix_tokens, "p": early_req.adopted_first, "pending": pending,
            "equal": early_tokens == cold_tokens}


def _first_mismatch(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (-1: equal)."""
    mismatch = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1)
    if mismatch < 0 and len(a) != len(b):
        mismatch = min(len(a), len(b))
    return mismatch


def _reload_audits(warm, host, geometry, target, lookup_keys, n: int,
                   fault: str | None) -> tuple[Any, dict]:
    """Restore the target's prefix from the host tier onto the reset engine `warm` (the
    whole prompt's keys under the credit_n_minus_1 fault, which then credits N - 1) and
    audit it: (the restore, the PairResult fields of its depth, exactness and sizes)."""
    C, bt = warm.mem.checkpoint_interval, warm.mem.block_tokens
    full_keys = target.ensure_keys(n // bt)
    tier_full = host.restorable_prefix(full_keys, bt, C)
    empty = all(used == cached == 0 for used, cached, _, _ in warm.mem.usage().values())
    keys = lookup_keys
    if fault == "credit_n_minus_1":
        if tier_full != n:
            raise ValueError(f"fault {fault}: the tier holds no entry at B = N = {n} "
                             f"(deepest over the whole prompt: {tier_full})")
        keys = full_keys
    restored = _restore(warm, host, keys)
    exact = _restored_exact(host, warm.executor.arena, keys, restored)
    expected_bytes, capacity, units, expected_units = _restore_sizes(warm.mem, geometry,
                                                                     restored)
    objs = restored.blocks + ([restored.checkpoint] if restored.checkpoint else [])
    # Fresh units: the reset device held nothing, and the reload's objects live there now.
    fresh = empty and all(o.valid and o.cached and warm.mem.live.get(o.oid) is o for o in objs)
    if fault == "credit_n_minus_1":
        _force_credit(warm, 0, full_keys, n - 1)
    return restored, {
        "tier_full_depth": tier_full, "restored_exact": exact, "expected_bytes": expected_bytes,
        "unit_capacity_bytes": capacity, "restored_units": units,
        "expected_units": expected_units, "reload_units_fresh": fresh}


def _placement_fields(sched, n: int, C: int, b: int) -> dict:
    """The PairResult fields the scheduler's placement rules decide for a prompt of n
    tokens restored at b: the expected credited prefix p and first chunk, and whether the
    cold run's chunks after b are the reload's (`same_chunks`)."""
    budget_tokens, split = sched.max_num_batched_tokens, sched.split_last_boundary
    name = sched.placement.name
    p_rule = expected_prefix(n, C, budget_tokens, sched.step_end, sched.align, split, name)
    cold = chunk_ends(0, n, C, budget_tokens, sched.align, split)
    reload = chunk_ends(b, n, C, budget_tokens, sched.align, split)
    return {
        "chunk_tokens": budget_tokens,
        "same_chunks": (b == 0 or b in cold) and reload == [e for e in cold if e > b],
        "placement": name,
        "align_chunks": bool(sched.align), "split_last_boundary": split,
        "expected_p": p_rule, "full_prefix": C * ((n - 1) // C),
        "reuse_lost": C * ((n - 1) // C) - p_rule,
        "expected_first": next(iter(chunk_ends(b, n, C, budget_tokens, sched.align, split)),
                               b) - b}


def _pair_spec(model, geometry, org: str, budget: str, chunk_tokens: int | str,
               split_last_boundary: bool, placement: str | None = None):
    """The engine spec of a pair: cap 8, `chunk_tokens` per step (`chunk_budget`), the
    checkpoint placement (None: the organization's)."""
    from serving_core.builder import loaded_model_spec
    from serving_core.memory import org_layout

    C = org_layout(geometry, arm(org).org).checkpoint_interval
    return loaded_model_spec(model, geometry, arm(org).org, budget,
                             {"cap": 8, "max_num_batched_tokens": chunk_budget(chunk_tokens, C),
                              "split_last_boundary": split_last_boundary,
                              "checkpoint_placement": placement})


def run_pair(model, geometry, org: str, budget: str, case: str, output_tokens: int,
             seed: int, *, delayed_save: bool = False, save_delay_s: float = 1.0,
             fault: str | None = None, interposer_tokens: int | None = None,
             poison: bool = True, split_last_boundary: bool = False,
             chunk_tokens: int | str = MAX_BATCHED_TOKENS,
             placement: str | None = None) -> PairResult:
    """The protocol for one organization and one prompt length (see the module doc);
    `chunk_tokens`: the engine's token budget per step (`chunk_budget`)."""
    from serving_core.host_tier import HostTier
    from serving_core.request import Request

    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: allowed values are {', '.join(FAULTS)}")
    spec = _pair_spec(model, geometry, org, budget, chunk_tokens, split_last_boundary,
                      placement)
    fresh_engine = functools.partial(_publishing_engine, spec, model)
    cold = fresh_engine()
    sched = cold.sched  # the rules the engine runs, read back from it
    C, bt = cold.mem.checkpoint_interval, cold.mem.block_tokens
    n = case_tokens(case, C)
    prompts = draw_prompts(seed, n, min(n, C + 1) if interposer_tokens is None
                       else interposer_tokens or n)
    target = _spec(0, 0.0, prompts[0], output_tokens)
    clock = [0.0]  # the tier's clock (seconds): saves of the delayed-save audit wait on it
    host = HostTier(TIER_CAPACITY_BYTES, poison=poison,
                    save_delay_s=save_delay_s if delayed_save else 0.0, clock=lambda: clock[0])
    cold_tokens, _, cold_lps = _generate(cold, [target], host)
    lookup_keys = Request(target, bt).lookup_keys()

    window = NO_WINDOW  # delayed_save: a request arriving while the saves are incomplete
    if delayed_save:
        window = _save_window(fresh_engine(), host, clock, save_delay_s, lookup_keys,
                              _spec(0, 0.0, prompts[0], output_tokens), cold_tokens)
    # Interposers: two other prompts through the same device (their own state published).
    _generate(cold, [_spec(i, 0.0, prompts[i], INTERPOSER_TOKENS) for i in (1, 2)], host)
    clock[0] += save_delay_s
    host.complete()
    saves = host.saves_completed

    warm = fresh_engine()  # device cache reset; the host tier is kept
    restored, audits = _reload_audits(warm, host, geometry, Request(target, bt), lookup_keys,
                                      n, fault)
    first = _first_batch(warm, 0)
    reload_tokens, req, reload_lps = _generate(warm, [_spec(0, 0.0, prompts[0], output_tokens)])
    return PairResult(
        budget=budget, seed=seed, org=org, length_case=case, n_tokens=n, interval=C,
        output_tokens=output_tokens, **_placement_fields(sched, n, C, restored.prefix_tokens),
        restored_prefix_b=restored.prefix_tokens, credited_prefix_p=req.adopted_first,
        first_context=first.get("context", -1), first_scheduled=first.get("scheduled", -1),
        bytes_h2d=restored.bytes_h2d, poisoned_units=restored.poisoned_units, **audits,
        window_b=window["b"], window_p=window["p"], window_pending=window["pending"],
        window_tokens_equal=window["equal"], fault=fault or "",
        tokens_equal=cold_tokens == reload_tokens,
        first_mismatch=_first_mismatch(cold_tokens, reload_tokens),
        cold_tokens=json.dumps(cold_tokens), reload_tokens=json.dumps(reload_tokens),
        host_saves=saves, state_codec=geometry.state_codec, logprobs_equal=cold_lps == reload_lps,
    )


def write_rows(root: str | os.PathLike, rows: list[PairResult], model: str) -> Path:
    """The pairs as one file of the `continuation` study table (one study run)."""
    data = [{**asdict(r), "b_equals_p": r.b_equals_p, "audits_ok": r.audits_ok, "ok": r.ok}
            for r in rows]
    return write_study(root, TABLE, rows_to_columns(
        TABLE, data, study_id=new_study_id(), created_at=now_iso(), model=model))


def summary(rows: list[PairResult]) -> dict:
    return {"pairs": len(rows), "equal": sum(r.tokens_equal for r in rows),
            "B_equals_p": all(r.b_equals_p for r in rows),
            "audits_ok": all(r.audits_ok for r in rows), "ok": sum(r.ok for r in rows)}


def choices(value: str, allowed, name: str, check=None) -> list[str] | None:
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    bad = [v for v in items if (check(v) if check else v not in allowed)]
    if bad or not items:
        print(f"error: --{name}={value!r}: allowed values are {', '.join(allowed)}",
              file=sys.stderr)
        return None
    return items


def _bad_case(label: str) -> bool:
    try:
        parse_case(label)
    except ValueError:
        return True
    return False


def _parser() -> argparse.ArgumentParser:
    p = study_parser("continuation", __doc__, model=True, run=True)
    p.add_argument("--orgs", default=",".join(ORGS))
    p.add_argument("--cases", default=",".join(OFFSETS),
                   help="offsets from multiples of C: kC, kC+d, kC-d")
    p.add_argument("--delayed-save-cases", default="2C+1",
                   help="cases that also run the delayed-save audit ('none': no case)")
    p.add_argument("--save-delay", type=float, default=1.0,
                   help="seconds of the tier's clock a delayed save stays incomplete")
    p.add_argument("--fault", default="none", help="fault injection: none | credit_n_minus_1")
    p.add_argument("--split-last-boundary", action="store_true",
                   help="engine.split_last_boundary: aligned chunks of a k C prompt end at N - C")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--placement", default=None, choices=PLACEMENTS,
                   help="engine.checkpoint_placement (default: each organization's)")
    p.add_argument("--state-codec", default="auto",
                   help="model.state_codec of the preset's geometry (serving_core/state_codec.py)")
    p.add_argument("--chunk-tokens", default=str(MAX_BATCHED_TOKENS),
                   help="token budget per step, or C: each organization's interval")
    return p


def chunk_budget(value: str, C: int) -> int:
    """--chunk-tokens: a positive number of tokens, or 'C' (the organization's interval)."""
    text = str(value).strip().upper()
    tokens = C if text == "C" else int(text) if text.isdigit() else 0
    if tokens < 1:
        raise ValueError(f"--chunk-tokens={value!r}: allowed values are a positive integer or C")
    return tokens


def _row_text(row: PairResult, org: str, case: str) -> str:
    window = "" if row.window_b < 0 else f"; window B={row.window_b} p={row.window_p}"
    return (f"{org:>3} N={row.n_tokens:>5} ({case:>4}) "
            f"C={row.interval}: B={row.restored_prefix_b} p={row.credited_prefix_p} "
            f"expected {row.expected_p} (lost {row.reuse_lost}); first batch "
            f"{row.first_context}/{row.first_scheduled}; {row.bytes_h2d:,} B H2D{window}; "
            f"tokens {'equal' if row.tokens_equal else 'DIFFER'}; "
            f"{'ok' if row.ok else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    orgs = choices(args.orgs, ORGS, "orgs")
    cases = choices(args.cases, ("kC", "kC+d", "kC-d"), "cases", _bad_case)
    delayed = ([] if args.delayed_save_cases.strip() == "none" else
               choices(args.delayed_save_cases, ("kC", "kC+d", "kC-d", "none"),
                        "delayed-save-cases", _bad_case))
    if orgs is None or cases is None or delayed is None:
        return 2
    if args.fault not in ("none", *FAULTS):
        print(f"error: --fault={args.fault!r}: allowed values are none, {', '.join(FAULTS)}",
              file=sys.stderr)
        return 2
    if args.output_tokens < 1:
        print(f"error: --output-tokens={args.output_tokens}: expected >= 1", file=sys.stderr)
        return 2
    if args.save_delay <= 0:
        print(f"error: --save-delay={args.save_delay}: expected > 0", file=sys.stderr)
        return 2
    from serving_core.executor.torch_config import TorchExecutorConfig, check_checkpoint
    from serving_core.geometry import load_geometry
    from serving_core.model.loader import load_model

    try:
        geometry = load_geometry(args.preset).with_state_codec(args.state_codec)
        chunk_budget(args.chunk_tokens, 1)
        check_checkpoint(TorchExecutorConfig(args.checkpoint), geometry)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = load_model(args.checkpoint)
    fault = None if args.fault == "none" else args.fault
    delayed_keys = {parse_case(c) for c in delayed}
    rows = []
    total = len(orgs) * len(cases)
    for org in orgs:
        for i, case in enumerate(cases):
            t = time.perf_counter()
            try:
                row = run_pair(model, geometry, org, args.budget, case, args.output_tokens,
                               args.seed + i, delayed_save=parse_case(case) in delayed_keys,
                               save_delay_s=args.save_delay, fault=fault,
                               split_last_boundary=args.split_last_boundary,
                               chunk_tokens=args.chunk_tokens, placement=args.placement)
            except ValueError as err:  # a case the organization cannot run (N < 1, fault)
                print(f"error: org={org} case={case}: {err}", file=sys.stderr)
                return 2
            rows.append(row)
            print(f"[{len(rows)}/{total}] {_row_text(row, org, case)} "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    path = write_rows(args.ledger_root, rows, args.preset)
    print(f"ledger: {path}; page: python -m analysis.studies.continuation --ledgers "
          f"{args.ledger_root}")
    print(json.dumps(summary(rows)), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
