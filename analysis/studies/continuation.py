"""Continuation correctness page (continuation.md): reload from the host tier, in process.

Reads the newest study run of the `continuation` table (ledgers.studies; written by
`python -m experiments.studies.continuation`, `make continuation`) and shows one row per
(organization, prompt length): restored prefix B, credited p, the rule's expected p, the
first reload batch, the host-to-device bytes and the audits, and whether the reload's
tokens equal the cold run's.

    python -m analysis.studies.continuation --ledgers ROOT [--out DIR]

prints the page's path and, as its LAST line, JSON {"pairs", "equal", "B_equals_p",
"audits_ok", "ok"} of that study run (the driver's own last line); exit 0 when every pair
passes, 1 when one fails, 2 without a continuation table.
"""

from __future__ import annotations

import sys

import pandas as pd

from analysis import cli

PAGE = "continuation.md"
TITLE = "Continuation correctness: a reloaded state continues like recomputation (in process)"
TABLES = ("continuation",)
FILL = "make continuation (python -m experiments.studies.continuation)"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def summary(rows: pd.DataFrame) -> dict:
    """The driver's last line, recomputed from the table's columns."""
    return {"pairs": int(len(rows)), "equal": int(rows["tokens_equal"].sum()),
            "B_equals_p": bool(rows["b_equals_p"].all()),
            "audits_ok": bool(rows["audits_ok"].all()), "ok": int(rows["ok"].sum())}


def section(rows: pd.DataFrame) -> str:
    head = rows.iloc[0]
    lines = [
        f"# {TITLE}",
        "",
        f"Study {head.study_id} (written {head.created_at}); model {head.model}, budget "
        f"{head.budget}; greedy, EOS ignored; per organization and prompt length N the target",
        "is generated cold, two interposers run, the device cache is reset keeping the host",
        "tier, and the target is regenerated from the reloaded prefix, restored into units",
        "filled with NaN beforehand. B: restored prefix; p: prefix the scheduler credited;",
        "expected p: the deepest boundary strictly inside the prompt that the engine's",
        "placement rule publishes; full = C floor((N-1)/C); lost = full - expected p.",
        "First batch: tokens computed / scheduled by the first reload step. Bytes:",
        "host-to-device bytes of the restore (all equal layers x (B x KV bytes/token +",
        "SSM + conv) where marked yes). Window: B / p of a request arriving while the",
        "saves were held incomplete (delayed-save audit; '-' where not run).",
        "",
        "| org | N | C | rule | B | p | expected p | full | lost | tier at N | first batch "
        "| bytes H2D | bytes ok | window | tokens equal | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.itertuples(index=False):
        rule = "step_end+align" if r.align_chunks else r.placement
        rule += "+split" if r.split_last_boundary else ""
        window = "-" if r.window_b < 0 else f"{r.window_b} / {r.window_p}"
        tokens = "yes" if r.tokens_equal else f"no (first at {r.first_mismatch})"
        fault = f" fault {r.fault}" if r.fault else ""
        codec = f" ({r.state_codec} state)" if r.state_codec not in ("auto", "", None) else ""
        lines.append(
            f"| {r.org}{codec} | {r.n_tokens} ({r.length_case}{fault}) | {r.interval} | {rule} | "
            f"{r.restored_prefix_b} | {r.credited_prefix_p} | {r.expected_p} | "
            f"{r.full_prefix} | {r.reuse_lost} | {r.tier_full_depth} | "
            f"{r.first_context} / {r.first_scheduled} | {r.bytes_h2d:,} | "
            f"{_yes(r.bytes_h2d == r.expected_bytes and r.restored_exact)} | {window} | "
            f"{tokens} | {_yes(r.ok)} |")
    same = rows[rows["same_chunks"]]
    lines += ["", f"{int(rows['ok'].sum())} of {len(rows)} pairs pass every column. Where the "
              "cold run ended a chunk at B and then ran the reload's chunks, the reload must "
              f"repeat its token logprobs bit for bit: {int(same['logprobs_equal'].sum())} of "
              f"{len(same)} do.", ""]
    lost = rows[rows["reuse_lost"] != 0]
    if len(lost):
        lines.append("Reuse lost under the engine's rule (prompt N = k C run as one aligned "
                     "chunk; no checkpoint at N - C): " + "; ".join(
                         f"{r.org} N={r.n_tokens}: {r.reuse_lost} tokens"
                         for r in lost.itertuples(index=False)) + ".")
        lines.append("")
    return "\n".join(lines)


write_page, main = cli.study_page(TABLES[0], PAGE, section, summary, FILL, "pairs", __doc__)


if __name__ == "__main__":
    sys.exit(main())
