"""Campaign sweeper: blocks of Hydra sweeps, run order, smoke mode, skip of complete runs.

The work is done by experiments.campaigns.campaign (imported lazily: Hydra imports every
plugin module at start-up, single runs included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf


class CampaignSweeper(Sweeper):
    def __init__(self, **sweeper_config: Any) -> None:
        self.sweeper_config = {
            k: OmegaConf.to_container(v) if isinstance(v, (DictConfig, ListConfig)) else v
            for k, v in sweeper_config.items()
        }
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: Sequence[str]) -> Any:
        from experiments.campaigns.campaign import CampaignSpec, run_campaign

        assert self.hydra_context is not None and self.config is not None
        spec = CampaignSpec.from_config(self.sweeper_config)
        return run_campaign(
            spec, arguments, config_loader=self.hydra_context.config_loader,
            config=self.config, launcher=self.launcher,
        )
