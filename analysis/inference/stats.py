"""Paired, seed-level statistics for serving campaigns (docs/statistics.md).

Seeds are the independent repeats and arms are paired by seed. Every effect is
estimated on paired log ratios d(s) = ln(G_A(s) / G_B(s)) and displayed in
percent as 100 (exp(mean d) - 1). Tests are exact sign-flip tests; families are
Holm-adjusted (decisions, never effects). All inputs are checked by
`_as_sample` / `_as_pairs`, so every public function rejects the same misuse
with the same message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

EXACT_MAX_N = 20  # enumerate all 2^n sign assignments up to here (2^20 sums, ~8 MB)
MC_RESAMPLES = 100_000  # Monte Carlo sign assignments beyond EXACT_MAX_N
TIE_RTOL = 1e-9  # |sum| ties within TIE_RTOL * sum|d| count as ">= observed"
BOOTSTRAP_RESAMPLES = 10_000
DEFAULT_ALPHA = 0.05

CONFIRMED = "CONFIRMED"
DIRECTIONAL = "DIRECTIONAL"
NOT_CONFIRMED = "NOT_CONFIRMED"
DECISIONS = (CONFIRMED, DIRECTIONAL, NOT_CONFIRMED)

RETENTION_POLICIES = ("S2", "Ret")
REUSE_MODES = ("SHARE", "ISOLATE")
DISPLAY_MEAN_LABEL = "display mean of seedwise 100 (A/B - 1); not the estimand"


# ---------------------------------------------------------------------------
# Input validation (the one place)
# ---------------------------------------------------------------------------


def _as_sample(values, field: str, *, min_n: int = 1, positive: bool = False) -> np.ndarray:
    """A finite 1-D float array of at least `min_n` values (all > 0 if `positive`)."""
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{field}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size < min_n:
        raise ValueError(f"{field}: needs n >= {min_n} values, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{field}: values must be finite (no NaN or inf)")
    if positive and np.any(arr <= 0):
        raise ValueError(f"{field}: throughputs must be positive, got min {arr.min()!r}")
    return arr


def _as_pairs(a, b, fields: tuple[str, str], *, min_n: int = 1, positive: bool = False):
    """Two samples of equal length, paired by position (seed)."""
    x = _as_sample(a, fields[0], min_n=min_n, positive=positive)
    y = _as_sample(b, fields[1], min_n=min_n, positive=positive)
    if x.size != y.size:
        raise ValueError(
            f"{fields[0]} and {fields[1]}: paired samples need equal lengths, "
            f"got {x.size} and {y.size}"
        )
    return x, y


def _as_confidence(confidence: float) -> float:
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence={confidence!r}: allowed values are 0 < confidence < 1")
    return float(confidence)


def _as_pvalue(p, field: str) -> float:
    value = float(p)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{field}={p!r}: allowed values are 0 <= p <= 1")
    return value


# ---------------------------------------------------------------------------
# Effects
# ---------------------------------------------------------------------------


def log_ratios(a, b) -> np.ndarray:
    """Per-seed d(s) = ln(a(s) / b(s)) for paired positive throughputs."""
    x, y = _as_pairs(a, b, ("a", "b"), positive=True)
    return np.log(x) - np.log(y)


def effect_pct(d) -> float:
    """The estimand in percent: 100 (exp(mean d) - 1)."""
    return 100.0 * math.expm1(float(np.mean(_as_sample(d, "d"))))


@dataclass(frozen=True, slots=True)
class DisplayMean:
    """Paper-style mean of seedwise relative changes; a display statistic only."""

    value_pct: float
    n: int
    label: str = DISPLAY_MEAN_LABEL


def display_mean_pct(a, b) -> DisplayMean:
    """Mean over seeds of 100 (a/b - 1), labelled as a display statistic."""
    x, y = _as_pairs(a, b, ("a", "b"), positive=True)
    return DisplayMean(float(np.mean(100.0 * (x / y - 1.0))), int(x.size))


def geometric_mean(values) -> float:
    """exp(mean ln x) of positive values (arm summary across seeds)."""
    return float(np.exp(np.mean(np.log(_as_sample(values, "values", positive=True)))))


@dataclass(frozen=True, slots=True)
class NormalizedIndex:
    """Within-seed index of each arm relative to the first (column 0 = 1).

    `per_seed[s, k]` is the product of step ratios G_j/G_{j-1}, j = 1..k, in
    seed s; `mean` averages those per-seed products (arithmetic, as the paper
    displays them); `geometric_mean` is the log-scale average, which equals the
    product of the step effects.
    """

    per_seed: np.ndarray
    mean: np.ndarray
    geometric_mean: np.ndarray


def normalized_index(table) -> NormalizedIndex:
    """Index arms (columns, in step order) within each seed (rows) before averaging."""
    arr = np.asarray(table, dtype=float)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise ValueError(
            f"table: expected a 2-D array of seeds x arms (>= 1 seed, >= 2 arms), "
            f"got shape {arr.shape}"
        )
    _as_sample(arr.ravel(), "table", positive=True)
    steps = arr[:, 1:] / arr[:, :-1]
    per_seed = np.concatenate([np.ones((arr.shape[0], 1)), np.cumprod(steps, axis=1)], axis=1)
    return NormalizedIndex(
        per_seed=per_seed,
        mean=per_seed.mean(axis=0),
        geometric_mean=np.exp(np.log(per_seed).mean(axis=0)),
    )


# ---------------------------------------------------------------------------
# Tests and multiplicity
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignFlipResult:
    """Two-sided sign-flip test of mean d = 0.

    `method` is "exact" (all 2^n assignments, n <= EXACT_MAX_N) or
    "monte_carlo" (`n_assignments` seeded random assignments; p counts the
    observed assignment, (k + 1) / (R + 1)).
    """

    statistic: float  # mean d
    pvalue: float
    n: int
    method: str
    n_assignments: int


def _all_sign_sums(d: np.ndarray) -> np.ndarray:
    """Sums of d under all 2^n sign assignments (doubling; O(2^n) work and memory)."""
    sums = np.zeros(1)
    for x in d:
        sums = np.concatenate((sums + x, sums - x))
    return sums


def sign_flip_test(d, *, n_resamples: int = MC_RESAMPLES, seed: int = 0) -> SignFlipResult:
    """Exact (n <= 20) or seeded Monte Carlo two-sided sign-flip test on d.

    p = share of sign assignments whose |mean| >= the observed |mean|; sums
    within TIE_RTOL x sum|d| of the observed one count as ties.
    """
    arr = _as_sample(d, "d")
    observed = float(arr.sum())
    threshold = abs(observed) - TIE_RTOL * float(np.abs(arr).sum())
    if arr.size <= EXACT_MAX_N:
        sums = _all_sign_sums(arr)
        pvalue = float(np.count_nonzero(np.abs(sums) >= threshold)) / sums.size
        return SignFlipResult(observed / arr.size, pvalue, int(arr.size), "exact", int(sums.size))
    if int(n_resamples) < 1:
        raise ValueError(f"n_resamples={n_resamples!r}: allowed values are integers >= 1")
    rng = np.random.default_rng(seed)
    hits = 0
    chunk = max(1, 2_000_000 // arr.size)  # bound the sign matrix to ~2M entries
    for start in range(0, int(n_resamples), chunk):
        rows = min(chunk, int(n_resamples) - start)
        signs = rng.integers(0, 2, size=(rows, arr.size), dtype=np.int8) * 2 - 1
        hits += int(np.count_nonzero(np.abs(signs @ arr) >= threshold))
    pvalue = (hits + 1) / (int(n_resamples) + 1)
    return SignFlipResult(observed / arr.size, pvalue, int(arr.size), "monte_carlo",
                          int(n_resamples))


def _as_pvalues(pvalues) -> np.ndarray:
    p = _as_sample(pvalues, "pvalues")
    if np.any((p < 0) | (p > 1)):
        raise ValueError("pvalues: allowed values are 0 <= p <= 1")
    return p


def holm(pvalues) -> np.ndarray:
    """Holm step-down adjusted p-values, returned in the input order."""
    p = _as_pvalues(pvalues)
    order = np.argsort(p, kind="stable")
    m = p.size
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


def holm_reject(pvalues, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """Holm decisions in input order: reject while p_(i) <= alpha / (m - i), then stop."""
    p = _as_pvalues(pvalues)
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha={alpha!r}: allowed values are 0 < alpha < 1")
    order = np.argsort(p, kind="stable")
    m = p.size
    passes = p[order] <= float(alpha) / (m - np.arange(m))
    num_rejected = m if passes.all() else int(np.argmin(passes))
    reject = np.zeros(m, dtype=bool)
    reject[order[:num_rejected]] = True
    return reject


def two_look(p6: float, p9: float | None = None) -> float:
    """Two-look p for an extended sample: min(1, 2 min(p6, p9)), p9 = 1 if no second look."""
    first = _as_pvalue(p6, "p6")
    second = 1.0 if p9 is None else _as_pvalue(p9, "p9")
    return min(1.0, 2.0 * min(first, second))


# ---------------------------------------------------------------------------
# Intervals
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PairedTInterval:
    """Paired-t interval of mean d, back-transformed to percent (df = n - 1)."""

    effect_pct: float
    low_pct: float
    high_pct: float
    confidence: float
    n: int
    mean_log: float
    se_log: float

    @property
    def df(self) -> int:
        return self.n - 1

    def as_dict(self) -> dict[str, float]:
        return {"effect_pct": self.effect_pct, "ci_low_pct": self.low_pct,
                "ci_high_pct": self.high_pct}


def _t_half_width(d: np.ndarray, confidence: float) -> tuple[float, float, float]:
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size))
    from scipy.special import stdtrit  # t quantile (what scipy.stats.t.ppf calls); lazy import

    t_crit = float(stdtrit(d.size - 1, 0.5 + confidence / 2.0))
    return mean, se, t_crit * se


def paired_t_interval(d, confidence: float = 0.95) -> PairedTInterval:
    """Paired-t interval in log space, back-transformed: 100 (exp(mean d +- t se) - 1)."""
    arr = _as_sample(d, "d", min_n=2)
    conf = _as_confidence(confidence)
    mean, se, half = _t_half_width(arr, conf)
    return PairedTInterval(
        effect_pct=100.0 * math.expm1(mean),
        low_pct=100.0 * math.expm1(mean - half),
        high_pct=100.0 * math.expm1(mean + half),
        confidence=conf,
        n=int(arr.size),
        mean_log=mean,
        se_log=se,
    )


def bootstrap_mean_interval(values, n_resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                            confidence: float = 0.95) -> tuple[float, float]:
    """Seed-level percentile bootstrap of the plain mean of `values` (e.g. seedwise % changes)."""
    arr = _as_sample(values, "values", min_n=2)
    return _bootstrap_quantiles(arr, n_resamples, seed, _as_confidence(confidence))


def _bootstrap_quantiles(arr: np.ndarray, n_resamples: int, seed: int,
                         conf: float) -> tuple[float, float]:
    """Percentile interval of the mean over seeded resamples of the seeds (with replacement)."""
    if int(n_resamples) < 1:
        raise ValueError(f"n_resamples={n_resamples!r}: allowed values are integers >= 1")
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(int(n_resamples), arr.size))].mean(axis=1)
    low, high = np.quantile(means, [0.5 - conf / 2.0, 0.5 + conf / 2.0])
    return float(low), float(high)


# ---------------------------------------------------------------------------
# Composite estimands
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainmentResult:
    """Probe-effect check: the interval of 100 ln(on/off) must lie in [-margin, +margin]."""

    passed: bool
    estimate_log_pct: float
    low_log_pct: float
    high_log_pct: float
    margin_pct: float
    confidence: float
    n: int


def containment(on, off, margin_pct: float = 3.0, confidence: float = 0.90) -> ContainmentResult:
    """Paired-t interval of 100 ln(on/off) (not back-transformed) against +-margin_pct."""
    d = log_ratios(on, off)
    _as_sample(d, "on/off pairs", min_n=2)
    conf = _as_confidence(confidence)
    if not float(margin_pct) > 0:
        raise ValueError(f"margin_pct={margin_pct!r}: allowed values are > 0")
    mean, _, half = _t_half_width(d, conf)
    low, high = 100.0 * (mean - half), 100.0 * (mean + half)
    return ContainmentResult(
        passed=bool(-margin_pct <= low and high <= margin_pct),
        estimate_log_pct=100.0 * mean,
        low_log_pct=low,
        high_log_pct=high,
        margin_pct=float(margin_pct),
        confidence=conf,
        n=int(d.size),
    )


@dataclass(frozen=True, slots=True)
class RetentionPairs:
    """Throughput per seed for the four Q9 cells, aligned by seed (ascending)."""

    seeds: tuple[int, ...]
    s2_share: np.ndarray
    ret_share: np.ndarray
    s2_isolate: np.ndarray
    ret_isolate: np.ndarray


def retention_pairs(
    table: pd.DataFrame, value: str = "throughput", expected_seeds=None
) -> RetentionPairs:
    """Pivot a long table (seed, policy, mode, value) into complete per-seed cells.

    Every seed (the table's, plus `expected_seeds` if given) needs exactly one
    row for each policy x mode; otherwise the ValueError names the seeds and
    the cells that are missing or duplicated.
    """
    required = ("seed", "policy", "mode", value)
    absent = [c for c in required if c not in table.columns]
    if absent:
        raise ValueError(f"table: missing columns {absent}; required columns are {list(required)}")
    frame = table.loc[:, list(required)].copy()
    for field, allowed in (("policy", RETENTION_POLICIES), ("mode", REUSE_MODES)):
        bad = sorted(set(frame[field].astype(str)) - set(allowed))
        if bad:
            raise ValueError(f"{field}: values {bad} not allowed; allowed values are {allowed}")
    frame["seed"] = _as_seed_column(frame["seed"])
    seeds = set(frame["seed"].tolist()) | set(int(s) for s in (expected_seeds or ()))
    problems = _pair_problems(frame.groupby(["seed", "policy", "mode"]).size(), sorted(seeds))
    if problems:
        named = [seed for seed, _ in problems]
        detail = "; ".join(f"seed {seed}: {text}" for seed, text in problems)
        raise ValueError(f"incomplete policy x mode pairs for seeds {named}: {detail}")
    wide = frame.set_index(["seed", "policy", "mode"])[value].unstack(["policy", "mode"])
    wide = wide.sort_index()
    cols = {
        (p, m): _as_sample(wide[(p, m)].to_numpy(), f"{value} ({p}/{m})", positive=True)
        for p in RETENTION_POLICIES
        for m in REUSE_MODES
    }
    return RetentionPairs(
        seeds=tuple(int(s) for s in wide.index),
        s2_share=cols[("S2", "SHARE")],
        ret_share=cols[("Ret", "SHARE")],
        s2_isolate=cols[("S2", "ISOLATE")],
        ret_isolate=cols[("Ret", "ISOLATE")],
    )


def _pair_problems(counts: pd.Series, seeds: list[int]) -> list[tuple[int, str]]:
    """(seed, "missing .../duplicated ...") for every seed without exactly one row per cell."""
    problems = []
    for seed in seeds:
        missing, duplicated = [], []
        for policy in RETENTION_POLICIES:
            for mode in REUSE_MODES:
                k = int(counts.get((seed, policy, mode), 0))
                if k == 0:
                    missing.append(f"{policy}/{mode}")
                elif k > 1:
                    duplicated.append(f"{policy}/{mode} x{k}")
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"duplicated {', '.join(duplicated)}"] if duplicated else []
        )
        if parts:
            problems.append((seed, "; ".join(parts)))
    return problems


def _as_seed_column(seeds: pd.Series) -> pd.Series:
    numeric = pd.to_numeric(seeds, errors="coerce")
    if numeric.isna().any() or not np.all(numeric == np.round(numeric)):
        raise ValueError("seed: values must be integers")
    return numeric.astype(np.int64)


@dataclass(frozen=True, slots=True)
class RetentionInteraction:
    """K_ret (primary) and the within-mode retention effects (secondary).

    d_share(s) = ln(G(Ret, SHARE) / G(S2, SHARE)), d_isolate likewise;
    K_ret = 100 (exp(mean(d_share - d_isolate)) - 1). The predicted direction
    is positive; `decision` is one of DECISIONS.
    """

    k_ret: PairedTInterval
    delta_share: PairedTInterval
    delta_isolate: PairedTInterval
    decision: str
    pairs: RetentionPairs
    d_share: np.ndarray
    d_isolate: np.ndarray

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.pairs.seeds

    @property
    def n(self) -> int:
        return len(self.pairs.seeds)

    def as_dict(self) -> dict:
        return {
            "K_ret": self.k_ret.as_dict(),
            "delta_share": self.delta_share.as_dict(),
            "delta_isolate": self.delta_isolate.as_dict(),
            "decision": self.decision,
            "n": self.n,
        }


def retention_decision(diff, interval: PairedTInterval) -> str:
    """CONFIRMED if the interval lies above 0; DIRECTIONAL if every seed is > 0."""
    if interval.low_pct > 0.0:
        return CONFIRMED
    if np.all(_as_sample(diff, "diff") > 0.0):
        return DIRECTIONAL
    return NOT_CONFIRMED


def retention_interaction(
    table: pd.DataFrame,
    value: str = "throughput",
    confidence: float = 0.95,
    expected_seeds=None,
) -> RetentionInteraction:
    """K_ret with paired-t intervals from a long (seed, policy, mode, value) table."""
    pairs = retention_pairs(table, value, expected_seeds)
    if len(pairs.seeds) < 2:
        raise ValueError(f"seed: K_ret needs n >= 2 complete seeds, got {len(pairs.seeds)}")
    d_share = log_ratios(pairs.ret_share, pairs.s2_share)
    d_isolate = log_ratios(pairs.ret_isolate, pairs.s2_isolate)
    k_ret = paired_t_interval(d_share - d_isolate, confidence)
    return RetentionInteraction(
        k_ret=k_ret,
        delta_share=paired_t_interval(d_share, confidence),
        delta_isolate=paired_t_interval(d_isolate, confidence),
        decision=retention_decision(d_share - d_isolate, k_ret),
        pairs=pairs,
        d_share=d_share,
        d_isolate=d_isolate,
    )
