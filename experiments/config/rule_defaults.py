"""The run config's engine-rule defaults, derived from the rule declarations.

`register()` stores the config node `engine_rules` ({engine: {<rule>: <default>}} for every
rule the config sets, serving_core.engine_spec.config_defaults) in Hydra's ConfigStore;
conf/config.yaml's defaults list loads it first, so a declared rule is a key of every
composed config (overridable as engine.<name>=value, no `+`) with no line of YAML. The
Hydra plugin hydra_plugins/hsl_rules registers it whenever Hydra starts (every command
line, campaign and test composition).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from serving_core.engine_spec import config_defaults

RULE_DEFAULTS = "engine_rules"  # the node's name in conf/config.yaml's defaults list


def register() -> None:
    """Store (or replace) the `engine_rules` node from the current declarations."""
    ConfigStore.instance().store(name=RULE_DEFAULTS, node={"engine": config_defaults()})
