"""The token choice of a batch of logits under each row's SamplingParams.

`sample(logits, rows)` returns each row's token and, where asked, its logprobs. Rows with
no parameters, or greedy ones whose logits no rule moves and that want no logprobs, take
the batch's raw argmax (`argmax_rows`): exactly the greedy choice of a greedy-only server,
bit for bit. Every other row is processed alone in float32 in vLLM v1's order
(serving_core/sampling_params.py): logit_bias and allowed_token_ids, the min_tokens mask,
repetition / frequency / presence penalties, then greedy argmax, or temperature, min_p,
top_k, top_p and the exponential-race draw (`probs / q`, q ~ Exp(1): vLLM's random_sample)
with a generator seeded by (seed, output index). Logprobs are log_softmax of the raw row.
"""

from __future__ import annotations

import torch

from serving_core.model.greedy import argmax_rows
from serving_core.sampling_params import SamplingParams, token_seed

# A row's logprobs: (the chosen token's logprob, ((token id, logprob), ...) best first)
Logprobs = tuple[float, tuple[tuple[int, float], ...]]


def _plain(p: SamplingParams | None) -> bool:
    return p is None or (p.greedy and p.logprobs is None and not p.changes_logits)


def sample(logits: torch.Tensor, rows) -> tuple[list[int], list[Logprobs | None]]:
    """`rows`: per row of the (b, V) logits, (SamplingParams or None, request) where the
    request gives its tokens (`num_prompt`, `num_generated`, `token_ids`)."""
    tokens = argmax_rows(logits).tolist()
    logprobs: list[Logprobs | None] = [None] * len(tokens)
    for i, (params, req) in enumerate(rows):
        if not _plain(params):
            tokens[i], logprobs[i] = sample_row(logits[i], params, req)
    return tokens, logprobs


def process_logits(x: torch.Tensor, p: SamplingParams, req) -> torch.Tensor:
    """The logits the choice reads (float32, a new tensor): bias, allowed ids, the
    min_tokens mask, penalties (vLLM's apply_penalties, OpenAI's definition)."""
    x = x.float().clone()
    vocab = x.shape[0]
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(p.allowed_token_ids)] = True
        x.masked_fill_(~keep, float("-inf"))
    for token, bias in p.logit_bias:
        x[token] += bias
    if p.min_tokens and req.num_generated < p.min_tokens and p.stop_ids:
        x[list(p.stop_ids)] = float("-inf")
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        output = torch.tensor(req.token_ids(req.num_prompt, req.num_tokens), dtype=torch.long)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(req.token_ids(0, req.num_prompt), dtype=torch.long)] = True
            seen[output] = True
            scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, scaled, x)
        counts = torch.bincount(output, minlength=vocab).to(torch.float32)
        x -= p.frequency_penalty * counts
        x -= p.presence_penalty * (counts > 0).to(torch.float32)
    return x


def truncate(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with min_p, top_k and top_p applied (vLLM's order and
    tie rules: top_k keeps every token tied with the k-th, top_p keeps at least one)."""
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    vocab = x.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        ordered, index = x.sort()  # ascending, as vLLM's apply_top_k_top_p
        cum = ordered.softmax(-1).cumsum(-1)
        drop = cum <= 1.0 - p.top_p
        drop[-1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(0, index, ordered)
    return x


def sample_row(row: torch.Tensor, p: SamplingParams, req) -> tuple[int, Logprobs | None]:
    x = process_logits(row, p, req)
    if p.greedy:
        token = int(x.argmax())
    else:
        probs = truncate(x, p).softmax(-1)
        gen = torch.Generator(device=probs.device)
        if p.seed is None:
            gen.seed()
        else:
            gen.manual_seed(token_seed(p.seed, req.num_generated))
        q = torch.empty_like(probs).exponential_(generator=gen)
        token = int((probs / q).argmax())
    if p.logprobs is None:
        return token, None
    raw = row.float().log_softmax(-1)
    top = []
    if p.logprobs:
        values, ids = torch.topk(raw, p.logprobs)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return token, (float(raw[token]), tuple(top))
