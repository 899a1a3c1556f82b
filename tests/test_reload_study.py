"""The reload study and the boundary matrix over HTTP: the study table's schema and its
audit, the report page from a hand-made table, the prompt templates; end to end (slow)
on the tiny model with real servers started and stopped by the commands."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from analysis.studies import reload_study as page
from experiments.studies import continuation_http as http
from experiments.studies import reload_study as study
from ledgers.check import check
from ledgers.studies import STUDY_SCHEMAS, check_studies, read_study, write_study


def _row(**over) -> dict:
    row = {"study_id": "s", "created_at": "t", "model": "falcon_h1_tiny", "org": "D0",
           "budget": "b63", "pair": 0, "order": "off_on", "server": 1, "host_tier": True,
           "split_last_boundary": True, "n_tokens": 3584, "interval": 1792, "trial": 0,
           "document": 3, "condition": "reload", "path": "host_reload", "reused_tokens": 1792,
           "restored_tokens": 1792, "suffix_tokens": 1792, "first_batch_computed": 1792,
           "first_batch_scheduled": 1792, "ttft_s": 0.5, "e2e_s": 2.0, "output_tokens": 4,
           "output_ids": "[1, 2, 3, 4]", "output_matches": True}
    row.update(over)
    return row


def _columns(rows: list[dict]) -> dict:
    return {name: [r[name] for r in rows] for name in STUDY_SCHEMAS["reload_study"].names}


def test_study_table_round_trips_and_a_wrong_schema_is_reported(tmp_path):
    path = write_study(tmp_path, "reload_study", _columns([_row()]))
    assert read_study(tmp_path, "reload_study").to_pylist() == [_row()]
    assert check_studies(tmp_path) == []
    report = check(tmp_path)
    assert report.notes["Parquet files outside the ledger layout"] == []
    table = pq.read_table(path).drop(["e2e_s"])
    pq.write_table(table, path.with_name("reload_study-2.parquet"))
    problems = check_studies(tmp_path)
    assert len(problems) == 1 and "missing ['e2e_s']" in problems[0]
    assert check(tmp_path).problems["study files with a wrong schema"] == problems


@pytest.mark.parametrize("column, value, message", [
    ("path", "tier", "not in recompute|device_reuse|host_reload"),
    ("condition", "warm", "not in cold|repeat|reload|warmup"),
])
def test_study_table_refuses_values_outside_its_enumerations(tmp_path, column, value, message):
    with pytest.raises(ValueError, match=message):
        write_study(tmp_path, "reload_study", _columns([_row(**{column: value})]))
    assert not (tmp_path / "reload_study").exists() or not list(
        (tmp_path / "reload_study").glob("*.parquet"))


def test_page_groups_by_actual_path_and_counts(tmp_path, capsys):
    """A repeat the device did NOT serve is counted as recompute, not as a repeat hit."""
    rows = [
        _row(condition="warmup", trial=-1, path="recompute", reused_tokens=0,
             restored_tokens=0, suffix_tokens=1024, n_tokens=1024, ttft_s=9.0),
        _row(condition="cold", path="recompute", reused_tokens=0, restored_tokens=0,
             suffix_tokens=3584, first_batch_computed=0, first_batch_scheduled=2048, ttft_s=2.0),
        _row(condition="repeat", path="device_reuse", restored_tokens=0, ttft_s=1.0),
        _row(condition="repeat", path="recompute", reused_tokens=0, restored_tokens=0,
             suffix_tokens=3584, trial=1, ttft_s=2.2, output_matches=False),
        _row(condition="reload", ttft_s=0.8),
    ]
    write_study(tmp_path / "led", "reload_study", _columns(rows))
    code = page.main([str(tmp_path / "led"), "--out", str(tmp_path / "rep")])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"requests": 4, "paths": {"recompute": 2, "device_reuse": 1,
                                             "host_reload": 1}, "mismatches": 1,
                    "study_id": "s"}
    assert code == 1  # a mismatch fails
    text = (tmp_path / "rep" / page.PAGE).read_text()
    assert "| 3584 | repeat | ON | recompute | 1 | 0 | 3584 |" in text
    assert "| 3584 | reload | ON | host_reload | 1 | 1792 | 1792 | 1792+1792 | 0.800 |" in text
    assert "Repeats that reused the device prefix: 1 of 2" in text
    assert "N=3584: B=1792, recomputed N - B=1792" in text
    assert (tmp_path / "rep" / page.FIGURE).stat().st_size > 10_000


def test_templates_are_deterministic_token_ids_of_their_text():
    import quicktok

    enc = quicktok.get_encoding("llama3")
    for name in http.TEMPLATES:
        ids = http.template_ids(name, 600)
        assert len(ids) == 600 and ids == http.template_ids(name, 600)
        assert ids == list(enc.encode(http.template_text(name, 30)))[:600]
        other = http.template_ids(name, 600, document=1)
        assert other[:2] == ids[:2] and other[:8] != ids[:8]  # distinct documents
    assert "规则" in enc.decode(http.template_ids("chinese_rules", 50))
    assert "def step_0" in enc.decode(http.template_ids("python_code", 20))


def test_study_prompts_have_distinct_documents():
    a, b = study.prompt_ids(600, 0, 0), study.prompt_ids(600, 1, 0)
    assert a == study.prompt_ids(600, 0, 0) and a[:16] != b[:16]


@pytest.mark.parametrize("argv, field", [
    (["--trials", "0"], "--trials=0"), (["--pairs", "on_on"], "--pairs='on_on'"),
    (["--lengths", "x"], "--lengths='x'"), (["--org", "q9"], "q9"),
])
def test_study_bad_input_exits_2(argv, field, tmp_path, capsys):
    assert study.main([*argv, "--ledger-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_reload_study_end_to_end(tiny_checkpoint, tmp_path, capsys):
    """Both orders on S2 at N = 1,024 = 2 C (the split publishes 512): every repeat reuses
    512 on the device, every reload restores B = 512 and schedules N - B; outputs agree."""
    code = study.main(["--checkpoint", str(tiny_checkpoint), "--org", "s2", "--lengths", "1024",
                       "--trials", "1", "--output-tokens", "4", "--warmup-tokens", "600",
                       "--ledger-root", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last["mismatches"] == 0
    assert last["paths"] == {"recompute": 4, "device_reuse": 4, "host_reload": 2}
    rows = read_study(tmp_path, "reload_study").to_pylist()
    reloads = [r for r in rows if r["condition"] == "reload"]
    assert {(r["restored_tokens"], r["first_batch_computed"], r["first_batch_scheduled"])
            for r in reloads} == {(512, 512, 512)}
    assert {r["host_tier"] for r in rows if r["condition"] == "reload"} == {True}
    assert [(r["pair"], r["server"], r["host_tier"]) for r in rows
            if r["condition"] == "warmup"] == [(0, 0, False), (0, 1, True), (1, 0, True),
                                               (1, 1, False)]


@pytest.mark.slow
def test_boundary_matrix_over_http(tiny_checkpoint, tmp_path, capsys):
    """S2 and D0 at 2C-1, 2C, 2C+1 and one template: B = p = C floor((N-1)/C), the first
    reload batch computes B, tokens equal the cold run's."""
    code = http.main(["--checkpoint", str(tiny_checkpoint), "--orgs", "s2,d0",
                      "--cases", "2C-1,2C,2C+1", "--output-tokens", "4",
                      "--templates", "python_code", "--template-lengths", "1100",
                      "--template-output-tokens", "4", "--ledger-root", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last["cases"] == 8 and last["ok"] == 8 and last["B_equals_p"]
