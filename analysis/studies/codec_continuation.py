"""Compressed-state preemption page (codec_continuation.md): a request preempted after its
first chunk resumes from its compressed checkpoint exactly as the unpreempted run continues.

Reads the newest study run of the `codec_continuation` table (ledgers.studies; written by
`python -m experiments.studies.codec_continuation`, `make codec-continuation`, whose reuse half
goes to the `continuation` table and page) and shows one row per (state codec,
organization): where the request was preempted and resumed, whether tokens, logprobs and the
checkpoint at 2C equal the unpreempted run's, the fp32 control, and the reuse pair's outcome.

    python -m analysis.studies.codec_continuation --ledgers ROOT [--out DIR]

prints the page's path and, as its LAST line, JSON {"pairs", "ok"}; exit 0 when every row
passes, 1 when one fails, 2 without the table.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from analysis import cli

if TYPE_CHECKING:
    import pandas as pd

TABLES = ("codec_continuation",)  # the preemption half; the reuse half is continuation's
PAGE, FILL = ("codec_continuation.md",
              "make codec-continuation (python -m experiments.studies.codec_continuation)")
TITLE = "Compressed recurrent state: preemption and reuse continue exactly, per codec"
MARK = {True: "yes", False: "NO"}


def summary(rows: pd.DataFrame) -> dict:
    return {"pairs": int(len(rows)), "ok": int(rows["ok"].sum()),
            "reuse_ok": int(rows["reuse_ok"].sum())}


def section(rows: pd.DataFrame) -> str:
    head = rows.iloc[0]
    lines = [
        f"# {TITLE}", "",
        f"Study {head.study_id} (written {head.created_at}); model {head.model}, budget "
        f"{head.budget}, seed {head.seed}. A request of 2C + 1 tokens runs in chunks of C; it",
        "is preempted after its first chunk and resumed from the checkpoint the codec wrote",
        "at C. Required: one preemption, resumed at B = C, tokens, logprobs and the",
        "checkpoint at 2C bit-equal to the unpreempted run's, and the fp32 control differing",
        "at 2C (so the comparison can fail). Reuse: the same codec and organization's host",
        "reload pair (continuation.md).", "",
        "| codec | org | C | preempted at | resumed at | tokens | logprobs | state at 2C "
        "| fp32 control differs | reuse pair | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.itertuples(index=False):
        lines.append(
            f"| {r.state_codec} | {r.org} | {r.interval} | {r.preempted_at} | {r.resumed_b} | "
            f"{MARK[bool(r.tokens_equal)]} | {MARK[bool(r.logprobs_equal)]} | "
            f"{MARK[bool(r.state_equal)]} | {MARK[bool(r.fp32_differs)]} | "
            f"{MARK[bool(r.reuse_ok)]} | {MARK[bool(r.ok)]} |")
    lines += ["", f"{int(rows['ok'].sum())} of {len(rows)} rows pass; "
              f"{int(rows['reuse_ok'].sum())} reuse pairs pass.", ""]
    return "\n".join(lines)


write_page, main = cli.study_page(TABLES[0], PAGE, section, summary, FILL, "pairs", __doc__)


if __name__ == "__main__":
    sys.exit(main())
