"""
The selection-corrected signed retention, piece by piece against direct computations: the prior's posterior means
against Tweedie's formula, the slopes and the estimate against whole-matrix arithmetic, the replicates against
resampled aggregates, the combination of a control's draws and an excess against their definitions. (Coverage:
tests/test_statistics.py.)
"""

import dataclasses

import numpy as np
import pytest
from helpers import metric_passes

from art_malleability import metrics as M
from art_malleability.metrics._retention import NormalMeansPrior, RetentionBasis, relative_error_variance
from art_malleability.metrics._summary import EB_LOADINGS, pass_metrics, replicated
from art_malleability.metrics.accumulators import PerturbedScores


def test_the_prior_recovers_a_two_point_distribution_and_its_posterior_means_follow_tweedie(rng):
    theta = np.where(rng.random(20000) < 0.3, 3.0, 0.0)
    prior = NormalMeansPrior.fit(theta + rng.standard_normal(theta.size))
    near = np.abs(prior.grid - 3.0) < 0.6
    assert prior.weights[near].sum() == pytest.approx(0.3, abs=0.03)
    assert prior.weights[np.abs(prior.grid) < 0.6].sum() == pytest.approx(0.7, abs=0.03)
    # Tweedie: E[theta | z] = z + d/dz log f(z), f the prior's marginal density; checked by a finite difference
    z = np.linspace(-2.0, 5.0, 29)

    def log_marginal(v):
        return np.log(np.exp(-0.5 * (v[:, None] - prior.grid) ** 2) @ prior.weights)

    h = 1e-5
    tweedie = z + (log_marginal(z + h) - log_marginal(z - h)) / (2 * h)
    np.testing.assert_allclose(prior.posterior_means(z), tweedie, atol=1e-6)


def _passes(before, after, top=None, n_bootstrap=50, seed=0):
    return metric_passes(before, after, n_bootstrap, seed, top=top, given=True)


@pytest.mark.parametrize("selected", [True, False])
def test_the_estimate_and_its_replicates_are_the_stated_arithmetic(rng, selected):
    n_query, n_train = 40, 120
    mu = np.where(np.arange(n_train) < 15, 0.5, 0.0) * rng.choice([-1, 1], n_train)
    before = mu + rng.standard_normal((n_query, n_train))
    after = 0.4 * mu + 0.8 * (before - mu) + 0.6 * rng.standard_normal((n_query, n_train))
    after[3, 2] = np.nan  # an excluded pair
    top = None if selected else np.arange(15)
    clean, perturbed = _passes(before, after, top)
    basis = clean.retention_basis(selected)
    points, draws = replicated(perturbed, spearman=False, selected=selected)
    t = clean.top
    # the basis: signs and standard errors of the clean aggregates; the prior on all columns (or the set's)
    m_b = before.mean(0)
    se = before.std(0, ddof=1) / np.sqrt(n_query)
    fitted_on = np.arange(n_train) if selected else t
    prior = NormalMeansPrior.fit(m_b[fitted_on] / se[fitted_on])
    np.testing.assert_allclose(basis.corrected, se[t] * prior.posterior_means(m_b[t] / se[t]), rtol=1e-10)
    s = np.sign(m_b[t])
    assert basis.denominator == pytest.approx(np.sum(s * basis.corrected), rel=1e-12)
    # the slopes over the pairs finite on both sides, the estimate
    slope = np.empty(t.size)
    for i, j in enumerate(t):
        both = np.isfinite(before[:, j]) & np.isfinite(after[:, j])
        slope[i] = np.cov(after[both, j], before[both, j])[0, 1] / np.var(before[both, j], ddof=1)
    m_a = np.nanmean(after, axis=0)
    expected = np.sum(s * (m_a[t] - slope * (m_b[t] - basis.corrected))) / basis.denominator
    assert points["signed_retention"] == pytest.approx(expected, rel=1e-10)
    # each replicate: the estimate moved by the residual part's change on that resample
    for i, r in enumerate(M.resample_rows(n_query, 50, 0)):
        w = np.bincount(r, minlength=n_query).astype(float)
        agg_b, agg_a = M.aggregate_scores(before, w)[t], M.aggregate_scores(after, w)[t]
        residual = np.sum(s * (agg_a - slope * agg_b)) / basis.denominator
        full = np.sum(s * (m_a[t] - slope * m_b[t])) / basis.denominator
        assert draws["signed_retention"][i] == pytest.approx(expected + residual - full, rel=1e-9, abs=1e-12)
    # the empirical-Bayes loadings
    w = np.maximum(s * basis.corrected, 0.0)
    loadings = np.sqrt(basis.eb_variance * w / w.sum()) * (slope - expected)
    np.testing.assert_allclose(draws[EB_LOADINGS], loadings, rtol=1e-9, atol=1e-15)


def test_a_control_and_an_excess_combine_as_stated(rng):
    """The control's interval: variance of the draws' mean replicates + between-draw variance / draws + the mean
    loadings' squares; the excess's: paired differences of the replicates and of the loadings."""
    n_query, n_train = 50, 100
    mu = np.where(np.arange(n_train) < 10, 0.6, 0.0)
    before = mu + rng.standard_normal((n_query, n_train))
    clean, _ = _passes(before, before)
    draws, parts = [], []
    for _ in range(3):
        perturbed = PerturbedScores(clean)
        perturbed.add(0.25 * mu + 0.7 * (before - mu) + 0.7 * rng.standard_normal((n_query, n_train)))
        draws.append(pass_metrics(perturbed, keep_draws=True))
        parts.append(replicated(perturbed, spearman=False))
    control = M.combine_controls(draws)
    name = "signed_retention"
    values = np.array([p[0][name] for p in parts])
    mean_reps = np.mean([p[1][name] for p in parts], axis=0)
    mean_loadings = np.mean([p[1][EB_LOADINGS] for p in parts], axis=0)
    variance = np.var(mean_reps, ddof=1) + np.var(values, ddof=1) / 3 + np.sum(mean_loadings**2)
    half = 1.959963984540054 * np.sqrt(variance)
    assert control.signed_retention.value == pytest.approx(values.mean(), rel=1e-12)
    np.testing.assert_allclose(control.signed_retention.interval, (values.mean() - half, values.mean() + half),
                               rtol=1e-9)
    attack = PerturbedScores(clean)
    attack.add(-0.2 * mu + 0.7 * (before - mu) + 0.7 * rng.standard_normal((n_query, n_train)))
    point, reps = replicated(attack, spearman=False)
    result = pass_metrics(attack, control=control)
    excess = point[name] - values.mean()
    variance = (np.var(reps[name] - mean_reps, ddof=1) + np.var(values, ddof=1) / 3
                + np.sum((reps[EB_LOADINGS] - mean_loadings) ** 2))
    half = 1.959963984540054 * np.sqrt(variance)
    assert result.excess_retention.value == pytest.approx(excess, rel=1e-12)
    np.testing.assert_allclose(result.excess_retention.interval, (excess - half, excess + half), rtol=1e-9)


def test_the_selection_corrected_denominator_undoes_the_winners_curse(rng):
    """100 influential examples among 1,000, the set the 100 largest clean aggregates (background examples at 0 enter
    it by noise): over six draws the plug-in clean influence is inflated, the corrected one is near the truth; the
    parametric bootstrap's relative error is small and reproducible."""
    n_query, n_train, k = 100, 1000, 100
    plug_in, corrected = [], []
    for _ in range(6):
        mu = np.zeros(n_train)
        mu[:k] = rng.uniform(1.6, 3.0, k) * rng.choice([-1, 1], k) / np.sqrt(n_query)
        before = mu + rng.standard_normal((n_query, n_train))
        top = M.top_indices(before.mean(0), k)
        basis = RetentionBasis.of(np.full(n_train, float(n_query)), before.sum(0), (before**2).sum(0), top, "abs",
                                  True, seed=0)
        truth = np.sum(basis.signs * mu[top])
        plug_in.append(np.sum(np.abs(before.mean(0)[top])) / truth)
        corrected.append(basis.denominator / truth)
        assert 0 < basis.eb_variance < 0.05
    assert np.mean(plug_in) > 1.6
    assert np.mean(corrected) == pytest.approx(1.0, abs=0.1)
    se = before.std(0, ddof=1) / np.sqrt(n_query)
    prior = NormalMeansPrior.fit(before.mean(0) / se)
    variance = relative_error_variance(prior, se, k, "abs", 0)
    assert relative_error_variance(prior, se, k, "abs", 0) == variance  # the same seeded worlds: the same bits
    # the basis's own, with its standard errors from the sums instead of the rows: equal to rounding
    assert variance == pytest.approx(basis.eb_variance, rel=1e-9)


def test_the_em_loops_run_on_one_thread_and_restore_the_settings():
    """The deconvolutions' small products run single-threaded; torch's and the BLAS's settings come back, also when
    the loop fails."""
    import torch
    from threadpoolctl import threadpool_info

    from art_malleability._utils.torch_utils import single_thread

    threads = torch.get_num_threads()
    blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    seen = []
    with pytest.raises(RuntimeError, match="inside"), single_thread():
        seen.append(torch.get_num_threads())
        seen.extend(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")
        raise RuntimeError("inside")
    assert set(seen) == {1}
    assert torch.get_num_threads() == threads
    assert [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"] == blas


def test_a_retention_that_is_not_a_share_is_refused(rng):
    """A denominator not decidedly positive (Fieller: the ratio's confidence set is then unbounded) or a clean
    influence under a tenth of the perturbed one (a new user's audit without test points printed 56,463
    [26,519, 86,407]) gives no retention, rather than a decided-looking interval."""
    from art_malleability.metrics._retention import MAX_RETENTION

    n_query, n_train = 60, 200
    mu = np.where(np.arange(n_train) < 20, 0.8, 0.0)
    before = mu + rng.standard_normal((n_query, n_train))
    clean, _ = _passes(before, before)
    basis = clean.retention_basis(True)
    assert basis.identified(0.95) and basis.eb_variance > 0
    # the denominator's relative standard error just over 1 / z at 95 % (z = 1.96) and under it at 90 % (1.645)
    weak = dataclasses.replace(basis, eb_variance=1.01 / 1.959963984540054**2)
    assert not weak.identified(0.95) and weak.identified(0.90)
    assert not dataclasses.replace(basis, denominator=-basis.denominator).identified(0.5)
    kept = PerturbedScores(clean)
    kept.add(0.5 * mu + 0.7 * (before - mu) + 0.7 * rng.standard_normal((n_query, n_train)))
    points, draws = replicated(kept, spearman=False)
    assert 0.2 < points["signed_retention"] < 0.8 and np.isfinite(draws["signed_retention"]).all()
    # the same set and clean scores, the perturbed influence thirty times the clean one: not a share kept
    blown = PerturbedScores(clean)
    blown.add(30 * mu + 0.7 * (before - mu) + 0.7 * rng.standard_normal((n_query, n_train)))
    points, draws = replicated(blown, spearman=False)
    assert np.isnan(points["signed_retention"]) and np.isnan(draws["signed_retention"]).all()
    metrics = pass_metrics(blown)
    assert np.isnan(metrics.signed_retention.value) and np.isnan(metrics.signed_retention.interval).all()
    # just inside the bound: reported
    inside = PerturbedScores(clean)
    inside.add(0.9 * MAX_RETENTION * mu + 0.7 * (before - mu) + 0.7 * rng.standard_normal((n_query, n_train)))
    assert np.isfinite(replicated(inside, spearman=False)[0]["signed_retention"])


def test_an_audit_whose_queries_are_its_fitted_training_set_reports_no_retention():
    from helpers import trained_classifier

    from art_malleability import MalleabilityEstimator
    from art_malleability.data import load_dataset

    data = load_dataset("digits", n_train=300, n_test=60, seed=0)
    report = MalleabilityEstimator(trained_classifier(epochs=200), verbose=False, attacks=["fgsm"], controls=False,
                                   n_bootstrap=50).evaluate(data.x_train, data.y_train)
    result = report.results[0]
    assert result.signed_retention is None and result.signed_retention_ci == [None, None]
    reasons = report.to_dict()["null_reasons"]
    assert reasons["results[0].signed_retention"].startswith("not a share of influence kept here")
    with_test = MalleabilityEstimator(trained_classifier(epochs=200), verbose=False, attacks=["fgsm"],
                                      controls=False, n_bootstrap=50).evaluate(data.x_train, data.y_train,
                                                                               data.x_test, data.y_test)
    assert with_test.results[0].signed_retention is not None
