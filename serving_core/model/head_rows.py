"""The LM head's rows, padded so that a row's logits do not depend on the other rows.

The torch executor runs one head product per step over the rows that sample (decode rows
and the final rows of prefill chunks that complete their prompt), so the same row meets
0 to hundreds of others. MKL's fp32 GEMM on the CPUs measured rounds a row of a product of
1-3 rows (or of a 1-3-row remainder of one thread's share of the rows) differently from a
row in a group of 4, by up to 5e-7. Zero rows appended up to a multiple of 4 make every row
the same bits alone or among any others: checked at 1-4 intra-op threads for 1-40, 63-67,
100, 127-131, 140, 197, 255-257, 383 and 511 rows (tests/test_lm_head.py keeps a cheap
check). The head is bound by reading its weight, so up to 3 padded rows cost nothing
measurable.
"""

from __future__ import annotations

import torch

HEAD_ROW_MULTIPLE = 4


def pad_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows (n, D) with zero rows appended up to a multiple of HEAD_ROW_MULTIPLE
    (the rows themselves when n already is one)."""
    extra = -rows.shape[0] % HEAD_ROW_MULTIPLE
    if not extra:
        return rows
    return torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
