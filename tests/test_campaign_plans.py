"""Campaign run sets against the design's counts (docs/paper_design.md sections 4, 5),
cross-campaign reuse, and the preregistered plans satisfied by exactly the runs the
campaigns collect.

Every campaign is planned (composed and validated, nothing run) once per session;
the counts are the document's, written out here, not derived from the configs.
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import traceback
from collections import Counter
from dataclasses import dataclass

import pandas as pd
import pytest

from analysis.inference import prereg
from experiments.campaigns import campaign as camp
from experiments.campaigns.sweeps import Job
from experiments.runners.ledger_io import RunKey, cell_columns
from experiments.runners.provenance import prereg_plan_hash

CAMPAIGNS = ("q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8", "q9", "d0_split", "caps",
             "bursts", "pinning", "orig5", "q10_tq4", "q6_development", "tier",
             "q11_state_codec")
EXT = tuple(range(42000, 42012))


@dataclass(frozen=True)
class Planned:
    """What the tests read of a planned run: its job, its key and its config's cell columns."""

    job: Job
    key: RunKey
    columns: dict


def _tier_bytes(cfg) -> int:
    """The host tier's size as analysis reads it back from a run's engine_config (-1: none)."""
    tier = (cfg.get("host_tier") or {}).get("capacity_bytes")
    return -1 if tier is None else int(tier)


def as_planned(runs) -> tuple[Planned, ...]:
    """What the tests read of plan_campaign's runs."""
    return tuple(Planned(r.job, r.key, {**cell_columns(r.cfg, r.resolved),
                                        "host_tier_bytes": _tier_bytes(r.cfg)}) for r in runs)


def _plan_all() -> dict[str, tuple | str]:
    """name -> its planned runs (or the error planning raised, as text)."""
    out: dict[str, tuple | str] = {}
    for name in CAMPAIGNS:
        try:
            runs = camp.plan_campaign([f"campaign={name}", "ledger_root=/nonexistent/ledgers"])[1]
        except Exception:  # noqa: BLE001 - reported by the tests of that campaign
            out[name] = traceback.format_exc()
            continue
        out[name] = as_planned(runs)
    return out


@functools.cache
def _plans() -> dict[str, tuple | str]:
    """Every campaign planned (composed and validated by plan_campaign) in a forked child,
    which sends back what the tests read and exits without freeing anything: the ~2,000
    composed configs are millions of OmegaConf objects in reference cycles, and collecting
    them in this process cost about as much as a fifth of the planning."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plan, send, leave without cleanup
        code = 1
        try:
            os.close(read)
            gc.freeze()  # the collector walks only what the planning makes
            with os.fdopen(write, "wb") as pipe:
                pickle.dump(_plan_all(), pipe, protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the planning child failed (wait status {status})"
    return pickle.loads(data)


def planned(name: str) -> tuple[Planned, ...]:
    runs = _plans()[name]
    if isinstance(runs, str):
        raise AssertionError(f"planning campaign={name} raised:\n{runs}")
    return runs


def frame(runs) -> pd.DataFrame:
    return pd.DataFrame([
        {**r.columns, "campaign": r.key.campaign, "run_id": r.key.run_id,
         "block": r.job.block, "status": "complete", "adopted": True,
         "prereg_plan_hash": prereg_plan_hash(r.key.question)} for r in runs])


@functools.cache
def design() -> pd.DataFrame:
    """Every distinct run of every campaign: what a full collection leaves in the ledgers."""
    runs = pd.concat([frame(planned(c)) for c in CAMPAIGNS], ignore_index=True)
    return runs.drop_duplicates("run_id").reset_index(drop=True)


# (campaign, total runs, runs per home campaign) as docs/paper_design.md sections 4 and 5
# count them.
COUNTS = {
    "q1": (126, {"q1": 126}),                    # Exp 1a 108 + Exp 1b 18
    "q2": (54, {"q2": 18, "q3": 36}),            # anchors 2a/2b 18; Exp 2c = Q3's q = 0
    "q3": (144, {"q3": 96, "q1": 36, "q4": 12}),  # 144, of which Q1's 36 (and Q4's D0 12)
    "q4": (144, {"q4": 36, "q1": 108}),          # D0 36 + Q1's Exp 1a
    "q5": (78, {"q5": 72, "orig5": 6}),          # 66 curve runs + the b108 common six (A19)
    "q6": (360, {"q6": 360}),
    "q7": (24, {"q7": 24}),
    "q8": (6, {"q8": 6}),
    "q9": (24, {"q9": 24}),
    "d0_split": (120, {"d0_split": 96, "q4": 24}),  # split 96; default from Q4
    "caps": (72, {"caps": 48, "q5": 12, "orig5": 6, "bursts": 6}),  # + six-seed cap 8 vs 63
    "bursts": (24, {"bursts": 18, "q5": 6}),
    "pinning": (96, {"pinning": 72, "q5": 12, "orig5": 12}),  # 72 fresh + 24 R1
    "orig5": (84, {"orig5": 54, "q5": 12, "caps": 6, "bursts": 12}),  # 2 x (6 + 4 x 9)
    "q10_tq4": (288, {"q10_tq4": 144, "q1": 108, "q4": 36}),  # TQ4 144; bf16 Exp 1a + Q4 D0
    "q6_development": (105, {"q6_development": 105}),  # 2 x 3 x 5 x 3 + S2 b83 5 x 3
    "tier": (216, {"tier": 144, "q1": 48, "q4": 24}),  # 3 orgs x 2 budgets x 2 tiers x 12
    # primary 2 models x 5 orgs x 10 seeds; b108, isolate, granite, granite_tq4 2 x 5 x 3 each;
    # tq4 2 x 5 x 2 budgets x 3; int8 4 orgs x 3
    "q11_state_codec": (292, {"q11_state_codec": 100 + 30 + 30 + 60 + 30 + 30 + 12}),
}


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_campaign_run_counts_match_the_design(name):
    runs = planned(name)
    total, by_home = COUNTS[name]
    assert len(runs) == total
    assert Counter(r.key.campaign for r in runs) == by_home
    assert len({r.key.run_id for r in runs}) == total


def test_exp1a_and_exp1b_sizes_and_design_values():
    runs = frame(planned("q1"))
    exp1a = runs[runs.block == "exp1a"]
    assert len(exp1a) == 108 and set(exp1a.seed) == set(EXT)
    assert set(exp1a.cap) == {63} and set(exp1a.rate) == {3.0} and set(exp1a.org) == {
        "S0", "S1", "S2"}
    low = runs[runs.block.str.startswith("exp1b")]
    assert len(low) == 18 and set(low.seed) == {0, 1, 2} and set(low.rate) == {0.8}
    assert set(zip(low.budget, low.cap, strict=True)) == {("b63", 63), ("b108", 109)}


def test_design_values_split_grid_and_pinning():
    split = frame(planned("d0_split"))
    fresh = split[split.campaign == "d0_split"]
    assert sorted(set(fresh.d0_attention_fraction)) == [0.427383, 0.477383, 0.577383, 0.627383]
    assert set(split[split.campaign == "q4"].d0_attention_fraction) == {0.527383}
    q5 = frame(planned("q5"))
    grid = {b: sorted(set(q5[q5.budget == b].rate)) for b in ("b63", "b108")}
    assert grid == {"b63": [0.8, 1.3, 1.7, 2.2, 3.0], "b108": [0.8, 1.3, 1.7, 2.2, 3.0, 4.5]}
    assert set(zip(q5.budget, q5.cap, strict=True)) == {("b63", 63), ("b108", 109)}
    for name in ("q1", "q2", "q3", "q4", "q5", "d0_split", "caps", "bursts", "orig5"):
        assert set(frame(planned(name)).pinning_k) == {2}, name
    for name in ("q6", "q7", "q8", "q9"):
        assert set(frame(planned(name)).pinning_k) == {1}, name
    pins = frame(planned("pinning"))
    assert Counter(pins.pinning_k) == {-1: 24, 3: 24, 2: 24, 1: 24}


def test_q3_q4_share_the_b83_endpoint_cells_with_q1_and_never_recollect():
    q3 = frame(planned("q3"))
    assert Counter(zip(q3.q, q3.campaign, strict=True)) == {(0.0, "q3"): 48, (0.5, "q3"): 48,
                                                            (1.0, "q1"): 36, (1.0, "q4"): 12}
    assert set(q3.budget) == {"b83"}
    exp2c = frame(planned("q2")).query("campaign == 'q3'")
    assert set(exp2c.q) == {0.0} and set(exp2c.org) == {"S0", "S1", "S2"}


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_reused_runs_are_the_home_campaigns_own_runs(name):
    """A run another campaign collects has the same id there: it is collected once."""
    for run in planned(name):
        if run.key.campaign != name:
            home = {r.key.run_id for r in planned(run.key.campaign)}
            assert run.key.run_id in home, (name, run.key.campaign, run.job.overrides)


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_every_plan_is_satisfied_by_the_collected_design(name):
    """Each family of conf/prereg/<name>.yaml is accepted on the union of all campaigns'
    runs (cells match on every design column, plan hashes of each home campaign), and every
    run of the campaign belongs to some family of its plan."""
    runs = design()
    plan = prereg.load_plan(name)
    used: set[str] = set()
    for family in plan.families:
        check = prereg.check_family(plan, family, runs)
        assert check.accepted, (family.name, check.reasons()[:3])
        used |= set(check.runs.run_id)
    assert {r.key.run_id for r in planned(name)} <= used


@pytest.mark.parametrize(("name", "family"), [("q5", "b108_common_six"),
                                              ("caps", "cap8_vs_cap63_six_seeds")])
def test_six_seed_comparisons_need_only_their_own_campaign(name, family):
    """`make q5` alone collects the b108 common six, `make campaign C=caps` alone the six-seed
    cap 8 vs cap 63 comparison (issue 20): the family is accepted on that campaign's runs."""
    plan = prereg.load_plan(name)
    check = prereg.check_family(plan, family, frame(planned(name)))
    assert check.accepted, check.reasons()[:3]
    assert set(check.runs.seed) == set(range(6)) and len(check.runs) == 24


FAMILY_RUNS = {("q1", "EXT-22"): 288, ("q10_tq4", "codec_interactions"): 288,
               ("q11_state_codec", "codec_and_ranking"): 100,
               ("q6", "Q6-17"): 192, ("orig5", "ORIG-5"): 84, ("pinning", "PIN-2"): 48,
               ("q7", "probe_containment"): 24,
               ("q8", "retention_depth"): 6, ("q9", "k_ret"): 24}


@pytest.mark.parametrize(("plan_name", "family"), FAMILY_RUNS)
def test_family_run_sets(plan_name, family):
    plan = prereg.load_plan(plan_name)
    assert len(prereg.expected_runs(plan, family)) == FAMILY_RUNS[(plan_name, family)]


def test_a_cell_matches_on_every_design_column():
    runs = design()
    plan = prereg.load_plan("q1")
    moved = runs.copy()
    moved.loc[moved.campaign == "q1", "arrival"] = "onoff"  # same cells under bursts
    check = prereg.check_family(plan, "EXT-22", moved)
    assert not check.accepted and any("S0_b63" in m.cell_id for m in check.missing)
    moved = runs.copy()
    moved.loc[moved.campaign == "q1", "executor"] = "sim:h200"
    assert not prereg.check_family(plan, "EXT-22", moved).accepted
