"""The deconvolution behind the noise-aware flip rate, piece by piece against direct computations."""

import warnings

import numpy as np
import pytest
from scipy.stats import multivariate_normal

from art_malleability.metrics import _flip_posterior as F


def test_paired_moments_equal_explicit_means_and_covariances_of_resampled_rows(rng):
    before, after = rng.normal(size=(12, 9)), rng.normal(size=(12, 9))
    before[3, 2] = after[3, 2] = np.nan  # an excluded pair
    top = np.array([2, 5, 7])
    rows = rng.integers(0, 12, (4, 12))
    weights = np.zeros((4, 12))
    for i, r in enumerate(rows):
        np.add.at(weights[i], r, 1.0)
    means, cov = F.paired_moments(before, after, top, weights)
    for i, r in enumerate(rows):
        for j, col in enumerate(top):
            pairs = np.stack([before[r, col], after[r, col]], axis=1)
            pairs = pairs[np.isfinite(pairs).all(axis=1)]
            np.testing.assert_allclose(means[i, j], pairs.mean(axis=0), rtol=1e-12)
            np.testing.assert_allclose(cov[i, j], np.cov(pairs.T, ddof=1) / len(pairs), rtol=1e-10)


def test_bivariate_normal_cdf_equals_scipy(rng):
    for _ in range(100):
        h, k = rng.normal(0, 2, 2)
        if rng.random() < 0.2:
            h = 0.0
        r = rng.uniform(-0.99, 0.99)
        expected = multivariate_normal([0, 0], [[1, r], [r, 1]]).cdf([h, k])
        assert F.bivariate_normal_cdf(h, k, r) == pytest.approx(expected, abs=1e-7)
    assert F.bivariate_normal_cdf(0.0, 0.0, 0.5) == pytest.approx(1 / 3)


@pytest.mark.parametrize("selection", [None, "abs", "signed"])
def test_the_measured_flip_probability_equals_monte_carlo(rng, selection):
    """P(measured signs opposite | population atom, selected), against 400,000 simulated pairs per atom."""
    u, v = np.array([1.5, 0.3, -0.8]), np.array([0.4, -0.2, 0.9])
    sbb, saa, sab = np.array([1.0]), np.array([1.7]), np.array([0.8])
    t = None if selection is None else np.array([0.9])
    exact = F._measured_flip_probability(u, v, sbb, saa, sab, t, selection or "abs")[0]
    cov = [[sbb[0], sab[0]], [sab[0], saa[0]]]
    for i in range(3):
        x = rng.multivariate_normal([u[i], v[i]], cov, size=400_000)
        keep = np.ones(len(x), bool)
        if selection == "abs":
            keep = np.abs(x[:, 0]) >= t[0]
        elif selection == "signed":
            keep = x[:, 0] >= t[0]
        flipped = x[keep, 0] * x[keep, 1] < 0
        assert exact[i] == pytest.approx(flipped.mean(), abs=4e-3)


@pytest.mark.parametrize("heavy", [False, True])
def test_the_likelihood_is_the_bivariate_t_density_over_the_selection_probability(rng, heavy):
    # standardised aggregates are bivariate Student-t with the degrees of freedom the scores' kurtosis gives (n - 1 for
    # normal scores): the density from scipy, over the selection probability of its clean marginal
    from scipy.stats import multivariate_t
    from scipy.stats import t as student

    draw = (lambda size: rng.standard_t(3, size=size)) if heavy else (lambda size: rng.normal(size=size))
    before, after = draw((30, 40)), draw((30, 40))
    before[:, :5] += 3.0
    top = np.arange(5)
    threshold = 0.4
    posterior = F.FlipPosterior.from_scores(before, after, top, threshold)
    nu = posterior.dof
    assert (nu < 20) if heavy else (nu == 29)
    means, cov = F.paired_moments(before, after, top)
    j, atom = 2, 100
    scale = np.sqrt(cov[0, j, 0, 0])
    x = means[0, j] / scale
    standardised = cov[0, j] / scale**2
    density = multivariate_t([posterior.u[atom], posterior.v[atom]], standardised, df=nu).logpdf(x)
    t = threshold / scale
    sd = np.sqrt(standardised[0, 0])
    u = posterior.u[atom]
    selected = student.sf((t - u) / sd, nu) + student.cdf((-t - u) / sd, nu)
    assert posterior.loglik[j, atom] == pytest.approx(density - np.log(selected), rel=1e-10)


def test_the_noise_degrees_of_freedom_follow_the_scores_kurtosis(rng):
    # nu = 2 (n - 1) / (kappa - 1), kappa the set's mean sample kurtosis (the larger side's), at most n - 1
    from scipy.stats import kurtosis

    n = 60
    before, after = rng.standard_t(3, size=(n, 8)), rng.normal(size=(n, 8))
    after[:, 3] = np.nan  # a pair excluded on one side drops out of both sides' sums
    sums = F.PairedSums.of(before, after, np.arange(8))
    kept = np.isfinite(after).all(0)
    kappa = max(kurtosis(before[:, kept], fisher=False).mean(), kurtosis(after[:, kept], fisher=False).mean())
    assert sums.noise_dof() == pytest.approx(min(n - 1, 2 * (n - 1) / (kappa - 1)), rel=1e-9)
    assert F.PairedSums.of(after[:, :3], after[:, :3], np.arange(3)).noise_dof() == n - 1  # normal: Student's own
    assert F.PairedSums.of(before[:3], after[:3], np.arange(8)).noise_dof() == np.inf  # fewer than four queries


def test_em_finds_the_mixing_weights_and_never_lowers_the_likelihood(rng):
    """Two populations of standardised means, (3, 3) and (3, -3): the NPMLE puts 70 / 30 % of its mass near them."""
    n_query, n_train = 400, 200
    mu_b = np.full(n_train, 3.0)
    mu_a = np.where(np.arange(n_train) < 140, 3.0, -3.0)
    noise = rng.normal(size=(n_query, n_train)) * np.sqrt(n_query)
    before, after = mu_b + noise, mu_a + 0.5 * noise + np.sqrt(0.75) * rng.normal(size=noise.shape) * np.sqrt(n_query)
    posterior = F.FlipPosterior.from_scores(before, after, np.arange(n_train), None)
    weights = posterior.weights
    near_keep = (np.abs(posterior.u - 3) < 1.2) & (np.abs(posterior.v - 3) < 1.2)
    near_flip = (np.abs(posterior.u - 3) < 1.2) & (np.abs(posterior.v + 3) < 1.2)
    assert weights[near_keep].sum() == pytest.approx(0.7, abs=0.05)
    assert weights[near_flip].sum() == pytest.approx(0.3, abs=0.05)
    assert posterior.estimate() == pytest.approx(0.3, abs=0.02)
    start = np.full(posterior.u.size, 1.0 / posterior.u.size)
    fits = [F._em(posterior.loglik, start, steps) for steps in (1, 5, 25, 100)]
    likelihoods = [F._total_loglik(posterior.loglik, weights) for weights in fits]
    assert all(b >= a - 1e-9 for a, b in zip(likelihoods, likelihoods[1:], strict=False))


def test_the_projection_noise_model_follows_the_spread_between_seeds(rng):
    """
    Three seeds, sd = 0.2 + 0.5 |x|: the model is applied at measured aggregates, so it must predict the spread of the
    examples whose measured size is ``m`` (not of those whose true size is ``m``): within 20 % over the usual range.
    """
    size = np.abs(rng.normal(size=20000)) * 3
    seeds = size + (0.2 + 0.5 * size) * rng.normal(size=(3, 20000))
    alpha, beta = F.projection_noise(seeds)
    measured, spread = np.abs(seeds.mean(axis=0)), seeds.std(axis=0, ddof=1) / 0.886227  # c4 of three values
    for low, high in ((0.3, 0.7), (0.8, 1.2), (1.8, 2.2), (3.5, 4.5)):
        inside = (measured >= low) & (measured < high)
        assert alpha + beta * measured[inside].mean() == pytest.approx(spread[inside].mean(), rel=0.2)
    assert F.projection_noise(seeds[:1]) is None


def test_projection_noise_enters_the_covariance_of_the_likelihood(rng):
    from scipy.stats import multivariate_t

    before, after = rng.normal(size=(30, 40)), rng.normal(size=(30, 40))
    before[:, :5] += 3.0
    top = np.arange(5)
    posterior = F.FlipPosterior.from_scores(before, after, top, None, noise=(0.3, 0.2))
    means, cov = F.paired_moments(before, after, top)
    j, atom = 1, 200
    extra = (0.3 + 0.2 * np.abs(means[0, j])) ** 2
    total = cov[0, j] + np.diag(extra)
    scale = np.sqrt(total[0, 0])
    density = multivariate_t([posterior.u[atom], posterior.v[atom]], total / scale**2,
                             df=posterior.dof).logpdf(means[0, j] / scale)
    assert posterior.loglik[j, atom] == pytest.approx(density, rel=1e-10)


def test_the_bivariate_cdf_next_to_an_axis_is_exact_and_silent():
    """Arguments a hair from zero (of either sign) send Owen's T to its infinite-slope limit: no overflow warning,
    scipy's value."""
    import warnings

    from scipy.stats import multivariate_normal

    from art_malleability.metrics._flip_posterior import bivariate_normal_cdf

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for h, k, r in [(1e-310, 0.5, 0.3), (0.7, 1e-305, -0.4), (2.0, 3e-320, 0.9), (-1.2, -1e-308, 0.2),
                        (1e-200, -1e-200, 0.4), (-1e-310, 1e-310, -0.3), (0.0, -1e-310, 0.5), (-0.8, 0.0, -0.6)]:
            expected = multivariate_normal([0.0, 0.0], [[1.0, r], [r, 1.0]]).cdf([h, k])
            assert float(bivariate_normal_cdf(h, k, r)) == pytest.approx(expected, abs=1e-9)


def test_members_measured_without_query_noise_count_for_certain(rng):
    """A member whose scores do not vary over the queries flips or keeps its sign for certain; one whose perturbed
    scores alone do not vary leaves the expectation by noise finite (no warning)."""
    from art_malleability import metrics as M

    before = rng.standard_normal((40, 30)) + 3.0
    after = before + 0.3 * rng.standard_normal((40, 30))
    before[:, 0], after[:, 0] = 5.0, -4.0  # flips, exactly measured
    before[:, 1], after[:, 1] = 2.0, 2.5  # keeps its sign, exactly measured
    after[:, 2] = 1.0  # perturbed scores without spread
    top = np.arange(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a division by a zero spread would warn
        result = M.noise_aware_flip_rate(before, after, top=top, selected=False)
    probabilities = result["flip_probabilities"]
    assert probabilities[0] == 1.0 and probabilities[1] == 0.0
    assert np.all(np.isfinite(probabilities)) and result["estimate"] == pytest.approx(1 / 6, abs=1e-6)
    assert result["ci"][0] >= 1 / 6 - 1e-9  # a certain flip keeps the interval off zero
    assert np.isfinite(result["null_raw_flip_rate"]) and result["null_raw_flip_rate"] < 0.05


def _reference_constrained_fit(loglik, flip_atoms, share, steps):
    """The constrained NPMLE by plain EM from the uniform prior within each block (the log-likelihood is concave in the
    weights, so a long run reaches the maximum)."""
    lik = np.exp(loglik - loglik.max(axis=1, keepdims=True))
    w = np.where(flip_atoms, share / max(flip_atoms.sum(), 1), (1 - share) / max((~flip_atoms).sum(), 1))
    for _ in range(steps):
        r = w * (lik.T @ (1.0 / np.maximum(lik @ w, 1e-300)))
        r_flip, r_keep = r[flip_atoms].sum(), r[~flip_atoms].sum()
        w = np.where(flip_atoms, share * r / max(r_flip, 1e-300), (1 - share) * r / max(r_keep, 1e-300))
    return w, F._total_loglik(loglik, w)


@pytest.fixture
def half_flipped(rng):
    """40 members, 12 of which change sign, at 1-3 standard errors of 60 queries, selected by their clean aggregates."""
    from art_malleability import metrics as M

    n_query, n_train = 60, 400
    mu_b = np.zeros(n_train)
    mu_b[:40] = rng.uniform(1.0, 3.0, 40) * rng.choice([-1, 1], 40) / np.sqrt(n_query)
    mu_a = 0.8 * mu_b
    mu_a[:12] *= -1
    noise = rng.standard_normal((n_query, n_train))
    before, after = mu_b + noise, mu_a + 0.7 * noise + np.sqrt(0.51) * rng.standard_normal((n_query, n_train))
    top = M.top_indices(M.aggregate_scores(before), 40)
    return F.FlipPosterior.from_scores(before, after, top, M.selection_threshold(before, top))


def test_the_profile_is_the_constrained_maximum_likelihood(half_flipped):
    """Every constrained fit holds its flip mass and reaches the likelihood of a long plain EM run."""
    posterior = half_flipped
    shares, weights, total = posterior.profile()
    np.testing.assert_allclose(weights[:, posterior.flip_atoms].sum(1), shares, atol=1e-12)
    for i in (0, 5, 12, 25, 50):
        _, reference = _reference_constrained_fit(posterior.loglik, posterior.flip_atoms, shares[i], 4000)
        assert total[i] >= reference - 0.02, (shares[i], total[i], reference)
    # the unconstrained fit lies on the profile: its maximum is the fit's likelihood
    assert total.max() == pytest.approx(F._total_loglik(posterior.loglik, posterior.weights), abs=0.05)
    assert posterior.no_flip_statistic() == pytest.approx(2 * (max(total.max(), F._total_loglik(
        posterior.loglik, posterior.weights)) - total[0]), abs=1e-9)


def test_the_interval_is_the_inverted_likelihood_ratio_test(half_flipped):
    """Brute force: the deviance of long plain EM runs on a fine grid of flip masses, the accepted masses' posterior
    flip shares; the interval's ends are theirs (within the fine grid's step), and it widens with the confidence."""
    posterior = half_flipped
    fine = np.linspace(0.0, 1.0, 201)
    fits = [_reference_constrained_fit(posterior.loglik, posterior.flip_atoms, s, 1500) for s in fine]
    totals = np.array([total for _, total in fits])
    deviance = 2 * (max(totals.max(), F._total_loglik(posterior.loglik, posterior.weights)) - totals)
    shares = np.array([F._posterior_flips(posterior.loglik, w, posterior.flip_atoms).mean() for w, _ in fits])
    accepted = shares[deviance <= 3.841]
    p = posterior.flip_probabilities()
    spread = 1.959963984540054 * np.sqrt(np.sum(p * (1 - p))) / p.size  # the members' classification at the fit
    low, high = posterior.interval(0.95)
    assert low == pytest.approx(min(accepted.min(), p.mean() - spread), abs=0.015)
    assert high == pytest.approx(max(accepted.max(), p.mean() + spread), abs=0.015)
    assert low <= posterior.estimate() <= high and 0.0 < low
    wide, narrow = posterior.interval(0.99), posterior.interval(0.8)
    assert wide[0] <= low <= narrow[0] <= narrow[1] <= high <= wide[1]


def test_posteriors_a_hair_past_one_keep_the_interval_finite(half_flipped, monkeypatch):
    """Rounding can leave a certain member's flip probability at 1 + 1e-16; its classification spread is then 0."""
    posterior = half_flipped
    probabilities = np.where(posterior.flip_probabilities() > 0.5, 1.0 + 2e-16, 0.0)  # every member certain
    monkeypatch.setattr(posterior, "flip_probabilities", lambda: probabilities)
    low, high = posterior.interval(0.95)
    assert np.isfinite(low) and np.isfinite(high) and low <= high
