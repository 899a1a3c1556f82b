"""Campaign sweep definitions: the `hydra.sweeper` fields, expansion into jobs, run order.

A campaign file (conf/campaign/<name>.yaml, `# @package _global_`) fixes its
settings at the top level and declares its sweep under `hydra.sweeper`:

    params:  Hydra sweep syntax shared by every block ("s0,s1", "range(0,3)", 0.5)
    blocks:  named sweeps, each a cartesian product of params merged with its own keys
    order:   product | seed_major | balanced (Williams design per seed)

Task overrides from the command line apply to every block and win over both;
`hydra.sweeper.smoke=true` keeps the first `smoke_seeds` seeds of each block,
sets `smoke_requests` requests per run and writes to campaign `<name>_smoke`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf

from experiments.config.bad_input import CampaignError
from serving_core.rules import show_value

ORDERS = ("product", "seed_major", "balanced")
SMOKE_SUFFIX = "_smoke"


def _positive_int(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CampaignError(f"{field_name}={value!r}: allowed integers >= 1")
    return value


def _flag(value: Any, field_name: str) -> bool:
    if not isinstance(value, bool):
        raise CampaignError(f"{field_name}={value!r}: allowed true, false")
    return value


def _sweep_mapping(value: Any, field_name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise CampaignError(f"{field_name}: expected a mapping of override keys to values")
    for key, item in value.items():
        if isinstance(item, (Mapping, list, tuple)):
            raise CampaignError(
                f"{field_name}.{key}: expected a scalar or a sweep string like 'a,b,c'"
            )
    return dict(value)


@dataclass(frozen=True)
class CampaignSpec:
    """The sweep of a campaign, as configured under `hydra.sweeper`."""

    params: dict[str, Any] = field(default_factory=dict)
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    order: str = "product"
    only: tuple[str, ...] = ()
    smoke: bool = False
    smoke_seeds: int = 3
    smoke_requests: int = 60
    max_batch_size: int | None = None

    @classmethod
    def from_config(cls, sweeper: Mapping) -> CampaignSpec:
        """Validate `hydra.sweeper` fields; errors name `hydra.sweeper.<field>`."""
        raw = OmegaConf.to_container(sweeper) if isinstance(sweeper, DictConfig) else sweeper
        at = "hydra.sweeper"
        order = raw.get("order", "product")
        if order not in ORDERS:
            raise CampaignError(f"{at}.order={order!r}: allowed values are {', '.join(ORDERS)}")
        blocks_raw = raw.get("blocks") or {}
        if not isinstance(blocks_raw, Mapping):
            raise CampaignError(f"{at}.blocks: expected a mapping of block names to sweeps")
        blocks = {str(n): _sweep_mapping(b, f"{at}.blocks.{n}") for n, b in blocks_raw.items()}
        only = raw.get("only") or ()
        only = (only,) if isinstance(only, str) else tuple(only)
        unknown = [n for n in only if n not in blocks]
        if unknown:
            raise CampaignError(
                f"{at}.only={list(only)}: unknown blocks {unknown}; allowed values are "
                f"{', '.join(blocks) or '(this campaign has no blocks)'}"
            )
        batch = raw.get("max_batch_size")
        return cls(
            params=_sweep_mapping(raw.get("params"), f"{at}.params"),
            blocks=blocks,
            order=order,
            only=only,
            smoke=_flag(raw.get("smoke", False), f"{at}.smoke"),
            smoke_seeds=_positive_int(raw.get("smoke_seeds", 3), f"{at}.smoke_seeds"),
            smoke_requests=_positive_int(raw.get("smoke_requests", 60), f"{at}.smoke_requests"),
            max_batch_size=None if batch is None else _positive_int(batch, f"{at}.max_batch_size"),
        )


@dataclass(frozen=True)
class Job:
    """One cell x seed to run: the overrides that compose its config."""

    block: str
    overrides: tuple[str, ...]


def _parse(parser: OverridesParser, lines: Sequence[str], where: str) -> list[Override]:
    try:
        return parser.parse_overrides(list(lines))
    except OverrideParseException as err:
        raise CampaignError(f"{where}: {err}") from err


def _axis(override: Override, where: str) -> tuple[str, list[str]]:
    """(merge key, rendered overrides) of one parsed override; sweeps expand to many."""
    key = override.get_key_element()
    if override.is_sweep_override():
        if not override.is_discrete_sweep():
            raise CampaignError(
                f"{where}: {override.input_line}: only discrete sweeps (a,b / range / choice) "
                "can be expanded"
            )
        return key.lstrip("+~"), [f"{key}={v}" for v in override.sweep_string_iterator()]
    return key.lstrip("+~"), [f"{key}={override.get_value_element_as_str()}"]


def _merge_axes(axes: dict[str, list[str]], overrides: list[Override], where: str) -> None:
    for override in overrides:
        name, values = _axis(override, where)
        axes.pop(name, None)  # a later source replaces the key and moves it last
        axes[name] = values


def _smoke_axes(axes: dict[str, list[str]], spec: CampaignSpec, campaign_name: str) -> None:
    if "seed" in axes:
        axes["seed"] = axes["seed"][: spec.smoke_seeds]
    names = [v.split("=", 1)[1] for v in axes.get("campaign_name", [])] or [campaign_name]
    axes["campaign_name"] = [f"campaign_name={n}{SMOKE_SUFFIX}" for n in names]


def expand_jobs(spec: CampaignSpec, arguments: Sequence[str], campaign_name: str) -> list[Job]:
    """Every job of the campaign in expansion order (blocks in order, cartesian within)."""
    parser = OverridesParser.create()
    command_line = _parse(parser, arguments, "command line")
    blocks = spec.blocks or {"": {}}
    if spec.only:
        blocks = {name: blocks[name] for name in spec.only}
    jobs = []
    for name, block in blocks.items():
        axes: dict[str, list[str]] = {}
        if spec.smoke:
            smoke = [f"workload.num_requests={spec.smoke_requests}"]
            _merge_axes(axes, _parse(parser, smoke, "hydra.sweeper.smoke"), "smoke")
        params = [f"{k}={show_value(v)}" for k, v in spec.params.items()]
        _merge_axes(axes, _parse(parser, params, "hydra.sweeper.params"), "hydra.sweeper.params")
        where = f"hydra.sweeper.blocks.{name}"
        own = [f"{k}={show_value(v)}" for k, v in block.items()]
        _merge_axes(axes, _parse(parser, own, where), where)
        _merge_axes(axes, command_line, "command line")
        if spec.smoke:
            _smoke_axes(axes, spec, campaign_name)
        jobs += [Job(name, tuple(combo)) for combo in itertools.product(*axes.values())]
    return jobs


def williams_rows(n: int) -> list[list[int]]:
    """Williams design: every condition once per position and once after each other one
    (over n rows for even n, 2n rows for odd n)."""
    first, low, high = [0], 1, n - 1
    for i in range(1, n):
        if i % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [[(c + r) % n for c in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows
