"""Checkpoint placement: at which checkpoint boundaries a chunk's recurrent state is published.

One rule, `engine.checkpoint_placement` (serving_core/scheduler.py), takes the values
below; `engine.retention_interval` filters any of them. Boundaries are grid indices j
(position j C, C the organization's checkpoint interval: vLLM's Mamba block on N0). A
chunk [start, end) can publish only boundaries in (start, end]; each policy says which
(docs/engine_rules.md section 8.3 names each one's source):

- `step_end`: the chunk's end, when it lies on the grid.
- `every_boundary`, `all`: every boundary the chunk crosses (`all` is vLLM's earlier
  `mamba_cache_mode=all` name for it: a state at every block).
- `align`: vLLM 0.32's `mamba_cache_mode=align`: the chunk's end on the grid, and in the
  chunk that reaches the prefill end (max(prompt, tokens - 1)) and starts on the grid, the
  last boundary strictly below its end when it lies at least one interval past the start
  (`get_mamba_prefill_checkpoint_position`, `is_mamba_prefill_checkpoint_valid`).
- `periodic:N`: every boundary crossed whose index is a multiple of N.
- `junction`: the request's branch point, the deepest boundary at or below where it stops
  sharing a prefix with every earlier request (learned from the prefix tree of the requests
  seen so far, serving_core/overlap.py), and its tail: the prompt's last boundary strictly
  below its end and every boundary beyond (reached by decode).
- `optimal` / `optimal:M`: the positions of the exact dynamic program for the overlap-depth
  distribution of the requests seen so far, at most M of them (M: the composites the
  organization's composite pool holds beside a full batch's working composites, or the given M).

Per-request positions (junction, optimal) are fixed when a request is first admitted, so
what its chunks reserve is what they publish; the request then enters the prefix tree.
`engine.retention_interval=<k>block` (the vLLM arm's spelling, block = one checkpoint
interval) keeps only boundaries that are multiples of k, and the replay boundary (the
prompt's last one), as vLLM's `prefix_cache_retention_interval` does
(`MambaManager.reachable_block_mask`).
"""

from __future__ import annotations

from serving_core.overlap import PrefixTree, optimal_positions

FIXED = ("step_end", "every_boundary", "align", "all", "junction", "optimal")
PARAMETRIC = ("periodic", "optimal")  # name:N with an integer N >= 1
PLACEMENT_SHOWN = ("values are step_end, every_boundary, align, all, junction, periodic:N, "
                   "optimal, optimal:M (N, M integers >= 1), null")
BLOCK = "block"
RETENTION_SHOWN = "values are null (keep every placed checkpoint) or <k>block (k >= 1, e.g. 2block)"


def parse_placement(value) -> tuple[str, int]:
    """(policy, its integer parameter or 0); ValueError for anything else."""
    if isinstance(value, str):
        if value in FIXED:
            return value, 0
        name, _, n = value.partition(":")
        if name in PARAMETRIC and n.isdigit() and int(n) >= 1 and n == str(int(n)):
            return name, int(n)
    raise ValueError(f"engine.checkpoint_placement={value!r}: allowed {PLACEMENT_SHOWN}")


def is_placement(value) -> bool:
    try:
        parse_placement(value)
    except ValueError:
        return False
    return True


def retention_blocks(interval) -> int:
    """Blocks per retained checkpoint for "block" (1) or "<k>block" (k >= 1); 0 otherwise."""
    if not isinstance(interval, str) or not interval.endswith(BLOCK):
        return 0
    k = interval[:-len(BLOCK)] or "1"
    return int(k) if k.isdigit() and int(k) >= 1 else 0


def is_retention(value) -> bool:
    return value is None or retention_blocks(value) > 0


class Placement:
    """Where one engine publishes checkpoints (see the module doc). `boundaries(req,
    start, end)`: the grid indices a chunk [start, end) publishes; `gate(req, start,
    end)`: how many of (start, end) it may publish at most (the full-prompt gate)."""

    def __init__(self, name: str, interval: int, retention: int = 0, param: int = 0,
                 budget_checkpoints: int = 0, block: int = 0) -> None:
        self.policy = name
        self.name = f"{name}:{param}" if param else name
        self.C = interval
        self.retention = retention
        self.param = param
        self.budget_checkpoints = budget_checkpoints
        self.marks: dict[int, frozenset[int]] = {}  # rid -> positions fixed at admission
        learns = name in ("junction", "optimal")
        self.tree = PrefixTree(block, interval) if learns and interval else None
        self._dp: tuple[int, frozenset[int]] | None = None  # (requests seen, positions)

    @property
    def max_checkpoints(self) -> int:
        """optimal: M, the positions the dynamic program may choose."""
        return self.param or self.budget_checkpoints

    @property
    def optimal_checkpoints(self) -> int | None:
        """optimal's M as it runs (the given one, or derived from the budget); None for
        every other policy: the run's record (`optimal_checkpoints` in engine_config)."""
        return self.max_checkpoints if self.policy == "optimal" else None

    # ----- what a chunk publishes --------------------------------------------------------
    def candidates(self, req, start: int, end: int):
        C = self.C
        if self.policy == "step_end":
            return (end // C,) if end % C == 0 and end > start else ()
        if self.policy == "align":
            return _align(req, start, end, C)
        return range(start // C + 1, end // C + 1)

    def keeps(self, req, j: int) -> bool:
        policy = self.policy
        if policy == "periodic" and j % self.param:
            return False
        if self.tree is not None:
            marks = self.marks.get(req.rid)
            if marks is None:
                marks = self._positions(req)
            if j not in marks and not (policy == "junction"
                                       and j >= (req.num_prompt - 1) // self.C):
                return False
        k = self.retention
        return not k or j % k == 0 or j == (req.num_prompt - 1) // self.C

    def boundaries(self, req, start: int, end: int) -> list[int]:
        if end <= start:
            return []
        return [j for j in self.candidates(req, start, end) if self.keeps(req, j)]

    def gate(self, req, start: int, end: int) -> int:
        C = self.C
        return sum(1 for j in range(start // C + 1, (end - 1) // C + 1) if self.keeps(req, j))

    # ----- what it learns ------------------------------------------------------------------
    def admit(self, req) -> None:
        """Fix a request's positions at its first admission, then add it to the tree."""
        if self.tree is None or req.rid in self.marks:
            return
        self.marks[req.rid] = self._positions(req)
        keys = req.ensure_keys(req.num_prompt // req.block_tokens)
        self.tree.record(self.tree.overlap_tokens(keys, req.num_prompt))
        self.tree.insert(keys)

    def finish(self, req) -> None:
        """A finished request: its generated tokens join the tree, its positions go."""
        if self.tree is None:
            return
        self.marks.pop(req.rid, None)
        self.tree.insert(req.ensure_keys(req.num_tokens // req.block_tokens))

    def _positions(self, req) -> frozenset[int]:
        if self.policy == "junction":
            keys = req.ensure_keys(req.num_prompt // req.block_tokens)
            j = self.tree.overlap_tokens(keys, req.num_prompt) // self.C
            return frozenset((j,)) if j else frozenset()
        seen = self.tree.requests
        if self._dp is None or self._dp[0] != seen:
            chosen = optimal_positions(self.tree.tail_mass(), self.max_checkpoints)
            self._dp = (seen, frozenset(chosen))
        return self._dp[1]


def _align(req, start: int, end: int, C: int) -> tuple[int, ...]:
    """vLLM 0.32 align mode: the state where a step ends on a block boundary (the block it
    fills is cached), and the prefill checkpoint of the chunk that reaches the prefill end
    (`get_mamba_prefill_checkpoint_position(end)`: the last boundary below the end, valid
    per `is_mamba_prefill_checkpoint_valid` only for a chunk starting on the grid with the
    boundary at least one block past its start)."""
    out = ()
    if end >= max(req.num_prompt, req.num_tokens - 1) and start % C == 0:
        pos = (end - 1) // C * C
        if pos >= start + C:
            out = (pos // C,)
    if end % C == 0:
        out += (end // C,)
    return out
