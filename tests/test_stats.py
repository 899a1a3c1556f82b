"""Statistics wrappers against hand-worked cases, SciPy and statsmodels oracles."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from analysis.inference import stats

# t quantiles typed in rather than computed. The design's t(0.975, 5) = 2.5705818366147395 is
# 3.8e-10 (relative) above the true quantile 2.5705818356363155 (mpmath, 40 digits, which
# SciPy reproduces); intervals are checked against the design's value to 1e-8 and the exact one
# to 1e-12.
T_975_DF5_SPEC = 2.5705818366147395
T_975_DF5 = 2.5705818356363155
T_95_DF4 = 2.1318467863266503  # t(0.95, 4)


def _scipy_sign_flip(d: np.ndarray) -> float:
    res = sps.permutation_test(
        (d,), lambda x, axis: np.mean(x, axis=axis), permutation_type="samples",
        n_resamples=np.inf, vectorized=True, alternative="two-sided",
    )
    return float(res.pvalue)


def _binomial_sign_flip_p(n: int, num_positive: int) -> float:
    """Exact p for d = +-c: the flipped sum is c (2B - n) with B ~ Binomial(n, 1/2)."""
    observed = abs(2 * num_positive - n)
    b = np.arange(n + 1)
    return float(sps.binom.pmf(b, n, 0.5)[np.abs(2 * b - n) >= observed].sum())


# --- effects -----------------------------------------------------------------


def test_log_ratios_and_effect_pct():
    d = stats.log_ratios([110.0, 121.0], [100.0, 110.0])
    np.testing.assert_allclose(d, [math.log(1.1), math.log(1.1)])
    assert stats.effect_pct(d) == pytest.approx(10.0)


def test_display_mean_is_labelled_and_differs_from_estimand():
    shown = stats.display_mean_pct([110.0, 90.0], [100.0, 100.0])
    assert shown.value_pct == pytest.approx(0.0)
    assert "display" in shown.label and shown.n == 2
    # the estimand is the geometric one: 100 (sqrt(1.1 x 0.9) - 1)
    estimand = stats.effect_pct(stats.log_ratios([110.0, 90.0], [100.0, 100.0]))
    assert estimand == pytest.approx(100 * (math.sqrt(0.99) - 1))


@pytest.mark.parametrize(
    ("a", "b", "needle"),
    [
        ([1.0, 2.0], [1.0], "equal lengths"),
        ([1.0, 0.0], [1.0, 1.0], "positive"),
        ([1.0, np.nan], [1.0, 1.0], "finite"),
        ([], [], "n >= 1"),
    ],
)
def test_paired_inputs_rejected_with_named_field(a, b, needle):
    with pytest.raises(ValueError, match=needle):
        stats.log_ratios(a, b)


def test_geometric_mean():
    assert stats.geometric_mean([1.0, 100.0]) == pytest.approx(10.0)
    assert stats.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="positive"):
        stats.geometric_mean([2.0, -8.0])


def test_normalized_index_forms_products_within_seed_before_averaging():
    table = [[100.0, 120.0, 150.0], [200.0, 220.0, 330.0]]
    idx = stats.normalized_index(table)
    np.testing.assert_allclose(idx.per_seed, [[1.0, 1.2, 1.5], [1.0, 1.1, 1.65]])
    np.testing.assert_allclose(idx.mean, [1.0, 1.15, 1.575])
    np.testing.assert_allclose(idx.geometric_mean, [1.0, math.sqrt(1.32), math.sqrt(1.5 * 1.65)])
    # not the ratio of arm means (480/300 = 1.6)
    assert idx.mean[2] != pytest.approx(1.6)
    with pytest.raises(ValueError, match="seeds x arms"):
        stats.normalized_index([1.0, 2.0])


# --- sign-flip test --------------------------------------------------------------


def test_sign_flip_hand_enumerated_with_float_tie():
    d = [0.1, 0.2, -0.05]
    # The 8 signed sums, by hand: +-0.35, +-0.25, +-0.15, +-0.05. |sum| >= 0.25 for
    # 0.35, -0.35, 0.25 (observed) and -0.25 (= -0.1 - 0.2 + 0.05, a float tie): 4 / 8.
    res = stats.sign_flip_test(d)
    assert res.pvalue == 0.5
    assert res.statistic == pytest.approx(0.25 / 3)
    assert (res.method, res.n, res.n_assignments) == ("exact", 3, 8)


def test_sign_flip_twelve_positive_seeds_reaches_the_minimum():
    d = np.linspace(0.01, 0.12, 12)
    res = stats.sign_flip_test(d)
    assert res.pvalue == 2 / 4096
    assert res.n_assignments == 4096


@pytest.mark.parametrize("n", [4, 6, 9, 12])
def test_sign_flip_matches_scipy_permutation_test(n):
    rng = np.random.default_rng(1000 + n)
    for shift in (0.0, 0.02, 0.05):
        d = rng.normal(shift, 0.04, size=n)
        assert stats.sign_flip_test(d).pvalue == pytest.approx(_scipy_sign_flip(d), rel=1e-12)


@pytest.mark.parametrize(("n", "num_positive"), [(7, 5), (15, 11), (20, 14)])
def test_sign_flip_exact_equal_magnitudes_match_binomial(n, num_positive):
    d = np.array([0.03] * num_positive + [-0.03] * (n - num_positive))
    res = stats.sign_flip_test(d)
    assert res.method == "exact"
    assert res.pvalue == pytest.approx(_binomial_sign_flip_p(n, num_positive), rel=1e-12)


def test_sign_flip_zero_effect_gives_one():
    assert stats.sign_flip_test([0.1, -0.1]).pvalue == 1.0


def test_sign_flip_monte_carlo_beyond_twenty_seeds():
    n, num_positive = 25, 18
    d = np.array([0.02] * num_positive + [-0.02] * (n - num_positive))
    res = stats.sign_flip_test(d, seed=7)
    assert res.method == "monte_carlo"
    assert res.n_assignments == stats.MC_RESAMPLES
    exact = _binomial_sign_flip_p(n, num_positive)
    se = math.sqrt(exact * (1 - exact) / res.n_assignments)
    assert abs(res.pvalue - exact) < 5 * se
    assert stats.sign_flip_test(d, seed=7).pvalue == res.pvalue
    assert stats.sign_flip_test(d, seed=8).pvalue != res.pvalue


# --- Holm and two looks ------------------------------------------------------------


def test_holm_hand_example():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 -> max(0.06, 0.04)
    np.testing.assert_allclose(stats.holm(p), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_array_equal(stats.holm_reject(p, 0.05), [True, False, False, True])


def test_holm_family_of_22_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(22)
    p = np.concatenate([rng.uniform(0, 0.004, 8), rng.uniform(0, 1, 12), [0.002, 0.002]])
    rng.shuffle(p)
    assert p.size == 22
    reject_ref, adjusted_ref, _, _ = multipletests(p, alpha=0.05, method="holm")
    np.testing.assert_allclose(stats.holm(p), adjusted_ref, rtol=1e-12)
    for alpha in (0.01, 0.05, 0.10):
        reject_ref = multipletests(p, alpha=alpha, method="holm")[0]
        np.testing.assert_array_equal(stats.holm_reject(p, alpha), reject_ref)
    assert 0 < stats.holm_reject(p, 0.05).sum() < 22


def test_holm_rejects_bad_pvalues():
    with pytest.raises(ValueError, match="pvalues"):
        stats.holm([0.2, 1.5])
    with pytest.raises(ValueError, match="alpha"):
        stats.holm_reject([0.2], alpha=0.0)


@pytest.mark.parametrize(
    ("p6", "p9", "expected"),
    [(0.03, None, 0.06), (0.03, 0.01, 0.02), (0.02, 0.5, 0.04), (0.6, 0.7, 1.0), (0.4, 1.0, 0.8)],
)
def test_two_look(p6, p9, expected):
    assert stats.two_look(p6, p9) == pytest.approx(expected)


def test_two_look_rejects_out_of_range():
    with pytest.raises(ValueError, match="p9"):
        stats.two_look(0.1, 1.2)


# --- intervals -----------------------------------------------------------------


def test_paired_t_interval_df5_with_typed_t():
    d = np.array([0.01, 0.03, 0.02, 0.05, 0.04, 0.00])
    # mean 0.025; squared deviations sum to 1.75e-3, so s^2 = 3.5e-4 and se = s / sqrt(6)
    se = math.sqrt(3.5e-4) / math.sqrt(6)
    res = stats.paired_t_interval(d)
    assert res.df == 5
    assert res.effect_pct == pytest.approx(100 * math.expm1(0.025))
    for t_value, rel in ((T_975_DF5, 1e-12), (T_975_DF5_SPEC, 1e-8)):
        assert res.low_pct == pytest.approx(100 * math.expm1(0.025 - t_value * se), rel=rel)
        assert res.high_pct == pytest.approx(100 * math.expm1(0.025 + t_value * se), rel=rel)


def test_paired_t_interval_matches_scipy_ttest_rel():
    rng = np.random.default_rng(5)
    a = rng.uniform(90, 110, 8)
    b = a * np.exp(rng.normal(0.03, 0.02, 8))
    ci = sps.ttest_rel(np.log(b), np.log(a)).confidence_interval(0.90)
    res = stats.paired_t_interval(stats.log_ratios(b, a), confidence=0.90)
    assert res.low_pct == pytest.approx(100 * math.expm1(ci.low), rel=1e-10)
    assert res.high_pct == pytest.approx(100 * math.expm1(ci.high), rel=1e-10)


def test_paired_t_interval_needs_two_seeds():
    with pytest.raises(ValueError, match="n >= 2"):
        stats.paired_t_interval([0.1])
    with pytest.raises(ValueError, match="confidence"):
        stats.paired_t_interval([0.1, 0.2], confidence=95)


def test_bootstrap_deterministic_by_seed():
    d = [2.13, 5.41, -1.27, 3.08, 4.66, 0.35]  # seedwise percent changes
    first = stats.bootstrap_mean_interval(d, seed=3)
    assert first == stats.bootstrap_mean_interval(d, seed=3)
    assert first != stats.bootstrap_mean_interval(d, seed=4)
    assert first[0] <= sum(d) / len(d) <= first[1]
    low, high = stats.bootstrap_mean_interval([0.1, 0.1, 0.1], seed=0)
    assert low == pytest.approx(high)
    with pytest.raises(ValueError, match="n_resamples=0"):
        stats.bootstrap_mean_interval(d, n_resamples=0)


def test_bootstrap_close_to_normal_theory_for_many_seeds():
    d = np.random.default_rng(11).normal(5.0, 10.0, 400)
    low, high = stats.bootstrap_mean_interval(d, seed=1)
    half = 1.959964 * d.std(ddof=0) / math.sqrt(d.size)
    assert low == pytest.approx(d.mean() - half, abs=0.25)
    assert high == pytest.approx(d.mean() + half, abs=0.25)


# --- composite estimands ---------------------------------------------------------


def test_interaction_in_percentage_points():
    """A family's interaction (analysis.inference.families.seedwise): per seed the
    difference of the two seedwise percent changes (pp) and of the two log ratios."""
    from analysis.inference.families import seedwise

    d_a, d_b = [0.2, 0.1, 0.3], [0.05, 0.0, 0.1]
    frame = pd.DataFrame({"a.treatment": np.exp(d_a), "a.control": 1.0,
                          "b.treatment": np.exp(d_b), "b.control": 1.0})
    per = seedwise(frame, "interaction", "log")
    pp = [100 * (math.exp(a) - math.exp(b)) for a, b in zip(d_a, d_b, strict=True)]
    assert list(per["pct"]) == pytest.approx(pp)
    assert per["pct"].mean() == pytest.approx(sum(pp) / 3)  # the mean of seedwise pp
    back_transformed = 100 * math.expm1(0.2) - 100 * math.expm1(0.05)
    assert abs(per["pct"].mean() - back_transformed) > 0.05  # the other definition differs
    assert list(per["log"]) == pytest.approx([0.15, 0.1, 0.2])
    assert stats.sign_flip_test(per["log"].to_numpy()).pvalue == 0.25  # all positive: 2 / 8


def test_containment_pass_and_fail():
    off = np.full(5, 100.0)
    log_pct = np.array([0.5, 1.0, 1.5, 0.0, 1.0])  # 100 ln(on/off)
    res = stats.containment(off * np.exp(log_pct / 100), off)
    # mean 0.8, s^2 = (0.09 + 0.04 + 0.49 + 0.64 + 0.04) / 4 = 0.325
    half = T_95_DF4 * math.sqrt(0.325 / 5)
    assert res.passed
    assert res.estimate_log_pct == pytest.approx(0.8)
    assert (res.low_log_pct, res.high_log_pct) == (pytest.approx(0.8 - half),
                                                   pytest.approx(0.8 + half))
    shifted = stats.containment(off * np.exp((log_pct + 2.5) / 100), off)
    assert not shifted.passed and shifted.high_log_pct > 3.0


def _retention_table(diffs, d_isolate=None, seeds=None):
    """Throughputs whose per-seed d_SHARE - d_ISOLATE equals `diffs`."""
    n = len(diffs)
    seeds = seeds or list(range(88001, 88001 + n))
    d_iso = d_isolate if d_isolate is not None else [0.01] * n
    rows = []
    for s, diff, di in zip(seeds, diffs, d_iso, strict=True):
        base = 100.0 + (s % 7)
        for policy, mode, value in (
            ("S2", "SHARE", base), ("Ret", "SHARE", base * math.exp(diff + di)),
            ("S2", "ISOLATE", base * 0.8), ("Ret", "ISOLATE", base * 0.8 * math.exp(di)),
        ):
            rows.append({"seed": s, "policy": policy, "mode": mode, "throughput": value})
    return pd.DataFrame(rows)


def test_retention_interaction_confirmed_with_typed_t():
    diffs = [0.04, 0.06, 0.05, 0.07, 0.03, 0.05]
    res = stats.retention_interaction(_retention_table(diffs))
    mean = 0.05
    se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 5) / math.sqrt(6)
    assert res.n == 6 and res.seeds == tuple(range(88001, 88007))
    assert res.k_ret.effect_pct == pytest.approx(100 * math.expm1(mean))
    assert res.k_ret.low_pct == pytest.approx(100 * math.expm1(mean - T_975_DF5 * se))
    assert res.delta_isolate.effect_pct == pytest.approx(100 * math.expm1(0.01))
    assert res.delta_share.effect_pct == pytest.approx(100 * math.expm1(0.06))
    assert res.decision == stats.CONFIRMED
    assert set(res.as_dict()) == {"K_ret", "delta_share", "delta_isolate", "decision", "n"}


def test_retention_interaction_directional_and_not_confirmed():
    directional = stats.retention_interaction(
        _retention_table([0.001, 0.001, 0.001, 0.001, 0.001, 0.5]))
    assert directional.k_ret.low_pct < 0 and directional.decision == stats.DIRECTIONAL
    mixed = stats.retention_interaction(_retention_table([0.03, -0.02, 0.01, 0.02, -0.01, 0.0]))
    assert mixed.decision == stats.NOT_CONFIRMED
    negative = stats.retention_interaction(
        _retention_table([-0.04, -0.06, -0.05, -0.07, -0.03, -0.05]))
    assert negative.k_ret.high_pct < 0 and negative.decision == stats.NOT_CONFIRMED


def test_retention_pairs_name_missing_and_duplicated_seeds():
    table = _retention_table([0.05] * 6)
    gap = table.drop(table.index[(table.seed == 88003) & (table.policy == "Ret")
                                 & (table["mode"] == "ISOLATE")])
    with pytest.raises(ValueError, match=r"seeds \[88003\].*missing Ret/ISOLATE"):
        stats.retention_interaction(gap)
    dup = pd.concat([table, table[table.seed == 88005].head(1)])
    with pytest.raises(ValueError, match=r"seeds \[88005\].*duplicated S2/SHARE x2"):
        stats.retention_interaction(dup)
    with pytest.raises(ValueError, match=r"seeds \[88007\]"):
        stats.retention_interaction(table, expected_seeds=range(88001, 88008))
    bad = table.assign(policy=table.policy.replace("Ret", "S2+R"))
    with pytest.raises(ValueError, match=r"policy.*allowed values are \('S2', 'Ret'\)"):
        stats.retention_interaction(bad)
