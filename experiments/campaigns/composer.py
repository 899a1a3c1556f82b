"""Fast composition of a campaign's job configs, equal to Hydra's own."""

from __future__ import annotations

import pickle
from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, open_dict


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
        from hydra._internal.config_loader_impl import ConfigLoaderImpl

        parsed = self._parse(overrides)
        groups = tuple(o.input_line for o in parsed if self._is_group(o))
        if groups not in self._bases:
            full = self._loader.load_sweep_config(self._master, list(groups))
            with open_dict(full):
                del full["hydra"]
            self._bases[groups] = pickle.dumps(full, protocol=pickle.HIGHEST_PROTOCOL)
        cfg = pickle.loads(self._bases[groups])
        values = [o for o in parsed if not self._is_group(o)]
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg
