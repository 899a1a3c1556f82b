"""Q9: is the retention gain conditioned on prefix reuse? K_ret (primary).

d_m(s) = ln(G(Ret, m) / G(S2, m)) for m in {SHARE, ISOLATE};
K_ret = 100 (exp(mean(d_SHARE - d_ISOLATE)) - 1) with its paired-t 95% interval
(stats.retention_interaction), ledger timebase primary, request span as
sensitivity; within-mode effects are secondary.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from analysis.inference import prereg, stats
from analysis.inference.families import PAPER_LABELS
from analysis.pages import figures, readouts
from analysis.pages import paper_figures as pf
from analysis.pages.common import DESIGN_COLUMNS, ORG_SETTINGS, fmt_value
from analysis.pages.render import QuestionResult, Section

QUESTION = "q9"
TITLE = "Is the retention gain conditioned on prefix reuse?"
READS = ("q9",)
POLICY = {"S2": "S2", "S2_RETENTION": "Ret"}
MODE = {"share": "SHARE", "isolate": "ISOLATE"}
TIMEBASES = (("ledger", "throughput_ledger", "primary"), ("span", "throughput_span",
                                                          "sensitivity"))


def family_table(plan: prereg.Plan, runs: pd.DataFrame,
                 allow_changed_plan: bool) -> pd.DataFrame | None:
    """(seed, policy, mode, throughput_*) of the accepted K_ret family's runs, else None."""
    fam = plan.primary_family
    check = prereg.check_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
    if not check.accepted:
        return None
    keys = {c.id: c.keys for c in fam.cells}
    return check.runs.assign(
        policy=check.runs["cell_id"].map(lambda c: POLICY[str(keys[c]["org"]).upper()]),
        mode=check.runs["cell_id"].map(lambda c: MODE[str(keys[c]["reuse"]).lower()]))


def condition_tables(runs: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """S2 / S2_RETENTION runs per condition (everything but org, reuse and K), labelled."""
    runs = runs[runs["org"].isin(POLICY) & runs["reuse"].isin(MODE)]
    if runs.empty:
        return {}
    keys = [c for c in DESIGN_COLUMNS if c not in ("org", "reuse", *ORG_SETTINGS)]
    varying = [c for c in keys if c == "stage" or runs[c].nunique(dropna=False) > 1]
    out = {}
    for values, group in runs.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, values, strict=True))
        label = " ".join(t for c in varying if (t := fmt_value(c, row[c])))
        out[label] = group.assign(policy=group["org"].map(POLICY), mode=group["reuse"].map(MODE))
    return out


def complete_seeds(table: pd.DataFrame) -> tuple[list[int], list[int]]:
    """Seeds with exactly one run in each of the four policy x mode cells, and the others."""
    counts = table.groupby(["seed", "policy", "mode"]).size()
    cells = counts[counts == 1].groupby("seed").size()
    seeds = sorted(int(s) for s in cells.index[cells == 4])
    return seeds, sorted(int(s) for s in set(table["seed"]) - set(seeds))


def kret(table: pd.DataFrame, condition: str, status: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary (timebase x estimand) and per-seed changes from stats.retention_interaction."""
    rows, per_seed = [], []
    for timebase, column, role in TIMEBASES:
        frame = table[["seed", "policy", "mode", column]].rename(columns={column: "throughput"})
        result = stats.retention_interaction(frame, "throughput")
        d = {"K_ret": result.d_share - result.d_isolate, "delta_share": result.d_share,
             "delta_isolate": result.d_isolate}
        for name, interval in (("K_ret", result.k_ret), ("delta_share", result.delta_share),
                               ("delta_isolate", result.delta_isolate)):
            rows.append({"condition": condition, "status": status, "timebase": timebase,
                         "estimand": name, "role": role if name == "K_ret" else "secondary",
                         "n": result.n, "effect_pct": interval.effect_pct,
                         "ci_low_pct": interval.low_pct, "ci_high_pct": interval.high_pct,
                         "n_pos": int((d[name] > 0).sum()), "n_neg": int((d[name] < 0).sum()),
                         "decision": (_label(result.decision) if name == "K_ret"
                                      and role == "primary" and status == "preregistered"
                                      else "")})
            per_seed += [{"condition": condition, "timebase": timebase, "estimand": name,
                          "seed": s, "change_pct": 100 * math.expm1(v)}
                         for s, v in zip(result.seeds, d[name], strict=True)]
    return pd.DataFrame(rows), pd.DataFrame(per_seed)


def _label(decision: str) -> str:
    paper = PAPER_LABELS.get(decision)
    return f"{decision} (paper: {paper})" if paper else decision


def isolate_identical(runs: pd.DataFrame) -> bool:
    """Whether S2 and S2+Retention runs are identical under ISOLATE seed by seed (in the
    simulator a request-unique salt leaves retention nothing to keep)."""
    part = runs[runs["reuse"] == "isolate"]
    wide = part.pivot_table(index="seed", columns="org",
                            values=["throughput_ledger", "throughput_span", "output_tokens"])
    if wide.empty or "S2_RETENTION" not in wide.columns.get_level_values(1):
        return False
    pairs = [(wide[(m, "S2")], wide[(m, "S2_RETENTION")])
             for m in ("throughput_ledger", "throughput_span", "output_tokens")]
    return all(bool((a.dropna() == b.dropna()).all()) and a.notna().any() for a, b in pairs)


ISOLATE_NOTE = ("ISOLATE check not informative in simulation: S2 and S2+Retention runs are "
                "identical under ISOLATE (same throughput and output on every seed), so "
                "Delta_ISOLATE is 0 by construction, not a measured null.")

KRET_TEXT = ("K_ret = 100 (exp(mean(d_SHARE - d_ISOLATE)) - 1) % with d_m(s) = "
             "ln(G(Ret, m)/G(S2, m)) per seed; 95% paired-t intervals (df = n - 1). "
             "Decision: CONFIRMED (interval above 0), DIRECTIONAL (every seed above 0, interval "
             "includes 0), NOT_CONFIRMED. Ledger timebase primary; request span sensitivity. "
             "Status `preregistered`: the accepted K_ret family's runs and seeds; `exploratory`: "
             "every condition of the ledger over its complete seeds (its label is descriptive).")


def kret_section(result: QuestionResult, plan: prereg.Plan, runs: pd.DataFrame,
                 allow_changed_plan: bool) -> None:
    """K_ret of the accepted family (if any) and of every condition with >= 2 complete seeds."""
    summaries, seeds, notes = [], [], []
    family = family_table(plan, runs, allow_changed_plan)
    if family is not None:
        summary, per_seed = kret(family, f"{plan.campaign} (plan)", "preregistered")
        summaries.append(summary)
        seeds.append(per_seed)
    else:
        collected = len(runs) and (runs["campaign"].astype(str) == plan.campaign).any()
        notes.append("The K_ret family of the plan is refused (see below); no preregistered "
                     "K_ret." if collected else "The K_ret family of the plan has no runs yet "
                     f"(`make {plan.campaign}`); no preregistered K_ret.")
    for label, table in condition_tables(runs).items():
        complete, incomplete = complete_seeds(table)
        if incomplete:
            notes.append(f"{label}: seeds without exactly one run per policy x mode cell are "
                         f"left out: {incomplete}.")
        if len(complete) < 2:
            notes.append(f"No data for K_ret in {label}: {len(complete)} complete seed(s), "
                         "needs 2.")
            continue
        table = table[table["seed"].isin(complete)]
        if family is not None and set(table["run_id"]) == set(family["run_id"]):
            continue  # the preregistered row above already is this condition
        summary, per_seed = kret(table, label, "exploratory")
        summaries.append(summary)
        seeds.append(per_seed)
    text = " ".join([KRET_TEXT, *notes])
    if not summaries:
        result.sections.append(Section("K_ret: retention x reuse interaction",
                                       f"No data for K_ret. {text}"))
        return
    summary = result.add("kret", pd.concat(summaries, ignore_index=True))
    result.add("kret_seeds", pd.concat(seeds, ignore_index=True))
    result.sections.append(Section("K_ret: retention x reuse interaction", text,
                                   [("", summary, None)]))


ORDER_NOTE = ("Run order (AMBIGUOUS A9, \"balanced order\"): the four rows of a 4 x 4 "
              "Williams square cycled over the six seeds. Seeds 88001-88004 form the balanced "
              "square (each condition once in each position and once after each other); "
              "88005-88006 repeat its first two rows, so over six seeds each condition holds "
              "each position once or twice (2/1/2/1): no order of four conditions balances "
              "positions over six seeds.")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    plan = readouts.load_plan(QUESTION, plan_dir)
    if not runset.empty:
        result.notes.append(ORDER_NOTE)
        readouts.throughput_section(result, runset.runs)
        kret_section(result, plan, runset.all_runs, allow_changed_plan)
        result.add("q9_runs", readouts.run_frame(runset.runs))
        if isolate_identical(runset.runs):
            result.notes.append(ISOLATE_NOTE)
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def first_condition(summary, per_seed):
    """(per-seed, summary) frames of the K_ret table's first condition (the plan's if any)."""
    if summary is None or summary.empty:
        return None, None
    condition = summary["condition"].iloc[0]
    return (per_seed[per_seed["condition"] == condition],
            summary[summary["condition"] == condition])


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    per_seed, summary = first_condition(f.get("kret"), f.get("kret_seeds"))
    runs = f.get("q9_runs")
    stage, note = "main", ""
    if runs is not None and len(runs) and summary is not None:
        label = summary["condition"].iloc[0]
        stage = "main" if "(plan)" in label else pf.figure_stages(runs)[0]
        runs = runs[runs["stage"] == stage]
        note = pf.stage_note(runs, stage)
        summary = summary[summary["timebase"] == "ledger"]
    return figures.kept([
        ("Fig. 7(c) Q9 throughput confirmation: geometric-mean ledger throughput by reuse mode "
         "(bars), all runs (dots), K_ret with its 95% CI",
         pf.kret_bars(runs, summary, pf.stage_path(out_dir / "q9_fig7c_kret.png", stage),
                      "Q9 throughput confirmation", note, stage)),
        ("K_ret panel (first condition of the K_ret table): per-seed retention effects in SHARE "
         "and ISOLATE and their difference (dots), effects with 95% paired-t intervals (squares)",
         figures.kret_panel(*first_condition(f.get("kret"), f.get("kret_seeds")),
                            out_dir / "q9_kret.png")),
    ])
