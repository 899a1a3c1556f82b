"""Q10 (exploratory): does the organizations' ranking survive compressed attention state?

Q1 Exp 1a and Q4 repeated with attention KV stored as TQ4 (model falcon_h1_7b_tq4, campaign
q10_tq4) next to their bf16 runs (Q1's and Q4's own), at the same byte budgets. Plan
conf/prereg/q10_tq4.yaml, exploratory and declared as such: EXT-22 rows 1-11 under each codec
(Holm over 11 per codec), the codec interaction of rows 1-9 (TQ4 contrast minus bf16
contrast, Holm over 9), and the codec's own effect per organization and budget
(descriptive). The page puts every contrast under bf16 and TQ4 side by side, paired by seed,
with the statistics of Q1/Q4 (analysis.inference.families: seedwise log ratios, exact sign flips,
Holm); the bf16 decisions that count remain EXT-22's (page q1, Holm over 22).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from analysis.inference.families import SMOKE_TAG
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section

QUESTION = "q10_tq4"
TITLE = "Compressed attention state (TQ4) and the organizations' ranking (exploratory)"
CODECS = {"falcon_h1_7b": "bf16", "falcon_h1_7b_tq4": "tq4"}
MAIN = ("throughput_span", "throughput_ledger", "e2e_p99", "ttft_p99", "c_once_tokens",
        "running_mean", "preemptions")
CONTRASTS = ("tq4_contrasts", "bf16_contrasts")
INTERACTIONS = "codec_interactions"
ESTIMAND = "throughput_span"
SIDE_COLUMNS = ("effect", "min_seed", "max_seed", "n_pos", "n_neg", "p_exact", "p_holm")


def codec_of(model: str) -> str:
    return CODECS.get(str(model), str(model))


def _table(families, name: str) -> pd.DataFrame | None:
    """The primary estimand's table of the family: its main-stage evaluation, else its smoke
    counterpart (`<name> (smoke)`, first three seeds)."""
    for wanted in (name, name + SMOKE_TAG):
        for fam in families:
            if fam.name == wanted and ESTIMAND in fam.tables:
                return fam.tables[ESTIMAND]
    return None


def side_by_side(families) -> pd.DataFrame:
    """Per EXT-22 row 1-11: the bf16 and the TQ4 contrast (mean seedwise %, min-max, signs,
    exact and Holm p) and, for rows 1-9, the codec interaction (pp) with its p-values."""
    bf16, tq4 = _table(families, "bf16_contrasts"), _table(families, "tq4_contrasts")
    inter = _table(families, INTERACTIONS)
    if bf16 is None or tq4 is None:
        return pd.DataFrame()
    rows = []
    by_inter = {} if inter is None else {t.removesuffix("_tq4_minus_bf16"): r
                                         for t, r in zip(inter["test"], inter.itertuples(),
                                                         strict=True)}
    tq4_rows = tq4.set_index("test")
    for r in bf16.itertuples():
        if r.test not in tq4_rows.index:
            continue
        t = tq4_rows.loc[r.test]
        row = {"test": r.test, "row": r.label, "unit": r.unit, "n": int(min(r.n, t["n"]))}
        for codec, src in (("bf16", r._asdict()), ("tq4", t.to_dict())):
            row.update({f"{codec}_{c}": src[c] for c in SIDE_COLUMNS})
        i = by_inter.get(r.test)
        row.update({"codec_pp": i.effect if i else math.nan,
                    "codec_min": i.min_seed if i else math.nan,
                    "codec_max": i.max_seed if i else math.nan,
                    "codec_p_exact": i.p_exact if i else math.nan,
                    "codec_p_holm": i.p_holm if i else math.nan,
                    "sign_kept": _sign_kept(r.effect, t["effect"])})
        rows.append(row)
    return pd.DataFrame(rows)


def _sign_kept(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b):
        return "n/a"
    return "yes" if (a > 0) == (b > 0) else "NO"


def ranking(cells: pd.DataFrame) -> pd.DataFrame:
    """Per stage, budget and codec: organizations by mean request-span throughput, best first."""
    rows = []
    for (stage, budget, codec), part in cells.groupby(["stage", "budget", "kv_codec"],
                                                      sort=False):
        ordered = part.sort_values("throughput_span", ascending=False)
        rows.append({"stage": stage, "budget": budget, "kv_codec": codec,
                     "ranking": " > ".join(ordered["org"]),
                     "best_tokens_s": float(ordered["throughput_span"].iloc[0])})
    return pd.DataFrame(rows)


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    if not runs.empty:
        runs = runs.assign(kv_codec=runs["model"].map(codec_of)).sort_values(
            "kv_codec", kind="stable")
        result.add("runs", readouts.run_frame(runs).assign(model=runs["model"],
                                                           kv_codec=runs["kv_codec"]))
        cells = result.add("cells", readouts.means_table(runs, ["budget", "org", "kv_codec"],
                                                         MAIN))
        order = result.add("ranking", ranking(cells))
        result.sections.append(Section(
            "Cells and ranking by codec",
            "EXPLORATORY (conf/prereg/q10_tq4.yaml). λ 3, cap 63, q 1, f 0, pin K 2, seeds "
            "42000-42011; bf16 = falcon_h1_7b (Q1 Exp 1a and Q4 runs), tq4 = falcon_h1_7b_tq4 "
            "(264 instead of 1,024 B of KV per token per layer) at the same byte budgets. "
            "Arithmetic means over runs; the step model's codec constants are nominal, not "
            "fitted (conf/executor/a100_roofline.yaml). At λ 3 a TQ4 S1/S2 arm can reach the "
            "offered load (about 689 output tokens/s over the request span), where memory no "
            "longer binds and its contrasts are ceiling-bound. D0 keeps its bf16 byte split "
            "(0.527383) under TQ4, so its attention pool holds about 3.9 times the tokens while "
            "its recurrent pool keeps the same composites.",
            [("cell means", cells, None), ("organizations by mean request-span throughput",
                                           order, None)]))
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    side = result.add("side_by_side", side_by_side(families))
    if len(side):
        result.sections.insert(1 if len(result.sections) else 0, Section(
            "Every stepwise and D0/S2 contrast under bf16 and TQ4",
            "EXPLORATORY. EXT-22 rows 1-11 (request-span throughput, the Q1/Q4 primary), "
            "paired by seed: mean seedwise percent change (interactions: pp), observed "
            "min-max, sign counts (+/-), exact two-sided sign-flip p of the seedwise log ratio "
            "and Holm p within each codec's 11 tests; `codec_pp` is the TQ4 contrast minus the "
            "bf16 contrast (mean over seeds of the difference of seedwise percent changes) "
            "with its sign-flip p (log-ratio difference) and Holm p over rows 1-9; "
            "`sign_kept` says whether the contrast's direction is the same under both codecs. "
            "The bf16 decisions that count are EXT-22's on the Q1 page (Holm over 22).",
            [("", side, None)]))
    return result


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    """No figure: the report names figure files `<page>_*` and this page's name has an
    underscore of its own; the tables carry the comparison."""
    return []
