"""The register of readings for the AMBIGUOUS items (docs/paper_design.md section 8): complete,
named in the plans consistently, and printed in the report's index."""

from __future__ import annotations

import re

import pytest

from analysis.inference import prereg


def test_every_register_item_has_a_reading_and_an_alternative():
    rows = prereg.load_readings()
    assert [r["id"] for r in rows] == [f"A{i}" for i in range(1, 26)]
    for row in rows:
        assert all(row[f].strip() for f in prereg.READING_FIELDS), row["id"]
        assert row["reading"] != row["alternative"], row["id"]


def test_items_the_plans_name_are_in_the_register():
    known = {r["id"] for r in prereg.load_readings()}
    named = set()
    for path in prereg.PLAN_DIR.glob("*.yaml"):
        if path.name != prereg.READINGS_FILE:
            named |= set(re.findall(r"AMBIGUOUS (A\d+)", path.read_text()))
    assert named and named <= known


def test_incomplete_entry_is_refused(tmp_path):
    (tmp_path / prereg.READINGS_FILE).write_text("A1:\n  item: x\n  reading: y\n")
    with pytest.raises(ValueError, match="A1: missing alternative, where"):
        prereg.load_readings(tmp_path)
