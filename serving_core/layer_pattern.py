"""A model's layer pattern: which sequence mixer and which feed-forward block each layer has.

A layer is written `mixer` or `mixer+ffn` (an FFN-only layer is written `mlp` or `moe`):

- mixers: `hybrid` (attention and Mamba2 side by side in one layer, Falcon-H1), `attention`,
  `mamba2`, `gdn` (Gated DeltaNet, Qwen3-Next), `mamba1` (Jamba's Mamba), `none`;
- feed-forward: `mlp` (dense), `moe` (routed experts, optionally a shared expert), `none`.

A layer may first call a weight-shared transformer block: `shared+mixer[+ffn]` (`shared`
alone: the call only). Zamba2's hybrid layers are `shared+mamba2`: one of the preset's
`shared_blocks` blocks (attention + MLP, used in turn) runs on the layer's input, then the
layer's own Mamba2. A shared block's weights count once however many layers call it
(serving_core/param_count.py); each call keeps attention KV of its own, so for state a call
is an attention layer.

A preset lists its layers in order, each entry a layer string or a run `[count, layer]`
(serving_core/geometry.py expands and checks them against `num_layers`). A preset without a
pattern is Falcon-H1-shaped: every layer `hybrid+mlp`.

The storage scope (`scope_counts`): every state-carrying layer kind's count shares a
greatest common divisor g; the model is g copies of one group holding count / g layers of
each kind. Every organization sizes its units for one group (the per-layer scope of a
uniform model such as Falcon-H1, where g is the layer count) and the arenas hold g copies:
the same grouping vLLM's hybrid allocator makes (layers split into groups of equal size,
one page shared by one layer of each group). The group keeps the model's exact ratio of
attention to recurrent bytes; whole-model bytes are group bytes x g.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

MIXERS = ("hybrid", "attention", "mamba2", "gdn", "mamba1", "none")
FFNS = ("mlp", "moe", "none")
# The state each mixer carries: attention KV, a recurrent state of one shape.
ATTENTION_MIXERS = ("hybrid", "attention")
RECURRENT_KINDS = {"hybrid": "mamba2", "mamba2": "mamba2", "gdn": "gdn", "mamba1": "mamba1"}
SHARED = "shared"  # a call of a weight-shared block, written before the layer's mixer
LAYER_FORMS = (f"'mixer' or 'mixer+ffn' with mixer one of {', '.join(MIXERS)} and ffn one of "
               f"{', '.join(FFNS)} ('mlp' or 'moe' alone: an FFN-only layer), either "
               f"prefixed '{SHARED}+' (a call of a weight-shared block; '{SHARED}' alone: the "
               "call only), or a run [count, layer]")


def split_shared(text: str) -> tuple[bool, str]:
    """(calls a shared block, the rest of the layer string)."""
    parts = text.strip().split("+", 1)
    if parts[0] != SHARED:
        return False, text.strip()
    return True, parts[1] if len(parts) > 1 else "none"



def parse_layer(text: str) -> tuple[str, str]:
    """(mixer, ffn) of one layer string; a mixer alone has no FFN block (a shared-block
    call in front is not part of either: `shared_calls` counts them)."""
    if not isinstance(text, str):
        raise ValueError(f"model.layers entry {text!r}: allowed forms are {LAYER_FORMS}")
    shared, rest = split_shared(text)
    if shared and rest.split("+")[0] == SHARED:
        raise ValueError(f"model.layers entry {text!r}: allowed forms are {LAYER_FORMS}")
    parts = rest.split("+")
    if len(parts) == 1 and parts[0] in ("mlp", "moe"):
        return "none", parts[0]
    if len(parts) == 1 and parts[0] in MIXERS:
        return parts[0], "none"
    if len(parts) == 2 and parts[0] in MIXERS and parts[1] in FFNS:
        return parts[0], parts[1]
    raise ValueError(f"model.layers entry {text!r}: allowed forms are {LAYER_FORMS}")


def attention_group_first(layers: Sequence[str]) -> bool:
    """Whether vLLM's KV cache groups put attention before the recurrent state: its groups
    follow the order the layers register their caches (kv_cache_utils
    `_get_kv_cache_groups_uniform_page_size`), so the first layer with a cache decides; a
    hybrid layer registers its attention first (Falcon-H1)."""
    for layer in layers:
        mixer = parse_layer(layer)[0]
        if mixer in ATTENTION_MIXERS:
            return True
        if mixer in RECURRENT_KINDS:
            return False
    return True


def expand_layers(entries: Iterable[Any]) -> tuple[str, ...]:
    """The per-layer strings of a pattern written with runs `[count, layer]`."""
    out: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            parse_layer(entry)
            out.append(entry.strip())
            continue
        if (isinstance(entry, Sequence) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and entry[0] > 0):
            parse_layer(entry[1])
            out.extend([str(entry[1]).strip()] * entry[0])
            continue
        raise ValueError(f"model.layers entry {entry!r}: allowed forms are {LAYER_FORMS}")
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _counts(layers: tuple[str, ...]) -> tuple[tuple[tuple[str, int], ...], ...]:
    """(mixer counts, ffn counts, state counts) of a pattern, as items: the planner and the
    geometry ask for them hundreds of times per run, for a handful of patterns. The mixer
    counts carry the shared-block calls under `shared`."""
    parsed = [parse_layer(s) for s in layers]
    mixers = Counter(m for m, _ in parsed)
    mixers[SHARED] = sum(split_shared(s)[0] for s in layers)
    ffns = Counter(f for _, f in parsed)
    # a shared-block call keeps KV of its own: an attention layer for state
    states = {"attention": sum(mixers[m] for m in ATTENTION_MIXERS) + mixers[SHARED]}
    for mixer, kind in RECURRENT_KINDS.items():
        states[kind] = states.get(kind, 0) + mixers[mixer]
    return tuple(mixers.items()), tuple(ffns.items()), tuple(states.items())


def mixer_counts(layers: Sequence[str]) -> Counter:
    return Counter(dict(_counts(tuple(layers))[0]))


def shared_calls(layers: Sequence[str]) -> int:
    """Layers that call a weight-shared block."""
    return mixer_counts(layers)[SHARED]


def ffn_counts(layers: Sequence[str]) -> Counter:
    return Counter(dict(_counts(tuple(layers))[1]))


def state_counts(layers: Sequence[str]) -> dict[str, int]:
    """Layers carrying each kind of state: attention KV and each recurrent shape."""
    return dict(_counts(tuple(layers))[2])


def scope_copies(layers: Sequence[str]) -> int:
    """g: the greatest common divisor of the state-carrying layer counts (1 if none)."""
    counts = [c for c in state_counts(layers).values() if c > 0]
    return math.gcd(*counts) if counts else 1
