"""The token choice of a batch of logits under each row's SamplingParams.

`sample(logits, rows)` returns each row's token and, where asked, its logprobs. Rows with
no parameters, or greedy ones whose logits no rule moves and that want no logprobs, take
the batch's raw argmax (`argmax_rows`): exactly the greedy choice of a greedy-only server,
bit for bit. The other rows are copied to float32 and processed in vLLM v1's order
(serving_core/sampling_params.py): per row, logit_bias and allowed_token_ids, the
min_tokens mask, repetition / frequency / presence penalties; then greedy rows take the
argmax, random rows are divided by their temperatures, truncated per row (min_p, top_k,
top_p) and drawn together by inverse CDF: the first token whose cumulative probability
exceeds u x total, with one uniform u per token from a generator seeded by (seed, output
index) (`token_uniform`). One uniform per token keeps the draw batchable (softmax, cumsum
and searchsorted over the batch, not a 128k-wide noise tensor per row) and independent of
the batch. Logprobs are log_softmax of the raw row.
"""

from __future__ import annotations

import random

import torch

from serving_core.model.greedy import argmax_rows
from serving_core.sampling_params import SamplingParams, token_seed

# A row's logprobs: (the chosen token's logprob, ((token id, logprob), ...) best first)
Logprobs = tuple[float, tuple[tuple[int, float], ...]]


def _plain(p: SamplingParams | None) -> bool:
    return p is None or (p.greedy and p.logprobs is None and not p.changes_logits)


def token_uniform(p: SamplingParams, index: int) -> float:
    """The uniform in [0, 1) that draws a request's `index`-th output token (a fresh random
    one when the request has no seed)."""
    if p.seed is None:
        return random.random()
    return random.Random(token_seed(p.seed, index)).random()


def sample(logits: torch.Tensor, rows) -> tuple[list[int], list[Logprobs | None]]:
    """`rows`: per row of the (b, V) logits, (SamplingParams or None, request) where the
    request gives its tokens (`num_prompt`, `num_generated`, `token_ids`)."""
    tokens = argmax_rows(logits).tolist()
    logprobs: list[Logprobs | None] = [None] * len(tokens)
    special = [i for i, (p, _) in enumerate(rows) if not _plain(p)]
    if not special:
        return tokens, logprobs
    x = logits[special].float().clone()
    params = [rows[i][0] for i in special]
    for j, i in enumerate(special):
        if params[j].changes_logits:
            x[j] = process_logits(x[j], params[j], rows[i][1])
    greedy = [j for j, p in enumerate(params) if p.greedy]
    if greedy:
        for j, tok in zip(greedy, argmax_rows(x[greedy]).tolist(), strict=True):
            tokens[special[j]] = tok
    drawn = [j for j, p in enumerate(params) if not p.greedy]
    if drawn:
        xr = x[drawn] / torch.tensor([[params[j].temperature] for j in drawn])
        for k, j in enumerate(drawn):
            if params[j].min_p or params[j].top_k or params[j].top_p < 1.0:
                xr[k] = truncate(xr[k], params[j])
        u = torch.tensor([[token_uniform(params[j], rows[special[j]][1].num_generated)]
                          for j in drawn], dtype=torch.float32)
        cdf = xr.softmax(-1).cumsum(-1)
        picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        picks = picks.clamp_(max=x.shape[1] - 1)[:, 0].tolist()
        for j, tok in zip(drawn, picks, strict=True):
            tokens[special[j]] = tok
    for j, i in enumerate(special):
        if params[j].logprobs is not None:
            logprobs[i] = _logprobs(logits[i], tokens[i], params[j].logprobs)
    return tokens, logprobs


def sample_row(row: torch.Tensor, p: SamplingParams, req) -> tuple[int, Logprobs | None]:
    """One row's token (and logprobs): `sample` of a batch of one."""
    tokens, lps = sample(row[None], [(p, req)])
    return tokens[0], lps[0]


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
    """Temperature-scaled logits (`x` already divided by the temperature) with min_p, top_k
    and top_p applied (vLLM's order and tie rules: top_k keeps every token tied with the
    k-th, top_p keeps at least one)."""
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


def _logprobs(row: torch.Tensor, token: int, k: int) -> Logprobs:
    raw = row.float().log_softmax(-1)
    top = ()
    if k:
        values, ids = torch.topk(raw, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return float(raw[token]), top
