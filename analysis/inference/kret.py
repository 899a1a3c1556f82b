"""Retention interaction K_ret (Q9) from a CSV or a ledger root.

    python -m analysis.inference.kret --csv FILE [--timebase ledger|span] [--seeds 88001,...]
    python -m analysis.inference.kret --ledgers ROOT --campaign q9 [--timebase ledger|span]
        [--allow-changed-plan]

Prints a per-seed table, the three estimands with paired-t 95% intervals and
the decision; the LAST line is one JSON object for machines. Incomplete or
duplicated policy x mode pairs, and ledger runs collected under another plan hash
(unless --allow-changed-plan), exit with status 2 and say what is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

from analysis.inference import stats

TIMEBASES = ("ledger", "span")
EXIT_INPUT_ERROR = 2
# Ledger org / reuse values, compared case-insensitively (upper org, lower reuse).
LEDGER_ORG_TO_POLICY = {"S2": "S2", "S2_RETENTION": "Ret"}
LEDGER_REUSE_TO_MODE = {"share": "SHARE", "isolate": "ISOLATE"}
_LEDGER_QUERY = """
    SELECT seed, upper(trim(org)) AS org, lower(trim(reuse)) AS reuse,
           throughput_ledger, throughput_span, prereg_plan_hash
    FROM runs
    WHERE campaign = ? AND status = 'complete' AND adopted
      AND upper(trim(org)) IN ('S2', 'S2_RETENTION')
"""


def select_throughput(frame: pd.DataFrame, timebase: str) -> pd.DataFrame:
    """(seed, policy, mode, throughput) with throughput taken from the timebase's column.

    `throughput_<timebase>` wins; a plain `throughput` column counts as the
    ledger timebase (the primary), so `span` requires `throughput_span`.
    """
    if timebase not in TIMEBASES:
        raise ValueError(f"timebase={timebase!r}: allowed values are {TIMEBASES}")
    column = f"throughput_{timebase}"
    if column not in frame.columns:
        if timebase == "ledger" and "throughput" in frame.columns:
            column = "throughput"
        else:
            accepted = "throughput_ledger or throughput" if timebase == "ledger" else column
            raise ValueError(f"timebase={timebase!r} needs a column {accepted}; "
                             f"found columns {list(frame.columns)}")
    out = frame.loc[:, [c for c in ("seed", "policy", "mode") if c in frame.columns]].copy()
    out["throughput"] = pd.to_numeric(frame[column], errors="coerce")
    return out


def read_csv(path: str | Path, timebase: str) -> pd.DataFrame:
    frame = pd.read_csv(path)
    frame.columns = [str(c).strip() for c in frame.columns]
    for field in ("policy", "mode"):
        if field in frame.columns:
            frame[field] = frame[field].astype(str).str.strip()
    return select_throughput(frame, timebase)


def check_plan_hash(runs: pd.DataFrame, campaign: str, allow_changed_plan: bool) -> None:
    """The runs must carry the hash of the plan they were collected under (conf/prereg/<q>
    of the campaign, `q9` for q9_smoke and demo_q9); ValueError names the hashes."""
    from analysis.inference import prereg

    home = prereg.home_campaign(campaign)
    if not (prereg.PLAN_DIR / f"{home}.yaml").is_file():
        raise ValueError(f"campaign={campaign!r}: no preregistered plan conf/prereg/{home}.yaml")
    expected = prereg.load_plan(home).plan_hash
    found = runs["prereg_plan_hash"].fillna("").astype(str).value_counts()
    other = {h or "<none>": int(n) for h, n in found.items() if h != expected}
    if other and not allow_changed_plan:
        shown = ", ".join(f"{h[:12]} x{n}" for h, n in other.items())
        raise ValueError(f"prereg_plan_hash: runs of campaign {campaign!r} carry {shown}; the "
                         f"plan {home} now hashes to {expected[:12]} (plan changed after "
                         "collection; --allow-changed-plan accepts it)")


def read_ledgers(root: str | Path, campaign: str, timebase: str,
                 allow_changed_plan: bool = False) -> pd.DataFrame:
    """Adopted complete S2 / S2_RETENTION runs of `campaign` from the DuckDB catalog, after
    checking their plan hash."""
    import ledgers  # imported here only: the CSV path must not need the ledger stack

    connection = ledgers.connect(root)
    try:
        runs = connection.execute(_LEDGER_QUERY, [campaign]).df()
    finally:
        connection.close()
    if runs.empty:
        raise ValueError(f"campaign={campaign!r}: no adopted complete S2/S2_RETENTION runs "
                         f"under {root}")
    check_plan_hash(runs, campaign, allow_changed_plan)
    bad = sorted(set(runs["reuse"].astype(str)) - set(LEDGER_REUSE_TO_MODE))
    if bad:
        raise ValueError(f"reuse: values {bad} not allowed; allowed values are "
                         f"{tuple(LEDGER_REUSE_TO_MODE)}")
    runs["policy"] = runs["org"].map(LEDGER_ORG_TO_POLICY)
    runs["mode"] = runs["reuse"].map(LEDGER_REUSE_TO_MODE)
    return select_throughput(runs, timebase)


def plan_seeds(campaign: str) -> tuple[int, ...] | None:
    """Seeds of the campaign's primary preregistered family, if a plan exists (the first
    three for a smoke or demo campaign)."""
    from analysis.inference import prereg
    from analysis.inference.families import SMOKE_SEEDS

    home = prereg.home_campaign(campaign)
    if not (prereg.PLAN_DIR / f"{home}.yaml").is_file():
        return None
    plan = prereg.load_plan(home)
    if home != campaign:
        return tuple(sorted({s for c in plan.primary_family.cells
                             for s in c.seeds[:SMOKE_SEEDS]}))
    return tuple(sorted({s for c in plan.primary_family.cells for s in c.seeds}))


def _pct(d: float) -> float:
    return 100.0 * math.expm1(d)


def format_report(result: stats.RetentionInteraction, timebase: str) -> str:
    """Human table: per-seed throughputs and effects, then the three estimands."""
    pairs = result.pairs
    per_seed = pd.DataFrame({
        "seed": pairs.seeds,
        "S2/SHARE": pairs.s2_share,
        "Ret/SHARE": pairs.ret_share,
        "S2/ISOLATE": pairs.s2_isolate,
        "Ret/ISOLATE": pairs.ret_isolate,
        "d_SHARE %": [_pct(d) for d in result.d_share],
        "d_ISOLATE %": [_pct(d) for d in result.d_isolate],
        "K_ret(s) %": [_pct(d) for d in result.d_share - result.d_isolate],
    })
    conf = f"{100 * result.k_ret.confidence:g}%"
    summary = pd.DataFrame(
        [(name, iv.effect_pct, iv.low_pct, iv.high_pct, role)
         for name, iv, role in (("K_ret", result.k_ret, "primary"),
                                ("delta_share", result.delta_share, "secondary"),
                                ("delta_isolate", result.delta_isolate, "secondary"))],
        columns=["estimand", "effect %", f"{conf} low %", f"{conf} high %", "role"],
    )
    return "\n".join([
        f"K_ret: retention x reuse interaction (timebase {timebase}, n = {result.n}, "
        f"paired-t df = {result.k_ret.df}); throughput in output tokens/s",
        per_seed.to_string(index=False, float_format=lambda x: f"{x:.4f}"),
        "",
        summary.to_string(index=False, float_format=lambda x: f"{x:+.3f}"),
        f"decision: {result.decision} (predicted direction: positive K_ret)",
    ])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m analysis.inference.kret",
        description="Retention x reuse interaction K_ret with paired-t 95% intervals.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--csv", help="CSV with seed, policy (S2|Ret), mode (SHARE|ISOLATE), "
                                      "throughput or throughput_ledger/throughput_span")
    source.add_argument("--ledgers", help="ledger root read through ledgers.connect(root)")
    parser.add_argument("--campaign", default="q9", help="campaign in the ledgers (default q9)")
    parser.add_argument("--timebase", choices=TIMEBASES, default="ledger",
                        help="ledger (primary) or span (sensitivity)")
    parser.add_argument("--allow-changed-plan", action="store_true",
                        help="accept ledger runs whose plan hash differs from the plan's now")
    parser.add_argument("--seeds", help="comma-separated seeds that must all be present "
                                        "(default with --ledgers: the campaign's plan seeds)")
    return parser


def _parse_seeds(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise ValueError(f"--seeds={text!r}: allowed values are comma-separated integers") from exc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.csv is not None:
            table = read_csv(args.csv, args.timebase)
            expected = _parse_seeds(args.seeds) if args.seeds else None
        else:
            table = read_ledgers(args.ledgers, args.campaign, args.timebase,
                                 args.allow_changed_plan)
            expected = _parse_seeds(args.seeds) if args.seeds else plan_seeds(args.campaign)
        result = stats.retention_interaction(table, "throughput", expected_seeds=expected)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT_ERROR
    print(format_report(result, args.timebase))
    print(json.dumps(result.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
