"""Where a page's winner flips: the `holds_under` column of every primary contrast.

For each primary family of a page (its preregistered plan's families of role `primary`),
the family is rerun under every alternative engine rule of the sensitivity study
(conf/sensitivity/alternatives.yaml: the declared ones, the slab rules among them, and the
`identified_*` alternatives of the identify study) by `make sensitivity`, into campaigns
`sens_<alternative>` (`SMOKE=1`: `sens_<alternative>_smoke`). Each primary contrast's
sign and Holm decision under each alternative is compared with the `default` rerun of the
same size (analysis.studies.sensitivity.robustness), and the page's primary table gets:

- `holds under all k alternatives` when no alternative changes its sign or decision;
- `depends on <alternative> (sign | decision | sign and decision); ...` otherwise: the
  contrast is not a winner, it is a winner under some of the rules the anchors cannot
  decide;
- `not run under the alternatives (...)` when the family has no sensitivity runs, naming
  how to collect them. A rerun refused by the plan check (e.g. its runs still being
  collected) is left out. Reruns at smoke size say so: with 3 seeds no decision can
  change, only signs.

Any page gets the column without code of its own: analysis.report calls
`add_flip_columns(result.families, con)` after a page's `analyze` (a campaign page added
later, e.g. per model, only lists its family in conf/sensitivity/alternatives.yaml).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pandas as pd

from analysis.inference import prereg
from analysis.inference.families import REFUSED

COLUMN = "holds_under"
SMOKE = "_smoke"  # a sensitivity campaign at smoke size (analysis.studies.sensitivity)
NOT_LISTED = ("not run under the alternatives (list the family in "
              "conf/sensitivity/alternatives.yaml, then make sensitivity)")
NOT_RUN = "not run under the alternatives (make sensitivity; SMOKE=1 for a first look)"
NOT_RERUN = "not rerun under the alternatives: "  # + the file's reason (its `not_rerun`)


def flip_texts(long: pd.DataFrame) -> dict[tuple[str, str], str]:
    """{(family, test): column text} from the sensitivity long table (one row per
    alternative, family and test: effect and decision; analysis.studies.sensitivity)."""
    from analysis.studies.sensitivity import robustness

    # a refused or incomplete rerun (its runs still collecting) decides nothing: left out
    long = long[(long["n"] > 0) & ~long["decision"].astype(str).str.startswith(REFUSED)]
    if long.empty:
        return {}
    table = robustness(long)
    sizes = {f: _size_note(rows) for f, rows in long.groupby("family")}
    out = {}
    for r in table.itertuples():
        size = sizes[r.family]
        alts = set(long[(long["family"] == r.family) & (long["test"] == r.contrast)]
                   ["alternative"]) - {"default"}
        if r.robust == "yes":
            out[(r.family, r.contrast)] = f"holds under all {len(alts)} alternatives{size}"
        elif r.robust == "no":
            parts = [c.replace(": ", " (", 1) + ")" for c in str(r.changes).split("; ")]
            out[(r.family, r.contrast)] = "depends on " + "; ".join(parts) + size
        else:
            out[(r.family, r.contrast)] = "not compared (no default rerun)"
    return out


def _size_note(long: pd.DataFrame) -> str:
    """What the comparison's size allows: smoke reruns, or fewer seeds than the plan's
    (`planned`, a declared subset), say so; with n seeds and 2 / 2^n > 0.05 no decision can
    change, only signs."""
    n = int(long["n"].min())
    signs = ": signs only" if 2.0 / 2 ** n > 0.05 else ""
    if "campaign" in long and long["campaign"].astype(str).str.endswith(SMOKE).any():
        return f" (smoke reruns, n = {n}: signs only)"
    planned = int(long["planned"].max()) if "planned" in long else n
    return f" (n = {n} of the plan's {planned} seeds{signs})" if n < planned else ""


@lru_cache(maxsize=64)
def _question_of(plan: str, plan_dir) -> str:
    """A plan's question, lower case (its `question` key; the plan is not validated here)."""
    import yaml

    path = Path(plan_dir or prereg.PLAN_DIR) / f"{plan}.yaml"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return str(yaml.load(path.read_text(), Loader=loader)["question"]).lower()


def _spec_entries(spec: dict, plan_dir, key: str = "families") -> dict[tuple[str, str], dict]:
    """{(plan question, family): entry} of the families the sensitivity study reruns (or,
    key `not_rerun`, those it cannot rerun, each with why)."""
    return {(_question_of(e["plan"], plan_dir), e["family"]): e for e in spec.get(key) or ()}


@lru_cache(maxsize=1)
def _alternatives() -> dict:
    from analysis.studies.sensitivity import load_alternatives

    return load_alternatives()


def alternative_effects(con, plan: str, family: str, plan_dir=None,
                        spec: dict | None = None) -> pd.DataFrame:
    """The sensitivity long table of one family (analysis.studies.sensitivity.evaluate):
    every primary contrast's effect and decision under each alternative with runs, and as
    `default` on the page's own runs at the same seeds."""
    return _effects(_sensitivity_runs(con), plan, family, plan_dir, spec or _alternatives())


def _sensitivity_runs(con) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(every complete run: the pages' own and the reruns; the study's record)."""
    from analysis.studies.sensitivity import load_inputs

    return load_inputs(con)


def _effects(inputs, plan: str, family: str, plan_dir, spec: dict) -> pd.DataFrame:
    from analysis.studies.sensitivity import evaluate

    runs, record = inputs
    if runs.empty:
        return pd.DataFrame()
    return evaluate(runs, {**spec, "families": [{"plan": plan, "family": family}]},
                    plan_dir, record)[0]


def add_flip_columns(families, con, plan_dir=None, spec: dict | None = None) -> None:
    """Add COLUMN to the primary estimand's table of every primary family in `families`
    (FamilyResult objects of one page), from the sensitivity runs in `con`'s ledgers."""
    primary = [f for f in families if f.role == "primary" and f.primary in f.tables]
    if not primary:
        return
    spec = spec or _alternatives()
    listed = _spec_entries(spec, plan_dir)
    unrun = _spec_entries(spec, plan_dir, "not_rerun")
    runs = None  # the sensitivity runs, read once for the page's families
    for fam in primary:
        name = fam.name.split(" (")[0]
        table = fam.tables.get(fam.primary)
        if table is None or table.empty or "test" not in table:
            continue
        key = (str(fam.question).lower(), name)
        if key in unrun:
            table[COLUMN] = NOT_RERUN + " ".join(str(unrun[key]["why"]).split())
            continue
        if key not in listed:
            table[COLUMN] = NOT_LISTED
            continue
        plan = listed[key]["plan"]
        try:  # a family the study cannot evaluate must not take its page down
            runs = _sensitivity_runs(con) if runs is None else runs
            long = _effects(runs, plan, name, plan_dir, spec)
        except Exception as exc:  # noqa: BLE001 - named in the column instead
            table[COLUMN] = f"not compared ({type(exc).__name__}: {exc})"
            continue
        texts = flip_texts(long) if not long.empty else {}
        table[COLUMN] = [texts.get((name, t), NOT_RUN) for t in table["test"]]
