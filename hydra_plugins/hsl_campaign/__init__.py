"""Hydra plugins of Hybrid State Lab: the campaign sweeper and the process launcher.

Discovered by Hydra through the `hydra_plugins` namespace package; configs live
in conf/hydra/sweeper/campaign.yaml and conf/hydra/launcher/local.yaml.
"""
