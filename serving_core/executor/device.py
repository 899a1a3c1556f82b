"""Device placement of the real path: index tensors without a stream sync, the sync a
measurement needs, and what the device is.

The torch executor builds small index tensors (block tables, page ids, token ids) from
host lists every step. `torch.tensor(values, device="cuda")` copies from pageable host
memory and waits for the stream to drain: a host synchronisation per tensor, dozens per
decode step. `host_index` builds the tensor on the host in pinned memory and copies it
asynchronously (the caching host allocator keeps the pinned block alive until the copy
has run), so the decode loop reads the device back only where a token must be read (the
sampler's `tolist`). On a CPU device both are the same plain `torch.tensor`.
"""

from __future__ import annotations

import platform

import torch


def host_index(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """`torch.tensor(values, dtype)` on `device`, copied without a host synchronisation."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU): before a host clock is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: torch.device | str) -> dict:
    """What runs the real path: device name, capability, memory, driver-side CUDA version,
    torch version and the host; read from torch, never assumed."""
    device = torch.device(device)
    out = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.machine(), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update({
            "name": props.name, "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "memory_bytes": int(props.total_memory), "cuda_runtime": torch.version.cuda,
            "driver": _driver_version(),
        })
    else:
        out.update({"name": platform.processor() or platform.machine(), "driver": None,
                    "cuda_runtime": torch.version.cuda})
    return out


def _driver_version() -> str | None:
    """The NVIDIA driver's version through NVML (nvidia-ml-py), else nvidia-smi, else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - NVML absent or refused: try the command line
        pass
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
