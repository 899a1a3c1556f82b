"""Per-request sampling parameters and the stop rule, as vLLM's SamplingParams defines them.

A request's `SamplingParams` travels on its spec (`spec.sampling`; None is greedy with
EOS ignored, what every simulated and in-process run does). The executor's sampler
(serving_core/model/sampler.py) reads the logit rules; the engine reads the stop rule
(`stops`) when it hands out each token, so a stop token ends the request in the step that
produced it, on any executor.

Order and meaning follow vLLM v1's sampler: logit_bias and allowed_token_ids, the
min_tokens mask of the stop tokens, penalties (repetition over prompt and output tokens,
frequency and presence over output tokens, OpenAI's definition), then greedy (temperature
below 1e-5) or temperature, min_p, top_k, top_p and a random draw. Logprobs are those of the
raw model distribution (vLLM's default `raw_logprobs`).

Randomness is keyed, not stateful: the draw for a request's j-th output token uses a
uniform from a generator seeded with (seed, j) (`token_seed`), so a seeded request gives
the same tokens however it is batched, preempted or recomputed (up to the fp32 rounding by
which a batch's logits differ from a lone row's), and two seeds give independent draws.
The draws are not vLLM's (its generator is per request and stateful, its noise per vocab
entry): the same seed gives different tokens on the two servers, as it does across any two
implementations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below this is greedy
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on the wire): every token
    min_p: float = 0.0
    seed: int | None = None  # None: the server draws one per request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None  # top alternatives to return per token (0: the token's own)
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = True
    min_tokens: int = 0
    # top alternatives of each prompt token's logprob (echo with logprobs): computed from
    # the prefill's logits, so such a request reads no cached prefix before its first token
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end the request: stop_token_ids, and EOS unless ignored."""
        return self.stop_token_ids if self.ignore_eos else self.stop_token_ids | self.eos_token_ids

    @property
    def changes_logits(self) -> bool:
        """Whether any rule moves the logits before the choice (else greedy is the raw
        argmax)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None
                    or (self.min_tokens and self.stop_ids)
                    or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def stops(self, token: int, num_generated: int) -> bool:
        """Whether `token`, the request's `num_generated`-th output token, ends it
        (vLLM's check_stop: never before min_tokens)."""
        return num_generated >= self.min_tokens and token in self.stop_ids

    def with_seed(self, seed: int) -> SamplingParams:
        from dataclasses import replace

        return replace(self, seed=int(seed))


GREEDY = SamplingParams()


def token_seed(seed: int, index: int) -> int:
    """The generator seed of a request's `index`-th output token (a 63-bit hash of both)."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED
