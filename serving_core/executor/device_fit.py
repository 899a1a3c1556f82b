"""Which declared device a model is served on: the smallest that holds it.

A model fits a device when, on each of its GPUs, its share of the weights, the activations
of one forward of the engine's token budget and its share of the state budget sum to at most
the memory vLLM lets a run use:

    weights / t + activations + state / t <= USABLE_FRACTION x capacity

with t the device's tensor-parallel degree. Activations: ACTIVATION_WIDTHS hidden-width bf16
buffers per token of the step's token budget (residual, normed input, the mixer's and the
FFN's projection outputs, which widen to about 4 x hidden), replicated on every GPU.
USABLE_FRACTION is vLLM's default gpu_memory_utilization (0.9): the rest is the CUDA
context, the allocator's fragmentation and the sampler's buffers. `choose_device` takes
the first device of DEVICE_ORDER that fits (fewest GPUs first, then the least memory per
GPU); a model no declared device holds is refused in one line.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass

from serving_core.executor.profiles import DeviceProfile, load_device_profile
from serving_core.geometry import Geometry

USABLE_FRACTION = 0.9  # vLLM EngineArgs gpu_memory_utilization default
ACTIVATION_WIDTHS = 16  # hidden-width buffers live per token in one forward
# conf/executor options, fewest GPUs first, then the least memory per GPU.
DEVICE_ORDER = ("a100", "a100_80gb", "h100", "h200_141gb", "h100_tp2", "h200_tp2",
                "h100_tp4", "h100_tp8")


@dataclass(frozen=True)
class Fit:
    """Bytes one GPU of `device` holds for a model and a state budget."""

    device: str
    tensor_parallel: int
    weights: float
    activations: int
    state: float
    usable: float

    @property
    def needed(self) -> float:
        return self.weights + self.activations + self.state

    @property
    def fits(self) -> bool:
        return self.needed <= self.usable

    def line(self) -> str:
        gb = 1e9
        return (f"{self.device} (tp {self.tensor_parallel}): per GPU weights "
                f"{self.weights / gb:.2f} + activations {self.activations / gb:.2f} + state "
                f"{self.state / gb:.2f} = {self.needed / gb:.2f} GB of {self.usable / gb:.2f} "
                f"usable")


def activation_bytes(geometry: Geometry, profile: DeviceProfile) -> int:
    """Peak activations of one forward: the token budget x ACTIVATION_WIDTHS x hidden."""
    return (profile.max_num_batched_tokens * ACTIVATION_WIDTHS * geometry.hidden_size
            * geometry.dtype_bytes)


@functools.lru_cache(maxsize=32)
def _named_profile(name: str) -> DeviceProfile:
    return load_device_profile(name)


def device_fit(geometry: Geometry, device: str | DeviceProfile, state_bytes: int) -> Fit:
    """The per-GPU bytes of serving `geometry` with `state_bytes` of state on `device`."""
    profile = _named_profile(device) if isinstance(device, str) else device
    tp = profile.tensor_parallel
    name = device if isinstance(device, str) else profile.name
    return Fit(name, tp, geometry.weight_bytes / tp, activation_bytes(geometry, profile),
               state_bytes / tp, USABLE_FRACTION * profile.hbm_capacity_bytes)


def choose_device(geometry: Geometry, state_bytes: int) -> str:
    """The first device of DEVICE_ORDER that holds the model; ValueError in one line when
    none does."""
    for name in DEVICE_ORDER:
        if device_fit(geometry, name, state_bytes).fits:
            return name
    largest = device_fit(geometry, DEVICE_ORDER[-1], state_bytes)
    raise ValueError(f"model={geometry.name!r} with {state_bytes / 1e9:.2f} GB of state fits "
                     f"no declared device ({', '.join(DEVICE_ORDER)}); the largest: "
                     f"{largest.line()}")


def check_fits(geometry: Geometry, device, state_bytes: int, option: str) -> None:
    """Refuse (ValueError, one line) a run of a model on a device that cannot hold it."""
    fit = device_fit(geometry, device, state_bytes)
    if fit.fits:
        return
    try:
        hint = f"executor={choose_device(geometry, state_bytes)} holds it"
    except ValueError:
        hint = f"no declared device holds it ({', '.join(DEVICE_ORDER)})"
    raise ValueError(f"{option}: cannot hold model={geometry.name!r} "
                     f"({fit.line()}); {hint} (serving_core/executor/device_fit.py)")


def main(argv: list[str] | None = None) -> int:
    """`python -m serving_core.executor.device_fit --model M --budget B`: the device the
    rule chooses and the fit on every declared device, as JSON; exit 2 when none holds it."""
    from serving_core.geometry import load_geometry
    from serving_core.planner import plan_budget

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", required=True, help="bN, pN or NMiB (serving_core/planner.py)")
    args = ap.parse_args(argv)
    try:
        g = load_geometry(args.model)
        state = plan_budget(g, args.budget).model_nominal_bytes
        fits = {n: device_fit(g, n, state).line() for n in DEVICE_ORDER}
        chosen = choose_device(g, state)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, "state_bytes": state, "device": chosen,
                      "fits": fits}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
