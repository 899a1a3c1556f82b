"""tests/cpu_log.py: per-file and per-test CPU totals of a HSL_TEST_CPU_LOG file, checked on
a hand-written log (totals added up by hand)."""

from __future__ import annotations

import json

import cpu_log
import run_order


def _log(path, rows):
    path.write_text("".join(json.dumps({"test": t, "cpu_s": c, "wall_s": 9.0, "worker": "gw0"})
                            + "\n" for t, c in rows))
    return path


def test_totals_by_file_and_test_and_against_an_older_log(tmp_path):
    new = _log(tmp_path / "new.jsonl", [("tests/test_a.py::x", 1.5), ("tests/test_a.py::y", 2.0),
                                        ("tests/test_b.py::z", 0.5),
                                        ("tests/test_a.py::x", 1.0)])  # rerun: the last counts
    old = _log(tmp_path / "old.jsonl", [("tests/test_a.py::x", 3.0), ("tests/test_b.py::z", 1.0)])
    tests = cpu_log.load(new)
    assert tests == {"tests/test_a.py::x": 1.0, "tests/test_a.py::y": 2.0,
                     "tests/test_b.py::z": 0.5}
    assert cpu_log.by_file(tests) == {"tests/test_a.py": 3.0, "tests/test_b.py": 0.5}
    text = cpu_log.report(tests, top=1, older=cpu_log.load(old))
    lines = text.splitlines()
    assert lines[0] == "3 tests, 3.5 CPU seconds (before: 2 tests, 4.0 s, -12.5 %)"
    assert "     3.0  85.7%      3.0  tests/test_a.py" in lines  # top 1 file: a, 3.5 s total
    assert not any("test_b.py" in line for line in lines)
    assert "    2.00  tests/test_a.py::y" in lines


def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys):
    assert cpu_log.main([str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip().startswith("error: log=")
    log = _log(tmp_path / "l.jsonl", [("tests/test_a.py::x", 1.0)])
    assert cpu_log.main([str(log), "--top", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --top=0: allowed integers >= 1"


def test_write_costs_puts_each_files_wall_seconds_costliest_first(tmp_path, capsys):
    log = _log(tmp_path / "l.jsonl", [("tests/test_a.py::x", 1.0), ("tests/test_b.py::y", 1.0),
                                      ("tests/test_b.py::z", 1.0)])  # wall 9.0 each
    costs = tmp_path / "durations.json"
    assert cpu_log.main([str(log), "--write-costs", str(costs)]) == 0
    assert list(json.loads(costs.read_text()).items()) == [("tests/test_b.py", 18.0),
                                                           ("tests/test_a.py", 9.0)]
    assert run_order.load_costs(costs) == {"tests/test_b.py": 18.0, "tests/test_a.py": 9.0}
    assert run_order.load_costs(tmp_path / "missing.json") == {}


def test_files_go_costliest_first_unknown_ones_at_the_median_tests_in_order():
    costs = {"a": 1.0, "b": 5.0, "c": 3.0, "d": 10.0}  # median 4.0
    assert run_order.file_order(["a", "new", "b", "c", "d"], costs) == ["d", "b", "new", "c", "a"]
    assert run_order.file_order(["y", "x"], {}) == ["y", "x"]  # no table: collection order

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item(n) for n in ("a::1", "b::1", "a::2", "b::2", "c::1")]
    run_order.order_items(items, {"a": 1.0, "b": 2.0})
    assert [i.nodeid for i in items] == ["b::1", "b::2", "c::1", "a::1", "a::2"]
