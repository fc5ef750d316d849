"""
The signed retention of an influential set, corrected for the selection of the set.

Estimand (the set ``T`` and the measured clean signs ``s_j = sign(m_b,j)`` held fixed; ``μ`` the population aggregates,
the means over infinitely many queries):

    ``R = Σ_{j∈T} s_j μ_a,j / Σ_{j∈T} s_j μ_b,j``

1: the set's clean influence is kept, 0: wiped out, below 0: reversed on balance. Where every measured sign is right it
is ``Σ_T sign(μ_b) μ_a / Σ_T |μ_b|``, the ``|μ_b|``-weighted mean of the members' ratios ``μ_a / μ_b``; members with
``μ_b = 0`` (examples that entered the set by query noise) count for nothing in it.

Why not the plug-in ratio ``Σ_T s m_a / Σ_T s m_b`` of the measured aggregates: the set is chosen for large
``|m_b|``, so its clean aggregates carry the winner's curse (in planted designs the plug-in denominator was 1.9 times
the true one, 8 times with weak influence), and the perturbed aggregates share that noise; its bootstrap interval,
conditional on the set, then covered the truth in 0 % of the draws.

Estimator (empirical Bayes and a regression on the clean noise):

- ``z_j = m_b,j / se_j`` for every training example (``se``: the standard error of its clean aggregate); ``G`` the
  nonparametric maximum-likelihood distribution of ``θ = μ_b / se`` from ``z ~ N(θ, 1)`` (Kiefer-Wolfowitz, EM on a
  grid), fitted on all examples when the set was chosen from these aggregates (the posterior mean given ``z`` does
  not depend on the selection: Tweedie's formula undoes the winner's curse), on the set's own when it was given;
- ``μ̂_j = se_j E_G[θ | z_j]``, ``D̂ = Σ_T s_j μ̂_j`` (the set's clean influence, selection corrected);
- ``β_j = cov(a_j, b_j) / var(b_j)`` over the queries (the perturbed scores regressed on the clean ones);
- ``R̂ = Σ_T s_j [m_a,j − β_j (m_b,j − μ̂_j)] / D̂``: the perturbed aggregate loses ``β_j`` times the clean winner's
  curse, which it shares through the queries; the residual ``m_a − β m_b`` is uncorrelated with the clean noise and so
  with the selection.

Interval: normal, ``R̂ ± z √V`` with ``V`` the bootstrap variance over queries of the residual part
``Σ_T s (m*_a − β m*_b) / D̂`` (``T``, ``s``, ``β``, ``D̂`` fixed) plus the empirical-Bayes error of ``D̂``:
``Σ_T w_j (β_j − R̂)² · Var((D̂ − D) / D̂)`` with ``w ∝ max(s μ̂, 0)``, the relative variance from a parametric
bootstrap (:data:`EB_WORLDS` worlds drawn from ``Ĝ``, the set chosen in each as the audit chose it, ``G`` refitted).
Controls and excesses combine the same two parts (:func:`~._summary.combine_controls`). Measured coverage and bias:
docs/metrics.md. Assumptions: normal aggregates (means over many queries), examples exchangeable given ``θ`` (one
prior for all), the selection by clean aggregates only.

When it is not reported (``NaN``, with the reason in the report's ``null_reasons``): a ratio is a share only where its
denominator is decidedly positive and not negligible, so the retention is refused where ``D̂ ≤ 0``, where ``D̂`` is not
distinguishable from zero at the report's confidence (its relative standard error, from the parametric bootstrap
above, at least ``1 / z``: the ratio's confidence set is then unbounded, as Fieller's theorem says of any ratio), and
where ``|R̂|`` exceeds :data:`MAX_RETENTION` (the set's clean influence is then under a tenth of what the perturbed
influence holds, and the ratio measures how small the clean influence is rather than a share kept: queries drawn from
a training set that the model fits, say, whose clean scores are near zero).

Cost: ``O(N)`` for the prior (binned), ``O(EB_WORLDS · N)`` for the parametric bootstrap, ``O(B · k)`` per pass from
sums the metrics accumulate anyway; nothing depends on the number of queries but those sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from art_malleability._utils.torch_utils import single_thread
from art_malleability.metrics._flip_posterior import PairedSums

#: Atoms of the prior's grid (plus one at 0), EM steps, and bins of the standardised aggregates.
GRID_SIZE, EM_STEPS, BINS = 100, 500, 400
#: Worlds of the parametric bootstrap of the empirical-Bayes error.
EB_WORLDS = 40
#: Largest ``|R̂|`` reported: beyond it the set's clean influence is under a tenth of its perturbed influence, and the
#: ratio is no longer a share of influence kept (a new user's audit without test points printed 56,463).
MAX_RETENTION = 10.0


def _design(low: float, high: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The grid of atoms over ``[low, high]`` (and 0), the bins' edges, and the likelihood of each bin's centre."""
    grid = np.unique(np.concatenate([np.linspace(low, high, GRID_SIZE), [0.0]]))
    edges = np.linspace(low - 1e-9, high + 1e-9, BINS + 1)
    centres = 0.5 * (edges[1:] + edges[:-1])
    return grid, edges, np.exp(-0.5 * (centres[:, None] - grid[None, :]) ** 2)


def _em(lik: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """
    Plain EM of the mixing weights from the uniform prior, :data:`EM_STEPS` steps (a smooth function of the data, which
    the parametric bootstrap repeats exactly), for several data sets at once.

    :param lik: ``(bins, atoms)`` likelihoods.
    :param counts: ``(bins, R)`` counts of each bin in each data set.
    :return: ``(atoms, R)`` weights.
    """
    w = np.full((lik.shape[1], counts.shape[1]), 1.0 / lik.shape[1])
    total = counts.sum(axis=0)
    with single_thread():
        for _ in range(EM_STEPS):
            w = w * (lik.T @ (counts / np.maximum(lik @ w, 1e-300))) / total
    return w


@dataclass
class NormalMeansPrior:
    """A discrete distribution of ``θ`` (atoms and weights), fitted from ``z ~ N(θ, 1)``."""

    grid: np.ndarray
    weights: np.ndarray

    @classmethod
    def fit(cls, z: np.ndarray) -> NormalMeansPrior:
        """Nonparametric maximum likelihood on a grid spanning the data, ``z`` binned into :data:`BINS` bins."""
        z = np.asarray(z, dtype=np.float64)
        z = z[np.isfinite(z)]
        if z.size == 0:
            return cls(np.zeros(1), np.ones(1))
        grid, edges, lik = _design(float(z.min()), float(z.max()))
        counts = np.histogram(z, edges)[0].astype(np.float64)
        used = counts > 0
        return cls(grid, _em(lik[used], counts[used, None])[:, 0])

    def posterior_means(self, z: np.ndarray) -> np.ndarray:
        """:return: ``E[θ | z]`` of each ``z``."""
        z = np.asarray(z, dtype=np.float64)
        out = np.empty_like(z)
        logw = np.log(np.maximum(self.weights, 1e-300))
        for s in range(0, z.size, 4096):
            log_post = -0.5 * (z[s : s + 4096, None] - self.grid[None, :]) ** 2 + logw
            post = np.exp(log_post - log_post.max(axis=1, keepdims=True))
            out[s : s + 4096] = (post @ self.grid) / post.sum(axis=1)
        return out


def _choose(values: np.ndarray, k: int, rank_by: str) -> np.ndarray:
    """The ``k`` largest keys (``|value|`` or value), ties to the lower index."""
    key = np.abs(values) if rank_by == "abs" else values
    return np.argsort(-key, kind="stable")[:k]


def relative_error_variance(prior: NormalMeansPrior, se: np.ndarray, k: int, rank_by: str | None, seed: int) -> float:
    """
    The variance of ``(D̂ − D) / D̂`` over worlds drawn from the fitted prior: ``θ_j ~ G`` and ``z_j = θ_j + N(0, 1)``
    for every example the prior was fitted on (standard errors ``se``), the set chosen as the audit chose it (the
    ``k`` largest clean aggregates ``se · z`` by ``rank_by``; ``None``: the set was given, all of them), ``G`` refitted
    as on the data, ``D = Σ_T s se θ``, ``D̂ = Σ_T s se E_Ĝ*[θ | z]``.

    :param seed: Seed of the worlds.
    """
    rng = np.random.default_rng([seed, 0xEB])
    n = se.size
    if n == 0:
        return float("nan")
    theta = rng.choice(prior.grid, size=(EB_WORLDS, n), p=prior.weights / prior.weights.sum())
    z = theta + rng.standard_normal((EB_WORLDS, n))
    grid, edges, lik = _design(float(z.min()), float(z.max()))
    counts = np.stack([np.histogram(row, edges)[0] for row in z], axis=1).astype(np.float64)
    used = counts.sum(axis=1) > 0
    weights = _em(lik[used], counts[used])
    errors = np.empty(EB_WORLDS)
    for r in range(EB_WORLDS):
        top = np.arange(n) if rank_by is None else _choose(se * z[r], k, rank_by)
        signs = np.sign(z[r, top])
        fitted = NormalMeansPrior(grid, weights[:, r]).posterior_means(z[r, top])
        estimate = np.sum(signs * se[top] * fitted)
        with np.errstate(invalid="ignore", divide="ignore"):
            errors[r] = (estimate - np.sum(signs * se[top] * theta[r, top])) / estimate
    errors = errors[np.isfinite(errors)]
    return float(np.var(errors, ddof=1)) if errors.size > 1 else float("nan")


@dataclass
class RetentionBasis:
    """
    What every pass of one clean pass shares: the clean signs ``s``, the clean aggregates ``m_b`` and the
    selection-corrected ``μ̂`` of the set, ``D̂``, and the empirical-Bayes error's weights ``w`` and relative variance.
    """

    signs: np.ndarray
    clean: np.ndarray
    corrected: np.ndarray
    denominator: float
    eb_weights: np.ndarray
    eb_variance: float

    @classmethod
    def of(cls, count: np.ndarray, total: np.ndarray, squares: np.ndarray, top: np.ndarray, rank_by: str,
           selected: bool, seed: int) -> RetentionBasis:
        """
        :param count: Finite clean scores of every training example (over all queries).
        :param total: Their sums.
        :param squares: Their sums of squares.
        :param top: The set.
        :param rank_by: How it was chosen.
        :param selected: Whether it was chosen from these clean scores (else given in advance).
        :param seed: Seed of the parametric bootstrap.
        """
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count
            variance = (squares - count * mean**2) / (count - 1.0)
            se = np.sqrt(np.maximum(variance, 0.0) / count)
            z = mean / se
        usable = np.isfinite(z) & (se > 0)
        if not selected:  # a set fixed in advance: its members are exchangeable among themselves only
            usable &= np.isin(np.arange(usable.size), top)
        prior = NormalMeansPrior.fit(z[usable])
        clean = mean[top]
        signs = np.nan_to_num(np.sign(clean))
        exact = ~usable[top]  # measured without query noise (or given members without a spread): taken as they are
        corrected = np.where(exact, np.nan_to_num(clean), se[top] * prior.posterior_means(np.where(exact, 0.0, z[top])))
        denominator = float(np.sum(signs * corrected))
        w = np.maximum(signs * corrected, 0.0)
        w = w / w.sum() if w.sum() > 0 else np.full(w.size, 1.0 / max(w.size, 1))
        in_set = np.isin(np.flatnonzero(usable), top).sum()
        variance = relative_error_variance(prior, se[usable], int(in_set), rank_by if selected else None, seed)
        return cls(signs, clean, corrected, denominator, w, variance)

    def identified(self, confidence: float) -> bool:
        """Whether the set's clean influence ``D̂`` is decidedly positive at ``confidence``: positive, with a relative
        standard error below ``1 / z`` (else the ratio's confidence set is unbounded: Fieller)."""
        z = float(norm.ppf(0.5 + confidence / 2.0))
        return bool(np.isfinite(self.denominator) and self.denominator > 0 and np.isfinite(self.eb_variance)
                    and z * z * self.eb_variance < 1.0)

    def retention(self, sums: PairedSums, perturbed: np.ndarray, resampled_clean: np.ndarray,
                  resampled_perturbed: np.ndarray, confidence: float = 0.95) -> tuple[float, np.ndarray, np.ndarray]:
        """
        One pass's retention (``NaN`` where it is not a share: see the module docstring).

        :param sums: The set's paired sums over all queries (one row; the slopes ``β`` are their covariance over the
            clean variance, :meth:`~._flip_posterior.PairedSums.moments`).
        :param perturbed: ``(k,)`` perturbed aggregates of the set.
        :param resampled_clean: ``(B, k)`` clean aggregates of the set in every resample.
        :param resampled_perturbed: ``(B, k)`` perturbed ones.
        :return: ``(R̂, replicates, eb_loadings)``: the replicates ``R̂ + (residual part on a resample − on all
            queries)``; the loadings ``e`` of the empirical-Bayes error, ``√(Var_rel · w) (β − R̂)``, whose squares sum
            to its variance (linear in the slopes, so a control's mean over draws and an excess's difference follow).
        """
        undefined = float("nan"), np.full(len(resampled_clean), np.nan), np.full(self.signs.size, np.nan)
        if not self.identified(confidence):
            return undefined
        _, cov = sums.moments()
        clean_variance, covariance = cov[0, :, 0, 0], cov[0, :, 0, 1]
        slope = np.where(clean_variance > 0, covariance / np.where(clean_variance > 0, clean_variance, 1.0), 0.0)
        s, d = self.signs, self.denominator
        residual = np.nansum(s * (perturbed - slope * self.clean)) / d
        point = float(residual + np.sum(s * slope * self.corrected) / d)
        if abs(point) > MAX_RETENTION:
            return undefined
        replicates = np.nansum(s * (resampled_perturbed - slope * resampled_clean), axis=1) / d
        loadings = np.sqrt(max(self.eb_variance, 0.0) * self.eb_weights) * (slope - point)
        return point, point + (replicates - residual), loadings
