"""Identify the engine's rules and the step model's constants jointly (make identify).

For every combination of a declared candidate space (conf/calibration/identify.yaml:
engine rules, step-model forms), refit the free step-model constants on the anchors'
sections A-C as `make calibrate` does (experiments.studies.calibrate.fit_constants,
simulate-and-fit until the constants settle), then score the combination on every
disclosed anchor: levels, organization ratios, C_once, H, K, forwards and forward seconds,
preemptions, running and waiting medians, low-load C_once and TTFT p99, S2 slab occupancy
and the share of S2 runs with a slab reclaim. The anchors are split into a fitting part
(sections A-C, what the constants are fitted to) and a checking part (D and F); both are
reported, and the combination of least fitting loss is adopted only if it lowers the
checking loss of the refitted defaults without moving a throughput level outside 10 %.

Every simulated run goes through the campaign driver (conf/campaign/identify.yaml, run in
this process, each run forked from it, complete runs skipped) under its own campaign name,
identify_<combination>_<phase> (fit1, fit2, ..., score); each iteration's constants are a
deterministic function of the previous iteration's ledgers, so a killed search resumes
where it stopped. Each combination's result is written to the `identify` study table
(ledgers.studies) as soon as it is scored; combinations already scored by the same search
are read back, not rerun. At the end the driver writes the selection (adopted default and
identified set) to the table and, for a full search, conf/calibration/identify.csv (the
search table) and conf/calibration/identified.yaml (the identified set, which
experiments.studies.sensitivity adds to its alternatives). analysis.studies.identify
renders the page.

    python -m experiments.studies.identify [--ledger-root ROOT] [--smoke]
        [--design NAME[,NAME]] [--combinations NAME[,NAME]] [--jobs N] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from experiments.studies import calibrate as cal
from experiments.studies import study_parser

ROOT = Path(__file__).resolve().parents[2]
SPACE_YAML = ROOT / "conf" / "calibration" / "identify.yaml"
CAMPAIGN_YAML = ROOT / "conf" / "campaign" / "identify.yaml"
OUT_CSV = ROOT / "conf" / "calibration" / "identify.csv"
OUT_IDENTIFIED = ROOT / "conf" / "calibration" / "identified.yaml"
TABLE = "identify"
# The acceptance targets of issue 33: nine throughput ratios within 3 pp, ten C_once levels
# within 15 %: (section, point, metric, ratio or org).
TARGET_RATIOS = (("A", "control", "S1/S0"), ("A", "control", "S2/S1"), ("B", "L", "S1/S0"),
                 ("B", "L", "S2/S1"), ("C", "L", "D0/S2"), ("B", "H", "S1/S0"),
                 ("B", "H", "S2/S1"), ("C", "H", "D0/S2"), ("C", "M", "D0/S2"))
TARGET_CONCE = (("B", "L", "S0"), ("B", "L", "S1"), ("B", "L", "S2"), ("B", "H", "S0"),
                ("B", "H", "S1"), ("B", "H", "S2"), ("D", "low_b63", "S1"),
                ("D", "low_b63", "S2"), ("D", "low_b108", "S1"), ("D", "low_b108", "S2"))


# ----- the candidate space ------------------------------------------------------------------
@dataclass(frozen=True)
class Level:
    factor: str
    name: str
    code: str
    overrides: dict  # org ("all", "s0", ...) -> tuple of overrides
    why: str


@dataclass(frozen=True)
class Combination:
    """One level per factor; `name` is the codes of its non-default levels ("base": none)."""

    levels: tuple[Level, ...]

    @property
    def name(self) -> str:
        return ".".join(lv.code for lv in self.levels if lv.code) or "base"

    @property
    def rules_name(self) -> str:
        """The name without the step-model form (what the first fit's runs depend on)."""
        return ".".join(lv.code for lv in self.levels if lv.code and lv.factor != "form") or "base"

    @property
    def form(self) -> str:
        return next(lv.name for lv in self.levels if lv.factor == "form")

    @property
    def label(self) -> str:
        """factor=level of every non-default level."""
        return ", ".join(f"{lv.factor}={lv.name}" for lv in self.levels if lv.code) or "defaults"

    def overrides(self, org: str) -> list[str]:
        """Hydra overrides of this combination's rules for runs of `org`."""
        out = []
        for lv in self.levels:
            out += [*lv.overrides.get("all", ()), *lv.overrides.get(org, ())]
        return out

    def rules(self) -> dict[str, list[str]]:
        return {org: self.overrides(org) for org in anchor_orgs()}


@dataclass(frozen=True)
class Space:
    factors: dict  # factor -> {level name: Level}, defaults first
    designs: dict
    full: tuple[str, ...]
    fit: dict
    score: dict
    selection: dict
    digest: str

    def default(self) -> dict[str, Level]:
        return {f: next(iter(levels.values())) for f, levels in self.factors.items()}

    def combination(self, chosen: dict[str, str]) -> Combination:
        levels = self.default()
        for factor, name in chosen.items():
            if factor not in self.factors:
                raise ValueError(f"factor {factor!r}: allowed values are "
                                 f"{', '.join(self.factors)}")
            if name not in self.factors[factor]:
                raise ValueError(f"{factor}={name!r}: allowed values are "
                                 f"{', '.join(self.factors[factor])}")
            levels[factor] = self.factors[factor][name]
        return Combination(tuple(levels.values()))

    def design(self, name: str) -> list[Combination]:
        """The combinations of one design, in a fixed order."""
        if name not in self.designs:
            raise ValueError(f"--design={name!r}: allowed values are {', '.join(self.designs)}")
        spec = self.designs[name] or {}
        if "combinations" in spec:
            return [self.combination(c or {}) for c in spec["combinations"]]
        if name == "one_at_a_time":
            out = [self.combination({})]
            for factor, levels in self.factors.items():
                out += [self.combination({factor: lv}) for lv in list(levels)[1:]]
            return out
        factors = list(spec)
        return [self.combination(dict(zip(factors, choice, strict=True)))
                for choice in itertools.product(*(spec[f] for f in factors))]

    def combinations(self, designs) -> list[Combination]:
        seen, out = set(), []
        for d in designs:
            for c in self.design(d):
                if c.name not in seen:
                    seen.add(c.name)
                    out.append(c)
        return out


def load_space(path: Path = SPACE_YAML) -> Space:
    raw = yaml.safe_load(Path(path).read_text())
    factors = {}
    orgs = anchor_orgs()  # read once (a YAML parse), not once per level
    for factor, levels in raw["factors"].items():
        factors[factor] = {}
        for name, spec in levels.items():
            over = {k: tuple(v) for k, v in (spec.get("overrides") or {}).items()}
            bad = sorted(set(over) - {"all", *orgs})
            if bad:
                raise ValueError(f"{path}: {factor}.{name}: overrides for {bad}; allowed keys "
                                 f"are all, {', '.join(orgs)}")
            factors[factor][name] = Level(factor, name, str(spec.get("code") or ""), over,
                                          " ".join(str(spec.get("why", "")).split()))
        codes = [lv.code for lv in factors[factor].values()]
        if codes[0] or len(set(codes)) != len(codes):
            raise ValueError(f"{path}: factor {factor}: the default level has code '' and "
                             "every other level a code of its own")
    # The digest covers what a combination's scores depend on: the levels without their
    # `why` texts, the designs, the fit and the score (a reworded justification or comment,
    # or a changed selection rule, which is applied anew at every run, is not a new search).
    semantic = {**{k: v for k, v in raw.items() if k != "selection"},
                "factors": {f: {n: {k: v for k, v in spec.items() if k != "why"}
                                for n, spec in levels.items()}
                            for f, levels in raw["factors"].items()}}
    return Space(factors, raw["designs"], tuple(raw["full"]), raw["fit"], raw["score"],
                 raw["selection"], hashlib.sha256(json.dumps(
                     semantic, sort_keys=True).encode()).hexdigest()[:12])


def campaign_blocks(path: Path = CAMPAIGN_YAML) -> dict[str, dict]:
    """Block name -> its keys in conf/campaign/identify.yaml."""
    raw = yaml.safe_load(Path(path).read_text())
    return raw["hydra"]["sweeper"]["blocks"]


def anchor_orgs() -> tuple[str, ...]:
    """The organizations the anchors' cells run (the campaign's blocks), in block order."""
    return tuple(dict.fromkeys(str(b["org"]) for b in campaign_blocks().values()))


def block_of(cell: cal.Cell) -> str:
    return f"{cell.point}_{cell.org.lower()}"


# ----- running one phase through the campaign driver -----------------------------------------
@dataclass
class Settings:
    ledger_root: Path
    smoke: bool
    jobs: int | None
    seeds: int
    requests: int | None
    max_iterations: int
    tolerance: float
    quiet: bool = False
    sweep_dir: Path | None = None  # where the campaigns' Hydra job logs go (not in the key)

    def key(self, space: Space) -> str:
        """The search's identity: everything its results depend on but the combination."""
        text = json.dumps({"space": space.digest, "smoke": self.smoke, "seeds": self.seeds,
                           "requests": self.requests, "iterations": self.max_iterations,
                           "tolerance": self.tolerance,
                           "anchors": cal._sha(cal.ANCHORS_CSV),
                           "mixed": cal._sha(cal.MIXED_CSV),
                           "campaign": cal._sha(CAMPAIGN_YAML)}, sort_keys=True)
        return ("smoke-" if self.smoke else "full-") + hashlib.sha256(
            text.encode()).hexdigest()[:10]


def profile_overrides(profile) -> list[str]:
    """executor.* overrides that put `profile`'s fitted constants into a run."""
    out = [f"executor.{name}={repr(float(getattr(profile, name)))}" for name in cal.CONSTANTS]
    return [*out, f"executor.name={profile.name}", "executor.step_model=additive"]


def profile_name(profile) -> str:
    digest = hashlib.sha256(json.dumps([float(getattr(profile, n)) for n in cal.CONSTANTS])
                            .encode()).hexdigest()[:8]
    return f"a100-identify-{digest}"


def campaign_name(combo: Combination, phase: str, settings: Settings) -> str:
    """The ledger campaign of one phase (the campaign driver adds _smoke at smoke size). The
    first fit runs every combination from the same start profile, so combinations that differ
    only in the step-model form share it."""
    name = combo.rules_name if phase == "fit1" else combo.name
    return f"identify_{name}_{phase}"


def campaign_in_process(args: list[str]) -> tuple[int, str, str]:
    """`python -m experiments.run ARGS` (cwd: the repository) in this process, not a new
    interpreter per phase: (exit code, stdout, stderr). The launcher forks its runs from here."""
    from hydra.core.global_hydra import GlobalHydra

    from experiments import run as entry

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, cwd = sys.argv, os.getcwd()
    # imported, not run as __main__: Hydra needs the config directory spelled out
    sys.argv = [entry.__file__, "--config-path", str(ROOT / "conf"), *args]
    try:
        os.chdir(ROOT)
        entry.install_hooks()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            entry.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
        os.chdir(cwd)
        GlobalHydra.instance().clear()
    return code, out.getvalue(), err.getvalue()


def run_phase(combo: Combination, phase: str, cells, profile, settings: Settings, log) -> str:
    """Run (or skip as complete) `cells` under `combo` and `profile`; returns the campaign.
    Organizations whose rule overrides agree share one campaign-driver call."""
    name = campaign_name(combo, phase, settings)
    groups: dict[tuple, list[str]] = {}
    for cell in cells:
        groups.setdefault(tuple(combo.overrides(cell.org.lower())), []).append(block_of(cell))
    for overrides, blocks in groups.items():
        cmd = ["-m", "campaign=identify", f"ledger_root={settings.ledger_root}",
               f"campaign_name={name}", f"hydra.sweeper.only=[{','.join(blocks)}]", *overrides,
               *profile_overrides(profile)]
        if settings.jobs:
            cmd.append(f"hydra.launcher.n_jobs={settings.jobs}")
        if settings.sweep_dir is not None:
            cmd.append(f"hydra.sweep.dir={settings.sweep_dir / name}")
        if settings.smoke:
            cmd += ["hydra.sweeper.smoke=true", f"hydra.sweeper.smoke_seeds={settings.seeds}"]
            if settings.requests:
                cmd.append(f"hydra.sweeper.smoke_requests={settings.requests}")
        code, stdout, stderr = campaign_in_process(cmd)
        if code != 0:
            tail = (stdout + stderr).strip().splitlines()[-5:]
            raise RuntimeError(f"campaign {name} ({len(blocks)} blocks) exited "
                               f"{code}: " + " | ".join(tail))
        summary = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if summary and not settings.quiet:
            s = json.loads(summary[-1])
            log(f"    {name}: {s['planned']} runs, {s['done']} ran, {s['skipped']} skipped, "
                f"{s['wall_seconds']:.0f} s")
    return name + ("_smoke" if settings.smoke else "")


def read_runs(root: Path, campaign: str, cells, profile) -> dict:
    """{cell: [RunStats by seed]} of one phase, read back from its ledgers."""
    import ledgers
    from serving_core.geometry import load_geometry

    geometry = load_geometry("falcon_h1_7b")
    by_key = {(c.org, c.budget, float(c.rate), int(c.cap), float(c.q)): c for c in cells}
    con = ledgers.connect(root, campaigns=[campaign])
    try:
        runs = con.execute(
            "SELECT run_id, org, budget, rate, cap, q, seed, throughput_span, c_once_tokens, "
            "h_tokens, engine_steps, running_median, waiting_median, waiting_max, "
            "output_tokens, span_start_s, span_end_s FROM runs WHERE campaign = ? AND "
            "status = 'complete' AND adopted ORDER BY seed", [campaign]).df()
        req = con.execute(
            "SELECT run_id, sum(preemptions) AS preemptions, avg(prompt_tokens) AS mean_input,"
            " avg(target_output_tokens) AS mean_output, list(ttft_s) FILTER "
            "(WHERE status = 'finished') AS ttft FROM requests WHERE campaign = ? "
            "GROUP BY run_id", [campaign]).df().set_index("run_id")
        steps = con.execute(
            f"SELECT run_id, step, {', '.join(STEP_COLUMNS)} FROM steps WHERE campaign = ? "
            "ORDER BY run_id, step", [campaign]).df()
        slab = con.execute(
            "SELECT run_id, t_s, event, invalidated FROM slab WHERE campaign = ? "
            "ORDER BY run_id, seq", [campaign]).df()
    finally:
        con.close()
    steps_by, slab_by = _lists_by_run(steps), _lists_by_run(slab)
    empty_slab = {"t_s": [], "event": [], "invalidated": []}
    out: dict = {}
    for row in runs.itertuples(index=False):
        cell = by_key.get((row.org, row.budget, float(row.rate), int(row.cap), float(row.q)))
        if cell is None:
            continue
        r = req.loc[row.run_id]
        ttft = [t for t in (r.ttft if r.ttft is not None else []) if not math.isnan(t)]
        s = {"throughput_span": row.throughput_span, "c_once_tokens": row.c_once_tokens,
             "h_tokens": row.h_tokens, "engine_steps": row.engine_steps,
             "preemptions": int(r.preemptions), "running_median": row.running_median,
             "waiting_median": row.waiting_median, "waiting_max": row.waiting_max,
             "ttft_p99": float(np.percentile(ttft, 99)) if ttft else math.nan,
             "output_tokens": row.output_tokens, "mean_input": float(r.mean_input),
             "mean_output": float(r.mean_output), "span_s": row.span_end_s - row.span_start_s}
        out.setdefault(cell, []).append(cal.run_stats(
            cell, int(row.seed), profile, s, steps_by.get(row.run_id, {c: [] for c in
                                                                        STEP_COLUMNS}),
            slab_by.get(row.run_id, empty_slab), geometry))
    missing = [block_of(c) for c in cells if c not in out]
    if missing:
        raise RuntimeError(f"campaign {campaign}: no complete runs of {', '.join(missing)}")
    return out


def _lists_by_run(frame) -> dict:
    """{run_id: {column: list of Python values}} (DataFrame.to_dict("list") per run, a
    column at a time: to_dict boxes value by value, a second per phase here)."""
    return {k: {c: g[c].tolist() for c in g.columns} for k, g in frame.groupby("run_id")}


STEP_COLUMNS = ("num_scheduled", "num_decode_seqs", "decode_context_tokens",
                "prefill_tokens_initial", "prefill_tokens_resume", "decode_tokens",
                "prefill_attention_pairs", "checkpoint_writes")


# ----- one combination ----------------------------------------------------------------------
@dataclass
class Identified:
    combo: Combination
    profile: object
    iterations: int
    converged: bool
    residuals: list
    runs: dict = field(repr=False)
    seconds: float = 0.0


def start_profile():
    """The refits' common start: today's calibrated profile, every paged constant at 0 but
    the form's own (the fit frees those)."""
    from serving_core.executor.profiles import load_device_profile

    return load_device_profile("a100")


def identify_one(combo: Combination, space: Space, anchors, mixed, settings: Settings,
                 log) -> Identified:
    """Refit the step model under `combo` (simulate the fit cells, fit, repeat) and simulate
    every anchor cell with the result."""
    t0 = time.perf_counter()
    fit_cells = sorted({a.cell for a in anchors if a.section in "ABC"
                        and a.metric in ("throughput", "event_s")}, key=str)
    report_cells = sorted({a.cell for a in anchors if a.section in "ABCD"}, key=str)
    names = cal.STEP_FORMS[combo.form]
    profile = start_profile()
    profile = replace(profile, name=profile_name(profile))
    residuals, converged, it = [], False, 0
    for it in range(1, settings.max_iterations + 1):
        campaign = run_phase(combo, f"fit{it}", fit_cells, profile, settings, log)
        runs = read_runs(settings.ledger_root, campaign, fit_cells, profile)
        before = profile
        profile, residuals = cal.fit_constants(runs, anchors, mixed, profile, names)
        profile = replace(profile, name=profile_name(profile))
        change = cal.max_change(before, profile, names)
        if not settings.quiet:
            log(f"  {combo.name} iteration {it}: " + ", ".join(
                f"{n}={getattr(profile, n):.4g}" for n in names) + f" (max change {change:.1%})")
        if change < settings.tolerance:
            converged = True
            break
    campaign = run_phase(combo, "score", report_cells, profile, settings, log)
    runs = read_runs(settings.ledger_root, campaign, report_cells, profile)
    return Identified(combo, profile, it, converged, residuals, runs,
                      time.perf_counter() - t0)


# ----- scoring ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    kind: str  # level | ratio | slab
    part: str  # fit | check
    section: str
    point: str
    org: str  # organization, or the ratio (S1/S0)
    metric: str
    measured: float
    ours: float
    error: float  # relative error (levels), gap in pp (ratios), difference (slab)
    residual: float  # error over its tolerance


def zero_tolerance(spec, metric: str) -> float:
    """The absolute tolerance, in the metric's own unit, of an anchor of 0: `spec` is one
    number for every metric or a mapping metric -> tolerance with a `default` entry (so 1
    replayed token does not weigh as 1 preemption: conf/calibration/identify.yaml)."""
    if isinstance(spec, Mapping):
        value = spec.get(metric, spec.get("default"))
        if value is None:
            raise ValueError(f"zero-anchor tolerance: no entry for metric {metric!r} and no "
                             "'default' entry")
        return float(value)
    return float(spec)


def score_items(result: Identified, space: Space, anchors) -> list[Item]:
    sc = space.score
    part_of = {s: "fit" for s in sc["fit_sections"]} | {s: "check" for s in sc["check_sections"]}
    rows = cal.compare(anchors, result.runs)
    items = []
    for sec, point, org, metric, measured, ours, err in rows:
        if sec not in part_of or metric not in sc["level_tolerance"]:
            continue
        if measured == 0:
            error = ours - measured
            residual = error / zero_tolerance(sc["zero_anchor_tolerance"], metric)
        else:
            error = err
            residual = err / sc["level_tolerance"][metric]
        items.append(Item("level", part_of[sec], sec, point, org, metric, measured, ours,
                          float(error), float(residual)))
    for sec, point, metric, ratio, measured, ours, gap in cal.ratio_rows(rows):
        if sec not in part_of:
            continue
        tol = sc["ratio_tolerance_pp"][metric]
        items.append(Item("ratio", part_of[sec], sec, point, ratio, metric, measured, ours,
                          float(gap), float(gap / tol)))
    s2 = [r for c, rs in result.runs.items() if c.org == "S2" for r in rs]
    if s2 and "F" in part_of:
        slab = sc["slab"]
        occ = float(np.nanmean([r.metrics["slab_occupancy_mean"] for r in s2]))
        share = sum(1 for r in s2 if r.metrics["slab_pops"] > 0) / len(s2)
        for metric, measured, ours, tol in (
                ("occupancy", slab["occupancy"], occ, slab["occupancy_tolerance"]),
                ("reclaim_share", slab["reclaim_share"], share, slab["reclaim_tolerance"])):
            items.append(Item("slab", part_of["F"], "F", "all", "S2", metric, measured, ours,
                              ours - measured, (ours - measured) / tol))
    return items


def part_loss(items: list[Item], part: str) -> float:
    """Mean over groups (kind, metric) of the mean squared residual in the group."""
    groups: dict[tuple[str, str], list[float]] = {}
    for it in items:
        if it.part == part and math.isfinite(it.residual):
            groups.setdefault((it.kind, it.metric), []).append(it.residual ** 2)
    return float(np.mean([np.mean(v) for v in groups.values()])) if groups else math.nan


def targets(items: list[Item]) -> list[tuple[str, float, bool]]:
    """(target, error, met) of the 19 acceptance targets."""
    ratio = {(i.section, i.point, i.org): i for i in items
             if i.kind == "ratio" and i.metric == "throughput"}
    level = {(i.section, i.point, i.org): i for i in items
             if i.kind == "level" and i.metric == "c_once"}
    out = []
    for key in TARGET_RATIOS:
        it = ratio.get(key)
        gap = it.error if it else math.nan
        out.append((f"{key[0]}-{key[1]} {key[2]} throughput within 3 pp", gap,
                    bool(it) and abs(gap) <= 3.0))
    for key in TARGET_CONCE:
        it = level.get(key)
        err = it.error if it else math.nan
        out.append((f"{key[0]}-{key[1]} {key[2]} C_once within 15 %", err,
                    bool(it) and abs(err) <= 0.15))
    return out


def throughput_levels_within(items: list[Item], limit: float) -> bool:
    return all(abs(i.error) <= limit for i in items
               if i.kind == "level" and i.metric == "throughput")


# ----- the study table ----------------------------------------------------------------------
def result_rows(result: Identified, space: Space, anchors, search: str, settings: Settings,
                study_id: str) -> dict[str, list]:
    """The study-table columns of one scored combination."""
    from datetime import UTC, datetime

    items = score_items(result, space, anchors)
    combo = result.combo
    rows = []

    def add(kind, part="", section="", point="", org="", metric="", measured=math.nan,
            ours=math.nan, error=math.nan, residual=math.nan, met=False):
        rows.append((kind, part, section, point, org, metric, float(measured), float(ours),
                     float(error), float(residual), bool(met)))

    for name in cal.CONSTANTS:
        add("constant", metric=name, ours=getattr(result.profile, name),
            met=name in cal.STEP_FORMS[combo.form])
    for lab, target, fitted, err in result.residuals:
        add("residual", part="fit", metric=lab, measured=target, ours=fitted, error=err)
    for it in items:
        add(it.kind, it.part, it.section, it.point, it.org, it.metric, it.measured, it.ours,
            it.error, it.residual)
    for part in ("fit", "check"):
        add("loss", part=part, ours=part_loss(items, part))
    for name, err, met in targets(items):
        add("target", metric=name, error=err, met=met)
    add("levels", metric="throughput levels within 10 %",
        met=throughput_levels_within(items, space.selection["level_limit"]))
    names = ("kind", "part", "section", "point", "org", "metric", "measured", "ours", "error",
             "residual", "met")
    cols = {n: [r[i] for r in rows] for i, n in enumerate(names)}
    n = len(rows)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    common = {"study_id": study_id, "created_at": now, "search": search,
              "combination": combo.name, "label": combo.label, "form": combo.form,
              "rules": json.dumps(combo.rules(), sort_keys=True),
              "seeds_per_cell": settings.seeds, "requests": settings.requests or 300,
              "iterations": result.iterations, "converged": result.converged,
              "seconds": result.seconds}
    return {**{k: [v] * n for k, v in common.items()}, **cols}


def scored(root: Path, search: str) -> dict[str, dict]:
    """{combination: its newest rows (column lists)} already in the table for `search`."""
    from ledgers.studies import read_study

    table = read_study(root, TABLE, latest=False)
    if table is None:
        return {}
    frame = table.to_pandas()
    frame = frame[(frame["search"] == search) & (frame["kind"] != "selection")]
    out = {}
    for name, g in frame.groupby("combination"):
        newest = g[g["created_at"] == g["created_at"].max()]
        newest = newest[newest["study_id"] == newest["study_id"].iloc[-1]]
        out[name] = newest.to_dict("list")
    return out


def summary_of(rows: dict) -> dict:
    """Loss, targets met, levels flag and constants of one combination's rows."""
    def pick(kind, part=None):
        return [i for i, k in enumerate(rows["kind"])
                if k == kind and (part is None or rows["part"][i] == part)]

    loss = {rows["part"][i]: rows["ours"][i] for i in pick("loss")}
    tgt = pick("target")
    return {"combination": rows["combination"][0], "label": rows["label"][0],
            "form": rows["form"][0], "rules": json.loads(rows["rules"][0]),
            "fit_loss": loss.get("fit", math.nan), "check_loss": loss.get("check", math.nan),
            "targets_met": sum(bool(rows["met"][i]) for i in tgt), "targets": len(tgt),
            "levels_ok": bool(rows["met"][pick("levels")[0]]),
            "levels": {f"{rows['section'][i]}-{rows['point'][i]} {rows['org'][i]} "
                       f"{rows['metric'][i]}": (rows["measured"][i], rows["error"][i])
                       for i in pick("level")},
            "constants": {rows["metric"][i]: rows["ours"][i] for i in pick("constant")},
            "ratios": {f"{rows['section'][i]}-{rows['point'][i]} {rows['org'][i]} "
                       f"{rows['metric'][i]}": rows["error"][i] for i in pick("ratio")},
            "iterations": rows["iterations"][0], "converged": bool(rows["converged"][0]),
            "seconds": float(rows["seconds"][0])}


def moved_outside(candidate: dict, base: dict, selection: dict) -> list[str]:
    """The levels the refitted defaults hold within the selection's limit (relative error;
    an anchor of 0 by the score's absolute tolerance, `zero_tolerance`) that `candidate`
    moves outside it: the issue's "without moving any level outside 10 %"."""
    limit, zero = selection["level_limit"], selection["zero_tolerance"]

    def within(metric: str, measured: float, error: float) -> bool:
        return abs(error) <= (zero_tolerance(zero, metric) if measured == 0 else limit)

    out = []
    for key, (measured, error) in base.get("levels", {}).items():
        got = candidate.get("levels", {}).get(key)
        metric = key.rsplit(" ", 1)[-1]
        if got is not None and within(metric, measured, error) and not within(metric, *got):
            out.append(key)
    return out


def select(summaries: list[dict], space: Space) -> dict:
    """The adopted default (or none) and the identified set (selection rule of the space):
    the combination of least fitting loss is adopted only when it lowers the refitted
    defaults' checking loss, keeps every throughput level within the limit and moves no
    level the defaults hold within the limit outside it."""
    finite = [s for s in summaries if math.isfinite(s["fit_loss"])]
    if not finite:
        return {"best": None, "adopted": None, "identified": [], "reason": "nothing scored"}
    best = min(finite, key=lambda s: (s["fit_loss"], s["combination"]))
    base = next((s for s in summaries if s["combination"] == "base"), None)
    tol = space.selection["tolerance"]
    identified = [s["combination"] for s in sorted(finite, key=lambda s: s["fit_loss"])
                  if s["fit_loss"] <= (1 + tol) * best["fit_loss"]]
    pct = f"{space.selection['level_limit']:.0%}"
    moved = [] if base is None else moved_outside(best, base, space.selection)
    if base is None:
        adopted, reason = None, "the refitted defaults (base) were not scored"
    elif best["combination"] == "base":
        adopted, reason = "base", "the defaults have the least fitting loss"
    elif not best["levels_ok"]:
        adopted, reason = None, f"{best['combination']} moves a throughput level outside {pct}"
    elif not best["check_loss"] < base["check_loss"]:
        adopted, reason = None, (f"{best['combination']} does not improve the checking part "
                                 f"({best['check_loss']:.3g} against {base['check_loss']:.3g})")
    elif moved:
        adopted, reason = None, (
            f"{best['combination']} lowers the checking loss ({best['check_loss']:.3g} against "
            f"{base['check_loss']:.3g}) but moves {len(moved)} level(s) the defaults hold "
            f"within {pct} outside it: {', '.join(moved)}")
    else:
        adopted, reason = best["combination"], (
            f"least fitting loss ({best['fit_loss']:.3g}), checking loss "
            f"{best['check_loss']:.3g} below the defaults' {base['check_loss']:.3g}, no level "
            f"moved outside {pct}")
    return {"best": best["combination"], "adopted": adopted, "identified": identified,
            "reason": reason}


def selection_rows(search: str, study_id: str, selection: dict, summaries,
                   space: Space) -> dict[str, list]:
    """One row per combination: identified or not, adopted or not, the reason, and (`ours`)
    how many levels the refitted defaults hold within the limit it moves outside."""
    from datetime import UTC, datetime

    now = datetime.now(UTC).isoformat(timespec="seconds")
    base = next((s for s in summaries if s["combination"] == "base"), {})
    rows = []
    for s in summaries:
        name = s["combination"]
        rows.append((name, s["label"], s["form"], json.dumps(s["rules"], sort_keys=True),
                     "identified" if name in selection["identified"] else "",
                     name == selection["adopted"],
                     float(len(moved_outside(s, base, space.selection)))))
    n = len(rows)
    return {"study_id": [study_id] * n, "created_at": [now] * n, "search": [search] * n,
            "combination": [r[0] for r in rows], "label": [r[1] for r in rows],
            "form": [r[2] for r in rows], "rules": [r[3] for r in rows],
            "seeds_per_cell": [0] * n, "requests": [0] * n, "iterations": [0] * n,
            "converged": [False] * n, "seconds": [0.0] * n, "kind": ["selection"] * n,
            "part": [r[4] for r in rows], "section": [""] * n, "point": [""] * n,
            "org": [""] * n, "metric": [selection["reason"]] * n, "measured": [math.nan] * n,
            "ours": [r[6] for r in rows], "error": [math.nan] * n,
            "residual": [math.nan] * n, "met": [r[5] for r in rows]}


# ----- conf/calibration outputs -------------------------------------------------------------
def write_conf(summaries: list[dict], selection: dict, space: Space, search: str,
               settings: Settings, seconds: float, unscored: list[str] = ()) -> None:
    """conf/calibration/identify.csv (the search table) and identified.yaml (the set)."""
    import csv

    ratio_keys = sorted({k for s in summaries for k in s["ratios"]})
    with OUT_CSV.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["combination", "label", "form", "fit_loss", "check_loss", "targets_met",
                    "levels_within_10pct", "levels_moved_outside", "identified", "adopted",
                    "iterations", *cal.CONSTANTS, *(f"gap_pp {k}" for k in ratio_keys)])
        base = next((s for s in summaries if s["combination"] == "base"), {})
        for s in sorted(summaries, key=lambda s: s["fit_loss"]):
            moved = moved_outside(s, base, space.selection)
            w.writerow([s["combination"], s["label"], s["form"], f"{s['fit_loss']:.4f}",
                        f"{s['check_loss']:.4f}", f"{s['targets_met']}/{s['targets']}",
                        s["levels_ok"], len(moved), s["combination"] in selection["identified"],
                        s["combination"] == selection["adopted"], s["iterations"],
                        *(f"{s['constants'].get(c, math.nan):.6g}" for c in cal.CONSTANTS),
                        *(f"{s['ratios'].get(k, math.nan):+.2f}" for k in ratio_keys)])
    by_name = {s["combination"]: s for s in summaries}
    identified = {}
    for name in selection["identified"]:
        s = by_name[name]
        consts = {c: float(v) for c, v in s["constants"].items()}
        identified[name] = {
            "label": s["label"], "form": s["form"], "fit_loss": round(s["fit_loss"], 6),
            "check_loss": round(s["check_loss"], 6),
            "rules": {org: list(o) for org, o in s["rules"].items() if o},
            "executor": consts,
        }
    doc = {"search": search, "space": space.digest, "seeds_per_cell": settings.seeds,
           "combinations_scored": len(summaries), "unscored": list(unscored),
           "search_seconds": round(seconds),
           "selection_tolerance": space.selection["tolerance"],
           "best": selection["best"], "adopted": selection["adopted"],
           "reason": selection["reason"], "identified": identified}
    OUT_IDENTIFIED.write_text(
        "# Written by `make identify` (experiments/studies/identify.py): the combinations whose\n"
        "# fitting-part loss is within the selection tolerance of the best, with their rules\n"
        "# per organization and fitted step-model constants. experiments.studies.sensitivity\n"
        "# adds each as an alternative `identified_<name>`; do not edit by hand.\n"
        + yaml.safe_dump(doc, sort_keys=False, width=100))


# ----- command line -------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = study_parser("identify", __doc__, smoke="the smoke design, 1 seed, 40 requests, "
                     "1 iteration (campaigns *_smoke)")
    p.add_argument("--design", default=None,
                   help="comma-separated designs of the space (default: its `full` list)")
    p.add_argument("--combinations", default="",
                   help="comma-separated combination names to run (of the chosen designs)")
    p.add_argument("--jobs", type=int, default=None, help="parallel runs (default: cores)")
    p.add_argument("--iterations", type=int, default=None, help="at most this many fits")
    p.add_argument("--sweep-dir", type=Path, default=None,
                   help="folder for the campaigns' job logs (default: Hydra's, "
                        "outputs/multirun/<campaign>/<time> under the working directory)")
    p.add_argument("--list", action="store_true", help="list the combinations; run nothing")
    p.add_argument("--no-conf", action="store_true",
                   help="do not write conf/calibration/identify.csv and identified.yaml")
    p.add_argument("--select-only", action="store_true",
                   help="run nothing: apply the selection rule to the combinations the search "
                        "has scored (the others are listed as unscored) and write its outputs")
    p.add_argument("--search", default=None,
                   help="with --select-only: the search key to select over (default: the key "
                        "of this space and these settings)")
    return p


def _chosen(args, space: Space) -> list:
    """The combinations the flags choose; ValueError names the bad flag."""
    designs = (args.design.split(",") if args.design else
               ["smoke"] if args.smoke else list(space.full))
    combos = space.combinations(designs)
    if args.combinations:
        wanted = args.combinations.split(",")
        unknown = sorted(set(wanted) - {c.name for c in combos})
        if unknown:
            raise ValueError(f"--combinations: unknown {', '.join(unknown)}; allowed values are "
                             f"{', '.join(c.name for c in combos)}")
        combos = [c for c in combos if c.name in wanted]
    for flag in ("jobs", "seeds", "requests", "iterations"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag}={value}: allowed integers >= 1")
    if not args.smoke and (args.seeds or args.requests):
        raise ValueError("--seeds/--requests: allowed only with --smoke (a full search runs "
                         "the anchors' 3 seeds and 300 requests)")
    return combos


def _log(msg) -> None:
    print(msg, file=sys.stderr, flush=True)


def _score_all(combos, space: Space, settings: Settings, search: str, study_id: str,
               select_only: bool) -> tuple[list[dict], list[str]]:
    """Summaries of every combination (scored now or earlier by `search`), and the names
    --select-only left unscored."""
    from ledgers.studies import write_study

    anchors = cal.load_anchors()
    mixed = cal.load_mixed()
    done = scored(settings.ledger_root, search)
    _log(f"identify: search {search}, {len(combos)} combinations ({len(done)} already scored), "
         f"{settings.seeds} seed(s) per cell, at most {settings.max_iterations} fit iterations; "
         f"ledgers {settings.ledger_root}")
    summaries, unscored = [], []
    for i, combo in enumerate(combos, 1):
        if combo.name in done:
            summaries.append(summary_of(done[combo.name]))
            continue
        if select_only:
            unscored.append(combo.name)
            continue
        result = identify_one(combo, space, anchors, mixed, settings, _log)
        cols = result_rows(result, space, anchors, search, settings, study_id)
        write_study(settings.ledger_root, TABLE, cols)
        s = summary_of(cols)
        summaries.append(s)
        _log(f"[{i}/{len(combos)}] {combo.name}: fit loss {s['fit_loss']:.3f}, check loss "
             f"{s['check_loss']:.3f}, targets {s['targets_met']}/{s['targets']}, "
             f"{result.iterations} fits, {result.seconds:.0f} s")
    return summaries, unscored


def _print_ranking(summaries: list[dict], selection: dict) -> None:
    for s in sorted(summaries, key=lambda s: s["fit_loss"]):
        print(f"{s['combination']:32} fit {s['fit_loss']:8.3f}  check {s['check_loss']:8.3f}  "
              f"targets {s['targets_met']:2d}/{s['targets']}"
              + ("  identified" if s["combination"] in selection["identified"] else ""))
    print(f"best {selection['best']}; adopted {selection['adopted']}: {selection['reason']}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.search and not args.select_only:
        print("error: --search: allowed only with --select-only", file=sys.stderr)
        return 2
    try:
        space = load_space()
        combos = _chosen(args, space)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.list:
        for c in combos:
            print(f"{c.name:32} {c.label}")
        print(f"{len(combos)} combinations")
        return 0
    settings = Settings(
        ledger_root=args.ledger_root.resolve(), smoke=args.smoke, jobs=args.jobs,
        seeds=(args.seeds or 1) if args.smoke else 3,
        requests=(args.requests or 40) if args.smoke else None,
        max_iterations=args.iterations or (1 if args.smoke else space.fit["max_iterations"]),
        tolerance=float(space.fit["tolerance"]),
        sweep_dir=args.sweep_dir.resolve() if args.sweep_dir else None)
    from ledgers.studies import write_study

    search = args.search or settings.key(space)
    study_id = time.strftime("%Y%m%dT%H%M%S") + "-" + search
    t0 = time.perf_counter()
    summaries, unscored = _score_all(combos, space, settings, search, study_id,
                                     args.select_only)
    if unscored:
        _log(f"select-only: {len(unscored)} combination(s) of the space not scored by {search}: "
             + ", ".join(unscored))
    if not summaries:
        print(f"error: search {search}: nothing scored under {settings.ledger_root}",
              file=sys.stderr)
        return 2
    selection = select(summaries, space)
    write_study(settings.ledger_root, TABLE, selection_rows(search, study_id, selection,
                                                            summaries, space))
    # the search's compute time: its combinations' refit-and-score seconds
    seconds = sum(s["seconds"] for s in summaries)
    if not args.smoke and not args.no_conf:
        write_conf(summaries, selection, space, search, settings, seconds, unscored)
        _log(f"wrote {OUT_CSV.relative_to(ROOT)} and {OUT_IDENTIFIED.relative_to(ROOT)}")
    _print_ranking(summaries, selection)
    print(json.dumps({"search": search, "combinations": len(summaries), "best":
                      selection["best"], "adopted": selection["adopted"],
                      "identified": selection["identified"],
                      "unscored": unscored, "search_seconds": round(seconds, 1),
                      "wall_seconds": round(time.perf_counter() - t0, 1)}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
