"""Malleability metrics: hand-computed cases, edge cases, and the fast bootstrap against its slow twin."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from art_malleability import metrics as M
from art_malleability.metrics import _ResampledSpearman


def test_top_k_count():
    assert M.top_k_count(100, 0.1) == 10
    assert M.top_k_count(30, 0.1) == 3  # 0.1 * 30 is 3.0000000000000004 in floats
    assert M.top_k_count(9, 0.1) == 0
    assert M.top_k_count(5, 1.0) == 5
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="top_fraction"):
            M.top_k_count(10, bad)


def test_top_indices_ties_nan_and_ranking():
    values = np.array([1.0, -3.0, 3.0, np.nan, 0.5])
    assert M.top_indices(values, 2).tolist() == [1, 2]  # tie on |3|: lower index first
    assert M.top_indices(values, 2, "signed").tolist() == [2, 0]
    assert M.top_indices(values, 10).tolist() == [1, 2, 0, 4]  # NaN never selected
    assert M.top_indices(values, 0).tolist() == []
    with pytest.raises(ValueError, match="rank_by"):
        M.top_indices(values, 1, "size")


def test_flip_mask_zero_and_nan_are_not_flips():
    before = np.array([1.0, 1.0, -2.0, 0.0, 1.0, np.nan])
    after = np.array([-1.0, 0.0, 3.0, -1.0, 2.0, -1.0])
    assert M.flip_mask(before, after).tolist() == [True, False, True, False, False, False]


def test_flip_rate_hand_computed():
    # two queries, ten training examples; aggregate = column mean
    before = np.array([[5.0, -4.0, 1, 1, 1, 1, 1, 1, 1, 1], [3.0, -2.0, 1, 1, 1, 1, 1, 1, 1, 1]])
    after = before.copy()
    after[:, 0] = -1.0  # the most influential example flips
    # top_fraction 0.2 -> k = 2: examples 0 (|4|) and 1 (|-3|); one of two flips
    assert M.flip_rate(before, after, 0.2) == 0.5
    assert M.flip_rate(before, after, 0.1) == 1.0
    # signed ranking picks 0 and then the first of the tied +1 columns (index 2), which does not flip
    assert M.flip_rate(before, after, 0.2, rank_by="signed") == 0.5
    assert M.flip_rate(before, before, 0.2) == 0.0


def test_flip_rate_empty_set_is_nan():
    before = np.ones((3, 5))
    assert np.isnan(M.flip_rate(before, before, 0.1))
    assert np.isnan(M.top_k_jaccard(before, before, 0.1))


def test_per_query_flip_rates_ignore_excluded_pairs():
    before = np.array([[np.nan, 2.0, -1.0, 0.5], [4.0, np.nan, 1.0, -3.0]])
    after = np.array([[np.nan, -2.0, -1.0, 0.5], [4.0, np.nan, 1.0, 3.0]])
    # 3 finite per row, top_fraction 0.34 -> k = 1: row 0 picks index 1 (flips), row 1 picks index 0 (no)
    assert M.per_query_flip_rates(before, after, 0.34).tolist() == [1.0, 0.0]


def test_aggregate_scores_nan_and_weights():
    scores = np.array([[np.nan, 2.0], [1.0, 4.0]])
    assert M.aggregate_scores(scores).tolist() == [1.0, 3.0]
    assert M.aggregate_scores(scores, np.array([2.0, 1.0])).tolist() == [1.0, pytest.approx(8 / 3)]
    assert np.isnan(M.aggregate_scores(np.array([[np.nan, 1.0]]))[0])


def test_spearman_matches_scipy_and_edge_cases(rng):
    before = rng.normal(size=(5, 20))
    after = before + rng.normal(size=before.shape)
    assert M.spearman(before, after) == pytest.approx(spearmanr(before.ravel(), after.ravel()).statistic)
    assert np.isnan(M.spearman(np.ones((2, 3)), rng.normal(size=(2, 3))))
    assert np.isnan(M.spearman(np.array([[1.0]]), np.array([[2.0]])))
    before[0, 0] = np.nan
    keep = np.isfinite(before)
    assert M.spearman(before, after) == pytest.approx(spearmanr(before[keep], after[keep]).statistic)


def test_jaccard_hand_computed():
    before = np.array([[5.0, 4.0, 1.0, 0.5, 0.1]])
    after = np.array([[5.0, 0.0, 4.0, 0.5, 0.1]])
    # k = 2: {0, 1} vs {0, 2} -> 1 / 3
    assert M.top_k_jaccard(before, after, 0.4) == pytest.approx(1 / 3)


@pytest.mark.parametrize("ties", [False, True])
def test_resampled_spearman_equals_explicit_resample(rng, ties):
    before = rng.normal(size=(12, 30))
    after = before + rng.normal(size=before.shape)
    if ties:
        before = np.round(before)
        after = np.round(after)
        before[2, 3] = np.nan
    fast = _ResampledSpearman(before, after)
    for _ in range(20):
        rows = rng.integers(0, 12, 12)
        assert fast(rows) == pytest.approx(M.spearman(before[rows], after[rows]), abs=1e-12)


def test_bootstrap_interval_contains_estimate_and_single_query_is_nan(rng):
    before = rng.normal(size=(40, 50))
    after = before + 0.5 * rng.normal(size=before.shape)
    result = M.malleability_metrics(before, after, n_bootstrap=200)
    for name in ("flip_rate", "per_query_flip_rate", "spearman", "top_k_jaccard"):
        low, high = result[name + "_ci"]
        assert low <= result[name] <= high, name
    single = M.malleability_metrics(before[:1], after[:1], n_bootstrap=50)
    assert all(np.isnan(v) for v in single["spearman_ci"])
    assert np.isfinite(single["spearman"])


def test_bootstrap_is_deterministic_and_validated(rng):
    before = rng.normal(size=(10, 30))
    after = before + rng.normal(size=before.shape)
    assert M.malleability_metrics(before, after, seed=3) == M.malleability_metrics(before, after, seed=3)
    with pytest.raises(ValueError, match="confidence"):
        M.bootstrap_interval(lambda r: 0.0, 10, confidence=1.0)
    with pytest.raises(ValueError, match="n_bootstrap"):
        M.bootstrap_interval(lambda r: 0.0, 10, n_bootstrap=0)
    with pytest.raises(ValueError, match="same shape"):
        M.flip_rate(before, after[:, :5])
    with pytest.raises(ValueError, match="influence matrix"):
        M.spearman(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))


def test_inputs_not_mutated(rng):
    before = rng.normal(size=(6, 20))
    after = rng.normal(size=(6, 20))
    before[0, 0] = np.nan
    copies = before.copy(), after.copy()
    M.malleability_metrics(before, after, n_bootstrap=20)
    np.testing.assert_array_equal(before, copies[0])
    np.testing.assert_array_equal(after, copies[1])


def test_interval_conditional_on_the_perturbed_set_contains_the_estimate(rng):
    """Only the top set is perturbed (strategy "top"); the interval must bracket the estimate."""
    n_query, n_train = 60, 200
    before = rng.normal(size=(n_query, n_train)) + rng.normal(size=n_train)
    top = M.top_indices(M.aggregate_scores(before), 20)
    after = before.copy()
    after[:, top] = rng.normal(size=(n_query, 20)) + rng.normal(size=20)
    result = M.malleability_metrics(before, after, 0.1, n_bootstrap=300, top=top)
    assert result["flip_rate"] == M.flip_rate(before, after, 0.1)
    for name in ("flip_rate", "top_k_jaccard"):
        low, high = result[name + "_ci"]
        assert low <= result[name] <= high, name


@pytest.mark.parametrize("ties", [False, True])
def test_batched_resamples_equal_one_at_a_time(rng, ties):
    """The batched bootstrap statistics give the values of the one-resample definitions."""
    before = rng.normal(size=(9, 40))
    after = before + rng.normal(size=before.shape)
    if ties:
        before, after = np.round(before), np.round(after)
        before[1, 5] = after[3, 7] = np.nan
        before[:, 11] = np.nan  # a column without any finite score
    top = M.top_indices(M.aggregate_scores(before), 6)
    noise = 0.05
    aggregates = M._ResampledAggregates(before, after, top, 6, "abs", M.z_value(0.9), noise)
    spearman_fast = _ResampledSpearman(before, after)
    rows = rng.integers(0, 9, (25, 9))
    flips, jaccards, rhos = aggregates.flip_rate(rows), aggregates.top_k_jaccard(rows), spearman_fast.batch(rows)
    floor = aggregates.flip_rate_above_floor(rows)
    for i, r in enumerate(rows):
        w = np.bincount(r, minlength=9).astype(float)
        agg_b, agg_a = M.aggregate_scores(before, w), M.aggregate_scores(after, w)
        assert flips[i] == M._aggregate_flip_rate(agg_b, agg_a, top)
        assert floor[i] == M.flip_rate_above_floor(before[r], after[r], top=top, noise=noise, confidence=0.9)
        assert jaccards[i] == M._aggregate_jaccard(agg_a, top, 6, "abs")
        assert rhos[i] == pytest.approx(M.spearman(before[r], after[r]), abs=1e-12)
    for rank_by in ("abs", "signed"):
        values = np.round(rng.normal(size=(7, 30)))
        values[2, :5] = np.nan
        masks = M._top_masks(values, 8, rank_by)
        for i in range(7):
            assert set(np.flatnonzero(masks[i])) == set(M.top_indices(values[i], 8, rank_by).tolist())


def test_noise_thresholds_are_standard_errors_of_the_column_means(rng):
    from scipy.stats import sem

    scores = rng.normal(size=(12, 7))
    scores[3, 2] = np.nan
    scores[:, 5] = np.nan
    scores[1:, 6] = np.nan  # a single finite value: the sign is never determined
    expected = np.array([sem(col[np.isfinite(col)]) if np.isfinite(col).sum() > 1 else np.inf for col in scores.T])
    z = M.z_value(0.95)
    assert z == pytest.approx(1.959964, abs=1e-6)
    np.testing.assert_allclose(M.noise_thresholds(scores), z * expected, rtol=1e-12)
    np.testing.assert_allclose(M.noise_thresholds(scores, noise=0.3), z * np.sqrt(expected**2 + 0.09), rtol=1e-12)
    with pytest.raises(ValueError, match="noise"):
        M.noise_thresholds(scores, noise=-1.0)


def test_flip_rate_above_floor_counts_only_distinguishable_flips():
    # 20 queries; example 0 flips far from zero, example 1 flips from a score buried in query noise
    q = np.linspace(-1, 1, 20)
    before = np.stack([np.full(20, 5.0) + q, 0.05 + 3 * q, np.full(20, 4.0) + q, np.full(20, 3.0) + q], axis=1)
    after = before.copy()
    after[:, 0] = -5.0 + q
    after[:, 1] = -0.05 + 3 * q
    assert M.flip_rate(before, after, 0.5) == 0.5  # top 2: examples 0 and 2 by |mean|
    top = np.array([0, 1])
    assert M.flip_rate(before, after, top=top) == 1.0
    assert M.flip_rate_above_floor(before, after, top=top) == 0.5
    assert M.counted_flips(before, after, top).tolist() == [0]
    assert M.flip_rate_above_floor(before, after, top=top, noise=10.0) == 0.0  # a very noisy estimator


def test_excess_flip_rate_is_paired_with_its_control(rng):
    before = rng.normal(size=(30, 60)) + rng.normal(size=60)
    after = before + rng.normal(size=before.shape)
    control = M.malleability_metrics(before, after, n_bootstrap=100, seed=4, keep_draws=True)
    same = M.malleability_metrics(before, after, n_bootstrap=100, seed=4, control=control)
    assert same["excess_flip_rate"] == 0.0 and same["excess_flip_rate_ci"] == (0.0, 0.0)  # paired: no noise
    other = M.malleability_metrics(before, before + 3 * rng.normal(size=before.shape), n_bootstrap=100, seed=4,
                                   control=control)
    assert other["excess_flip_rate"] == pytest.approx(other["flip_rate"] - control["flip_rate"])
    low, high = other["excess_flip_rate_ci"]
    assert low <= other["excess_flip_rate"] <= high
    with pytest.raises(ValueError, match="keep_draws"):
        M.malleability_metrics(before, after, n_bootstrap=50, control=control)


def test_shifted_percentile_interval():
    draws = np.array([0.2, 0.3, 0.3, 0.4, 0.5, np.nan])
    low, high = M.shifted_percentile_interval(0.1, draws, 0.5)  # quartiles 0.3, 0.4 around median 0.3
    assert (low, high) == pytest.approx((0.1, 0.2))
    assert M.shifted_percentile_interval(0.3, draws, 0.5) == pytest.approx(tuple(np.nanpercentile(draws, [25, 75])))
    assert M.shifted_percentile_interval(0.0, draws, 0.5, bounds=(0.0, 1.0))[0] == 0.0
    assert all(np.isnan(M.shifted_percentile_interval(0.1, np.array([np.nan]))))


def test_hierarchical_interval_adds_the_spread_between_runs(rng):
    points = np.array([0.1, 0.5, 0.3])
    tight = points[:, None] + 1e-3 * rng.normal(size=(3, 200))
    mean, (low, high) = M.hierarchical_interval(points, tight, n_bootstrap=2000, seed=1)
    assert mean == pytest.approx(0.3)
    # nearly no query noise: the interval is the bootstrap of the mean of three runs
    run_means = points[rng.integers(0, 3, (4000, 3))].mean(axis=1)
    assert low == pytest.approx(np.percentile(run_means, 2.5), abs=0.02)
    assert high == pytest.approx(np.percentile(run_means, 97.5), abs=0.02)
    one_mean, one = M.hierarchical_interval(points[:1], tight[:1], seed=1)
    assert one_mean == 0.1 and one[1] - one[0] < 0.01
    with pytest.raises(ValueError, match="one row of replicates per run"):
        M.hierarchical_interval(points, tight[:2])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.tuples(st.integers(2, 7), st.integers(4, 25)),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    nan_share=st.sampled_from([0.0, 0.1, 0.4]),
    top_fraction=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    rank_by=st.sampled_from(["abs", "signed"]),
    confidence=st.sampled_from([0.5, 0.9, 0.95]),
    noise=st.sampled_from([0.0, 0.3]),
)
def test_every_interval_contains_its_point_estimate(shape, seed, ties, nan_share, top_fraction, rank_by, confidence,
                                                    noise):
    """Property: whatever the scores (ties, excluded pairs, tiny sets), each reported interval holds its estimate."""
    rng = np.random.default_rng(seed)
    before = rng.normal(size=shape) + rng.normal(size=shape[1])
    after, control_after = (before + s * rng.normal(size=shape) for s in (1.0, 0.5))
    if ties:
        before, after, control_after = np.round(before), np.round(after), np.round(control_after)
    for m in (before, after, control_after):
        m[rng.random(shape) < nan_share] = np.nan
    kwargs = dict(top_fraction=top_fraction, rank_by=rank_by, n_bootstrap=40, confidence=confidence, seed=seed,
                  noise=noise)
    control = M.malleability_metrics(before, control_after, keep_draws=True, **kwargs)
    result = M.malleability_metrics(before, after, control=control, **kwargs)
    for name, (low, high) in M.BOUNDS.items():
        point = result[name]
        if np.isnan(point):
            continue
        assert not np.isnan(low) and low <= point <= high, (name, point, low, high)
        assert M.BOUNDS[name][0] <= low and high <= M.BOUNDS[name][1]
    pooled_mean, (low, high) = M.hierarchical_interval(
        [result["flip_rate"], control["flip_rate"]], [control["draws"]["flip_rate"]] * 2, 50, confidence, seed
    )
    if np.isfinite(pooled_mean):
        assert low <= pooled_mean <= high
