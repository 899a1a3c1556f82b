"""Which memory organization serves each hybrid model best (issues 28 and 48).

Six presets (conf/model/: Falcon-H1-7B, Granite-4.0-H-Tiny and -Small, Nemotron-H-8B,
Qwen3-Next-80B-A3B, Jamba v0.1), each on the first declared device that holds it with its
larger budget (serving_core/executor/device_fit.py: A100-40GB for Falcon-H1, Granite Tiny
and Nemotron-H, A100-80GB for Granite Small, one H200 for Jamba, two H200s tensor-parallel
for Qwen3-Next). Every organization (S0, S1, S2, D0, N0, Jenga) at two budgets that mean
the same for every model (16 and 32 requests at the workload's mean: KV of 3,602 tokens and
one checkpoint each) and one load per budget, 80 % of the memory-bound capacity of the
budget's best organization (its leader), measured by the campaign's first stage on its own
seed (41000) with the model's memory-unbound ceiling and unloaded p99 TTFT; D0's split
chosen per model on separate seeds (43000-43001); test seeds 42000-42008 (nine: a unanimous
effect passes Holm over a family's 10 tests), 100 requests a run (campaign models, plan
conf/prereg/models.yaml; conf/calibration/models_regime.yaml holds the regime,
experiments/campaigns/models_regime.py writes it). A cell whose mean p99 TTFT exceeds the
model's bound (10 x its unloaded p99 TTFT) is overloaded: flagged, not ranked. Per model,
budget and load the page names the organization of highest mean request-span throughput
among those within the bound, a tie when the preregistered equivalence test (TOST at
+-1 %) holds against the runner-up, or the best as undecided when neither holds; each
throughput as a fraction of the model's ceiling; the capacity in bytes behind it; and
whether the answer changes under S2's other slab policies or the identified alternatives
(campaign models_sens, the highest declared load, seeds 42000-42002).
"""

from __future__ import annotations

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
    "differ by model); the load is 80 % of the memory-bound capacity of each budget's "
    "best organization, so an organization of less capacity can be overloaded (flagged, not "
    "ranked); below capacity every organization that keeps up serves the offered load, so "
    "throughput ties are the expected answer there. The identified alternatives carry the "
    "A100's fitted constants to every device, as the default does; their sensitivity runs "
    "use three seeds (signs, not decisions).")


def regime(path: Path = REGIME_FILE) -> dict:
    """The campaign's regime per model ({} before its first stage ran)."""
    return _regime_doc(path).get("models", {})


def _regime_doc(path: Path = REGIME_FILE) -> dict:
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


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
    """The declared test the answer rests on: the winner against its budget's leader (the
    runner-up when the winner leads); its Holm p."""
    table = _family_table(families, model)
    hit = None
    if table is not None:
        ids = {f"{best}_vs_{second}_{cell}", f"{second}_vs_{best}_{cell}"}
        rows = table[table["test"].isin(ids)]
        hit = rows.iloc[0] if len(rows) else None
    return {"p_holm": float(hit["p_holm"]) if hit is not None else math.nan,
            "holm_below_alpha": bool(hit is not None and hit["p_holm"] <= ALPHA)}


def overloaded(part: pd.DataFrame, bound_s: float) -> list[str]:
    """The organizations of one cell whose mean p99 TTFT over the seeds exceeds the bound
    (none when the bound is unknown)."""
    if not math.isfinite(bound_s):
        return []
    means = part.groupby("org", sort=False)["ttft_p99"].mean()
    return [org for org, v in means.items() if v > bound_s]


def _answer(part: pd.DataFrame, means: pd.Series, margin: float, alpha: float) -> dict:
    """The call among the organizations within the bound (means sorted, best first)."""
    best, second = means.index[0], means.index[1]
    d = _pair(part, best, second)
    equivalent, low, high = tost(d, margin, alpha)
    ties = [o for o in means.index[1:] if tost(_pair(part, best, o), margin, alpha)[0]]
    return {"best": best, "runner_up": second, "d": d, "tost_low_pct": low,
            "tost_high_pct": high,
            "answer": ("tie: " + "=".join([best, *ties]) if equivalent
                       else best if low > 0 else f"{best} (undecided)")}


def winners(runs: pd.DataFrame, families, reg: dict, equivalence: dict) -> pd.DataFrame:
    """Per model, budget and load: the organizations over the overload bound (flagged, not
    ranked); among the others, the one of highest mean throughput, the runner-up, the
    seedwise effect, the TOST against the runner-up (a tie when equivalent: no winner named;
    undecided when its interval holds 0 but not within the margin), the winner's throughput
    as a fraction of the model's ceiling, p99 TTFTs against the bound and the Holm p of the
    declared test against the budget's leader."""
    margin, alpha = float(equivalence["margin_pct"]), float(equivalence["alpha"])
    rows = []
    for (stage, model, budget, rate), part in runs.groupby(
            ["stage", "model", "budget", "rate"], sort=False):
        entry = reg.get(model, {})
        bound = float(entry.get("ttft_bound_s", math.nan))
        over = overloaded(part, bound)
        kept = part[~part["org"].isin(over)]
        means = kept.groupby("org")[ESTIMAND].mean().sort_values(ascending=False, kind="stable")
        if part["org"].nunique() < 2:
            continue
        level, load = _level(entry, budget), _load(entry, rate)
        call = (_answer(kept, means, margin, alpha) if len(means) >= 2 else
                {"best": means.index[0] if len(means) else "", "runner_up": "",
                 "d": np.array([]), "tost_low_pct": math.nan, "tost_high_pct": math.nan,
                 "answer": f"{means.index[0]} (alone within the bound)" if len(means)
                 else "overloaded (every organization)"})
        ceiling = entry.get("ceiling", {}).get("tokens_s", math.nan)
        leader = entry.get("capacity", {}).get(level, {}).get("org", "")
        best, d = call["best"], call["d"]
        other = call["runner_up"] if best == leader else leader
        test = _test_row(families, model, best, other, f"{level}_{load}")
        if call["answer"] == best and test["p_holm"] > ALPHA:  # the declared test disagrees
            call["answer"] = f"{best} (undecided)"
        rows.append({
            "stage": stage, "model": model, "budget": budget, "level": level, "rate": rate,
            "load": load, "answer": call["answer"], "best": best,
            "overloaded": ",".join(over), "best_tokens_s": _mean_of(means, best),
            "runner_up": call["runner_up"],
            "best_of_ceiling_pct": 100 * _mean_of(means, best) / ceiling,
            "runner_up_of_ceiling_pct": 100 * _mean_of(means, call["runner_up"]) / ceiling,
            "effect_pct": float(100 * np.mean(np.expm1(d))) if d.size else math.nan,
            "tost_low_pct": call["tost_low_pct"], "tost_high_pct": call["tost_high_pct"],
            "n": int(d.size), "ttft_bound_s": bound,
            "best_ttft_p99_s": float(part[part["org"] == best]["ttft_p99"].mean()),
            "max_ttft_p99_s": float(part.groupby("org")["ttft_p99"].mean().max()),
            "leader": leader, **test,
            "ranking": " > ".join(means.index)})
    return pd.DataFrame(rows)


def _mean_of(means: pd.Series, org: str) -> float:
    return float(means[org]) if org in means.index else math.nan


def _level(entry: dict, budget: str) -> str:
    return next((k for k, v in entry.get("budgets", {}).items() if f"{v}MiB" == budget), "")


def _load(entry: dict, rate: float) -> str:
    return next((load for rates in entry.get("rates", {}).values()
                 for load, v in rates.items()
                 if math.isclose(v, float(rate), rel_tol=1e-9)), "")


def regime_table(reg: dict) -> pd.DataFrame:
    """Per model and budget: device, ceiling, the budget's capacity and leader, loads,
    overload bound, budget in bytes and units, D0's split."""
    rows = []
    for model, e in reg.items():
        for level, mib in e.get("budgets", {}).items():
            nbytes = mib * 2**20
            split = e.get("d0_split", {})
            cap = e.get("capacity", {}).get(level, {})
            rows.append({
                "model": model, "device": e["device_name"], "fit": e["fit"],
                "ceiling_tokens_s": e.get("ceiling", {}).get("tokens_s", math.nan),
                "level": level, "budget_mib": mib,
                "capacity_tokens_s": cap.get("tokens_s", math.nan),
                "capacity_of_ceiling_pct": 100 * cap.get("tokens_s", math.nan)
                / e.get("ceiling", {}).get("tokens_s", math.nan),
                "leader": cap.get("org", ""), "capacity_per_org": cap.get("per_org", ""),
                **{f"rate_{k}": v for k, v in e.get("rates", {}).get(level, {}).items()},
                "idle_ttft_p99_s": min(e.get("idle_ttft_p99_s", {math.nan: math.nan}).values()),
                "ttft_bound_s": e.get("ttft_bound_s", math.nan),
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


def analyze(con, *, plan_dir=None, allow_changed_plan: bool = False) -> QuestionResult:
    from analysis.questions import models_sens

    result, runset, plan = readouts.begin_plan(con, QUESTION, TITLE, plan_dir)
    runs = runset.runs
    families = readouts.attach_families(result, runset.all_runs, QUESTION, plan_dir,
                                        allow_changed_plan)
    if runs.empty:
        return result
    doc = _regime_doc()
    reg, equivalence = doc.get("models", {}), plan.raw["equivalence"]
    win = result.add("winners", winners(runs, families, reg, equivalence))
    cap = result.add("capacity", capacity_table(reg))
    sens = result.add("sensitivity", models_sens.sensitivity(
        runs, models_sens.sens_runs(con), doc.get("sensitivity", {}),
        lambda frame: winners(frame, [], reg, equivalence)))
    why = result.add("reasons", reasons(win, cap))
    cells = result.add("cells", readouts.means_table(runs, ["model", "budget", "rate", "org"],
                                                     MAIN))
    result.sections[:0] = [
        Section("The best organization per model, budget and load", WINNERS_TEXT + CAVEAT,
                [("", win, None)]),
        Section("The reason in bytes", "Per cell, the mean requests (8 blocks of 512 tokens "
                "and one checkpoint) the winner and the runner-up fit in the budget, with "
                "their padding.", [("", why, None)]),
        Section("Sensitivity: slab policies and identified alternatives", SENS_TEXT,
                [("", sens, None)]),
        Section("Regime: devices, ceilings, capacities, loads, bounds, budgets",
                "conf/calibration/models_regime.yaml.",
                [("", result.add("regime", regime_table(reg)), None)]),
        Section("Capacity per organization", "Bytes per KV token and per checkpoint as each "
                "organization stores them (serving_core/storage.py), padding over the raw "
                "bytes, and the mean requests that fit.", [("", cap, None)]),
        Section("Cell means", "Arithmetic means over seeds per model, budget, load and "
                "organization.", [("", cells, None)])]
    return result


SENS_TEXT = (
    "Each cell's answer at the highest declared load under S2's other slab policies (slab_refill, "
    "slab_dense) and every identified alternative of the identify study (its fitted "
    "constants on every organization, its rules where it has them; conf/sensitivity/"
    "alternatives.yaml), on seeds 42000-42002 (campaign models_sens), beside the test runs' "
    "answer on the same seeds; `flips` marks a changed answer. Falcon-H1-7B's family also "
    "gets the `holds_under` column of `make sensitivity` (analysis/flips.py).")
WINNERS_TEXT = (
    "Per model, budget level (r16, r32: requests at the workload's mean) and load (l80: "
    "percent of the memory-bound capacity of the budget's leader): `overloaded` lists the "
    "organizations whose mean p99 TTFT exceeds the model's bound (10 x its unloaded p99 "
    "TTFT; flagged, not ranked); among the rest, the organization of highest mean "
    "request-span throughput (output tokens/s), or `tie: A=B...` when the preregistered two "
    "one-sided tests (paired t, 90 % interval of the seedwise log ratio within +-1 %) hold "
    "against the runner-up (every organization equivalent to the best is listed), "
    "`A (undecided)` when that interval spans both the margin and no difference or the "
    "declared test below does not pass Holm (a winner is named only when both agree); the "
    "throughputs as percent of the model's ceiling; the seedwise effect against the "
    "runner-up and its TOST interval; the Holm p of the declared test of the winner against "
    "the budget's leader (against the runner-up when the winner leads; Falcon-H1-7B's "
    "family primary, the others secondary); p99 TTFT of the winner and the worst "
    "organization. ")


def draw(result: QuestionResult, out_dir: Path) -> list[tuple[str, Path]]:
    return []  # the winner table carries the answer
