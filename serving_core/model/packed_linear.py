"""oneDNN-prepacked copies of fp32 linear weights, used only where they give the plain bits.

vLLM's CPU build runs its linear layers through oneDNN with weights reordered once at load.
On the 2-core machine at one intra-op thread, oneDNN's product over a prepacked weight gives
F.linear's (MKL's) bits for 4 or more rows when the inner dimension is 128 (the tiny
Falcon-H1's projections from the hidden state and its LM head), and is faster where MKL's
small-row sgemm wastes time: the 128,256 x 128 head at 4 rows takes 6.5 ms against 12.6-18
(docs/real_path.md section 4). It rounds differently for 1-3 rows, at two intra-op threads
(rows 5-11 of 256 x 128), and for inner dimensions of 256 and 768 at every row count. So:

- a weight is packed at load only when it is fp32 on the CPU, large enough (MIN_WEIGHT
  elements: below that oneDNN's call costs more than it saves), and its packed product gives
  the plain product's bits on CHECK_ROWS random rows at one thread (checked once per shape
  on the machine at hand; a shape that fails stays plain);
- a product uses the packed copy only with MIN_ROWS or more rows, at one intra-op thread,
  while the weight is the tensor packed and unchanged; everything else runs the plain op.

`install("off")` (the server's `--packed-linear off`) packs nothing from then on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

MODES = ("auto", "off")  # `--packed-linear` values
MIN_ROWS = 4
MIN_WEIGHT = 1 << 18  # elements (1 MiB fp32): smaller weights stay on F.linear
# Row counts the load-time check runs (random rows at one intra-op thread); the head's
# are multiples of 4 (its rows are padded so: serving_core/model/head_rows.py).
CHECK_ROWS = (4, 5, 7, 8, 13, 16, 64, 67, 128, 259)
HEAD_CHECK_ROWS = (4, 8, 64)

_mode = "auto"
_checked: dict[tuple, bool] = {}  # (rows of the check, N, K, oracle's kind) -> same bits


def install(mode: str) -> None:
    """Pack weights of models loaded from now on (`auto`), or none (`off`)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"packed_linear={mode!r}: allowed values are {', '.join(MODES)}")
    _mode = mode


def mode() -> str:
    return _mode


class Pack:
    """The packed copy of a weight's output rows [lo, hi) (all by default), used while the
    weight is the same unchanged tensor."""

    __slots__ = ("source", "version", "lo", "hi", "packed")

    def __init__(self, weight: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        self.source, self.version = weight, weight._version
        self.lo, self.hi = lo, weight.shape[0] if hi is None else hi
        piece = weight[self.lo : self.hi].contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(piece, None)

    def serves(self, weight: torch.Tensor, rows: int) -> bool:
        """Whether a product of `rows` rows with `weight` may use the packed copy."""
        return (rows >= MIN_ROWS and weight is self.source
                and weight._version == self.version and torch.get_num_threads() == 1)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) @ weight.T: oneDNN over the packed copy."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def packable(weight: torch.Tensor) -> bool:
    """fp32 on the CPU, 2-D, at least MIN_WEIGHT elements, oneDNN present, packing on."""
    return (_mode == "auto" and weight.dim() == 2 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.numel() >= MIN_WEIGHT
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack(weight: torch.Tensor, oracle: Callable[[torch.Tensor], torch.Tensor] | None = None,
         rows: tuple[int, ...] = CHECK_ROWS, piece: tuple[int, int] | None = None,
         kind: str = "linear") -> Pack | None:
    """The Pack of weight's output rows `piece` (all by default) when `packable` and its
    product gives oracle's bits (default F.linear with the weight) on `rows` random rows at
    one intra-op thread; else None."""
    if not packable(weight):
        return None
    entry = Pack(weight, *(piece or (0, None)))
    key = (rows, *weight.shape, entry.lo, entry.hi, kind)
    if key not in _checked:
        _checked[key] = _same_bits(entry, oracle or (lambda x: F.linear(x, weight)), rows)
    return entry if _checked[key] else None


def _same_bits(entry: Pack, oracle: Callable, rows: tuple[int, ...]) -> bool:
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return all(torch.equal(entry.product(x), oracle(x)) for x in (
                torch.randn(m, entry.source.shape[1], generator=gen) for m in rows))
    finally:
        torch.set_num_threads(threads)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           entry: Pack | None) -> torch.Tensor:
    """F.linear(x, weight, bias), over the packed copy where `entry` serves it."""
    if entry is not None and bias is None and entry.serves(weight, x.numel() // x.shape[-1]):
        return entry.product(x)
    return F.linear(x, weight, bias)


def packed_bytes(entries) -> int:
    """Bytes of the packed copies (as many as their plain fp32 pieces')."""
    return sum((e.hi - e.lo) * e.source.shape[1] * e.source.element_size()
               for e in entries if e is not None)


_loaded: dict | None = None  # what the latest model packed (ModelPacks.describe)


class ModelPacks:
    """A model's packed linear weights by name, and its LM head's packed vocabulary pieces
    (all of them or none); `describe` says what was packed."""

    def __init__(self, weights: dict[str, torch.Tensor], names: list[str],
                 head: str | None = None, pieces: list[tuple[int, int]] = (),
                 head_oracle: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None):
        global _loaded
        self.linear = {n: pack(weights[n]) for n in names}
        self.head: list[Pack] = []
        if head is not None:
            w = weights[head]
            self.head = [pack(w, (lambda x, lo=lo, hi=hi: head_oracle(x, lo, hi))
                              if head_oracle else None, HEAD_CHECK_ROWS, (lo, hi), "head")
                         for lo, hi in pieces]
            if not all(self.head):
                self.head = []
        _loaded = self.describe()

    def head_for(self, weight: torch.Tensor, rows: int) -> list[Pack]:
        """The head's packed pieces when they serve a product of `rows` rows with `weight`,
        else [] (the plain product)."""
        return self.head if self.head and self.head[0].serves(weight, rows) else []

    def describe(self) -> dict:
        entries = [*self.linear.values(), *self.head]
        return {"linear_packed": sum(e is not None for e in self.linear.values()),
                "linear_plain": sum(e is None for e in self.linear.values()),
                "head_pieces": len(self.head), "packed_bytes": packed_bytes(entries),
                "min_rows": MIN_ROWS, "min_weight": MIN_WEIGHT, "threads": 1}


def settings() -> dict:
    """The mode, what the latest model loaded in this process packed, and whether packed
    products run at this process's intra-op thread count (runtime record)."""
    loaded = _loaded or {"linear_packed": 0, "head_pieces": 0}
    packed = bool(loaded["linear_packed"] or loaded["head_pieces"])
    return {"mode": _mode, **loaded, "in_effect": packed and torch.get_num_threads() == 1}
