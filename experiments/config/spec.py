"""The run config's engine spec, re-exported for callers still importing it from config.

The translation lives in `experiments.runners.spec` (runners build from it, and
runners must not import config); `experiments.config.validation` imports it here.
"""

from experiments.runners.spec import (  # noqa: F401
    INPROC_NAME,
    SIMULATED,
    TORCH_HTTP,
    TORCH_INPROC,
    VLLM,
    engine_spec,
    executor_path,
)
