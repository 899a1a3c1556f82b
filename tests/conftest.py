"""Shared fixtures: compose the project's Hydra config without a command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from serving_core.geometry import load_geometry

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def compose_config(*overrides: str):
    """The primary config with `overrides`, as the runner would see it."""
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def make_cfg(tmp_path):
    """Compose a config whose ledger root points into tmp_path."""

    def _make(*overrides: str):
        return compose_config(f"ledger_root={tmp_path / 'ledgers'}", *overrides)

    return _make


@pytest.fixture(scope="session")
def falcon():
    """Falcon-H1-7B geometry (conf/model/falcon_h1_7b.yaml)."""
    return load_geometry("falcon_h1_7b")


@pytest.fixture(scope="session")
def granite():
    return load_geometry("granite")


@pytest.fixture(scope="session")
def attention_only():
    return load_geometry("attention_only")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random-weight tiny Falcon-H1 checkpoint (conf/model/falcon_h1_tiny.yaml), built once
    per session offline with transformers' FalconH1 classes."""
    from serving_core.model.make_tiny import build

    return build(tmp_path_factory.mktemp("falcon_h1_tiny"), "falcon_h1_tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    """Our torch Falcon-H1 (fp32) loaded from the tiny checkpoint."""
    from serving_core.model.falcon_h1 import FalconH1

    return FalconH1.load(tiny_checkpoint)
