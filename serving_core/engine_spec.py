"""What an engine is built from: one immutable spec, serializable to JSON.

`EngineSpec` names everything that decides what an engine does: the model
geometry, the storage organization, the budget (or explicit pool units), every
engine rule (the scheduler's and the allocator's rule dataclasses, RULE_SECTIONS, and the
executor's, declared on its ExecutorSpec), the executor, the clock and the trace. Every
path that builds an engine (a simulated cell, the in-process torch engine, the
HTTP server, continuation, calibration, benchmarks) goes through
`serving_core.builder.build_engine(spec)`; the server receives the same spec as
JSON. This module is also the only place the rule dataclasses are made from data
(`from_dict`, `rule_sections`).

`requested_rules()` resolves the spec's per-organization defaults through the
organization registry: it is what the run asks for, to be compared with what the
built engine reports (`Engine.effective_rules()`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from serving_core import rules
from serving_core.executor.base import EXECUTOR_RULE_KEYS
from serving_core.executor.spec import EXECUTOR_KINDS, ExecutorSpec  # noqa: F401
from serving_core.geometry import Geometry, geometry_from_config
from serving_core.memory.rules import AllocatorRules
from serving_core.scheduler import SchedulerConfig
from serving_core.state_codec import DEFAULT_STATE_CODEC

CLOCKS = ("virtual", "wall")
DEFAULT_CLOCK = {"simulated": "virtual", "paced": "wall", "torch": "wall", "external": "wall"}

# The engine's rule dataclasses, side by side in EngineSpec: section -> class (each field
# one rule declaration, serving_core/rules.py; the order is the order of the records).
RULE_SECTIONS: dict[str, type] = {"scheduler": SchedulerConfig, "allocator": AllocatorRules}

@dataclass(frozen=True)
class HostTierSpec:
    """An external (host) state tier beside the state manager (serving_core/host_tier.py).

    capacity_bytes: host bytes the tier may hold (required, > 0: there is no unbounded
    default); whole entries (a checkpoint with its attention chain) are evicted least
    recently used first. The torch executor copies real state; a simulated executor
    models the copies with its profile's host-link constants (`host_link_bandwidth_Bps`,
    `host_link_latency_s`). poison: fill every destination unit with NaN before a restore
    writes it (the boundary audits over HTTP; off when serving).
    """

    capacity_bytes: int
    poison: bool = False

    def __post_init__(self) -> None:
        cap = self.capacity_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"host_tier.capacity_bytes={cap!r}: allowed values are "
                             f"integers > 0 (bytes; required, no unbounded default)")
        if self.poison not in (True, False):
            raise ValueError(f"host_tier.poison={self.poison!r}: allowed values are true, false")

    def rules(self) -> dict[str, Any]:
        return {"capacity_bytes": int(self.capacity_bytes), "poison": bool(self.poison)}

    @classmethod
    def of(cls, value: Any) -> HostTierSpec | None:
        """None (off) from None/false, the spec of a mapping {capacity_bytes: N}."""
        if value is None or value is False:
            return None
        if isinstance(value, HostTierSpec):
            return value
        if value is True:
            raise ValueError("host_tier.capacity_bytes: required (an integer > 0 bytes); "
                             "the host tier has no unbounded default")
        if not isinstance(value, Mapping):
            raise ValueError(f"host_tier={value!r}: allowed values are null or "
                             f"{{capacity_bytes: N}}")
        _known(value, cls, "host_tier")
        if "capacity_bytes" not in value:
            raise ValueError("host_tier.capacity_bytes: required (an integer > 0 bytes); "
                             "the host tier has no unbounded default")
        return cls(**value)


# executors a host tier runs on (torch: real copies; simulated: a transfer-time model)
HOST_TIER_EXECUTORS = ("torch", "simulated")


@dataclass(frozen=True)
class EngineSpec:
    model: Mapping[str, Any]  # geometry fields (conf/model/<name>.yaml, resolved)
    org: str  # storage organization: S0 | S1 | S2 | D0 | N0
    budget: str  # bN | pN; the planner converts it to pool units
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    allocator: AllocatorRules = field(default_factory=AllocatorRules)
    executor: ExecutorSpec = field(default_factory=ExecutorSpec)
    clock: str | None = None  # virtual | wall | None: the executor's default
    trace: bool = False
    pool_units: Mapping[str, int] | None = None  # None: the planner's units for the budget
    # Save published state to a host tier and restore held prefixes on admission
    # (None: off; see HostTierSpec).
    host_tier: HostTierSpec | None = None

    def __post_init__(self) -> None:
        from serving_core.memory import normalize_org

        object.__setattr__(self, "org", normalize_org(self.org))
        if self.clock is not None and self.clock not in CLOCKS:
            raise ValueError(f"clock={self.clock!r}: allowed values are {', '.join(CLOCKS)}")
        object.__setattr__(self, "host_tier", HostTierSpec.of(self.host_tier))
        if self.host_tier is not None and self.executor.kind not in HOST_TIER_EXECUTORS:
            raise ValueError(f"host_tier: a host tier runs on executor.kind "
                             f"{' or '.join(HOST_TIER_EXECUTORS)}, not {self.executor.kind!r}")

    # ----- derived --------------------------------------------------------------------------
    @property
    def clock_kind(self) -> str:
        return self.clock or DEFAULT_CLOCK[self.executor.kind]

    def geometry(self) -> Geometry:
        return geometry_from_config(self.model)

    def units(self, geometry: Geometry | None = None) -> dict[str, int]:
        """Pool units: explicit, or the planner's for the budget."""
        if self.pool_units is not None:
            return {str(k): int(v) for k, v in self.pool_units.items()}
        from serving_core.planner import plan_budget, units_for

        return units_for(plan_budget(geometry or self.geometry(), self.budget), self.org)

    def requested_rules(self) -> dict[str, Any]:
        """The rules this spec asks for, per-organization defaults resolved (registry):
        every declared rule of each section (RULE_SECTIONS), then the executor's."""
        from serving_core.memory import org_class, org_layout

        geometry = self.geometry()
        cls, layout = org_class(self.org), org_layout(geometry, self.org)
        out: dict[str, Any] = {"org": self.org}
        for section in RULE_SECTIONS:
            out.update(rules.requested(getattr(self, section),
                                       lambda r: rules.RuleContext(cls, layout, r)))
        return {
            **out,
            **_requested_executor_rules(self.executor, geometry),
            "clock": self.clock_kind,
            "trace": bool(self.trace),
            "host_tier": self.host_tier.rules() if self.host_tier is not None else False,
        }

    # ----- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["model"] = dict(self.model)
        if self.host_tier is None:
            data["host_tier"] = None
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineSpec:
        """The spec of a mapping (to_dict's shape); ValueError names a bad or unknown key."""
        data = dict(data)
        _known(data, cls, "engine spec")
        sections = {}
        for section, rule_cls in RULE_SECTIONS.items():
            values = dict(data.pop(section, None) or {})
            _known(values, rule_cls, f"engine spec: {section}")
            sections[section] = rule_cls(**values)
        ex = dict(data.pop("executor", None) or {})
        _known(ex, ExecutorSpec, "engine spec: executor")
        units = data.pop("pool_units", None)
        return cls(
            **data,
            **sections,
            executor=ExecutorSpec(**ex),
            pool_units=None if units is None else {str(k): int(v) for k, v in units.items()},
        )

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls.from_dict(json.loads(text))


def _known(data: Mapping, cls, where: str) -> None:
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed keys are {allowed}")


def _requested_executor_rules(ex: ExecutorSpec, geometry: Geometry) -> dict[str, Any]:
    """What the spec asks of its executor, under keys of EXECUTOR_RULE_KEYS (the executor's
    describe() reports the same keys): its kind and step model, each executor rule the
    executor runs (their declarations on ExecutorSpec say which), for torch the model's
    KV codec, and for both a state codec other than auto."""
    out: dict[str, Any] = {"executor": ex.kind, "step_model": _requested_step_model(ex),
                           **rules.requested(ex, lambda spec: spec)}
    if ex.kind == "torch":
        out["kv_codec"] = geometry.kv_codec
        out["kv_group_heads"] = geometry.kv_group_heads
    if geometry.state_codec != DEFAULT_STATE_CODEC:  # auto: the record as before the axis
        out["state_codec"] = geometry.state_codec
    assert out.keys() <= set(EXECUTOR_RULE_KEYS), sorted(out)
    return out


def _requested_step_model(ex: ExecutorSpec) -> str | None:
    """additive | roofline for a modelled executor (the profile's `step_model`), else None;
    a spec without a profile (a step model object handed to the builder) asks for none."""
    if ex.kind == "torch" or not ex.profile:
        return None
    return str(dict(ex.profile).get("step_model") or "roofline")


def rule_differences(requested: Mapping[str, Any], effective: Mapping[str, Any]) -> list[str]:
    """`key requested X, effective Y` for every requested rule the engine does not run."""
    out = []
    for key, want in requested.items():
        got = effective.get(key, "<absent>")
        if got != want:
            shown = rules.show_value
            out.append(f"{key} requested {shown(want)}, effective {shown(got)}")
    return out


def check_effective(requested: Mapping[str, Any], effective: Mapping[str, Any]) -> None:
    """Refuse a run whose engine runs other rules than requested (one line)."""
    diffs = rule_differences(requested, effective)
    if diffs:
        raise ValueError("engine rules differ from the request: " + "; ".join(diffs))


def rule_sections(**flat: Any) -> dict[str, Any]:
    """{section: rule dataclass} of rules given by name, each routed to the layer that
    declares it (RULE_SECTIONS); ValueError names an unknown rule."""
    owner = {f.name: section for section, cls in RULE_SECTIONS.items()
             for f in rules.rule_fields(cls)}
    unknown = sorted(set(flat) - set(owner))
    if unknown:
        raise ValueError(f"engine.{unknown[0]}: unknown rule; allowed rules are "
                         f"{', '.join(owner)}")
    return {section: cls(**{k: v for k, v in flat.items() if owner[k] == section})
            for section, cls in RULE_SECTIONS.items()}


def rule_declarations() -> list[tuple[str, Any]]:
    """(section, field) of every declared rule, in record order."""
    return [(section, f) for section, cls in RULE_SECTIONS.items()
            for f in rules.rule_fields(cls)]


def executor_rule_declarations() -> list[tuple[str, Any]]:
    """("executor", field) of every executor rule (declared on ExecutorSpec)."""
    return [("executor", f) for f in rules.rule_fields(ExecutorSpec)]


def config_defaults() -> dict[str, Any]:
    """<name> -> its default in the run config, for every rule the config's engine section
    sets (the `engine_rules` config node, experiments/config/rule_defaults.py)."""
    return {f.name: rules.config_default(f)
            for _, f in rule_declarations() + executor_rule_declarations()
            if rules.declared(f).config and rules.hydra_key(f) == f"engine.{f.name}"}


def rules_table() -> str:
    """The Markdown table of every declared rule (docs/engine_rules.md, between its
    engine-rules markers; tests/test_engine_rules.py holds it up to date)."""
    lines = ["| key | default | allowed | layer | what it decides |", "|---|---|---|---|---|"]
    layer = {"scheduler": "scheduler", "allocator": "allocator (memory)"}
    for section, f in rule_declarations() + executor_rule_declarations():
        r = rules.declared(f)
        allowed = r.allowed_text().removeprefix("values are ")
        default = rules.show_value(rules.default_of(f))
        lines.append(f"| `{rules.hydra_key(f)}` | `{default}` | {allowed} "
                     f"| {layer.get(section, section)} | {r.doc} |")
    return "\n".join(lines) + "\n"


DOCS_TABLE = ("<!-- rules-table:begin (generated: python -m serving_core.engine_spec "
              "--write-docs) -->\n", "<!-- rules-table:end -->")


def write_docs_table(path: str = "docs/engine_rules.md") -> bool:
    """Put rules_table() between the markers of `path`; True when the file changed."""
    import re
    from pathlib import Path

    begin, end = DOCS_TABLE
    text = Path(path).read_text()
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path}: no rules-table markers")
    new = pattern.sub(lambda _: begin + rules_table() + end, text)
    Path(path).write_text(new)
    return new != text


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write-docs"]:
        sys.exit("usage: python -m serving_core.engine_spec --write-docs")
    print("docs/engine_rules.md:", "updated" if write_docs_table() else "up to date")
