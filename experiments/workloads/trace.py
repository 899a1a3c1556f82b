"""Production traces described by prefix-block hashes (Mooncake's FAST'25 format).

A trace is JSONL, one request a line: `{"timestamp": ms, "input_length": tokens,
"output_length": tokens, "hash_ids": [...]}`; hash ids name 512-token blocks (TRACE_BLOCK),
equal ids are equal blocks, and a line holds exactly ceil(input_length / 512) of them.
`read_trace` parses and checks every line of a file; a malformed line, a timestamp below the
previous line's or a hash list of the wrong length raises ValueError naming the line (1-based).

Tokens (`prompt_tokens`). Hash block i of a line becomes `b = workload.trace_block_tokens`
tokens (default 512, the trace's own block); a line of n hash ids and input length L becomes
n - 1 full blocks plus a last block of `L - 512 (n - 1)` tokens scaled by b / 512 (rounded,
at least 1); at b = 512 the prompt is exactly L tokens. A full block's tokens are a function
of its hash id alone (equal id, equal tokens, in any run or process); the last block, when it
is partial, is keyed by the line number instead, so it is unique to the request (a partial
block is never cached). Tokens lie in [TOKEN_BASE, vocab): the first three of a block spell
its key in base (vocab - TOKEN_BASE), so two different keys differ within three tokens, and
the rest come from a SplitMix64 hash of (key, position).

Block-size mapping. The default b = 512 keeps the trace's lengths: at a checkpoint interval
C = 256 a hash block is two consecutive C blocks (reusable together), at C = 1,024 two
consecutive hash blocks form one C block, reusable only when both are (so a reusable prefix of
k hash blocks is adoptable to floor(512 k / 1024) x 1,024 tokens). `trace_block_tokens = C`
instead maps every hash block onto exactly one C block (lengths scaled by C / 512).

The bound (`reusable_prefix_blocks`): request r's infinite-cache reusable prefix is the
longest prefix of its full blocks that some earlier request of the window held as full
blocks (same ids in the same order from the start), in blocks; x b in tokens. No cache can
adopt more: different keys give different tokens within a block's first three.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512  # tokens per hash block in the Mooncake traces
DATA_DIR = Path(__file__).resolve().parent / "data" / "mooncake_fast25"
TRACES = {
    "conversation": DATA_DIR / "conversation_trace.jsonl",
    "synthetic": DATA_DIR / "synthetic_trace.jsonl",
}
TOKEN_BASE = 100  # ids below are left alone (special and control tokens of most vocabularies)
KEY_DIGITS = 3  # leading tokens of a block that spell its key
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_MEMO: dict[tuple, Trace] = {}


@dataclass(frozen=True)
class Trace:
    """A parsed trace; line i (0-based) holds `hash_values[hash_offsets[i]:hash_offsets[i+1]]`."""

    timestamps_ms: np.ndarray  # int64, non-decreasing
    input_lengths: np.ndarray  # int64 >= 1
    output_lengths: np.ndarray  # int64 >= 1
    hash_offsets: np.ndarray  # int64, one more than the lines
    hash_values: np.ndarray  # int64 >= 0
    sha256: str  # of the file's bytes
    name: str  # a vendored trace's name, or the path given

    def __len__(self) -> int:
        return len(self.timestamps_ms)

    def hash_ids(self, line: int) -> np.ndarray:
        return self.hash_values[self.hash_offsets[line] : self.hash_offsets[line + 1]]


def trace_path(name: str) -> Path:
    """The file of a vendored trace name or a path; ValueError names the field."""
    path = TRACES.get(name, Path(str(name)).expanduser()) if isinstance(name, str) else None
    if not name or path is None or not path.is_file():
        raise ValueError(
            f"workload.trace_file={name!r}: allowed values are {', '.join(TRACES)} "
            "or the path of a JSONL trace file"
        )
    return path


def read_trace(name: str) -> Trace:
    """The parsed trace (memoized per file state); ValueError names the first bad line."""
    path = trace_path(name)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _MEMO:
        _MEMO[key] = parse_trace(path.read_bytes(), name)
    return _MEMO[key]


def parse_trace(data: bytes, name: str) -> Trace:
    """Parse and check the lines of a trace file's bytes."""
    where = f"workload.trace_file={name!r}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{where}: line {line}: not UTF-8 text") from None
    stamps, inputs, outputs, offsets, values = [], [], [], [0], []
    previous = None
    for number, raw in enumerate(text.splitlines(), start=1):
        row = _row(raw, number, where)
        if previous is not None and row[0] < previous:
            raise ValueError(f"{where}: line {number}: timestamp {row[0]} is below the "
                             f"previous line's {previous} (timestamps must not decrease)")
        previous = row[0]
        stamps.append(row[0])
        inputs.append(row[1])
        outputs.append(row[2])
        values.extend(row[3])
        offsets.append(len(values))
    if not stamps:
        raise ValueError(f"{where}: no requests in the file")
    return Trace(np.array(stamps, np.int64), np.array(inputs, np.int64),
                 np.array(outputs, np.int64), np.array(offsets, np.int64),
                 np.array(values, np.int64), hashlib.sha256(data).hexdigest()[:16], str(name))


def _row(raw: str, number: int, where: str) -> tuple[int, int, int, list[int]]:
    def bad(detail: str) -> ValueError:
        return ValueError(f"{where}: line {number}: {detail}")

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        raise bad(f"not a JSON object ({err.msg})") from None
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise bad(f"missing field {missing[0]!r}; each line holds {', '.join(_FIELDS)}")

    def integer(field: str, low: int) -> int:
        value = obj[field]
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise bad(f"{field}={value!r}: allowed integers >= {low}")
        return int(value)

    stamp, length = integer("timestamp", 0), integer("input_length", 1)
    output = integer("output_length", 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(
        isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 0 for h in ids
    ):
        raise bad("hash_ids: allowed a list of integers >= 0")
    blocks = -(-length // TRACE_BLOCK)
    if len(ids) != blocks:
        raise bad(f"hash_ids holds {len(ids)} ids; input_length={length} needs "
                  f"ceil({length} / {TRACE_BLOCK}) = {blocks}")
    return stamp, length, output, [int(h) for h in ids]


def window(trace: Trace, start: int, count: int, duration_s: float | None) -> range:
    """Lines [start, start + count) whose timestamps lie within duration_s of line start's."""
    if start >= len(trace):
        raise ValueError(f"workload.trace_start={start}: the trace holds {len(trace)} requests "
                         f"(allowed 0..{len(trace) - 1})")
    stop = min(start + count, len(trace))
    if duration_s is not None:
        limit = trace.timestamps_ms[start] + duration_s * 1000.0
        stop = start + int(np.searchsorted(trace.timestamps_ms[start:stop], limit, "left"))
        stop = max(stop, start + 1)
    return range(start, stop)


def block_lengths(input_length: int, num_blocks: int, block_tokens: int) -> list[int]:
    """Token lengths of a line's blocks under the mapping (module docstring)."""
    tail = input_length - TRACE_BLOCK * (num_blocks - 1)
    if block_tokens == TRACE_BLOCK:
        last = tail
    else:
        last = max(1, math.floor(tail * block_tokens / TRACE_BLOCK + 0.5))
    return [block_tokens] * (num_blocks - 1) + [last]


def block_key(hash_id: int | None, line: int) -> int:
    """A full block's key is 2 x its hash id; a partial last block's is 2 x line + 1."""
    return 2 * int(hash_id) if hash_id is not None else 2 * int(line) + 1


def block_tokens(key: int, length: int, vocab: int) -> np.ndarray:
    """The tokens of block `key` (int32, the first `length` of a fixed sequence per key)."""
    span = vocab - TOKEN_BASE
    if key >= span**KEY_DIGITS:
        raise ValueError(f"workload.trace_vocab_size={vocab}: too small to spell block key "
                         f"{key} in {KEY_DIGITS} tokens")
    digits = [(key // span**d) % span for d in range(KEY_DIGITS)]
    j = np.arange(length, dtype=np.uint64)
    x = np.uint64(key) * np.uint64(1 << 32) + j
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    tokens = (x % np.uint64(span)).astype(np.int64)
    tokens[: min(KEY_DIGITS, length)] = digits[: min(KEY_DIGITS, length)]
    return (tokens + TOKEN_BASE).astype(np.int32)


def prompt_tokens(trace: Trace, line: int, block_tokens_: int, vocab: int) -> np.ndarray:
    """Line `line`'s prompt (read-only int32): its blocks' tokens back to back."""
    ids = trace.hash_ids(line)
    lengths = block_lengths(int(trace.input_lengths[line]), len(ids), block_tokens_)
    full = int(trace.input_lengths[line]) % TRACE_BLOCK == 0
    parts = [
        block_tokens(block_key(int(h) if (k < len(ids) - 1 or full) else None, line), n, vocab)
        for k, (h, n) in enumerate(zip(ids, lengths, strict=True))
    ]
    prompt = np.concatenate(parts)
    prompt.flags.writeable = False
    return prompt


def full_blocks(trace: Trace, line: int) -> int:
    return int(trace.input_lengths[line]) // TRACE_BLOCK


def reusable_prefix_blocks(trace: Trace, lines: range) -> list[int]:
    """Per line of the window, the infinite-cache reusable prefix in full blocks (see the
    module docstring): prefixes of earlier lines' full blocks are kept in a trie."""
    children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node; root is 0
    out = []
    for line in lines:
        ids = trace.hash_ids(line)[: full_blocks(trace, line)].tolist()
        node, matched = 0, 0
        for h in ids:
            child = children.get((node, h))
            if child is None:
                break
            node, matched = child, matched + 1
        out.append(matched)
        for h in ids[matched:]:
            node = children.setdefault((node, h), len(children) + 1)
    return out


def reuse_distance_tokens(trace: Trace, lines: range) -> list[int]:
    """Per line of the window, the prompt tokens of the lines between it and the latest
    earlier line holding its whole reusable prefix (`reusable_prefix_blocks`); -1 where the
    bound is 0. Under LRU a prefix survives only while the cache holds what came between:
    a distance above a budget's token capacity means the bound cannot be realised there."""
    bound = reusable_prefix_blocks(trace, lines)
    holder: dict[tuple[int, ...], int] = {}  # whole-block prefix -> latest line holding it
    tokens = np.concatenate([[0], np.cumsum(trace.input_lengths[lines.start:lines.stop])])
    out = []
    for k, line in enumerate(lines):
        ids = tuple(trace.hash_ids(line)[: full_blocks(trace, line)].tolist())
        source = holder.get(ids[: bound[k]]) if bound[k] else None
        out.append(-1 if source is None else int(tokens[k] - tokens[source + 1]))
        for j in range(1, len(ids) + 1):
            holder[ids[:j]] = k
    return out
