"""Rerun the primary families under alternative engine rules (make sensitivity).

Some engine rules cannot be identified from the calibration anchors (slab policy, admission
gate, checkpoint placement, the free queue, checkpoint recency). For each alternative of
conf/sensitivity/alternatives.yaml and each primary family listed there (every page's; Q1's
EXT-22 also decides Q4's D0/S2 rows; `--families` picks some), every cell of the family's
preregistered plan (conf/prereg/<plan>.yaml) is run at its seeds with the alternative's
overrides, into campaign `sens_<alternative>` (`sens_<alternative>_smoke` at smoke size:
the first seeds and fewer requests), question `sensitivity`. The `default` alternative's
runs are the page's own: they go to the cell's home campaign (`<home>_smoke` at smoke
size) under that campaign's question, exactly as `make <home>` would run them, so each
alternative is paired by seed with the runs the page reports. A run under an alternative
whose engine asks for the same rules as the default's (`EngineSpec.requested_rules()`:
e.g. a slab policy for an organization without slabs) is not run: the page's own run
stands for it (outcome `as_default`). Runs go through experiments.run (complete runs are
skipped, the ledgers written as for any run); the study's own record, one row per run (its
alternative, plan cell, seed, campaign, run id and outcome), goes to the `sensitivity_runs`
study table (ledgers.studies), written after each family's seed (every alternative), so a
stopped study resumes where it stopped and has whole seeds.
`analysis.studies.sensitivity` then evaluates the families.

    python -m experiments.studies.sensitivity --ledgers ROOT [--smoke] [--alternatives a,b]
        [--families F,G] [--seeds N] [--requests N]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from experiments.studies import study_parser
from ledgers.studies import new_study_id, now_iso, rows_to_columns, write_study

ROOT = Path(__file__).resolve().parents[2]
ALTERNATIVES_YAML = ROOT / "conf" / "sensitivity" / "alternatives.yaml"
PREREG_DIR = ROOT / "conf" / "prereg"
QUESTION = "sensitivity"
CAMPAIGN_PREFIX = "sens_"
SMOKE_SUFFIX = "_smoke"
TABLE = "sensitivity_runs"  # study table (ledgers.studies); page analysis/studies/
# Plan cell keys (conf/prereg) -> Hydra overrides of one run.
CELL_KEYS = {"org": "org", "budget": "budget", "cap": "engine.cap", "rate": "load.rate",
             "q": "workload.q", "f": "engine.headroom", "pinning_k": "engine.pinning_k",
             "reuse": "workload.reuse", "arrival": "load.arrival", "trace": "trace",
             "model": "model", "d0_attention_fraction": "model.d0_attention_fraction",
             "retention_k": "retention.k", "host_tier_bytes": "host_tier.capacity_bytes",
             "placement": "engine.checkpoint_placement"}
# campaign: replaced by the sensitivity campaign; seeds: a cell's own seeds (family_cells)
IGNORED_KEYS = ("campaign", "seeds")
NOT_APPLICABLE = -1  # a plan's retention_k or host_tier_bytes of a cell without one
EXECUTORS = {"sim:a100-calibrated": "a100"}
DEFAULT = "default"  # the alternative whose runs are the page's own


@dataclass(frozen=True)
class Alternative:
    name: str
    overrides: tuple[str, ...]
    why: str
    by_org: tuple[tuple[str, tuple[str, ...]], ...] = ()  # more overrides for one org's runs

    def for_org(self, org: str) -> tuple[str, ...]:
        return (*self.overrides, *dict(self.by_org).get(str(org).lower(), ()))


@dataclass(frozen=True)
class Job:
    """One run of the study: which alternative, plan cell and seed, and its overrides
    (`base`: the cell's own, without the alternative's and the bookkeeping)."""

    alternative: Alternative
    plan: str
    family: str
    cell: str
    seed: int
    campaign: str
    overrides: tuple[str, ...]
    base: tuple[str, ...] = ()


def campaign_name(alternative: str, smoke: bool) -> str:
    return f"{CAMPAIGN_PREFIX}{alternative}{SMOKE_SUFFIX if smoke else ''}"


def load_alternatives(path: Path = ALTERNATIVES_YAML) -> tuple[dict, dict[str, Alternative]]:
    """(the file's mapping, {name: Alternative}) in file order, the identified combinations
    (conf/calibration/identified.yaml, ledgers.alternatives) after the declared ones."""
    from ledgers.alternatives import load_alternatives as load_merged

    raw = load_merged(path)
    alts = {name: Alternative(name, tuple(spec.get("overrides") or ()), str(spec.get("why", "")),
                              tuple((org, tuple(v)) for org, v in
                                    (spec.get("by_org") or {}).items()))
            for name, spec in raw["alternatives"].items()}
    if "default" not in alts:
        raise ValueError(f"{path}: alternatives must include `default` (today's rules)")
    return raw, alts


def _override_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


@lru_cache(maxsize=64)
def _plan_yaml(path: Path) -> dict:
    """A plan file, parsed once per process (planning reads each for every alternative)."""
    return yaml.safe_load(path.read_text())


def family_cells(plan_name: str, family: str, plan_dir: Path = PREREG_DIR) -> list[dict]:
    """[{id, keys, seeds}] of one family: the plan's defaults, the family's, then the cell's
    own keys (the merge order conf/prereg documents)."""
    plan = _plan_yaml(Path(plan_dir) / f"{plan_name}.yaml")
    fams = [f for f in plan["families"] if f["name"] == family]
    if not fams:
        raise ValueError(f"conf/prereg/{plan_name}.yaml has no family {family!r}")
    fam = fams[0]
    out = []
    for cell in fam["cells"]:
        keys = {"campaign": plan["campaign"], **plan.get("defaults", {}),
                **fam.get("defaults", {}), **cell}
        keys.pop("id")
        out.append({"id": cell["id"], "keys": keys,
                    "seeds": list(cell.get("seeds", fam["seeds"]))})
    return out


def page_campaign(keys: dict, smoke: bool) -> tuple[str, str]:
    """(campaign, question) of a cell's own runs: its home campaign, `_smoke` at smoke
    size, and the question conf/campaign/<home>.yaml gives its runs. A cell several
    campaigns collect (bursts' and ORIG-5's [q5, bursts]) goes to the first, where another
    family (Q5's) collects the same run: one run per seed, not one in each campaign, which
    the plan check would drop as duplicated."""
    value = keys["campaign"]
    home = value if isinstance(value, str) else list(value)[0]
    conf = _plan_yaml(ROOT / "conf" / "campaign" / f"{home}.yaml")
    return f"{home}{SMOKE_SUFFIX if smoke else ''}", str(conf["question"])


def cell_overrides(keys: dict) -> list[str]:
    """Hydra overrides reproducing a plan cell; refuses keys it cannot map."""
    out = []
    for key, value in keys.items():
        if key in IGNORED_KEYS:
            continue
        if key == "executor":
            if value not in EXECUTORS:
                raise ValueError(f"cell executor {value!r}: allowed {', '.join(EXECUTORS)}")
            out.append(f"executor={EXECUTORS[value]}")
            continue
        if key not in CELL_KEYS:
            raise ValueError(f"cell key {key!r} has no run override "
                             f"(known: {', '.join(CELL_KEYS)})")
        if key == "d0_attention_fraction" and str(keys.get("org", "")).upper() != "D0":
            continue
        if key == "retention_k" and value == NOT_APPLICABLE:
            continue
        if key == "host_tier_bytes" and value == NOT_APPLICABLE:
            value = None
        value = str(value).lower() if key == "org" else value
        out.append(f"{CELL_KEYS[key]}={_override_value(value)}")
    return out


def planned_jobs(alternatives: list[Alternative], families: list[dict], *, smoke: bool,
                 seeds: int | None, requests: int | None) -> list[Job]:
    """Every run: alternative x family cell x seed."""
    jobs = []
    for alt in alternatives:
        for fam in families:
            for cell in family_cells(fam["plan"], fam["family"]):
                campaign, question = ((campaign_name(alt.name, smoke), QUESTION)
                                      if alt.name != DEFAULT else
                                      page_campaign(cell["keys"], smoke))
                chosen = cell["seeds"][:seeds] if seeds else cell["seeds"]
                for seed in chosen:
                    size = [f"workload.num_requests={requests}"] if requests else []
                    job = [*cell_overrides(cell["keys"]),
                           *alt.for_org(cell["keys"].get("org", "")),
                           f"campaign_name={campaign}", f"question={question}", f"seed={seed}",
                           *size]
                    base = (*cell_overrides(cell["keys"]), f"seed={seed}", *size)
                    jobs.append(Job(alt, fam["plan"], fam["family"], cell["id"], int(seed),
                                    campaign, tuple(job), base))
    return jobs


def run_jobs(jobs: list[Job], ledger_root: Path, progress: bool = True) -> list[dict]:
    """Run (or skip as complete) every job through experiments.run; one `sensitivity_runs`
    row per job (run id and outcome). A job whose engine asks for the default's rules is
    not run (`as_default`: the page's own run of its cell and seed stands for it)."""
    from hydra import compose, initialize_config_dir
    from tqdm import tqdm

    from experiments.run import main_run

    rows = []
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        for job in tqdm(jobs, desc="sensitivity runs", disable=not progress, file=sys.stderr):
            cfg = compose(config_name="config",
                          overrides=[*job.overrides, f"ledger_root={ledger_root}"])
            if job.alternative.name != DEFAULT and _asks_default_rules(cfg, job.base):
                line, outcome = {"run_id": ""}, "as_default"
            else:
                with contextlib.redirect_stdout(io.StringIO()):
                    line = main_run(cfg)
                outcome = "skipped" if line.get("skipped") else "ran"
            rows.append({"alternative": job.alternative.name,
                         "alternative_overrides": json.dumps(list(job.alternative.overrides)),
                         "plan": job.plan, "family": job.family, "cell": job.cell,
                         "seed": job.seed, "campaign": job.campaign, "run_id": line["run_id"],
                         "outcome": outcome})
    return rows


@lru_cache(maxsize=512)
def _default_engine(base: tuple[str, ...]) -> str:
    from hydra import compose

    return _engine_identity(compose(config_name="config", overrides=list(base)))


def _engine_identity(cfg) -> str:
    """What decides a run apart from its bookkeeping: the rules its engine asks for
    (`EngineSpec.requested_rules()`: engine, executor, clock, trace, host tier) and every
    config section but `engine` as configured (the executor's constants among them); an
    engine key reaches the run only through a declared rule."""
    from experiments.runners.cell import cell_config
    from experiments.runners.spec import engine_spec

    config = {k: v for k, v in cell_config(cfg).items()
              if k not in ("engine", "campaign_name", "question")}
    return json.dumps([engine_spec(cfg).requested_rules(), config], sort_keys=True,
                      default=str)


def _asks_default_rules(cfg, base: tuple[str, ...]) -> bool:
    """Whether the run of `cfg` is its cell's run under the default alternative (`base`):
    the same requested rules and the same configuration outside `engine`."""
    return _engine_identity(cfg) == _default_engine(base)


def run_study(jobs: list[Job], ledger_root: Path, progress: bool = True) -> list[dict]:
    """run_jobs family by family and, within one, seed by seed (the seed's every alternative
    and cell), the study record written after each (one study id): a stopped study keeps
    the record of what it ran, and each family has whole seeds under every alternative, so
    its pages pair the alternatives with their own runs at those seeds."""
    study_id, rows = new_study_id(), []
    chunks: dict[tuple[str, int], list[Job]] = {}
    for job in jobs:  # planned alternative by alternative, cell by cell: regrouped
        chunks.setdefault((job.family, job.seed), []).append(job)
    families = list(dict.fromkeys(job.family for job in jobs))
    for key in sorted(chunks, key=lambda k: (families.index(k[0]), k[1])):
        done = run_jobs(chunks[key], ledger_root, progress)
        write_study(ledger_root, TABLE, rows_to_columns(TABLE, done, study_id=study_id,
                                                        created_at=now_iso()))
        rows += done
    return rows


def main(argv: list[str] | None = None) -> int:
    p = study_parser("sensitivity", __doc__, smoke="smoke size: the file's smoke seeds and "
                     "requests, *_smoke campaigns")
    p.add_argument("--alternatives", default="",
                   help="comma-separated subset of conf/sensitivity/alternatives.yaml")
    p.add_argument("--families", default="",
                   help="comma-separated subset of the file's families (e.g. ARMS-9)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    raw, alts = load_alternatives()
    names = [n for n in args.alternatives.split(",") if n] or list(alts)
    listed = [f["family"] for f in raw["families"]]
    families = [n for n in args.families.split(",") if n] or listed
    for flag, chosen, allowed in (("alternatives", names, list(alts)),
                                  ("families", families, listed)):
        unknown = [n for n in chosen if n not in allowed]
        if unknown:
            print(f"--{flag}: unknown {', '.join(unknown)}; allowed values are "
                  f"{', '.join(allowed)}", file=sys.stderr)
            return 2
    for flag in ("seeds", "requests"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            print(f"--{flag}={getattr(args, flag)}: must be >= 1", file=sys.stderr)
            return 2
    seeds, requests = args.seeds, args.requests
    if args.smoke:
        seeds = seeds or int(raw["smoke"]["seeds"])
        requests = requests or int(raw["smoke"]["requests"])
    jobs = planned_jobs([alts[n] for n in names],
                        [f for f in raw["families"] if f["family"] in families],
                        smoke=args.smoke or requests is not None, seeds=seeds,
                        requests=requests)  # another size than the page's: never its campaign
    rows = run_study(jobs, args.ledger_root, progress=not args.quiet)
    count = {o: sum(r["outcome"] == o for r in rows) for o in ("ran", "skipped", "as_default")}
    print(f"sensitivity: {len(jobs)} runs ({count['ran']} ran, {count['skipped']} skipped as "
          f"complete, {count['as_default']} as the default's) for {len(names)} alternatives "
          f"into {args.ledger_root}; study table {args.ledger_root}/{TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
