"""Small real ledgers for the analysis tests, built from the REAL preregistered plans.

Every cell of the chosen families (conf/prereg) is turned into the overrides of a run and
run with `experiments.runners.cell.run_cell` on a short synthetic workload; its runs row comes from
`experiments.runners.ledger_io.runs_row` (stamped with the real plan hash of the campaign that
collects it) and is written with `ledgers.write_run`, as `experiments.run` records a run.
Main-stage families are written at their planned seeds; smoke-stage ones under
`<campaign>_smoke` at the first three seeds, as `make <q> SMOKE=1` collects them. Q9's
four runs per seed are written in the campaign's balanced (Williams) order.
"""

from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import build_once, compose_config  # noqa: E402

from analysis.inference import prereg  # noqa: E402
from experiments.campaigns.sweeps import williams_rows  # noqa: E402
from experiments.runners.cell import run_cell  # noqa: E402
from experiments.runners.ledger_io import run_key, runs_row  # noqa: E402
from experiments.runners.run_plan import plan_run  # noqa: E402
from ledgers import write_run  # noqa: E402

WORKLOAD = ("workload.source=synthetic", "workload.num_requests=36",
            "workload.synthetic_prompt_tokens=2400", "workload.synthetic_context_tokens=2048",
            "workload.synthetic_output_tokens=48")
SMOKE_SEEDS = 3
# The plan ledgers (`build`): fewer requests per run than the ad-hoc cells, the same
# families, seeds and checks (16: queues still form in q1, q2, q3, q5, q9; the build takes
# 7.6 CPU s instead of 9.3 at 24).
LEDGER_REQUESTS = 16
LEDGER_WORKLOAD = (*WORKLOAD[:1], f"workload.num_requests={LEDGER_REQUESTS}", *WORKLOAD[2:])


def brute_sign_flip(d) -> float:
    """Reference two-sided sign-flip p by listing every sign assignment (itertools)."""
    d = np.asarray(d, dtype=float)
    observed = abs(d.mean())
    hits = [abs(np.mean(d * np.array(signs))) >= observed - 1e-12
            for signs in itertools.product((1, -1), repeat=d.size)]
    return sum(hits) / len(hits)


@functools.cache
def _executor_options() -> dict[str, str]:
    """Profile name -> conf/executor option (first option in name order wins)."""
    profiles = Path(__file__).resolve().parent.parent / "conf" / "executor"
    options: dict[str, str] = {}
    for path in sorted(profiles.glob("*.yaml")):
        options.setdefault(yaml.safe_load(path.read_text()).get("name"), path.stem)
    return options


def executor_option(label: str) -> str:
    """The conf/executor option whose profile name the ledger label `sim:<name>` carries."""
    name = str(label).split(":", 1)[1]
    if name in _executor_options():
        return _executor_options()[name]
    raise ValueError(f"executor={label!r}: no conf/executor profile is named {name!r}")


def cell_overrides(keys) -> list[str]:
    """The run overrides that reproduce a plan cell's design columns."""
    pin = int(keys["pinning_k"])
    out = [f"model={keys['model']}", f"org={str(keys['org']).lower()}",
           f"budget={keys['budget']}", f"engine.cap={keys['cap']}", f"load.rate={keys['rate']}",
           f"load.arrival={keys['arrival']}", f"workload.q={keys['q']}",
           f"engine.headroom={keys['f']}", f"workload.reuse={keys['reuse']}",
           f"engine.pinning_k={'null' if pin < 0 else pin}",
           f"trace={str(bool(keys['trace'])).lower()}",
           f"executor={executor_option(keys['executor'])}"]
    if "d0_attention_fraction" in keys:
        out.append(f"model.d0_attention_fraction={keys['d0_attention_fraction']}")
    if "retention_k" in keys:
        out.append(f"retention.k={keys['retention_k']}")
    return out


@dataclass(frozen=True)
class Part:
    """Cells of one plan family to write: `stage` main or smoke, optionally some cells."""

    plan: str
    family: str
    stage: str = "main"
    cells: tuple[str, ...] = ()
    balanced: bool = False


PARTS = (
    Part("q9", "k_ret", balanced=True),
    Part("q7", "probe_containment"),
    Part("q8", "retention_depth"),
    Part("q1", "exp1b_low_load"),
    Part("q2", "anchors"),
    Part("q1", "EXT-22", "smoke"),
    Part("q3", "sharing_levels", "smoke"),
    Part("q5", "load_curves", cells=("S2_b63_r0p8", "D0_b63_r0p8", "S2_b63_r3", "D0_b63_r3")),
    Part("q6", "Q6-17", "smoke", cells=("D0_b63_f0", "S2_b63_f0", "D0_b63_f19", "S2_b63_f19",
                                         "S2_b63_f27")),
)


@dataclass
class BuiltLedger:
    root: Path
    plan_dir: Path
    rows: list[dict] = field(default_factory=list)


def _jobs(part: Part) -> list[tuple[prereg.Cell, int, str]]:
    fam = prereg.load_plan(part.plan).family(part.family)
    cells = [c for c in fam.cells if not part.cells or c.id in part.cells]
    jobs = []
    for cell in cells:
        home = prereg.cell_campaigns(cell)[-1]
        campaign = home + ("_smoke" if part.stage == "smoke" else "")
        seeds = cell.seeds[:SMOKE_SEEDS] if part.stage == "smoke" else cell.seeds
        jobs += [(cell, seed, campaign) for seed in seeds]
    if part.balanced:  # each seed's conditions in row i of a Williams design
        seeds = sorted({s for _, s, _ in jobs})
        rows = williams_rows(len(cells))
        jobs = [next(j for j in jobs if j[1] == seed and j[0].id == cells[k].id)
                for i, seed in enumerate(seeds) for k in rows[i % len(rows)]]
    return jobs


def build(root: Path, parts=PARTS) -> BuiltLedger:
    """Write every part's runs once (a cell shared by two families is written once)."""
    built = BuiltLedger(root, prereg.PLAN_DIR)
    written: set[str] = set()
    configs: dict[tuple, object] = {}
    for part in parts:
        for cell, seed, campaign in _jobs(part):
            home = prereg.home_campaign(campaign)
            key_id = (cell.id, campaign, home, tuple(sorted(cell.keys.items(), key=str)))
            if key_id not in configs:  # the config and its run plan (the seed is not in it)
                cfg = compose_config(
                    f"ledger_root={root}", f"campaign_name={campaign}", f"question={home}",
                    *LEDGER_WORKLOAD, *cell_overrides(cell.keys))
                configs[key_id] = cfg, plan_run(cfg)
            cfg, plan = configs[key_id]
            cfg.seed = int(seed)
            key = run_key(cfg)
            if key.run_id in written:
                continue
            written.add(key.run_id)
            result = run_cell(cfg, plan=plan)
            row = runs_row(cfg, key, result, result.summary["wall_seconds"])
            tables = {name: cols for name, cols in result.tables.items()
                      if len(next(iter(cols.values())))}
            write_run(root, key.campaign, key.run_id, tables, row)
            built.rows.append(row)
    return built


def write_cells(root: Path, campaign: str, plan_hash: str, overrides, seeds,
                question: str | None = None) -> list[dict]:
    """Run one ad-hoc cell per seed and write it under `root` stamped with `plan_hash`.

    For analyses outside the preregistered plans (e.g. the vLLM-arm page); the config is
    composed once and only its seed changes. `question` defaults to the campaign.
    """
    cfg = compose_config(f"ledger_root={root}", f"campaign_name={campaign}",
                         f"question={question or campaign}", *WORKLOAD, *overrides)
    rows = []
    for seed in seeds:
        cfg.seed = int(seed)
        key = run_key(cfg)
        result = run_cell(cfg)
        row = {**runs_row(cfg, key, result, result.run_seconds), "prereg_plan_hash": plan_hash}
        tables = {name: cols for name, cols in result.tables.items()
                  if len(next(iter(cols.values())))}
        write_run(root, key.campaign, key.run_id, tables, row)
        rows.append(row)
    return rows


_BUILT: dict[str, BuiltLedger] = {}


def shared_ledger(tmp_path_factory) -> BuiltLedger:
    """The test ledger (built once per test run, shared by the xdist workers; read-only:
    a test that changes ledger files works on a copy)."""
    if "ledger" not in _BUILT:
        _BUILT["ledger"] = build_once(tmp_path_factory, "analysis_ledger",
                                      lambda directory: build(directory / "ledger"))
    return _BUILT["ledger"]
