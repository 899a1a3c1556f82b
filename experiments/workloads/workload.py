"""Request workloads for the serving engine: ShareGPT or synthetic, shared contexts, arrivals.

A workload is a pure function of (seed, workload config, load config). Each
random choice draws from its own stream, `default_rng(SeedSequence([seed,
stream]))`, so changing one knob never reshuffles another:

- conversations: a seeded permutation of the eligible pool (repeated, each
  round reshuffled, when more requests than conversations are asked for);
- context slots: a seeded permutation of `i mod num_contexts`, so the eight
  shared contexts are used equally often;
- sharing: a seeded permutation ranks the requests; the first
  `floor(q n + 1/2)` share their slot's context, the rest get a unique
  context of the same length. The shared sets are nested in q, and q changes
  only sharing: prompt lengths, outputs, slots and arrivals do not depend on it;
- arrivals: unit exponentials scaled by the rate (common random numbers
  across rates).

ShareGPT (docs/paper_design.md section 1.4): the question is the first human turn, the output
is the token length of the first model turn after it, capped at
`max_output_tokens`. Context k has length `L * (1 + spread * (2k / (K - 1) - 1))`
with the mean length L chosen so that mean(context + question) is
`mean_input_tokens` over the eligible pool. A conversation is eligible when
its question plus capped output fits `max_model_len` next to the LONGEST
context, so every conversation fits every slot and no resampling is needed.
Contexts are windows of the corpus of model turns that no request uses as a
question or an output: the eight shared ones from its start, the unique ones
laid back to back after them from a seeded offset. Every context window starts
with a 16-token run (the smallest cache unit, serving_core/memory/d0.py) that no
other window starts with, so a unique context shares no cacheable prefix.

Synthetic: fixed lengths from a deterministic arithmetic token pattern whose
first token differs for every sequence; the same slot and sharing rules.

Trace (experiments/workloads/trace.py): a window of a prefix-block-hash trace replayed at its
own timestamps divided by `trace_speed` (load.* is not used), prompts spelled from the hash
ids, outputs the trace's (max_output_tokens, output_rule and max_model_len do not apply);
`Workload.reusable_prefix` holds each request's infinite-cache bound. Its fields
(TRACE_DEFAULTS) are allowed only with source=trace, so the other sources' normalized
configs and hashes are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.workloads import sessions, sharegpt, trace

SOURCES = ("sharegpt", "synthetic", "trace", "sessions")
REUSE_MODES = ("share", "isolate")
OUTPUT_RULES = ("tokenizer_ratio", "raw")
ARRIVALS = ("poisson", "onoff")
UNIQUE_PREFIX_TOKENS = 16  # smallest cache unit (D0 attention block, serving_core.memory.d0)

WORKLOAD_DEFAULTS = {
    "source": "sharegpt",
    "num_requests": 300,
    "q": 1.0,
    "reuse": "share",
    "num_contexts": 8,
    "mean_input_tokens": 3365,  # measured mean input (docs/calibration.md section E)
    # context k spans mean * (1 -/+ spread), linearly over k; 0.035 keeps every shared
    # context within [3,072, 3,583] tokens: exactly six full 512-token blocks, as measured
    "context_spread": 0.035,
    "max_output_tokens": 1024,
    "max_model_len": 8192,
    "tokenizer": "llama3",
    "output_rule": "tokenizer_ratio",  # tokenizer_ratio | raw (see scaled_outputs)
    "output_ratio": 0.83,  # fitted by `make calibrate` to the measured mean outputs
    "synthetic_prompt_tokens": 600,  # context + question
    "synthetic_context_tokens": 512,
    "synthetic_output_tokens": 32,
}
# source=trace only (conf/workload/trace.yaml): the window, time scale, block mapping, ids
TRACE_DEFAULTS = {
    "trace_file": "conversation",  # conversation | synthetic (vendored) | a JSONL path
    "trace_start": 0,  # 0-based index of the window's first request
    "trace_duration_s": None,  # null: num_requests only; else also within this trace time
    "trace_speed": 1.0,  # arrival = (timestamp - first timestamp) / 1000 / trace_speed
    "trace_block_tokens": 512,  # tokens one 512-token hash block becomes (trace.py)
    "trace_vocab_size": 32000,  # token ids in [100, vocab); <= the model's vocabulary
}
# source=sessions only (conf/workload/sessions.yaml, agentic.yaml; workloads/sessions.py)
SESSION_DEFAULTS = sessions.SESSION_DEFAULTS
# each source's own fields, allowed only with it
SOURCE_FIELDS = {"trace": TRACE_DEFAULTS, "sessions": SESSION_DEFAULTS}
LOAD_DEFAULTS = {"rate": 3.0, "arrival": "poisson", "on_s": 5.0, "off_s": 15.0}

_STREAM_CONVERSATIONS = 1
_STREAM_SLOTS = 2
_STREAM_SHARING = 3
_STREAM_ARRIVALS = 4
_STREAM_UNIQUE = 5

# Synthetic pattern: token j of sequence s is BASE + (s * STRIDE + j * STEP) mod SPAN.
# STRIDE is coprime with SPAN, so sequences below SPAN all start with distinct tokens.
_PATTERN_BASE = 1000
_PATTERN_SPAN = 100_000
_PATTERN_STRIDE = 7919
_PATTERN_STEP = 31


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: int  # 0..n-1 in arrival order
    arrival_s: float  # seconds from episode start
    prompt: np.ndarray  # int32 token ids: context tokens + first human turn tokens
    output_tokens: int  # exact tokens to generate (EOS ignored), >= 1
    context_id: int  # 0..num_contexts-1 for a shared context, -1 for a unique context
    salt: str  # "" under SHARE; a stable unique per-request salt under ISOLATE
    # sessions: arrives think_s after request `after` finished (arrival_s unused); -1: none
    after: int = -1
    think_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    meta: dict  # tokenizer and dataset identity, length statistics, config hash, knobs
    # per request, the infinite-cache reusable prefix in tokens (trace sources); None: none
    reusable_prefix: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class _Material:
    """Per-request pieces of a source, all independent of q and reuse."""

    questions: list[np.ndarray]
    output_tokens: np.ndarray  # int64, >= 1
    slots: np.ndarray  # int64 context slot per request
    shared_contexts: list[np.ndarray]  # one per slot
    unique_contexts: list[np.ndarray]  # per request, as long as its slot's shared context
    meta: dict


# ---------------------------------------------------------------- configuration


def normalize_workload_config(cfg) -> dict:
    """Defaults filled in, every field validated; raises ValueError naming the field."""
    out = _merge(cfg, {**WORKLOAD_DEFAULTS, **TRACE_DEFAULTS, **SESSION_DEFAULTS}, "workload")
    out["source"] = _choice(out["source"], SOURCES, "workload.source")
    # keys() first: a DictConfig's `in` on an absent key raises and formats an error inside
    keys = set(cfg.keys()) if cfg is not None else set()
    for source, fields in SOURCE_FIELDS.items():
        own = {key: out.pop(key) for key in fields}
        if out["source"] == source:
            out.update(_trace_fields(own) if source == "trace" else _session_fields(own))
            continue
        given = [key for key in fields if key in keys and key in cfg]
        if given:
            raise ValueError(f"workload.{given[0]}: allowed only with workload.source={source}")
    out["reuse"] = _choice(out["reuse"], REUSE_MODES, "workload.reuse")
    if out["tokenizer"] not in sharegpt.TOKENIZERS:
        raise ValueError(
            f"workload.tokenizer={out['tokenizer']!r}: allowed values are "
            f"{', '.join(sharegpt.TOKENIZERS)}"
        )
    out["output_rule"] = _choice(out["output_rule"], OUTPUT_RULES, "workload.output_rule")
    out["output_ratio"] = _number(out["output_ratio"], "workload.output_ratio", 0.0, 4.0, True)
    out["q"] = _number(out["q"], "workload.q", low=0.0, high=1.0)
    out["context_spread"] = _number(out["context_spread"], "workload.context_spread", 0.0, 0.9)
    for key in ("num_requests", "num_contexts", "mean_input_tokens", "max_output_tokens"):
        out[key] = _integer(out[key], f"workload.{key}", low=1)
    out["max_model_len"] = _integer(out["max_model_len"], "workload.max_model_len", low=2)
    for key in ("synthetic_prompt_tokens", "synthetic_context_tokens", "synthetic_output_tokens"):
        out[key] = _integer(out[key], f"workload.{key}", low=1)
    if out["source"] == "synthetic":
        _check_synthetic(out)
    return out


def normalize_load_config(cfg) -> dict:
    """Defaults filled in, every field validated; raises ValueError naming the field."""
    out = _merge(cfg, LOAD_DEFAULTS, "load")
    out["arrival"] = _choice(out["arrival"], ARRIVALS, "load.arrival")
    out["rate"] = _number(out["rate"], "load.rate", low=0.0, open_low=True)
    out["on_s"] = _number(out["on_s"], "load.on_s", low=0.0, open_low=True)
    out["off_s"] = _number(out["off_s"], "load.off_s", low=0.0)
    return out


def workload_config_hash(workload_cfg, load_cfg, seed) -> str:
    """Stable hash of the normalized configs and the seed."""
    payload = {
        "workload": normalize_workload_config(workload_cfg),
        "load": normalize_load_config(load_cfg),
        "seed": _seed(seed),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """$HSL_CACHE_DIR, else `<repo>/.cache/workloads`."""
    env = os.environ.get("HSL_CACHE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache" / "workloads"


def _merge(cfg, defaults: dict, section: str) -> dict:
    if cfg is None:
        cfg = {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a project dependency
        pass
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{section}: expected a mapping, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - set(defaults))
    if unknown:
        raise ValueError(
            f"{section}.{unknown[0]}: unknown field; allowed fields are {', '.join(defaults)}"
        )
    return {**defaults, **cfg}


def _choice(value, allowed: tuple[str, ...], field: str) -> str:
    key = str(value).strip().lower()
    if key not in allowed:
        raise ValueError(f"{field}={value!r}: allowed values are {', '.join(allowed)}")
    return key


def _number(value, field: str, low: float, high: float = math.inf, open_low=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{field}={value!r}: expected a number")
    value = float(value)
    below = value <= low if open_low else value < low
    if math.isnan(value) or below or value > high:
        bracket = "(" if open_low else "["
        upper = "inf)" if math.isinf(high) else f"{high:g}]"
        raise ValueError(f"{field}={value!r}: allowed values are {bracket}{low:g}, {upper}")
    return value


def _integer(value, field: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{field}={value!r}: expected an integer >= {low}")
    if value < low:
        raise ValueError(f"{field}={value!r}: allowed values are integers >= {low}")
    return int(value)


def _seed(seed) -> int:
    return _integer(seed, "seed", low=0)


def _trace_fields(cfg: dict) -> dict:
    name = cfg["trace_file"]
    data = trace.read_trace(name)  # parsed here (memoized): a bad line is refused before a run
    duration = cfg["trace_duration_s"]
    out = {
        "trace_file": name,
        "trace_start": _integer(cfg["trace_start"], "workload.trace_start", low=0),
        "trace_duration_s": None if duration is None else _finite(
            _number(duration, "workload.trace_duration_s", 0.0, open_low=True),
            "workload.trace_duration_s"),
        "trace_speed": _finite(_number(cfg["trace_speed"], "workload.trace_speed", 0.0,
                                       open_low=True), "workload.trace_speed"),
        "trace_block_tokens": _integer(cfg["trace_block_tokens"], "workload.trace_block_tokens",
                                       low=16),
        "trace_vocab_size": _integer(cfg["trace_vocab_size"], "workload.trace_vocab_size",
                                     low=1000),
    }
    trace.window(data, out["trace_start"], 1, None)  # the window's first request exists
    return out


def _session_fields(cfg: dict) -> dict:
    out = {"session_lengths": _choice(cfg["session_lengths"], sessions.LENGTHS,
                                      "workload.session_lengths")}
    for key in ("session_mean_turns", "session_think_s"):
        low = 1.0 if key == "session_mean_turns" else 0.0
        out[key] = _finite(_number(cfg[key], f"workload.{key}", low), f"workload.{key}")
    for key, low in (("session_system_tokens", 0), ("session_max_turns", 1),
                     ("session_user_tokens", 1), ("session_output_tokens", 1),
                     ("session_max_tokens", 2), ("session_vocab_size", 1000)):
        out[key] = _integer(cfg[key], f"workload.{key}", low=low)
    if out["session_system_tokens"] + 2 > out["session_max_tokens"]:
        raise ValueError(f"workload.session_system_tokens={out['session_system_tokens']}: "
                         f"allowed <= session_max_tokens - 2 = {out['session_max_tokens'] - 2}")
    return out


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{field}={value!r}: allowed finite numbers > 0")
    return value


def _check_synthetic(cfg: dict) -> None:
    prompt, context = cfg["synthetic_prompt_tokens"], cfg["synthetic_context_tokens"]
    if context >= prompt:
        raise ValueError(
            f"workload.synthetic_context_tokens={context}: must be below "
            f"synthetic_prompt_tokens={prompt} to leave a question"
        )
    if prompt + cfg["synthetic_output_tokens"] > cfg["max_model_len"]:
        raise ValueError(
            f"workload.synthetic_prompt_tokens={prompt}: prompt + synthetic_output_tokens "
            f"exceeds max_model_len={cfg['max_model_len']}"
        )
    if cfg["num_contexts"] + 2 * cfg["num_requests"] > _PATTERN_SPAN:
        limit = (_PATTERN_SPAN - cfg["num_contexts"]) // 2
        raise ValueError(
            f"workload.num_requests={cfg['num_requests']}: the synthetic pattern allows <= {limit}"
        )


# ---------------------------------------------------------------- building


def build_workload(
    workload_cfg, load_cfg, seed: int, cache_dir: str | Path | None = None
) -> Workload:
    """The request list for (seed, workload config, load config); deterministic."""
    wcfg = normalize_workload_config(workload_cfg)
    lcfg = normalize_load_config(load_cfg)
    seed = _seed(seed)
    if wcfg["source"] == "trace":
        return _trace_workload(wcfg, lcfg, seed)
    if wcfg["source"] == "sessions":
        return _session_workload(wcfg, lcfg, seed, Path(cache_dir or default_cache_dir()))
    n = wcfg["num_requests"]
    if wcfg["source"] == "sharegpt":
        pool = sharegpt.load_pool(wcfg["tokenizer"], Path(cache_dir or default_cache_dir()))
        material = _sharegpt_material(pool, wcfg, seed)
    else:
        material = _synthetic_material(wcfg, seed)
    shared = _shared_mask(n, wcfg["q"], seed)
    arrivals = arrival_times(lcfg, n, seed)
    requests = tuple(
        RequestSpec(
            request_id=i,
            arrival_s=float(arrivals[i]),
            prompt=_prompt(material, i, shared[i]),
            output_tokens=int(material.output_tokens[i]),
            context_id=int(material.slots[i]) if shared[i] else -1,
            salt=f"req-{seed}-{i}" if wcfg["reuse"] == "isolate" else "",
        )
        for i in range(n)
    )
    meta = {
        **material.meta,
        **_length_stats(requests),
        "config_hash": workload_config_hash(wcfg, lcfg, seed),
        "source": wcfg["source"],
        "q": wcfg["q"],
        "reuse": wcfg["reuse"],
        "seed": seed,
        "num_requests": n,
        "num_shared": int(shared.sum()),
        "arrival": lcfg["arrival"],
        "rate": lcfg["rate"],
        "arrival_span_s": float(arrivals[-1]),
        "workload": wcfg,
        "load": lcfg,
    }
    return Workload(requests, meta)


def _prompt(material: _Material, i: int, shared: bool) -> np.ndarray:
    context = material.shared_contexts[material.slots[i]] if shared else material.unique_contexts[i]
    prompt = np.concatenate([context, material.questions[i]]).astype(np.int32, copy=False)
    prompt.flags.writeable = False
    return prompt


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, stream]))


def _shared_mask(n: int, q: float, seed: int) -> np.ndarray:
    """Exactly floor(q n + 1/2) requests share; the sets are nested in q."""
    rank = _rng(seed, _STREAM_SHARING).permutation(n)
    return rank < math.floor(q * n + 0.5)


def _balanced_slots(n: int, num_contexts: int, seed: int) -> np.ndarray:
    return _rng(seed, _STREAM_SLOTS).permutation(np.arange(n) % num_contexts)


def arrival_times(load_cfg, n: int, seed: int) -> np.ndarray:
    """Sorted arrival times in seconds for n requests.

    Poisson: cumulative exponential gaps at `rate`. ON/OFF: a Poisson process at
    `rate * (on_s + off_s) / on_s` run on ON time only, then mapped to wall time
    by inserting an `off_s` gap after every `on_s` of ON time: the same mean rate.
    """
    lcfg = normalize_load_config(load_cfg)
    gaps = _rng(_seed(seed), _STREAM_ARRIVALS).standard_exponential(n)
    if lcfg["arrival"] == "poisson":
        return np.cumsum(gaps) / lcfg["rate"]
    on_s, off_s = lcfg["on_s"], lcfg["off_s"]
    on_time = np.cumsum(gaps) / (lcfg["rate"] * (on_s + off_s) / on_s)
    windows, offsets = np.divmod(on_time, on_s)
    return windows * (on_s + off_s) + offsets


def _length_stats(requests: tuple[RequestSpec, ...]) -> dict:
    inputs = np.array([len(r.prompt) for r in requests])
    outputs = np.array([r.output_tokens for r in requests])
    return {
        "mean_input_tokens": float(inputs.mean()),
        "median_input_tokens": float(np.median(inputs)),
        "mean_output_tokens": float(outputs.mean()),
        "median_output_tokens": float(np.median(outputs)),
        "max_total_tokens": int((inputs + outputs).max()),
    }


# ---------------------------------------------------------------- ShareGPT


def context_lengths(mean_tokens: float, num_contexts: int, spread: float) -> np.ndarray:
    """Lengths of the shared contexts: linear over mean * (1 - spread) .. mean * (1 + spread)."""
    factors = 1.0 + spread * np.linspace(-1.0, 1.0, num_contexts) if num_contexts > 1 else [1.0]
    return np.rint(mean_tokens * np.asarray(factors)).astype(np.int64)


def plan_contexts(pool: sharegpt.ShareGPTPool, wcfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """(shared context lengths, eligible conversation indices) for a config.

    The mean context length is a fixed point: longer contexts exclude more long
    questions, which lowers the mean question length. A few rounds settle it.
    """
    prompt_lens = pool.prompt_lens
    outputs = scaled_outputs(pool.output_tokens, wcfg)
    usable = (prompt_lens >= 1) & (outputs >= 1)
    target, limit = wcfg["mean_input_tokens"], wcfg["max_model_len"]
    eligible = usable
    mean_context = target - prompt_lens[usable].mean()
    for _ in range(20):
        lengths = context_lengths(mean_context, wcfg["num_contexts"], wcfg["context_spread"])
        if lengths.min() < UNIQUE_PREFIX_TOKENS:
            raise ValueError(
                f"workload.mean_input_tokens={target}: too small for contexts next to a mean "
                f"question of {prompt_lens[eligible].mean():.0f} tokens"
            )
        eligible = usable & (prompt_lens + outputs + lengths.max() <= limit)
        if not eligible.any():
            raise ValueError(
                f"workload.max_model_len={limit}: no conversation fits next to a "
                f"{lengths.max()}-token context (mean_input_tokens={target})"
            )
        updated = target - prompt_lens[eligible].mean()
        if abs(updated - mean_context) < 0.5:
            break
        mean_context = updated
    return lengths, np.flatnonzero(eligible)


def scaled_outputs(raw: np.ndarray, wcfg: dict) -> np.ndarray:
    """Output lengths a workload asks for, capped at max_output_tokens.

    `raw`: the first model turn's token count under the workload tokenizer.
    `tokenizer_ratio`: round(output_ratio x raw), kept >= 1 for a reply that has
    tokens: one ratio for every request and cell, standing for the token-count
    ratio between the measured model's tokenizer and ours on model replies
    (`make calibrate` fits it to the measured mean outputs). A zero stays zero
    (no exchange). `raw`: the counts unchanged.
    """
    raw = np.asarray(raw, dtype=np.int64)
    if wcfg["output_rule"] == "tokenizer_ratio":
        scaled = np.rint(raw * wcfg["output_ratio"]).astype(np.int64)
        raw = np.where(raw > 0, np.maximum(scaled, 1), 0)
    return np.minimum(raw, wcfg["max_output_tokens"])


def _sharegpt_material(pool: sharegpt.ShareGPTPool, wcfg: dict, seed: int) -> _Material:
    n, num_contexts = wcfg["num_requests"], wcfg["num_contexts"]
    lengths, eligible = plan_contexts(pool, wcfg)
    rng = _rng(seed, _STREAM_CONVERSATIONS)
    rounds = -(-n // len(eligible))
    chosen = np.concatenate([rng.permutation(eligible) for _ in range(rounds)])[:n]
    slots = _balanced_slots(n, num_contexts, seed)
    if lengths.sum() + lengths.max() + UNIQUE_PREFIX_TOKENS > len(pool.corpus):
        raise ValueError(
            f"workload.mean_input_tokens={wcfg['mean_input_tokens']}: contexts need more text "
            f"than the {len(pool.corpus)}-token corpus holds"
        )
    windows = _ContextWindows(pool.corpus)
    shared_contexts = [windows.take(int(length)) for length in lengths]
    windows.start_unique(_rng(seed, _STREAM_UNIQUE))
    unique_contexts = [windows.take(int(lengths[slot])) for slot in slots]
    meta = {
        "tokenizer": pool.meta["tokenizer"],
        "dataset": pool.meta["dataset"],
        "pool_cache_key": pool.meta["cache_key"],
        "records_salvaged": pool.meta["records_salvaged"],
        "truncated_tail_chars": pool.meta["truncated_tail_chars"],
        "conversations_kept": pool.meta["conversations_with_exchange"],
        "conversations_eligible": len(eligible),
        "context_lengths": [int(x) for x in lengths],
    }
    return _Material(
        questions=[pool.prompt(int(c)) for c in chosen],
        output_tokens=scaled_outputs(pool.output_tokens[chosen], wcfg).astype(np.int64),
        slots=slots,
        shared_contexts=shared_contexts,
        unique_contexts=unique_contexts,
        meta=meta,
    )


class _ContextWindows:
    """Hands out corpus windows whose first UNIQUE_PREFIX_TOKENS tokens never repeat.

    Shared contexts come from the head of the corpus; unique ones are laid back
    to back in the remainder from a seeded offset, wrapping around (at a shifted
    phase) when a workload needs more text than the corpus holds. A window whose
    leading run was already handed out moves one token on until it is new.
    """

    def __init__(self, corpus: np.ndarray):
        self._corpus = corpus
        self._low = 0  # start of the region windows are taken from
        self._cursor = 0
        self._seen: set[bytes] = set()

    def start_unique(self, rng: np.random.Generator) -> None:
        """Switch to the region after everything handed out so far, at a seeded offset."""
        self._low = self._cursor
        self._cursor = self._low + int(rng.integers(len(self._corpus) - self._low))

    def take(self, length: int) -> np.ndarray:
        end = len(self._corpus)
        span = end - self._low
        assert UNIQUE_PREFIX_TOKENS <= length <= span, "context length outside the corpus region"
        for _ in range(span):
            if self._cursor + length > end:
                overshoot = self._cursor + length - end
                self._cursor = self._low + overshoot % (span - length + 1)
            start = self._cursor
            key = self._corpus[start : start + UNIQUE_PREFIX_TOKENS].tobytes()
            self._cursor = start + 1
            if key not in self._seen:
                self._seen.add(key)
                self._cursor = start + length
                return self._corpus[start : start + length]
        raise ValueError("workload.num_requests: more unique contexts than the corpus can provide")


# ---------------------------------------------------------------- synthetic


def _pattern(sequence: int, length: int) -> np.ndarray:
    j = np.arange(length, dtype=np.int64)
    return (
        _PATTERN_BASE + (sequence * _PATTERN_STRIDE + j * _PATTERN_STEP) % _PATTERN_SPAN
    ).astype(np.int32)


def _synthetic_material(wcfg: dict, seed: int) -> _Material:
    n, num_contexts = wcfg["num_requests"], wcfg["num_contexts"]
    context_len = wcfg["synthetic_context_tokens"]
    question_len = wcfg["synthetic_prompt_tokens"] - context_len
    # Sequence ids: shared contexts 0..K-1, unique contexts K..K+n-1, questions K+n..K+2n-1.
    return _Material(
        questions=[_pattern(num_contexts + n + i, question_len) for i in range(n)],
        output_tokens=np.full(n, wcfg["synthetic_output_tokens"], dtype=np.int64),
        slots=_balanced_slots(n, num_contexts, seed),
        shared_contexts=[_pattern(k, context_len) for k in range(num_contexts)],
        unique_contexts=[_pattern(num_contexts + i, context_len) for i in range(n)],
        meta={
            "tokenizer": {"name": "synthetic-pattern", "n_vocab": _PATTERN_BASE + _PATTERN_SPAN},
            "context_lengths": [context_len] * num_contexts,
        },
    )


# ---------------------------------------------------------------- trace


def _trace_workload(wcfg: dict, lcfg: dict, seed: int) -> Workload:
    """A window of a block-hash trace (experiments/workloads/trace.py); seed sets salts only."""
    data = trace.read_trace(wcfg["trace_file"])
    lines = trace.window(data, wcfg["trace_start"], wcfg["num_requests"],
                         wcfg["trace_duration_s"])
    block, vocab = wcfg["trace_block_tokens"], wcfg["trace_vocab_size"]
    stamps = data.timestamps_ms[lines.start : lines.stop]
    arrivals = (stamps - stamps[0]) / 1000.0 / wcfg["trace_speed"]
    bound = tuple(b * block for b in trace.reusable_prefix_blocks(data, lines))
    requests = tuple(
        RequestSpec(
            request_id=i,
            arrival_s=float(arrivals[i]),
            prompt=trace.prompt_tokens(data, line, block, vocab),
            output_tokens=int(data.output_lengths[line]),
            context_id=-1,
            salt=f"req-{seed}-{i}" if wcfg["reuse"] == "isolate" else "",
        )
        for i, line in enumerate(lines)
    )
    span = float(arrivals[-1])
    meta = {
        "tokenizer": {"name": "trace-hash-blocks", "n_vocab": vocab},
        "trace": {"file": data.name, "sha256": data.sha256, "requests_in_file": len(data),
                  "first_line": lines.start + 1, "last_line": lines.stop,
                  "block_tokens": block, "speed": wcfg["trace_speed"]},
        "arrival": "trace",
        "rate": (len(requests) - 1) / span if span > 0 else 0.0,
        "arrival_span_s": span,
    }
    return _bounded_workload(requests, bound, meta, (wcfg, lcfg, seed))


def _bounded_workload(requests: tuple, bound: tuple, meta: dict, config: tuple) -> Workload:
    """A workload that records each request's bound (trace, sessions), with its meta."""
    wcfg, lcfg, seed = config
    meta = {
        **_length_stats(requests),
        **meta,
        "reusable_prefix_tokens": int(sum(bound)),
        "reusable_fraction": sum(bound) / sum(len(r.prompt) for r in requests),
        "config_hash": workload_config_hash(wcfg, lcfg, seed),
        "source": wcfg["source"],
        "q": wcfg["q"],
        "reuse": wcfg["reuse"],
        "seed": seed,
        "num_requests": len(requests),
        "num_shared": -1,
        "workload": wcfg,
        "load": lcfg,
    }
    return Workload(requests, meta, reusable_prefix=tuple(bound))


# ---------------------------------------------------------------- sessions


def _session_workload(wcfg: dict, lcfg: dict, seed: int, cache_dir: Path) -> Workload:
    """Multi-turn sessions (experiments/workloads/sessions.py): a session's first turn at
    the load's arrivals (sessions per second), each later turn after the previous one."""
    turns = sessions.draw_turns(wcfg, seed, cache_dir)
    count = turns[-1].session + 1
    starts = arrival_times(lcfg, count, seed)
    prompts, bound = sessions.prompts(turns, wcfg["session_system_tokens"],
                                      wcfg["session_vocab_size"])
    requests = tuple(
        RequestSpec(
            request_id=i,
            arrival_s=float(starts[t.session]),
            prompt=prompts[i],
            output_tokens=t.output_tokens,
            context_id=-1,
            salt=f"req-{seed}-{i}" if wcfg["reuse"] == "isolate" else "",
            after=i - 1 if t.turn else -1,
            think_s=t.think_s,
        )
        for i, t in enumerate(turns)
    )
    meta = {
        "tokenizer": {"name": "session-segments", "n_vocab": wcfg["session_vocab_size"]},
        "sessions": {"count": count, "lengths": wcfg["session_lengths"],
                     "mean_turns": len(turns) / count,
                     "max_turns": max(t.turn for t in turns) + 1},
        "arrival": lcfg["arrival"],
        "rate": lcfg["rate"],
        "arrival_span_s": float(starts[-1]),
    }
    return _bounded_workload(requests, bound, meta, (wcfg, lcfg, seed))


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a workload and print its statistics.")
    parser.add_argument("--seed", type=int, default=42000)
    parser.add_argument("--q", type=float, default=WORKLOAD_DEFAULTS["q"])
    parser.add_argument("--source", default=WORKLOAD_DEFAULTS["source"])
    parser.add_argument("--reuse", default=WORKLOAD_DEFAULTS["reuse"])
    parser.add_argument("--num-requests", type=int, default=WORKLOAD_DEFAULTS["num_requests"])
    parser.add_argument("--tokenizer", default=WORKLOAD_DEFAULTS["tokenizer"])
    parser.add_argument("--rate", type=float, default=LOAD_DEFAULTS["rate"])
    parser.add_argument("--arrival", default=LOAD_DEFAULTS["arrival"])
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    workload_cfg = {
        "source": args.source,
        "q": args.q,
        "reuse": args.reuse,
        "num_requests": args.num_requests,
        "tokenizer": args.tokenizer,
    }
    load_cfg = {"rate": args.rate, "arrival": args.arrival}
    start = time.perf_counter()
    workload = build_workload(workload_cfg, load_cfg, args.seed, args.cache_dir)
    seconds = time.perf_counter() - start
    meta = workload.meta
    shared = meta["num_shared"] / meta["num_requests"]
    print(f"source {meta['source']}  seed {meta['seed']}  config {meta['config_hash']}")
    print(f"tokenizer {json.dumps(meta['tokenizer'])}")
    if meta["source"] == "sharegpt":
        print(
            f"conversations: salvaged {meta['records_salvaged']}, with an exchange "
            f"{meta['conversations_kept']}, eligible {meta['conversations_eligible']}"
        )
    print(f"context lengths {meta['context_lengths']}")
    print(
        f"n {meta['num_requests']}  input mean {meta['mean_input_tokens']:.1f} "
        f"median {meta['median_input_tokens']:.1f}  output mean {meta['mean_output_tokens']:.1f} "
        f"median {meta['median_output_tokens']:.1f}  max total {meta['max_total_tokens']}"
    )
    print(
        f"shared contexts {shared:.3f} (q={meta['q']:g}, reuse {meta['reuse']})  "
        f"arrivals {meta['arrival']} at {meta['rate']:g}/s over {meta['arrival_span_s']:.1f} s"
    )
    print(f"built in {seconds:.3f} s")


if __name__ == "__main__":
    main()
