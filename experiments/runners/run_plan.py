"""What one run derives from its config, derived once: `RunPlan`.

`validate_config` (experiments.config.validation) returns the plan of a checked config;
`plan_run` derives it without the checks (tests and tools that run a config as it is).
The rest of a run reads the plan: the arm, the executor path, the geometry, the budget
plan and the engine spec (its pool units fixed to the plan's), so nothing resolves the
arm, plans the budget or translates the engine config again.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from experiments.runners.spec import engine_spec, executor_path
from ledgers.arms import Arm, arm
from serving_core.engine_spec import EngineSpec
from serving_core.geometry import Geometry, geometry_from_config
from serving_core.planner import BudgetPlan, plan_budget, units_for


@dataclass(frozen=True)
class RunPlan:
    arm: Arm  # ledgers.arms row of `org=`
    path: str  # how the cell is served (experiments.runners.spec.executor_path)
    geometry: Geometry
    budget: BudgetPlan  # the planner's plan of `budget=` under the geometry
    spec: EngineSpec  # the engine the run builds (pool units: the budget's for the arm)

    @property
    def units(self) -> dict[str, int]:
        """Pool units of the arm's organization under the budget."""
        return dict(self.spec.pool_units)


def plan_run(cfg: DictConfig) -> RunPlan:
    """The plan of a config, unchecked (validate_config checks it, then derives the same)."""
    run_arm = arm(cfg.org)
    geometry = geometry_from_config(cfg.model)
    budget = plan_budget(geometry, str(cfg.budget))
    spec = engine_spec(cfg, run_arm=run_arm, pool_units=units_for(budget, run_arm.org))
    return RunPlan(run_arm, executor_path(cfg.executor), geometry, budget, spec)
