"""Per-request hit attribution: why a request's first admission adopted less than the
longest prefix it shared with the requests before it (docs/engine_rules.md section 18).

Levels, from the ideal down to the adopted prefix J (each one at most the one above, so
the losses, the differences of consecutive levels, add up to ideal - J by construction):

    I   ideal: longest token prefix shared with any request first admitted before this
        one (same cache salt; a finished request counts with its output)
    D1  I on the block grid, strict prefix: B floor(min(I, N - 1) / B)   -> lost_block
    D2  deepest boundary <= D1 where another request ever published a
        checkpoint of this chain (in the whole run)                         -> lost_placement
    D3  ... published before this request's lookup                         -> lost_admission
    D4  ... and within the cached attention prefix at the lookup           -> lost_attention
    D5  ... whose checkpoint is present, or was lost with its own pages
        (not through another group's storage: S2 slab, Jenga large page)   -> lost_group
    J   the adopted prefix (present checkpoint within the attention prefix) -> lost_checkpoint

With a host tier, what device eviction cost below D3 is charged to the tier (its copy was
absent or partial: a restore would have put it back before the lookup): lost_tier =
D3 - J and the three eviction causes are 0. Without recurrent state the block grid is the
checkpoint grid and attention blocks play the checkpoints. The ideal comes from a prefix
index of the token ids seen so far (per salt, sorted: the longest common prefix with any
earlier sequence is the longer one with its two sorted neighbours, as the deepest shared
node of a prefix tree is). The engine reads no workload label.
"""

from __future__ import annotations

import bisect

import numpy as np

CAUSES = ("block", "placement", "admission", "attention", "group", "checkpoint", "tier")
LOSS_COLUMNS = tuple(f"lost_{c}_tokens" for c in CAUSES)
ATTRIBUTION_COLUMNS = ("ideal_prefix_tokens", "cached_attention_tokens", *LOSS_COLUMNS)
UNATTRIBUTED = -1  # never admitted (or a path without an engine of ours)
GROUP_REASONS = frozenset({"slab_reclaim", "pool_pressure"})  # lost through shared storage


_TOKEN = np.dtype(">i8")  # big-endian: the bytes of two sequences sort as the sequences do


def _encode(tokens) -> bytes:
    return np.asarray(tokens, dtype=_TOKEN).tobytes()


def _common(a: bytes, b: bytes) -> int:
    """Length in tokens of the common prefix of two encoded sequences."""
    m = min(len(a), len(b)) // _TOKEN.itemsize
    x = np.frombuffer(a, dtype=_TOKEN, count=m)
    y = np.frombuffer(b, dtype=_TOKEN, count=m)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else m


class PrefixIndex:
    """Token sequences seen so far, sorted per salt (8 bytes a token, no Python int per
    token), and the longest prefix a new one shares with any of them."""

    def __init__(self) -> None:
        self.sorted: dict[str, list[bytes]] = {}

    def insert(self, salt: str, tokens) -> None:
        bisect.insort(self.sorted.setdefault(salt, []), _encode(tokens))

    def longest_shared(self, salt: str, tokens) -> int:
        """Longest prefix `tokens` shares with a sequence inserted before (0: none)."""
        entries = self.sorted.get(salt, [])
        probe = _encode(tokens)
        i = bisect.bisect_left(entries, probe)
        return max((_common(probe, entries[j]) for j in (i - 1, i) if 0 <= j < len(entries)),
                   default=0)


class HitAttribution:
    """Collects what the attribution needs while a run goes (publications, losses and a
    snapshot at each first admission) and resolves the levels at the end (`columns`)."""

    def __init__(self, block_tokens: int, interval: int, tier: bool) -> None:
        self.B = block_tokens
        self.C = interval or block_tokens  # without recurrent state: the block grid
        self.per = self.C // block_tokens
        self.blocks_only = not interval
        self.tier = tier
        self.index = PrefixIndex()
        self.seq = 0  # one counter orders publications, losses and lookups
        self.published: dict[int, list[tuple[int, int]]] = {}  # key -> (seq, producer)
        self.last_loss: dict[int, str] = {}  # key -> reason of its latest loss
        self.snapshots: dict[int, tuple] = {}

    # ----- events --------------------------------------------------------------------------
    def tracks(self, obj) -> bool:
        return bool(obj.kind) != self.blocks_only

    def on_publish(self, obj) -> None:
        if self.tracks(obj):
            self.published.setdefault(obj.key, []).append((self.seq, obj.producer))
            self.seq += 1

    def on_loss(self, obj, reason: str) -> None:
        if self.tracks(obj):
            self.last_loss[obj.key] = reason
            self.seq += 1

    def finished(self, req) -> None:
        """A finished request's whole sequence (prompt and output) joins the index."""
        if req.num_generated and req.tokens:
            self.index.insert(req.spec.salt, req.tokens)

    def admitted(self, req, adoption, cache) -> None:
        """Snapshot at the first admission's lookup (call before the adopted prefix is
        published anew: nothing of this request is published yet)."""
        tokens = req.spec.prompt
        ideal = self.index.longest_shared(req.spec.salt, tokens)
        self.index.insert(req.spec.salt, tokens)
        d1 = self.B * (min(ideal, len(tokens) - 1) // self.B)
        grid = [adoption.keys[j * self.per - 1] for j in range(1, d1 // self.C + 1)]
        table = cache.attention if self.blocks_only else cache.checkpoints
        before = [key in self.published for key in grid]
        present = [key in table for key in grid]
        attention = adoption.hit.attention
        d3 = _deepest(before, self.C)
        d4 = _deepest(before, self.C, attention)
        kept = [b and (p or self.last_loss.get(k) not in GROUP_REASONS)
                for b, p, k in zip(before, present, grid, strict=True)]
        d5 = _deepest(kept, self.C, d4)
        self.snapshots[req.rid] = (ideal, d1, grid, self.seq, d3, d4, d5, adoption.jadopt,
                                   attention)
        self.seq += 1

    # ----- resolution ------------------------------------------------------------------------
    def columns(self, request_ids) -> dict[str, dict[int, int]]:
        """Per attribution column, each request's value (UNATTRIBUTED if never admitted)."""
        out = {c: {} for c in ATTRIBUTION_COLUMNS}
        for rid in request_ids:
            row = self._row(rid)
            for column in ATTRIBUTION_COLUMNS:
                out[column][rid] = row.get(column, UNATTRIBUTED)
        return out

    def _row(self, rid: int) -> dict[str, int]:
        snap = self.snapshots.get(rid)
        if snap is None:
            return {}
        ideal, d1, grid, _, d3, d4, d5, j, attention = snap
        ever = [any(p != rid for _, p in self.published.get(key, ())) for key in grid]
        d2 = _deepest(ever, self.C)
        if self.tier:
            lost = (ideal - d1, d1 - d2, d2 - d3, 0, 0, 0, d3 - j)
        else:
            lost = (ideal - d1, d1 - d2, d2 - d3, d3 - d4, d4 - d5, d5 - j, 0)
        return {"ideal_prefix_tokens": ideal, "cached_attention_tokens": attention,
                **dict(zip(LOSS_COLUMNS, lost, strict=True))}


def _deepest(flags: list[bool], interval: int, limit: int | None = None) -> int:
    """Deepest boundary (j + 1) * interval <= limit whose flag j is set (0: none)."""
    top = len(flags) if limit is None else min(len(flags), limit // interval)
    for j in range(top - 1, -1, -1):
        if flags[j]:
            return (j + 1) * interval
    return 0


def identity_violations(rows) -> list[str]:
    """The rows (mappings with the attribution columns and `adopted_prefix_tokens`) that
    break ideal = adopted + sum of losses or carry a negative loss: one line each."""
    bad = []
    for row in rows:
        if row["ideal_prefix_tokens"] == UNATTRIBUTED:
            continue
        losses = [row[c] for c in LOSS_COLUMNS]
        total = row["adopted_prefix_tokens"] + sum(losses)
        if total != row["ideal_prefix_tokens"] or min(losses) < 0:
            bad.append(f"request {row['request_id']}: ideal {row['ideal_prefix_tokens']} != "
                       f"adopted {row['adopted_prefix_tokens']} + losses {losses}")
    return bad
