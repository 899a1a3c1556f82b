"""One study convention: every study driver in experiments/studies/ names its table
(TABLE), the table has a documented schema in ledgers.studies, its page is registered in
analysis/studies/ and reads it; study files are audited by ledgers.check (a damaged or
foreign file is reported) and read through the catalog (such a file skipped, with a
warning); the drivers' row types are exactly their tables' columns."""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from dataclasses import fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ledgers
from analysis.pages import common
from analysis.studies import STUDY_PAGE_MODULES, study_pages
from experiments import studies as drivers
from ledgers.catalog import LedgerWarning
from ledgers.check import check
from ledgers.studies import STUDY_SCHEMAS, check_studies, study_files, write_study

REPO = Path(__file__).resolve().parents[1]


def _drivers() -> dict:
    names = [m.name for m in pkgutil.iter_modules(drivers.__path__)]
    assert {"continuation", "continuation_http", "reload_study", "sensitivity",
            "fidelity"} <= set(names)
    return {n: importlib.import_module(f"experiments.studies.{n}") for n in names
            if n not in drivers.CONFIG_FITS}


def test_every_study_driver_writes_a_documented_table_and_has_a_page():
    pages = {m.__name__.rsplit(".", 1)[-1]: m for m in study_pages()}
    for name, module in _drivers().items():
        assert module.TABLE in STUDY_SCHEMAS, name
        assert name in pages, f"analysis/studies/{name}.py is not registered"
        assert module.TABLE in pages[name].TABLES, name
        source = Path(module.__file__).read_text()
        assert "write_study(" in source and ".to_parquet(" not in source, name
        assert "pq.write_table" not in source, name
    for module in study_pages():
        assert module.PAGE.endswith(".md") and module.TITLE and callable(module.write_page)
        assert all(t in STUDY_SCHEMAS for t in module.TABLES), module.__name__


def test_every_page_module_of_analysis_studies_is_registered():
    found = {m.name for m in pkgutil.iter_modules([str(REPO / "analysis" / "studies")])}
    assert found == set(STUDY_PAGE_MODULES)


@pytest.mark.parametrize("table", list(STUDY_SCHEMAS))
def test_every_study_table_opens_with_its_identity_and_documents_each_column(table):
    schema = STUDY_SCHEMAS[table]
    assert schema.names[:2] == ["study_id", "created_at"]
    assert len(set(schema.names)) == len(schema.names)
    for f in schema:
        meta = f.metadata
        assert meta[b"doc"].decode().strip() and b"unit" in meta, (table, f.name)
        assert not f.nullable


def test_driver_rows_are_exactly_their_tables_columns():
    from experiments.studies.continuation import PairResult
    from experiments.studies.continuation_http import HttpCase

    identity = {"study_id", "created_at", "model"}
    assert ({f.name for f in fields(PairResult)} | {"b_equals_p", "audits_ok", "ok"}
            | identity) == set(STUDY_SCHEMAS["continuation"].names)
    assert ({f.name for f in fields(HttpCase)} | {"b_equals_p", "ok"} | identity
            | {"budget", "seed"}) == set(STUDY_SCHEMAS["continuation_http"].names)


def _row(table: str, **values) -> dict:
    """One row of `table` with every column filled by a value of its type."""
    defaults = {pa.string(): "x", pa.int64(): 1, pa.float64(): 0.5, pa.bool_(): True}
    row = {f.name: defaults[f.type] for f in STUDY_SCHEMAS[table]}
    for f in STUDY_SCHEMAS[table]:
        allowed = (f.metadata or {}).get(b"values")
        if allowed:
            row[f.name] = allowed.decode().split("|")[0]
    row.update(values)
    return row


@pytest.mark.parametrize("table", list(STUDY_SCHEMAS))
def test_each_study_table_round_trips_through_the_catalog_and_the_check(table, tmp_path):
    first = write_study(tmp_path, table, {k: [v] for k, v in _row(
        table, study_id="20260101T000000-aaaaaa").items()})
    write_study(tmp_path, table, {k: [v, v] for k, v in _row(
        table, study_id="20260102T000000-bbbbbb").items()})
    report = check(tmp_path)
    assert report.ok and not report.empty  # study files alone make a ledger root
    con = ledgers.connect(tmp_path)
    try:
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 3
        newest = common.latest_study(con, table)
    finally:
        con.close()
    assert list(newest["study_id"]) == ["20260102T000000-bbbbbb"] * 2
    # a damaged file and a foreign one (another table's schema) in the table's directory
    (first.parent / f"{table}-damaged.parquet").write_bytes(first.read_bytes()[:60])
    other = next(t for t in STUDY_SCHEMAS if t != table)
    foreign = pa.Table.from_pylist([_row(other)], schema=STUDY_SCHEMAS[other])
    pq.write_table(foreign, first.parent / f"{table}-foreign.parquet")
    problems = check_studies(tmp_path)
    assert len(problems) == 2
    assert any("damaged" in p and "unreadable" in p for p in problems)
    assert any("foreign" in p and "schema differs" in p for p in problems)
    report = check(tmp_path)
    assert not report.ok and report.problems["study files with a wrong schema"] == problems
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        con = ledgers.connect(tmp_path)
    try:
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == 3
    finally:
        con.close()
    (warning,) = [w for w in caught if issubclass(w.category, LedgerWarning)]
    assert "2 study files skipped" in str(warning.message)
    assert len(study_files(tmp_path)) == 4


def test_a_study_table_refuses_a_missing_column_and_writes_nothing(tmp_path):
    row = _row("continuation")
    del row["ok"]
    with pytest.raises(ValueError, match=r"missing columns \['ok'\]"):
        write_study(tmp_path, "continuation", {k: [v] for k, v in row.items()})
    with pytest.raises(ValueError, match="allowed values are reload_study, continuation"):
        write_study(tmp_path, "nope", {})
    assert study_files(tmp_path) == []


def test_rows_to_columns_takes_shared_values_even_for_a_column_named_rows():
    from ledgers.studies import rows_to_columns

    fitted = [{"parameter": "mixed_step_s", "value": 0.02},
              {"parameter": "per_step_overhead_s", "value": 0.03}]
    columns = rows_to_columns("fidelity_fit", fitted, study_id="s", created_at="t",
                              model="m", start="cpu", profile="p", rows=120,
                              rms_rel_error=0.1, org_errors="{}", runs="[]", overrides="[]")
    assert columns["rows"] == [120, 120] and columns["value"] == [0.02, 0.03]
    assert list(columns) == STUDY_SCHEMAS["fidelity_fit"].names
