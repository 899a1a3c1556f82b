"""A set of adopted runs and the SQL over it: {campaigns} and {adopted} filled in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd


def _literal(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def in_list(column: str, values: Sequence[str]) -> str:
    """`column IN ('a', 'b')` (literals, so DuckDB can prune hive partitions); FALSE if empty."""
    return f"{column} IN ({', '.join(map(_literal, values))})" if values else "FALSE"


@dataclass
class RunSet:
    """Adopted complete runs serving some questions, with run-level readouts and cell labels.

    `runs` holds one run per (cell, seed): the earliest-written one. Two adopted runs
    can share a cell and seed when their configs differ outside the identity columns
    (e.g. workload size); the later ones are in `set_aside`, named by the analyses,
    and still seen by the preregistration check (`all_runs`), which refuses them.
    """

    questions: tuple[str, ...]
    campaigns: tuple[str, ...]  # the campaigns those runs were collected in
    runs: pd.DataFrame
    set_aside: pd.DataFrame

    @property
    def all_runs(self) -> pd.DataFrame:
        return pd.concat([self.runs, self.set_aside], ignore_index=True)

    @property
    def empty(self) -> bool:
        return self.runs.empty

    def notes(self) -> list[str]:
        return [f"set aside: run {r.run_id} duplicates cell {r.cell} seed {r.seed} "
                f"(an earlier adopted run is analysed)" for r in self.set_aside.itertuples()]


RUN_IDS_VIEW = "analysis_run_ids"  # registered per query: the run set's run ids


def query(con, sql: str, runset: RunSet) -> pd.DataFrame:
    """Run `sql` with {campaigns} (the run set's campaigns) and {adopted} (its run ids) filled.

    The run ids are registered as a relation rather than re-selected from the runs
    view, which would read every runs file again for each query.
    """
    ids = pd.concat([runset.runs["run_id"], runset.set_aside["run_id"]], ignore_index=True)
    con.register(RUN_IDS_VIEW, pd.DataFrame({"run_id": ids.astype(str)}))
    try:
        text = sql.format(campaigns=in_list("campaign", runset.campaigns),
                          adopted=f"SELECT run_id FROM {RUN_IDS_VIEW}")
        return con.execute(text).df()
    finally:
        con.unregister(RUN_IDS_VIEW)
