"""The `models` campaign's sensitivity runs (campaign models_sens, question sensitivity).

Every test cell at the higher load is rerun under the alternative engine rules the anchors
cannot decide (conf/sensitivity/alternatives.yaml, read through ledgers.alternatives): the
declared slab policies (SLAB_ALTERNATIVES) and every `identified_*` combination of the
identify study (its fitted step-model constants on every organization, its rules on the
organizations it names). An organization whose runs under an alternative would repeat runs
already made (no rule of its own: the test runs; the same constants and rules as an earlier
alternative: that one's) borrows them instead of running again; the spec this returns says,
per alternative, which organizations it runs and which it borrows from where, and how its
runs are told apart in the ledgers (the executor name suffix of the identified constants,
the engine rules). On SENS_SEEDS, the first test seeds: the page compares each answer with
the test runs' answer on the same seeds.
"""

from __future__ import annotations

from experiments.campaigns import models_regime as regime_mod
from ledgers.alternatives import load_alternatives

SLAB_ALTERNATIVES = ("slab_refill", "slab_dense")
SENS_SEEDS = (42_000, 42_003)  # range(42000,42003): three seeds, signs only
DEFAULT = "default"  # the test runs (conf/sensitivity/alternatives.yaml `default`)


def chosen_alternatives(raw: dict | None = None) -> dict[str, dict]:
    """{name: spec} of the slab alternatives and every identified one, in file order."""
    alts = (raw or load_alternatives())["alternatives"]
    return {n: a for n, a in alts.items()
            if n in SLAB_ALTERNATIVES or n.startswith("identified_")}


def _split(spec: dict, org: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(executor constants, engine rules) of an alternative's runs of one organization."""
    overrides = [*spec.get("overrides", ()), *(spec.get("by_org") or {}).get(org.lower(), ())]
    constants = tuple(o for o in overrides if o.startswith("executor.")
                      and not o.startswith("executor.name="))
    rules = tuple(o for o in overrides if not o.startswith("executor."))
    return constants, rules


def _requested(org: str, model: str, rules: tuple[str, ...]) -> dict:
    """The engine rules an organization's run of the model asks for under `rules`
    (engine.<rule>=<value> of the scheduler's and allocator's sections), as the engine
    resolves them (a rule the organization does not run asks nothing)."""
    from dataclasses import fields

    from serving_core import rules as rule_api
    from serving_core.engine_spec import RULE_SECTIONS
    from serving_core.geometry import load_geometry
    from serving_core.memory import org_class, org_layout

    cls, layout = org_class(org), org_layout(load_geometry(model), org)
    values = dict(r.removeprefix("engine.").split("=", 1) for r in rules)
    out = {}
    for section in RULE_SECTIONS.values():
        names = {f.name for f in fields(section)}
        built = section(**{k: v for k, v in values.items() if k in names})
        out.update(rule_api.requested(built, lambda r: rule_api.RuleContext(cls, layout, r)))
    return out


def inert(org: str, rules: tuple[str, ...], models=None) -> bool:
    """Whether the rules change nothing the organization's runs ask for, on every model."""
    models = models or regime_mod.MODELS
    return all(_requested(org, m, rules) == _requested(org, m, ()) for m in models)


def sensitivity_spec(alternatives: dict[str, dict], orgs, models=None) -> dict[str, dict]:
    """Per alternative: `runs` {org: engine rules} it runs itself, `borrows` {org: the
    alternative whose runs it shares, or default}, `executor_suffix` (its runs' executor
    name ends so when it has constants of its own, else null). Rules an organization does
    not run (inert) are dropped from its key, so its runs are shared."""
    spec, seen = {}, {}  # seen: (org, constants, rules) -> first alternative that ran it
    for name, alt in alternatives.items():
        runs, borrows = {}, {}
        for org in (o.upper() for o in orgs):
            constants, rules = _split(alt, org)
            key = (org, constants, () if inert(org, rules, models) else rules)
            if not key[1] and not key[2]:
                borrows[org] = DEFAULT
            elif key in seen:
                borrows[org] = seen[key]
            else:
                seen[key] = name
                runs[org] = list(key[2])
        constants = _split(alt, "")[0]
        spec[name] = {"runs": runs, "borrows": borrows,
                      "executor_suffix": f"-{name}" if constants else None,
                      "why": alt.get("why", "")}
    return spec


def _block(test_block: dict, rate: float, orgs: list[str], rules: list[str],
           constants: tuple[str, ...], name: str | None) -> dict:
    block = {**test_block, "load.rate": rate, "org": ",".join(o.lower() for o in orgs)}
    for override in rules:
        key, value = override.split("=", 1)
        block[key] = value
    for override in constants:  # `++`: a derived device profile's file lacks the key
        key, value = override.split("=", 1)
        block[f"++{key}"] = value
    if name:
        block["executor.name"] = name
    return block


def sensitivity_blocks(regime: dict, test_blocks: dict, high: str, alternatives: dict,
                       spec: dict) -> dict:
    """The campaign's blocks: per test block (model and budget) and alternative, one block
    per group of the organizations it runs with the same rules, at the budget's higher load."""
    blocks = {}
    for block_name, test_block in test_blocks.items():
        entry = regime[test_block["model"]]
        level = block_name.rsplit("_", 1)[1]
        rate = entry["rates"][level][high]
        for alt, s in spec.items():
            groups: dict[tuple, list[str]] = {}
            for org, rules in s["runs"].items():
                groups.setdefault(tuple(rules), []).append(org)
            constants = _split(alternatives[alt], "")[0]
            name = (f"{entry['device_name']}{s['executor_suffix']}"
                    if s["executor_suffix"] else None)
            for i, (rules, orgs) in enumerate(groups.items()):
                blocks[f"{block_name}_{alt}_{i}"] = _block(
                    {k: v for k, v in test_block.items() if k != "load.rate"}, rate, orgs,
                    list(rules), constants, name)
    return blocks


def write_sensitivity(regime: dict, test_blocks: dict, high: str) -> dict:
    """Write conf/campaign/models_sens.yaml; return the spec the page reads."""
    alternatives = chosen_alternatives()
    spec = sensitivity_spec(alternatives, regime_mod.ORGS)
    blocks = sensitivity_blocks(regime, test_blocks, high, alternatives, spec)
    regime_mod.campaign_file(
        "models_sens", "Issue 48 sensitivity (experiments/campaigns/models_sens.py): every "
        "test cell at the higher load\nunder S2's other slab policies and every identified "
        "alternative of conf/sensitivity/\nalternatives.yaml; organizations whose runs would "
        "repeat others' borrow them (the spec in\nconf/calibration/models_regime.yaml).",
        {"load": {"arrival": "poisson"}},
        {"org": ",".join(regime_mod.ORGS), "seed": f"range({SENS_SEEDS[0]},{SENS_SEEDS[1]})"},
        blocks, question="sensitivity")
    return spec
