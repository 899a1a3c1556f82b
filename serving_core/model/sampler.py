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
index) (`token_uniform`). One uniform per token keeps the draw batchable and independent of
the batch; the CDF is searched in two levels (`draw`: 256-token block sums, then within
the block), so a 128k-wide row costs one exp and one sum, not a sequential cumsum.
Logprobs are log_softmax of the raw row.
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


@torch.inference_mode()  # the model's logits are inference tensors, rewritten in place
def sample(logits: torch.Tensor, rows) -> tuple[list[int], list[Logprobs | None]]:
    """`rows`: per row of the (b, V) logits, (SamplingParams or None, request) where the
    request gives its tokens (`num_prompt`, `num_generated`, `token_ids`). The rows of
    processed requests are overwritten in place (float32 logits; a batch's logits are read
    by nothing after its sampling), which spares a copy of the batch per step."""
    tokens = argmax_rows(logits).tolist()
    logprobs: list[Logprobs | None] = [None] * len(tokens)
    special = [i for i, (p, _) in enumerate(rows) if not _plain(p)]
    if not special:
        return tokens, logprobs
    raw = {i: logits[i].float().log_softmax(-1) for i in special
           if rows[i][0].logprobs is not None}  # before any rule moves the row
    x = logits if logits.dtype == torch.float32 else logits.float()
    drawn = []
    for i in special:
        p, req = rows[i]
        if p.changes_logits:
            x[i] = process_logits(x[i], p, req)
        if p.greedy:
            tokens[i] = int(x[i].argmax())
            continue
        x[i].div_(p.temperature)
        if p.min_p or p.top_k or p.top_p < 1.0:
            x[i] = truncate(x[i], p)
        drawn.append(i)
    if drawn:
        u = [token_uniform(rows[i][0], rows[i][1].num_generated) for i in drawn]
        sub = x if len(drawn) == x.shape[0] else x[drawn]
        for i, tok in zip(drawn, draw(sub, u), strict=True):
            tokens[i] = tok
    for i, lsm in raw.items():
        logprobs[i] = token_logprobs(lsm, tokens[i], rows[i][0].logprobs)
    return tokens, logprobs


def draw(x: torch.Tensor, u: list[float], block: int = 256) -> list[int]:
    """Per row of logits `x` (b, V), the first token whose cumulative probability exceeds
    u x total (inverse CDF), searched over block sums and then inside the chosen block.
    A token of probability 0 (masked) is never chosen: the block is one whose cumulative
    mass passes the target, and inside it the choice moves to a token of positive mass."""
    b, vocab = x.shape
    w = x.sub_(x.amax(-1, keepdim=True)).exp_()  # in place: unnormalized probabilities
    pad = (-vocab) % block
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    blocks = w.view(b, -1, block)
    cum = blocks.sum(-1).double().cumsum(-1)  # (b, blocks)
    target = torch.tensor(u, dtype=torch.float64)[:, None] * cum[:, -1:]
    bi = torch.searchsorted(cum, target, right=True)[:, 0].clamp_(max=cum.shape[1] - 1)
    rows = torch.arange(b)
    before = torch.where(bi > 0, cum[rows, (bi - 1).clamp(min=0)], torch.zeros((), dtype=cum.dtype))
    inner = blocks[rows, bi].double()  # (b, block)
    j = torch.searchsorted(inner.cumsum(-1), (target[:, 0] - before)[:, None], right=True)
    j = j[:, 0].clamp_(max=block - 1)
    out = []
    for r in range(b):
        k = int(j[r])
        if inner[r, k] <= 0:  # rounding moved it off the mass: the nearest positive token
            positive = torch.nonzero(inner[r] > 0)[:, 0]
            after = positive[positive >= k]
            k = int(after[0] if after.numel() else positive[-1])
        out.append(int(bi[r]) * block + k)
    return out


def sample_row(row: torch.Tensor, p: SamplingParams, req) -> tuple[int, Logprobs | None]:
    """One row's token (and logprobs): `sample` of a batch of one (`row` is not changed)."""
    tokens, lps = sample(row[None].clone(), [(p, req)])
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


def token_logprobs(raw: torch.Tensor, token: int, k: int) -> Logprobs:
    """(the token's logprob, top k) of a row's log_softmax."""
    top = ()
    if k:
        values, ids = torch.topk(raw, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return float(raw[token]), top
