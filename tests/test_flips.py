"""analysis.flips: the `holds_under` column on planted contrasts (one flips its sign under
one alternative, one its decision under another, one holds under all)."""

from __future__ import annotations

import pandas as pd

from analysis import flips
from analysis.inference.families import FamilyResult

REJECT_POS = "reject H0 (positive)"


def _long(rows):
    return pd.DataFrame([{"alternative": a, "campaign": f"sens_{a}", "question": "ARMS",
                          "family": "ARMS-9", "test": t, "label": t, "predicted": "none",
                          "n": 12, "effect": e, "unit": "%", "p_holm": 0.01, "decision": d,
                          "status": "accepted"} for a, t, e, d in rows])


PLANTED = _long([
    ("default", "JENGA_vs_S2", 17.5, REJECT_POS),
    ("slab_dense", "JENGA_vs_S2", -1.5, REJECT_POS),  # the planted sign flip
    ("identified_a", "JENGA_vs_S2", 16.0, REJECT_POS),
    ("default", "D0_vs_S2", 5.0, REJECT_POS),
    ("slab_dense", "D0_vs_S2", 4.0, REJECT_POS),
    ("identified_a", "D0_vs_S2", 0.5, "not rejected"),  # the planted decision change
    ("default", "S2M_vs_S2", 2.0, REJECT_POS),
    ("slab_dense", "S2M_vs_S2", 1.0, REJECT_POS),
    ("identified_a", "S2M_vs_S2", 3.0, REJECT_POS),
])


def test_a_planted_flip_is_reported_as_depending_on_its_rule():
    texts = flips.flip_texts(PLANTED)
    assert texts[("ARMS-9", "JENGA_vs_S2")] == "depends on slab_dense (sign)"
    assert texts[("ARMS-9", "D0_vs_S2")] == "depends on identified_a (decision)"
    assert texts[("ARMS-9", "S2M_vs_S2")] == "holds under all 2 alternatives"


def test_smoke_reruns_say_they_decide_nothing():
    smoke = PLANTED.assign(campaign=PLANTED["campaign"] + "_smoke", n=3)
    texts = flips.flip_texts(smoke)
    assert texts[("ARMS-9", "JENGA_vs_S2")] == ("depends on slab_dense (sign) "
                                                "(smoke reruns, n = 3: signs only)")


def test_a_refused_rerun_is_not_a_flip():
    """An alternative whose runs are incomplete is refused by the plan check: no effect, no
    decision, and no claim that the contrast depends on it."""
    refused = _long([("identified_b", "JENGA_vs_S2", float("nan"), "refused")]).assign(n=0)
    texts = flips.flip_texts(pd.concat([PLANTED, refused], ignore_index=True))
    assert texts[("ARMS-9", "S2M_vs_S2")] == "holds under all 2 alternatives"
    assert texts[("ARMS-9", "JENGA_vs_S2")] == "depends on slab_dense (sign)"


def test_without_a_default_rerun_nothing_is_claimed():
    texts = flips.flip_texts(PLANTED[PLANTED["alternative"] != "default"])
    assert set(texts.values()) == {"not compared (no default rerun)"}


def _family(tests):
    table = pd.DataFrame({"test": tests, "effect": [1.0] * len(tests),
                          "decision": [REJECT_POS] * len(tests)})
    return FamilyResult("Q1", "EXT-22", "primary", "sign_flip_holm", "", True, [],
                        tables={"throughput_span": table}, primary="throughput_span")


def test_every_page_family_gets_the_column(monkeypatch):
    """A primary family the study does not rerun says so; a listed one with runs gets its
    text per test; a listed one without runs says how to collect them."""
    spec = {"families": [{"plan": "arms", "family": "ARMS-9"}], "alternatives": {}}
    unlisted = _family(["t1"])
    flips.add_flip_columns([unlisted], con=None, spec=spec)
    assert list(unlisted.tables["throughput_span"][flips.COLUMN]) == [flips.NOT_LISTED]

    import analysis.studies.sensitivity as sens

    listed = _family(["JENGA_vs_S2", "other"])
    listed.question, listed.name = "ARMS", "ARMS-9"
    monkeypatch.setattr(sens, "load_inputs", lambda con: (pd.DataFrame({"seed": [1]}), None))
    monkeypatch.setattr(sens, "evaluate",
                        lambda runs, spec, plan_dir=None, record=None: (PLANTED, {}))
    flips.add_flip_columns([listed], con=None, spec=spec)
    assert list(listed.tables["throughput_span"][flips.COLUMN]) == [
        "depends on slab_dense (sign)", flips.NOT_RUN]


def _plan_yaml(path):
    import yaml

    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def test_every_registered_page_with_a_primary_family_has_the_column(monkeypatch):
    """Each question and campaign page whose plan has a primary family gets a `holds_under`
    column that compares or says why not: never 'not listed' (every such family is listed
    in conf/sensitivity/alternatives.yaml, as rerun or not_rerun with its reason)."""
    from analysis.inference import prereg
    from analysis.questions import campaign_pages, question_pages
    from analysis.studies import sensitivity as sens

    monkeypatch.setattr(sens, "load_inputs", lambda con: (pd.DataFrame(), None))
    names = {getattr(p, "PLAN", None) or getattr(p, "QUESTION", "")
             for p in (*question_pages(), *campaign_pages())}
    plans = sorted(n for n in names if n and (prereg.PLAN_DIR / f"{n}.yaml").is_file())
    assert {"q1", "q11_state_codec", "arms", "models", "tier", "traces", "vllm_knobs"} <= set(plans)
    seen = 0
    for name in plans:
        plan = _plan_yaml(prereg.PLAN_DIR / f"{name}.yaml")
        for fam in (f for f in plan.get("families", []) if f.get("role") == "primary"):
            result = _family([t["id"] for t in fam.get("tests") or [{"id": "t"}]])
            result.question, result.name = plan["question"], fam["name"]
            flips.add_flip_columns([result], con=None)
            column = set(result.tables["throughput_span"][flips.COLUMN])
            assert flips.NOT_LISTED not in column, (name, fam["name"])
            seen += 1
    assert seen >= len(plans) - 1  # every page's plan but one without a primary family


def test_every_plan_with_a_primary_family_is_listed():
    """Also the plans no page module names itself (Q6's development search)."""
    from analysis.inference import prereg

    spec = flips._alternatives()
    listed = {(e["plan"], e["family"]) for e in (*spec["families"], *spec["not_rerun"])}
    primary = {(path.stem, f["name"]) for path in prereg.PLAN_DIR.glob("*.yaml")
               for f in (_plan_yaml(path) or {}).get("families", [])
               if f.get("role") == "primary"}
    assert len(primary) >= 20 and primary <= listed, sorted(primary - listed)
