"""Which conclusions survive the engine rules the anchors cannot identify (sensitivity.md).

`make sensitivity` reruns the primary families (conf/sensitivity/alternatives.yaml: every
page's, Q1's EXT-22 also deciding Q4's D0/S2 rows) under each declared alternative rule,
into campaign `sens_<alternative>` (`..._smoke` at smoke size), question `sensitivity`.
Here each family is evaluated per alternative with the question's own machinery
(analysis.inference.families.evaluate_family on the preregistered family, its cells moved
to that campaign and its seeds cut to those collected): the primary estimand's seedwise
effect, Holm-adjusted decision and all. `default` is the page's own runs (the runner's
`default` alternative collects them in the page's campaigns), paired by seed: every
alternative and the page are cut to the seeds complete in all of them. A cell the runner
did not rerun because its engine asks for the default's rules (`as_default`, e.g. a slab
policy for D0) reads the page's own runs. One table: every primary contrast's estimate and
decision under every alternative; a contrast whose sign or decision differs from the
`default`'s is marked, and it is robust when none does.

The sensitivity runs carry no preregistered plan of their own (question `sensitivity`), so
the derived plans check cells and seeds, not plan hashes.

    python -m analysis.studies.sensitivity --ledgers ROOT [--out DIR]
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pandas as pd

from analysis import cli
from analysis.inference import families, prereg
from analysis.pages import common
from analysis.pages.render import md_table

PAGE = "sensitivity.md"
TITLE = "Which conclusions survive the engine rules the anchors cannot identify"
TABLES = ("sensitivity_runs",)  # the study's record; its runs are campaigns sens_*
QUESTION = "sensitivity"
ALTERNATIVES_YAML = Path(__file__).resolve().parents[2] / "conf" / "sensitivity" / \
    "alternatives.yaml"
CAMPAIGN_PREFIX, SMOKE_SUFFIX = "sens_", "_smoke"
NO_PLAN_HASH = "<none>"  # what the plan check reads for a run collected under no plan
FILL = ("make sensitivity (python -m experiments.studies.sensitivity, then "
        "python -m analysis.studies.sensitivity)")
CHANGED = "**changed**"
DEFAULT = "default"  # compared on the pages' own runs
AS_DEFAULT = "as_default"  # a study record's outcome: the page's own run stands for it


def load_alternatives(path: Path = ALTERNATIVES_YAML) -> dict:
    """The declared alternatives and the identified ones (ledgers.alternatives)."""
    from ledgers.alternatives import load_alternatives as load_merged

    return load_merged(path)


def executor_of(cell_executor: str, overrides) -> str:
    """The executor a cell's runs record under an alternative: an identified alternative
    runs the simulator on its own fitted profile (`executor.name=<profile>` among its
    overrides, ledgers.alternatives), so its runs say `sim:<profile>`, not the plan's."""
    names = [o.split("=", 1)[1] for o in overrides or () if o.startswith("executor.name=")]
    if names and str(cell_executor).startswith("sim:"):
        return f"sim:{names[-1]}"
    return cell_executor


def derived_plan(plan: prereg.Plan, family: str, campaign: str,
                 seeds: set[int] | None, overrides=(), borrowed=(), smoke: bool = False
                 ) -> prereg.Plan:
    """The plan's `family` with every cell moved to `campaign` (and to the executor profile
    the alternative's `overrides` name, if any) and its seeds cut to those in `seeds` (plan
    order kept; None: all); hash checks are off (the runs carry no plan). Cells in
    `borrowed` (run as the default's: the runner's `as_default`) keep the page's own
    campaigns (their smoke ones when `smoke`), whose runs are checked against their plans."""
    fam = plan.family(family)
    seeds = {s for c in fam.cells for s in c.seeds} if seeds is None else seeds

    def moved(cell) -> dict:
        if cell.id in borrowed:
            return {**cell.keys, "campaign": page_campaigns(cell, smoke)}
        keys = {**cell.keys, "campaign": campaign}
        if "executor" in keys:
            keys["executor"] = executor_of(keys["executor"], overrides)
        return keys

    cells = tuple(dataclasses.replace(c, keys=moved(c),
                                      seeds=tuple(s for s in c.seeds if s in seeds))
                  for c in fam.cells)
    fam = dataclasses.replace(fam, cells=cells, seeds=tuple(s for s in fam.seeds if s in seeds))
    return dataclasses.replace(plan, campaign=campaign, families=(fam,), plan_hash=NO_PLAN_HASH)


def page_campaigns(cell: prereg.Cell, smoke: bool):
    """The campaigns of a cell's own runs (the page's): as planned, or their smoke ones."""
    names = prereg.cell_campaigns(cell)
    if smoke:
        names = tuple(s for c in names for s in families.smoke_campaigns(c))
    return names[0] if len(names) == 1 else names


def page_plan(plan: prereg.Plan, family: str, seeds: set[int], smoke: bool) -> prereg.Plan:
    """The page's own runs of `family` (the `default` of every comparison), its seeds cut
    to `seeds`; each run is checked against the plan of the campaign it was collected in."""
    fam = plan.family(family)
    cells = tuple(dataclasses.replace(c, keys={**c.keys, "campaign": page_campaigns(c, smoke)},
                                      seeds=tuple(s for s in c.seeds if s in seeds))
                  for c in fam.cells)
    fam = dataclasses.replace(fam, cells=cells, seeds=tuple(s for s in fam.seeds if s in seeds))
    return dataclasses.replace(plan, families=(fam,))


def complete_seeds(plan: prereg.Plan, runs: pd.DataFrame) -> set[int]:
    """Seeds of the plan's one family with a matching run in every cell."""
    fam = plan.families[0]
    found, _ = families.relaxed_match(plan, fam, runs)
    if found.empty:
        return set()
    per_seed = found.groupby("seed")["cell_id"].nunique()
    return {int(s) for s, n in per_seed.items() if n == len(fam.cells)}


def campaigns_present(runs: pd.DataFrame, alternatives: list[str]) -> dict[str, str]:
    """{alternative: campaign}: the full-size campaign when it has runs, else the smoke one
    (`default` excluded: its runs are the pages' own)."""
    present = set(runs["campaign"].astype(str)) if len(runs) else set()
    out = {}
    for alt in alternatives:
        for campaign in (f"{CAMPAIGN_PREFIX}{alt}", f"{CAMPAIGN_PREFIX}{alt}{SMOKE_SUFFIX}"):
            if alt != DEFAULT and campaign in present:
                out[alt] = campaign
                break
    return out


def borrowed_cells(record: pd.DataFrame | None, alternative: str, family: str) -> set[str]:
    """Cells the study ran as the default's under `alternative` (outcome `as_default`)."""
    if record is None or record.empty:
        return set()
    rows = record[(record["alternative"] == alternative) & (record["family"] == family)
                  & (record["outcome"] == AS_DEFAULT)]
    return set(rows["cell"].astype(str))


def _paired(runs, spec, entry, found, record, plan_dir):
    """(plan, {alternative: (derived plan, its runs)}, seeds, smoke) of one family: every
    alternative with runs at one size (full before smoke) and the page's own runs, cut to
    the seeds complete in all of them (paired by seed)."""
    plan = prereg.load_plan(entry["plan"], plan_dir or prereg.PLAN_DIR)
    name = entry["family"]
    for smoke in (False, True):
        derived, seeds = {}, None
        for alt, campaign in found.items():
            if campaign.endswith(SMOKE_SUFFIX) != smoke:
                continue
            overrides = spec["alternatives"][alt].get("overrides") or ()
            alt_plan = derived_plan(plan, name, campaign, None, overrides,
                                    borrowed_cells(record, alt, name), smoke)
            alt_runs = family_runs(runs, record, alt, name, campaign)
            mine = complete_seeds(alt_plan, alt_runs)
            if mine:
                derived[alt] = (alt_plan, alt_runs)
                seeds = mine if seeds is None else seeds & mine
        if derived:
            seeds &= complete_seeds(page_plan(plan, name, seeds, smoke), runs)
            return plan, derived, seeds, smoke
    return plan, {}, set(), False


def family_runs(runs: pd.DataFrame, record: pd.DataFrame | None, alternative: str,
                family: str, campaign: str) -> pd.DataFrame:
    """`runs` with the alternative's campaign cut to the runs the study record names for
    `family`: one sens_<alternative> campaign holds every family's reruns, and a cell that
    does not name an axis (EXT-22's S2_b63, no host tier) would otherwise also match another
    family's runs on it (TIER-1's host-tier runs), a duplicate that drops the cell."""
    if record is None or record.empty:
        return runs
    rows = record[(record["alternative"] == alternative) & (record["family"] == family)]
    if rows.empty:
        return runs
    ids = set(rows["run_id"].astype(str)) - {""}
    return runs[(runs["campaign"].astype(str) != campaign) | runs["run_id"].isin(ids)]


def _restricted(derived: prereg.Plan, seeds: set[int]) -> prereg.Plan:
    fam = derived.families[0]
    cells = tuple(dataclasses.replace(c, seeds=tuple(s for s in c.seeds if s in seeds))
                  for c in fam.cells)
    return dataclasses.replace(derived, families=(dataclasses.replace(
        fam, cells=cells, seeds=tuple(s for s in fam.seeds if s in seeds)),))


def evaluate(runs: pd.DataFrame, spec: dict, plan_dir=None,
             record: pd.DataFrame | None = None) -> tuple[pd.DataFrame, dict]:
    """Long table (alternative, question, family, test, label, n, effect, p_holm, decision,
    status, planned: the plan's seeds) of every primary contrast under every alternative
    with runs and, as `default`, on the page's own runs at the same seeds; and
    {(alt, family): status}. `runs`: the pages' and the sensitivity runs; `record`: the
    study's record (its `as_default` cells are read from the page's runs)."""
    found = campaigns_present(runs, list(spec["alternatives"]))
    rows, status = [], {}
    for entry in spec["families"]:
        plan, derived, seeds, smoke = _paired(runs, spec, entry, found, record, plan_dir)
        if not seeds:
            continue
        plans = {DEFAULT: (page_plan(plan, entry["family"], seeds, smoke), runs),
                 **{alt: (_restricted(d, seeds), r) for alt, (d, r) in derived.items()}}
        for alt, (alt_plan, alt_runs) in plans.items():
            fam = alt_plan.families[0]
            res = families.evaluate_family(alt_plan, fam, alt_runs)
            campaign = found.get(alt, "the page's own runs" + (" (smoke)" if smoke else ""))
            status[(alt, entry["family"])] = f"{res.status} ({campaign}, n = {len(seeds)})"
            table = res.tables.get(fam.primary_estimand.name)
            for r in (table.itertuples() if table is not None else ()):
                rows.append({"alternative": alt, "campaign": campaign,
                             "question": plan.question, "family": entry["family"],
                             "test": r.test, "label": r.label, "predicted": r.predicted,
                             "n": r.n, "effect": r.effect, "unit": r.unit,
                             "p_holm": r.p_holm, "decision": r.decision,
                             "status": res.status,
                             "planned": len(plan.family(entry["family"]).seeds)})
    return pd.DataFrame(rows), status


def _sign(x: float) -> int:
    return 0 if x is None or (isinstance(x, float) and math.isnan(x)) or x == 0 else (
        1 if x > 0 else -1)


def robustness(long: pd.DataFrame) -> pd.DataFrame:
    """One row per contrast: per alternative 'effect (decision)', with a change in sign
    (opposite nonzero signs; an effect of exactly 0, e.g. identical runs, flips nothing) or
    in decision against `default` marked; `robust` says whether no alternative changed it."""
    if long.empty:
        return pd.DataFrame()
    alts = list(dict.fromkeys(long["alternative"]))
    out = []
    for (family, test), rows in long.groupby(["family", "test"], sort=False):
        by = rows.set_index("alternative")
        base = by.loc["default"] if "default" in by.index else None
        row = {"family": family, "contrast": test, "label": rows["label"].iloc[0]}
        changed = []
        for alt in alts:
            if alt not in by.index:
                row[alt] = ""
                continue
            r = by.loc[alt]
            text = f"{r.effect:+.1f}{'%' if str(r.unit).startswith('%') else ''}"
            text += f" ({_short(r.decision)})"
            if base is not None and alt != "default":
                flips = []
                if _sign(r.effect) * _sign(base.effect) < 0:  # opposite, both nonzero
                    flips.append("sign")
                if str(r.decision) != str(base.decision):
                    flips.append("decision")
                if flips:
                    changed.append(f"{alt}: {' and '.join(flips)}")
                    text += f" {CHANGED}"
            row[alt] = text
        compared = base is not None and len(by.index) > 1
        row["robust"] = "no" if changed else ("yes" if compared else "")
        row["changes"] = "; ".join(changed)
        out.append(row)
    return pd.DataFrame(out)


def _overrides_text(alt: dict) -> str:
    """An alternative's overrides (per organization where it has them); executor constants
    of an identified alternative are summarized, not listed."""
    over = [o for o in alt.get("overrides") or [] if not o.startswith("executor.")]
    if any(o.startswith("executor.") for o in alt.get("overrides") or []):
        over.append("its fitted step-model constants")
    over += [f"{org}: {', '.join(v)}" for org, v in (alt.get("by_org") or {}).items()]
    return ", ".join(over) or "no override"


def _short(decision: str) -> str:
    d = str(decision)
    return {"not rejected": "n.s.", "refused": "refused"}.get(
        d, d.replace("reject H0 (positive)", "H0 rejected, +").replace(
            "reject H0 (negative)", "H0 rejected, -"))


def load_inputs(con) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(every complete run: the pages' own and the sensitivity reruns; every row of the
    study's record, None when it has none), read once per report (each page's flip columns
    read them: `common.once_per_report`), copied out."""
    runs, record = common.once_per_report(con, "sensitivity inputs", lambda: _read_inputs(con))
    return runs.copy(), None if record is None else record.copy()


def _read_inputs(con) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    questions = [q for (q,) in con.execute("SELECT DISTINCT question FROM runs").fetchall()]
    runs = common.load_runs(con, [str(q) for q in questions]).all_runs
    try:
        record = con.execute(f"SELECT * FROM {TABLES[0]}").df()
    except Exception:  # noqa: BLE001 - no study table in these ledgers
        record = None
    return runs, record


def section(runs: pd.DataFrame, spec: dict, plan_dir=None,
            record: pd.DataFrame | None = None) -> tuple[str, dict, dict]:
    long, status = evaluate(runs, spec, plan_dir, record)
    alts = spec["alternatives"]
    text = ["# Sensitivity: which conclusions survive the rules the anchors cannot identify",
            ""]
    if long.empty:
        text += [f"No sensitivity runs in these ledgers. Fill with `{FILL}`.", ""]
        return "\n".join(text), {"contrasts": 0}, {}
    table = robustness(long)
    shown_alts = [a for a in alts if a in set(long["alternative"])]
    n_seeds = long.groupby("alternative")["n"].max().to_dict()
    smoke = any(str(c).endswith(SMOKE_SUFFIX) for c in long["campaign"])
    text += [
        "Each primary family (" + ", ".join(f"{e['plan'].upper()} `{e['family']}`"
                                           for e in spec["families"])
        + ") rerun under every declared alternative engine rule "
        "(conf/sensitivity/alternatives.yaml), evaluated by the question's own preregistered "
        "decision (mean seedwise percent change of the primary estimand; exact sign-flip "
        "test, Holm within the family). Cells: as preregistered, collected in campaign "
        "`sens_<alternative>` (a cell whose engine asks the default's rules reads the "
        "page's own run); `default` is the page's own runs, paired by seed: per family, "
        "every alternative and the page at the seeds complete in all of them; largest n "
        "per alternative: "
        + ", ".join(f"{a} n = {int(n_seeds[a])}" for a in shown_alts) + ".", ""]
    n_min = int(min(n_seeds.values()))
    if smoke:
        text += ["**Smoke size** (`*_smoke` campaigns: fewer requests per run than the "
                 "preregistered design; seeds as collected): for checking the pipeline and "
                 "for a first look, not for conclusions about the full design."]
    if 2.0 / 2 ** n_min > 0.05:
        text += [f"With n = {n_min} seeds the smallest exact two-sided sign-flip p is "
                 f"2 / 2^{n_min} = {2.0 / 2 ** n_min:.3g} > 0.05: no test can be rejected, so "
                 "decision changes are impossible and only signs are informative."]
    text.append("")
    text += ["## Alternatives", ""]
    text += [f"- `{a}`: {_overrides_text(alts[a])}; {alts[a].get('why', '')}"
             for a in shown_alts]
    text += ["", "## Family status per alternative", ""]
    text += [f"- {alt} / {fam}: {st}" for (alt, fam), st in status.items()]
    robust = table[table["robust"] == "yes"]
    fragile = table[table["robust"] == "no"]
    text += ["", "## Primary contrasts under each alternative", "",
             f"Effect (mean seedwise % change; interactions in pp) and decision; {CHANGED} "
             "marks a sign (opposite, both nonzero) or decision that differs from `default`.",
             "",
             md_table(table, ["family", "contrast", "label", *shown_alts, "robust"]), ""]
    text += ["## Robust and fragile conclusions", "",
             f"Robust to every alternative ({len(robust)} of {len(table)}): "
             + (", ".join(f"`{c}`" for c in robust["contrast"]) or "none") + ".", "",
             f"Fragile ({len(fragile)}):", ""]
    text += [f"- `{r.contrast}` ({r.family}): {r.changes}" for r in fragile.itertuples()]
    if fragile.empty:
        text.append("- none")
    info = {"contrasts": int(len(table)), "robust": int(len(robust)),
            "fragile": int(len(fragile)), "alternatives": shown_alts, "smoke": smoke}
    return "\n".join(text) + "\n", info, {"long": long, "robustness": table}


def runs_section(record: pd.DataFrame) -> str:
    """What the newest study run (`sensitivity_runs` study table) ran, per alternative."""
    if record.empty:
        return ""
    counts = (record.assign(ran=record["outcome"] == "ran")
              .groupby(["alternative", "campaign"], sort=False)
              .agg(runs=("run_id", "size"), ran=("ran", "sum")).reset_index())
    counts["skipped"] = counts["runs"] - counts["ran"]
    head = record.iloc[0]
    return "\n".join(["", "## Runs of the newest study", "",
                      f"Study {head['study_id']} (written {head['created_at']}): every run "
                      "it asked for, run or skipped as already complete.", "",
                      md_table(counts), ""])


def write_page(con, out: Path, plan_dir=None) -> tuple[Path, dict]:
    """Write sensitivity.md and its tables (without runs, the page names the fill command)."""
    runs, record = load_inputs(con)
    text, info, tables = section(runs, load_alternatives(), plan_dir, record)
    text += runs_section(common.latest_study(con, TABLES[0]))
    common.write_tables(out, "sensitivity", tables)
    path = Path(out) / PAGE
    path.write_text(text, encoding="utf-8")
    return path, info


def main(argv: list[str] | None = None) -> int:
    return cli.report_page_main("analysis.studies.sensitivity", __doc__, PAGE, write_page,
                                "contrasts", argv=argv)


if __name__ == "__main__":
    sys.exit(main())
