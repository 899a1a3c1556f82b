"""How an engine rule is declared: one dataclass field whose metadata says everything else.

A rule is a field of the rule dataclass of the layer that runs it (the allocator's
`serving_core.memory.rules.AllocatorRules`, the scheduler's `SchedulerConfig`, the
executor's `serving_core.executor.spec.ExecutorSpec`), made with `rule(...)`: its
default, its doc line, its allowed values (or a check with the allowed values in words),
its config key (`engine.<name>`, or its declared `key`), how the run asks for it
given the organization (`requested`), how it is read back from the built engine object
(`effective`) and whether its default stays out of a run's identity. Validation, the
requested and effective rules, the run-identity defaults, the config translation and the
docs table (docs/engine_rules.md) iterate these fields; nothing lists the rules by hand.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

RULE = "engine_rule"  # the metadata key of a rule field
OMIT = object()  # a requested value that asks nothing under the rule's name


@dataclass(frozen=True)
class Rule:
    """What a rule field declares besides its name and default (see the module docstring).

    allowed: the values it takes, or None with `check` (value -> bool) and `shown` (the
    allowed values in words); normalize: the stored value of an accepted one (float for a
    fraction); requested(value, ctx): the value the spec asks the engine to run (ctx:
    `RuleContext`), by default the value; effective(obj): the value read back from the
    engine object that runs it, by default its attribute of the rule's name;
    identity_neutral: at its default the rule stays out of a run's identity (a rule added
    after runs were collected, its default reproducing the earlier engine); config: set
    by the config key engine.<name> (False: derived otherwise, as retention_k from the arm
    and retention.k); config_null: the config's default is null, filled elsewhere (as
    max_num_batched_tokens from the executor profile); key: the config key when it is not
    engine.<name> (an executor group's setting: executor.<name>). A `requested` that
    returns OMIT asks nothing under the rule's name (the executor does not run it, or
    reports it under another key)."""

    doc: str
    allowed: tuple | None = None
    check: Callable[[Any], bool] | None = None
    shown: str = ""
    normalize: Callable[[Any], Any] | None = None
    requested: Callable[[Any, Any], Any] | None = None
    effective: Callable[[Any], Any] | None = None
    identity_neutral: bool = True
    config: bool = True
    config_null: bool = False
    key: str = ""

    def allowed_text(self) -> str:
        if self.allowed is not None:
            return "values are " + ", ".join(show_value(a) for a in self.allowed)
        return self.shown


@dataclass(frozen=True)
class RuleContext:
    """What a rule's requested value may depend on: the organization's class, its unit
    layout under the model, and the rule dataclass the rule belongs to."""

    org_class: type
    layout: Any
    rules: Any


def rule(default: Any = MISSING, doc: str = "", *, default_factory: Any = MISSING,
         **declared: Any) -> Any:
    """A rule field (see Rule for the keyword arguments)."""
    return field(default=default, default_factory=default_factory,
                 metadata={RULE: Rule(doc, **declared)})


def rule_fields(cls_or_obj: Any) -> Iterator[Field]:
    """The rule fields of a rule dataclass (class or instance), in declaration order."""
    return (f for f in fields(cls_or_obj) if RULE in f.metadata)


def declared(f: Field) -> Rule:
    return f.metadata[RULE]


def hydra_key(f: Field) -> str:
    """The config key of a rule the config sets (its declared key, else engine.<name>),
    else its bare name."""
    r = declared(f)
    return (r.key or f"engine.{f.name}") if r.config else f.name


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def config_default(f: Field) -> Any:
    """The default the run config gives a rule: null for a config_null rule, else the
    declared default."""
    return None if declared(f).config_null else default_of(f)


def check_rules(obj: Any) -> None:
    """Check every rule field of `obj` against its declaration, storing the normalized
    value (ValueError, one line naming the key and the allowed values)."""
    for f in rule_fields(obj):
        r = declared(f)
        value = getattr(obj, f.name)
        ok = value in r.allowed if r.allowed is not None else r.check(value)
        if not ok:
            raise ValueError(f"{hydra_key(f)}={value!r}: allowed {r.allowed_text()}")
        if r.normalize is not None:
            object.__setattr__(obj, f.name, r.normalize(value))


def requested(obj: Any, ctx_of: Callable[[Any], RuleContext]) -> dict[str, Any]:
    """The value each rule of `obj` asks the engine to run (ctx_of(obj): its context)."""
    ctx = ctx_of(obj)
    out = {}
    for f in rule_fields(obj):
        r, value = declared(f), getattr(obj, f.name)
        want = value if r.requested is None else r.requested(value, ctx)
        if want is not OMIT:
            out[f.name] = want
    return out


def effective(declared_by: Any, engine_part: Any) -> dict[str, Any]:
    """Each rule of `declared_by` (a rule dataclass or instance) as the engine object
    running it (`engine_part`) reports it."""
    out = {}
    for f in rule_fields(declared_by):
        r = declared(f)
        out[f.name] = (getattr(engine_part, f.name) if r.effective is None
                       else r.effective(engine_part))
    return out


# ----- checks shared by declarations ---------------------------------------------------------
def is_integer(value: Any, low: int) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral)
            and value >= low)


def optional_integer(low: int) -> Callable[[Any], bool]:
    return lambda value: value is None or is_integer(value, low)


def is_number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value))


def show_value(value: Any) -> str:
    """A rule value as the config spells it (null, true, false, or its text)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
