"""Real vLLM next to our organizations on the real executor (campaign vllm_native).

Per arm (engine, organization, prefix caching) over the adopted complete runs: output
throughput (ledger episode), TTFT and E2E p99 over finished requests, prefix-hit tokens
(prompt tokens served from cache at admission: our engine's adopted prefix, vLLM's
reported cached tokens), preemptions (the poller's final cumulative count, which both
servers export), and vLLM's boot time. Each value is the mean over seeds with its
standard deviation and the number of seeds. `python -m analysis.questions.vllm_arm --ledgers ROOT`
prints the section; the report writes it as vllm_native.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.pages.render import md_table

CAMPAIGN = "vllm_native"
PAGE = "vllm_native.md"
TITLE = "Real vLLM arm"
METRICS = ("throughput", "ttft_p99", "e2e_p99", "prefix_hit_tokens", "preemptions", "boot_s")

_PER_RUN = """
    WITH r AS (
        SELECT run_id, seed, executor, org, throughput_ledger AS throughput, engine_config
        FROM runs WHERE campaign = ? AND status = 'complete' AND adopted),
    q AS (
        SELECT run_id,
               quantile_cont(ttft_s, 0.99) FILTER (status = 'finished') AS ttft_p99,
               quantile_cont(e2e_s, 0.99) FILTER (status = 'finished') AS e2e_p99,
               sum(greatest(adopted_prefix_tokens, 0)) AS prefix_hit_tokens,
               count(*) FILTER (status = 'finished') AS finished
        FROM requests WHERE campaign = ? GROUP BY run_id),
    p AS (
        SELECT run_id, max(preemptions_total) AS preemptions FROM poller
        WHERE campaign = ? GROUP BY run_id)
    SELECT r.*, q.ttft_p99, q.e2e_p99, q.prefix_hit_tokens, q.finished, p.preemptions
    FROM r LEFT JOIN q USING (run_id) LEFT JOIN p USING (run_id)
    ORDER BY executor, org, seed
"""


def _arm(row) -> str:
    engine = str(row["executor"]).split(":")[0]
    if engine != "vllm":
        return f"ours {row['org']} ({engine})"
    cfg = row["config"]
    cache = "prefix cache on" if cfg.get("prefix_caching") else "prefix cache off"
    return f"vLLM {cfg.get('version', '?')} {row['org']} ({cache})"


def per_run(con, campaign: str = CAMPAIGN) -> pd.DataFrame:
    """One row per adopted complete run of the campaign with its metrics and arm."""
    frame = con.execute(_PER_RUN, [campaign] * 3).df()
    if frame.empty:
        return frame
    frame["config"] = [json.loads(c or "{}") for c in frame["engine_config"]]
    frame["arm"] = frame.apply(_arm, axis=1)
    frame["boot_s"] = [c.get("boot_s", float("nan")) for c in frame["config"]]
    frame["workaround"] = [c.get("cpu_mamba2_fix_applied") for c in frame["config"]]
    return frame.drop(columns=["engine_config"])


def per_arm(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation over seeds of each metric, per arm."""
    rows = []
    for arm, group in runs.groupby("arm", sort=True):
        row = {"arm": arm, "seeds": int(group["seed"].nunique())}
        for m in METRICS:
            values = pd.to_numeric(group[m], errors="coerce")
            row[m] = values.mean()
            row[f"{m}_sd"] = values.std(ddof=1) if len(values) > 1 else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def _cache_line(runs: pd.DataFrame) -> list[str]:
    vllm = runs[runs["executor"].str.startswith("vllm")]
    if vllm.empty:
        return ["No vLLM run is complete yet."]
    cfg = vllm["config"].iloc[0]
    keys = ("block_size", "num_blocks", "page_bytes", "page_padding_percent", "cache_mode",
            "retention_interval", "kv_cache_memory_bytes_requested",
            "kv_cache_memory_bytes_allocated")
    return ["vLLM's effective cache (first vLLM run): "
            + ", ".join(f"{k} {cfg.get(k)}" for k in keys) + ". "
            "Tables vLLM has no records for: " + ", ".join(cfg.get("not_applicable", [])) + "."]


def section(con, campaign: str = CAMPAIGN) -> str:
    """The Markdown section comparing the arms of `campaign`."""
    runs = per_run(con, campaign)
    out = [f"# Real vLLM vs our organizations ({campaign})", ""]
    if runs.empty:
        return "\n".join(out + [f"No complete runs in campaign {campaign}.", ""])
    arms = per_arm(runs)
    cols = ["arm", "seeds"] + [c for m in METRICS for c in (m, f"{m}_sd")]
    out += ["Mean over seeds (sd); throughput in output tokens/s over the ledger episode, "
            "TTFT/E2E p99 in s, prefix-hit tokens summed over a run's requests, preemptions "
            "the final cumulative count, boot_s vLLM's start-to-healthy time.", "",
            md_table(arms, cols), "", *_cache_line(runs), "",
            "## Runs", "",
            md_table(runs, ["arm", "seed", "throughput", "ttft_p99", "e2e_p99",
                            "prefix_hit_tokens", "preemptions", "finished", "boot_s",
                            "workaround"]), ""]
    return "\n".join(out)


def write_page(con, out: Path, campaign: str = CAMPAIGN) -> Path | None:
    """Write the section as `out/vllm_native.md` (and its CSV) when the campaign has runs."""
    runs = per_run(con, campaign)
    if runs.empty:
        return None
    (out / "tables").mkdir(parents=True, exist_ok=True)
    per_arm(runs).to_csv(out / "tables" / f"{campaign}_arms.csv", index=False)
    path = out / PAGE
    path.write_text(section(con, campaign), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("analysis.questions.vllm_arm", __doc__)
    parser.add_argument("--campaign", default=CAMPAIGN)
    args = parser.parse_args(argv)

    def show(con) -> int:
        print(section(con, args.campaign))
        return 0

    return cli.with_ledgers(args.ledgers, show)


if __name__ == "__main__":
    sys.exit(main())
