"""The boundary matrix over HTTP: reload continues exactly like recomputation, through
the server's host tier (issue 21, sections 2 and 4).

`python -m experiments.studies.continuation_http` (make continuation-http). Per organization
with checkpoints one fresh server (host tier on, poisoning restores (an audit),
`engine.split_last_boundary=true`;
its engine line must say both), and per case five serial operations on it: the target
cold, two interposer requests (other prompts of min(N, C+1) tokens), POST
/reset_prefix_cache, the target again (reload). Greedy, EOS ignored. Cases: the nine
offsets from multiples of C (as `make continuation`: 2C-1 ... 3C+1) with 64 generated
tokens, and (`--templates`) three prompt templates (English ledger arithmetic, Chinese
ordered rules, Python code; text made here and tokenized with the llama3 tokenizer the
workload uses, nothing downloaded) at absolute lengths (default 3,583, 3,584, 5,376)
with 256 generated tokens. Per case every column must hold (exit 1 otherwise): the
reload's actual path is host_reload with B = p = C floor((N-1)/C) (0 and recompute
when no boundary lies inside), its first batch computed B and scheduled the rule's
first chunk from B, and its generated ids equal the cold run's. The host tier poisons
every destination unit with NaN before a restore writes it, so a missed byte changes
the tokens. The cold run must recompute (every case's prompt is its own document).
Rows go to the `continuation_http` study table (ledgers.studies,
<ledger_root>/continuation_http/); `python -m analysis.studies.continuation_http` writes the
page (continuation_http.md). The LAST line is JSON {"cases", "equal", "B_equals_p", "ok",
"seconds_per_case"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from experiments.studies import study_parser
from experiments.studies.continuation import OFFSETS, ORGS, VOCAB, chunk_ends, parse_case
from experiments.studies.reload_study import Server, server_spec
from ledgers.studies import new_study_id, now_iso, rows_to_columns, write_study

TEMPLATES = ("english_ledger", "chinese_rules", "python_code")
INTERPOSER_TOKENS = 2
TABLE = "continuation_http"  # study table (ledgers.studies); page analysis/studies/


def template_text(name: str, lines: int, document: int = 0) -> str:
    """Deterministic synthetic text of a template (no data downloaded), opening with the
    document's identity so that no two documents share a prefix block."""
    out = [f"Document {document} ({name}):"]
    for i in range(lines):
        a, b = (i * 37) % 997 + 3, (i * 91) % 613 + 7
        if name == "english_ledger":
            out.append(f"Ledger line {i}: account A-{i % 17:02d} opens at {a} credits, "
                       f"receives {b}, pays {a // 3}; the closing balance is "
                       f"{a + b - a // 3} credits.")
        elif name == "chinese_rules":
            out.append(f"第{i + 1}条规则：若第{i}步的结果大于{a}，则先减去{b}，再按顺序执行第"
                       f"{i + 2}条；否则保持不变并记录编号{a + b}。")
        elif name == "python_code":
            out.append(f"def step_{i}(values):\n    total = sum(v * {a} for v in values)\n"
                       f"    return (total + {b}) % {a + b}\n")
        else:
            raise ValueError(f"template {name!r}: allowed values are {', '.join(TEMPLATES)}")
    return "\n".join(out)


def template_ids(name: str, n: int, document: int = 0) -> list[int]:
    """The first n llama3 token ids of the template's text for one document."""
    import quicktok

    enc = quicktok.get_encoding("llama3")
    lines = max(8, n // 20)
    while True:
        ids = list(enc.encode(template_text(name, lines, document)))
        if len(ids) >= n:
            return [int(t) for t in ids[:n]]
        lines *= 2


@dataclass
class HttpCase:
    org: str
    case: str
    template: str
    n_tokens: int
    interval: int
    output_tokens: int
    cold_path: str
    reload_path: str
    restored_b: int
    credited_p: int
    expected_p: int
    first_computed: int
    first_scheduled: int
    expected_first: int
    tokens_equal: bool
    first_mismatch: int
    seconds: float

    @property
    def b_equals_p(self) -> bool:
        return self.restored_b == self.credited_p == self.expected_p

    @property
    def ok(self) -> bool:
        want_path = "host_reload" if self.expected_p else "recompute"
        return (self.cold_path == "recompute" and self.tokens_equal and self.b_equals_p
                and self.reload_path == want_path
                and self.first_computed == self.expected_p
                and self.first_scheduled == self.expected_first)


def run_case(srv: Server, org: str, case: str, template: str, prompt: list[int],
             output_tokens: int, interval: int, budget_tokens: int, align: bool,
             split: bool, seed: int) -> HttpCase:
    t0 = time.perf_counter()
    n = len(prompt)
    rng = np.random.default_rng([seed, n, 7])
    side = min(n, interval + 1)
    cold = srv.complete(prompt, output_tokens)
    for _ in range(2):
        srv.complete([int(t) for t in rng.integers(0, VOCAB, side)], INTERPOSER_TOKENS)
    srv.reset_prefix_cache()
    warm = srv.complete(prompt, output_tokens)
    p = interval * ((n - 1) // interval)
    first = next(iter(chunk_ends(p, n, interval, budget_tokens, align, split)), p) - p
    mismatch = next((i for i, (a, b) in enumerate(zip(cold.token_ids, warm.token_ids,
                                                      strict=False)) if a != b), -1)
    return HttpCase(org, case, template, n, interval, output_tokens, cold.path, warm.path,
                    warm.restored_tokens, warm.reused_tokens, p, warm.first_batch_computed,
                    warm.first_batch_scheduled, first, cold.token_ids == warm.token_ids,
                    mismatch, time.perf_counter() - t0)


def write_rows(root: str, rows: list[HttpCase], *, model: str, budget: str,
               seed: int) -> Path:
    """The cases as one file of the `continuation_http` study table (one study run)."""
    data = [{**asdict(r), "b_equals_p": r.b_equals_p, "ok": r.ok} for r in rows]
    return write_study(root, TABLE, rows_to_columns(
        TABLE, data, study_id=new_study_id(), created_at=now_iso(),
        model=model, budget=budget, seed=seed))


def _parser() -> argparse.ArgumentParser:
    p = study_parser("continuation_http", __doc__, model=True, run=True)
    p.add_argument("--orgs", default=",".join(ORGS))
    p.add_argument("--cases", default=",".join(OFFSETS), help="offsets: kC, kC+d, kC-d; none")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--templates", default="none",
                   help=f"comma list of {', '.join(TEMPLATES)}, all, or none")
    p.add_argument("--template-lengths", default="3583,3584,5376")
    p.add_argument("--template-output-tokens", type=int, default=256)
    return p


def _cases(args, cases: list[str], templates: list[str], lengths: list[int], C: int,
           first: int) -> list[tuple[str, str, list[int], int]]:
    """(case, template, prompt ids, output tokens) of one organization's server, random
    prompts of the offset cases first; `first`: rows already run (the prompts' seed)."""
    todo = []
    rng = np.random.default_rng([args.seed, first])
    for c in cases:
        k, d = parse_case(c)
        todo.append((c, "random", [int(t) for t in rng.integers(0, VOCAB, k * C + d)],
                     args.output_tokens))
    for t in templates:
        for n in lengths:  # a new document per case: its cold run recomputes
            todo.append((f"N={n}", t, template_ids(t, n, len(todo)),
                         args.template_output_tokens))
    return todo


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    orgs = [o.strip() for o in args.orgs.split(",") if o.strip()]
    cases = [] if args.cases.strip() == "none" else [
        c.strip() for c in args.cases.split(",") if c.strip()]
    templates = (list(TEMPLATES) if args.templates == "all" else [] if args.templates == "none"
                 else [t.strip() for t in args.templates.split(",") if t.strip()])
    try:
        for c in cases:
            parse_case(c)
        lengths = [int(x) for x in args.template_lengths.split(",") if x.strip()]
        bad = [o for o in orgs if o not in ORGS] or [t for t in templates if t not in TEMPLATES]
        if bad or not orgs:
            raise ValueError(f"--orgs/--templates: {bad or orgs}: allowed orgs are "
                             f"{', '.join(ORGS)}, templates {', '.join(TEMPLATES)}")
        if args.output_tokens < 1 or args.template_output_tokens < 1:
            raise ValueError("--output-tokens/--template-output-tokens: expected >= 1")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows: list[HttpCase] = []
    total = len(orgs) * (len(cases) + len(templates) * len(lengths))
    for org in orgs:
        spec = server_spec(args.checkpoint, args.preset, org, args.budget, True, True,
                           poison=True)
        with tempfile.TemporaryDirectory(prefix="continuation-http-") as tmp, \
                Server(spec, Path(tmp)) as srv:
            eff = srv.effective
            from serving_core.memory import org_layout

            C = org_layout(spec.geometry(), spec.org).checkpoint_interval
            for case, template, prompt, out in _cases(args, cases, templates, lengths, C,
                                                      len(rows)):
                row = run_case(srv, org, case, template, prompt, out, C,
                               eff["max_num_batched_tokens"], eff["align_chunks"],
                               eff["split_last_boundary"], args.seed)
                rows.append(row)
                print(f"[{len(rows)}/{total}] {org:>3} {case:>6} {template:>14} "
                      f"N={row.n_tokens:>5} C={C}: reload {row.reload_path} B={row.restored_b} "
                      f"p={row.credited_p} expected {row.expected_p}; first batch "
                      f"{row.first_computed}/{row.first_scheduled} ({row.expected_first}); "
                      f"tokens {'equal' if row.tokens_equal else 'DIFFER'}; "
                      f"{'ok' if row.ok else 'FAIL'} ({row.seconds:.1f} s)", flush=True)
    path = write_rows(args.ledger_root, rows, model=args.preset, budget=args.budget,
                      seed=args.seed)
    print(f"ledger: {path}; page: python -m analysis.studies.continuation_http --ledgers "
          f"{args.ledger_root}")
    print(json.dumps({"cases": len(rows), "equal": sum(r.tokens_equal for r in rows),
                      "B_equals_p": all(r.b_equals_p for r in rows),
                      "ok": sum(r.ok for r in rows),
                      "seconds_per_case": round(sum(r.seconds for r in rows)
                                                / max(1, len(rows)), 1)}), flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
