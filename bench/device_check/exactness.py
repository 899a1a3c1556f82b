"""Stage 1: greedy tokens of the tiny checkpoint through our engine (S0/S1/S2/D0) against
transformers' FalconH1ForCausalLM on the same device.

Two prompts share a document; the second arrives after the first finished, so on S0/S1/S2
it adopts the checkpoint the first published (the adopted prefix is recorded). transformers'
model runs each prompt alone with its own cache (fp32, its torch path), token by token, as
tests/test_reference_model.py does. Where transformers is absent the reference is our own
contiguous path (serving_core/model/dense_state.py) and the result says so. TF32 is off for
the stage (cuDNN's convolutions default to it on an accelerator): exactness is fp32 to fp32.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from serving_core.builder import build_engine, loaded_model_spec
from serving_core.engine import serve
from serving_core.geometry import load_geometry
from serving_core.model.dense_state import DenseState
from serving_core.records import record_produced
from serving_core.server.runtime import ServedSpec


def prompts_of(plan, seed: int = 2026) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    doc = rng.integers(0, 128_256, plan.exact_prompt)
    return [np.concatenate([doc, rng.integers(0, 128_256, n)]).astype(np.int32)
            for n in plan.exact_suffixes]


def transformers_greedy(checkpoint, prompts, device, n: int) -> list[list[int]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import FalconH1ForCausalLM

    net = FalconH1ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    net = net.to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            step = net(torch.tensor([prompt.tolist()], device=device), use_cache=True,
                       logits_to_keep=1)
            tokens = []
            for _ in range(n):
                tok = int(step.logits[0, -1].argmax())
                tokens.append(tok)
                step = net(torch.tensor([[tok]], device=device),
                           past_key_values=step.past_key_values, use_cache=True,
                           logits_to_keep=1)
            out.append(tokens)
    return out


def contiguous_greedy(model, prompts, n: int) -> list[list[int]]:
    """Our model over contiguous per-sequence state (no pages, no engine)."""
    out = []
    dev = model.device
    for prompt in prompts:
        state = DenseState(model)
        logits = state.run(model, torch.tensor([prompt.tolist()], device=dev))
        tokens = []
        for _ in range(n):
            tok = int(logits[0].argmax())
            tokens.append(tok)
            logits = state.run(model, torch.tensor([[tok]], device=dev))
        out.append(tokens)
    return out


def engine_greedy(model, geometry, org: str, plan, prompts) -> tuple[list[list[int]], list[int],
                                                                     dict]:
    sched = {"cap": 4, "max_num_batched_tokens": 2048}  # the rest: SchedulerConfig's defaults
    spec = loaded_model_spec(model, geometry, org, plan.exact_budget, sched, clock="virtual")
    engine = build_engine(spec, model=model)
    produced = record_produced(engine)
    # The second arrives long after the first finished (virtual clock: 1,000 s, about
    # 1,000 poller samples) and adopts what the first published.
    specs = [ServedSpec(i, a, p, plan.exact_output) for i, (p, a) in
             enumerate(zip(prompts, (0.0, 1000.0), strict=False))]
    result = serve(engine, specs)
    adopted = [int(v) for v in result.tables["requests"]["adopted_prefix_tokens"]]
    return [produced[i] for i in range(len(specs))], adopted, engine.effective_rules()


def run(plan, device: torch.device, deadline: float) -> dict:
    from serving_core.model.falcon_h1 import FalconH1

    try:
        import transformers

        reference_kind, version = "transformers", transformers.__version__
    except ImportError:
        reference_kind, version = "contiguous", None
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    geometry = load_geometry(plan.exact_model)
    prompts = prompts_of(plan)
    out = {"model": plan.exact_model, "reference": reference_kind, "transformers": version,
           "prompt_tokens": [len(p) for p in prompts], "output_tokens": plan.exact_output,
           "orgs": {}, "complete": False}
    try:
        with tempfile.TemporaryDirectory(prefix="hsl-device-tiny-") as tmp:
            if reference_kind == "transformers":
                checkpoint, out["checkpoint"] = _checkpoint(tmp, plan.exact_model)
                model = FalconH1.load(checkpoint, device, "float32")
                t0 = time.perf_counter()
                reference = transformers_greedy(checkpoint, prompts, device, plan.exact_output)
                out["reference_s"] = time.perf_counter() - t0
            else:
                from serving_core.model.random_weights import random_model

                model = random_model(plan.exact_model, device, "float32")
            contiguous = contiguous_greedy(model, prompts, plan.exact_output)
            if reference_kind == "contiguous":
                reference = contiguous
            out["contiguous_equal"] = contiguous == reference
            for org in plan.orgs:
                if time.perf_counter() > deadline:
                    out["stopped"] = f"time limit reached before {org}"
                    break
                t0 = time.perf_counter()
                tokens, adopted, rules = engine_greedy(model, geometry, org, plan, prompts)
                out["orgs"][org] = {
                    "equal": tokens == reference, "adopted_prefix_tokens": adopted,
                    "first_mismatch": _first_mismatch(tokens, reference),
                    "decode_attention": rules.get("decode_attention"),
                    "seconds": time.perf_counter() - t0}
            out["complete"] = len(out["orgs"]) == len(plan.orgs)
            out["all_equal"] = out["complete"] and all(v["equal"] for v in out["orgs"].values())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return out


def _checkpoint(folder, model: str):
    """The tiny checkpoint, written by transformers' own FalconH1ForCausalLM (make_tiny.build,
    as the tests' is) or, where that builder fails (another transformers version), from our
    random weights through safetensors; which one is said."""
    from serving_core.model.make_tiny import build

    try:
        return build(folder, model, tokenizer=False), "transformers FalconH1ForCausalLM"
    except Exception as err:  # noqa: BLE001 - the fallback is recorded with the reason
        from serving_core.model.random_weights import write_checkpoint

        path = write_checkpoint(Path(folder) / "ours", model)
        return path, f"serving_core.model.random_weights ({type(err).__name__}: {err})"


def _first_mismatch(tokens, reference) -> list | None:
    """(request, token index) of the first differing token, None when all are equal."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return [i, j]
        if len(a) != len(b):
            return [i, min(len(a), len(b))]
    return None
