"""Host tier and continuation protocol on the tiny model: a save counts only once its
copy completed; a reload into a reset device continues exactly like the cold run; the
expected prefix follows the placement rule; a tier entry at B = N never skips the last
prompt token; the byte audits (destination poisoning, delayed saves, host-to-device
bytes) each catch the fault they exist for."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
from engines import run_simulated, torch_engine

import experiments.studies.continuation as cont
from analysis.studies import continuation as page
from experiments.studies.continuation import ORGS, main
from experiments.workloads.workload import RequestSpec
from serving_core.executor.state_copy import ArenaCopier
from serving_core.geometry import load_geometry
from serving_core.host_tier import HostTier
from serving_core.planner import plan_budget, units_for
from serving_core.request import Request
from serving_core.scheduler import SchedulerConfig
from serving_core.state_manager import HybridStateManager

CAPACITY = 1 << 30  # a tier that holds everything these tests publish


def _engine(model, org="S2"):
    """A torch engine whose state manager logs its publications (what a tier saves)."""
    geometry = load_geometry("falcon_h1_tiny")
    units = units_for(plan_budget(geometry, "b63"), org)
    eng = torch_engine(model, geometry, org, units,
                       SchedulerConfig(cap=4, max_num_batched_tokens=2048, headroom=0.0),
                       clock="virtual")
    eng.sched.state.log_publications()
    return eng


def _served(model, prompt_tokens: int):
    """An engine that has served one request of `prompt_tokens` tokens, and its spec."""
    eng = _engine(model)
    spec = RequestSpec(0, 0.0, np.arange(1, 1 + prompt_tokens, dtype=np.int32), 2, -1, "")
    eng.add_request(spec)
    while eng.num_finished < 1:
        eng.step()
    return eng, spec


def _save(eng, host) -> int:
    """Start saving every entry `eng` published (its state manager, its arena's copier)."""
    return eng.sched.state.save_published(host, ArenaCopier(eng.executor.arena))


def _restore(eng, host, keys):
    """Restore the deepest prefix of `keys` the tier holds into `eng`."""
    return eng.sched.state.restore_prefix(keys, host, ArenaCopier(eng.executor.arena))


def test_a_save_counts_only_after_its_copy_completed(tiny_model):
    eng, spec = _served(tiny_model, 599)
    keys = Request(spec, eng.mem.block_tokens).lookup_keys()
    host = HostTier(CAPACITY, poison=True)
    started = _save(eng, host)
    # one entry: the checkpoint at 512 with its 512-token block
    assert started == len(eng.mem.cache.attention) + len(eng.mem.cache.checkpoints) == 2
    assert host.num_entries == 1 and host.used_bytes == 2 * (512 * 1024 + 1557 * 1024)
    assert host.restorable_prefix(keys, 512, 512) == 0  # copies started, not completed
    assert host.complete() == 2 and host.num_pending == 0
    assert host.restorable_prefix(keys, 512, 512) == 512
    assert _save(eng, host) == 0  # nothing new to copy


def _saved_then_reset(tiny_model, n: int):
    """A served prompt of n tokens saved into a poisoning host tier (copies complete), its
    lookup keys, and a fresh engine with an empty device cache."""
    eng, spec = _served(tiny_model, n)
    host = HostTier(CAPACITY, poison=True)
    _save(eng, host)
    host.complete()
    return eng, host, Request(spec, 512).lookup_keys(), _engine(tiny_model)


def test_restore_goes_into_fresh_units_and_equals_the_saved_state(tiny_model):
    import torch

    eng, host, keys, reset = _saved_then_reset(tiny_model, 699)
    before = reset.mem.usage()["shared"]
    got = _restore(reset, host, keys)
    assert got.prefix_tokens == 512 and len(got.blocks) == 1 and got.checkpoint is not None
    used, cached, free, total = reset.mem.usage()["shared"]
    assert before == (0, 0, total, total)
    # one attention block, three SSM member pages and the conv slab's page (S2)
    assert used == 0 and cached == 1 + 3 + 1
    old_ckpt = eng.mem.cache.checkpoints[keys[0]]
    for (c0, s0), (c1, s1) in zip(eng.executor.arena.read(old_ckpt),
                                  reset.executor.arena.read(got.checkpoint), strict=True):
        assert torch.equal(c0, c1) and torch.equal(s0, s1)
    unit_old = eng.mem.cache.attention[keys[0]].units[0]
    for layer in range(eng.executor.arena.layers):
        assert torch.equal(eng.executor.arena.kv_view(layer)[unit_old],
                           reset.executor.arena.kv_view(layer)[got.blocks[0].units[0]])


def test_continuation_command_last_line(tiny_checkpoint, tmp_path, capsys):
    code = main(["--checkpoint", str(tiny_checkpoint), "--orgs", "s2", "--cases", "C+1",
                 "--output-tokens", "3", "--delayed-save-cases", "none",
                 "--ledger-root", str(tmp_path / "led")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    assert json.loads(out[-1]) == {"pairs": 1, "equal": 1, "B_equals_p": True,
                                   "audits_ok": True, "ok": 1}
    # the page, from the study table (analysis.studies.continuation): the same last line
    assert page.main(["--ledgers", str(tmp_path / "led"), "--out", str(tmp_path / "rep")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == out[-1]
    rows = pq.read_table(next((tmp_path / "led" / "continuation").glob("*.parquet"))).to_pylist()
    assert [(r["n_tokens"], r["restored_prefix_b"], r["credited_prefix_p"]) for r in rows] == [
        (513, 512, 512)]
    assert len(json.loads(rows[0]["cold_tokens"])) == 3
    assert all(r["tokens_equal"] and r["reload_units_fresh"] and r["ok"] for r in rows)
    # 2 layers x (512 tokens x 1,024 B of KV + 1,536 KiB SSM + 21 KiB conv)
    assert rows[0]["bytes_h2d"] == 2 * (512 * 1024 + 1536 * 1024 + 21 * 1024) == 4_237_312
    assert ("| s2 | 513 (C+1) | 512 | step_end+align | 512 | 512 | 512 | 512 | 0 | 512 | "
            "512 / 1 | 4,237,312 | yes | - | yes | yes |") in (
        tmp_path / "rep" / "continuation.md").read_text()


def test_bad_org_exits_2(capsys):
    assert main(["--orgs", "s9"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --orgs='s9': allowed values are {', '.join(ORGS)}")


def test_bad_case_and_fault_exit_2(capsys):
    assert main(["--cases", "2C+x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --cases='2C+x': allowed values are kC, kC+d, kC-d")
    assert main(["--fault", "drop"]) == 2
    assert "--fault='drop'" in capsys.readouterr().err


def test_reference_cases_are_the_offsets_of_the_reference_lengths():
    """At C = 1,792 the nine cases are the reference lengths; at C = 512 the same offsets."""
    lengths = [k * 1792 + d for k, d in map(cont.parse_case, cont.OFFSETS)]
    assert lengths == [3583, 3584, 3585, 3587, 3588, 3589, 5375, 5376, 5377]
    assert [k * 512 + d for k, d in map(cont.parse_case, cont.OFFSETS)] == [
        1023, 1024, 1025, 1027, 1028, 1029, 1535, 1536, 1537]
    assert "n0" in ORGS and "s2_retention" not in ORGS


@pytest.mark.parametrize("n, p", [
    # step_end, aligned chunks, C = 512, budget 2,048 (hand-computed chunk ends)
    (1023, 512),  # [0,512) [512,1023): the boundary 512 ends a step
    (1024, 0),  # one chunk [0,1024): only 1024 = N is published, nothing inside
    (1025, 1024),  # [0,1024) [1024,1025)
    (1536, 0),  # one chunk [0,1536)
    (1537, 1536),
    (2560, 2048),  # [0,2048) [2048,2560): the budget splits at 2048 = N - C
    (3072, 2048),  # [0,2048) [2048,3072)
    (512, 0),  # N = C: the tier entry is at B = N, nothing strictly inside
])
def test_expected_prefix_under_step_end_with_aligned_chunks(n, p):
    assert cont.expected_prefix(n, 512, 2048, step_end=True, align=True) == p


@pytest.mark.parametrize("n, p", [(1024, 512), (1536, 1024), (1023, 512), (1025, 1024),
                                  (2560, 2048), (3072, 2560), (512, 0)])
def test_expected_prefix_with_the_last_boundary_split(n, p):
    """split_last_boundary: a k C prompt's aligned chunk ends at N - C (hand-computed ends:
    1024 -> [512, 1024], 1536 -> [1024, 1536], 3072 -> [2048, 2560, 3072])."""
    assert cont.expected_prefix(n, 512, 2048, step_end=True, align=True, split=True) == p


@pytest.mark.parametrize("n, p", [(3583, 1792), (3584, 1792), (3585, 3584), (5375, 3584),
                                  (5376, 3584), (5377, 5376), (1792, 0)])
def test_expected_prefix_under_every_boundary(n, p):
    """Every boundary a chunk crosses is published: p = C floor((N-1)/C) (C = 1,792)."""
    assert cont.expected_prefix(n, 1792, 2048, step_end=False, align=False) == p
    assert p == 1792 * ((n - 1) // 1792)


@pytest.mark.parametrize("n, placement, p", [
    # C = 512, budget 2,048, aligned chunks (hand-computed chunk ends)
    (1024, "align", 512),  # one chunk [0,1024): vLLM's prefill checkpoint at 512
    (1025, "align", 1024),  # [0,1024) [1024,1025): 1024 ends a step
    (1536, "align", 1024),  # one chunk [0,1536): 1024 inside it, 1536 = N at its end
    (2560, "align", 2048),  # [0,2048) [2048,2560): 2048 ends a step; 2048 < 2048 + C
    (3072, "align", 2560),  # [0,2048) [2048,3072): 2560 = 2048 + C inside the last
    (1024, "junction", 512),  # first request: its tail, from (N - 1) // C = 1 on
    (1025, "junction", 1024), (512, "junction", 0),
])
def test_expected_prefix_under_align_and_junction(n, placement, p):
    assert cont.expected_prefix(n, 512, 2048, True, True, placement=placement) == p


@pytest.mark.parametrize("placement", ["", "align", "junction"])
@pytest.mark.parametrize("org", ["S2", "D0", "N0"])
def test_rule_helper_agrees_with_the_engine(org, placement):
    """The independent rule (chunk ends, published boundaries) matches the checkpoints a
    simulated engine publishes for one cold prompt, at every reference offset and N = kC,
    under the organization's placement and under align and junction."""
    from serving_core.memory import org_layout

    geometry = load_geometry("falcon_h1_tiny")
    C = org_layout(geometry, org).checkpoint_interval
    units = units_for(plan_budget(geometry, "b63"), org)
    cfg = SchedulerConfig(cap=4, max_num_batched_tokens=2048, headroom=0.0,
                          checkpoint_placement=placement or None)
    for k, d in [*map(cont.parse_case, cont.OFFSETS), (1, 0), (4, 0), (5, 0)]:
        n = k * C + d
        spec = RequestSpec(0, 0.0, np.arange(1, n + 1, dtype=np.int32) % 50_000, 1, -1, "")

        class Step:
            def step_seconds(self, *a, **k):
                return 0.01

        for split in (False, True):
            res = run_simulated(geometry, org, units, replace(cfg, split_last_boundary=split),
                                [spec], Step())
            got = sorted(o.boundary for o in res.memory.cache.checkpoints.values())
            rules = res.engine_config
            want = cont.published_boundaries(
                n, C, 2048, rules["checkpoint_placement"] == "step_end",
                rules["align_chunks"], rules["split_last_boundary"], placement)
            assert got == want, (org, n, split)


def test_restore_bytes_match_the_layout_and_a_skipped_copy_shows(tiny_model, monkeypatch):
    """Audit (c): a restore of B = 512 on S2 copies exactly 2 x (512 x 1,024 + SSM + conv)
    bytes host-to-device into the layout's units (1 block + 3 SSM pages); a restore that
    skips the checkpoint copy is caught by the count and by the read-back."""
    geometry = load_geometry("falcon_h1_tiny")
    eng, host, keys, reset = _saved_then_reset(tiny_model, 599)
    got = _restore(reset, host, keys)
    expected, capacity, units, need = cont._restore_sizes(reset.mem, geometry, got)
    assert got.bytes_h2d == expected == 4_237_312 and units == need == 4
    assert capacity == 2 * (4 * 524_288 + 32_768) >= got.bytes_h2d
    assert got.poisoned_units == 4 and cont._restored_exact(host, reset.executor.arena, keys, got)

    monkeypatch.setattr(ArenaCopier, "load_checkpoint", lambda self, obj, data: 0)
    reset = _engine(tiny_model)
    bad = _restore(reset, host, keys)
    assert bad.bytes_h2d == 2 * 512 * 1024 != cont._restore_sizes(reset.mem, geometry, bad)[0]
    assert not cont._restored_exact(host, reset.executor.arena, keys, bad)  # NaN left


def _ssm_missed(self, obj, data):
    """A faulty restore: writes the conv window (the last region), leaves the SSM member
    pages as it found them."""
    regions = self.regions(obj)
    view = self._view(regions[-1])
    view.index_copy_(1, self._index(regions[-1]), data[-1])
    return 0


@pytest.mark.parametrize("poison", [True, False])
def test_poisoning_turns_a_missed_ssm_copy_into_changed_tokens(tiny_model, monkeypatch,
                                                               poison):
    """Audit (a). A restore that misses the SSM state leaves zeros on a fresh device, which
    this random tiny model's greedy tokens do not reveal at 513 tokens; with the destination
    poisoned (NaN) the same miss changes the tokens. Removing the poisoning makes the
    poison=True case fail."""
    monkeypatch.setattr(ArenaCopier, "load_checkpoint", _ssm_missed)
    row = cont.run_pair(tiny_model, load_geometry("falcon_h1_tiny"), "s2", "b63", "C+1", 3, 0,
                        poison=poison)
    assert row.restored_prefix_b == row.credited_prefix_p == 512
    assert not row.restored_exact and not row.ok  # the read-back sees the miss either way
    assert row.tokens_equal is not poison


def test_delayed_save_makes_an_early_request_recompute(tiny_model, monkeypatch):
    """Audit (b). Saves held incomplete: a request arriving in the window restores nothing
    and recomputes (B = p = 0, same tokens); after the window the reload restores 512.
    With the protection removed (entries indexed before their copy landed) the early
    request restores the unlanded (NaN) buffers and the audit fails."""
    geometry = load_geometry("falcon_h1_tiny")
    row = cont.run_pair(tiny_model, geometry, "s2", "b63", "C+1", 3, 0, delayed_save=True)
    assert row.window_pending == 2 and row.window_b == row.window_p == 0
    assert row.window_tokens_equal and row.window_ok and row.ok
    assert row.restored_prefix_b == row.credited_prefix_p == 512

    def complete_early(self, now=None):
        for p in self._pending:  # indexed at once: the copy has not landed
            (self.blocks if p.kind == "a" else self.checkpoints)[p.key] = p.data
        done, self._pending = len(self._pending), []
        self.saves_completed += done
        return done

    monkeypatch.setattr(HostTier, "complete", complete_early)
    row = cont.run_pair(tiny_model, geometry, "s2", "b63", "C+1", 3, 0, delayed_save=True)
    assert row.window_b == 512 and not row.window_ok and not row.ok


def test_a_tier_entry_at_n_never_skips_the_last_prompt_token(tiny_model, tmp_path, capsys,
                                                            tiny_checkpoint):
    """N = C = 512 on S2: the cold step publishes the checkpoint at 512 = N, so the tier
    holds B = N; the reload credits only boundaries strictly inside (none: B = p = 0) and
    its first batch computes the whole prompt. Forcing p = N - 1 over the B = N state (the
    failure the reference study found) is reported as a mismatch, and exits 1."""
    geometry = load_geometry("falcon_h1_tiny")
    row = cont.run_pair(tiny_model, geometry, "s2", "b63", "C", 3, 0)
    assert row.tier_full_depth == 512 == row.n_tokens
    assert row.restored_prefix_b == row.credited_prefix_p == row.expected_p == 0
    assert (row.first_context, row.first_scheduled) == (0, 512) and row.ok
    code = main(["--checkpoint", str(tiny_checkpoint), "--orgs", "s2", "--cases", "C",
                 "--fault", "credit_n_minus_1", "--output-tokens", "3",
                 "--delayed-save-cases", "none", "--ledger-root", str(tmp_path / "l")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1 and json.loads(out[-1])["B_equals_p"] is False
    rows = pq.read_table(next((tmp_path / "l" / "continuation").glob("*.parquet"))).to_pylist()
    assert [(r["restored_prefix_b"], r["credited_prefix_p"], r["first_context"],
             r["first_scheduled"], r["ok"]) for r in rows] == [(512, 511, 511, 1, False)]


def _assert_whole_matrix(code: int, capsys, ledger_root) -> None:
    """The default run covered every arm of the study's ORGS at every reference offset
    (OFFSETS), one row each, and every pair passed every column."""
    pairs = len(ORGS) * len(cont.OFFSETS)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last == {"pairs": pairs, "equal": pairs, "B_equals_p": True,
                                  "audits_ok": True, "ok": pairs}
    rows = pq.read_table(next((ledger_root / "continuation").glob("*.parquet"))).to_pylist()
    assert sorted((r["org"], r["length_case"]) for r in rows) == sorted(
        (org, case) for org in ORGS for case in cont.OFFSETS)


@pytest.mark.slow
def test_every_org_and_reference_length_continues_exactly(tiny_checkpoint, tmp_path, capsys):
    """The whole matrix (make continuation): every arm with checkpoints (S0, S1, S2, D0, N0,
    Jenga, S2 and D0 under Marconi, N0 as vLLM runs it) x 9 lengths, every column."""
    code = main(["--checkpoint", str(tiny_checkpoint), "--ledger-root", str(tmp_path / "l"),
                 "--output-tokens", "4"])
    _assert_whole_matrix(code, capsys, tmp_path / "l")


def test_n0_reload_on_granite_moves_one_page_per_mamba2_layer(granite_tiny_model):
    """Granite tiny (conf/model/granite_hybrid_tiny.yaml) is one storage group of 1 attention
    and 3 Mamba2 layers. N0 as vLLM pages it: KV of one attention layer is 2 (K, V) x 2 heads
    x 32 x 4 B = 512 B per token; one Mamba2 layer's state is 8 x 32 x 64 x 4 (SSM, 65,536 B)
    + (8 x 32 + 2 x 64) x 3 x 4 (conv, 4,608 B) = 70,144 B; the block is the smallest
    multiple of 16 tokens whose KV holds it: ceil(70,144 / (16 x 512)) x 16 = 144 tokens, a
    page of 73,728 B, and a checkpoint takes one page per Mamba2 layer (3). N = 2C+1 = 289
    reloads B = 288: 2 blocks and 1 checkpoint = 5 pages (368,640 B), moving 288 x 512 +
    3 x 70,144 = 357,888 B host-to-device, every member page filled from its layer's bytes."""
    geometry = load_geometry("granite_hybrid_tiny")
    layer_state = 8 * 32 * 64 * 4 + (8 * 32 + 2 * 64) * 3 * 4
    block = -(-layer_state // (16 * 512)) * 16
    assert (layer_state, block) == (70_144, 144)
    row = cont.run_pair(granite_tiny_model, geometry, "n0", "b63", "2C+1", 3, 0)
    assert (row.interval, row.n_tokens, row.restored_prefix_b) == (144, 289, 288)
    assert row.bytes_h2d == row.expected_bytes == 288 * 512 + 3 * layer_state == 357_888
    assert (row.restored_units, row.unit_capacity_bytes) == (5, 5 * block * 512)
    assert row.tokens_equal and row.restored_exact and row.ok


def test_a_one_token_chunk_after_a_reload_repeats_the_decoded_token_bit_for_bit(
        granite_tiny_model):
    """Granite tiny, S0, N = 3C + 1 = 1,537: the cold run computes [0, 1536) as one chunk
    and then decodes token 1,536; the reload adopts the checkpoint at 1,536 and computes the
    same token as a one-token chunk. Both attend with the decode step's kernels
    (torch_executor._OneTokenAttention), so the logprobs repeat bit for bit (the prefill
    attention there gave the same tokens with logprobs off by fp32 rounding)."""
    geometry = load_geometry("granite_hybrid_tiny")
    row = cont.run_pair(granite_tiny_model, geometry, "s0", "b63", "3C+1", 2, 0)
    assert (row.n_tokens, row.restored_prefix_b, row.first_scheduled) == (1537, 1536, 1)
    assert row.same_chunks and row.tokens_equal and row.logprobs_equal and row.ok


@pytest.mark.slow
def test_every_org_and_reference_length_continues_exactly_on_granite(
        granite_tiny_checkpoint, tmp_path, capsys):
    """make continuation MODEL=granite: the whole matrix on the interleaved hybrid (N0: a
    checkpoint of three per-layer pages)."""
    code = main(["--checkpoint", str(granite_tiny_checkpoint), "--preset", "granite_hybrid_tiny",
                 "--ledger-root", str(tmp_path / "l"), "--output-tokens", "4"])
    _assert_whole_matrix(code, capsys, tmp_path / "l")


@pytest.mark.slow
@pytest.mark.parametrize("part", ["conv", "kv"])
def test_damaged_host_state_changes_the_continuation(tiny_model, monkeypatch, part):
    """The comparison can fail: zeroing the reloaded checkpoint's conv state, or the
    reloaded attention blocks, changes the generated tokens while B = p still holds.
    (Zeroing only the SSM state does not change this random tiny model's greedy tokens:
    its SSM contribution at 512 tokens is below the argmax margins.)"""
    import experiments.studies.continuation as cont
    from serving_core.geometry import load_geometry

    restore = HybridStateManager.restore_prefix

    def damaged(self, keys, tier, copier):
        if part == "conv":  # a checkpoint's last region: its conv window
            for regions in tier.checkpoints.values():
                regions[-1].zero_()
        else:
            for regions in tier.blocks.values():
                for region in regions:
                    region.zero_()
        return restore(self, keys, tier, copier)

    monkeypatch.setattr(HybridStateManager, "restore_prefix", damaged)
    row = cont.run_pair(tiny_model, load_geometry("falcon_h1_tiny"), "s2", "b63", "C+1", 6, 0)
    assert row.restored_prefix_b == row.credited_prefix_p == 512
    assert not row.tokens_equal and not row.ok
