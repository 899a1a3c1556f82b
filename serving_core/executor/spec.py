"""What an engine's executor is built from: `ExecutorSpec` (carried by EngineSpec as
`executor`) and the executor's engine rules, declared on it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving_core import rules

# external: an engine another program runs (the vLLM arm); the spec still carries its
# scheduler settings, but serving_core builds no engine for it.
EXECUTOR_KINDS = ("simulated", "paced", "torch", "external")


def _torch(value: Any, ex: ExecutorSpec) -> Any:
    return value if ex.kind == "torch" else rules.OMIT


@dataclass(frozen=True)
class ExecutorSpec:
    """The executor of an engine, chosen by `kind` in the builder's registry, and its
    engine rules (fields made with serving_core.rules.rule: what the executor runs, declared
    in its layer; requested, recorded, documented and checked from the declarations).

    simulated / paced: `profile` is the device profile mapping (conf/executor/<name>.yaml,
    resolved) and `indirection_overhead` the extra S1/S2 fraction on top of the profile's;
    paced sleeps each modelled step on a wall clock. torch: `checkpoint`, `device`, `dtype`.
    external: served by another program (vLLM), never built here.
    """

    kind: str = "simulated"
    profile: Mapping[str, Any] | None = None
    indirection_overhead: float = rules.rule(
        0.0, "simulated, paced: extra S1/S2 indirection fraction on top of the profile's "
        "(recorded within `indirection`)", check=rules.is_number, shown="finite numbers",
        normalize=float, identity_neutral=False, requested=lambda value, ex: rules.OMIT)
    checkpoint: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    scan_chunk: int | None = rules.rule(
        None, "torch: tokens per chunk of the prefill SSD scan (null: the model's; the "
        "torch executor configs set 128)", check=rules.optional_integer(1),
        shown="integers >= 1 or null", key="executor.scan_chunk", identity_neutral=False,
        requested=lambda value, ex: _torch(value, ex) if value else rules.OMIT)
    prefill_batch_tokens: int | None = rules.rule(
        None, "torch: prefill chunks over the same span share a forward up to this many "
        "tokens (0: one request per forward; null: the executor's default, 0 over packed KV)",
        check=rules.optional_integer(0), shown="integers >= 0 or null (the executor's default)",
        key="executor.prefill_batch_tokens",
        requested=lambda value, ex: rules.OMIT if value is None else _torch(value, ex))

    def __post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise ValueError(
                f"executor.kind={self.kind!r}: allowed values are {', '.join(EXECUTOR_KINDS)}"
            )
        if self.kind == "torch" and not self.checkpoint:
            raise ValueError("executor.checkpoint: a checkpoint folder is required with torch")
        rules.check_rules(self)
