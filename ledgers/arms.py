"""The one table of experiment arms: every spelling of an organization's name lives here.

An arm is what a user asks for (`org=s2_retention`); it runs on a storage
organization of serving_core (`S2`) with its own settings (retention K) and is
recorded in the ledgers under its own `org` value (`S2_RETENTION`) and `arm`
label (`S2+Retention`); an arm may run its organization under engine rules of its own
(`rules`, rule name -> value, set over the config's `engine.<name>`): a cache-policy arm
(`s2_marconi`) under `engine.cache_policy=marconi`, `n0_vllm` N0 under vLLM's rules. The
runner's choices, the ledgers' values, and the
analysis' order, display names and colours all derive from `ARMS`; the table's
order is the order of every figure and table. (serving_core names only its
storage organizations, on the organization classes; a test checks the two agree.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# N0 under vLLM's rules (docs/engine_rules.md section 17): with them N0 decides as vLLM
# 0.32's scheduler and hybrid KV cache manager do, step for step (campaign n0_vllm).
VLLM_RULES: Mapping[str, Any] = MappingProxyType({
    "align_chunks": True, "cross_final_chunk": True, "stop_at_junction": True,
    "admission": "capped_prompt", "whole_chunks": True, "state_blocks": "vllm_align",
    "duplicates": "cache", "release_order": "groups"})


@dataclass(frozen=True, slots=True)
class Arm:
    name: str  # config value: org=<name>
    org: str  # storage organization the engine builds (serving_core's registry key)
    ledger_org: str  # runs.org
    label: str  # runs.arm, short display name
    display: str  # figure legends
    color: str  # figure colour
    retention: bool = False  # producer-side checkpoint retention (retention.k applies)
    # engine rules the arm runs (name -> value over the config's engine.<name>; read back
    # from the engine into the run's record like every rule)
    rules: Mapping[str, Any] = field(default_factory=dict)


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("s0", "S0", "S0", "S0", "S0", "#8c8c8c"),
    Arm("s1", "S1", "S1", "S1", "S1", "#4c72b0"),
    Arm("s2", "S2", "S2", "S2", "S2", "#55a868"),
    Arm("d0", "D0", "D0", "D0", "D0", "#c44e52"),
    Arm("s2_retention", "S2", "S2_RETENTION", "S2+Retention", "S2+Retention", "#8172b2",
        retention=True),
    Arm("n0", "N0", "N0", "N0", "N0 (vLLM native)", "#937860"),
    Arm("n0_vllm", "N0", "N0_VLLM", "N0+vLLM", "N0 (vLLM's rules)", "#5f9ea0",
        rules=VLLM_RULES),
    Arm("jenga", "JENGA", "JENGA", "Jenga", "Jenga (two-level)", "#da8bc3"),
    Arm("s2_marconi", "S2", "S2_MARCONI", "S2+Marconi", "S2 + Marconi cache", "#2f7d3e",
        rules={"cache_policy": "marconi"}),
    Arm("d0_marconi", "D0", "D0_MARCONI", "D0+Marconi", "D0 + Marconi cache", "#8c2d30",
        rules={"cache_policy": "marconi"}),
)}
ARM_NAMES = tuple(ARMS)
BY_LEDGER_ORG: dict[str, Arm] = {a.ledger_org: a for a in ARMS.values()}
LEDGER_ORGS = tuple(BY_LEDGER_ORG)  # runs.org values in display order
STORAGE_ORGS = tuple(dict.fromkeys(a.org for a in ARMS.values()))
# one arm per storage organization, with no rules on top (s0, s1, s2, d0, n0, jenga)
PLAIN_ARMS = tuple(a.name for a in ARMS.values() if a.ledger_org == a.org)
OTHER_COLOR = "#dd8452"  # an org value outside the table


def arm(name: str) -> Arm:
    """The arm named by a config value (case and `+` tolerated); ValueError names the choices."""
    key = str(name).strip().lower().replace("+", "_")
    if key not in ARMS:
        raise ValueError(f"org={name!r}: allowed values are {', '.join(ARM_NAMES)}")
    return ARMS[key]


def display_name(ledger_org: str) -> str:
    """Legend name of a runs.org value (the value itself when outside the table)."""
    found = BY_LEDGER_ORG.get(str(ledger_org).upper())
    return found.display if found else str(ledger_org)


def color(ledger_org: str) -> str:
    found = BY_LEDGER_ORG.get(str(ledger_org).upper())
    return found.color if found else OTHER_COLOR
