"""The sampler (serving_core/model/sampler.py) against hand-computed expectations: greedy
rows are the raw argmax bit for bit, each logit rule moves the logits as vLLM defines it,
seeded draws repeat per (seed, output index) and follow the distribution they draw from."""

from __future__ import annotations

import math

import pytest
import torch

from serving_core.model.greedy import argmax_rows
from serving_core.model.sampler import process_logits, sample, sample_row, truncate
from serving_core.sampling_params import SamplingParams, token_seed


class _Req:
    """What the sampler reads of a request: its prompt and generated tokens."""

    def __init__(self, prompt, output=()):
        self.tokens = list(prompt) + list(output)
        self.num_prompt = len(prompt)
        self.num_generated = len(output)

    @property
    def num_tokens(self):
        return len(self.tokens)

    def token_ids(self, start, end):
        return self.tokens[start:end]


def test_greedy_rows_are_the_raw_argmax_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(5, 128_256)
    rows = [(None, _Req([1])), (SamplingParams(), _Req([1])),
            (SamplingParams(temperature=0.0, stop_token_ids=frozenset({3})), _Req([1]))] * 1
    rows += [(SamplingParams(temperature=0.0, seed=3), _Req([2])), (None, _Req([2]))]
    tokens, lps = sample(logits, rows)
    assert tokens == argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_penalties_as_openai_and_vllm_define_them():
    x = torch.tensor([1.0, 2.0, -1.0, 3.0, 0.5, -2.0])
    req = _Req(prompt=[1], output=[2, 2, 4])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(x, p, req)
    # repetition over prompt and output tokens {1, 2, 4}: positive / 2, negative x 2;
    # then frequency x count and presence over the output tokens {2: 2, 4: 1}
    want = [1.0, 2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.25, 3.0, 0.5 / 2 - 0.5 - 0.25, -2.0]
    assert got.tolist() == pytest.approx(want)
    assert x.tolist() == [1.0, 2.0, -1.0, 3.0, 0.5, -2.0]  # the input is not modified


def test_bias_allowed_ids_and_the_min_tokens_mask():
    x = torch.zeros(6)
    p = SamplingParams(logit_bias=((1, 5.0), (2, -100.0)), allowed_token_ids=(1, 2, 3))
    got = process_logits(x, p, _Req([0]))
    assert got.tolist() == [-math.inf, 5.0, -100.0, 0.0, -math.inf, -math.inf]
    p = SamplingParams(min_tokens=2, stop_token_ids=frozenset({3}),
                       eos_token_ids=frozenset({5}), ignore_eos=False)
    assert process_logits(x, p, _Req([0], [4])).tolist() == [0, 0, 0, -math.inf, 0, -math.inf]
    assert process_logits(x, p, _Req([0], [4, 4])).tolist() == [0.0] * 6  # min_tokens reached
    ignored = SamplingParams(min_tokens=2, eos_token_ids=frozenset({5}), ignore_eos=True)
    assert process_logits(x, ignored, _Req([0])).tolist() == [0.0] * 6


def test_temperature_min_p_top_k_top_p():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))
    keep = lambda t: [i for i, v in enumerate(t.tolist()) if v > -math.inf]  # noqa: E731
    assert truncate(logp, SamplingParams(temperature=2.0)).tolist() == logp.tolist()
    # min_p 0.2: drop tokens below 0.2 x 0.5 = 0.1
    assert keep(truncate(logp, SamplingParams(temperature=1.0, min_p=0.2))) == [0, 1, 2]
    assert keep(truncate(logp, SamplingParams(temperature=1.0, top_k=2))) == [0, 1]
    # top_p 0.8: ascending cumulative 0.03, 0.10, 0.25, 0.50, 1.0; drop those <= 0.2
    assert keep(truncate(logp, SamplingParams(temperature=1.0, top_p=0.8))) == [0, 1, 2]
    assert keep(truncate(logp, SamplingParams(temperature=1.0, top_p=0.75))) == [0, 1]
    assert keep(truncate(logp, SamplingParams(temperature=1.0, top_p=1e-6))) == [0]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_seeded_draws_repeat_per_output_index_and_follow_the_distribution(temperature):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * temperature
    probs = (logits / temperature).softmax(-1)  # = [0.5, 0.3, 0.15, 0.05]
    p = SamplingParams(temperature=temperature, seed=11)
    draws = [sample_row(logits, p, _Req([0], [9] * j))[0] for j in range(4000)]
    again = [sample_row(logits, p, _Req([0], [9] * j))[0] for j in range(50)]
    assert again == draws[:50]  # the same (seed, index), the same token
    other = [sample_row(logits, p.with_seed(12), _Req([0], [9] * j))[0] for j in range(50)]
    assert other != draws[:50]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    # 4,000 draws: each frequency within 4 standard errors of its probability
    se = (probs * (1 - probs) / len(draws)).sqrt()
    assert ((freq - probs).abs() < 4 * se).all(), freq
    assert token_seed(11, 0) != token_seed(11, 1) != token_seed(12, 1)


def test_a_batch_draws_what_each_row_draws_alone():
    torch.manual_seed(1)
    logits = torch.randn(4, 1000)
    params = [SamplingParams(temperature=0.8, seed=s, top_k=k, top_p=tp)
              for s, k, tp in ((1, 0, 1.0), (2, 40, 1.0), (3, 0, 0.9), (4, 5, 0.5))]
    reqs = [_Req([0], [7] * j) for j in range(4)]
    batch, _ = sample(logits.clone(), list(zip(params, reqs, strict=True)))  # rows rewritten
    alone = [sample_row(logits[i], params[i], reqs[i])[0] for i in range(4)]
    assert batch == alone
    for i, tok in enumerate(batch):  # inside each row's truncation
        kept = truncate(logits[i] / 0.8, params[i])
        assert kept[tok] > -math.inf


def test_logprobs_are_the_raw_distribution_with_top_alternatives():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    p = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=5.0)
    token, (lp, top) = sample_row(logits, p, _Req([0]))
    raw = logits.log_softmax(-1)
    # the penalty moved the choice (2 / 5 < 1) but logprobs are the raw model's
    assert token == 1 and lp == pytest.approx(float(raw[1]))
    assert [t for t, _ in top] == [0, 1]
    assert [v for _, v in top] == pytest.approx(raw[:2].tolist())
    _, (lp0, top0) = sample_row(logits, SamplingParams(logprobs=0), _Req([0]))
    assert top0 == () and lp0 == pytest.approx(float(raw[0]))


def test_stop_rule():
    p = SamplingParams(stop_token_ids=frozenset({7}), eos_token_ids=frozenset({2}),
                       ignore_eos=False, min_tokens=3)
    assert not p.stops(7, 2) and p.stops(7, 3) and p.stops(2, 4) and not p.stops(5, 9)
    assert not SamplingParams(eos_token_ids=frozenset({2})).stops(2, 5)  # EOS ignored


def test_inverse_cdf_draw_by_hand():
    from serving_core.model.sampler import draw

    x = torch.tensor([[0.1, 0.0, 0.2, 0.7, 0.0]]).log()  # zeros are masked (-inf)
    # cumulative 0.1, 0.1, 0.3, 1.0, 1.0: the first token whose cumulative mass exceeds u
    for block in (2, 256):
        us = (0.0, 0.05, 0.0999, 0.1001, 0.29, 0.31, 0.9999)
        got = [draw(x.clone(), [u], block)[0] for u in us]  # draw overwrites its input
        assert got == [0, 0, 0, 2, 2, 3, 3], block
    wide = torch.full((3, 1000), float("-inf"))
    wide[0, 999], wide[1, 0], wide[2, 517] = 0.0, 0.0, 0.0  # one token left in each row
    assert draw(wide, [0.5, 0.999, 0.0]) == [999, 0, 517]
