"""`argmax_rows` equals torch.argmax(-1): random rows, ties across and within blocks (the
first maximal index wins), a maximum in the tail past the last whole block, NaN rows."""

from __future__ import annotations

import torch

from serving_core.model.greedy import BLOCK, argmax_rows


def test_argmax_rows_equals_torch_argmax_with_ties_tail_and_nan():
    gen = torch.Generator().manual_seed(0)
    v = 20 * BLOCK + 37
    x = torch.randn(9, v, generator=gen)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    x[1, 5] = x[1, 3000] = x[1, 4000] = 50.0  # tie across blocks: the first wins
    x[2, 700] = x[2, 701] = 50.0  # tie within a block
    x[3, 9] = x[3, v - 1] = 50.0  # tie with the tail
    x[4, v - 2] = 60.0  # maximum only in the tail: falls back
    x[5, 100] = float("nan")  # NaN is the maximum for torch.argmax: falls back
    x[6] = 0.0  # all equal: index 0
    got = argmax_rows(x)
    assert torch.equal(got, x.argmax(-1))
    assert got[1:4].tolist() == [5, 700, 9] and got[4] == v - 2 and got[6] == 0
    y = torch.randn(4, 16 * BLOCK, generator=gen)  # no tail
    y[2, 17] = y[2, 16 * BLOCK - 1] = 9.0
    assert torch.equal(argmax_rows(y), y.argmax(-1))
    assert torch.equal(argmax_rows(y[:1]), y[:1].argmax(-1))  # one row: torch's own


def test_with_the_split_worker_a_batch_is_taken_in_row_halves_with_the_same_indices():
    """SPLIT_ROWS rows or more: the second half of the rows on the worker; ties, a tail
    maximum and NaN rows in either half give torch.argmax's indices."""
    import threading

    from serving_core.model import greedy, split

    gen = torch.Generator().manual_seed(1)
    v = 20 * BLOCK + 37
    x = torch.randn(2 * greedy.SPLIT_ROWS + 3, v, generator=gen)
    x[1, 5] = x[1, 3000] = 50.0
    x[-2, v - 2] = 60.0  # falls back in the worker's half only
    x[-1, 100] = float("nan")
    seen = []
    rows = greedy._argmax_rows
    split.install(1)
    try:
        greedy._argmax_rows = lambda t: (seen.append(threading.current_thread().name), rows(t))[1]
        got = argmax_rows(x)
        few = argmax_rows(x[: greedy.SPLIT_ROWS - 1])
    finally:
        greedy._argmax_rows = rows
        split.close()
    assert torch.equal(got, x.argmax(-1)) and torch.equal(few, x[: greedy.SPLIT_ROWS - 1]
                                                           .argmax(-1))
    assert sorted(seen) == sorted([threading.current_thread().name, "hsl-split",
                                   threading.current_thread().name])
