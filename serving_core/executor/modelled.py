"""Executors that run the step-time model instead of a model: no data, only durations.

`SimulatedExecutor` returns each step's modelled duration for a virtual clock;
`PacedExecutor` sleeps it, so a wall-clock engine (the HTTP server without a
model) serves at the modelled pace.
"""

from __future__ import annotations

import time
from typing import Any

from serving_core.executor.base import ExecutorOutput
from serving_core.state_codec import DEFAULT_STATE_CODEC


class SimulatedExecutor:
    """The step-time model as an executor."""

    kind = "simulated"
    reads_state = False  # durations only: the plan carries no state views

    def __init__(self, step_model) -> None:
        self.step_model = step_model

    def execute(self, plan: list, checkpoint_writes: int) -> ExecutorOutput:
        new_tokens = [item.num_new for item in plan]
        contexts = [item.context for item in plan]
        model = self.step_model
        if not getattr(model, "prices_sampling", False):
            return ExecutorOutput(model.step_seconds(new_tokens, contexts, checkpoint_writes))
        sampling = sum(it.samples for it in plan)
        return ExecutorOutput(model.step_seconds(new_tokens, contexts, checkpoint_writes,
                                                 num_sampling=sampling))

    def commit(self, plan: list) -> None:
        """Nothing to write: a modelled step holds no state."""

    def describe(self) -> dict[str, Any]:
        model = self.step_model
        indirection = getattr(model, "indirection", None)
        if indirection is None:
            indirection = getattr(model, "effective_indirection", 0.0)
        device = getattr(model, "device", None)
        out = {
            "executor": self.kind,
            "step_model": getattr(model, "kind", type(model).__name__),
            "profile": getattr(device, "name", None),
            "indirection": float(indirection),
        }
        codec = getattr(getattr(model, "geometry", None), "state_codec", DEFAULT_STATE_CODEC)
        if codec != DEFAULT_STATE_CODEC:  # the step model prices this codec's bytes and work
            out["state_codec"] = codec
        paged = getattr(model, "paged_s_per_seq", 0.0)
        if paged:  # the additive model's paged-state gathers, seconds per scheduled sequence
            out["paged_state_s"] = float(paged)
        gemm_s = getattr(model, "_logit_gemm_s", 0.0)
        row_s = getattr(model, "_logit_row_s", 0.0)
        if gemm_s or row_s:  # the additive model's logits GEMMs (AdditiveStepModel.logit_seconds)
            out.update(logit_gemm_s=float(gemm_s), logit_row_s=float(row_s),
                       logit_block_rows=int(model.logit_block_rows))
        return out


class PacedExecutor(SimulatedExecutor):
    """The simulated executor on a wall clock: each step sleeps its modelled duration."""

    kind = "paced"

    def execute(self, plan: list, checkpoint_writes: int) -> ExecutorOutput:
        out = super().execute(plan, checkpoint_writes)
        time.sleep(out.duration_s)
        return out
