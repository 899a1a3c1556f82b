"""The executor protocol: what the engine asks of whatever runs a scheduled step.

An executor runs one step's plan (`execute`, before publication: the chunks and
the number of checkpoint boundaries they cross), then `commit`s it after the
scheduler has published the step's entries (a real executor writes the published
states into their units; a modelled one has nothing to write). `describe()` says
what it runs, read from the executor itself, under keys of `EXECUTOR_RULE_KEYS`; the
engine's record of a run's rules includes it. An executor that addresses state sets
`reads_state = True` (a modelled one False) and then finds, on each scheduled item, a
`ChunkState` (serving_core.state_manager): the attention unit ids, the composites it
reads and writes and, at commit, where each published state goes. It never reads a
request's state objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# The keys of an engine's effective rules that belong to its executor: what any executor's
# describe() may report, what a spec requests of its executor (EngineSpec.requested_rules)
# and what is checked only once the executor is built (serving_core.builder.preflight).
EXECUTOR_RULE_KEYS = ("executor", "step_model", "profile", "indirection", "paged_state_s",
                      "logit_gemm_s", "logit_row_s", "logit_block_rows", "device", "dtype",
                      "scan_chunk", "prefill_batch_tokens", "kv_codec", "kv_group_heads",
                      "decode_attention", "state_codec")


@dataclass(slots=True)
class ExecutorOutput:
    """What an executor returns for one step.

    duration_s: modelled seconds (virtual clock); a wall-clock engine measures instead.
    sampled: request id -> next token id for the scheduled requests that produce one;
    a request missing here gets the workload's synthetic token (simulated runs).
    logprobs: request id -> (the token's logprob, top alternatives) where its
    SamplingParams asked for them (serving_core/model/sampler.py).
    prompt_logprobs: request id -> [(prompt position i, (logprob of prompt token i given
    the tokens before it, top alternatives))] for the positions this step computed, where
    its SamplingParams set prompt_logprobs.
    """

    duration_s: float = 0.0
    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, tuple] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)


class Executor(Protocol):
    reads_state: bool  # the plan carries a ChunkState per scheduled item

    def execute(self, plan: list, checkpoint_writes: int) -> ExecutorOutput: ...

    def commit(self, plan: list) -> None: ...

    def describe(self) -> dict[str, Any]: ...
