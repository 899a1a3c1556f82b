"""The prefill SSD scan alone at the tiny Falcon-H1's mixer shapes (H 12, P 64, N 512, G 1).

Times `mamba.chunk_scan` for prompt segments of 512 / 1,024 / 2,048 tokens at batch 1 and
4 tokens x 512, for scan chunks of 64 / 128 / 256 tokens, next to the previous
implementation (kept here as `_chunk_scan_before`: token-major states, all-pairs decay
matrices built out of place) and transformers' formulation (`chunk_scan_reference`). Each
row is the median thread CPU time of 5 runs with one intra-op thread (a busy shared machine
does not inflate it) and the rate of the state products' arithmetic (4 T H P N flops, the
floor of the SSD form at N = 512). Prints a table and writes bench/results/scan.json.
Numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from bench.kernel_bench import RESULTS
from bench.timing import median_ms
from serving_core.model import mamba
from serving_core.model.mamba import _decay, segment_sum

SHAPES = ((1, 512), (1, 1024), (1, 2048), (4, 512))
CHUNKS = (64, 128, 256)
H, P, N, G = 12, 64, 512, 1


def _chunk_scan_before(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor, chunk: int, initial: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mamba.chunk_scan` as it was (arguments and results the same): the state carried
    across chunks by one (b, H, P, N) update per chunk, token-major states, all-pairs decay."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    hg = h // g
    d_res, xdt, Adt, B, C = mamba.scan_inputs(x, dt, A, B, C, D, chunk)
    nc = xdt.shape[1]
    A_cum = torch.cumsum(Adt, dim=2)  # (b, c, l, H)
    # Intra-chunk: y_diag[i] = sum_{j <= i} (C_i . B_j) exp(A_cum_i - A_cum_j) xdt_j.
    Bg = B.permute(0, 1, 3, 2, 4)  # (b, c, G, l, N)
    Cg = C.permute(0, 1, 3, 2, 4)
    CB = torch.matmul(Cg, Bg.transpose(-1, -2))  # (b, c, G, l, l)
    L = _decay(segment_sum(Adt.permute(0, 1, 3, 2)))  # (b, c, H, l, l)
    M = (L.view(b, nc, g, hg, chunk, chunk) * CB[:, :, :, None]).view(b, nc, h, chunk, chunk)
    xh = xdt.permute(0, 1, 3, 2, 4)  # (b, c, H, l, P)
    y = torch.matmul(M, xh).permute(0, 1, 3, 2, 4)  # (b, c, l, H, P)
    # Each chunk's own contribution to the state at its end.
    decay = _decay(A_cum[:, :, -1:] - A_cum)  # (b, c, l, H)
    xd = (xdt * decay[..., None]).view(b, nc, chunk, g, hg * p).permute(0, 1, 3, 4, 2)
    own = torch.matmul(xd, Bg)  # (b, c, G, hg P, N)
    # Carry the state across chunks: s_{k+1} = exp(A_cum_k[-1]) s_k + own_k.
    last = _decay(A_cum[:, :, -1])  # (b, c, H)
    states = torch.empty(b, nc, h, p, n, dtype=torch.float32, device=x.device)
    s = initial.float()
    for k in range(nc):
        states[:, k] = s
        s = s * last[:, k, :, None, None] + own[:, k].reshape(b, h, p, n)
    # Inter-chunk: y_off[i] = exp(A_cum_i) C_i . s_k.
    sg = states.view(b, nc, g, hg * p, n).transpose(-1, -2)  # (b, c, G, N, hg P)
    y_off = torch.matmul(Cg, sg)  # (b, c, G, l, hg P)
    y_off = y_off.permute(0, 1, 3, 2, 4).reshape(b, nc, chunk, h, p)
    y = y + y_off * _decay(A_cum)[..., None]
    y = y.reshape(b, nc * chunk, h, p)[:, :t] + d_res
    return y, s



def _inputs(b: int, t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, H, P, generator=gen)
    dt = mamba.discretize_dt(torch.randn(b, t, H, generator=gen),
                             0.5 * torch.randn(H, generator=gen), (0.0, math.inf))
    A = -torch.exp(2 * torch.randn(H, generator=gen))
    B, C = torch.randn(b, t, G, N, generator=gen), torch.randn(b, t, G, N, generator=gen)
    return x, dt, A, B, C, torch.randn(H, generator=gen), torch.randn(b, H, P, N, generator=gen)


def _median_ms(fn, repeats: int) -> float:
    """This thread's CPU milliseconds of `fn()`, the upper median of `repeats` calls."""
    return median_ms(fn, repeats, clock=time.thread_time, pick=statistics.median_high)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scan", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kernels = {"chunk_scan": mamba.chunk_scan, "before": _chunk_scan_before,
               "reference": mamba.chunk_scan_reference}
    rows = []
    print(f"{'b x T':>10} {'chunk':>6} " + " ".join(f"{k + ' ms':>14}" for k in kernels)
          + f" {'GFLOP/s':>8} {'speed-up':>9}")
    for b, t in SHAPES:
        x, dt, A, B, C, D, init = _inputs(b, t)
        for chunk in CHUNKS:
            call = (x, dt, A, B, C, D, chunk, init)
            ms = {k: _median_ms(lambda f=f, call=call: f(*call), args.repeats)
                  for k, f in kernels.items()}
            gflops = 4 * b * t * H * P * N / ms["chunk_scan"] / 1e6
            rows.append({"batch": b, "tokens": t, "chunk": chunk, **{f"{k}_ms": v for k, v
                         in ms.items()}, "gflops": gflops})
            print(f"{b:>3} x {t:<5} {chunk:>6} " + " ".join(f"{v:>14.1f}" for v in ms.values())
                  + f" {gflops:>8.1f} {ms['before'] / ms['chunk_scan']:>8.2f}x", flush=True)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"rows": rows, "load_avg": load, "threads": 1}
    (RESULTS / "scan.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
