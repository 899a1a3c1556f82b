"""Drift of a compressed SSM state against the fp32-state reference (issue 47).

On the random-weight tiny Falcon-H1 and Granite-style checkpoints (serving_core.model.
make_tiny, seed 0) a prompt is prefilled and a long greedy generation decoded with the
state kept in fp32 (the reference), then again with the SSM state stored in each codec
(serving_core/executor/state_encoding.py) after the prefill and after every decode step,
as the torch executor stores a running state. Per codec:

- teacher-forced along the reference tokens: the greedy-token agreement (argmax equal to
  the reference's) and the KL divergence KL(reference || codec) of the next-token
  distributions, overall and per span of generation length (drift with length);
- free-running: the first position where the codec's own greedy tokens leave the
  reference's.

Random weights: the numbers say how far the state codec moves these models' outputs,
nothing about task accuracy. Usage:
    python -m bench.state_codec_drift [--tokens 512] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from serving_core.executor.state_encoding import StateEncoder
from serving_core.model.dense_state import DenseState

MODELS = ("falcon_h1_tiny", "granite_hybrid_tiny")
CODECS = ("bf16", "fp16", "fp8_e4m3", "int8", "bf16_sr", "fp16_sr")
SPANS = (0, 64, 256, 512, 1024, 4096)


class CodecState(DenseState):
    """DenseState whose SSM state is stored in a codec after each forward (encoded and
    decoded in place, rounding keyed by (0, position, group))."""

    def __init__(self, model, codec: str, members: int) -> None:
        super().__init__(model)
        self.encoders = [StateEncoder(codec, tuple(s.shape[1:]), members) for s in self.ssm]
        self.position = 0

    def store_recurrent(self, layer, conv, ssm):
        enc = self.encoders[layer]
        ssm.copy_(enc.decode(enc.encode(ssm, [(0, self.position)], layer)))

    def run(self, model, ids, logits=True):
        self.position = self.length + ids.shape[1]
        return super().run(model, ids, logits)


def _load(name: str, directory: Path):
    from serving_core.model.make_tiny import build

    path = build(directory / name, name, seed=0)
    if name.startswith("granite"):
        from serving_core.model.granite_moe_hybrid import GraniteMoeHybrid

        model = GraniteMoeHybrid.load(path)
        return model, model.members
    from serving_core.model.falcon_h1 import FalconH1

    return FalconH1.load(path), 1


@torch.no_grad()
def _forced(model, members: int, prompt: torch.Tensor, tokens: int, codecs=CODECS):
    """The reference's greedy tokens, and per codec its agreement and KL at each position,
    every codec's state fed the reference's tokens (teacher forcing, in lockstep: no
    distribution is kept)."""
    ref = DenseState(model)
    states = {c: CodecState(model, c, members) for c in codecs}
    logits = {"ref": ref.run(model, prompt)} | {c: s.run(model, prompt) for c, s in states.items()}
    out, agree, kl = [], {c: [] for c in codecs}, {c: [] for c in codecs}
    for _ in range(tokens):
        lref = logits["ref"][0].double().log_softmax(-1)
        tok = int(lref.argmax())
        out.append(tok)
        p = lref.exp()
        for c in codecs:
            lp = logits[c][0].double().log_softmax(-1)
            agree[c].append(int(lp.argmax()) == tok)
            kl[c].append(float((p * (lref - lp)).sum()))
        nxt = torch.tensor([[tok]])
        logits = {"ref": ref.run(model, nxt)} | {c: s.run(model, nxt) for c, s in states.items()}
    return out, agree, kl


@torch.no_grad()
def _first_divergence(model, state, prompt, ref_tokens) -> int | None:
    logits = state.run(model, prompt)
    for i, ref in enumerate(ref_tokens):
        tok = int(logits[0].argmax())
        if tok != ref:
            return i
        logits = state.run(model, torch.tensor([[tok]]))
    return None


def measure(name: str, model, members: int, tokens: int, prompt_tokens: int = 64,
            codecs=CODECS) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128_256, (1, prompt_tokens), generator=gen)
    ref_tokens, agreements, kls = _forced(model, members, prompt, tokens, codecs)
    rows = []
    for codec in codecs:
        agree, kl = agreements[codec], kls[codec]
        div = _first_divergence(model, CodecState(model, codec, members), prompt, ref_tokens)
        row = {"model": name, "codec": codec, "tokens": tokens,
               "agreement": sum(agree) / len(agree), "mean_kl": sum(kl) / len(kl),
               "max_kl": max(kl), "first_divergence": div, "spans": []}
        for a, b in zip(SPANS, SPANS[1:], strict=False):
            if a >= tokens:
                break
            part_a, part_k = agree[a:b], kl[a:b]
            row["spans"].append({"from": a, "to": min(b, tokens),
                                 "agreement": sum(part_a) / len(part_a),
                                 "mean_kl": sum(part_k) / len(part_k)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per model and codec, agreement and mean KL per span."""
    spans = [(s["from"], s["to"]) for s in rows[0]["spans"]]
    head = ("| model | codec | agreement | mean KL | max KL | first divergence | "
            + " | ".join(f"agree / KL {a}-{b}" for a, b in spans) + " |")
    lines = [head, "|" + "---|" * (6 + len(spans))]
    for r in rows:
        cells = [f"{s['agreement']:.3f} / {s['mean_kl']:.2e}" for s in r["spans"]]
        div = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        lines.append(f"| {r['model']} | {r['codec']} | {r['agreement']:.3f} | "
                     f"{r['mean_kl']:.2e} | {r['max_kl']:.2e} | {div} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.state_codec_drift")
    parser.add_argument("--tokens", type=int, default=512, help="generated tokens per run")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    names, codecs = args.models.split(","), args.codecs.split(",")
    bad = [n for n in names if n not in MODELS] + [c for c in codecs if c not in CODECS]
    if bad or args.tokens < 1:
        print(f"error: --models={args.models!r} / --codecs={args.codecs!r} / "
              f"--tokens={args.tokens}: allowed models {', '.join(MODELS)}, codecs "
              f"{', '.join(CODECS)}, tokens >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            model, members = _load(name, Path(tmp))
            rows += measure(name, model, members, args.tokens, codecs=codecs)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
