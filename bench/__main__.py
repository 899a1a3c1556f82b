"""`python -m bench [part ...]`: the benchmarks, all or the parts named (any order given).

Parts: engine (engine wall time per cell), single (one whole experiments.run process,
P2), campaign (Q1 Exp 1a with 2 workers plus its analysis, P2), ledger (10^7 trace rows,
catalog queries, P4), kernel (paged versus contiguous decode, engine versus transformers'
generate on the tiny model). Numbers, not assertions: the test suite never times anything.
"""

from __future__ import annotations

import sys

PARTS = {
    "engine": ("bench.engine_bench", []),
    "single": ("bench.campaign_bench", ["--part", "single"]),
    "campaign": ("bench.campaign_bench", ["--part", "campaign"]),
    "ledger": ("bench.ledger_bench", []),
    "kernel": ("bench.kernel_bench", []),
}


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv) or list(PARTS)
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
