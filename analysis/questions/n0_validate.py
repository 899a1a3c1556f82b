"""Simulated N0 against real vLLM (campaign n0_validate): the organization's mechanism.

The same cells (budget x seed, low load) on real vLLM 0.32 (executor=vllm) and on our
simulator's N0 with vLLM's CPU block alignment. vLLM exports no step records, so no step
profile is fitted and time-based readouts are shown for reference only; what is compared is
what the organization decides: per request, the prompt tokens served from cache at
admission (vLLM's reported cached tokens; our adopted prefix), and per run the requests
with a hit, the hit tokens and the preemptions (the poller's final cumulative count, which
both export). Requests are paired by (budget, seed, request id): the workload is a function
of the seed, so the same request id is the same prompt and arrival time on both.

`python -m analysis.questions.n0_validate --ledgers ROOT` prints the section (last line: JSON);
`analysis.report` writes it as n0_validate.md when the campaign has runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.pages.render import md_table

CAMPAIGN = "n0_validate"
PAGE = "n0_validate.md"
TITLE = "Simulated N0 against real vLLM"
FILL = "make campaign C=n0_validate JOBS=1 (needs make setup-vllm)"

_RUNS = """
    SELECT run_id, seed, budget, executor, org, throughput_span
    FROM runs WHERE campaign = ? AND status = 'complete' AND adopted
"""
_REQUESTS = """
    SELECT run_id, request_id, context_id, prompt_tokens,
           greatest(adopted_prefix_tokens, 0) AS hit_tokens, ttft_s
    FROM requests WHERE campaign = ? AND status = 'finished'
"""
_POLLER = """
    SELECT run_id, max(preemptions_total) AS preemptions FROM poller
    WHERE campaign = ? GROUP BY run_id
"""


def arm_of(executor: str) -> str:
    """'vllm' for the real vLLM arm, 'sim' for the simulator."""
    return "vllm" if str(executor).startswith("vllm") else "sim"


def load(con, campaign: str = CAMPAIGN) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs with their arm and run-level readouts, finished requests with their arm)."""
    runs = con.execute(_RUNS, [campaign]).df()
    if runs.empty:
        return runs, pd.DataFrame()
    runs["arm"] = runs["executor"].map(arm_of)
    # One run per (arm, budget, seed): the first adopted one.
    runs = runs.sort_values(["arm", "budget", "seed", "run_id"]).drop_duplicates(
        ["arm", "budget", "seed"], keep="first")
    reqs = con.execute(_REQUESTS, [campaign]).df()
    reqs = reqs.merge(runs[["run_id", "arm", "budget", "seed"]], on="run_id", how="inner")
    per_run = reqs.groupby("run_id").agg(
        requests=("request_id", "size"), hit_tokens=("hit_tokens", "sum"),
        hit_requests=("hit_tokens", lambda s: int((s > 0).sum())),
        ttft_p99=("ttft_s", lambda s: s.quantile(0.99))).reset_index()
    runs = runs.merge(per_run, on="run_id", how="left")
    runs = runs.merge(con.execute(_POLLER, [campaign]).df(), on="run_id", how="left")
    return runs.reset_index(drop=True), reqs


def paired_requests(reqs: pd.DataFrame) -> pd.DataFrame:
    """Requests finished on both arms, side by side, with whether their hits agree."""
    keys = ["budget", "seed", "request_id"]
    real = reqs[reqs["arm"] == "vllm"][[*keys, "context_id", "hit_tokens"]]
    sim = reqs[reqs["arm"] == "sim"][[*keys, "hit_tokens"]]
    both = real.merge(sim, on=keys, suffixes=("_vllm", "_sim"))
    both["agree"] = both["hit_tokens_vllm"] == both["hit_tokens_sim"]
    # n-th request of its shared context in the run (request ids follow arrival order)
    both["nth_of_context"] = both.groupby(["budget", "seed", "context_id"])[
        "request_id"].rank(method="first").astype(int)
    return both.sort_values(keys).reset_index(drop=True)


def cell_table(runs: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame:
    """Per budget: per arm the mean per run of each readout, and the request agreement."""
    rows = []
    for budget, group in runs.groupby("budget", sort=True):
        row = {"budget": budget}
        for arm in ("vllm", "sim"):
            sub = group[group["arm"] == arm]
            row[f"seeds_{arm}"] = int(len(sub))
            for col in ("hit_tokens", "hit_requests", "preemptions", "throughput_span",
                        "ttft_p99"):
                row[f"{col}_{arm}"] = float(sub[col].mean()) if len(sub) else float("nan")
        p = pairs[pairs["budget"] == budget]
        row["paired_requests"] = int(len(p))
        row["hits_agree"] = int(p["agree"].sum())
        rows.append(row)
    return pd.DataFrame(rows)


def section(runs: pd.DataFrame, reqs: pd.DataFrame) -> tuple[str, dict]:
    """Markdown of the validation and its summary."""
    out = ["# Simulated N0 against real vLLM (n0_validate)", ""]
    if runs.empty or set(runs["arm"]) != {"vllm", "sim"}:
        have = sorted(set(runs["arm"])) if not runs.empty else []
        out.append(f"Needs complete runs of both arms (have: {', '.join(have) or 'none'}); "
                   f"`{FILL}` fills them.")
        return "\n".join(out) + "\n", {"paired_requests": 0}
    pairs = paired_requests(reqs)
    cells = cell_table(runs, pairs)
    info = {"paired_requests": int(len(pairs)), "hits_agree": int(pairs["agree"].sum()),
            "by_budget": {r.budget: [int(r.hits_agree), int(r.paired_requests)]
                          for r in cells.itertuples()},
            "differ_by_nth": {int(k): int(v) for k, v in pairs[~pairs["agree"]].groupby(
                "nth_of_context").size().items()}}
    out += [
        "Per budget, means per run over seeds. hit_tokens: prompt tokens served from cache at "
        "admission, summed over a run's requests; hit_requests: requests with a hit; "
        "preemptions: the final cumulative count. Throughput (request span, tokens/s) and "
        "TTFT p99 (s) are for reference only: the simulator's CPU profile is not fitted to "
        "vLLM (vLLM exports no steps). hits_agree: paired requests (same budget, seed and "
        "request id) whose hit tokens are equal on both arms.", "",
        md_table(cells), "",
        f"Requests with equal hit tokens on both arms: {info['hits_agree']} of "
        f"{info['paired_requests']}; the others by their place among their context's "
        f"requests (nth_of_context): {info['differ_by_nth']}.", "",
        "On CPU the vLLM arm runs with the Mamba2 prefix-caching workaround "
        "(vllm_plugin/): no state is taken from inside a prefill chunk, so a prompt that "
        "fits in one chunk leaves its block-boundary state uncached; the next request of "
        "that context then misses, and vLLM splits ITS prefill at the shared-prefix "
        "junction, which caches the state for the requests after it. The simulated N0 "
        "follows vLLM on GPU, where the state inside the chunk is kept, so the second "
        "request of each context (and the first after an eviction of the state) is where "
        "the two arms are expected to differ.", "",
        "## Requests whose hits differ", "",
        md_table(pairs[~pairs["agree"]]) if (~pairs["agree"]).any() else "None.", ""]
    return "\n".join(out), info


def write_page(con, out: Path, campaign: str = CAMPAIGN) -> tuple[Path, dict] | None:
    """Write n0_validate.md (and its CSV) when the campaign has runs."""
    runs, reqs = load(con, campaign)
    if runs.empty:
        return None
    text, info = section(runs, reqs)
    if not reqs.empty and set(runs["arm"]) == {"vllm", "sim"}:
        (out / "tables").mkdir(parents=True, exist_ok=True)
        paired_requests(reqs).to_csv(out / "tables" / "n0_validate_requests.csv", index=False)
    path = out / PAGE
    path.write_text(text, encoding="utf-8")
    return path, info


def main(argv: list[str] | None = None) -> int:
    return cli.section_main("analysis.questions.n0_validate", __doc__,
                            lambda con: section(*load(con)),
                            lambda info: bool(info["paired_requests"]), argv)


if __name__ == "__main__":
    sys.exit(main())
