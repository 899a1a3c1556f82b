"""A request as the engine tracks it: tokens, progress, held state and timestamps."""

from __future__ import annotations

import hashlib
import math
from enum import IntEnum

from serving_core.memory.objects import NULL

GENERATED_TOKEN_SPACE = (
    128_256  # ids of synthetic generated tokens stay inside a Llama-3 vocabulary
)


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


def salt_root(salt: str) -> int:
    """Deterministic root of a request's hash chain (the cache_salt); '' under SHARE."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


class Request:
    """Progress of one request across admission episodes.

    `num_computed` tokens have KV and recurrent state; the request needs compute
    while num_computed < num_tokens (prompt + generated). A step that reaches
    num_tokens samples the next token. Block keys chain over all tokens, so a
    resumed request finds its own published prefix, generated tokens included.
    """

    __slots__ = (
        "spec",
        "rid",
        "tokens",
        "num_prompt",
        "target_output",
        "num_generated",
        "num_tokens",
        "num_computed",
        "block_tokens",
        "keys",
        "_root",
        "status",
        "attn",
        "working",
        "adopted",
        "dests",
        "retained",
        "lagging",
        "pin",
        "episodes",
        "preemptions",
        "prefill_target",
        "arrival_s",
        "start_s",
        "first_token_s",
        "finish_s",
        "adopted_first",
        "adopted_resume",
        "alloc_fail_logged",
        "junction",
        "memo_hit",
        "memo_version",
        "blocked",
        "next_token",
        "sampling",
        "room_end",
        "refusal",
    )

    def __init__(self, spec, block_tokens: int) -> None:
        self.spec = spec
        self.rid = int(spec.request_id)
        self.tokens: list[int] | None = None  # materialized on first use (see _token_list)
        self.num_prompt = len(spec.prompt)
        self.target_output = int(spec.output_tokens)
        if self.num_prompt < 1 or self.target_output < 1:
            raise ValueError(f"request {self.rid}: prompt and output must have >= 1 token")
        self.num_generated = 0
        self.num_tokens = self.num_prompt  # prompt + generated, kept by append_generated
        self.num_computed = 0
        self.block_tokens = block_tokens
        self.keys: list[int] = []
        self._root = salt_root(spec.salt)
        self.status = Status.WAITING
        self.attn: list = []  # attention block objects, block i covers [i B, (i+1) B)
        self.working = NULL  # composite the next tokens are computed into
        self.adopted = NULL  # checkpoint read as initial state, released after the first step
        self.dests: list = []  # destination composites reserved for boundaries in this chunk
        # the manager's promise to the scheduler: a decode from any position below this
        # needs no new unit and crosses no boundary (serving_core/state_manager.py _allocate)
        self.room_end = 0
        self.retained: list = []  # published checkpoints pinned by producer-side retention
        self.lagging: list = []  # state_blocks=vllm_align: released at the next allocation
        self.pin = NULL  # preemption-time pin on the rightmost checkpoint
        self.episodes = 0
        self.preemptions = 0
        self.prefill_target = 0
        self.arrival_s = float(spec.arrival_s)
        self.start_s = math.nan
        self.first_token_s = math.nan
        self.finish_s = math.nan
        self.refusal = ""  # why the engine refused it at arrival ("": not refused)
        self.adopted_first = 0
        self.adopted_resume = 0
        self.alloc_fail_logged = False
        self.junction = 0  # stop_at_junction: end of the cached attention prefix, or 0
        self.memo_hit = None  # last admission lookup and the cache version it saw
        self.memo_version = -1
        # (cache mark, pool gains, token budget) when its admission last failed with
        # requests running; None once admitted (serving_core/scheduler.py _try_admit and
        # _cache_mark)
        self.blocked: tuple[int, int, int] | None = None
        self.next_token: int | None = None  # token a real executor sampled for this step
        # stop rules of a served request (serving_core/sampling_params.py), or None
        self.sampling = getattr(spec, "sampling", None)

    @property
    def prefill_end(self) -> int:
        """Where prefill ends: the prompt's end, or the known tokens less one on a resume
        (vLLM's `max(num_prompt_tokens, num_tokens - 1)`)."""
        return max(self.num_prompt, self.num_tokens - 1)

    def ensure_keys(self, num_blocks: int) -> list[int]:
        """Chain keys of the first `num_blocks` full blocks (computed once, extended lazily)."""
        keys = self.keys
        if len(keys) >= num_blocks:
            return keys
        tokens, bt = self._token_list(), self.block_tokens
        parent = keys[-1] if keys else self._root
        for i in range(len(keys), num_blocks):
            parent = hash((parent, *tokens[i * bt : (i + 1) * bt]))
            keys.append(parent)
        return keys

    def lookup_keys(self) -> list[int]:
        """Keys of the full blocks of all known tokens but the last (one is always computed)."""
        n = (self.num_tokens - 1) // self.block_tokens
        return self.ensure_keys(n)[:n]

    def _token_list(self) -> list[int]:
        """Prompt + generated token ids as a list; built lazily so a long waiting queue
        holds only the compact prompt arrays."""
        if self.tokens is None:
            self.tokens = self.spec.prompt.tolist()
        return self.tokens

    def release_tokens(self) -> None:
        """Drop token ids and keys of a finished request (counts and timestamps stay)."""
        self.tokens = []
        self.keys = []

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + generated (what an executor feeds the model)."""
        return self._token_list()[start:end]

    def next_generated_token(self) -> int:
        """The synthetic id of the next generated token (simulated executors)."""
        j = self.num_generated
        return (self.rid * 1_000_003 + j * 7_919 + 17) % GENERATED_TOKEN_SPACE

    def append_generated(self) -> None:
        """Append the token an executor sampled (`next_token`), else the synthetic one."""
        token = self.next_token
        if token is None:
            token = self.next_generated_token()
        else:
            self.next_token = None
        self._token_list().append(token)
        self.num_generated += 1
        self.num_tokens += 1
