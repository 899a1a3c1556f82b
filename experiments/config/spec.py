"""The run config's engine spec, re-exported for experiments.config.validation.

The translation lives in `experiments.runners.spec` (runners build from it, and
runners must not import config).
"""

from experiments.runners.spec import (  # noqa: F401
    SIMULATED,
    TORCH_HTTP,
    TORCH_INPROC,
    VLLM,
    VLLM_VIRTUAL,
    engine_spec,
    executor_path,
)
