"""`python -m bench.side_by_side DIR`: one table of the side-by-side run (bench/side_by_side.sh).

Reads the `bench.serve_bench` results in DIR (one JSON per allocator and client, each with
our S2 server and vLLM's at every concurrency) and `kernels.json` (`BENCH=kernel`'s paged
vs contiguous decode) and prints, per (allocator, client, concurrency): output tokens/s of
ours and vLLM's and their ratio against the issue's target (glibc: >= 1.3x at the largest
concurrency, >= 1x below; tcmalloc: >= 1.5x at the largest), TTFT p99 of both (ours must
not exceed vLLM's), and each server's CPU ms and minor page faults per output token. Then
the kernel ratios (target <= 1.10). Numbers, not assertions; exit 2 when DIR has no result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGETS = {"glibc": 1.3, "tcmalloc": 1.5}  # ours / vLLM output tok/s at the top concurrency
KERNEL_LIMIT = 1.10


def _rows(path: Path) -> dict[tuple, dict]:
    """(concurrency, arm) -> the last row of that arm at that concurrency."""
    data = json.loads(path.read_text())
    return {(r["concurrency"], "vllm" if r["arm"] == "vllm" else "ours"): r
            for r in data["rows"]}


def _target(alloc: str, n: int, top: int) -> float:
    return TARGETS.get(alloc, 1.0) if n == top else 1.0


def serve_lines(results: dict[str, Path]) -> list[str]:
    """Table lines for {"<allocator>_<client>": result path}."""
    head = (f"{'alloc':15} {'client':6} {'conc':>4} {'ours tok/s':>10} {'vLLM tok/s':>10} "
            f"{'ratio':>6} {'target':>6} {'TTFT99 ours':>11} {'vLLM':>6} "
            f"{'cpu ms/tok ours':>15} {'vLLM':>6} {'faults/tok ours':>15} {'vLLM':>6}")
    lines = [head]
    for name, path in results.items():
        alloc, client = name.split("_", 1)
        rows = _rows(path)
        # an ours-only variant ("glibc-t1_ours": one thread) is read against the vLLM rows
        # of its allocator's file
        base = results.get(f"{alloc.split('-')[0]}_{client}")
        others = _rows(base) if base is not None and base != path else {}
        concs = sorted({n for n, _ in rows})
        for n in concs:
            ours = rows.get((n, "ours"))
            vllm = rows.get((n, "vllm")) or others.get((n, "vllm"))
            if ours is None or vllm is None:
                lines.append(f"{alloc:15} {client:6} {n:>4} missing arm: "
                             f"{'ours' if ours is None else 'vllm'}")
                continue
            ratio = ours["output_tok_s"] / vllm["output_tok_s"]
            target = _target(alloc.split("-")[0], n, concs[-1])
            mark = "ok" if ratio >= target else "BELOW"
            lines.append(
                f"{alloc:15} {client:6} {n:>4} {ours['output_tok_s']:>10.1f} "
                f"{vllm['output_tok_s']:>10.1f} {ratio:>6.2f} {target:>5.1f}x "
                f"{ours['ttft_p99_s']:>11.2f} {vllm['ttft_p99_s']:>6.2f} "
                f"{ours.get('server_cpu_ms_per_token', float('nan')):>15.2f} "
                f"{vllm.get('server_cpu_ms_per_token', float('nan')):>6.2f} "
                f"{ours.get('faults_per_token', float('nan')):>15.1f} "
                f"{vllm.get('faults_per_token', float('nan')):>6.1f} {mark}")
    return lines


def kernel_lines(path: Path) -> list[str]:
    """Paged / contiguous decode ratios of bench/kernel_bench.py's result."""
    if not path.exists():
        return [f"kernel: no {path.name} (BENCH=kernel did not run or failed)"]
    rows = json.loads(path.read_text()).get("paged_vs_contiguous", [])
    out = [f"kernel {r['org']} b={r['batch']}: mixer {r['mixer_ratio']:.3f}, model "
           f"{r['model_ratio']:.3f}" + (
               f"; contiguous on huge pages too: mixer {r['mixer_ratio_matched']:.3f}, model "
               f"{r['model_ratio_matched']:.3f}" if "model_ratio_matched" in r else "")
           for r in rows]
    for what, suffix in (("paged/contiguous", ""), ("matched", "_matched")):
        keys = (f"mixer_ratio{suffix}", f"model_ratio{suffix}")
        worst = max((r[k] for r in rows for k in keys if k in r), default=None)
        if worst is not None:
            out.append(f"kernel worst {what} {worst:.3f} (limit {KERNEL_LIMIT:.2f}): "
                       + ("ok" if worst <= KERNEL_LIMIT else "ABOVE"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.side_by_side DIR", file=sys.stderr)
        return 2
    folder = Path(args[0])
    results = {p.stem: p for p in sorted(folder.glob("*_*.json")) if p.stem != "kernels"}
    if not results:
        print(f"error: DIR={folder}: no <allocator>_<client>.json result in it",
              file=sys.stderr)
        return 2
    print("\n".join(serve_lines(results) + kernel_lines(folder / "kernels.json")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
