"""Fast composition of a campaign's job configs, equal to Hydra's own."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import Container, DictConfig, ListConfig, open_dict
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import OmegaConfBaseException

from experiments.runners.spec import resolved_config

Path = tuple[Any, ...]  # keys from the config's root to a node


def _interpolations(node: Container, at: Path = ()) -> list[Path]:
    """Paths of the interpolated values under `node`; a list holding one counts whole."""
    found: list[Path] = []
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        child = node._get_node(key)
        if child._is_interpolation():
            found.append((*at, key))
        elif isinstance(child, Container) and not child._is_none() and not child._is_missing():
            inner = _interpolations(child, (*at, key))
            found += [(*at, key)] if inner and isinstance(child, ListConfig) else inner
    return found


def _copy_plain(value):
    """A copy of plain config data (dicts and lists copied, leaves shared: immutable)."""
    if isinstance(value, dict):
        return {k: _copy_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    return value


def _plain_at(cfg: DictConfig, path: Path):
    """The node at `path` as OmegaConf.to_container(cfg, resolve=True) has it."""
    parent = cfg
    for key in path[:-1]:
        parent = parent._get_node(key)
        if not isinstance(parent, DictConfig) or parent._is_interpolation():
            raise KeyError(path)  # the whole conversion decides (and names the error)
    if path[-1] not in parent:
        raise KeyError(path)
    node = parent._get_child(path[-1], throw_on_missing_value=False)._dereference_node()
    if isinstance(node, Container):
        return BaseContainer._to_content(node, resolve=True, throw_on_missing=False)
    return node._value()


def _set_at(plain: dict, path: Path, value) -> None:
    """Put `value` at `path` of the plain config, whose parents must be dicts with the key."""
    for key in path[:-1]:
        plain = plain[key]
        if not isinstance(plain, dict):
            raise KeyError(path)
    if path[-1] not in plain:
        raise KeyError(path)
    plain[path[-1]] = value


def _changed_path(override: Override) -> Path | None:
    """The dotted key a plain value change sets; None for additions, deletions, packages."""
    if override.type != OverrideType.CHANGE or override.package is not None:
        return None
    return tuple(override.key_or_group.split("."))


class CellComposer:
    """Compose job configs as Hydra would, fast: one full composition per set of group
    overrides (config groups such as campaign=, model=), then value overrides applied
    with Hydra's own override code. A full composition costs ~0.1 s, this ~1 ms. Each job
    gets its own copy of the base, unpickled (OmegaConf's own pickling keeps flags and
    interpolations; 4x cheaper than a deep copy of the node tree)."""

    def __init__(self, config_loader, master_config: DictConfig) -> None:
        self._loader = config_loader
        self._master = master_config
        self._parser = OverridesParser.create(config_loader=config_loader)
        self._bases: dict[tuple[str, ...], bytes] = {}  # pickled base configs
        self._parsed: dict[str, Override] = {}  # campaigns repeat a few dozen override lines
        self._group_keys: dict[str, bool] = {}
        # per base: its config resolved to plain Python (None: it does not resolve) and
        # the paths of its interpolations, which a job's value changes may move
        self._resolved: dict[tuple[str, ...], tuple[dict | None, list[Path]]] = {}

    def _is_group(self, override: Override) -> bool:
        key = override.key_or_group
        if key not in self._group_keys:
            self._group_keys[key] = self._loader.repository.group_exists(key)
        return self._group_keys[key]

    def _parse(self, lines: Sequence[str]) -> list[Override]:
        new = [line for line in dict.fromkeys(lines) if line not in self._parsed]
        if new:
            self._parsed.update(zip(new, self._parser.parse_overrides(new), strict=True))
        return [self._parsed[line] for line in lines]

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """The job config of `overrides`, equal to Hydra's composition of them."""
        return self.compose_resolved(overrides, resolve=False)[0]

    def compose_resolved(self, overrides: Sequence[str], resolve: bool = True
                         ) -> tuple[DictConfig, dict | None]:
        """The job config and, with `resolve`, it as plain Python, equal to
        experiments.runners.spec.resolved_config of it: the base's resolved copy with the
        values the job changes and every interpolation read again from the job config
        (the whole conversion where the job adds or deletes keys or any read fails)."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        parsed = self._parse(overrides)
        groups = tuple(o.input_line for o in parsed if self._is_group(o))
        if groups not in self._bases:
            full = self._loader.load_sweep_config(self._master, list(groups))
            with open_dict(full):
                del full["hydra"]
            self._bases[groups] = pickle.dumps(full, protocol=pickle.HIGHEST_PROTOCOL)
            self._resolved[groups] = (resolved_config(full), _interpolations(full))
        cfg = pickle.loads(self._bases[groups])
        values = [o for o in parsed if not self._is_group(o)]
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        if not resolve:
            return cfg, None
        base, interpolated = self._resolved[groups]
        changed = [_changed_path(o) for o in values]
        if base is None or None in changed:
            return cfg, resolved_config(cfg)
        plain = _copy_plain(base)
        try:
            for path in (*changed, *interpolated):
                _set_at(plain, path, _plain_at(cfg, path))
        except (KeyError, OmegaConfBaseException):
            return cfg, resolved_config(cfg)
        return cfg, plain
