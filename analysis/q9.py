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

from analysis import figures, prereg, readouts, stats
from analysis.families import relaxed_match
from analysis.render import QuestionResult, Section

QUESTION = "q9"
TITLE = "Is the retention gain conditioned on prefix reuse?"
READS = ("q9",)
POLICY = {"S2": "S2", "S2_RETENTION": "Ret"}
MODE = {"share": "SHARE", "isolate": "ISOLATE"}
TIMEBASES = (("ledger", "throughput_ledger", "primary"), ("span", "throughput_span",
                                                          "sensitivity"))


def cell_table(plan: prereg.Plan, runs: pd.DataFrame, allow_changed_plan: bool
               ) -> tuple[pd.DataFrame, bool, list[str]]:
    """(seed, policy, mode, throughput_*) of the K_ret family's cells; accepted; notes."""
    fam = plan.primary_family
    check = prereg.check_family(plan, fam, runs, allow_changed_plan=allow_changed_plan)
    matched, notes = (check.runs, []) if check.accepted else relaxed_match(plan, fam, runs)
    keys = {c.id: c.keys for c in fam.cells}
    table = matched.assign(
        policy=matched["cell_id"].map(lambda c: POLICY[str(keys[c]["org"]).upper()]),
        mode=matched["cell_id"].map(lambda c: MODE[str(keys[c]["reuse"]).lower()]))
    return table, check.accepted, notes


def complete_seeds(table: pd.DataFrame) -> tuple[list[int], list[int]]:
    """Seeds with all four policy x mode cells, and the incomplete ones."""
    counts = table.groupby("seed")["cell_id"].nunique()
    return sorted(int(s) for s in counts.index[counts == 4]), sorted(
        int(s) for s in counts.index[counts < 4])


def kret(table: pd.DataFrame, accepted: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Summary (timebase x estimand) and per-seed changes from stats.retention_interaction."""
    rows, per_seed = [], []
    for timebase, column, role in TIMEBASES:
        frame = table[["seed", "policy", "mode", column]].rename(columns={column: "throughput"})
        result = stats.retention_interaction(frame, "throughput")
        d = {"K_ret": result.d_share - result.d_isolate, "delta_share": result.d_share,
             "delta_isolate": result.d_isolate}
        for name, interval in (("K_ret", result.k_ret), ("delta_share", result.delta_share),
                               ("delta_isolate", result.delta_isolate)):
            decision = result.decision if name == "K_ret" else "secondary"
            rows.append({"timebase": timebase, "estimand": name,
                         "role": role if name == "K_ret" else "secondary",
                         "n": result.n, "effect_pct": interval.effect_pct,
                         "ci_low_pct": interval.low_pct, "ci_high_pct": interval.high_pct,
                         "n_pos": int((d[name] > 0).sum()), "n_neg": int((d[name] < 0).sum()),
                         "decision": decision if accepted else "refused (exploratory)"})
            per_seed += [{"timebase": timebase, "estimand": name, "seed": s,
                          "change_pct": 100 * math.expm1(v)}
                         for s, v in zip(result.seeds, d[name], strict=True)]
    return pd.DataFrame(rows), pd.DataFrame(per_seed)


KRET_TEXT = ("K_ret = 100 (exp(mean(d_SHARE - d_ISOLATE)) - 1) % with d_m(s) = "
             "ln(G(Ret, m)/G(S2, m)) per seed; 95% paired-t intervals (df = n - 1). "
             "Decision: CONFIRMED (interval above 0), DIRECTIONAL (every seed above 0, interval "
             "includes 0), NOT_CONFIRMED. Ledger timebase primary; request span sensitivity.")


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset = readouts.begin(con, QUESTION, TITLE, READS)
    plan = readouts.load_plan(QUESTION, plan_dir)
    if not runset.empty:
        readouts.throughput_section(result, runset.runs)
        table, accepted, notes = cell_table(plan, runset.all_runs, allow_changed_plan)
        seeds, incomplete = complete_seeds(table)
        text = KRET_TEXT
        if incomplete:
            text += f" Seeds without all four cells (left out): {incomplete}."
        if not accepted:
            text += " The K_ret family is refused (see below): this is exploratory."
        text += "".join(f" {n}." for n in notes)
        if len(seeds) >= 2:
            summary, per_seed = kret(table[table["seed"].isin(seeds)], accepted)
            result.add("kret", summary)
            result.add("kret_seeds", per_seed)
            result.sections.append(Section("K_ret: retention x reuse interaction", text,
                                           [("", summary, None)]))
        else:
            result.sections.append(Section(
                "K_ret: retention x reuse interaction",
                f"No data for K_ret: {len(seeds)} seed(s) with all four policy x mode cells "
                f"(needs 2). {text}"))
    readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir, allow_changed_plan)
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    f = result.frames
    return figures.kept([
        ("K_ret panel: per-seed retention effects in SHARE and ISOLATE and their difference "
         "(dots), effects with 95% paired-t intervals (squares)",
         figures.kret_panel(f.get("kret_seeds"), f.get("kret"), out_dir / "q9_kret.png")),
        ("Throughput by cell: geometric mean (bars) and seeds (dots)",
         figures.throughput_bars(f.get("runs"), out_dir / "q9_throughput.png",
                                 "Q9 throughput by cell")),
    ])
