"""Planning reads a config's values from its plain copy (experiments.runners.spec.
resolved_config): the same columns and plan as the OmegaConf reads, and a deleted key is
still named as OmegaConf names it."""

from __future__ import annotations

import pytest
from conftest import compose_config
from omegaconf import open_dict
from omegaconf.errors import OmegaConfBaseException

from experiments.config.validation import validate_config
from experiments.runners.ledger_io import cell_columns
from experiments.runners.spec import resolved_config

CONFIGS = [(), ("org=d0", "budget=4091MiB"), ("org=s2", "workload.q=0.5", "load.rate=3.0"),
           ("org=s1", "engine.pinning_k=2", "retention.k=3")]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: " ".join(o) or "defaults")
def test_plain_reads_give_the_config_reads(overrides):
    cfg = compose_config(*overrides)
    resolved = resolved_config(cfg)
    assert cell_columns(cfg, resolved) == cell_columns(cfg)
    plain = validate_config(cfg, check_root=False, resolved=resolved)
    assert plain == validate_config(cfg, check_root=False)


def test_a_deleted_key_is_named_as_the_config_names_it():
    cfg = compose_config()
    with open_dict(cfg):
        del cfg.retention["k"]
    with pytest.raises(OmegaConfBaseException) as config_reads:
        validate_config(cfg, check_root=False)
    with pytest.raises(OmegaConfBaseException) as plain_reads:
        validate_config(cfg, check_root=False, resolved=resolved_config(cfg))
    assert type(plain_reads.value) is type(config_reads.value)
    assert str(plain_reads.value) == str(config_reads.value) and "retention.k" in str(
        plain_reads.value)
