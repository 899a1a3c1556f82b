"""A preset's public source and published size (its `card` block): documentation, not state.

Every conf/model/<name>.yaml says where its numbers come from and what size is published
there, and the size its own fields derive (serving_core/param_count.py) is held to it
(tests/test_model_presets.py, within 2 %):

    card:
      source: hf:tiiuae/Falcon-H1-7B-Instruct  # hf:<repo id>, or a paper or document
      published_params: 7_590_000_000           # the count that source publishes
      count_fields: {vocab_size: 130_048}       # optional: public-config fields the preset's
                                                # geometry leaves out or simplifies, applied
                                                # to the count only

A preset that is not a public model (a control or a random-weight checkpoint) names what it
is built from and publishes its own count. The block is neither geometry
(serving_core/geometry.py drops it) nor part of a run's identity
(experiments/runners/cell.py): naming or correcting a source changes no run id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from serving_core.geometry import (
    ARCHITECTURE_KEY,
    CARD_KEY,
    MODEL_CONF_DIR,
    Geometry,
    available_models,
    geometry_from_config,
)


@dataclass(frozen=True)
class ModelCard:
    source: str
    published_params: int
    count_fields: dict[str, Any] = field(default_factory=dict)


def read_card(model: str, data: dict) -> ModelCard:
    """The card of a preset's mapping; ValueError names a missing or bad field."""
    card = data.get(CARD_KEY)
    if not isinstance(card, dict):
        raise ValueError(f"model={model!r}: no '{CARD_KEY}' block; it needs {CARD_KEY}.source "
                         f"and {CARD_KEY}.published_params (serving_core/model_card.py)")
    unknown = sorted(set(card) - {f.name for f in dataclasses.fields(ModelCard)})
    if unknown:
        raise ValueError(f"model={model!r}: {CARD_KEY} has unknown fields {unknown}; allowed "
                         "fields are source, published_params, count_fields")
    source, published = card.get("source"), card.get("published_params")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"model={model!r}: {CARD_KEY}.source={source!r}: allowed values are "
                         "hf:<repo id> or the paper or document the numbers come from")
    if isinstance(published, bool) or not isinstance(published, int) or published <= 0:
        raise ValueError(f"model={model!r}: {CARD_KEY}.published_params={published!r}: "
                         "allowed values are integers > 0")
    counted = dict(card.get("count_fields") or {})
    known = {f.name for f in dataclasses.fields(Geometry)}
    if set(counted) - known:
        raise ValueError(f"model={model!r}: {CARD_KEY}.count_fields has unknown fields "
                         f"{sorted(set(counted) - known)}; allowed fields are geometry fields")
    return ModelCard(source.strip(), published, counted)


def _preset(model: str) -> dict:
    path = MODEL_CONF_DIR / f"{model}.yaml"
    if not path.exists():
        raise ValueError(f"model={model!r}: allowed values are {available_models()}")
    with path.open() as fh:
        return yaml.safe_load(fh)


def load_card(model: str) -> ModelCard:
    return read_card(model, _preset(model))


def counted_geometry(model: str) -> Geometry:
    """The preset's geometry with the card's count_fields applied (for counting only)."""
    data = _preset(model)
    card = read_card(model, data)
    data.pop(ARCHITECTURE_KEY, None)
    return geometry_from_config(data, **card.count_fields)


def card_params(model: str) -> tuple[int, int]:
    """(total, active) parameters the preset's fields derive, count_fields applied."""
    return counted_geometry(model).pattern_params()
