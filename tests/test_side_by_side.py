"""The side-by-side table (bench/side_by_side.py) and serve_bench's --concurrency."""

import json

import pytest

from bench import side_by_side
from bench.serve_bench import concurrency_list


def _row(arm, n, tok_s, ttft):
    return {"arm": arm, "concurrency": n, "output_tok_s": tok_s, "ttft_p99_s": ttft,
            "server_cpu_ms_per_token": 1.0, "faults_per_token": 2.0}


def test_table_gives_each_concurrency_its_ratio_against_the_target(tmp_path, capsys):
    rows = [_row("ours S2", 1, 30.0, 0.1), _row("vllm", 1, 20.0, 0.2),
            _row("ours S2", 64, 300.0, 9.0), _row("vllm", 64, 250.0, 10.0)]
    (tmp_path / "glibc_ours.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "glibc_vllm.json").write_text(json.dumps({"rows": rows[:3]}))
    assert side_by_side.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    c1 = next(x for x in lines if x.split()[:3] == ["glibc", "ours", "1"])
    c64 = next(x for x in lines if x.split()[:3] == ["glibc", "ours", "64"])
    assert " 1.50 " in c1 and c1.endswith("ok")
    assert " 1.20 " in c64 and " 1.3x " in c64 and c64.endswith("BELOW")
    assert any("missing arm: vllm" in x for x in lines)
    assert any("no kernels.json" in x for x in lines)


def test_an_empty_folder_is_refused(tmp_path, capsys):
    assert side_by_side.main([str(tmp_path)]) == 2
    assert "no <allocator>_<client>.json" in capsys.readouterr().err


def test_concurrency_list_parses_and_refuses_in_one_line():
    assert concurrency_list(None, 64) == [64]
    assert concurrency_list("1,16,64", 64) == [1, 16, 64]
    for bad in ("", "0,4", "a,b"):
        with pytest.raises(ValueError, match="allowed values are comma-separated"):
            concurrency_list(bad, 64)


def test_an_ours_only_variant_reads_against_its_allocators_vllm_rows(tmp_path, capsys):
    rows = [_row("ours S2", 64, 300.0, 9.0), _row("vllm", 64, 200.0, 10.0)]
    (tmp_path / "glibc_ours.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "glibc-t1_ours.json").write_text(json.dumps({"rows": [
        _row("ours S2", 64, 240.0, 9.5)]}))
    assert side_by_side.main([str(tmp_path)]) == 0
    t1 = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("glibc-t1"))
    assert " 1.20 " in t1 and " 1.3x " in t1 and t1.endswith("BELOW")
