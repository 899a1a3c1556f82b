"""The warm-up at start: a step's largest temporaries allocated, touched and freed once.

vLLM's engine runs a dummy batch of max_num_batched_tokens before it serves; this does the
same for the torch path, so the heap reaches its working size at start rather than under the
first requests. With glibc malloc keeping freed memory (serving_core/server/process_settings
.py) the pages stay with the process, and a saturating run's first serve took 0.04-0.9
page faults per output token instead of 3.4-23.5 (docs/real_path.md section 4). It runs
on contiguous state (`DenseState`), with fixed token ids and no random numbers drawn: the
engine's state arena, its requests, the sampler's seeds and the weights are untouched.
"""

from __future__ import annotations

import resource
import time

import torch

from serving_core.model.dense_state import DenseState

MODES = ("auto", "off")  # the server's `--warm-up` values


def warm_up(model, tokens: int, rows: int, mode: str = "auto") -> dict:
    """One prefill forward of `tokens` tokens (one sequence) and one decode forward of
    `rows` sequences with the head over every row; returns what ran, its seconds and the
    page faults it took (`mode` "off": nothing)."""
    if mode not in MODES:
        raise ValueError(f"warm_up={mode!r}: allowed values are {', '.join(MODES)}")
    if mode == "off" or tokens < 1 or rows < 1:
        return {"mode": mode, "ran": False}
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    vocab = model.w["model.embed_tokens.weight"].shape[0]
    with torch.inference_mode():
        ids = torch.arange(tokens, device=model.device)[None] % vocab
        DenseState(model, 1).run(model, ids)
        DenseState(model, rows).run(model, torch.zeros(rows, 1, dtype=torch.long,
                                                        device=model.device))
    return {"mode": mode, "ran": True, "tokens": tokens, "rows": rows,
            "s": round(time.perf_counter() - t0, 3),
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}
