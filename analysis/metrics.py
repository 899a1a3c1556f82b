"""Design columns and run-level metrics: the names pages and inference both use.

A cell is one experimental condition: the design columns plus the model,
executor and pool sizes. A metric says its unit and whether arms compare by
log ratio or difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ledgers.arms import ARMS, LEDGER_ORGS

DESIGN_COLUMNS = ("stage", "org", "budget", "cap", "rate", "arrival", "q", "f", "reuse",
                  "retention_k", "pinning_k", "d0_attention_fraction", "trace", "host_tier_bytes")
# Settings that only one org has (-1 / NaN elsewhere): never part of a pairing condition.
ORG_SETTINGS = ("retention_k", "d0_attention_fraction")
IDENTITY_COLUMNS = (*DESIGN_COLUMNS, "model", "executor", "units_detail")
# Order and names of runs.org values: the one table of arms (ledgers.arms).
ORG_ORDER = LEDGER_ORGS
ORG_NAMES = {a.ledger_org: a.label for a in ARMS.values() if a.label != a.ledger_org}


@dataclass(frozen=True, slots=True)
class Metric:
    """A run-level readout: its unit, and whether arms compare by log ratio or difference."""

    name: str
    unit: str
    scale: str  # "log": paired log ratios, effects in %; "diff": paired differences
    label: str


METRICS = {m.name: m for m in (
    Metric("throughput_ledger", "tokens/s", "log", "throughput, ledger timebase"),
    Metric("throughput_span", "tokens/s", "log", "throughput, request-span timebase"),
    Metric("ttft_p99", "s", "log", "TTFT p99 (run-level)"),
    Metric("e2e_p99", "s", "log", "E2E p99 (run-level)"),
    Metric("prefill_tokens_computed", "tokens", "log", "prefill tokens computed"),
    Metric("prefill_tokens_initial", "tokens", "diff", "prefill tokens, first admissions"),
    Metric("prefill_tokens_resume", "tokens", "diff", "prefill tokens recomputed on resume"),
    Metric("poller_running_mean", "requests", "diff", "running requests (poller mean)"),
    Metric("poller_waiting_mean", "requests", "diff", "waiting requests (poller mean)"),
    Metric("preemptions", "count", "diff", "preemptions per run"),
    Metric("ttft_p50", "s", "log", "TTFT p50 (run-level)"),
    Metric("e2e_p50", "s", "log", "E2E p50 (run-level)"),
    Metric("tpot_p99", "s", "log", "request-TPOT p99 (run-level)"),
    Metric("requests_per_s", "requests/s", "log", "completed requests per second, request span"),
    Metric("c_once_tokens", "tokens", "log", "C_once: prompt minus first-admission prefix"),
    Metric("h_tokens", "tokens", "log", "H = C_once + output tokens"),
    Metric("engine_steps", "count", "log", "K: engine steps (steps-ledger rows)"),
    Metric("h_per_k", "tokens/step", "log", "H/K per run"),
    Metric("running_median", "requests", "diff", "running gauge, run median"),
    Metric("running_max", "requests", "diff", "running gauge, run maximum"),
    Metric("waiting_median", "requests", "diff", "waiting gauge, run median"),
    Metric("waiting_max", "requests", "diff", "waiting gauge, run maximum"),
    Metric("waiting_p99", "requests", "diff", "waiting gauge, run p99"),
    Metric("jadopt_initial_mean", "tokens", "diff", "Jadopt, INITIAL admissions"),
    Metric("rmax_m1_initial_mean", "tokens", "diff", "Rmax (M1), INITIAL admissions"),
    Metric("amax_m1_initial_mean", "tokens", "diff", "Amax (M1), INITIAL admissions"),
    Metric("rmax_m0_initial_mean", "tokens", "diff", "Rmax (M0), INITIAL admissions"),
    Metric("amax_m0_initial_mean", "tokens", "diff", "Amax (M0), INITIAL admissions"),
    Metric("gap_r_initial_mean", "tokens", "diff", "GapR = Rmax (M1) - Jadopt, INITIAL"),
    Metric("gap_r_m0_initial_mean", "tokens", "diff", "GapR = Rmax (M0) - Jadopt, INITIAL"),
    Metric("jadopt_tokens_mean", "tokens", "diff", "adopted joint depth Jadopt"),
    Metric("jenter_tokens_mean", "tokens", "diff", "joint depth at queue entry"),
    Metric("amax_tokens_mean", "tokens", "diff", "attention depth Amax (M0)"),
    Metric("rmax_tokens_mean", "tokens", "diff", "recurrent depth Rmax (M0)"),
    Metric("gap_r_tokens_mean", "tokens", "diff", "GapR = Rmax - Jadopt (M0)"),
)}


def budget_rank(label: str) -> float:
    """Sort key of a budget label (b63 < b83 < b108; p254 after the b budgets)."""
    text = str(label).strip().lower()
    try:
        return float(text[1:]) + (1e6 if text.startswith("p") else 0.0)
    except ValueError:
        return math.inf


def seeds_text(seeds) -> str:
    """Compact seed list: 42000-42011, 0-2, 5."""
    values = sorted(int(s) for s in seeds)
    parts, start = [], None
    for i, s in enumerate(values):
        start = s if start is None else start
        if i + 1 == len(values) or values[i + 1] != s + 1:
            parts.append(str(s) if s == start else f"{start}-{s}")
            start = None
    return ", ".join(parts)
