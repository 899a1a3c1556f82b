"""Continuation per state codec and organization: a reused or resumed compressed state
continues exactly as the same compressed state does without reuse (issue 47).

`python -m experiments.studies.codec_continuation` (make codec-continuation). For each state
codec (bf16, fp16, fp8_e4m3, int8, bf16_sr, fp16_sr) and each organization (S0, S1, S2, D0,
N0, Jenga), on the tiny model, with chunks of C tokens (so every published boundary is a
chunk end of the writer's run and its working state went through the codec there, with the
same (seed, position) rounding the checkpoint got), greedy, each token's logprob returned:

- reuse: the continuation study's protocol (experiments/studies/continuation.py `run_pair`):
  the cold run saves to a host tier, the device is reset, the deepest held prefix B is
  restored into poisoned units and the target regenerated; its tokens AND its token
  logprobs must equal the cold run's bit for bit (`same_chunks`: the cold run's chunks
  after B are the reload's), with every byte and unit audit of that study;
- preemption: the target is preempted after its first chunk (its state at C published in
  the codec) and resumed; the resumed run adopts the checkpoint at C and must repeat the
  unpreempted run's tokens and logprobs, and the checkpoint both publish at 2C, bit for bit.
  Control: the model run over the same 2C tokens in C-token chunks with its state kept in
  fp32 (serving_core/model/dense_state.py) holds another SSM state at 2C, so the comparison
  sees the codec even where the tiny model's greedy tokens and logprobs do not change.

A pair the organization refuses (N0 holds no int8 state) is listed as refused. The reuse
rows go to the `continuation` study table (state_codec column); the LAST output line is
JSON {"pairs", "refused", "reuse_ok", "preempt_ok", "ok"}; exit 1 when a pair fails.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

from experiments.studies import continuation as cont
from experiments.studies import study_parser
from ledgers.arms import PLAIN_ARMS, arm
from ledgers.studies import new_study_id, now_iso, rows_to_columns, write_study
from serving_core.sampling_params import SamplingParams

CODECS = ("bf16", "fp16", "fp8_e4m3", "int8", "bf16_sr", "fp16_sr")
CASE = "C+1"  # the reuse prompt: B = C strictly inside it
TABLE = "codec_continuation"  # the preemption half; the reuse half goes to `continuation`
PREEMPT_CASE = "2C+1"  # preempted after its first chunk (C), two chunks left


@dataclass
class PreemptResult:
    org: str
    state_codec: str
    n_tokens: int
    interval: int
    preempted_at: int  # tokens computed when preempted
    resumed_b: int  # prefix the resumed request adopted (must be C)
    preemptions: int
    tokens_equal: bool
    logprobs_equal: bool
    state_equal: bool  # the checkpoint at 2C equals the unpreempted run's bit for bit
    fp32_differs: bool  # the fp32 state at 2C differs from the codec's decoded (the control)

    @property
    def ok(self) -> bool:
        return (self.tokens_equal and self.logprobs_equal and self.state_equal
                and self.preemptions == 1
                and self.resumed_b == self.interval == self.preempted_at
                and self.fp32_differs)


def _engine(model, geometry, org: str, budget: str):
    """A fresh engine of the organization whose steps are C-token chunks."""
    from serving_core.builder import build_engine, loaded_model_spec
    from serving_core.memory import org_layout

    C = org_layout(geometry, arm(org).org).checkpoint_interval
    spec = loaded_model_spec(model, geometry, arm(org).org, budget,
                             {"cap": 8, "max_num_batched_tokens": C})
    return build_engine(spec, model=model), C


def _serve(engine, spec, preempt_at: int | None = None) -> tuple[list, list, object, int]:
    """Serve one request to completion (tokens, logprobs, Request, tokens computed when
    preempted or -1); with `preempt_at`, the scheduler preempts it (its tail preemption)
    once it has computed that many tokens."""
    engine.add_request(spec)
    tokens, lps, preempted_at = [], [], -1
    req = None
    while engine.has_work():
        out = engine.step()
        req = req or next((r for r in engine.requests if r.rid == spec.request_id), None)
        if out is not None:
            tokens += [t for rid, t in out.produced if rid == spec.request_id]
            lps += [out.logprobs[spec.request_id][0]] if spec.request_id in out.logprobs else []
        if preempt_at is not None and preempted_at < 0 and req and req.num_computed >= preempt_at:
            preempted_at = req.num_computed
            engine.sched._preempt(engine.sched.running.pop())  # the lone running request
    return tokens, lps, req, preempted_at


def run_preemption(model, geometry, org: str, budget: str, output_tokens: int,
                   seed: int) -> PreemptResult:
    """The preemption case of one codec and organization (see the module doc)."""
    engine, C = _engine(model, geometry, org, budget)
    n = cont.case_tokens(PREEMPT_CASE, C)
    spec = cont.SampledSpec(0, 0.0, cont.draw_prompts(seed, n, 1)[0], output_tokens, -1, "",
                            sampling=SamplingParams(logprobs=0, seed=0))
    want, want_lps, _, _ = _serve(engine, spec)
    resumed = _engine(model, geometry, org, budget)[0]
    got, got_lps, req, at = _serve(resumed, spec, preempt_at=C)
    stored, decoded = _state_at(engine, 2 * C)
    return PreemptResult(
        org, geometry.state_codec, n, C, at, req.adopted_resume, req.preemptions,
        got == want, got_lps == want_lps, _equal(_state_at(resumed, 2 * C)[0], stored),
        not _equal(_fp32_ssm(model, spec.prompt[: 2 * C], C), [ssm for _, ssm in decoded]))


def _fp32_ssm(model, prompt, C: int) -> list:
    """Per layer, the SSM state after `prompt` run in C-token chunks with an fp32 state."""
    import torch

    from serving_core.model.dense_state import DenseState

    state, ids = DenseState(model), torch.as_tensor(prompt, dtype=torch.long)[None]
    with torch.inference_mode():
        for start in range(0, ids.shape[1], C):
            state.run(model, ids[:, start:start + C], logits=False)
    return list(state.ssm)


def _state_at(engine, boundary: int) -> tuple[list, list]:
    """The cached checkpoint at `boundary`: its stored bytes (what a host tier would copy)
    and its per-layer decoded (conv, ssm) state."""
    from serving_core.executor.state_copy import ArenaCopier

    (obj,) = [o for o in engine.mem.cache.checkpoints.values() if o.boundary == boundary]
    arena = engine.executor.arena
    return ArenaCopier(arena).read(obj), arena.read(obj)


def _equal(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _pair(model, geometry, codec: str, org: str, args) -> tuple | None:
    """(reuse PairResult, PreemptResult) of one codec and organization; None: refused."""
    try:
        g = geometry.with_state_codec(codec)
        from serving_core.memory import org_layout

        org_layout(g, arm(org).org)
    except ValueError as err:
        print(f"refused: {codec} x {org}: {err}", flush=True)
        return None
    reuse = cont.run_pair(model, g, org, args.budget, CASE, args.output_tokens, args.seed,
                          chunk_tokens="C")
    return reuse, run_preemption(model, g, org, args.budget, args.output_tokens, args.seed)


def _line(codec: str, org: str, reuse, pre: PreemptResult, seconds: float) -> str:
    return (f"{codec:>8} x {org:>5}: reuse B={reuse.restored_prefix_b} tokens "
            f"{'=' if reuse.tokens_equal else '!='} logprobs "
            f"{'=' if reuse.logprobs_equal else '!='} ({'ok' if reuse.ok else 'FAIL'}); "
            f"preempted at {pre.preempted_at}, resumed at {pre.resumed_b}: tokens "
            f"{'=' if pre.tokens_equal else '!='} logprobs {'=' if pre.logprobs_equal else '!='}"
            f" state {'=' if pre.state_equal else '!='}, fp32 state "
            f"{'differs' if pre.fp32_differs else 'SAME'} "
            f"({'ok' if pre.ok else 'FAIL'}) ({seconds:.1f} s)")


def write_preemptions(root, results: list, model: str, budget: str, seed: int):
    """The preemption half as one file of the `codec_continuation` study table (each row
    beside the outcome of its codec and organization's reuse pair)."""
    data = [{**asdict(q), "model": model, "budget": budget, "seed": seed,
             "reuse_ok": r.ok, "ok": q.ok} for r, q in results]
    return write_study(root, TABLE, rows_to_columns(
        TABLE, data, study_id=new_study_id(), created_at=now_iso()))


def main(argv: list[str] | None = None) -> int:
    p = study_parser("codec_continuation", __doc__, model=True, run=True)
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--orgs", default=",".join(PLAIN_ARMS))
    p.add_argument("--output-tokens", type=int, default=4)
    args = p.parse_args(argv)
    from serving_core.state_codec import STATE_CODECS

    codecs = cont.choices(args.codecs, STATE_CODECS, "codecs")
    orgs = cont.choices(args.orgs, PLAIN_ARMS, "orgs")
    if codecs is None or orgs is None:
        return 2
    from serving_core.geometry import load_geometry
    from serving_core.model.loader import load_model

    geometry, model = load_geometry(args.preset), load_model(args.checkpoint)
    reuse_rows, results, refused = [], [], []
    for codec in codecs:
        for org in orgs:
            t = time.perf_counter()
            got = _pair(model, geometry, codec, org, args)
            if got is None:
                refused.append(f"{codec} x {org}")
                continue
            reuse_rows.append(got[0])
            results.append(got)
            print(_line(codec, org, *got, time.perf_counter() - t), flush=True)
    if reuse_rows:
        print(f"ledger: {cont.write_rows(args.ledger_root, reuse_rows, args.preset)}")
        print("ledger: " + str(write_preemptions(args.ledger_root, results, args.preset,
                                                 args.budget, args.seed)))
    summary = {"pairs": len(results), "refused": refused,
               "reuse_ok": sum(r.ok for r, _ in results),
               "preempt_ok": sum(q.ok for _, q in results),
               "ok": all(r.ok and q.ok for r, q in results)}
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
