"""Settings of the real (torch) executor and the checks run before a cell starts."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path

from serving_core import env_switches
from serving_core.geometry import Geometry
from serving_core.model.config import check_geometry, read_config
from serving_core.model.loader import model_type

TORCH_KIND = "torch"
_FIELDS = ("name", "kind", "checkpoint", "device", "dtype", "max_num_batched_tokens",
           "scan_chunk", "prefill_batch_tokens")
_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TorchExecutorConfig:
    checkpoint: str
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048
    name: str = TORCH_KIND
    scan_chunk: int = 128  # tokens per chunk of the prefill SSD scan (FalconH1 scan_chunk)
    # prefill chunks over the same span share a forward up to this many tokens (0: one
    # request per forward; None: the executor's default)
    prefill_batch_tokens: int | None = None


def checked_model_fields(cfg, fields) -> tuple[dict, str]:
    """A real executor node's fields (only `fields` allowed), a checkpoint and its dtype;
    ValueError names the field. Shared by every executor that runs a checkpoint."""
    data = dict(cfg.items())
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"executor: unknown fields {unknown}; allowed fields are {list(fields)}")
    if not data.get("checkpoint"):
        raise ValueError("executor.checkpoint: a checkpoint folder is required")
    dtype = str(data.get("dtype", "float32"))
    if dtype not in _DTYPES:
        raise ValueError(f"executor.dtype={dtype!r}: allowed values are {list(_DTYPES)}")
    return data, dtype


def torch_executor_config(cfg) -> TorchExecutorConfig:
    """Parse and check an executor=torch node, and the torch side's environment switches
    (serving_core/env_switches.py); ValueError names the field or the variable."""
    env_switches.check()
    data, dtype = checked_model_fields(cfg, _FIELDS)
    device = str(data.get("device", "cpu"))
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"executor.device={device!r}: allowed values are cpu, cuda, cuda:N")
    tokens = data.get("max_num_batched_tokens", 2048)
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 1:
        raise ValueError(f"executor.max_num_batched_tokens={tokens!r}: expected an integer >= 1")
    chunk = data.get("scan_chunk", 128)
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"executor.scan_chunk={chunk!r}: expected an integer >= 1")
    batch = data.get("prefill_batch_tokens")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, numbers.Integral)
                              or batch < 0):
        raise ValueError(f"executor.prefill_batch_tokens={batch!r}: expected an integer >= 0 "
                         "or null (the executor's default)")
    return TorchExecutorConfig(str(data["checkpoint"]), device, dtype, int(tokens),
                               str(data.get("name", TORCH_KIND)), int(chunk),
                               None if batch is None else int(batch))


def check_checkpoint(tcfg: TorchExecutorConfig, geometry: Geometry) -> dict:
    """The checkpoint's config, after checking it has weights and matches the preset."""
    try:
        has_config = (Path(tcfg.checkpoint) / "config.json").is_file()
        cfg = read_config(tcfg.checkpoint,
                          model_type(tcfg.checkpoint) if has_config else "falcon_h1")
    except ValueError as err:
        raise ValueError(f"executor.{err}") from None
    if not any(Path(tcfg.checkpoint).glob("*.safetensors")):
        raise ValueError(
            f"executor.checkpoint={tcfg.checkpoint!r}: no *.safetensors weights next to "
            "config.json"
        )
    try:
        check_geometry(cfg, geometry, tcfg.checkpoint)
    except ValueError as err:
        raise ValueError(f"executor.{err}") from None
    return cfg
