"""Which vLLM setting serves best, per model and budget (campaign vllm_knobs).

vLLM 0.32's own Scheduler and hybrid KV cache manager on a virtual clock priced by the
calibrated A100 step model (executor=vllm_virtual). Each run's setting is read back from
vLLM's objects (the runs row's engine_config): the prefix-cache retention interval in
blocks of vLLM's derived block (ret0 = vLLM's default 0, ret1, ret2), the batched-token
budget (mbt1024, mbt4096; the others run 2,048) and prefix caching off (nocache: mamba
cache mode none, the only other mode 0.32 has). The preregistered plan
(conf/prereg/vllm_knobs.yaml) is evaluated by the project's family machinery: exact
sign-flip per test on the seedwise log ratio against the default (ret0), Holm over the
family. The winner table is descriptive, as the plan says.

`python -m analysis.questions.vllm_knobs --ledgers ROOT` prints the page (last line: JSON);
`analysis.report` writes it as vllm_knobs.md when the campaign has runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.flips import add_flip_columns
from analysis.inference import families, prereg
from analysis.pages import common
from analysis.pages.render import md_table

CAMPAIGN = PLAN = "vllm_knobs"
PAGE = "vllm_knobs.md"
TITLE = "Which vLLM setting serves best (vLLM's own scheduler, virtual clock)"
DEFAULT = "ret0"
DEFAULT_TOKENS = 2048
TIE_PCT = 0.5  # the plan's tie band on span throughput, broken by TTFT p50
SHOWN = ("throughput_span", "ttft_p50", "ttft_p99", "e2e_p50", "prefill_tokens_computed",
         "preemptions")


def setting_of(engine_config: str) -> str:
    """The campaign block a run belongs to, from the settings vLLM reports."""
    cfg = json.loads(engine_config or "{}")
    if not cfg.get("prefix_caching", True):
        return "nocache"
    tokens = int(cfg.get("max_num_batched_tokens", DEFAULT_TOKENS))
    if tokens != DEFAULT_TOKENS:
        return f"mbt{tokens}"
    interval, block = int(cfg.get("retention_interval") or 0), int(cfg.get("block_size", 1))
    if interval % block:
        return f"ret{interval}tokens"
    return f"ret{interval // block}"


def load(con) -> pd.DataFrame:
    """The campaign's adopted complete runs with their readouts and `setting`."""
    runs = common.load_runs(con, [CAMPAIGN]).all_runs
    if runs.empty:
        return runs
    return runs.assign(setting=runs["engine_config"].map(setting_of))


def winners(runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per model, budget and setting: seeds and metric means with the change against the
    default and the seeds it beats it in; per model and budget: the winner)."""
    rows = []
    for (model, budget), part in runs.groupby(["model", "budget"], sort=True):
        base = part[part["setting"] == DEFAULT].set_index("seed")["throughput_span"]
        for setting, group in part.groupby("setting", sort=True):
            mine = group.set_index("seed")["throughput_span"]
            seeds = sorted(set(mine.index) & set(base.index))
            change = (100 * (mine[seeds] / base[seeds] - 1)).mean() if seeds else float("nan")
            rows.append({"model": model, "budget": budget, "setting": setting,
                         "seeds": len(group), **{m: group[m].mean() for m in SHOWN},
                         "vs_default_pct": change,
                         "seeds_above_default": int((mine[seeds] > base[seeds]).sum()),
                         "paired_seeds": len(seeds)})
    table = pd.DataFrame(rows)
    best = []
    for (model, budget), part in table.groupby(["model", "budget"], sort=True):
        top = part["throughput_span"].max()
        near = part[part["throughput_span"] >= top * (1 - TIE_PCT / 100)]
        win = near.sort_values("ttft_p50").iloc[0]
        best.append({"model": model, "budget": budget, "winner": win["setting"],
                     "throughput_span": win["throughput_span"], "ttft_p50": win["ttft_p50"],
                     "vs_default_pct": win["vs_default_pct"],
                     "seeds_above_default": f"{win['seeds_above_default']}/"
                                            f"{win['paired_seeds']}",
                     "within_tie_band": ", ".join(sorted(set(near["setting"]) - {win["setting"]}))
                     or "-"})
    return table, pd.DataFrame(best)


def winner_tests(best: pd.DataFrame, plan, results) -> pd.DataFrame:
    """The winner table with each winner's paired test against the default (span
    throughput; seeds, mean seedwise change, 95 % interval, Holm-adjusted p, decision)."""
    (family,) = plan.families
    cell = {c.id: (c.keys["model"], c.keys["budget"], c.keys["setting"]) for c in family.cells}
    test_of = {cell[t.cells["treatment"]]: t.id for t in family.tests}
    table = results[0].tables.get("throughput_span", pd.DataFrame())
    rows = table.set_index("test") if len(table) else pd.DataFrame()
    out = []
    for row in best.itertuples(index=False):
        test = test_of.get((row.model, row.budget, row.winner))
        found = test is not None and test in rows.index
        got = rows.loc[test] if found else {}
        out.append({**row._asdict(), "test_n": got.get("n", "-") if found else "-",
                    **{k: got.get(k, float("nan")) if found else float("nan")
                       for k in ("effect", "ci_low", "ci_high", "p_holm")},
                    "decision": got.get("decision", "-") if found else
                    ("the default" if row.winner == DEFAULT else "-")})
    return pd.DataFrame(out)


def section(con) -> tuple[str, dict]:
    """The page's text and its JSON summary."""
    runs = load(con)
    lines = [f"# {TITLE}", "", __doc__.split("\n\n")[1].replace("\n", " "), ""]
    if runs.empty:
        return "\n".join([*lines, "No runs yet: `make campaign C=vllm_knobs`."]), {"runs": 0}
    table, best = winners(runs)
    plan = prereg.load_plan(PLAN)
    results = families.evaluate_plan(plan, runs)
    add_flip_columns(results, con)  # where each winner flips (analysis.flips)
    best = winner_tests(best, plan, results)
    lines += ["## Winner per model and budget", "",
              f"Highest mean span throughput; settings within {TIE_PCT} % of it are a tie, "
              "broken by the lower TTFT p50. With it, the winner's preregistered paired test "
              "against the default (ret0) on span throughput: seeds, effect (mean seedwise "
              "change), 95 % paired-t interval, Holm-adjusted exact sign-flip p over the "
              "family's 20 tests, decision.", "",
              md_table(best, list(best.columns)), "", "## Every setting", "",
              md_table(table, list(table.columns)), "",
              "## Preregistered family", "", *(r.markdown() for r in results)]
    info = {"runs": len(runs),
            "winners": {f"{r.model}:{r.budget}": r.winner for r in best.itertuples()},
            "families": {r.name: r.status for r in results}}
    return "\n".join(lines), info


def write_page(con, out: Path) -> tuple[Path, dict] | None:
    """Write vllm_knobs.md when the campaign has runs."""
    return None if load(con).empty else cli.write_section(con, out, PAGE, section)


def main(argv: list[str] | None = None) -> int:
    return cli.section_main("analysis.questions.vllm_knobs", __doc__, section,
                            lambda info: bool(info["runs"]), argv)


if __name__ == "__main__":
    sys.exit(main())
