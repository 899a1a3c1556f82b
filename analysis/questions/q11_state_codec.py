"""Q11 (exploratory): does compressing the recurrent (SSM) state change the organizations'
ranking?

Campaign q11_state_codec (issue 47): the SSM state stored as fp8_e4m3 (and, in one family,
int8 with per-head scales; serving_core/state_codec.py) against the model's own bf16 state
(`auto`) at the same byte budgets, on Falcon-H1-7B (bf16 and TQ4 KV) and Granite-4.0-H-Tiny.
Plan conf/prereg/q11_state_codec.yaml, exploratory: the primary family (10 seeds, b63,
share) is the codec's effect per organization and the ranking interactions, Holm over 9;
the other families are descriptive. The page reads the model preset's name for its codecs
(`<base>[_tq4][_fp8|_int8]`), as the Q10 page does for TQ4.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q11_state_codec"
TITLE = ("Compressed recurrent state (fp8/int8 SSM state) and the organizations' ranking "
         "(exploratory)")
STATE_SUFFIXES = {"_fp8": "fp8_e4m3", "_int8": "int8"}
MAIN = ("throughput_span", "throughput_ledger", "e2e_p99", "ttft_p99", "running_mean",
        "running_max", "prefix_hit_tokens_cross", "c_once_tokens")
GROUP = ["base", "kv_codec", "reuse", "budget"]
ACCURACY = (
    "Accuracy is not measured by this campaign. What is known comes from the cited engines' "
    "own evaluations: vLLM pull request 52962 (an fp8 SSM cache with stochastic rounding, "
    "about 2.1x more admitted tokens at GSM8K 436/512 against 437/512 with the fp32 state) "
    "and SGLang (GSM8K 0.955 with an fp32 state against 0.945 with bf16); and from our drift "
    "measurements (bench/state_codec_drift.py, docs/state_codec.md) on random-weight tiny "
    "models, which say how far the codec moves those models' next-token distributions and "
    "nothing about task accuracy.")


def codecs_of(model: str) -> tuple[str, str, str]:
    """(base model, KV codec, state codec) of a q11 preset name."""
    name, state = str(model), "auto"
    for suffix, codec in STATE_SUFFIXES.items():
        if name.endswith(suffix):
            name, state = name.removesuffix(suffix), codec
    kv = "tq4" if name.endswith("_tq4") else "bf16"
    return name.removesuffix("_tq4"), kv, state


def with_codecs(runs: pd.DataFrame) -> pd.DataFrame:
    """Runs with their base model, KV codec and state codec columns (`codecs_of`)."""
    parts = pd.DataFrame(runs["model"].map(codecs_of).tolist(), index=runs.index,
                         columns=["base", "kv_codec", "state_codec"])
    return pd.concat([runs, parts], axis=1)


def ranking(cells: pd.DataFrame) -> pd.DataFrame:
    """Per group and state codec: organizations by mean request-span throughput, best first;
    `changed` says whether the order differs from the same group's auto order."""
    rows = []
    for key, part in cells.groupby([*GROUP, "state_codec"], sort=False):
        ordered = part.sort_values("throughput_span", ascending=False)
        rows.append({**dict(zip([*GROUP, "state_codec"], key, strict=True)),
                     "ranking": " > ".join(ordered["org"]),
                     "best_tokens_s": float(ordered["throughput_span"].iloc[0])})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    auto = {tuple(r[g] for g in GROUP): r["ranking"] for _, r in out.iterrows()
            if r["state_codec"] == "auto"}

    def changed(r) -> str:
        base = auto.get(tuple(r[g] for g in GROUP))
        if base is None or r["state_codec"] == "auto":
            return "-"
        orgs = set(r["ranking"].split(" > "))
        kept = " > ".join(o for o in base.split(" > ") if o in orgs)
        return "no" if kept == r["ranking"] else "YES"

    return out.assign(changed=out.apply(changed, axis=1))


def gains(cells: pd.DataFrame) -> pd.DataFrame:
    """Per group and organization: each codec's mean throughput and running sequences
    against auto's (ratios)."""
    auto = cells[cells["state_codec"] == "auto"].set_index([*GROUP, "org"])
    rows = []
    for _, r in cells[cells["state_codec"] != "auto"].iterrows():
        key = tuple(r[g] for g in [*GROUP, "org"])
        if key not in auto.index:
            continue
        a = auto.loc[key]
        rows.append({**dict(zip([*GROUP, "org"], key, strict=True)),
                     "state_codec": r["state_codec"],
                     "throughput_ratio": r["throughput_span"] / a["throughput_span"],
                     "running_mean_ratio": r["running_mean"] / a["running_mean"],
                     "running_max_auto": a["running_max"], "running_max": r["running_max"]})
    return pd.DataFrame(rows)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        runs = with_codecs(runs)
        result.add("runs", readouts.run_frame(runs).assign(model=runs["model"],
                                                           state_codec=runs["state_codec"]))
        cells = readouts.means_table(runs, [*GROUP, "org", "state_codec"], MAIN)
        frames = {"cells": cells, "gains": gains(cells), "ranking": ranking(cells)}
        for name, frame in frames.items():
            result.add(name, frame)
        cells, gain, order = frames["cells"], frames["gains"], frames["ranking"]
        result.sections.append(Section(
            "Cells, gains and ranking by state codec",
            "EXPLORATORY (conf/prereg/q11_state_codec.yaml). λ 3, cap 63, q 1, f 0, pin K 2, "
            "100 requests per run; auto = the model's bf16 SSM state, fp8_e4m3 = 1 B per "
            "element (Falcon-H1-7B: 786,432 instead of 1,572,864 B per layer; conv kept bf16), "
            "at the same byte budgets. The checkpoints a budget holds per codec and "
            "organization (planner arithmetic) are in docs/state_codec.md. The codec's work "
            "is priced at nominal A100 constants (conf/executor/a100*.yaml). `changed`: the "
            "order of the organizations differs from auto's in the same group.",
            [("cell means", cells, None), ("codec against auto", gain, None),
             ("organizations by mean request-span throughput", order, None)]))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    result.sections.append(Section("What this page says about accuracy", ACCURACY, []))
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    """No figure: the tables carry the comparison."""
    return []
