"""Executors: the simulated device (step-time model on a virtual clock)."""

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
    INDIRECT_ORGS,
    AdditiveStepModel,
    StepTimeModel,
    build_step_model,
)

__all__ = [
    "FEATURES",
    "AdditiveStepModel",
    "build_step_model",
    "INDIRECT_ORGS",
    "SSD_CHUNK_TOKENS",
    "DeviceProfile",
    "ModelCosts",
    "StepTimeModel",
    "available_devices",
    "device_profile_from_config",
    "load_device_profile",
    "model_costs",
]
