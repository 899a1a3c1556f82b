"""Small real ledgers for the analysis tests, written through the runner's own API.

Each cell runs with `experiments.cell.run_cell` on a short synthetic workload
loaded enough (12 requests/s, long shared prompts) for the organizations to
differ; its runs row comes from `experiments.ledger_io.runs_row` and is written
with `ledgers.write_run`, exactly as `experiments.run` records a run, except
that the plan hash can be chosen (tests use their own small plans).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config  # noqa: E402

from experiments.cell import run_cell  # noqa: E402
from experiments.ledger_io import run_key, runs_row  # noqa: E402
from ledgers import write_run  # noqa: E402

WORKLOAD = ("workload.source=synthetic", "workload.num_requests=36", "load.rate=12",
            "workload.synthetic_prompt_tokens=2400", "workload.synthetic_context_tokens=2048",
            "workload.synthetic_output_tokens=48")


def write_cells(root: Path, campaign: str, plan_hash: str, overrides, seeds) -> list[dict]:
    """Run one cell per seed, write each under `root` stamped with `plan_hash`; return rows.

    The config is composed once and only its seed changes (composing dominates the cost).
    """
    cfg = compose_config(f"ledger_root={root}", f"campaign_name={campaign}",
                         f"question={campaign}", *WORKLOAD, *overrides)
    rows = []
    for seed in seeds:
        cfg.seed = int(seed)
        key = run_key(cfg)
        result = run_cell(cfg)
        row = {**runs_row(cfg, key, result, result.summary["wall_seconds"]),
               "prereg_plan_hash": plan_hash}
        tables = {name: cols for name, cols in result.tables.items()
                  if len(next(iter(cols.values())))}
        write_run(root, key.campaign, key.run_id, tables, row)
        rows.append(row)
    return rows


# Small plans over the test cells (rate 12, seeds 0-2), replacing q1, q4, q7, q8 and q9 of
# conf/prereg in a temporary plan directory; the other questions keep their real plans.
# Every design column a cell does not name: the test cells' own values.
_DEFAULTS = ("defaults: {arrival: poisson, trace: false, model: falcon_h1_7b, "
             "executor: 'sim:a100', pinning_k: -1, d0_attention_fraction: 0.527383, "
             "retention_k: 2}")
_PAIRED = "{{id: {0}_vs_{1}, kind: paired, treatment: {0}, control: {1}, predicted: {2}}}"
TEST_PLANS = {
    "q1": f"""
question: Q1
campaign: q1
title: test steps
alpha: 0.05
{{DEFAULTS}}
families:
  - name: steps
    role: primary
    seeds: [0, 1, 2]
    defaults: {{budget: b63, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share}}
    cells:
      - {{id: S0, org: S0}}
      - {{id: S1, org: S1}}
      - {{id: S2, org: S2}}
      - {{id: D0, org: D0, d0_attention_fraction: 0.527383}}
    estimands:
      - {{name: throughput, metric: throughput_ledger, role: primary}}
      - {{name: ttft_p99, metric: ttft_p99, role: secondary}}
    decision: {{method: sign_flip_holm, rule: exact sign-flip, Holm}}
    tests:
      - {_PAIRED.format("S1", "S0", "positive")}
      - {_PAIRED.format("S2", "S1", "positive")}
      - {_PAIRED.format("D0", "S2", "none")}
      - {{id: S2_vs_S1_minus_S1_vs_S0, kind: interaction, a: {{treatment: S2, control: S1}},
         b: {{treatment: S1, control: S0}}, predicted: none}}
  - name: more_seeds
    role: secondary
    seeds: [0, 1, 2, 3]
    defaults: {{budget: b63, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share}}
    cells:
      - {{id: S0, org: S0}}
      - {{id: S1, org: S1}}
      - {{id: S1_b83, org: S1, budget: b83}}
    estimands:
      - {{name: throughput, metric: throughput_ledger, role: primary}}
    decision: {{method: sign_flip_holm, rule: exact sign-flip, Holm}}
    tests:
      - {_PAIRED.format("S1", "S0", "positive")}
      - {_PAIRED.format("S1_b83", "S0", "positive")}
""",
    "q4": f"""
question: Q4
campaign: q4
title: test four orgs
alpha: 0.05
{{DEFAULTS}}
families:
  - name: d0_vs_s2
    role: primary
    seeds: [0, 1, 2]
    defaults: {{campaign: q1, budget: b63, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share}}
    cells:
      - {{id: S2, org: S2}}
      - {{id: D0, org: D0, d0_attention_fraction: 0.527383}}
    estimands:
      - {{name: throughput, metric: throughput_ledger, role: primary}}
    decision: {{method: sign_flip_holm, rule: exact sign-flip, Holm}}
    tests:
      - {_PAIRED.format("D0", "S2", "none")}
""",
    "q7": """
question: Q7
campaign: q7
title: test depth
alpha: 0.05
{DEFAULTS}
families:
  - name: probe_containment
    role: gate
    seeds: [0, 1, 2]
    defaults: {budget: b83, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share}
    cells:
      - {id: S2_off, org: S2, trace: false}
      - {id: S2_on, org: S2, trace: true}
      - {id: D0_off, org: D0, trace: false}
      - {id: D0_on, org: D0, trace: true}
    estimands:
      - {name: probe_effect, metric: throughput_ledger, role: primary}
    decision: {method: containment, margin_pct: 3.0, confidence: 0.9, rule: within 3}
    tests:
      - {id: probe_S2, kind: containment, probe_on: S2_on, probe_off: S2_off, predicted: none}
      - {id: probe_D0, kind: containment, probe_on: D0_on, probe_off: D0_off, predicted: none}
  - name: depth
    role: primary
    seeds: [0, 1, 2]
    defaults: {budget: b83, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share, trace: true}
    cells:
      - {id: S2_on, org: S2}
      - {id: D0_on, org: D0}
    estimands:
      - {name: jadopt_mean, metric: jadopt_tokens_mean, role: primary}
      - {name: gap_r_mean, metric: gap_r_tokens_mean, role: secondary}
      - {name: depth_classes, metric: entry_vs_adopted_class_shares, role: secondary}
    decision: {method: descriptive, rule: effects only}
    tests:
      - {id: D0_vs_S2_depth, kind: paired, treatment: D0_on, control: S2_on, predicted: none}
""",
    "q8": """
question: Q8
campaign: q8
title: test retention depth
alpha: 0.05
{DEFAULTS}
families:
  - name: retention_depth
    role: primary
    seeds: [0, 1, 2]
    defaults: {budget: p80, cap: 63, rate: 12.0, q: 1.0, f: 0.0, reuse: share, trace: true}
    cells:
      - {id: S2, org: S2}
      - {id: S2_RETENTION, org: S2_RETENTION, retention_k: 2}
    estimands:
      - {name: jadopt_mean, metric: jadopt_tokens_mean, role: primary}
      - {name: throughput, metric: throughput_ledger, role: secondary}
    decision: {method: descriptive, rule: effects only}
    tests:
      - {id: retention_vs_S2, kind: paired, treatment: S2_RETENTION, control: S2,
         predicted: positive}
""",
    "q9": """
question: Q9
campaign: q9
title: test K_ret
alpha: 0.05
{DEFAULTS}
families:
  - name: k_ret
    role: primary
    seeds: [0, 1, 2]
    defaults: {budget: p80, cap: 63, rate: 12.0, q: 1.0, f: 0.0}
    cells:
      - {id: S2_share, org: S2, reuse: share}
      - {id: Ret_share, org: S2_RETENTION, reuse: share, retention_k: 2}
      - {id: S2_isolate, org: S2, reuse: isolate}
      - {id: Ret_isolate, org: S2_RETENTION, reuse: isolate, retention_k: 2}
    estimands:
      - {name: K_ret, metric: throughput_ledger, role: primary}
    decision: {method: paired_t_interval, confidence: 0.95, rule: paired-t}
    tests:
      - {id: K_ret, kind: interaction, a: {treatment: Ret_share, control: S2_share},
         b: {treatment: Ret_isolate, control: S2_isolate}, predicted: positive}
      - {id: delta_share, kind: paired, treatment: Ret_share, control: S2_share,
         predicted: positive}
""",
}


TEST_PLANS = {name: text.replace("{DEFAULTS}", _DEFAULTS) for name, text in TEST_PLANS.items()}


def write_plans(plan_dir: Path) -> Path:
    """conf/prereg copied to `plan_dir`, with TEST_PLANS written over it."""
    from analysis import prereg

    plan_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(prereg.PLAN_DIR.glob("q*.yaml")):
        (plan_dir / path.name).write_text(path.read_text())
    for name, text in TEST_PLANS.items():
        (plan_dir / f"{name}.yaml").write_text(text.lstrip())
    return plan_dir


# (campaign, seeds, cells): each cell is a tuple of overrides.
LEDGER_CELLS = (
    ("q1", (0, 1, 2), [(f"org={o}", "budget=b63") for o in ("s0", "s1", "s2", "d0")]),
    ("q7", (0, 1, 2), [(f"org={o}", "budget=b83", f"trace={t}")
                       for o in ("s2", "d0") for t in ("true", "false")]),
    ("q8", (0, 1, 2), [(f"org={o}", "budget=p80", "trace=true") for o in ("s2", "s2_retention")]),
    ("q9", (0, 1, 2), [(f"org={o}", "budget=p80", f"workload.reuse={m}")
                       for o in ("s2", "s2_retention") for m in ("share", "isolate")]),
    ("q5", (0, 1), [(f"org={o}", "budget=b63", f"load.rate={r}")
                    for o in ("s2", "d0") for r in ("6", "12")]),
    ("q6", (0, 1), [(f"org={o}", "budget=b63", f"engine.headroom={f}")
                    for o in ("s2", "d0") for f in ("0.0", "0.19")]),
)


@dataclass
class BuiltLedger:
    root: Path
    plan_dir: Path
    rows: list[dict]


_BUILT: dict[str, BuiltLedger] = {}


def shared_ledger(tmp_path_factory) -> BuiltLedger:
    """The test ledger (built once per session) and its plan directory."""
    if "ledger" not in _BUILT:
        base = tmp_path_factory.mktemp("analysis_ledger")
        plan_dir = write_plans(base / "plans")
        from analysis import prereg

        rows = []
        for campaign, seeds, cells in LEDGER_CELLS:
            plan_hash = prereg.load_plan(campaign, plan_dir).plan_hash
            for cell in cells:
                rows += write_cells(base / "ledger", campaign, plan_hash, cell, seeds)
        _BUILT["ledger"] = BuiltLedger(base / "ledger", plan_dir, rows)
    return _BUILT["ledger"]
