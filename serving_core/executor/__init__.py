"""Executors: what runs a scheduled step (protocol in base.py).

Kinds, chosen by serving_core.builder's registry from an EngineSpec:
- simulated (modelled.SimulatedExecutor): the step-time model (simulated.py, device
  profiles in profiles.py) on a virtual clock;
- paced (modelled.PacedExecutor): the same model, each step slept on a wall clock;
- torch (torch_executor.TorchExecutor): the Falcon-H1 model over the organization's
  state arenas (state_arena.py), on a wall clock.
Clocks are in clocks.py; fit_steps.py fits a step model to a steps ledger.
"""

from serving_core.executor.profiles import (
    SSD_CHUNK_TOKENS,
    DeviceProfile,
    ModelCosts,
    available_devices,
    device_profile_from_config,
    load_device_profile,
    model_costs,
)
from serving_core.executor.simulated import (
    FEATURES,
    AdditiveStepModel,
    StepTimeModel,
    build_step_model,
)

__all__ = [
    "FEATURES",
    "AdditiveStepModel",
    "build_step_model",
    "SSD_CHUNK_TOKENS",
    "DeviceProfile",
    "ModelCosts",
    "StepTimeModel",
    "available_devices",
    "device_profile_from_config",
    "load_device_profile",
    "model_costs",
]
