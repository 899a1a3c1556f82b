"""Registers the engine-rule defaults (experiments/config/rule_defaults.py) in Hydra's
ConfigStore: Hydra imports every module of the `hydra_plugins` namespace package when it
starts, before it composes conf/config.yaml, whose defaults list names `engine_rules`."""

from experiments.config.rule_defaults import register

register()
