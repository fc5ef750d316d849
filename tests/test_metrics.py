"""Malleability metrics: hand-computed cases, edge cases, and the streamed statistics against their slow twins."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import metric_passes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from art_malleability import metrics as M


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


def _passes(before, after, n_bootstrap=25, seed=0, block=4, top_fraction=0.2, rank_by="abs"):
    return metric_passes(before, after, n_bootstrap, seed, block, top_fraction=top_fraction, rank_by=rank_by)


@pytest.mark.parametrize("ties", [False, True])
def test_the_jackknife_values_are_spearman_without_each_group(rng, ties):
    """Each leave-one-group-out correlation equals scipy's on the matrices without that group's queries."""
    before = rng.normal(size=(23, 30))
    after = before + rng.normal(size=before.shape)
    if ties:
        before, after = np.round(before), np.round(after)
        before[2, 3] = after[5, 1] = np.nan
    clean, perturbed = _passes(before, after)
    point, replicates = perturbed.spearman()
    assert point == pytest.approx(M.spearman(before, after), abs=1e-12)
    groups = clean.pairs.groups.numpy()
    assert len(replicates) == 20 and sorted(set(groups)) == list(range(20))
    for g, value in enumerate(replicates):
        kept = groups != g
        assert value == pytest.approx(M.spearman(before[kept], after[kept]), abs=1e-12)



def test_the_passes_of_one_clean_pass_share_its_sorted_side_and_stay_exact(rng):
    """The clean side's sort is kept between passes while every pair is finite: passes with and without excluded
    pairs, in any order, each equal scipy's correlation on their own matrices (and so do their jackknife values)."""
    from art_malleability.metrics.accumulators import PerturbedScores

    before = np.round(rng.normal(size=(23, 30)), 1)
    afters = [before + rng.normal(size=before.shape) for _ in range(3)]
    afters[1][4, 7] = afters[1][9, 0] = np.nan
    clean, _ = _passes(before, afters[0])
    groups = clean.pairs.groups.numpy()
    for after in afters + afters[::-1]:
        perturbed = PerturbedScores(clean)
        for s in range(0, len(after), 5):
            perturbed.add(after[s : s + 5])
        point, replicates = perturbed.spearman()
        assert point == pytest.approx(M.spearman(before, after), abs=1e-12)
        for g, value in enumerate(replicates):
            kept = groups != g
            assert value == pytest.approx(M.spearman(before[kept], after[kept]), abs=1e-12)

def test_a_single_query_has_statistics_but_no_intervals(rng):
    before = rng.normal(size=(40, 50))
    after = before + 0.5 * rng.normal(size=before.shape)
    single = M.malleability_metrics(before[:1], after[:1], n_bootstrap=50)
    assert np.isfinite(single.spearman.value) and np.isfinite(single.flip_rate.value)
    for name in ("flip_rate", "per_query_flip_rate", "spearman", "top_k_jaccard", "noise_aware_flip_rate"):
        assert all(np.isnan(v) for v in getattr(single, name).interval), name


def test_bootstrap_is_deterministic_and_validated(rng):
    before = rng.normal(size=(10, 30))
    after = before + rng.normal(size=before.shape)
    first, again = (json.dumps(M.malleability_metrics(before, after, seed=3).to_dict(), sort_keys=True, default=str)
                    for _ in range(2))
    assert first == again  # NaN included (pure noise: no retention is a share here)
    with pytest.raises(ValueError, match="confidence"):
        M.normal_interval(0.0, np.zeros(10), confidence=1.0)
    with pytest.raises(ValueError, match="confidence"):
        M.t_interval(np.zeros(10), confidence=0.0)
    with pytest.raises(ValueError, match="n_bootstrap"):
        M.resample_rows(10, n_bootstrap=0)
    with pytest.raises(ValueError, match="same shape"):
        M.flip_rate(before, after[:, :5])
    with pytest.raises(ValueError, match="influence matrix"):
        M.spearman(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))


def test_the_metrics_check_their_settings_through_the_shared_rules():
    """``n_bootstrap``, ``confidence`` and ``rank_by`` go through the rules the audit uses, naming the parameter: a
    float count such as ``3.0`` is refused here as the audit's ``n_bootstrap`` refuses it."""
    from art_malleability._utils.params import CONFIDENCE, POSITIVE_INT, RANK_BY, InvalidParameterError
    from art_malleability.metrics.accumulators import CleanScores, QueryResampling

    for bad in (0, -2, 3.0, True, "5", None):
        with pytest.raises(InvalidParameterError) as refused:
            M.resample_rows(10, n_bootstrap=bad)
        with pytest.raises(InvalidParameterError) as rule:
            POSITIVE_INT(bad, "n_bootstrap")
        assert refused.value.param == "n_bootstrap" and str(refused.value) == str(rule.value)
    rows = M.resample_rows(10, n_bootstrap=np.int64(4), seed=2)
    assert rows.shape == (4, 10) and np.array_equal(rows, M.resample_rows(10, 4, 2))
    for bad in (0.0, 1.0, float("nan"), -0.5, "0.9", None, True):
        with pytest.raises(InvalidParameterError) as refused:
            M.check_confidence(bad)
        with pytest.raises(InvalidParameterError) as rule:
            CONFIDENCE(bad, "confidence")
        assert refused.value.param == "confidence" and str(refused.value) == str(rule.value)
    assert M.check_confidence(np.float32(0.9)) == np.float32(0.9) and M.check_confidence(0.95) == 0.95
    for bad in ("first", None, "ABS"):
        with pytest.raises(InvalidParameterError) as refused:
            CleanScores(QueryResampling(4, 5, 0), 10, rank_by=bad)
        with pytest.raises(InvalidParameterError) as rule:
            RANK_BY(bad, "rank_by")
        assert refused.value.param == "rank_by" and str(refused.value) == str(rule.value)


def test_inputs_not_mutated(rng):
    before = rng.normal(size=(6, 20))
    after = rng.normal(size=(6, 20))
    before[0, 0] = np.nan
    copies = before.copy(), after.copy()
    M.malleability_metrics(before, after, n_bootstrap=20)
    np.testing.assert_array_equal(before, copies[0])
    np.testing.assert_array_equal(after, copies[1])


def test_a_given_perturbed_set_is_the_one_measured(rng):
    """Only the top set is perturbed (strategy "top"); passing it gives the flip rate of that set."""
    n_query, n_train = 60, 200
    before = rng.normal(size=(n_query, n_train)) + rng.normal(size=n_train)
    top = M.top_indices(M.aggregate_scores(before), 20)
    after = before.copy()
    after[:, top] = rng.normal(size=(n_query, 20)) + rng.normal(size=20)
    result = M.malleability_metrics(before, after, 0.1, n_bootstrap=50, top=top)
    assert result.flip_rate.value == M.flip_rate(before, after, 0.1) == M.flip_rate(before, after, top=top)
    assert result.top_k_jaccard.value == M.top_k_jaccard(before, after, top=top)


@pytest.mark.parametrize("ties", [False, True])
def test_streamed_resamples_equal_one_at_a_time(rng, ties):
    """The streamed bootstrap statistics give the values of the one-resample definitions, block by block."""
    before = rng.normal(size=(11, 40))  # resampled from 10 queries on (MIN_INTERVAL_QUERIES)
    after = before + rng.normal(size=before.shape)
    if ties:
        before, after = np.round(before), np.round(after)
        before[1, 5] = after[3, 7] = np.nan
        before[:, 11] = np.nan  # a column without any finite score
    clean, perturbed = _passes(before, after, n_bootstrap=25, block=2, top_fraction=0.15)
    top = clean.top
    assert list(top) == list(M.top_indices(M.aggregate_scores(before), 6))
    boot_b, boot_a = (t.numpy() for t in perturbed.resampled_top())
    jaccards = perturbed.resampled_jaccard().numpy()
    for i, r in enumerate(M.resample_rows(11, 25, 0)):
        w = np.bincount(r, minlength=11).astype(float)
        agg_b, agg_a = M.aggregate_scores(before, w), M.aggregate_scores(after, w)
        np.testing.assert_allclose(boot_b[i], agg_b[top], rtol=1e-12)
        np.testing.assert_allclose(boot_a[i], agg_a[top], rtol=1e-12)
        assert jaccards[i] == M.aggregate_jaccard(agg_a, top, 6, "abs")
    np.testing.assert_allclose(perturbed.per_query.numpy(), M.per_query_flip_rates(before, after, 0.15), rtol=1e-15)
    for rank_by in ("abs", "signed"):
        values = np.round(rng.normal(size=(7, 30)))
        values[2, :5] = np.nan
        masks = M.top_masks(torch.as_tensor(values), 8, rank_by).numpy()
        for i in range(7):
            assert set(np.flatnonzero(masks[i])) == set(M.top_indices(values[i], 8, rank_by).tolist())


def test_the_noise_aware_rate_counts_population_flips_not_noise(rng):
    """
    40 queries, unit standard errors: examples 0-9 flip far from zero, 10-19 keep their sign far from zero, 20-29
    keep it with an after-score buried in noise (0.1 SE): their measured signs flip by chance, no single one of them
    can be classified, and the report says so (``undecided_share``).
    """
    n_query = 40
    mu_b = np.concatenate([np.full(10, 6.0), np.full(10, 5.0), np.full(10, 5.5), rng.normal(0, 0.2, 70)])
    mu_a = np.concatenate([np.full(10, -6.0), np.full(10, 4.0), np.full(10, 0.1), rng.normal(0, 0.2, 70)])
    noise = rng.normal(size=(n_query, 100)) * np.sqrt(n_query)
    before, after = mu_b + noise, mu_a + 0.6 * noise + 0.8 * rng.normal(size=noise.shape) * np.sqrt(n_query)
    top = np.arange(30)
    aware = M.noise_aware_flip_rate(before, after, top=top, selected=False)
    probabilities = aware["flip_probabilities"]
    assert np.all(probabilities[:10] > 0.9) and np.all(probabilities[10:20] < 0.1)
    assert aware["estimate"] == pytest.approx(np.mean(probabilities))
    assert 1 / 3 <= aware["estimate"] <= 0.67 and aware["ci"][0] > 0.2  # the undecided third may go either way
    assert aware["undecided_share"] == pytest.approx(1 / 3, abs=0.1)
    assert aware["null_raw_flip_rate"] > 0.05 and aware["no_flip_statistic"] > 10.0


def test_excess_flip_rate_is_paired_with_its_control(rng):
    before = rng.normal(size=(30, 60)) + rng.normal(size=60)
    after = before + rng.normal(size=before.shape)
    control = M.malleability_metrics(before, after, n_bootstrap=100, seed=4, keep_draws=True)
    same = M.malleability_metrics(before, after, n_bootstrap=100, seed=4, control=control)
    assert same.excess_flip_rate == M.Estimate(0.0, 0.0, 0.0)  # paired: no noise
    other = M.malleability_metrics(before, before + 3 * rng.normal(size=before.shape), n_bootstrap=100, seed=4,
                                   control=control)
    assert other.excess_flip_rate.value == pytest.approx(other.flip_rate.value - control.flip_rate.value)
    with pytest.raises(ValueError, match="keep_draws=True on the same resamples .*got seed 4, n_bootstrap 100"):
        M.malleability_metrics(before, after, n_bootstrap=50, seed=4, control=control)
    with pytest.raises(ValueError, match="got seed 4, n_bootstrap 100"):
        M.malleability_metrics(before, after, n_bootstrap=100, seed=5, control=control)
    with pytest.raises(ValueError, match="no record of its resamples"):
        M.malleability_metrics(before, after, n_bootstrap=100, seed=4, control=replace(control, replicates=None))
    with pytest.raises(TypeError, match="control must hold the metrics of malleability_metrics .*got dict"):
        M.malleability_metrics(before, after, n_bootstrap=100, seed=4, control=control.to_dict())


def test_a_control_of_several_draws_adds_their_spread(rng):
    before = rng.normal(size=(30, 60)) + rng.normal(size=60)
    draws = [M.malleability_metrics(before, before + rng.normal(size=before.shape), n_bootstrap=100, seed=4,
                                    keep_draws=True) for _ in range(4)]
    combined = M.combine_controls(draws)
    rates = [d.flip_rate.value for d in draws]
    assert combined.flip_rate.value == pytest.approx(np.mean(rates)) and combined.n_draws == 4
    assert combined.draw_variance["flip_rate"] == pytest.approx(np.var(rates, ddof=1))
    mean_draws = np.mean([d.replicates.flip_rate for d in draws], axis=0)
    np.testing.assert_array_equal(combined.replicates.flip_rate, mean_draws)
    half = M.z_value(0.95) * np.sqrt(np.var(mean_draws, ddof=1) + np.var(rates, ddof=1) / 4)
    value = combined.flip_rate.value
    assert combined.flip_rate.interval == pytest.approx((value - half, value + half))
    attack = M.malleability_metrics(before, before + 2 * rng.normal(size=before.shape), n_bootstrap=100, seed=4,
                                    control=combined, keep_draws=True)
    assert attack.excess_flip_rate.value == pytest.approx(attack.flip_rate.value - value)
    # the excess's interval: the paired differences of the replicates (the same resamples) plus the draws' spread
    paired = attack.replicates.flip_rate - mean_draws
    excess = attack.excess_flip_rate.value
    half = M.z_value(0.95) * np.sqrt(np.var(paired, ddof=1) + np.var(rates, ddof=1) / 4)
    assert attack.excess_flip_rate.interval == pytest.approx((max(excess - half, -1.0), min(excess + half, 1.0)))
    other = M.malleability_metrics(before, before, n_bootstrap=100, seed=5, keep_draws=True)
    with pytest.raises(ValueError, match="the draws of one control must"):
        M.combine_controls([draws[0], other])
    with pytest.raises(ValueError, match="draws must be computed by malleability_metrics with keep_draws=True"):
        M.combine_controls([M.malleability_metrics(before, before, n_bootstrap=100, seed=4)])
    with pytest.raises(TypeError, match="draws must hold the metrics of malleability_metrics"):
        M.combine_controls([draws[0].to_dict()])


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
def test_any_scores_give_ordered_intervals_in_range(shape, seed, ties, nan_share, top_fraction, rank_by, confidence,
                                                    noise):
    """Property: whatever the scores (ties, excluded pairs, tiny sets), the metrics run and every interval is
    ordered, inside the statistic's range, or undefined (both ends NaN). (Coverage: tests/test_statistics.py.)"""
    rng = np.random.default_rng(seed)
    before = rng.normal(size=shape) + rng.normal(size=shape[1])
    after, control_after = (before + s * rng.normal(size=shape) for s in (1.0, 0.5))
    if ties:
        before, after, control_after = np.round(before), np.round(after), np.round(control_after)
    for m in (before, after, control_after):
        m[rng.random(shape) < nan_share] = np.nan
    kwargs = dict(top_fraction=top_fraction, rank_by=rank_by, n_bootstrap=40, confidence=confidence, seed=seed,
                  noise=(noise, 0.1) if noise else None)
    control = M.malleability_metrics(before, control_after, keep_draws=True, **kwargs)
    result = M.malleability_metrics(before, after, control=control, **kwargs)
    reported = result.to_dict()
    for name, (lowest, highest) in M.BOUNDS.items():
        low, high = reported[name + "_ci"]
        if np.isnan(low) or np.isnan(high):
            assert np.isnan(low) and np.isnan(high), name
            continue
        assert lowest <= low <= high <= highest, (name, low, high)
    mean, (low, high) = M.seed_interval(np.array([result.flip_rate.value, control.flip_rate.value]), confidence)
    assert np.isnan(low) or low <= high


@pytest.mark.parametrize("fraction", [1.0, 0.5, 1 / 3, 0.1, 0.07, 0.001])
def test_the_smallest_training_set_is_the_first_with_a_non_empty_influential_set(fraction):
    from art_malleability.metrics import smallest_training_set, top_k_count

    n = smallest_training_set(fraction)
    assert top_k_count(n, fraction) >= 1 and (n == 1 or top_k_count(n - 1, fraction) == 0)


def test_intervals_need_the_queries_that_keep_their_coverage_in_the_band():
    """A normal interval with the bootstrap's standard error of a mean over n Gaussian queries covers
    2 T_{n-1}(z sqrt((n-1)/n)) - 1: MIN_INTERVAL_QUERIES is the first n inside the 90-98 % band, and below it the
    resampled intervals and the noise-aware rate are null (a new user's 2 queries printed 34.0 % [34.0, 34.0])."""
    from scipy.stats import t

    from art_malleability.metrics.accumulators import QueryResampling

    def coverage(n):
        return 2 * t.cdf(M.z_value(0.95) * np.sqrt((n - 1) / n), n - 1) - 1

    n = M.MIN_INTERVAL_QUERIES
    assert coverage(n) >= 0.90 > coverage(n - 1)
    assert QueryResampling(n - 1, 50, 0).n_bootstrap == 0 and QueryResampling(n, 50, 0).n_bootstrap == 50
    rng = np.random.default_rng(3)
    mu = np.where(np.arange(60) < 6, 3.0, 0.0)
    for queries, defined in ((n - 1, False), (n, True)):
        before = mu + rng.normal(size=(queries, 60))
        result = M.malleability_metrics(before, before + 0.3 * rng.normal(size=before.shape), n_bootstrap=50,
                                        top_fraction=0.1)
        assert np.isfinite(result.flip_rate.value)  # the point is reported either way
        assert np.isfinite(result.flip_rate.interval).all() == defined
        assert np.isfinite(result.noise_aware_flip_rate.value) == defined
        assert np.isfinite(result.per_query_flip_rate.interval).all()  # Student-t over the queries: always
