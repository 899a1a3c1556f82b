"""Fit the additive step model's free constants and compare the simulator with its anchors.

Free constants (everything else is geometry and datasheet): memory_efficiency and
matmul_efficiency (the two efficiencies the step's traffic and dense prefill FLOPs run
at), mixed_step_s (the extra device time of a step mixing prefill and decode),
per_step_overhead_s (host time per step not overlapped with the device) and the paged
organizations' cost in one of the step-model forms of STEP_FORMS (`--form`): a fraction
of device time (indirection_overhead, S1/S2), or seconds per scheduled sequence per
member page and per conv slot its state spans (state_page_s, conv_slot_s; the additive
model's paged_state_pieces), or both.

Data sources:
- anchors (default): conf/calibration/paper_anchors.csv and mixed_steps.csv. The device
  constants are fitted by least squares to section C's summed forward seconds (D0 and S2
  at three points) and the two mixed-step savings, using the per-step features of
  simulated runs of the same cells; the host constant to the throughput anchors of
  sections A-C. Features depend on the trajectory, which depends on the constants, so
  simulate-and-fit repeats until the constants settle.
- `--steps PATH`: the steps ledger of any run (Parquet file or directory), fitted by
  serving_core.executor.fit_steps (the one steps-ledger fitter: one equation per row).

Either way the result is a profile YAML (default conf/executor/a100.yaml) holding the
fitted values, their residuals and the data they came from, and (anchors) a table of
every anchor next to the simulator's value with the relative error, the organization
ratios users read (S1/S0, S2/S1, D0/S2 throughput; S2/S1, S1/S0 C_once) measured vs ours
at every anchor point, the acceptance checks (levels and ratios) and the S2 slab occupancy
next to the measured state dumps. `--ablation` repeats the comparison with one engine rule
at a time switched (conf/calibration/rules.md records what each moved).

This driver composes Hydra configs and runs cells, so it lives in experiments (serving_core
imports none of the others); `python -m experiments.studies.calibrate` (make calibrate).
"""

from __future__ import annotations

import csv
import hashlib
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from experiments.studies import study_parser
from serving_core.executor.profiles import EXECUTOR_CONF_DIR, DeviceProfile, load_device_profile
from serving_core.executor.simulated import AdditiveStepModel

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_DIR = ROOT / "conf" / "calibration"
ANCHORS_CSV = CALIBRATION_DIR / "paper_anchors.csv"
MIXED_CSV = CALIBRATION_DIR / "mixed_steps.csv"
# Every constant a fit may free, in the order of the fit's parameter vector.
CONSTANTS = ("memory_efficiency", "matmul_efficiency", "mixed_step_s", "indirection_overhead",
             "per_step_overhead_s", "state_page_s", "conv_slot_s")
# Step-model forms: which of the paged organizations' constants the fit frees (the others
# stay at 0). `indirection` scales S1/S2 device time by one fraction; `pages` charges each
# scheduled sequence per member page and per conv slot of its state (an overhead that grows
# with the batch and with the pieces a state spans: S1 3 SSM pages + a conv page, S2 3 +
# a slot, S0 and D0 none); `both` frees all three.
_COMMON = ("memory_efficiency", "matmul_efficiency", "mixed_step_s", "per_step_overhead_s")
STEP_FORMS = {
    "indirection": (*_COMMON, "indirection_overhead"),
    "pages": (*_COMMON, "state_page_s", "conv_slot_s"),
    "both": (*_COMMON, "indirection_overhead", "state_page_s", "conv_slot_s"),
}
PAGED_CONSTANTS = ("indirection_overhead", "state_page_s", "conv_slot_s")
DEFAULT_FORM = "indirection"
FITTED = STEP_FORMS[DEFAULT_FORM]
# Scale below which a fitted constant's change counts as absolute (convergence test).
CHANGE_FLOOR = {"memory_efficiency": 0.01, "matmul_efficiency": 0.01, "mixed_step_s": 1e-4,
                "indirection_overhead": 0.01, "per_step_overhead_s": 1e-4,
                "state_page_s": 1e-5, "conv_slot_s": 1e-5}
# Measured mean output per request by seed group (docs/calibration.md sections A, B, E).
OUTPUT_ANCHORS = {"0-2": 243.0, "42000-42011": 261.5}


# ----- anchors ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One simulated configuration the anchors describe (org included)."""

    point: str
    budget: str
    rate: float
    cap: int
    q: float
    seeds: str
    org: str

    def overrides(self) -> list[str]:
        return [
            f"org={self.org.lower()}",
            f"budget={self.budget}",
            f"load.rate={self.rate}",
            f"engine.cap={self.cap}",
            f"workload.q={self.q}",
        ]


@dataclass
class Anchor:
    section: str
    cell: Cell
    metric: str
    value: float


def seed_list(label: str, count: int) -> list[int]:
    """The first `count` seeds of a range label such as '0-2' or '42000-42011'."""
    low, high = (int(x) for x in label.split("-"))
    return list(range(low, min(high, low + count - 1) + 1))


def load_anchors(path: Path = ANCHORS_CSV) -> list[Anchor]:
    with Path(path).open() as fh:
        rows = list(csv.DictReader(fh))
    return [
        Anchor(
            r["section"],
            Cell(r["point"], r["budget"], float(r["rate"]), int(r["cap"]), float(r["q"]),
                 r["seeds"], r["org"]),
            r["metric"],
            float(r["value"]),
        )
        for r in rows
    ]


def load_mixed(path: Path = MIXED_CSV) -> list[tuple[int, int, float]]:
    with Path(path).open() as fh:
        return [
            (int(r["chunk_tokens"]), int(r["decodes"]), float(r["split_saving_s"]))
            for r in csv.DictReader(fh)
        ]


# ----- simulation ---------------------------------------------------------------------------
def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose(config_name="config", overrides=["write_ledgers=false", *overrides])


def profile_mapping(profile: DeviceProfile) -> dict:
    from dataclasses import asdict

    return asdict(profile)


def step_feature_sums(model: AdditiveStepModel, steps: dict) -> np.ndarray:
    """Sums over a steps table of (memory_s, dense_s, fixed_s, mixed, scheduled sequences)."""
    return step_feature_rows(model, steps).sum(axis=0)


def step_feature_rows(model: AdditiveStepModel, steps: dict) -> np.ndarray:
    """Per row of a steps table: (memory_s, dense_s, fixed_s, mixed, scheduled sequences)."""
    f = model.ledger_features(steps)
    return np.column_stack([f["memory"], f["dense"], f["attention"] + f["scan"], f["mixed"],
                            np.asarray(steps["num_scheduled"], dtype=np.float64)])


def event_seconds(model: AdditiveStepModel, features: np.ndarray) -> float:
    """Summed device seconds of a run's steps from their summed features."""
    return model.device_seconds(tuple(features[:4]), float(features[4]))


@dataclass
class RunStats:
    cell: Cell
    seed: int
    metrics: dict
    features: np.ndarray = field(repr=False)


def simulate(cell: Cell, seed: int, profile: DeviceProfile, extra: list[str] = ()) -> RunStats:
    """One run of `cell` at `seed` under `profile`; anchor metrics and feature sums."""
    from omegaconf import OmegaConf

    from experiments.runners.cell import run_cell

    cfg = _compose([*cell.overrides(), f"seed={seed}", *extra])
    OmegaConf.set_struct(cfg, False)
    cfg.executor = OmegaConf.create(profile_mapping(profile))
    res = run_cell(cfg)
    s = dict(res.summary)
    s.update(mean_input=res.workload_meta["mean_input_tokens"],
             mean_output=res.workload_meta["mean_output_tokens"],
             span_s=res.episode["span_end_s"] - res.episode["span_start_s"])
    return run_stats(cell, seed, profile, s, res.tables["steps"], res.tables["slab"],
                     _geometry(cfg))


def run_stats(cell: Cell, seed: int, profile: DeviceProfile, s: dict, steps: dict, slab: dict,
              geometry) -> RunStats:
    """Anchor metrics and step-feature sums of one run from its summary `s` (the runner's
    keys plus mean_input, mean_output and span_s), steps and slab tables: the same for a run
    simulated here and one read back from a ledger (experiments.studies.identify)."""
    model = AdditiveStepModel(geometry, profile, cell.org)
    feats = step_feature_sums(model, steps)
    event_s = event_seconds(model, feats)
    prefill = sum(steps["prefill_tokens_initial"]) + sum(steps["prefill_tokens_resume"])
    decode = sum(steps["decode_tokens"])
    pops = sum(
        1 for e, n in zip(slab["event"], slab["invalidated"], strict=True)
        if e == "CROSS_INVALIDATE" and n > 0
    )
    metrics = {
        "throughput": s["throughput_span"],
        "c_once": s["c_once_tokens"],
        "h": s["h_tokens"],
        "k": s["engine_steps"],
        "preemptions": s["preemptions"],
        "running_median": s["running_median"],
        "waiting_median": s["waiting_median"],
        "waiting_max": s["waiting_max"],
        "forwards": len(steps["step"]),
        "event_s": event_s,
        "chunk_prefill": prefill,
        "decode_input": decode,
        "submitted_tokens": prefill + decode,
        "prompt_replay": sum(steps["prefill_tokens_resume"]),
        "ttft_p99": s["ttft_p99"],
        "mean_input": s["mean_input"],
        "mean_output": s["mean_output"],
        "output_tokens": s["output_tokens"],
        "span_s": s["span_s"],
        "slab_pops": pops,
        "state_pages": model.state_pages,  # paged_state_pieces: what the fit charges
        "conv_slots": model.conv_slots,
        **_occupancy(geometry, cell.org, slab),
        "throughput_index": math.nan,  # filled per seed against S0 (see compare)
    }
    return RunStats(cell, seed, metrics, feats)


_GEOMETRY = {}
OCCUPANCY_KEYS = ("occupancy_mean", "pages_mean", "live_mean", "pages_peak",
                  "live_at_peak_pages", "occupancy_at_peak_pages", "live_peak",
                  "pages_at_peak_live", "occupancy_at_peak_live")
SLAB_DUMPS_CSV = CALIBRATION_DIR / "slab_dumps.csv"


def load_slab_dumps(path: Path = SLAB_DUMPS_CSV) -> list[tuple[int, int]]:
    """The S2 state dumps of anchor F (docs/calibration.md section F): (live conv objects,
    slab pages) per dump."""
    with Path(path).open() as fh:
        return [(int(r["live_conv_objects"]), int(r["slab_pages"])) for r in csv.DictReader(fh)]


def _occupancy(geometry, org: str, slab: dict) -> dict:
    """S2 slab occupancy of one run (serving_core.memory.s2.slab_occupancy), prefixed slab_."""
    if org != "S2":
        return {f"slab_{k}": math.nan for k in OCCUPANCY_KEYS}
    from serving_core.memory import org_layout
    from serving_core.memory.s2 import slab_occupancy

    per = org_layout(geometry, "S2").slots_per_slab
    return {f"slab_{k}": float(v) for k, v in slab_occupancy(slab, per).items()}


def _geometry(cfg):
    from serving_core.geometry import geometry_from_config

    key = str(cfg.model.name)
    if key not in _GEOMETRY:
        _GEOMETRY[key] = geometry_from_config(cfg.model)
    return _GEOMETRY[key]


def simulate_cells(cells, seeds_per_cell: int, profile, extra=(), log=None) -> dict:
    """{cell: [RunStats per seed]}."""
    out = {}
    for cell in cells:
        out[cell] = [simulate(cell, sd, profile, extra) for sd in seed_list(cell.seeds,
                                                                              seeds_per_cell)]
        if log:
            log(f"  simulated {cell.point} {cell.org} ({len(out[cell])} seeds)")
    return out


def cell_mean(runs: list[RunStats], metric: str) -> float:
    return float(np.mean([r.metrics[metric] for r in runs]))


# ----- fits ---------------------------------------------------------------------------------
def _fit_rows(runs: dict, anchors: list[Anchor]) -> list[tuple]:
    """(label, target, [(features, paged, pieces, output, span, k)], kind) of every event
    and throughput anchor of sections A-C with simulated runs."""
    rows = []
    for a in anchors:
        if a.cell not in runs or a.section not in "ABC":
            continue
        paged = a.cell.org in ("S1", "S2")
        per_run = [(r.features, paged, (r.metrics["state_pages"], r.metrics["conv_slots"]),
                    r.metrics["output_tokens"], r.metrics["span_s"], r.metrics["k"])
                   for r in runs[a.cell]]
        if a.metric in ("event_s", "throughput"):
            rows.append((f"{a.metric} {a.section} {a.cell.point} {a.cell.org}", a.value,
                         per_run, a.metric))
    return rows


def _device_s(theta, feats, paged, pieces):
    """A run's device seconds under the constants `theta` (CONSTANTS' order)."""
    inv_mem, inv_mm, mix, x, _, page_s, slot_s = theta
    return (feats[0] * inv_mem + feats[1] * inv_mm + feats[2] + feats[3] * mix) * (
        1 + (x if paged else 0.0)) + feats[4] * (pieces[0] * page_s + pieces[1] * slot_s)


def _predictions(theta, ran, rows, mixed) -> np.ndarray:
    """What `theta` predicts for each fit row (`ran`: the constants the runs ran with),
    then each mixed step's split saving."""
    out = []
    for _, _, per_run, kind in rows:
        if kind == "event_s":
            out.append(np.mean([_device_s(theta, f, p, q) for f, p, q, *_ in per_run]))
        else:
            out.append(np.mean([
                o / (span + _device_s(theta, f, p, q) - _device_s(ran, f, p, q)
                     + k * (theta[4] - ran[4]))
                for f, p, q, o, span, k in per_run]))
    out.extend(theta[2] for _ in mixed)  # split saving of a D0 step: mixed_step_s
    return np.array(out)


def fit_constants(runs: dict, anchors: list[Anchor], mixed: list, profile: DeviceProfile,
                  fitted: tuple[str, ...] = FITTED):
    """Joint least squares of the `fitted` constants (a STEP_FORMS entry; the others of
    CONSTANTS keep the profile's value, except the paged ones outside the form, which are 0)
    on relative residuals of
    (a) section C's summed forward seconds (device time of the simulated steps),
    (b) the mixed-step split savings (exactly mixed_step_s for a D0 step), and
    (c) the throughput anchors of sections A-C: each run's request span moved by the
        change of its steps' device time plus K x the change of the host per-step time
        (the trajectory held fixed; the caller re-simulates and repeats).
    Returns (profile, residual rows (label, measured, fitted, relative error))."""
    from scipy.optimize import least_squares

    unknown = sorted(set(fitted) - set(CONSTANTS))
    if unknown:
        raise ValueError(f"fitted constants {unknown}: allowed values are {', '.join(CONSTANTS)}")
    rows = _fit_rows(runs, anchors)
    # `ran`: the constants the simulated trajectories ran with (the span adjustment's
    # baseline); `base`: the same with the paged constants outside the form at 0.
    ran = np.array([1 / profile.memory_efficiency, 1 / profile.matmul_efficiency,
                    profile.mixed_step_s, profile.indirection_overhead,
                    profile.per_step_overhead_s, profile.state_page_s, profile.conv_slot_s])
    free = np.array([c in fitted for c in CONSTANTS])
    paged_constants = np.array([c in PAGED_CONSTANTS for c in CONSTANTS])
    base = np.where(paged_constants & ~free, 0.0, ran)
    # Free constants start at the profile's value (inside the bounds); fixed ones stay there.
    lower = np.array([1, 1, 0, 0, 0, 0, 0], dtype=float)
    upper = np.array([20, 20, 0.1, 0.5, 0.05, 0.01, 0.01])
    start = np.maximum(ran, [1, 1, 1e-4, 0, 0, 0, 0])

    def full(theta_free):
        out = base.copy()
        out[free] = theta_free
        return out

    def predictions(theta_free):
        return _predictions(full(theta_free), ran, rows, mixed)

    targets = np.array([r[1] for r in rows] + [m[2] for m in mixed])

    def residuals(theta_free):
        return predictions(theta_free) / targets - 1

    # Typical scale of each constant (the paged seconds are orders below the efficiencies).
    scale = np.array([1, 1, 1e-3, 0.01, 1e-3, 1e-5, 1e-5])
    sol = least_squares(residuals, np.clip(start[free], lower[free], upper[free]),
                        bounds=(lower[free], upper[free]), x_scale=scale[free])
    inv_mem, inv_mm, mix, x, host, page_s, slot_s = full(sol.x)
    fitted_profile = replace(profile, memory_efficiency=float(1 / inv_mem),
                             matmul_efficiency=float(1 / inv_mm), mixed_step_s=float(mix),
                             indirection_overhead=float(x), per_step_overhead_s=float(host),
                             state_page_s=float(page_s), conv_slot_s=float(slot_s))
    labels = [r[0] for r in rows] + [f"mixed split saving {c} + {d}" for c, d, _ in mixed]
    pred = predictions(sol.x)
    return fitted_profile, [(lab, float(t), float(p), float(p / t - 1))
                            for lab, t, p in zip(labels, targets, pred, strict=True)]


def fit_output_ratio(base: float, log=None) -> tuple[float, dict]:
    """One tokenizer ratio for every cell: least squares of the relative errors of the mean
    output per seed group (seeds 0-2 and 42000-42011) against the measured means."""
    from experiments.workloads.workload import build_workload

    def means(ratio):
        out = {}
        for label in OUTPUT_ANCHORS:
            seeds = seed_list(label, 100)
            out[label] = float(np.mean([
                build_workload({"output_ratio": ratio, "q": 0.0}, {"rate": 3.0}, s)
                .meta["mean_output_tokens"] for s in seeds]))
        return out

    ratio = base
    for _ in range(3):  # mean outputs are nearly proportional to the ratio
        m = means(ratio)
        unit = {g: m[g] / ratio for g in m}
        ratio = sum(unit[g] / OUTPUT_ANCHORS[g] for g in m) / sum(
            (unit[g] / OUTPUT_ANCHORS[g]) ** 2 for g in m)
    ratio = round(ratio, 4)
    return ratio, means(ratio)


def max_change(before: DeviceProfile, after: DeviceProfile, names) -> float:
    """Largest relative change of the `names` constants (absolute below CHANGE_FLOOR)."""
    return max(abs(getattr(after, f) - getattr(before, f))
               / max(abs(getattr(before, f)), CHANGE_FLOOR[f]) for f in names)


STEP_MODEL_TEXT = (
    "device = memory_s/memory_efficiency + dense_s/matmul_efficiency + fixed_s + mixed_step_s "
    "[mixed]; step = device (1 + indirection [S1,S2]) + (state_page_s pages + conv_slot_s "
    "slots + per_seq_overhead_s) B + per_step_overhead_s")


# ----- profile output -----------------------------------------------------------------------
def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def write_profile(profile: DeviceProfile, path: Path, fit: dict, header: str) -> None:
    import yaml

    values = profile_mapping(profile)
    body = yaml.safe_dump(values, sort_keys=False, width=100)
    fit_text = yaml.safe_dump({"fit": fit}, sort_keys=False, width=100)
    Path(path).write_text(header + body + "\n" + fit_text)


PROFILE_HEADER = """\
# Simulated executor profile: NVIDIA A100-PCIE-40GB, one bf16 model replica, ADDITIVE step
# model CALIBRATED to the measured system (conf/calibration/). Written by
# `python -m experiments.studies.calibrate` (make calibrate); do not edit by hand.
# Datasheet peaks, the attention and scan efficiencies, per_seq_overhead_s and the token
# budget are fixed priors (see conf/executor/a100_roofline.yaml for their sources); the
# fields listed under fit.fitted were fitted, with residuals and data sources under fit.
"""


# ----- comparison table ---------------------------------------------------------------------
def compare(anchors: list[Anchor], runs: dict) -> list[tuple]:
    """(section, point, org, metric, anchor, ours, relative error) for every anchor."""
    index = {}
    for a in anchors:
        if a.metric == "throughput_index":
            base = Cell(a.cell.point, a.cell.budget, a.cell.rate, a.cell.cap, a.cell.q,
                        a.cell.seeds, "S0")
            if base in runs and a.cell in runs:
                ratios = [r.metrics["throughput"] / b.metrics["throughput"]
                          for r, b in zip(runs[a.cell], runs[base], strict=True)]
                index[a.cell] = float(np.mean(ratios))
    table = []
    for a in anchors:
        if a.cell not in runs:
            continue
        ours = index.get(a.cell, math.nan) if a.metric == "throughput_index" else cell_mean(
            runs[a.cell], a.metric)
        err = (ours / a.value - 1) if a.value else math.nan
        table.append((a.section, a.cell.point, a.cell.org, a.metric, a.value, ours, err))
    return table


def _err_text(anchor: float, ours: float, err: float) -> str:
    """Relative error, or the difference itself against a zero anchor."""
    if anchor == 0:
        return f"{ours - anchor:+.1f} abs"
    return "" if math.isnan(err) else f"{100 * err:+.1f}%"


def format_occupancy(runs: dict) -> str:
    """Per S2 cell: slab occupancy (live slots / 16 x slab pages), time-averaged and at the
    peaks, next to the measured state dumps (snapshots of unknown cells)."""
    dumps = ", ".join(f"{n} live in {p} pages = {n / p:.1f} of 16 ({n / (16 * p):.0%})"
                      for n, p in load_slab_dumps())
    lines = [f"  slab occupancy, measured state dumps: {dumps}",
             f"  {'point':9} {'mean occ':>8} {'mean live/pages':>16} {'at peak pages':>22} "
             f"{'at peak live':>22}"]
    for cell, rs in sorted(runs.items(), key=lambda kv: str(kv[0])):
        if cell.org != "S2":
            continue

        def m(key, rs=rs):
            return cell_mean(rs, f"slab_{key}")

        lines.append(
            f"  {cell.point:9} {m('occupancy_mean'):8.0%} "
            f"{m('live_mean'):7.1f} / {m('pages_mean'):5.1f}  "
            f"{m('live_at_peak_pages'):6.1f} / {m('pages_peak'):4.1f} "
            f"({m('occupancy_at_peak_pages'):4.0%})  "
            f"{m('live_peak'):6.1f} / {m('pages_at_peak_live'):4.1f} "
            f"({m('occupancy_at_peak_live'):4.0%})")
    return "\n".join(lines)


def format_table(rows: list[tuple]) -> str:
    lines = [f"{'sec':3} {'point':9} {'org':3} {'metric':16} {'anchor':>14} {'ours':>14} "
             f"{'rel err':>8}"]
    for sec, point, org, metric, anchor, ours, err in rows:
        e = _err_text(anchor, ours, err)
        lines.append(f"{sec:3} {point:9} {org:3} {metric:16} {anchor:14,.3f} {ours:14,.3f} "
                     f"{e:>8}")
    return "\n".join(lines)


# Organization ratios users read (numerator, denominator) per metric; each is computed at
# every anchor point where both organizations have the metric (docs/calibration.md
# section 2, Ratios).
RATIOS = {"throughput": (("S1", "S0"), ("S2", "S1"), ("D0", "S2")),
          "c_once": (("S2", "S1"), ("S1", "S0"))}
RATIO_TOLERANCE_PP = 3.0  # throughput ratios: within 3 percentage points of the measured
LEVEL_TOLERANCE = {"throughput": 0.10, "c_once": 0.15}


def ratio_rows(rows: list[tuple]) -> list[tuple]:
    """(section, point, metric, 'S1/S0', measured, ours, gap in pp) for every organization
    ratio both the anchors and the simulation give at one point. Ratios are of cell means,
    as the measured ones are (ratios of 3-run means); a ratio r is shown as r - 1."""
    level = {(r[0], r[1], r[2], r[3]): (r[4], r[5]) for r in rows}
    out = []
    for sec, point in dict.fromkeys((r[0], r[1]) for r in rows):
        for metric, pairs in RATIOS.items():
            for num, den in pairs:
                a = level.get((sec, point, num, metric))
                b = level.get((sec, point, den, metric))
                if a is None or b is None or not b[0] or not b[1]:
                    continue
                measured, ours = a[0] / b[0] - 1, a[1] / b[1] - 1
                out.append((sec, point, metric, f"{num}/{den}", measured, ours,
                            100 * (ours - measured)))
    return out


def format_ratios(ratios: list[tuple]) -> str:
    lines = [f"{'sec':3} {'point':9} {'metric':10} {'ratio':6} {'measured':>9} {'ours':>9} "
             f"{'gap pp':>7}"]
    for sec, point, metric, name, measured, ours, gap in ratios:
        lines.append(f"{sec:3} {point:9} {metric:10} {name:6} {100 * measured:+8.1f}% "
                     f"{100 * ours:+8.1f}% {gap:+7.1f}")
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def acceptance(rows: list[tuple], ratios: list[tuple] | None = None) -> list[str]:
    """The acceptance checks: levels (sections A-D), organization ratios, section A."""
    out = []

    def pick(secs, metric):
        return [r for r in rows if r[0] in secs and r[3] == metric]

    tp = pick("ABCD", "throughput")
    out.append(f"throughput within 10% (A-D): {_verdict(all(abs(r[6]) <= 0.10 for r in tp))}"
               "  " + ", ".join(f"{r[0]}{r[1]} {r[2]} {100 * r[6]:+.1f}%" for r in tp
                                if abs(r[6]) > 0.05))
    pre = pick("A", "preemptions")
    out.append("A zero preemptions: " + _verdict(all(r[5] == 0 for r in pre)))
    c = pick("A", "c_once")
    out.append("A identical input work in S0/S1/S2: "
               + _verdict(len({round(r[5], 6) for r in c}) == 1))
    co = pick("BCD", "c_once")
    out.append(f"C_once within 15% (B-D): {_verdict(all(abs(r[6]) <= 0.15 for r in co))}  "
               + ", ".join(f"{r[1]} {r[2]} {100 * r[6]:+.1f}%" for r in co))
    if ratios is not None:
        tr = [r for r in ratios if r[2] == "throughput"]
        out.append(f"throughput ratios within {RATIO_TOLERANCE_PP:g} pp: "
                   + _verdict(all(abs(r[6]) <= RATIO_TOLERANCE_PP for r in tr)) + "  "
                   + ", ".join(f"{r[1]} {r[3]} {r[6]:+.1f}" for r in tr
                               if abs(r[6]) > RATIO_TOLERANCE_PP))
        cr = [r for r in ratios if r[2] == "c_once" and r[0] != "A"]
        out.append("C_once ratios (reported, no tolerance set): " + ", ".join(
            f"{r[1]} {r[3]} {100 * r[4]:+.0f}%/{100 * r[5]:+.0f}%" for r in cr))
    return out


# ----- command line -------------------------------------------------------------------------
def calibrate_anchors(args, log) -> int:
    anchors = load_anchors(args.anchors)
    mixed = load_mixed(args.mixed)
    profile = load_device_profile(args.start)
    if profile.step_model != "additive" and args.iterations:
        profile = replace(profile, step_model="additive", name="a100-calibrated")
    extra = list(args.override)
    fit_cells = sorted({a.cell for a in anchors if a.section in "ABC" and a.metric in (
        "throughput", "event_s")}, key=str)
    report_cells = sorted({a.cell for a in anchors if a.section in "ABCD"}, key=str)
    log(f"output ratio: configured {args.output_ratio}")
    profile, device_res = _iterate_fit(args, log, anchors, mixed, profile, fit_cells, extra)
    runs = simulate_cells(report_cells, args.seeds, profile, extra)
    rows = compare(anchors, runs)
    ratio, ratio_means = (None, {})
    if not args.skip_output_fit:
        ratio, ratio_means = fit_output_ratio(args.output_ratio)
    fit = _fit_record(args, profile, device_res, rows, extra)
    profile = replace(profile, calibration="fitted to docs/calibration.md sections A-C "
                      "(conf/calibration/paper_anchors.csv) by make calibrate")
    if args.out:
        write_profile(profile, args.out, fit, PROFILE_HEADER)
        log(f"wrote {args.out}")
    print("\n== anchors vs simulation (mean over "
          f"{args.seeds} seeds per cell; section A uses the first seeds of 42000-42011)")
    print(format_table(rows))
    ratios = ratio_rows(rows)
    print("\n== organization ratios (ratio of cell means, as r - 1; gap = ours - measured)")
    print(format_ratios(ratios))
    print("\n== acceptance")
    print("\n".join(acceptance(rows, ratios)))
    _print_fit(args, profile, device_res)
    _print_workload(args, anchors, runs, ratio, ratio_means)
    return 0


def _iterate_fit(args, log, anchors, mixed, profile, fit_cells, extra):
    """Simulate the fit cells and refit the step constants until they move less than
    args.tolerance (at most args.iterations times): (profile, device residuals)."""
    device_res = []
    fitted_names = STEP_FORMS[args.form]
    for it in range(args.iterations):
        runs = simulate_cells(fit_cells, args.seeds, profile, extra)
        before = profile
        profile, device_res = fit_constants(runs, anchors, mixed, profile, fitted_names)
        change = max_change(before, profile, fitted_names)
        log(f"iteration {it + 1}: " + ", ".join(f"{f}={getattr(profile, f):.6g}"
                                                for f in fitted_names)
            + f"  (max change {change:.2%})")
        if change < args.tolerance:
            break
    return profile, device_res


def _fit_record(args, profile, device_res, rows, extra) -> dict:
    """The `fit` section a calibrated profile carries: constants, residuals, data."""
    tp = [r for r in rows if r[3] == "throughput" and r[0] in "ABC"]
    anchors = Path(args.anchors)
    return {
        "form": args.form,
        "fitted": {f: getattr(profile, f) for f in STEP_FORMS[args.form]},
        "step_model": STEP_MODEL_TEXT,
        "residuals": [
            {"data": lab, "measured": float(t), "fitted": float(p), "rel_error": float(e)}
            for lab, t, p, e in device_res],
        "resimulated_throughput": [
            {"data": f"{r[0]} {r[1]} {r[2]}", "measured": r[4], "simulated": float(r[5]),
             "rel_error": float(r[6])} for r in tp],
        "data": {
            "anchors": str(anchors.relative_to(ROOT)) if anchors.is_relative_to(ROOT)
            else str(args.anchors),
            "anchors_sha256": _sha(args.anchors),
            "mixed_steps": str(Path(args.mixed).name),
            "mixed_steps_sha256": _sha(args.mixed),
            "seeds_per_cell": args.seeds,
            "source": "docs/calibration.md sections A-C (fit), A-D (comparison)",
            "overrides": extra,
        },
    }


def _print_fit(args, profile, device_res) -> None:
    print(f"\n== fitted constants (profile {profile.name}, form {args.form})")
    for f in STEP_FORMS[args.form]:
        print(f"  {f:22} {getattr(profile, f):.6g}")
    print("  fit residuals (event seconds, throughput with the last trajectory, mixed steps):")
    for lab, t, p, e in device_res:
        print(f"    {lab:34} measured {t:10.4f}  fitted {p:10.4f}  {100 * e:+6.1f}%")


def _print_workload(args, anchors, runs, ratio, ratio_means) -> None:
    """The workload section: output and input lengths against the anchors, S2's reclaims."""
    print("\n== workload")
    for label, target in OUTPUT_ANCHORS.items():
        ours = ratio_means.get(label, math.nan)
        print(f"  mean output seeds {label:12} measured {target:7.1f}  ours {ours:7.1f} "
              f"({100 * (ours / target - 1):+.1f}%)")
    if ratio is not None:
        note = "" if abs(ratio - args.output_ratio) < 5e-4 else "  <- differs: update config"
        print(f"  output ratio: configured {args.output_ratio}  least-squares {ratio}{note}")
    for a in anchors:
        if a.metric == "mean_input":
            ours = cell_mean(runs[a.cell], "mean_input") if a.cell in runs else math.nan
            print(f"  mean input seeds {a.cell.seeds:12} measured {a.value:7.1f}  ours "
                  f"{ours:7.1f}")
    s2 = [r for c, rs in runs.items() if c.org == "S2" for r in rs]
    if s2:
        popped = sum(1 for r in s2 if r.metrics["slab_pops"] > 0)
        print(f"  S2 runs with a slab reclaim invalidating cached checkpoints: {popped} of "
              f"{len(s2)} (measured: 35 of 63 extension-campaign S2 runs)")
        print(format_occupancy(runs))


# One rule at a time switched back to the earlier engine (the first_chunk preset's value);
# "d0=aligned" instead gives D0 the S-organizations' step_end placement and alignment. The
# candidate rules after it (issue 19) are the alternatives, each justified by a text, for how
# long a shared checkpoint survives; see conf/calibration/rules.md for what each moved.
ABLATIONS = {
    "paper": [],
    "admission=first_chunk": ["engine.admission=first_chunk"],
    "placement=every_boundary": ["engine.checkpoint_placement=every_boundary",
                                 "engine.align_chunks=false"],
    "slab=refill": ["engine.slab_policy=refill"],
    "outputs=raw": ["workload.output_rule=raw"],
    "step=roofline": [],  # the datasheet roofline profile instead of the calibrated one
    "d0=aligned": ["engine.checkpoint_placement=step_end", "engine.align_chunks=true"],
    # candidate rules (default = today's behaviour)
    "pinning=K2": ["engine.pinning_k=2"],  # docs/calibration.md section E: K = 2 was on
    "free=single_queue": ["engine.free_queue=single_queue"],  # vLLM BlockPool free queue
    # docs/engine_rules.md section 9.2: the write-once slab rule applied to member pages
    "recency=publication": ["engine.checkpoint_recency=publication"],
    "slab=dense": ["engine.slab_policy=dense"],  # docs/calibration.md section F
    "single_queue+dense": ["engine.free_queue=single_queue", "engine.slab_policy=dense"],
}
ABLATION_METRICS = ("throughput", "c_once", "preemptions", "k", "waiting_median", "event_s",
                    "prompt_replay", "ttft_p99")


def ablation(args, log) -> int:
    """Relative error of each anchor, each organization ratio's gap and S2 slab occupancy,
    with one rule at a time switched (all of ABLATIONS, or --variants)."""
    names = args.variants or list(ABLATIONS)
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        print(f"--variants: unknown {', '.join(unknown)}; allowed values are "
              f"{', '.join(ABLATIONS)}", file=sys.stderr)
        return 2
    anchors = [a for a in load_anchors(args.anchors) if a.metric in ABLATION_METRICS]
    cells = sorted({a.cell for a in anchors if a.section in "ABCD"}, key=str)
    results, ratios, occupancy = {}, {}, {}
    for name in names:
        profile = load_device_profile("a100_roofline" if name == "step=roofline" else args.start)
        runs = simulate_cells(cells, args.seeds, profile, [*args.override, *ABLATIONS[name]])
        rows = compare(anchors, runs)
        results[name] = {(r[0], r[1], r[2], r[3]): r for r in rows}
        ratios[name] = {(r[0], r[1], r[2], r[3]): r for r in ratio_rows(rows)}
        s2 = [r for c, rs in runs.items() if c.org == "S2" for r in rs]
        occupancy[name] = (
            float(np.nanmean([r.metrics["slab_occupancy_mean"] for r in s2])) if s2 else math.nan,
            sum(1 for r in s2 if r.metrics["slab_pops"] > 0), len(s2))
        log(f"  ablation {name} done")
    width = max(14, *(len(n) for n in names))
    head = f"{'sec':3} {'point':9} {'org':3} {'metric':15} {'anchor':>12} " + " ".join(
        f"{n:>{width}}" for n in names)
    print("== relative error of each anchor")
    print(head)
    first = names[0]
    for key, row in results[first].items():
        cols = []
        for n in names:
            got = results[n].get(key)
            cols.append(f"{_err_text(got[4], got[5], got[6]) if got else '':>{width}}")
        print(f"{key[0]:3} {key[1]:9} {key[2]:3} {key[3]:15} {row[4]:12,.1f} " + " ".join(cols))
    print("\n== organization ratios: gap to the measured ratio, pp (ours - measured)")
    print(f"{'sec':3} {'point':9} {'metric':10} {'ratio':6} {'measured':>9} " + " ".join(
        f"{n:>{width}}" for n in names))
    for key, row in ratios[first].items():
        cols = [f"{ratios[n][key][6]:+{width}.1f}" if key in ratios[n] else " " * width
                for n in names]
        print(f"{key[0]:3} {key[1]:9} {key[2]:10} {key[3]:6} {100 * row[4]:+8.1f}% "
              + " ".join(cols))
    print("\n== S2 slabs: mean occupancy over S2 runs (measured dumps 90% and 86%); runs with a "
          "reclaim invalidating cached checkpoints (measured 35 of 63)")
    for n in names:
        occ, popped, total = occupancy[n]
        print(f"  {n:{width}} occupancy {occ:5.0%}  reclaims in {popped} of {total} runs")
    return 0


def calibrate_steps(args, log) -> int:
    """Fit a profile to every row of a steps ledger with serving_core's one steps fitter
    (serving_core.executor.fit_steps)."""
    import pyarrow.parquet as pq

    from serving_core.executor.fit_steps import fit_steps
    from serving_core.geometry import load_geometry

    table = pq.read_table(args.steps).to_pydict()
    try:
        fit = fit_steps(load_geometry(args.model), args.start, [(args.org, table)],
                        source=f"steps ledger {args.steps}")
    except ValueError as err:
        print(f"--steps={args.steps}: {err}", file=sys.stderr)
        return 2
    fitted = fit.profile
    for f in (*STEP_FORMS["indirection"], "attention_efficiency", "scan_efficiency",
              "per_seq_overhead_s"):
        print(f"{f:22} {getattr(fitted, f):.6g}")
    print(f"rows {fit.rows}  rms relative residual {fit.rms_rel_error:.3g}")
    if args.out:
        report = {
            "fitted": fit.parameters,
            "residuals": {"rows": fit.rows, "rms_rel_error": fit.rms_rel_error,
                          "total_rel_error": fit.total_rel_error},
            "data": {"steps": str(args.steps), "org": args.org, "model": args.model,
                     **fit.data},
        }
        header = PROFILE_HEADER.replace(
            "CALIBRATED to the measured system (conf/calibration/)", "CALIBRATED to a steps ledger")
        write_profile(fitted, args.out, report, header)
        log(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = study_parser("calibrate", __doc__, ledgers=False)
    p.add_argument("--anchors", type=Path, default=ANCHORS_CSV)
    p.add_argument("--mixed", type=Path, default=MIXED_CSV)
    p.add_argument("--steps", type=Path, default=None,
                   help="fit to this steps ledger (Parquet) instead of the anchors")
    p.add_argument("--org", default="S2", help="organization of the --steps run")
    p.add_argument("--model", default="falcon_h1_7b", help="model preset of the --steps run")
    p.add_argument("--start", default="a100", help="profile to start from (name or path)")
    p.add_argument("--out", default=str(EXECUTOR_CONF_DIR / "a100.yaml"),
                   help="profile YAML to write ('' to write nothing)")
    p.add_argument("--form", default=DEFAULT_FORM, choices=list(STEP_FORMS),
                   help="step-model form: which paged-state constants the fit frees")
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell")
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--skip-output-fit", action="store_true")
    p.add_argument("--ablation", action="store_true",
                   help="no fit: anchor errors with one engine rule at a time switched back")
    p.add_argument("--variants", type=lambda v: [x for x in v.split(",") if x], default=None,
                   help="with --ablation: comma-separated subset of the variants")
    p.add_argument("--compare-only", action="store_true",
                   help="no fit: the anchor table for the --start profile")
    p.add_argument("--override", action="append", default=[],
                   help="Hydra override applied to every simulated run (repeatable)")
    args = p.parse_args(argv)
    # '' writes nothing (a Path would make it '.', the working directory)
    args.out = Path(args.out) if args.out else None
    if args.seeds < 1:
        print(f"--seeds={args.seeds}: must be >= 1", file=sys.stderr)
        return 2
    try:
        if isinstance(args.start, str) and args.start.endswith(".yaml"):
            import yaml

            args.start = yaml.safe_load(Path(args.start).read_text())
        load_device_profile(args.start)
    except (ValueError, OSError) as err:
        print(f"--start: {err}", file=sys.stderr)
        return 2
    args.output_ratio = float(_compose(list(args.override)).workload.output_ratio)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.ablation:
        return ablation(args, log)
    if args.compare_only:
        args.iterations = 0
        args.out = None
    if args.steps is not None:
        if not args.steps.exists():
            print(f"--steps={args.steps}: no such file or directory", file=sys.stderr)
            return 2
        return calibrate_steps(args, log)
    return calibrate_anchors(args, log)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Anchor", "Cell", "compare", "fit_constants", "main"]
