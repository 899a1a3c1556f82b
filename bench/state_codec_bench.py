"""Seconds per SSM element of the state codecs' torch encode + decode on this machine's CPU
(serving_core/executor/state_encoding.py), and the CPU profile's `state_codec_s_per_op`
fitted from them.

Each codec encodes and decodes one tiny-Falcon-H1 layer state (12 heads x 64 x 512 =
393,216 elements, fp32) `--repeats` times on one thread; the median time over the
elements is its seconds per element. The fit is least squares through the origin of those
seconds against the codec's nominal operations per element (serving_core/state_codec.py,
`ops_per_element` of an fp32 model): s_per_op = sum(t ops) / sum(ops^2), with each codec's
ratio t / (s_per_op ops) printed, since a torch reference codec's costs need not follow
the nominal operation counts. Usage: python -m bench.state_codec_bench [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from serving_core.executor.state_encoding import StateEncoder
from serving_core.state_codec import STATE_CODECS, ops_per_element

SHAPE = (12, 64, 512)


def seconds_per_element(codec: str, repeats: int) -> float:
    enc = StateEncoder(codec, SHAPE, 1)
    x = torch.randn(1, *SHAPE, generator=torch.Generator().manual_seed(0))
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        enc.decode(enc.encode(x, [(0, i)]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / x.numel()


def fit(measured: dict[str, float]) -> tuple[float, dict[str, float]]:
    ops = {c: ops_per_element(c, 4) for c in measured}
    s = sum(measured[c] * ops[c] for c in measured) / sum(o * o for o in ops.values())
    return s, {c: measured[c] / (s * ops[c]) for c in measured}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.state_codec_bench")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        print(f"error: --repeats={args.repeats}: allowed integers >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    codecs = [c for c in STATE_CODECS if ops_per_element(c, 4)]
    measured = {c: seconds_per_element(c, args.repeats) for c in codecs}
    s, ratios = fit(measured)
    for c in codecs:
        print(f"{c:9s} {measured[c]:.3e} s/element  ops {ops_per_element(c, 4)}  "
              f"measured / fit {ratios[c]:.2f}")
    print(json.dumps({"state_codec_s_per_op": s, "seconds_per_element": measured}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
