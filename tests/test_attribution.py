"""Hit attribution (serving_core/attribution.py) and Q7's lineage counts
(analysis/pages/lineage.py): the waterfall on a hand-built run computed by hand, the
identity ideal = adopted + losses on every run of the placement smoke campaign (checked
independently by ledgers.check) and a planted broken cause that the check catches."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import duckdb
import numpy as np
import pandas as pd
import pytest

import ledgers
from analysis import cli
from analysis.inference import prereg
from analysis.pages import lineage as q7_lineage
from analysis.pages import readouts
from analysis.pages.render import QuestionResult
from analysis.questions import placement
from ledgers import check
from serving_core import attribution
from serving_core.attribution import HitAttribution, PrefixIndex, identity_violations
from serving_core.memory.prefix_cache import PrefixHit

REPO = Path(__file__).resolve().parent.parent


def _obj(key, producer, checkpoint=True):
    return SimpleNamespace(kind=int(checkpoint), key=key, producer=producer)


def _req(rid, prompt, generated=()):
    prompt = np.asarray(prompt, dtype=np.int64)
    return SimpleNamespace(rid=rid, spec=SimpleNamespace(prompt=prompt, salt=""),
                           num_generated=len(generated), tokens=[*prompt, *generated])


def test_prefix_index_finds_the_longest_shared_prefix_among_earlier_sequences():
    index = PrefixIndex()
    index.insert("", [1, 2, 3, 4, 5])
    index.insert("", [1, 2, 9])
    index.insert("x", [1, 2, 3, 4, 5, 6])  # another salt: never shared
    assert index.longest_shared("", [1, 2, 3, 4, 7]) == 4
    assert index.longest_shared("", [1, 2, 9, 9]) == 3
    assert index.longest_shared("", [2]) == 0
    assert index.longest_shared("y", [1, 2]) == 0


def test_waterfall_of_a_hand_built_run():
    """Blocks of 16 tokens (keys k1..k9), a checkpoint every 64 tokens (keys k4 and k8)."""
    att = HitAttribution(block_tokens=16, interval=64, tier=False)
    keys = [f"k{i}" for i in range(1, 10)]  # blocks 1..9 of the request's prompt
    # request 1 (the producer) was admitted first with the same 150-token prefix
    first = _req(1, list(range(150)) + [7, 7])
    att.admitted(first, SimpleNamespace(keys=keys, jadopt=0,
                                        hit=PrefixHit(0, 0, 0, 0)), SimpleNamespace(
        attention={}, checkpoints={}))
    att.on_publish(_obj("k4", 1))    # checkpoint at 64
    att.on_publish(_obj("k8", 1))    # checkpoint at 128
    att.on_loss(_obj("k8", 1), "slab_reclaim")  # lost through its slab: a group loss
    # request 2: shares 150 tokens, 170-token prompt; attention cached up to 144, the
    # checkpoint at 64 present, the one at 128 lost; it adopts 64
    second = _req(2, list(range(150)) + [9] * 20)
    cache = SimpleNamespace(attention={}, checkpoints={"k4": object()})
    att.admitted(second, SimpleNamespace(keys=keys, jadopt=64, hit=PrefixHit(144, 128, 64, 64)),
                 cache)
    att.on_publish(_obj("k8", 3))  # republished later by request 3: not before the lookup
    cols = att.columns([1, 2])
    row = {c: cols[c][2] for c in attribution.ATTRIBUTION_COLUMNS}
    # ideal 150 -> block grid 144 (6 lost) -> checkpoint grid of 64 with a checkpoint ever
    # published: 128 (16 lost to placement) -> published before the lookup: 128 -> within
    # attention 144: 128 -> present or lost with its own pages: 64 (the group loss at 128
    # charges 64) -> adopted 64
    assert row == {"ideal_prefix_tokens": 150, "cached_attention_tokens": 144,
                   "lost_block_tokens": 6, "lost_placement_tokens": 16,
                   "lost_admission_tokens": 0, "lost_attention_tokens": 0,
                   "lost_group_tokens": 64, "lost_checkpoint_tokens": 0,
                   "lost_tier_tokens": 0}
    assert cols["ideal_prefix_tokens"][1] == 0  # nothing before the first request


def test_admission_and_placement_losses_are_told_apart():
    att = HitAttribution(block_tokens=16, interval=64, tier=False)
    keys = [f"k{i}" for i in range(1, 9)]
    first = _req(1, list(range(140)))
    nothing = SimpleNamespace(attention={}, checkpoints={})
    att.admitted(first, SimpleNamespace(keys=keys, jadopt=0, hit=PrefixHit(0, 0, 0, 0)),
                 nothing)
    att.on_publish(_obj("k4", 1))  # the checkpoint at 64, before request 2's lookup
    second = _req(2, list(range(140)) + [5])
    att.admitted(second, SimpleNamespace(keys=keys, jadopt=64, hit=PrefixHit(64, 64, 64, 64)),
                 SimpleNamespace(attention={}, checkpoints={"k4": object()}))
    att.on_publish(_obj("k8", 2))  # its own checkpoint at 128: not another request's
    third = _req(3, list(range(140)) + [6])
    att.admitted(third, SimpleNamespace(keys=keys, jadopt=64, hit=PrefixHit(128, 128, 128, 64)),
                 SimpleNamespace(attention={}, checkpoints={"k4": object()}))
    cols = att.columns([2, 3])
    # request 2: 140 -> 128 (block 12); no other request ever published 128: placement 64
    assert [cols[c][2] for c in attribution.LOSS_COLUMNS] == [12, 64, 0, 0, 0, 0, 0]
    # request 3: request 2 published 128 before its lookup, yet it was found absent and the
    # attention reached 128: charged to the checkpoint (evicted while attention present)
    assert [cols[c][3] for c in attribution.LOSS_COLUMNS] == [12, 0, 0, 0, 0, 64, 0]


def test_lineage_counts_of_a_hand_built_run():
    rows = [  # (event, request_id, episode, cause, cause_request_id, age_s, same_step)
        ("PUBLISH", 1, 0, "", -1, np.nan, 0), ("PUBLISH", 2, 0, "", -1, np.nan, 1),
        ("PUBLISH", 3, 0, "", -1, np.nan, 1), ("ADOPT", 4, 1, "", -1, 2.0, 0),
        ("DEPTH_UP", 5, 1, "checkpoint", 2, np.nan, 0),
        ("DEPTH_DOWN", 5, 1, "checkpoint", 6, np.nan, 0),   # another request's allocation
        ("DEPTH_DOWN", 7, 1, "attention", 7, np.nan, 0),    # its own: not other-request
        ("DEPTH_DOWN", 8, 2, "attention", -1, np.nan, 0),   # a reset: no request
        ("END", 1, 0, "lru", 6, 3.0, 0), ("END", 2, 0, "slab_reclaim", 6, 5.0, 0),
        ("END", 3, 0, "run_end", -1, 9.0, 0)]
    lineage = pd.DataFrame(rows, columns=["event", "request_id", "episode", "cause",
                                          "cause_request_id", "age_s", "same_step"])
    lineage.insert(0, "run_id", "r")
    episodes = pd.DataFrame({"run_id": "r", "request_id": [5, 7, 8, 9],
                             "episode": [1, 1, 2, 1],
                             "depth_class": ["shallower", "shallower", "shallower", "deeper"]})
    got = q7_lineage.lineage_counts(lineage, episodes).iloc[0].to_dict()
    assert {k: got[k] for k in q7_lineage.COUNTS} == {
        "publication_events": 3, "depth_increasing_publications": 1,
        "depth_decreasing_losses": 3, "same_step_ambiguous_publications": 2,
        "reduced_depth_episodes": 3, "reduced_with_other_request_loss": 1, "adoptions": 1,
        "ends_lru": 1, "ends_slab_reclaim": 1, "ends_pool_pressure": 0, "ends_reset": 0,
        "ends_run_end": 1}
    assert got["median_end_age_s"] == 4.0  # median of 3 and 5 (run_end excluded)


@pytest.fixture(scope="module")
def smoke_root(tmp_path_factory):
    """`make placement SMOKE=1` at one budget, two placements and 8 requests a run (8 runs)."""
    tmp = tmp_path_factory.mktemp("placement")
    root = tmp / "ledgers"
    args = ("budget=b108 engine.checkpoint_placement=step_end,junction "
            f"workload.num_requests=8 hydra.sweep.dir={tmp / 'sweep'}")
    proc = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed",
                           "placement", "SMOKE=1", f"LEDGER_ROOT={root}",
                           f"REPORT_DIR={tmp / 'reports'}", f"ARGS={args}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root, tmp / "reports" / "placement.md"


def _requests(root) -> pd.DataFrame:
    con = ledgers.connect(root)
    try:
        return con.execute("SELECT * FROM requests").df()
    finally:
        con.close()


def test_smoke_campaign_attribution_adds_up_on_every_run(smoke_root):
    root, page = smoke_root
    requests = _requests(root)
    assert requests["run_id"].nunique() == 8
    finished = requests[requests["status"] == "finished"]
    assert len(finished) and (finished["ideal_prefix_tokens"] >= 0).all()
    assert identity_violations(requests.to_dict("records")) == []
    assert check.check(root).problems["requests whose hit attribution does not add up"] == []
    text = page.read_text()
    assert "vLLM issue 45238" in text and "lost_block" in text and "placement" in text


def test_a_planted_broken_cause_is_caught(smoke_root):
    requests = _requests(smoke_root[0])
    victim = requests.index[requests["ideal_prefix_tokens"] > 0][0]
    planted = requests.copy()
    planted.loc[victim, "lost_placement_tokens"] += 16  # a cause charging tokens it did not
    lines = identity_violations(planted.to_dict("records"))
    assert len(lines) == 1 and f"request {planted.loc[victim, 'request_id']}:" in lines[0]
    con = duckdb.connect()
    con.register("requests", planted)
    assert len(check._attribution(con)) == 1  # the ledger check sees it too
    moved = requests.copy()  # tokens moved into a cause from one that had none: the sum
    moved.loc[victim, "lost_tier_tokens"] -= 8  # holds, but a loss is negative
    moved.loc[victim, "lost_block_tokens"] += 8
    assert len(identity_violations(moved.to_dict("records"))) == 1


def test_the_page_names_the_workload_of_each_campaign():
    assert placement.workload("placement_shift_below_smoke") == "shift_below"
    assert placement.workload("placement_shared") == "shared"



@pytest.mark.filterwarnings("ignore::ledgers.catalog.LedgerWarning")  # an empty root
def test_a_standalone_page_passes_allow_changed_plan_and_says_so(tmp_path):
    """`--allow-changed-plan` reaches the page's analysis, and the page says it was given."""
    seen = []

    def analyze(con, *, allow_changed_plan=False):
        seen.append(allow_changed_plan)
        return QuestionResult("placement", "t", ("placement",), (), 0)

    for flag in ((), ("--allow-changed-plan",)):
        out = tmp_path / ("allowed" if flag else "plain")
        assert cli.question_page_main("p", None, "placement", analyze,
                                      ["--ledgers", str(tmp_path), "--out", str(out),
                                       *flag]) == 0
        assert (cli.CHANGED_PLAN_NOTE in (out / "placement.md").read_text()) == bool(flag)
    assert seen == [False, True]


@pytest.mark.slow  # two page writes, ~2.7 s of CPU each: the test above covers the flag
def test_the_standalone_page_accepts_an_amended_plan_only_when_told(smoke_root, tmp_path,
                                                                    monkeypatch):
    """Runs collected before an amendment carry the plan's earlier hash: the page alone
    refuses them unless --allow-changed-plan is given, and then says so at its top."""
    real = prereg.load_plan

    def amended(name, plan_dir=None):  # the plan as amended after the runs
        return replace(real(name, plan_dir or prereg.PLAN_DIR), plan_hash="0" * 64)

    monkeypatch.setattr(prereg, "load_plan", amended)
    monkeypatch.setattr(readouts, "load_plan", amended)
    for flag, verdict in (((), "refused"), (("--allow-changed-plan",),
                                            "accepted (allow_changed_plan)")):
        out = tmp_path / ("allowed" if flag else "plain")
        assert placement.main(["--ledgers", str(smoke_root[0]), "--out", str(out), *flag]) == 0
        text = (out / "placement.md").read_text()
        assert f"plan changed after collection ({verdict})" in text
        assert (cli.CHANGED_PLAN_NOTE in text) == bool(flag)
