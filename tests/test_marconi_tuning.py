"""Marconi's weight tuned as Marconi tunes it (serving_core/memory/marconi_tuning.py): the
replay on hand-built histories where the right weight is known, when tunings run, and the
engine's record of them."""

from __future__ import annotations

from conftest import compose_config

from serving_core.memory.cache_policy import CachePolicy
from serving_core.memory.marconi_tuning import (
    ALPHA_GRID,
    AlphaTuner,
    best_alpha,
    replay_hit_rate,
    replayed,
)

admitted = CachePolicy.admitted_boundaries


class Linear:
    """F(n) = n: a deeper checkpoint saves more (only the order matters after min-max)."""

    @staticmethod
    def prefix(n: int) -> float:
        return float(n)


def _request(tokens: list[int], num_prompt: int):
    """Block 1, grid 4: chain keys of every token, the final state at the prompt's end."""
    keys, parent = [], 0
    for t in tokens:
        parent = hash((parent, t))
        keys.append(parent)
    return replayed(keys, num_prompt, len(tokens), 1, 4)


SHARED = list(range(100, 108))  # an 8-token shared prefix: boundary 8, F = 8


def _long(i):
    return _request([*SHARED, 900 + i, 950 + i], 10)  # final (10 // 4) x 4 = 8: the prefix


def _short(i):
    return _request([500 + 10 * i + k for k in range(5)], 5)  # unique, final boundary 4


def test_the_shared_prefix_needs_alpha_above_one():
    """Capacity 2; L1, U1, U2, L2, U3, U4, L3 (L: the 8-token prefix plus 2 own tokens;
    U: 5 unique tokens, checkpoint at 4). At U2 the candidates are the prefix (oldest:
    recency 0, efficiency 1) and U1 (recency 1, efficiency 0): scores alpha and 1, so the
    prefix is evicted unless alpha > 1 (a tie goes to the older), and LRU order then
    misses L2 and L3. With alpha > 1 the prefix stays: L2 and L3 hit 8 tokens each.
    Prompts: 3 x 10 + 4 x 5 = 50 tokens; hit rate 16 / 50. The smallest such alpha of the
    grid is 1.1."""
    window = [_long(1), _short(1), _short(2), _long(2), _short(3), _short(4), _long(3)]
    rate = {a: replay_hit_rate(window, 2, a, Linear, 1, 4, admitted) for a in ALPHA_GRID}
    assert all(rate[a] == 0.0 for a in ALPHA_GRID if a <= 1.0)
    assert all(rate[a] == 16 / 50 for a in ALPHA_GRID if a > 1.0)
    assert best_alpha(window, 2, Linear, 1, 4, admitted) == (1.1, 16 / 50)


def test_lru_wins_when_deep_states_are_never_reused():
    """Capacity 2; a 4-token prefix reused by every short request (final boundary 4 = the
    prefix), and between them long unique requests whose end states (boundary 8, F 8) are
    never asked for again. With alpha 0 the shared prefix (touched on every hit) is the
    newest entry and survives; alpha 2 keeps the deep unique states instead, so the best
    weight is 0 (LRU)."""
    prefix = [1, 2, 3, 4]

    def short(i):
        return _request([*prefix, 60 + i], 5)

    def long(i):
        return _request([700 + 10 * i + k for k in range(9)], 9)

    window = [short(0), long(0), short(1), long(1), short(2), long(2), short(3), short(4)]
    alpha, rate = best_alpha(window, 2, Linear, 1, 4, admitted)
    assert alpha == 0.0
    assert rate > replay_hit_rate(window, 2, 2.0, Linear, 1, 4, admitted)


def test_tunings_run_after_the_bootstrap_window_and_every_window_after():
    """Alpha 0 until the first eviction, which comes after 3 finished requests: the window
    is 5 x 3 = 15, the first tuning runs at 18 finished and the next at 33, each on the 15
    most recent requests."""
    tuner = AlphaTuner()
    due = []
    for n in range(1, 40):
        if n == 4:
            tuner.on_eviction()
        if tuner.observe(_short(n)):
            due.append(n)
            tuner.tune(2, Linear, 1, 4, admitted)
    assert due == [18, 33]
    assert [h[0] for h in tuner.history] == [18, 33]
    assert all(h[3] == 15 for h in tuner.history)
    assert tuner.alpha == 0.0  # unique requests: nothing hits under any weight


def test_fixed_weight_is_kept_and_the_tuned_one_recorded():
    from experiments.runners.cell import run_cell

    cfg = compose_config("org=d0_marconi", "budget=b63", "workload.num_requests=10",
                         "engine.marconi_weight=fixed", "engine.marconi_alpha=0.5",
                         "write_ledgers=false")
    res = run_cell(cfg)
    assert res.engine_config["marconi_weight"] == "fixed"
    assert res.engine_config["marconi_alpha"] == 0.5
    assert res.engine_config["marconi_tuning"] is None
