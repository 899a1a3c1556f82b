"""The LM-head GEMM alone at the tiny Falcon-H1's shapes: seconds against logits rows.

The torch executor runs one head product per step over the rows that sample (decode rows
and prefill chunks that complete their prompt; serving_core/executor/torch_executor.py
`_sample_heads`), in vocabulary blocks over rows padded to a multiple of 4
(serving_core/model/falcon_h1.py `head`, serving_core/model/head_rows.py). At the tiny
model's width (hidden 128) and vocabulary (128,256) it reads a 64-MiB fp32 weight per call,
so its cost per call and per row is what the step model's logits terms (logit_gemm_s,
logit_row_s, logit_block_rows in serving_core/executor/profiles.py) describe. This bench
times the model's `head` (`--head model`, the default; `--head linear`: one `F.linear(x, W)
* m`, the head before blocks and padding) with x (rows, hidden), for rows 1..MAX, and
fits gemm_s + row_s x rows, with rows as they are and rounded up to blocks of 2, 4 and 8,
by least squares, and the step model's form (one pass over the weight per row below a
block of rows, one per GEMM from it on, plus a cost per row) for blocks of 2, 4 and 8; it
prints each form's rms relative error.

`python -m bench.logits_bench [--max-rows 48] [--reps 15] [--threads 1]`: the least and
the median thread CPU time per row count (a busy shared machine inflates them less than
wall time) and the fits; writes bench/results/logits.json. Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench.kernel_bench import RESULTS

HIDDEN, VOCAB = 128, 128_256  # conf/model/falcon_h1_tiny.yaml
BLOCKS = (1, 2, 4, 8)


def model_head(weight: torch.Tensor):
    """FalconH1.head itself over `weight` (a unit final norm, multiplier 0.5)."""
    from types import SimpleNamespace

    from serving_core.model.falcon_h1 import FalconH1, pack_weights

    w = {"model.final_layernorm.weight": torch.ones(weight.shape[1]), "lm_head.weight": weight}
    model = SimpleNamespace(w=w, eps=1e-5, mult={"lm_head_multiplier": 0.5},
                            packs=pack_weights(w, 0))  # packed as the model's (auto)
    return lambda x: FalconH1.head(model, x)


def time_rows(row_counts: np.ndarray, head, hidden: int, reps: int) -> dict[int, list]:
    """Thread CPU seconds of one head product per row count, `reps` times each, the counts
    in a new random order every repetition (a drift of the machine spreads over all)."""
    rng = np.random.default_rng(0)
    times: dict[int, list] = {int(r): [] for r in row_counts}
    inputs = {r: torch.randn(r, hidden) for r in times}
    with torch.inference_mode():
        head(inputs[min(times)])  # warm
        for _ in range(reps):
            for r in rng.permutation(list(times)):
                t0 = time.thread_time()
                head(inputs[int(r)])
                times[int(r)].append(time.thread_time() - t0)
    return times


def fit_form(rows: np.ndarray, seconds: np.ndarray, block: int) -> dict:
    """seconds = gemm_s + row_s x block ceil(rows / block): least squares on relative error."""
    padded = block * np.ceil(rows / block)
    a = np.stack([np.ones_like(padded), padded], axis=1) / seconds[:, None]
    (gemm_s, row_s), *_ = np.linalg.lstsq(a, np.ones_like(seconds), rcond=None)
    pred = gemm_s + row_s * padded
    rel = pred / seconds - 1.0
    return {"block_rows": block, "gemm_s": float(gemm_s), "row_s": float(row_s),
            "rms_rel_error": float(math.sqrt(np.mean(rel ** 2))),
            "max_abs_rel_error": float(np.max(np.abs(rel)))}


def fit_passes(rows: np.ndarray, seconds: np.ndarray, block: int) -> dict:
    """The step model's form (serving_core/executor/simulated.py `logit_seconds`): seconds =
    gemm_s x passes + row_s x rows, passes = rows below `block` rows, 1 from there on."""
    passes = np.where(rows < block, rows, 1.0)
    a = np.stack([passes, rows], axis=1) / seconds[:, None]
    (gemm_s, row_s), *_ = np.linalg.lstsq(a, np.ones_like(seconds), rcond=None)
    rel = (gemm_s * passes + row_s * rows) / seconds - 1.0
    return {"form": "passes", "block_rows": block, "gemm_s": float(gemm_s),
            "row_s": float(row_s), "rms_rel_error": float(math.sqrt(np.mean(rel ** 2))),
            "max_abs_rel_error": float(np.max(np.abs(rel)))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.logits_bench", description=__doc__)
    p.add_argument("--max-rows", type=int, default=48)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--head", choices=("model", "linear"), default="model")
    args = p.parse_args(argv)
    for name in ("max_rows", "reps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: allowed whole numbers >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN) * 0.02
    rows = np.arange(1, args.max_rows + 1, dtype=np.float64)
    head = (model_head(weight) if args.head == "model"
            else lambda x: (F.linear(x, weight) * 0.5).float())
    times = time_rows(rows.astype(int), head, HIDDEN, args.reps)
    seconds = np.array([min(times[int(r)]) for r in rows])
    medians = np.array([float(np.median(times[int(r)])) for r in rows])
    fits = [fit_form(rows, seconds, b) for b in BLOCKS]
    print("least thread CPU time of the repetitions (the fits' data), median beside it")
    print("rows  ms      median  " + "  ".join(f"pred b{f['block_rows']}" for f in fits))
    for r, s, med in zip(rows, seconds, medians, strict=True):
        preds = [f["gemm_s"] + f["row_s"] * f["block_rows"] * math.ceil(r / f["block_rows"])
                 for f in fits]
        print(f"{int(r):4d}  {1e3 * s:6.3f}  {1e3 * med:6.3f}  "
              + "  ".join(f"{1e3 * v:7.3f}" for v in preds))
    for f in fits:
        print(f"padded, block {f['block_rows']}: gemm {1e3 * f['gemm_s']:.3f} ms + row "
              f"{1e3 * f['row_s']:.4f} ms x padded rows; rms rel error "
              f"{f['rms_rel_error']:.3f}, max {f['max_abs_rel_error']:.3f}")
    passes = [fit_passes(rows, seconds, b) for b in BLOCKS[1:]]
    for f in passes:
        print(f"passes, block {f['block_rows']}: {1e3 * f['gemm_s']:.3f} ms per weight pass "
              f"+ {1e3 * f['row_s']:.4f} ms per row; rms rel error {f['rms_rel_error']:.3f}, "
              f"max {f['max_abs_rel_error']:.3f}")
    fits = fits + passes
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"hidden": HIDDEN, "vocab": VOCAB, "head": args.head, "threads": args.threads,
           "reps": args.reps,
           "rows": rows.astype(int).tolist(), "seconds_min": seconds.tolist(),
           "seconds_median": medians.tolist(), "fits": fits}
    (RESULTS / "logits.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
