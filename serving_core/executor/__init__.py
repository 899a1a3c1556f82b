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
from serving_core.executor.simulated import INDIRECT_ORGS, StepTimeModel

__all__ = [
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
