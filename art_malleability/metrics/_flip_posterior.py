"""
The noise-aware flip rate: how many members of the influential set have a *population* aggregate (the mean over
infinitely many queries) that changes sign, estimated by empirical-Bayes deconvolution of their paired clean and
perturbed aggregates.

Model. For a member ``j`` of the set, the clean and perturbed aggregates over the ``n`` queries,
``x_j = (m_b, m_a)``, are bivariate normal around the population aggregates ``θ_j = (μ_b, μ_a)`` with the covariance
``Σ_j`` of the two means: both come from the same queries and weights, so the covariance is estimated from the
paired per-query scores (variances and their covariance over ``n``), plus, for a projected estimator, the
projection's own variance (:func:`projection_noise`). Every quantity is standardised by the clean standard
error ``se_b,j``, so one prior ``G`` on standardised means serves examples of any scale. ``G`` is the distribution
of ``θ`` *among the members of the set*: the set was chosen by the clean aggregates (the ``k`` largest
``|m_b|``), so the likelihood of ``x_j`` is truncated to the selection event, ``f(x | θ) / P(|X_b| ≥ c | θ)``, which
undoes the winner's curse of the selection. ``G`` is estimated by nonparametric maximum likelihood on a fixed
grid of atoms (EM, Kiefer-Wolfowitz); the posterior probability that member ``j`` flips is the posterior mass of
the atoms with ``μ_b · μ_a < 0``.

Estimand: the share of the set whose population aggregates have strictly opposite signs. Estimate: the mean of
the posterior flip probabilities. Interval: a bootstrap over queries refits ``G`` and draws flip indicators from
the posteriors of every refit (estimation and classification uncertainty together), percentile; a likelihood-ratio
test of "no member flips" (``G`` restricted to sign-keeping atoms, compared with ``χ²₁``) puts 0 into the interval
whenever it does not reject. Null expectation of the raw flip rate: under the fitted no-flip ``G``, the expected
share of the set whose *measured* aggregates change sign, that is what the raw flip rate would be by query noise
alone. Assumptions, and where they fail, are in docs/metrics.md; coverage and bias are measured by the simulations
in the test suite.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import ndtr, owens_t
from scipy.stats import chi2, norm

#: Atoms per axis of the prior's grid (odd: one atom sits at 0, a population aggregate of about 0, which is not a flip).
GRID_SIZE = 25
#: EM steps of the fit on all queries, and of a bootstrap refit started from it.
FIT_STEPS, REFIT_STEPS = 300, 60
#: Flip indicators drawn from the posteriors of every bootstrap refit.
POSTERIOR_DRAWS = 20


class PairedSums:
    """
    Weighted sums over the queries of an influential set's paired clean and perturbed scores, from which its paired
    aggregates and their covariances follow (:meth:`moments`); each of ``count``, ``b``, ``a``, ``bb``, ``aa``, ``ab``
    is ``(R, k)``: one row per weighting of the queries (the audit's: all queries once, then the bootstrap resamples),
    over the pairs finite on both sides. Accumulated block by block over the queries, in ``O(R · n_query · k)``.
    """

    NAMES = ("count", "b", "a", "bb", "aa", "ab")

    def __init__(self, sums: dict[str, np.ndarray]) -> None:
        for name in self.NAMES:
            setattr(self, name, np.asarray(sums[name], dtype=np.float64))

    @classmethod
    def of(
        cls, before: np.ndarray, after: np.ndarray, top: np.ndarray, weights: np.ndarray | None = None
    ) -> PairedSums:
        """
        :param before: Clean influence matrix ``(n_query, n_train)`` (``NaN``: excluded pair).
        :param after: Perturbed influence matrix, same shape.
        :param top: The set (training indices).
        :param weights: ``(R, n_query)`` query multiplicities (default: all queries once).
        """
        b, a = before[:, top], after[:, top]
        pair = np.isfinite(b) & np.isfinite(a)
        b, a = np.where(pair, b, 0.0), np.where(pair, a, 0.0)
        w = np.ones((1, b.shape[0])) if weights is None else np.atleast_2d(np.asarray(weights, dtype=np.float64))
        return cls({"count": w @ pair, "b": w @ b, "a": w @ a, "bb": w @ (b * b), "aa": w @ (a * a),
                    "ab": w @ (a * b)})

    def rows(self, index: slice | np.ndarray) -> PairedSums:
        """:return: The sums of some weightings only."""
        return PairedSums({name: getattr(self, name)[index] for name in self.NAMES})

    def __len__(self) -> int:
        return len(self.count)

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """
        :return: ``means`` ``(R, k, 2)`` (clean, perturbed) and ``cov`` ``(R, k, 2, 2)``, the covariance of the two
            means (sample covariance of the per-query pairs over their count); ``NaN`` means with fewer than two pairs.
        """
        count = self.count
        safe = np.maximum(count, 1.0)
        mb, ma = self.b / safe, self.a / safe
        dof = np.maximum(count - 1.0, 1.0)
        vbb = (self.bb - count * mb * mb) / dof
        vaa = (self.aa - count * ma * ma) / dof
        vab = (self.ab - count * ma * mb) / dof
        means = np.stack([mb, ma], axis=-1)
        cov = np.stack([np.stack([vbb, vab], -1), np.stack([vab, vaa], -1)], -2) / safe[..., None, None]
        means[count < 2] = np.nan
        return means, cov


def paired_moments(
    before: np.ndarray, after: np.ndarray, top: np.ndarray, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """
    The paired aggregates of the set and their covariance, for all queries or for resamples of them
    (:class:`PairedSums`).

    :param before: Clean influence matrix ``(n_query, n_train)`` (``NaN``: excluded pair).
    :param after: Perturbed influence matrix, same shape.
    :param top: The set (training indices).
    :param weights: ``(B, n_query)`` query multiplicities of ``B`` resamples (default: all queries once).
    :return: ``means`` ``(B, k, 2)`` (clean, perturbed) and ``cov`` ``(B, k, 2, 2)``, the covariance of the two means
        (sample covariance of the per-query pairs over their count).
    """
    return PairedSums.of(before, after, top, weights).moments()


def projection_noise(aggregates: np.ndarray) -> tuple[float, float] | None:
    """
    The projection's noise in one aggregate score as a function of its size, ``sd(x) = α + β |x|``, from the clean
    aggregates of several projection seeds (the spread grows with the score: one global number understates it on
    the influential set, where flips are counted). Fitted by least squares of each example's sample standard
    deviation over seeds (made unbiased, ``c4``) on its measured mean ``|x|`` (both coefficients kept non-negative):
    the model is applied at measured aggregates, so it predicts the spread of examples of a given *measured* size.

    :param aggregates: ``(n_seeds, n_train)`` clean aggregate scores, one row per projection seed.
    :return: ``(α, β)``; ``None`` with fewer than two seeds.
    """
    aggregates = np.asarray(aggregates, dtype=np.float64)
    if aggregates.ndim != 2 or aggregates.shape[0] < 2:
        return None
    keep = np.all(np.isfinite(aggregates), axis=0)
    if not keep.any():
        return None
    n = aggregates.shape[0]
    c4 = math.sqrt(2.0 / (n - 1)) * math.exp(math.lgamma(n / 2.0) - math.lgamma((n - 1) / 2.0))
    sd = aggregates[:, keep].std(axis=0, ddof=1) / c4  # unbiased for a normal spread
    size = np.abs(aggregates[:, keep].mean(axis=0))
    design = np.stack([np.ones_like(size), size], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, sd, rcond=None)
    if beta < 0:
        alpha, beta = float(sd.mean()), 0.0
    elif alpha < 0:
        alpha, beta = 0.0, float(sd @ size / max(size @ size, 1e-300))
    return float(alpha), float(beta)


def _with_projection(means: np.ndarray, cov: np.ndarray, noise: tuple[float, float] | None) -> np.ndarray:
    """``cov`` plus the projection's variance of each aggregate (independent between the clean and perturbed fit)."""
    if noise is None:
        return cov
    alpha, beta = noise
    extra = (alpha + beta * np.abs(means)) ** 2
    cov = cov.copy()
    cov[..., 0, 0] += extra[..., 0]
    cov[..., 1, 1] += extra[..., 1]
    return cov


def _grid(x: np.ndarray) -> np.ndarray:
    """Atoms of one axis: sinh-spaced (fine near 0, where signs are decided), reaching past the data."""
    reach = float(np.nanquantile(np.abs(x), 0.99)) + 4.0 if np.isfinite(x).any() else 8.0
    return np.sinh(np.linspace(-math.asinh(reach), math.asinh(reach), GRID_SIZE))


class FlipPosterior:
    """
    The deconvolution of one influential set's paired aggregates (see the module's docstring).

    :param sums: The set's :class:`PairedSums`: row 0 over all queries once, the other rows (if any) over the bootstrap
        resamples of the queries that :meth:`interval` refits on (:meth:`from_scores` builds them from matrices).
    :param threshold: The selection threshold in score units (the smallest ``|aggregate|`` in the set for
        ``rank_by="abs"``, the smallest aggregate for ``"signed"``); ``None``: the set was given, not selected by these
        scores, and no truncation applies.
    :param rank_by: ``"abs"`` or ``"signed"``: how the set was selected.
    :param noise: The projection's noise model ``(α, β)`` of :func:`projection_noise`, or ``None``.
    """

    def __init__(
        self,
        sums: PairedSums,
        threshold: float | None,
        rank_by: str = "abs",
        noise: tuple[float, float] | None = None,
    ) -> None:
        self.threshold, self.rank_by, self.noise = threshold, rank_by, noise
        self.resampled = sums.rows(slice(1, None))
        means, cov = sums.rows(slice(0, 1)).moments()
        self.means, self.cov = means, cov
        finite = np.isfinite(means[0]).all(axis=1)
        self.keep = finite & (cov[0, :, 0, 0] > 0)
        # members whose scores do not vary over the queries (clean and perturbed) are measured exactly: their
        # population aggregates are the measured ones, and they flip or not for certain
        exact = finite & (cov[0, :, 0, 0] == 0) & (cov[0, :, 1, 1] == 0)
        self.exact_flips = np.where(exact, means[0, :, 0] * means[0, :, 1] < 0, np.nan)
        scale = np.sqrt(cov[0, :, 0, 0])
        axis = _grid(np.where(self.keep[:, None], means[0] / np.where(scale > 0, scale, 1.0)[:, None], np.nan))
        u, v = np.meshgrid(axis, axis, indexing="ij")
        self.axis, self.u, self.v = axis, u.ravel(), v.ravel()
        self.flip_atoms = self.u * self.v < 0
        self.loglik = self._loglik(means, cov)[0]
        self.weights = _em(self.loglik, np.full(self.u.size, 1.0 / self.u.size), FIT_STEPS)
        self._no_flip: np.ndarray | None = None

    @classmethod
    def from_scores(
        cls,
        before: np.ndarray,
        after: np.ndarray,
        top: np.ndarray,
        threshold: float | None,
        rank_by: str = "abs",
        noise: tuple[float, float] | None = None,
        rows: np.ndarray | None = None,
    ) -> FlipPosterior:
        """
        The deconvolution of whole influence matrices.

        :param before: Clean influence matrix ``(n_query, n_train)``.
        :param after: Perturbed influence matrix, same shape.
        :param top: The set (training indices), chosen from the clean aggregates.
        :param threshold: See the class.
        :param rank_by: See the class.
        :param noise: See the class.
        :param rows: ``(B, n_query)`` bootstrap resamples of the query rows for :meth:`interval` (default: none).
        """
        n_query = np.asarray(before).shape[0]
        weights = np.ones((1, n_query))
        if rows is not None and len(rows):
            counts = np.zeros((len(rows), n_query))
            np.add.at(counts, (np.arange(len(rows))[:, None], np.atleast_2d(rows)), 1.0)
            weights = np.concatenate([weights, counts])
        return cls(PairedSums.of(before, after, np.asarray(top, dtype=np.int64), weights), threshold, rank_by, noise)

    @property
    def no_flip_weights(self) -> np.ndarray:
        """The prior fitted on sign-keeping atoms only (the hypothesis that no member flips)."""
        if self._no_flip is None:
            start = np.where(self.flip_atoms, 0.0, 1.0)
            self._no_flip = _em(self.loglik, start / start.sum(), FIT_STEPS)
        return self._no_flip

    # ------------------------------------------------------------------ likelihood
    def _loglik(self, means: np.ndarray, cov: np.ndarray) -> np.ndarray:
        """
        ``(B, k_kept, atoms)`` log-likelihood of each member's standardised aggregates under each atom; a member
        without a usable covariance in a resample (a column constant over the resampled queries) gets a flat row.
        """
        with np.errstate(all="ignore"):
            loglik = self._raw_loglik(means, cov)
        usable = np.isfinite(loglik).all(axis=-1, keepdims=True)
        return np.where(usable, loglik, 0.0)

    def _raw_loglik(self, means: np.ndarray, cov: np.ndarray) -> np.ndarray:
        means, cov = means[:, self.keep], _with_projection(means, cov, self.noise)[:, self.keep]
        scale = np.sqrt(np.maximum(cov[..., 0, 0], 1e-300))
        x, y = means[..., 0] / scale, means[..., 1] / scale
        sbb = cov[..., 0, 0] / scale**2
        sab, saa = cov[..., 0, 1] / scale**2, cov[..., 1, 1] / scale**2
        det = np.maximum(sbb * saa - sab**2, 1e-12 * sbb * np.maximum(saa, 1e-300))
        dx = x[..., None] - self.u
        dy = y[..., None] - self.v
        quad = (saa[..., None] * dx**2 - 2 * sab[..., None] * dx * dy + sbb[..., None] * dy**2) / det[..., None]
        loglik = -0.5 * quad - 0.5 * np.log(det)[..., None] - math.log(2 * math.pi)
        if self.threshold is not None:
            t = (abs(self.threshold) if self.rank_by == "abs" else self.threshold) / scale
            sd, axis = np.sqrt(sbb)[..., None], self.axis  # the selection depends on the clean coordinate only
            selected = ndtr((axis - t[..., None]) / sd)
            if self.rank_by == "abs":
                selected = selected + ndtr((-t[..., None] - axis) / sd)
            loglik -= np.repeat(np.log(np.maximum(selected, 1e-300)), axis.size, axis=-1)
        return loglik

    # ------------------------------------------------------------------ results
    def flip_probabilities(self) -> np.ndarray:
        """:return: Each member's posterior probability of a sign change (``NaN`` for a member without scores)."""
        out = self.exact_flips.astype(np.float64)
        if self.keep.any():
            out[self.keep] = _posterior_flips(self.loglik, self.weights, self.flip_atoms)
        return out

    def estimate(self) -> float:
        """:return: The estimated share of the set whose population aggregates change sign."""
        probabilities = self.flip_probabilities()
        return float(np.nanmean(probabilities)) if np.isfinite(probabilities).any() else float("nan")

    def undecided_share(self) -> float:
        """
        :return: The share of the set whose perturbed aggregate lies within one standard error of zero: members whose
            population sign these queries can hardly decide (the regime where the estimate's bias grows, measured in
            docs/metrics.md).
        """
        means, cov = self.means[0, self.keep], _with_projection(self.means, self.cov, self.noise)[0, self.keep]
        if not len(means):
            return float("nan")
        return float(np.mean(np.abs(means[:, 1]) < np.sqrt(cov[:, 1, 1])))

    def no_flip_statistic(self) -> float:
        """:return: The likelihood-ratio statistic of "no member flips" (``G`` on sign-keeping atoms only)."""
        if not self.keep.any():
            return float("nan")
        full, restricted = (_total_loglik(self.loglik, w) for w in (self.weights, self.no_flip_weights))
        return max(0.0, 2.0 * (full - restricted))

    def null_raw_flip_rate(self) -> float:
        """
        :return: The raw flip rate expected by query noise alone: under the no-flip fit, each member's posterior
            over sign-keeping atoms, and for each atom the probability that the measured aggregates (bivariate
            normal with the member's covariance, given the selection) have opposite signs; the mean over members.
        """
        if not self.keep.any():
            return float("nan")
        posterior = _posterior(self.loglik, self.no_flip_weights)  # (k, atoms)
        cov = _with_projection(self.means, self.cov, self.noise)[0, self.keep]
        scale = np.sqrt(cov[:, 0, 0])
        sbb, saa, sab = (cov[:, 0, 0] / scale**2, cov[:, 1, 1] / scale**2, cov[:, 0, 1] / scale**2)
        t = None
        if self.threshold is not None:
            t = (abs(self.threshold) if self.rank_by == "abs" else self.threshold) / scale
        flips = _measured_flip_probability(self.u, self.v, sbb, saa, sab, t, self.rank_by)
        # exactly measured members flip by noise never
        return float(np.sum(posterior * flips) / (self.keep.sum() + np.isfinite(self.exact_flips).sum()))

    def interval(self, confidence: float, seed: int) -> tuple[float, float]:
        """
        :param confidence: Coverage, in (0, 1).
        :param seed: Seed of the posterior draws.
        :return: ``(low, high)``: percentile interval of the flip shares drawn from the posteriors of every refit on
            a resample; ``low`` is 0 when the likelihood-ratio test of no flips does not reject at ``1 - confidence``.
        """
        resampled = self.resampled
        if not self.keep.any() or len(resampled) == 0:
            return float("nan"), float("nan")
        exact = self.exact_flips[np.isfinite(self.exact_flips)]
        rng = np.random.default_rng(seed)
        shares = []
        step = max(1, int(2**22 // max(self.keep.sum() * self.u.size, 1)))
        for s in range(0, len(resampled), step):
            means, cov = resampled.rows(slice(s, s + step)).moments()
            loglik = self._loglik(means, cov)
            fitted = _em(loglik, np.broadcast_to(self.weights, (len(means), self.u.size)).copy(), REFIT_STEPS)
            probabilities = _posterior_flips(loglik, fitted, self.flip_atoms)  # (b, k)
            draws = rng.random((POSTERIOR_DRAWS, *probabilities.shape)) < probabilities
            shares.append(((draws.sum(axis=-1) + exact.sum()) / (draws.shape[-1] + exact.size)).ravel())
        tail = (1.0 - confidence) / 2.0
        low, high = (float(v) for v in np.quantile(np.concatenate(shares), [tail, 1.0 - tail]))
        if self.no_flip_statistic() < chi2.ppf(confidence, 1) and not exact.any():
            low = 0.0
        return low, high


def _em(loglik: np.ndarray, weights: np.ndarray, steps: int) -> np.ndarray:
    """
    Kiefer-Wolfowitz NPMLE of the atoms' weights by EM, for one or a batch of likelihood matrices.

    :param loglik: ``(k, atoms)`` or ``(B, k, atoms)``.
    :param weights: Starting weights ``(atoms,)`` or ``(B, atoms)`` (zeros stay zero).
    :param steps: EM steps.
    :return: The weights, summing to 1 per batch.
    """
    batched = loglik.ndim == 3
    lik = torch.from_numpy(np.exp(loglik - np.max(loglik, axis=-1, keepdims=True)))
    w = torch.from_numpy(np.array(weights, dtype=np.float64))
    if not batched:
        lik, w = lik[None], w[None]
    w = w / w.sum(dim=-1, keepdim=True)
    transposed = lik.transpose(1, 2)
    for _ in range(steps):
        mixture = torch.bmm(lik, w[..., None]).clamp_min(1e-300)  # (B, k, 1)
        w = w * torch.bmm(transposed, 1.0 / mixture)[..., 0] / lik.shape[1]
    w = (w / w.sum(dim=-1, keepdim=True)).numpy()
    return w if batched else w[0]


def _posterior(loglik: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Posterior over the atoms of each member (``(..., k, atoms)``)."""
    shifted = np.exp(loglik - np.max(loglik, axis=-1, keepdims=True)) * weights[..., None, :]
    return shifted / np.maximum(shifted.sum(axis=-1, keepdims=True), 1e-300)


def _posterior_flips(loglik: np.ndarray, weights: np.ndarray, flip_atoms: np.ndarray) -> np.ndarray:
    return _posterior(loglik, weights) @ flip_atoms.astype(np.float64)


def _total_loglik(loglik: np.ndarray, weights: np.ndarray) -> float:
    top = np.max(loglik, axis=-1)
    return float(np.sum(np.log(np.maximum(np.exp(loglik - top[:, None]) @ weights, 1e-300)) + top))


def bivariate_normal_cdf(h: np.ndarray, k: np.ndarray, r: np.ndarray) -> np.ndarray:
    """
    ``P(X ≤ h, Y ≤ k)`` of a standard bivariate normal with correlation ``r`` (Owen's T-function form, exact),
    broadcast over the arguments; ``r`` must lie in ``(-1, 1)``.
    """
    h, k, r = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (h, k, r)))
    root = np.sqrt(1.0 - r * r)
    tiny = 1e-300
    # a hair from zero: moved to ±tiny keeping the sign (exact zeros to +tiny, the branch ``beta`` accounts for)
    hs = np.where(np.abs(h) < tiny, np.where(h < 0, -tiny, tiny), h)
    ks = np.where(np.abs(k) < tiny, np.where(k < 0, -tiny, tiny), k)
    with np.errstate(over="ignore", divide="ignore"):  # ±inf near an axis: Owen's T has the right limit there
        a_h = (k - r * hs) / (hs * root)
        a_k = (h - r * ks) / (ks * root)
    zero = (h == 0) | (k == 0)
    beta = np.where((~zero & (np.sign(h) != np.sign(k))) | (zero & (h + k < 0)), 0.5, 0.0)  # no underflow of h·k
    both_zero = (np.abs(h) < tiny) & (np.abs(k) < tiny)  # both at the origin for all purposes
    value = 0.5 * (norm.cdf(h) + norm.cdf(k)) - owens_t(hs, a_h) - owens_t(ks, a_k) - beta
    return np.where(both_zero, 0.25 + np.arcsin(r) / (2 * np.pi), np.clip(value, 0.0, 1.0))


def _measured_flip_probability(
    u: np.ndarray, v: np.ndarray, sbb: np.ndarray, saa: np.ndarray, sab: np.ndarray, t: np.ndarray | None, rank_by: str
) -> np.ndarray:
    """
    ``(k, atoms)``: for every member (standardised covariance) and atom ``(u, v)``, the probability that the measured
    aggregates have opposite signs, given that the clean one was selected (``|X_b| ≥ t``, or ``X_b ≥ t`` for a signed
    ranking; no condition when ``t`` is ``None``).
    """
    # a perturbed aggregate without query noise has a floor of spread: its sign is then decided (or, at 0, a tie)
    sb, sa = np.sqrt(sbb)[:, None], np.sqrt(np.maximum(saa, 1e-24))[:, None]
    r = np.clip(sab[:, None] / (sb * sa), -0.999999, 0.999999)
    zb, za = -u / sb, -v / sa  # standardised positions of 0 on each axis
    low = np.zeros_like(zb) if t is None else (t[:, None] - u) / sb  # X_b ≥ t  <=>  Z_b ≥ low
    high = np.zeros_like(zb) if t is None else (-t[:, None] - u) / sb  # X_b ≤ -t <=>  Z_b ≤ high
    if t is None:
        low = high = zb

    def upper_left(b_from: np.ndarray) -> np.ndarray:  # P(Z_b ≥ b_from, Z_a ≤ za)
        return norm.cdf(za) - bivariate_normal_cdf(b_from, za, r)

    def lower_right(b_to: np.ndarray) -> np.ndarray:  # P(Z_b ≤ b_to, Z_a ≥ za)
        return norm.cdf(b_to) - bivariate_normal_cdf(b_to, za, r)

    if rank_by == "signed" and t is not None:
        selected = norm.sf(low)
        flipped = upper_left(low)  # selected means X_b ≥ t > 0: a flip is X_a < 0
    else:
        selected = norm.sf(low) + norm.cdf(high)
        flipped = upper_left(low) + lower_right(high)
    return np.clip(flipped / np.maximum(selected, 1e-300), 0.0, 1.0)
