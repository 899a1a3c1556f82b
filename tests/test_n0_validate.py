"""N0's block alignment knob (vLLM's CPU backend: 128-token alignment) and the comparison of
simulated N0 with real vLLM: pairing by request, agreement counts, and the page when an arm
is missing (the sim arm run for real, fast)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import ledgers
from analysis.questions import n0_validate as nv
from experiments.campaigns.campaign import plan_campaign
from serving_core.geometry import load_geometry
from serving_core.memory import org_layout
from serving_core.planner import plan_budget, units_for


def test_alignment_sets_the_n0_block_and_page():
    for align in (16, 128):
        g = load_geometry("falcon_h1_tiny", n0_block_alignment=align)
        lay = org_layout(g, "N0")
        kv = g.attention_bytes_per_token
        # smallest multiple of `align` tokens whose KV bytes hold one composite
        expect = align * math.ceil(g.composite_bytes / (align * kv))
        assert lay.block_tokens == expect and lay.page_bytes == expect * kv
        assert (expect - align) * kv < g.composite_bytes <= expect * kv
    assert org_layout(load_geometry("falcon_h1_tiny", n0_block_alignment=128), "N0"
                      ).block_tokens == 1664  # vLLM 0.32 CPU's block for this checkpoint
    g = load_geometry("falcon_h1_tiny", n0_block_alignment=128)
    plan = plan_budget(g, "b8")
    assert units_for(plan, "N0") == {"shared": plan.nominal_bytes // (1664 * 1024) - 1}
    with pytest.raises(ValueError, match="n0_block_alignment"):
        load_geometry("falcon_h1_tiny", n0_block_alignment=0)


def test_campaign_plans_both_arms_on_the_same_cells(monkeypatch, tmp_path, tiny_checkpoint):
    # Planning checks the vLLM interpreter exists and the checkpoint (models/<name>) loads.
    fake = tmp_path / "python"
    fake.write_text("")
    monkeypatch.setenv("HSL_VLLM_PYTHON", str(fake))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "falcon_h1_tiny").symlink_to(tiny_checkpoint)
    monkeypatch.chdir(tmp_path)
    _, runs = plan_campaign(["campaign=n0_validate", "ledger_root=/nonexistent"])
    cells = {}
    for run in runs:
        cells.setdefault(run.job.block, set()).add((run.cfg.budget, run.cfg.seed))
        assert run.cfg.model.n0_block_alignment == 128 and run.cfg.org == "n0"
    assert set(cells) == {"vllm", "sim"} and cells["vllm"] == cells["sim"]
    assert len(cells["sim"]) == 6


def _reqs(arm: str, hits: list[int], budget="b8", seed=1) -> pd.DataFrame:
    return pd.DataFrame({"run_id": f"{arm}{budget}{seed}", "request_id": range(len(hits)),
                         "context_id": 0, "prompt_tokens": 2000, "hit_tokens": hits,
                         "ttft_s": 0.1, "arm": arm, "budget": budget, "seed": seed})


def test_pairs_and_agreement_counts():
    reqs = pd.concat([_reqs("vllm", [0, 1664, 1664, 0]), _reqs("sim", [0, 1664, 0, 0]),
                      _reqs("vllm", [0, 1664], budget="b63"), _reqs("sim", [0, 1664, 1664],
                                                                   budget="b63")])
    pairs = nv.paired_requests(reqs)
    assert len(pairs) == 6  # b63's third request finished on one arm only
    assert list(pairs[pairs["budget"] == "b8"]["agree"]) == [True, True, False, True]
    runs = pd.DataFrame({"run_id": ["vllmb81", "simb81", "vllmb631", "simb631"],
                         "arm": ["vllm", "sim", "vllm", "sim"],
                         "budget": ["b8", "b8", "b63", "b63"], "seed": 1,
                         "hit_tokens": [3328, 1664, 1664, 3328],
                         "hit_requests": [2, 1, 1, 2], "preemptions": [0, 0, 0, 0],
                         "throughput_span": 1.0, "ttft_p99": 0.1})
    cells = nv.cell_table(runs, pairs).set_index("budget")
    assert cells.loc["b8", "hits_agree"] == 3 and cells.loc["b8", "paired_requests"] == 4
    assert cells.loc["b63", "hits_agree"] == 2
    text, info = nv.section(runs, reqs)
    assert info["hits_agree"] == 5 and info["by_budget"] == {"b63": [2, 2], "b8": [3, 4]}
    assert info["differ_by_nth"] == {3: 1}  # the third request of context 0 at b8
    assert "5 of 6" in text


def test_one_arm_only_says_what_fills_the_other(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "ledgers"
    rc = subprocess.call([sys.executable, "-m", "experiments.run", "-m", "campaign=n0_validate",
                          f"ledger_root={root}", "hydra.sweeper.params.seed=42000",
                          "hydra.sweeper.blocks.vllm.executor=cpu",  # no vLLM: both simulate
                          "hydra.sweeper.params.budget=b8",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert rc == 0
    con = ledgers.connect(root)
    try:
        runs, reqs = nv.load(con)
    finally:
        con.close()
    assert set(runs["arm"]) == {"sim"} and len(runs) == 1  # both blocks ran the same sim cell
    assert runs["hit_tokens"].iloc[0] > 0 and runs["requests"].iloc[0] == 16
    text, info = nv.section(runs, reqs)
    assert info == {"paired_requests": 0} and "have: sim" in text and "setup-vllm" in text
