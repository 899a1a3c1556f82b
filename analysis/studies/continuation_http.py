"""Continuation over HTTP page (continuation_http.md): the boundary matrix through the
server's host tier.

Reads the newest study run of the `continuation_http` table (ledgers.studies; written by
`python -m experiments.studies.continuation_http`, `make continuation-http`): per case the
cold and reload paths the server recorded, restored B, credited p, the first reload batch
and whether the reload's tokens equal the cold run's.

    python -m analysis.studies.continuation_http --ledgers ROOT [--out DIR]

prints the page's path and, as its LAST line, JSON {"cases", "equal", "B_equals_p", "ok",
"seconds_per_case"} of that study run (the driver's own last line); exit 0 when every case
passes, 1 when one fails, 2 without a continuation_http table.
"""

from __future__ import annotations

import sys

import pandas as pd

from analysis import cli

PAGE = "continuation_http.md"
TITLE = "Continuation over HTTP (host tier in the server)"
TABLES = ("continuation_http",)
FILL = "make continuation-http (python -m experiments.studies.continuation_http)"


def summary(rows: pd.DataFrame) -> dict:
    """The driver's last line, recomputed from the table's columns."""
    return {"cases": int(len(rows)), "equal": int(rows["tokens_equal"].sum()),
            "B_equals_p": bool(rows["b_equals_p"].all()), "ok": int(rows["ok"].sum()),
            "seconds_per_case": round(float(rows["seconds"].sum()) / max(1, len(rows)), 1)}


def section(rows: pd.DataFrame) -> str:
    head = rows.iloc[0]
    lines = [f"# {TITLE}", "",
             f"Study {head.study_id} (written {head.created_at}); model {head.model}, budget "
             f"{head.budget}. Per case on one server (--host-tier, split_last_boundary on): "
             "target cold, two interposers, POST /reset_prefix_cache, target again. B: "
             "restored by the tier; p: credited (the reload's adopted prefix); expected p = "
             "C floor((N-1)/C). First batch: computed / scheduled (expected). Paths from the "
             "server's records.",
             "", "| org | case | template | N | C | out | cold path | reload path | B | p | "
             "expected p | first batch | tokens equal | s | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows.itertuples(index=False):
        lines.append(f"| {r.org} | {r.case} | {r.template} | {r.n_tokens} | {r.interval} | "
                     f"{r.output_tokens} | {r.cold_path} | {r.reload_path} | {r.restored_b} | "
                     f"{r.credited_p} | {r.expected_p} | {r.first_computed} / "
                     f"{r.first_scheduled} ({r.expected_first}) | "
                     f"{'yes' if r.tokens_equal else f'no (at {r.first_mismatch})'} | "
                     f"{r.seconds:.1f} | {'yes' if r.ok else 'NO'} |")
    lines += ["", f"{int(rows['ok'].sum())} of {len(rows)} cases pass every column.", ""]
    return "\n".join(lines)


write_page, main = cli.study_page(TABLES[0], PAGE, section, summary, FILL, "cases", __doc__)


if __name__ == "__main__":
    sys.exit(main())
