"""`python -m bench [part ...]`: the benchmarks, all or the parts named (any order given).

Parts: engine (engine wall time per cell), single (one whole experiments.run process,
P2), campaign (Q1 Exp 1a with 2 workers plus its analysis, P2), ledger (10^7 trace rows,
catalog queries, P4), kernel (paged versus contiguous decode, engine versus transformers'
generate on the tiny model), serve (our HTTP server against vLLM's under a saturating
streamed workload, `make bench-serve`), profile (where a saturating in-process real-path run
spends its time), scan (the prefill SSD scan alone at the tiny model's shapes). `python -m
bench` alone runs every part but serve, profile and scan. Numbers, not assertions: the
test suite never times anything.
"""

from __future__ import annotations

import sys

PARTS = {
    "engine": ("bench.engine_bench", []),
    "single": ("bench.campaign_bench", ["--part", "single"]),
    "campaign": ("bench.campaign_bench", ["--part", "campaign"]),
    "ledger": ("bench.ledger_bench", []),
    "kernel": ("bench.kernel_bench", []),
    "serve": ("bench.serve_bench", []),
    "profile": ("bench.profile_bench", []),
    "scan": ("bench.scan_bench", []),
}


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or [
        p for p in PARTS if p not in ("serve", "profile", "scan")]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"error: part={unknown[0]}: allowed {', '.join(PARTS)}", file=sys.stderr)
        return 2
    import importlib

    for name in names:
        module, args = PARTS[name]
        print(f"== bench {name}", flush=True)
        code = importlib.import_module(module).main(args)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
