"""The models page's sensitivity columns: each cell's answer under every alternative rule.

Campaign models_sens (question sensitivity, experiments/campaigns/models_sens.py) reruns the
test cells at the highest declared load on the first test seeds under S2's other slab
policies and the identified alternatives; the regime file's `sensitivity` spec says which
organizations each alternative ran and which it shares (the test runs, `default`, or an
earlier alternative's identical runs). Each alternative's runs are told apart by their
executor name (identified constants) or their engine rules. The answer under an alternative
is set beside the test runs' answer on the same seeds and cells; `flips` marks a change.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pandas as pd

CAMPAIGN = "models_sens"
DEFAULT = "default"


def sens_runs(con) -> pd.DataFrame:
    """Every run of campaign models_sens (the run set's set-aside ones too: runs of one
    design cell under different rules are all kept)."""
    from analysis.pages.common import load_runs

    loaded = load_runs(con, ["sensitivity"])
    runs = pd.concat([loaded.runs, loaded.set_aside], ignore_index=True)
    if runs.empty or "campaign" not in runs:
        return pd.DataFrame()
    return runs[runs["campaign"].astype(str) == CAMPAIGN].reset_index(drop=True)


def _rules_hold(engine_config: str, rules: list[str]) -> bool:
    config = json.loads(engine_config)
    return all(str(config.get(r.split("=", 1)[0].removeprefix("engine."))) ==
               r.split("=", 1)[1] for r in rules)


def classify(sens: pd.DataFrame, spec: dict) -> pd.Series:
    """The alternative each sensitivity run belongs to ("" when none claims it)."""
    def which(run) -> str:
        executor = str(run["executor"])
        for name, s in spec.items():
            suffix = s.get("executor_suffix")
            if suffix and executor.endswith(suffix) and run["org"] in s["runs"]:
                return name
        for name, s in spec.items():
            if (not s.get("executor_suffix") and run["org"] in s["runs"]
                    and not any(executor.endswith(str(o.get("executor_suffix")))
                                for o in spec.values() if o.get("executor_suffix"))
                    and _rules_hold(run["engine_config"], s["runs"][run["org"]])):
                return name
        return ""

    return sens.apply(which, axis=1) if not sens.empty else pd.Series(dtype=str)


def alternative_runs(runs: pd.DataFrame, sens: pd.DataFrame, spec: dict,
                     name: str) -> pd.DataFrame:
    """The runs one alternative's answer rests on: its own, and the ones it shares, at the
    cells and seeds it ran."""
    cells = sens[sens["alternative"] == name][["model", "budget", "rate", "seed"]]
    parts = [sens[sens["alternative"] == name]]
    for org, source in spec[name]["borrows"].items():
        frame = runs if source == DEFAULT else sens[sens["alternative"] == source]
        parts.append(frame[frame["org"] == org])
    merged = pd.concat(parts, ignore_index=True).drop_duplicates(
        subset=["model", "budget", "rate", "seed", "org"])
    return merged.merge(cells.drop_duplicates(), on=["model", "budget", "rate", "seed"])


def sensitivity(runs: pd.DataFrame, sens: pd.DataFrame, spec: dict,
                answer: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """Per cell and alternative: the test runs' answer on the alternative's seeds, the
    answer under the alternative, whether it flips, and the organizations it overloads."""
    if sens.empty or runs.empty or not spec:
        return pd.DataFrame()
    sens = sens.assign(alternative=classify(sens, spec), stage=runs["stage"].iloc[0])
    keys = ["model", "budget", "rate"]
    rows = []
    for name in spec:
        alt = alternative_runs(runs, sens, spec, name)
        if alt.empty:
            continue
        seeds = alt[keys + ["seed"]].drop_duplicates()
        base = answer(runs.merge(seeds, on=keys + ["seed"]))
        merged = base.merge(answer(alt), on=keys, suffixes=("", "_alt"))
        for _, r in merged.iterrows():
            cell = alt[(alt["model"] == r["model"]) & (alt["budget"] == r["budget"])
                       & (alt["rate"] == r["rate"])]
            rows.append({"model": r["model"], "level": r["level"], "load": r["load"],
                         "alternative": name, "n": int(cell["seed"].nunique()),
                         "answer": r["answer"], "answer_alt": r["answer_alt"],
                         "flips": r["answer"] != r["answer_alt"],
                         "overloaded_alt": r["overloaded_alt"]})
    return pd.DataFrame(rows)
