"""Preregistered analysis plans (conf/prereg/<q>.yaml) and the ledger check against them.

A plan declares, per family, its role, estimands, seeds, cells (run-column
values such as org, budget, cap, rate, q, f, reuse), tests and decision rule.
A cell names every design column (plan-level `defaults`, then the family's, then
its own), so a run matches a cell only when all of them agree; `campaign` may be
a list when the cell's seeds were collected by more than one campaign (a run
reused from another campaign keeps that campaign's name).
The plan hash is sha256 of the plan's canonical JSON (sorted keys, no
whitespace), so comments and layout do not change it; the runner stamps it into
every run. `check_family` refuses a family whose cells or seeds are missing,
duplicated among adopted runs, or were collected under a different plan hash
(unless `allow_changed_plan`), and names exactly what is wrong.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from ledgers.arms import ARMS, LEDGER_ORGS
from ledgers.plans import (  # noqa: F401 (re-exported)
    PLAN_DIR,
    canonical_json,
    plan_hash,
    safe_loader,
)

PLAN_HASH_COLUMN = "prereg_plan_hash"  # ledgers/schemas.py runs column
FAMILY_ROLES = ("primary", "secondary", "gate")
ESTIMAND_ROLES = ("primary", "secondary", "sensitivity")
TEST_KINDS = ("paired", "interaction", "containment")
PREDICTIONS = ("positive", "negative", "none")
ORG_VALUES = LEDGER_ORGS  # runs.org values a plan's cell may name (ledgers.arms)
REUSE_VALUES = ("share", "isolate")
CELL_REQUIRED_KEYS = ("org", "budget", "cap", "rate", "arrival", "q", "f", "reuse", "pinning_k",
                      "trace", "model", "executor")
# Org-specific design columns: required for that org, sentinel for the others.
ORG_REQUIRED_KEYS = {
    **{a.ledger_org: ("d0_attention_fraction",) for a in ARMS.values() if a.org == "D0"},
    **{a.ledger_org: ("retention_k",) for a in ARMS.values() if a.retention},
}
STATISTICS = ("log_ratio", "relative_pct")
TEST_INTERVALS = ("none",)  # a test's own `intervals` (absent: the family's decision says)
# Decision methods and the fields each needs besides `method` and `rule`.
DECISION_FIELDS = {
    "sign_flip_holm": (),
    "paired_t_interval": ("confidence",),
    "containment": ("margin_pct", "confidence"),
    "descriptive": (),
}
# The cells each test kind compares, by role.
TEST_CELL_ROLES = {
    "paired": ("treatment", "control"),
    "interaction": ("a.treatment", "a.control", "b.treatment", "b.control"),
    "containment": ("probe_on", "probe_off"),
}
_SCALARS = (str, int, float, bool)


# ---------------------------------------------------------------------------
# Plan objects
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One experimental condition: run-column values (`keys`) and its seeds."""

    id: str
    keys: Mapping[str, Any]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class Estimand:
    name: str
    metric: str
    role: str


@dataclass(frozen=True)
class PlannedTest:
    """A declared comparison; `cells` maps a role ("treatment", "a.control", ...) to a cell id."""

    id: str
    kind: str
    cells: Mapping[str, str]
    predicted: str
    label: str = ""  # the paper's name of the contrast (legacy ID or row), "" if none
    intervals: str = ""  # "none": this row shows no interval although the family's do


def _named(items, attr: str, value: str, field_name: str, context: str):
    """The item whose `attr` is `value`; ValueError `field=value: context [the values]`."""
    for item in items:
        if getattr(item, attr) == value:
            return item
    raise ValueError(f"{field_name}={value!r}: {context} {[getattr(i, attr) for i in items]}")


@dataclass(frozen=True)
class Family:
    name: str
    role: str
    alpha: float
    seeds: tuple[int, ...]
    cells: tuple[Cell, ...]
    estimands: tuple[Estimand, ...]
    tests: tuple[PlannedTest, ...]
    decision: Mapping[str, Any]

    def cell(self, cell_id: str) -> Cell:
        return _named(self.cells, "id", cell_id, "cell", f"family {self.name!r} has cells")

    @property
    def primary_estimand(self) -> Estimand:
        return next(e for e in self.estimands if e.role == "primary")


@dataclass(frozen=True)
class Plan:
    question: str
    campaign: str
    alpha: float
    families: tuple[Family, ...]
    plan_hash: str
    raw: Mapping[str, Any] = field(repr=False)
    path: Path | None = None

    def family(self, name: str) -> Family:
        return _named(self.families, "name", name, "family", f"{self.question} declares")

    @property
    def primary_family(self) -> Family:
        return next(f for f in self.families if f.role == "primary")


# ---------------------------------------------------------------------------
# Hashing and loading
# ---------------------------------------------------------------------------


# canonical_json and plan_hash live in ledgers.plans (the runner hashes plans the same way).


READINGS_FILE = "readings.yaml"  # the AMBIGUOUS register's chosen readings (not a plan)
READING_FIELDS = ("item", "reading", "alternative", "where")


def load_readings(plan_dir: str | Path = PLAN_DIR) -> list[dict[str, str]]:
    """The reading chosen for each AMBIGUOUS item (A1, A2, ...), in register order."""
    import yaml

    path = Path(plan_dir) / READINGS_FILE
    if not path.is_file():
        return []
    raw = yaml.load(path.read_text(encoding="utf-8"), Loader=safe_loader()) or {}
    rows = []
    for key, entry in raw.items():
        missing = [f for f in READING_FIELDS if not str((entry or {}).get(f, "")).strip()]
        if missing:
            raise ValueError(f"{path.name}: {key}: missing {', '.join(missing)}")
        rows.append({"id": str(key), **{f: str(entry[f]) for f in READING_FIELDS}})
    return sorted(rows, key=lambda r: int(r["id"].lstrip("A")))


def load_plan(name_or_path: str | Path, plan_dir: str | Path = PLAN_DIR) -> Plan:
    """Load "q1" (from `plan_dir`) or a path to a plan YAML, validated (cached while the
    file is unchanged)."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = Path(plan_dir) / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"plan={str(name_or_path)!r}: no plan file at {path}")
    stat = path.stat()
    return _load_file(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=128)
def _load_file(path: str, _mtime_ns: int, _size: int) -> Plan:
    with open(path, encoding="utf-8") as fh:
        raw = yaml.load(fh, Loader=safe_loader())
    return parse_plan(raw, Path(path))


def parse_plan(raw: Any, path: Path | None = None) -> Plan:
    """Validate a plan mapping and build its objects; ValueError names the bad field."""
    where = str(path) if path else "plan"
    top = _mapping(raw, where)
    question = _string(top, "question", where)
    campaign = _string(top, "campaign", where)
    alpha = _alpha(top.get("alpha"), f"{where}: alpha")
    plan_defaults = _scalar_mapping(top.get("defaults", {}), f"{where}: defaults",
                                    allow=("campaign",))
    families = [_family(f, i, campaign, alpha, plan_defaults, where)
                for i, f in enumerate(_nonempty_list(top, "families", where))]
    names = [f.name for f in families]
    _unique(names, f"{where}: families[].name")
    primaries = [f.name for f in families if f.role == "primary"]
    if len(primaries) != 1:
        raise ValueError(f"{where}: exactly one family needs role 'primary', got {primaries}")
    return Plan(question, campaign, alpha, tuple(families), plan_hash(top), top, path)


def _family(raw: Any, index: int, campaign: str, plan_alpha: float, plan_defaults: Mapping,
            where: str) -> Family:
    top = _mapping(raw, f"{where}: families[{index}]")
    name = _string(top, "name", f"{where}: families[{index}]")
    at = f"{where}: family {name!r}"
    role = _choice(top.get("role"), FAMILY_ROLES, f"{at}: role")
    alpha = _alpha(top["alpha"], f"{at}: alpha") if "alpha" in top else plan_alpha
    seeds = _seeds(top.get("seeds"), f"{at}: seeds")
    defaults = {**plan_defaults, **_scalar_mapping(top.get("defaults", {}), f"{at}: defaults",
                                                   allow=("campaign",))}
    cells = [_cell(c, i, defaults, seeds, campaign, at)
             for i, c in enumerate(_nonempty_list(top, "cells", at))]
    _unique([c.id for c in cells], f"{at}: cells[].id")
    estimands = [_estimand(e, i, at) for i, e in enumerate(_nonempty_list(top, "estimands", at))]
    _unique([e.name for e in estimands], f"{at}: estimands[].name")
    if [e.role for e in estimands].count("primary") != 1:
        raise ValueError(f"{at}: exactly one estimand needs role 'primary'")
    decision = _decision(top.get("decision"), f"{at}: decision")
    cells_by_id = {c.id: c for c in cells}
    tests = [_test(t, i, cells_by_id, at) for i, t in enumerate(top.get("tests") or [])]
    _unique([t.id for t in tests], f"{at}: tests[].id")
    if not tests and decision["method"] != "descriptive":
        raise ValueError(f"{at}: tests may be empty only when decision.method is 'descriptive'")
    return Family(name, role, alpha, seeds, tuple(cells), tuple(estimands), tuple(tests),
                  decision)


def _cell(raw: Any, index: int, defaults: Mapping, seeds: tuple[int, ...], campaign: str,
          at: str) -> Cell:
    own = _scalar_mapping(raw, f"{at}: cells[{index}]", allow=("seeds", "campaign"))
    cell_id = _string(own, "id", f"{at}: cells[{index}]")
    where = f"{at}: cell {cell_id!r}"
    keys = {"campaign": campaign, **defaults,
            **{k: v for k, v in own.items() if k not in ("id", "seeds")}}
    missing = [k for k in CELL_REQUIRED_KEYS if k not in keys]
    if missing:
        raise ValueError(f"{where}: missing keys {missing}; every cell needs "
                         f"{list(CELL_REQUIRED_KEYS)}")
    _choice(keys["org"], ORG_VALUES, f"{where}: org")
    _choice(keys["reuse"], REUSE_VALUES, f"{where}: reuse")
    own_keys = ORG_REQUIRED_KEYS.get(str(keys["org"]), ())
    absent = [k for k in own_keys if k not in keys]
    if absent:
        raise ValueError(f"{where}: org {keys['org']} needs keys {absent}")
    keys = {k: v for k, v in keys.items()
            if k not in _ORG_SPECIFIC or k in own_keys}  # family defaults for other orgs
    keys["campaign"] = _campaigns(keys["campaign"], f"{where}: campaign")
    cell_seeds = _seeds(own["seeds"], f"{where}: seeds") if "seeds" in own else seeds
    return Cell(cell_id, keys, cell_seeds)


_ORG_SPECIFIC = {k for keys in ORG_REQUIRED_KEYS.values() for k in keys}


def _campaigns(value: Any, where: str) -> str | tuple[str, ...]:
    """A campaign name, or a tuple of names (a cell whose seeds span campaigns)."""
    if isinstance(value, str) and value:
        return value
    if (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        _unique(list(value), where)
        return tuple(value)
    raise ValueError(f"{where}: expected a campaign name or a list of names, got {value!r}")


def cell_campaigns(cell: Cell) -> tuple[str, ...]:
    value = cell.keys["campaign"]
    return (value,) if isinstance(value, str) else tuple(value)


def _estimand(raw: Any, index: int, at: str) -> Estimand:
    top = _mapping(raw, f"{at}: estimands[{index}]")
    where = f"{at}: estimands[{index}]"
    return Estimand(_string(top, "name", where), _string(top, "metric", where),
                    _choice(top.get("role"), ESTIMAND_ROLES, f"{where}: role"))


def _decision(raw: Any, where: str) -> dict[str, Any]:
    top = dict(_mapping(raw, where))
    method = _choice(top.get("method"), tuple(DECISION_FIELDS), f"{where}: method")
    missing = [k for k in (*DECISION_FIELDS[method], "rule") if k not in top]
    if missing:
        raise ValueError(f"{where}: method {method!r} needs fields {missing}")
    for key in ("statistic", "sensitivity_statistic"):
        if key in top:
            _choice(top[key], STATISTICS, f"{where}: {key}")
    if "first_look_seeds" in top:
        _seeds(top["first_look_seeds"], f"{where}: first_look_seeds")
    if "bootstrap" in top:
        boot = _mapping(top["bootstrap"], f"{where}: bootstrap")
        for key in ("resamples", "seed"):
            value = boot.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: bootstrap.{key}={value!r}: expected an integer >= 0")
    for key, low, high in (("confidence", 0.0, 1.0), ("margin_pct", 0.0, float("inf"))):
        value = top.get(key)
        if key in top and (isinstance(value, bool) or not isinstance(value, (int, float))
                           or not low < value < high):
            raise ValueError(f"{where}: {key}={value!r}: allowed values are {low} < x < {high}")
    return top


def _test(raw: Any, index: int, cells: Mapping[str, Cell], at: str) -> PlannedTest:
    top = _mapping(raw, f"{at}: tests[{index}]")
    test_id = _string(top, "id", f"{at}: tests[{index}]")
    where = f"{at}: test {test_id!r}"
    kind = _choice(top.get("kind"), TEST_KINDS, f"{where}: kind")
    predicted = _choice(top.get("predicted", "none"), PREDICTIONS, f"{where}: predicted")
    label = top.get("label", "")
    if not isinstance(label, str):
        raise ValueError(f"{where}: label={label!r} must be a string")
    intervals = (_choice(top["intervals"], TEST_INTERVALS, f"{where}: intervals")
                 if "intervals" in top else "")
    refs = {}
    for role in TEST_CELL_ROLES[kind]:
        node: Any = top
        for part in role.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, str) or node not in cells:
            raise ValueError(f"{where}: {role}={node!r} is not a cell of the family; "
                             f"allowed values are {sorted(cells)}")
        refs[role] = node
    seed_sets = {frozenset(cells[c].seeds) for c in refs.values()}
    if len(seed_sets) != 1:
        raise ValueError(f"{where}: compared cells {sorted(set(refs.values()))} must share "
                         f"their seeds (arms are paired by seed)")
    return PlannedTest(test_id, kind, refs, predicted, label, intervals)


# Small typed readers: each names the field and the allowed values on failure.


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
    bad = [k for k in raw if not isinstance(k, str)]
    if bad:  # YAML 1.1 reads bare on/off/yes/no keys as booleans
        raise ValueError(f"{where}: keys must be strings, got {bad!r} (quote on/off/yes/no)")
    return raw


def _string(top: Mapping, key: str, where: str) -> str:
    value = top.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise ValueError(f"{where}={value!r}: allowed values are {allowed}")
    return value


def _alpha(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{where}={value!r}: allowed values are 0 < alpha < 1")
    return float(value)


def _seeds(value: Any, where: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in value)):
        raise ValueError(f"{where}: expected a non-empty list of integer seeds, got {value!r}")
    _unique(value, where)
    return tuple(value)


def _nonempty_list(top: Mapping, key: str, where: str) -> list:
    value = top.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {key} must be a non-empty list")
    return value


def _scalar_mapping(raw: Any, where: str, allow: tuple[str, ...] = ()) -> dict[str, Any]:
    top = _mapping(raw, where)
    for k, v in top.items():
        if k not in allow and not isinstance(v, _SCALARS):
            raise ValueError(f"{where}: {k}={v!r} must be a string, number or boolean")
    return dict(top)


def _unique(values: list, where: str) -> None:
    seen, dups = set(), []
    for v in values:
        if v in seen:
            dups.append(v)
        seen.add(v)
    if dups:
        raise ValueError(f"{where}: duplicated values {dups}")


# ---------------------------------------------------------------------------
# Expected runs and the ledger check
# ---------------------------------------------------------------------------


def expected_runs(plan: Plan, family: str | Family) -> pd.DataFrame:
    """One row per (cell, seed) the family needs: cell_id, seed and the cell's keys.

    A test oracle: the tests read a plan's design through it (tests/test_campaign_plans.py
    checks it against hand-counted runs and the campaigns' cells); the analyses go through
    `check_family`."""
    fam = plan.family(family) if isinstance(family, str) else family
    rows = [{"cell_id": c.id, "seed": s, **c.keys} for c in fam.cells for s in c.seeds]
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class MissingRuns:
    cell_id: str
    keys: Mapping[str, Any]
    seeds: tuple[int, ...]

    def describe(self) -> str:
        keys = ", ".join(f"{k}={v}" for k, v in self.keys.items())
        return f"{self.cell_id} ({keys}) seeds {list(self.seeds)}"


@dataclass(frozen=True)
class DuplicatedRuns:
    cell_id: str
    seed: int
    count: int


@dataclass(frozen=True)
class ChangedPlan:
    """Runs of `campaign` stamped with `run_hash` where the plan now hashes to `expected_hash`."""

    campaign: str
    run_hash: str
    expected_hash: str
    num_runs: int


@dataclass(frozen=True, eq=False)
class FamilyCheck:
    """Outcome of checking runs against one family.

    `runs` holds the matched adopted complete runs with a `cell_id` column.
    A changed plan is accepted only with `allow_changed_plan`, and
    `plan_changed` then stays True so a report can state it.
    """

    question: str
    family: str
    plan_hash: str
    num_expected: int
    missing: tuple[MissingRuns, ...]
    duplicated: tuple[DuplicatedRuns, ...]
    changed: tuple[ChangedPlan, ...]
    allow_changed_plan: bool
    runs: pd.DataFrame = field(repr=False)

    @property
    def plan_changed(self) -> bool:
        return bool(self.changed)

    @property
    def accepted(self) -> bool:
        return (not self.missing and not self.duplicated
                and (not self.plan_changed or self.allow_changed_plan))

    def reasons(self) -> list[str]:
        out = [f"missing runs: {m.describe()}" for m in self.missing]
        out += [f"duplicated adopted runs: {d.cell_id} seed {d.seed} x{d.count}"
                for d in self.duplicated]
        verdict = "accepted (allow_changed_plan)" if self.allow_changed_plan else "refused"
        out += [f"plan changed after collection ({verdict}): {c.num_runs} {c.campaign} runs "
                f"carry plan hash {c.run_hash}, the plan now hashes to {c.expected_hash}"
                for c in self.changed]
        return out


def check_family(
    plan: Plan,
    family: str | Family,
    runs: pd.DataFrame,
    *,
    allow_changed_plan: bool = False,
    plan_hash_column: str = PLAN_HASH_COLUMN,
) -> FamilyCheck:
    """Match adopted complete runs to the family's cells and seeds, and check plan hashes.

    Runs count when `status` is "complete" and `adopted` is true (where those
    columns exist). A run collected under another campaign's plan (a cell with
    `campaign: q1` in the Q4 plan) is checked against that campaign's plan.
    """
    fam = plan.family(family) if isinstance(family, str) else family
    usable = _usable_runs(runs, fam, plan_hash_column)
    missing, duplicated, rows, ids = [], [], [], []
    columns = _Columns(usable)
    seeds = pd.to_numeric(usable["seed"], errors="coerce").to_numpy()
    for cell in fam.cells:
        index = np.flatnonzero(_cell_mask(usable, cell, columns))
        counts = Counter(int(s) for s in seeds[index] if not np.isnan(s))
        absent = tuple(s for s in cell.seeds if s not in counts)
        if absent:
            missing.append(MissingRuns(cell.id, dict(cell.keys), absent))
        duplicated += [DuplicatedRuns(cell.id, s, counts[s])
                       for s in cell.seeds if counts.get(s, 0) > 1]
        keep = index[np.isin(seeds[index], cell.seeds)]
        rows.append(keep)
        ids += [cell.id] * len(keep)
    taken = np.concatenate(rows) if rows else np.zeros(0, dtype=int)
    found = usable.iloc[taken].assign(cell_id=ids).reset_index(drop=True)
    changed = _changed_plans(plan, found, plan_hash_column)
    return FamilyCheck(plan.question, fam.name, plan.plan_hash,
                       sum(len(c.seeds) for c in fam.cells), tuple(missing), tuple(duplicated),
                       changed, bool(allow_changed_plan), found)


def _usable_runs(runs: pd.DataFrame, fam: Family, hash_column: str) -> pd.DataFrame:
    """Complete, adopted runs; an empty table matches nothing, a table missing columns fails."""
    if len(runs) == 0:
        columns = ["seed", "campaign", hash_column]
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    needed = {"seed", "campaign", hash_column} | {k for c in fam.cells for k in c.keys}
    absent = sorted(needed - set(runs.columns))
    if absent:
        raise ValueError(f"runs: missing columns {absent} needed by family {fam.name!r}")
    keep = pd.Series(True, index=runs.index)
    if "status" in runs.columns:
        keep &= runs["status"].astype(str) == "complete"
    if "adopted" in runs.columns:
        keep &= runs["adopted"].map(lambda v: isinstance(v, (bool, np.bool_)) and bool(v))
    return runs[keep]


@functools.lru_cache(maxsize=1024)
def _budget_label(value: Any) -> str:
    """Canonical budget label ("254 pages" -> "p254"); unparsable text is kept as is."""
    from serving_core.planner import parse_budget

    try:
        return parse_budget(str(value)).label
    except ValueError:
        return str(value).strip().casefold()


class _Columns:
    """The runs' design columns normalized once per check: numbers as floats, budgets as
    planner labels, other text stripped and case-folded, booleans as booleans."""

    def __init__(self, runs: pd.DataFrame):
        self.runs = runs
        self.cache: dict[tuple[str, str], np.ndarray] = {}

    def get(self, key: str, kind: str) -> np.ndarray:
        if (key, kind) not in self.cache:
            col = self.runs[key]
            if kind == "bool":
                value = col.map(lambda v: bool(v) if isinstance(v, (bool, np.bool_)) else None)
            elif kind == "number":
                value = pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)
            elif key == "budget":
                value = col.map(_budget_label)
            else:
                value = col.astype(str).str.strip().str.casefold()
            self.cache[(key, kind)] = np.asarray(value)
        return self.cache[(key, kind)]


def _cell_mask(runs: pd.DataFrame, cell: Cell, columns: _Columns | None = None) -> np.ndarray:
    """Runs whose columns equal the cell's keys.

    Numbers compare with a 1e-9 relative tolerance (3 == 3.0), a tuple of campaigns matches
    any of them, strings ignore case (org "s2" == "S2", reuse "SHARE" == "share"), budgets
    compare by canonical planner label.
    """
    columns = columns or _Columns(runs)
    mask = np.ones(len(runs), dtype=bool)
    for key, value in cell.keys.items():
        if key not in runs.columns:
            return np.zeros(len(runs), dtype=bool)
        if isinstance(value, tuple):  # campaign: any of these names
            mask &= np.isin(columns.get(key, "text"), [v.casefold() for v in value])
        elif isinstance(value, bool):
            mask &= columns.get(key, "bool") == value
        elif isinstance(value, (int, float)):
            mask &= np.isclose(columns.get(key, "number"), float(value), rtol=1e-9, atol=1e-12)
        elif key == "budget":
            mask &= columns.get(key, "text") == _budget_label(value)
        else:
            mask &= columns.get(key, "text") == str(value).casefold()
    return mask


def home_campaign(campaign: str) -> str:
    """The campaign whose plan a smoke (`q1_smoke`) or demo (`demo_q1`) campaign ran under."""
    campaign = campaign.removesuffix("_smoke")
    return campaign.removeprefix("demo_")


def _plan_name(campaign: str, rows: pd.DataFrame, plan_dir: Path) -> str:
    """The plan a campaign's runs were stamped with: the campaign's own plan file, else (a
    campaign named for a workload, e.g. traces_conversation) the question its runs ran."""
    home = home_campaign(campaign)
    questions = rows["question"].dropna().astype(str).unique() if "question" in rows else ()
    if (Path(plan_dir) / f"{home}.yaml").is_file() or len(questions) != 1:
        return home
    return str(questions[0])


def _changed_plans(plan: Plan, found: pd.DataFrame, hash_column: str) -> tuple[ChangedPlan, ...]:
    """Run hashes that differ from the plan of the campaign each run was collected in."""
    changed = []
    plan_dir = plan.path.parent if plan.path else PLAN_DIR
    for campaign, rows in found.groupby("campaign", sort=True):
        campaign = str(campaign)
        expected = (plan.plan_hash if campaign == plan.campaign
                    else load_plan(_plan_name(campaign, rows, plan_dir), plan_dir).plan_hash)
        hashes = rows[hash_column].map(lambda h: "<none>" if pd.isna(h) or h == "" else str(h))
        changed += [ChangedPlan(campaign, h, expected, int(k))
                    for h, k in sorted(hashes.value_counts().items()) if h != expected]
    return tuple(changed)


def run_order_violations(runs: pd.DataFrame, order_column: str = "created_at") -> list[str]:
    """Departures of a family's runs from a balanced order (the plan's `run_order: balanced`).

    Within each seed the conditions run in the order their runs were written; over every
    block of n consecutive seeds (n conditions) each condition must take each position
    once, and in a last, partial block no position twice (a Williams design, cycled, as
    the campaign's `balanced` order plans it). The write order is the completion order:
    a campaign whose order matters runs with one job at a time.
    """
    if runs.empty or order_column not in runs:
        return []
    seeds = sorted(int(s) for s in runs["seed"].unique())
    cells = sorted(runs["cell_id"].unique())
    n = len(cells)
    orders = {s: tuple(runs[runs["seed"] == s].sort_values(order_column)["cell_id"])
              for s in seeds}
    problems = []
    for start in range(0, len(seeds), n):
        block = seeds[start:start + n]
        for pos in range(n):
            taken = [orders[s][pos] for s in block if pos < len(orders[s])]
            repeated = sorted({c for c in taken if taken.count(c) > 1})
            if repeated:
                problems.append(f"seeds {block[0]}-{block[-1]}: position {pos + 1} is taken "
                                f"more than once by {repeated}")
    return problems
