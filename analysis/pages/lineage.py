"""Q7's lineage counts (the reference paper's C.1; docs/engine_rules.md section 19), from the
lineage table of the traced runs and the episodes of their trace (analysis/questions/q7.py).

Per run:
- publication events: checkpoints published (PUBLISH rows);
- depth-increasing publication events: publications that deepened a waiting episode's
  joint depth (DEPTH_UP);
- depth-decreasing loss events: losses (attention or checkpoint) that made a waiting
  episode's joint depth shallower (DEPTH_DOWN);
- same-step ambiguous publications: publications in the step in which a request whose
  chain holds the key was admitted (at step resolution their order against that lookup is
  ambiguous; the M0/M1 brackets of the depths are the same ambiguity);
- reduced-depth episodes (adopted depth below the entry depth, the `shallower` class) and
  how many of them include at least one other-request allocation-associated loss (a
  DEPTH_DOWN of that episode whose cause_request_id is another request's allocation);
- adoptions, and the checkpoints' ends by cause with their median age.
"""

from __future__ import annotations

import pandas as pd

COUNTS = ("publication_events", "depth_increasing_publications", "depth_decreasing_losses",
          "same_step_ambiguous_publications", "reduced_depth_episodes",
          "reduced_with_other_request_loss", "adoptions", "ends_lru", "ends_slab_reclaim",
          "ends_pool_pressure", "ends_reset", "ends_run_end")
LINEAGE_SQL = """
    SELECT run_id, event, request_id, episode, cause, cause_request_id, age_s, same_step
    FROM lineage WHERE {campaigns} AND run_id IN ({adopted})
"""
DEFINITIONS = (
    "Lineage counts per traced run (the paper's C.1), then summed over a cell's runs. "
    "Publication events: checkpoints published. Depth-increasing publications: those that "
    "deepened a waiting episode's joint depth (what it would adopt at that instant). "
    "Depth-decreasing loss events: losses of attention blocks or checkpoints that made a "
    "waiting episode's joint depth shallower. Same-step ambiguous publications: "
    "publications in the step in which a request whose chain holds the key was admitted "
    "(at step resolution, before or after its lookup cannot be told). Reduced-depth "
    "episodes: adopted depth below the entry depth (class shallower); with other-request "
    "loss: at least one depth-decreasing loss of that episode came from another request's "
    "allocation. Ends: the checkpoints' cache entries ended by LRU eviction of a member "
    "page, S2 slab reclaim, Jenga large-page reclaim (pool pressure), a prefix-cache reset, "
    "or still cached at the run's end; age is from publication to end. Descriptive, no test.")


def lineage_counts(lineage: pd.DataFrame, episodes: pd.DataFrame) -> pd.DataFrame:
    """Per run: COUNTS and the median age (s) of the ends other than run_end.

    `lineage`: rows of the lineage table (run_id, event, request_id, episode, cause,
    cause_request_id, age_s, same_step); `episodes`: run_id, request_id, episode and
    depth_class per admission episode (q7.load_episodes)."""
    if lineage.empty:
        return pd.DataFrame(columns=["run_id", *COUNTS, "median_end_age_s"])
    by_run = lineage.groupby("run_id")
    out = pd.DataFrame({
        "publication_events": by_run["event"].apply(lambda e: int((e == "PUBLISH").sum())),
        "depth_increasing_publications": by_run["event"].apply(
            lambda e: int((e == "DEPTH_UP").sum())),
        "depth_decreasing_losses": by_run["event"].apply(
            lambda e: int((e == "DEPTH_DOWN").sum())),
        "adoptions": by_run["event"].apply(lambda e: int((e == "ADOPT").sum())),
    })
    publish = lineage[lineage["event"] == "PUBLISH"]
    out["same_step_ambiguous_publications"] = publish.groupby("run_id")["same_step"].sum()
    ends = lineage[lineage["event"] == "END"]
    for cause in ("lru", "slab_reclaim", "pool_pressure", "reset", "run_end"):
        out[f"ends_{cause}"] = ends[ends["cause"] == cause].groupby("run_id").size()
    out["median_end_age_s"] = ends[ends["cause"] != "run_end"].groupby("run_id")["age_s"].median()
    reduced, with_loss = _reduced(lineage, episodes)
    out["reduced_depth_episodes"] = reduced
    out["reduced_with_other_request_loss"] = with_loss
    counts = [c for c in COUNTS]
    out[counts] = out[counts].fillna(0).astype(int)
    return out.reset_index()[["run_id", *COUNTS, "median_end_age_s"]]


def _reduced(lineage: pd.DataFrame, episodes: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per run: reduced-depth episodes, and those with an other-request allocation loss."""
    keys = ["run_id", "request_id", "episode"]
    shallower = episodes[episodes["depth_class"] == "shallower"][keys].drop_duplicates()
    down = lineage[(lineage["event"] == "DEPTH_DOWN") & (lineage["cause_request_id"] >= 0)
                   & (lineage["cause_request_id"] != lineage["request_id"])][keys]
    hit = shallower.merge(down.drop_duplicates(), on=keys, how="inner")
    return shallower.groupby("run_id").size(), hit.groupby("run_id").size()


def cell_counts(per_run: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """Sum of the per-run counts per traced cell (with the number of runs)."""
    if per_run.empty:
        return pd.DataFrame()
    merged = per_run.merge(runs[["run_id", "cell"]], on="run_id")
    table = merged.groupby("cell", sort=False)[list(COUNTS)].sum()
    table.insert(0, "n", merged.groupby("cell", sort=False).size())
    table["median_end_age_s"] = merged.groupby("cell", sort=False)["median_end_age_s"].median()
    return table.reset_index()
