"""
The noise-aware flip rate: how many members of the influential set have a *population* aggregate (the mean over
infinitely many queries) that changes sign, estimated by empirical-Bayes deconvolution of their paired clean and
perturbed aggregates.

Model. For a member ``j`` of the set, the clean and perturbed aggregates over the ``n`` queries,
``x_j = (m_b, m_a)``, are bivariate normal around the population aggregates ``θ_j = (μ_b, μ_a)`` with the covariance
``Σ_j`` of the two means: both come from the same queries and weights, so the covariance is estimated from the
paired per-query scores (variances and their covariance over ``n``), plus, for a projected estimator, the
projection's own variance (:func:`projection_noise`). As that covariance is itself estimated, from per-query scores
that may be heavy-tailed (a few queries that dominate), the standardised aggregates are taken as bivariate Student-t
rather than normal, with the degrees of freedom the per-query scores' kurtosis gives (:meth:`PairedSums.noise_dof`:
``n − 1`` for normal scores, about 15 for Student-t(3) scores over 100 queries, about 7 where 5 of 100 queries carry
most of the spread). Every quantity is standardised by the clean standard
error ``se_b,j``, so one prior ``G`` on standardised means serves examples of any scale. ``G`` is the distribution
of ``θ`` *among the members of the set*: the set was chosen by the clean aggregates (the ``k`` largest
``|m_b|``), so the likelihood of ``x_j`` is truncated to the selection event, ``f(x | θ) / P(|X_b| ≥ c | θ)``, which
undoes the winner's curse of the selection. ``G`` is estimated by nonparametric maximum likelihood on a fixed
grid of atoms (EM, Kiefer-Wolfowitz); the posterior probability that member ``j`` flips is the posterior mass of
the atoms with ``μ_b · μ_a < 0``.

Estimand: the share of the set whose population aggregates have strictly opposite signs. Estimate: the mean of
the posterior flip probabilities. Interval: profile likelihood. For every prior flip mass ``s`` on a grid of
:data:`PROFILE_SHARES` values in ``[0, 1]``, ``G`` is refitted under the constraint that it puts mass ``s`` on the flip
atoms; the shares ``s`` that the likelihood-ratio test does not reject (``2 (ℓ(Ĝ) − ℓ(Ĝ_s)) ≤ χ²₁(confidence)``,
the crossings interpolated between grid points) are accepted, and the interval spans the posterior mean flip shares
of the set under the accepted fits, joined with the estimate ± ``z`` times the spread of the members' classification
given ``Ĝ`` (the estimand is the share of these members). At ``s = 0`` the test is that of "no member flips". (A
bootstrap over the queries refitting ``G`` was used before: its resampled aggregates carry the query noise twice, so
its refits estimate the flip share of the *measured* aggregates and the interval leaned away from the estimate; its
coverage in planted designs fell to 0.5.) Null expectation of the raw flip rate: under the fitted no-flip ``G``, the
expected share of the set whose *measured* aggregates change sign, that is what the raw flip rate would be by query
noise alone. Assumptions, and where they fail, are in docs/metrics.md; coverage and bias are measured by the
simulations in the test suite.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import gammaln, ndtr, owens_t, stdtr
from scipy.stats import chi2, norm

from art_malleability._utils.torch_utils import single_thread

#: Atoms per axis of the prior's grid (odd: one atom sits at 0, a population aggregate of about 0, which is not a flip).
GRID_SIZE = 25
#: EM steps of the fit, and of every constrained fit of the profile likelihood.
FIT_STEPS = 300
#: Prior flip masses of the profile likelihood: 0, 1/50, ..., 1.
PROFILE_SHARES = 51
#: More flip masses fitted inside each grid cell where the deviance crosses the critical value.
REFINE_POINTS = 9


class PairedSums:
    """
    Weighted sums over the queries of an influential set's paired clean and perturbed scores, from which its paired
    aggregates and their covariances follow (:meth:`moments`); each of ``count``, ``b``, ``a``, ``bb``, ``aa``, ``ab``
    is ``(R, k)``: one row per weighting of the queries (the audit's: all queries once, then the bootstrap resamples),
    over the pairs finite on both sides. Accumulated block by block over the queries, in ``O(R · n_query · k)``.
    """

    NAMES = ("count", "b", "a", "bb", "aa", "ab", "bbb", "aaa", "bbbb", "aaaa")

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
                    "ab": w @ (a * b), "bbb": w @ b**3, "aaa": w @ a**3, "bbbb": w @ b**4, "aaaa": w @ a**4})

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

    def noise_dof(self) -> float:
        """
        Degrees of freedom of the standardised aggregates' noise (the first row's): a member's aggregate is divided by
        a standard error estimated from its own queries, and that estimate's relative variance is ``(κ − 1) / n`` for
        per-query scores of kurtosis ``κ``; matched to a scaled ``χ²_ν / ν`` (relative variance ``2 / ν``) it gives
        ``ν = 2 (n − 1) / (κ − 1)``, with ``κ`` the mean sample kurtosis of the set's clean and perturbed scores (the
        larger of the two), at most ``n − 1`` (normal scores: Student's own). Heavy-tailed or few dominant queries give
        few degrees of freedom: the aggregates' standardised noise has heavier tails than a normal's.

        :return: ``ν`` (``inf`` where fewer than four queries or no member varies).
        """
        count = self.count[0]
        safe = np.maximum(count, 1.0)
        kurtosis = []
        for sums in ((self.b, self.bb, self.bbb, self.bbbb), (self.a, self.aa, self.aaa, self.aaaa)):
            m, m2, m3, m4 = (s[0] / safe for s in sums)  # raw moments per member
            var = m2 - m * m
            fourth = m4 - 4 * m * m3 + 6 * m * m * m2 - 3 * m**4
            ok = (count >= 4) & (var > 1e-12 * np.maximum(m2, 1e-300))
            if ok.any():
                kurtosis.append(float(np.mean(fourth[ok] / var[ok] ** 2)))
        if not kurtosis:
            return math.inf
        n = float(np.median(count[count >= 4]))
        return float(min(n - 1.0, 2.0 * (n - 1.0) / max(max(kurtosis) - 1.0, 1e-12)))


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

    :param sums: The set's :class:`PairedSums` over all queries once (one row; :meth:`from_scores` builds them from
        matrices).
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
        if len(sums) != 1:
            raise ValueError(f"sums must hold one row (all queries once), got {len(sums)}")
        self.threshold, self.rank_by, self.noise = threshold, rank_by, noise
        self.dof = sums.noise_dof()
        means, cov = sums.moments()
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
        self._profile: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_scores(
        cls,
        before: np.ndarray,
        after: np.ndarray,
        top: np.ndarray,
        threshold: float | None,
        rank_by: str = "abs",
        noise: tuple[float, float] | None = None,
    ) -> FlipPosterior:
        """
        The deconvolution of whole influence matrices.

        :param before: Clean influence matrix ``(n_query, n_train)``.
        :param after: Perturbed influence matrix, same shape.
        :param top: The set (training indices), chosen from the clean aggregates.
        :param threshold: See the class.
        :param rank_by: See the class.
        :param noise: See the class.
        """
        return cls(PairedSums.of(before, after, np.asarray(top, dtype=np.int64)), threshold, rank_by, noise)

    def profile(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """
        The profile likelihood on the grid of prior flip masses ``0, 1/50, ..., 1`` (:meth:`constrained_fits`).

        :return: ``shares`` ``(PROFILE_SHARES,)``, ``weights`` ``(PROFILE_SHARES, atoms)`` and the total log-likelihood
            of each fit (the first, ``s = 0``, is the no-flip fit).
        """
        if self._profile is None:
            shares = np.linspace(0.0, 1.0, PROFILE_SHARES)
            self._profile = (shares, *self.constrained_fits(shares))
        return self._profile

    def constrained_fits(self, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """
        The fits of ``G`` constrained to put mass ``s`` on the flip atoms, for every ``s`` of ``shares`` at once: EM
        whose M-step rescales the flip and the sign-keeping atoms' weights to ``s`` and ``1 − s`` (one ``k × atoms``
        likelihood shared by all ``s``: two matrix products per step), started from ``Ĝ`` blended with a tenth of the
        uniform prior within each block.

        :param shares: Prior flip masses in ``[0, 1]``.
        :return: ``weights`` ``(len(shares), atoms)`` and the total log-likelihood of each fit.
        """
        top = self.loglik.max(axis=-1, keepdims=True)
        lik = torch.from_numpy(np.exp(self.loglik - top))
        flip = torch.from_numpy(self.flip_atoms)
        mass = torch.as_tensor(np.asarray(shares, dtype=np.float64))[:, None]
        blocks = torch.stack([flip, ~flip]).to(torch.float64)  # (2, atoms)
        fitted = torch.from_numpy(self.weights) * blocks
        total = fitted.sum(-1, keepdim=True)
        uniform = blocks / blocks.sum(-1, keepdim=True).clamp_min(1.0)
        start = torch.where(total > 0, 0.9 * fitted / total.clamp_min(1e-300) + 0.1 * uniform, uniform)
        w = mass * start[0] + (1.0 - mass) * start[1]
        with single_thread():
            for _ in range(FIT_STEPS):
                r = w * (lik.T @ (1.0 / (lik @ w.T).clamp_min(1e-300))).T  # (S, atoms): the E-step's masses
                in_flip = (r * blocks[0]).sum(-1, keepdim=True).clamp_min(1e-300)
                in_keep = (r * blocks[1]).sum(-1, keepdim=True).clamp_min(1e-300)
                w = torch.where(flip, mass * r / in_flip, (1.0 - mass) * r / in_keep)
        loglik = torch.log((lik @ w.T).clamp_min(1e-300)).sum(0) + float(top.sum())
        return w.numpy(), loglik.numpy()

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
        nu = self.dof
        if math.isinf(nu):
            loglik = -0.5 * quad - 0.5 * np.log(det)[..., None] - math.log(2 * math.pi)
            cdf = ndtr
        else:  # bivariate Student-t of nu degrees of freedom (PairedSums.noise_dof)
            loglik = (gammaln(0.5 * (nu + 2.0)) - gammaln(0.5 * nu) - math.log(nu * math.pi)
                      - 0.5 * np.log(det)[..., None] - 0.5 * (nu + 2.0) * np.log1p(quad / nu))

            def cdf(z: np.ndarray) -> np.ndarray:
                return stdtr(nu, z)
        if self.threshold is not None:
            t = (abs(self.threshold) if self.rank_by == "abs" else self.threshold) / scale
            sd, axis = np.sqrt(sbb)[..., None], self.axis  # the selection depends on the clean coordinate only
            selected = cdf((axis - t[..., None]) / sd)
            if self.rank_by == "abs":
                selected = selected + cdf((-t[..., None] - axis) / sd)
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
        if not self.keep.any():
            return float("nan")
        return float(np.mean(self.undecided_members()[self.keep]))

    def undecided_members(self) -> np.ndarray:
        """
        :return: Per member of the set, whether its perturbed aggregate lies within one standard error of zero (those
            :meth:`undecided_share` counts; a member measured exactly is never undecided).
        """
        cov = _with_projection(self.means, self.cov, self.noise)[0]
        return self.keep & (np.abs(self.means[0, :, 1]) < np.sqrt(cov[:, 1, 1]))

    def no_flip_statistic(self) -> float:
        """:return: The likelihood-ratio statistic of "no member flips" (``G`` on sign-keeping atoms only)."""
        if not self.keep.any():
            return float("nan")
        return max(0.0, 2.0 * (self._best_loglik() - float(self.profile()[2][0])))

    def _best_loglik(self) -> float:
        """The largest log-likelihood of the fits: the unconstrained one, or a constrained one that EM took further."""
        return max(_total_loglik(self.loglik, self.weights), float(self.profile()[2].max()))

    def null_raw_flip_rate(self) -> float:
        """
        :return: The raw flip rate expected by query noise alone: under the no-flip fit, each member's posterior
            over sign-keeping atoms, and for each atom the probability that the measured aggregates (bivariate
            normal with the member's covariance, given the selection) have opposite signs; the mean over members.
        """
        if not self.keep.any():
            return float("nan")
        posterior = _posterior(self.loglik, self.profile()[1][0])  # (k, atoms), under the no-flip fit
        cov = _with_projection(self.means, self.cov, self.noise)[0, self.keep]
        scale = np.sqrt(cov[:, 0, 0])
        sbb, saa, sab = (cov[:, 0, 0] / scale**2, cov[:, 1, 1] / scale**2, cov[:, 0, 1] / scale**2)
        t = None
        if self.threshold is not None:
            t = (abs(self.threshold) if self.rank_by == "abs" else self.threshold) / scale
        flips = _measured_flip_probability(self.u, self.v, sbb, saa, sab, t, self.rank_by)
        # exactly measured members flip by noise never
        return float(np.sum(posterior * flips) / (self.keep.sum() + np.isfinite(self.exact_flips).sum()))

    def interval(self, confidence: float) -> tuple[float, float]:
        """
        :param confidence: Coverage, in (0, 1).
        :return: ``(low, high)``: the profile-likelihood interval (see the module's docstring). The deviance is taken
            on the grid of :meth:`profile`, then on :data:`REFINE_POINTS` more shares inside every grid cell where it
            crosses the critical value; the crossings are interpolated linearly on that finer grid. Joined with the
            estimate ± ``z`` times the spread of the set's share given ``Ĝ`` (``√(Σ p (1 − p)) / k`` over the members'
            posterior flip probabilities): the estimand is the share of these members, whose classification is
            uncertain even where ``G`` is not.
        """
        if not self.keep.any():
            return float("nan"), float("nan")
        critical = chi2.ppf(confidence, 1)
        shares, weights, total = self.profile()
        best = self._best_loglik()
        cells = np.flatnonzero((2.0 * (best - total[:-1]) - critical) * (2.0 * (best - total[1:]) - critical) < 0)
        if cells.size:
            inner = (shares[cells, None] + np.arange(1, REFINE_POINTS + 1) / (REFINE_POINTS + 1) / (PROFILE_SHARES - 1))
            more_weights, more_total = self.constrained_fits(inner.ravel())
            order = np.argsort(np.concatenate([shares, inner.ravel()]), kind="stable")
            weights = np.concatenate([weights, more_weights])[order]
            total = np.concatenate([total, more_total])[order]
            best = max(best, float(total.max()))
        deviance = 2.0 * (best - total)
        exact = self.exact_flips[np.isfinite(self.exact_flips)]
        flip_shares = np.array([(_posterior_flips(self.loglik, w, self.flip_atoms).sum() + exact.sum())
                                / (self.keep.sum() + exact.size) for w in weights])  # the set's, under each fit
        accepted = list(flip_shares[deviance <= critical])
        for i in np.flatnonzero((deviance[:-1] - critical) * (deviance[1:] - critical) < 0):
            f = (critical - deviance[i]) / (deviance[i + 1] - deviance[i])  # the crossing, linearly
            accepted.append(flip_shares[i] + f * (flip_shares[i + 1] - flip_shares[i]))
        # the members' own classification at the fit: the set's share given Ĝ varies by the posteriors' spread
        probabilities = self.flip_probabilities()
        probabilities = probabilities[np.isfinite(probabilities)]
        estimate = float(probabilities.mean())
        # rounding can leave a certain member's probability a hair past 1
        variance = np.sum(np.clip(probabilities * (1.0 - probabilities), 0.0, None))
        spread = norm.ppf(0.5 + confidence / 2.0) * np.sqrt(variance)
        spread /= probabilities.size
        points = np.clip([estimate - spread, estimate + spread, *accepted], 0.0, 1.0)
        return float(points.min()), float(points.max())


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
    with single_thread():
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
