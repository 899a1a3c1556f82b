"""Which memory organization serves each hybrid model best (issues 28 and 48).

Six presets (conf/model/: Falcon-H1-7B, Granite-4.0-H-Tiny and -Small, Nemotron-H-8B,
Qwen3-Next-80B-A3B, Jamba v0.1), each on the first declared device that holds it with its
larger budget (serving_core/executor/device_fit.py: A100-40GB for Falcon-H1, Granite Tiny
and Nemotron-H, A100-80GB for Granite Small, one H200 for Jamba, two H200s tensor-parallel
for Qwen3-Next). Every organization (S0, S1, S2, D0, N0, Jenga) at two budgets that mean
the same for every model (16 and 32 requests at the workload's mean: KV of 3,602 tokens and
one checkpoint each) and two loads (60 and 90 % of the model's memory-unbound ceiling,
measured by the campaign's first stage); D0's split chosen per model on separate seeds
(43000-43001); test seeds 42000-42002, 150 requests a run (campaign models, plan
conf/prereg/models.yaml; conf/calibration/models_regime.yaml holds the regime,
experiments/campaigns/models_regime.py writes it). Per model, budget and load the page
names the organization of highest mean request-span throughput, a tie when the
preregistered equivalence test (TOST at +-1 %) holds against the runner-up, or the best as
undecided when neither holds; each throughput as a fraction of the model's ceiling; the
capacity in bytes behind it; and whether S2's slab policy (refill, dense: campaign
models_sens, the higher load) changes the answer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.inference.families import SMOKE_TAG
from analysis.pages import readouts
from analysis.pages.render import QuestionResult, Section
from ledgers.arms import STORAGE_ORGS

QUESTION = "models"
TITLE = "Which memory organization serves each hybrid model best"
ESTIMAND = "throughput_span"
ALPHA = 0.05  # conf/prereg/models.yaml
REGIME_FILE = Path(__file__).resolve().parents[2] / "conf" / "calibration" / "models_regime.yaml"
SENS_CAMPAIGN = "models_sens"
MEAN_BLOCKS = 8  # a mean request's 3,602 tokens in 512-token blocks: ceil(3602 / 512)
BATCH = 16  # bytes per token and per checkpoint of 16 mean requests (large pages, slabs shared)
MAIN = ("throughput_span", "ttft_p99", "e2e_p99", "running_mean", "preemptions",
        "prefix_hit_tokens")
CAVEAT = (
    "The step model is calibrated on Falcon-H1-7B on an A100-40GB (conf/executor/a100.yaml); "
    "every other model's terms come from its layer pattern priced with those fitted constants, "
    "and the other devices (A100-80GB, H200, two H200s tensor-parallel) carry the same fitted "
    "fractions to their datasheet peaks (an assumption, not a fit). MoE steps read the experts "
    "their tokens reach (E (1 - (1 - k/E)^n)), not the whole model. Budgets are state memory "
    "for the whole model, 16 and 32 requests at the workload's mean for every model (bytes "
    "differ by model); loads are 60 and 90 % of each model's own ceiling; the sensitivity "
    "columns cover S2's slab policy only (the identified alternatives carry the A100's fitted "
    "constants, which no other device has).")


def regime(path: Path = REGIME_FILE) -> dict:
    """The campaign's regime per model ({} before its first stage ran)."""
    return (yaml.safe_load(path.read_text()) or {}).get("models", {}) if path.is_file() else {}


def _family_table(families, model: str) -> pd.DataFrame | None:
    for wanted in (model, model + SMOKE_TAG):
        for fam in families:
            if fam.name == wanted and ESTIMAND in fam.tables:
                return fam.tables[ESTIMAND]
    return None


def tost(log_ratios, margin_pct: float, alpha: float) -> tuple[bool, float, float]:
    """Paired t TOST: (equivalent, low, high) with the 1 - 2 alpha interval of the mean log
    ratio in percent; equivalent when it lies within +-log(1 + margin)."""
    from scipy import stats

    d = np.asarray(log_ratios, dtype=float)
    if d.size < 2:
        return False, math.nan, math.nan
    half = stats.t.ppf(1 - alpha, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    low, high = d.mean() - half, d.mean() + half
    bound = math.log1p(margin_pct / 100)
    return bool(-bound < low and high < bound), 100 * math.expm1(low), 100 * math.expm1(high)


def _pair(part: pd.DataFrame, best: str, second: str) -> np.ndarray:
    wide = part.pivot_table(index="seed", columns="org", values=ESTIMAND).dropna(
        subset=[best, second])
    return np.log(wide[best] / wide[second]).to_numpy()


def _test_row(families, model: str, best: str, second: str, cell: str) -> dict:
    table = _family_table(families, model)
    hit = None
    if table is not None:
        ids = {f"{best}_vs_{second}_{cell}", f"{second}_vs_{best}_{cell}"}
        rows = table[table["test"].isin(ids)]
        hit = rows.iloc[0] if len(rows) else None
    return {"p_holm": float(hit["p_holm"]) if hit is not None else math.nan,
            "holm_below_alpha": bool(hit is not None and hit["p_holm"] <= ALPHA)}


def winners(runs: pd.DataFrame, families, reg: dict, equivalence: dict) -> pd.DataFrame:
    """Per model, budget and load: the organization of highest mean throughput, the
    runner-up, the seedwise effect, the TOST against the runner-up (a tie when equivalent:
    no winner named; undecided when its interval holds 0 but not within the margin), the
    winner's throughput as a fraction of the model's ceiling, its p99
    TTFT and the declared test's Holm p."""
    margin, alpha = float(equivalence["margin_pct"]), float(equivalence["alpha"])
    rows = []
    for (stage, model, budget, rate), part in runs.groupby(
            ["stage", "model", "budget", "rate"], sort=False):
        means = part.groupby("org")[ESTIMAND].mean().sort_values(ascending=False, kind="stable")
        if len(means) < 2:
            continue
        best, second = means.index[0], means.index[1]
        d = _pair(part, best, second)
        equivalent, low, high = tost(d, margin, alpha)
        entry = reg.get(model, {})
        ceiling = entry.get("ceiling", {}).get("tokens_s", math.nan)
        cell = f"{_level(entry, budget)}_{_load(entry, rate)}"
        ties = [o for o in means.index[1:]
                if tost(_pair(part, best, o), margin, alpha)[0]]
        rows.append({
            "stage": stage, "model": model, "budget": budget, "level": _level(entry, budget),
            "rate": rate, "load": _load(entry, rate), "best": best,
            "answer": ("tie: " + "=".join([best, *ties]) if equivalent
                       else best if low > 0 else f"{best} (undecided)"),
            "best_tokens_s": float(means.iloc[0]), "runner_up": second,
            "best_of_ceiling_pct": 100 * float(means.iloc[0]) / ceiling,
            "runner_up_of_ceiling_pct": 100 * float(means.iloc[1]) / ceiling,
            "effect_pct": float(100 * np.mean(np.expm1(d))) if d.size else math.nan,
            "tost_low_pct": low, "tost_high_pct": high, "n": int(d.size),
            "best_ttft_p99_s": float(part[part["org"] == best]["ttft_p99"].mean()),
            "max_ttft_p99_s": float(part.groupby("org")["ttft_p99"].mean().max()),
            **_test_row(families, model, best, second, cell),
            "ranking": " > ".join(means.index)})
    return pd.DataFrame(rows)


def _level(entry: dict, budget: str) -> str:
    return next((k for k, v in entry.get("budgets", {}).items() if f"{v}MiB" == budget), "")


def _load(entry: dict, rate: float) -> str:
    return next((k for k, v in entry.get("rates", {}).items()
                 if math.isclose(v, float(rate), rel_tol=1e-9)), "")


def regime_table(reg: dict) -> pd.DataFrame:
    """Per model: device, ceiling, loads, budgets in bytes and units, D0's split."""
    rows = []
    for model, e in reg.items():
        for level, mib in e.get("budgets", {}).items():
            nbytes = mib * 2**20
            split = e.get("d0_split", {})
            rows.append({
                "model": model, "device": e["device_name"], "fit": e["fit"],
                "ceiling_tokens_s": e.get("ceiling", {}).get("tokens_s", math.nan),
                "ceiling_org": e.get("ceiling", {}).get("org", ""),
                "rate_l60": e.get("rates", {}).get("l60", math.nan),
                "rate_l90": e.get("rates", {}).get("l90", math.nan),
                "level": level, "budget_mib": mib,
                "requests_at_mean": nbytes / e["request_bytes"],
                "kv_tokens": nbytes // e["kv_bytes_per_token"] if e["kv_bytes_per_token"] else 0,
                "checkpoints": nbytes // e["checkpoint_bytes"] if e["checkpoint_bytes"] else 0,
                "d0_split": split.get("fraction", math.nan),
                "byte_balanced_split": e["byte_balanced_split"],
                "split_selection": split.get("selection_means", "")})
    return pd.DataFrame(rows)


def capacity_table(reg: dict) -> pd.DataFrame:
    """Per model, budget and organization: bytes per KV token and per checkpoint as the
    organization stores 16 mean requests' (so large pages and slab slots are shared as in
    a run), their padding over the raw bytes, and the mean requests (8 blocks of 512 tokens
    and one checkpoint) that fit (D0 at its chosen split)."""
    from serving_core.geometry import load_geometry
    from serving_core.planner import plan_budget
    from serving_core.storage import capacity, cost

    rows = []
    for model, e in reg.items():
        g = load_geometry(model)
        split = e.get("d0_split", {}).get("fraction")
        for level, mib in e.get("budgets", {}).items():
            plan = plan_budget(g, f"{mib}MiB")  # storage prices one storage scope
            scale = plan.model_nominal_bytes / plan.nominal_bytes
            for org in STORAGE_ORGS:
                per_token = scale * cost(g, org, BATCH * MEAN_BLOCKS, 0) / (
                    BATCH * MEAN_BLOCKS * 512)
                per_ckpt = scale * cost(g, org, 0, BATCH) / BATCH
                rows.append({
                    "model": model, "level": level, "org": org,
                    "bytes_per_token": per_token,
                    "token_padding_pct": 100 * (per_token / g.kv_bytes_per_token - 1),
                    "bytes_per_checkpoint": per_ckpt,
                    "checkpoint_padding_pct": 100 * (
                        per_ckpt / g.recurrent_bytes_per_checkpoint - 1),
                    "requests_fit": capacity(g, org, (MEAN_BLOCKS, 1), plan.nominal_bytes,
                                             split if org == "D0" else None)})
    return pd.DataFrame(rows)


def sensitivity(win: pd.DataFrame, runs: pd.DataFrame, sens: pd.DataFrame,
                equivalence: dict) -> pd.DataFrame:
    """Per cell and S2 slab policy (models_sens): the answer with S2's runs under that
    policy in place of write_once's, and whether it differs from the page's."""
    rows = []
    if sens.empty or win.empty:
        return pd.DataFrame(rows)
    for policy, alt in sens.groupby("slab_policy"):
        swapped = pd.concat([runs[runs["org"] != "S2"], alt.assign(stage=runs["stage"].iloc[0])])
        cells = alt[["model", "budget", "rate"]].drop_duplicates()
        keep = swapped.merge(cells, on=["model", "budget", "rate"])
        again = winners(keep, [], {}, equivalence)
        merged = win.merge(again, on=["model", "budget", "rate"], suffixes=("", "_alt"))
        for _, r in merged.iterrows():
            rows.append({"model": r["model"], "level": r["level"], "load": r["load"],
                         "slab_policy": policy, "answer": r["answer"],
                         "answer_alt": r["answer_alt"], "flips": r["answer"] != r["answer_alt"],
                         "s2_pct_change": _s2_change(runs, alt, r)})
    return pd.DataFrame(rows)


def _s2_change(runs: pd.DataFrame, alt: pd.DataFrame, r) -> float:
    def mean(frame):
        part = frame[(frame["model"] == r["model"]) & (frame["budget"] == r["budget"])
                     & (frame["rate"] == r["rate"]) & (frame["org"] == "S2")]
        return part[ESTIMAND].mean()

    return 100 * (mean(alt) / mean(runs) - 1)


def reasons(win: pd.DataFrame, cap: pd.DataFrame) -> pd.DataFrame:
    """Per model, budget and load, the answer in bytes: the requests each of the winner and
    runner-up fits at the mean, and their checkpoint and token padding."""
    rows = []
    for _, r in win.iterrows():
        c = cap[(cap["model"] == r["model"]) & (cap["level"] == r["level"])].set_index("org")
        if r["best"] not in c.index or r["runner_up"] not in c.index:
            continue
        b, s = c.loc[r["best"]], c.loc[r["runner_up"]]
        rows.append({"model": r["model"], "level": r["level"], "load": r["load"],
                     "answer": r["answer"], "reason": (
                         f"{r['best']} fits {int(b['requests_fit'])} mean requests "
                         f"(checkpoint +{b['checkpoint_padding_pct']:.1f} %, token "
                         f"+{b['token_padding_pct']:.1f} %), {r['runner_up']} "
                         f"{int(s['requests_fit'])} (+{s['checkpoint_padding_pct']:.1f} %, "
                         f"+{s['token_padding_pct']:.1f} %)")})
    return pd.DataFrame(rows)


def _sens_runs(con) -> pd.DataFrame:
    from analysis.pages.common import load_runs

    # question sensitivity, as the sens_<alternative> campaigns; refill and dense runs of one
    # cell and seed are one design cell to the run set, which sets the second aside: both kept
    loaded = load_runs(con, ["sensitivity"])
    runs = pd.concat([loaded.runs, loaded.set_aside], ignore_index=True)
    if runs.empty:
        return runs
    sens = runs[runs["campaign"].astype(str) == SENS_CAMPAIGN].copy()
    sens["slab_policy"] = sens["engine_config"].map(lambda t: json.loads(t)["slab_policy"])
    return sens


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    if runs.empty:
        return result
    reg, equivalence = regime(), plan.raw["equivalence"]
    win = result.add("winners", winners(runs, families, reg, equivalence))
    cap = result.add("capacity", capacity_table(reg))
    sens = result.add("sensitivity", sensitivity(win, runs, _sens_runs(con), equivalence))
    why = result.add("reasons", reasons(win, cap))
    cells = result.add("cells", readouts.means_table(runs, ["model", "budget", "rate", "org"],
                                                     MAIN))
    result.sections[:0] = [
        Section("The best organization per model, budget and load", WINNERS_TEXT + CAVEAT,
                [("", win, None)]),
        Section("The reason in bytes", "Per cell, the mean requests (8 blocks of 512 tokens "
                "and one checkpoint) the winner and the runner-up fit in the budget, with "
                "their padding.", [("", why, None)]),
        Section("Sensitivity: S2's slab policy", "Each cell's answer with S2 run under "
                "engine.slab_policy refill or dense (campaign models_sens, the higher load) "
                "in place of write_once; `flips` marks a changed answer.", [("", sens, None)]),
        Section("Regime: devices, ceilings, loads, budgets", "conf/calibration/"
                "models_regime.yaml.", [("", result.add("regime", regime_table(reg)), None)]),
        Section("Capacity per organization", "Bytes per KV token and per checkpoint as each "
                "organization stores them (serving_core/storage.py), padding over the raw "
                "bytes, and the mean requests that fit.", [("", cap, None)]),
        Section("Cell means", "Arithmetic means over seeds per model, budget, load and "
                "organization.", [("", cells, None)])]
    return result


WINNERS_TEXT = (
    "Per model, budget level (r16, r32: requests at the workload's mean) and load (l60, l90: "
    "percent of the model's measured ceiling): the organization of highest mean request-span "
    "throughput (output tokens/s), or `tie: A=B...` when the preregistered two one-sided "
    "tests (paired t, 90 % interval of the seedwise log ratio within +-1 %) hold against the "
    "runner-up (every organization equivalent to the best is listed), `A (undecided)` when "
    "that interval spans both the margin and no difference; the throughputs as "
    "percent of the model's ceiling; the seedwise effect against the runner-up and its TOST "
    "interval; the declared pair test's Holm p (Falcon-H1-7B's family primary, the others "
    "secondary); p99 TTFT of the winner and the worst organization. ")


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # the winner table carries the answer
