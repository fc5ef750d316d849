"""
Intervals: resamples of query rows, the normal interval with a bootstrap standard error (discontinuous statistics),
the delete-a-group jackknife's (Spearman's correlation), the Student-t interval of a mean over queries or over training
seeds, the percentile interval, and the normal quantile of a coverage.
:mod:`art_malleability.metrics` exports the public names and docs/metrics.md gives each one's estimand and measured
coverage.
"""

from __future__ import annotations

import numpy as np
from scipy.stats import norm
from scipy.stats import t as student_t

from art_malleability._utils.params import CONFIDENCE, POSITIVE_INT

#: Fewest queries the intervals that resample them (normal intervals with a bootstrap standard error, the noise-aware
#: rate's deconvolution of per-member covariances) are built from: a normal interval with the bootstrap's standard
#: error of a mean over ``n`` Gaussian queries covers ``2 T_{n-1}(1.96 √((n-1)/n)) - 1``: 0.60 at 2 queries, 0.85 at
#: 5, 0.904 at 10, the first count inside the 90-98 % band (``tests/test_metrics.py`` computes it). Below it those
#: intervals and the noise-aware rate are not reported (Student-t intervals over queries or jackknife groups are).
MIN_INTERVAL_QUERIES = 10


def resample_rows(n_query: int, n_bootstrap: int = 1000, seed: int = 0) -> np.ndarray:
    """
    Bootstrap resamples of query rows: ``(n_bootstrap, n_query)`` indices drawn with replacement from a
    generator seeded with ``seed``. Every statistic of one audit is evaluated on the same resamples, so
    differences between statistics (an attack's flip rate minus its control's) are paired.

    :param n_query: Number of queries.
    :param n_bootstrap: Number of resamples: a positive integer (a Python or numpy int; ``3.0`` is refused, as the
        audit's ``n_bootstrap`` is).
    :param seed: Seed of the generator.
    :return: Integer array.
    :raises InvalidParameterError: For any other ``n_bootstrap`` (the rule ``POSITIVE_INT``, a ``ValueError``).
    """
    n_bootstrap = POSITIVE_INT(n_bootstrap, "n_bootstrap")
    return np.random.default_rng(seed).integers(0, n_query, (n_bootstrap, n_query))


def percentile_interval(draws: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """
    The plain percentile interval of bootstrap replicates: their ``(1 ∓ confidence)/2`` quantiles (the package's
    one home for it: the NTK checker's intervals over seeds).

    :param draws: Replicates (non-finite ones are ignored).
    :param confidence: Coverage, in (0, 1).
    :return: ``(low, high)``; ``(NaN, NaN)`` without a finite replicate.
    """
    check_confidence(confidence)
    draws = np.asarray(draws, dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    if draws.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(draws, [tail, 100.0 - tail])
    return float(low), float(high)


#: Ratio of the true variance of a threshold indicator ``1{a > b}`` at a tie (``1/4``) to its expected bootstrap
#: variance there (``1/6``) under Gaussian noise of the means: the bootstrap probability ``p* = Φ(Z)`` is itself
#: uniform, so ``E[p*(1 - p*)] = 1/2 - E[Φ(Z)²] = 1/6``. The ratio is largest at the tie and falls below 1 a
#: standard error away from it. A top-set overlap is a sum of such indicators near its rank cut-off, so its
#: bootstrap variance is scaled by this bound (``tests/test_statistics.py`` measures both the ratio and the coverage).
TIE_VARIANCE_RATIO = 1.5


def normal_interval(
    point: float, draws: np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = (-np.inf, np.inf),
    extra_variance: float = 0.0, variance_factor: float = 1.0,
) -> tuple[float, float]:
    """
    Normal interval with a bootstrap standard error: ``point ± z · sd(draws)``, clipped to the statistic's range.
    The interval of the statistics that are discontinuous in the query means (flip rates, top-set overlap): its
    estimand is the statistic's expected value at this number of queries, of which the statistic itself is
    unbiased. A percentile interval would inherit the resamples' bias (a resample repeats queries, so its means
    are noisier and its flip rates higher); the spread of the resamples is a usable standard error (coverage
    measured in the test suite).

    :param point: The statistic on all queries.
    :param draws: Its bootstrap replicates (non-finite ones are ignored).
    :param confidence: Coverage, in (0, 1).
    :param bounds: Range of the statistic.
    :param extra_variance: Variance added to the bootstrap variance (a source the resamples do not see, e.g. the
        spread between a control's random-sign draws divided by their number).
    :param variance_factor: Factor on the bootstrap variance (:data:`TIE_VARIANCE_RATIO` for a statistic made of
        rank cut-offs, whose bootstrap variance falls short near ties).
    :return: ``(low, high)``; ``(NaN, NaN)`` when the point is undefined or fewer than two replicates are finite.
    """
    check_confidence(confidence)
    draws = np.asarray(draws, dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    if draws.size < 2 or not np.isfinite(point):
        return float("nan"), float("nan")
    variance = variance_factor * float(draws.var(ddof=1)) + max(extra_variance, 0.0)
    half = float(norm.ppf(0.5 + confidence / 2.0)) * float(np.sqrt(variance))
    return float(max(point - half, bounds[0])), float(min(point + half, bounds[1]))


def jackknife_interval(
    point: float, replicates: np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = (-np.inf, np.inf),
    extra_variance: float = 0.0,
) -> tuple[float, float]:
    """
    Interval from a delete-a-group jackknife: ``point ± t_{G−1} · sqrt(v)`` with the jackknife variance
    ``v = (G − 1)/G · Σ_g (θ_(g) − θ̄)²`` of the ``G`` leave-one-group-out values (plus ``extra_variance``), clipped to
    the statistic's range. The interval of Spearman's correlation (a smooth statistic whose bootstrap would re-rank
    every resample); coverage measured in the test suite.

    :param point: The statistic on all queries.
    :param replicates: Its value with each group of queries left out (non-finite ones are ignored).
    :param confidence: Coverage, in (0, 1).
    :param bounds: Range of the statistic.
    :param extra_variance: Variance added (the spread between a control's draws over their number).
    :return: ``(low, high)``; ``(NaN, NaN)`` with fewer than two finite replicates or an undefined point.
    """
    check_confidence(confidence)
    replicates = np.asarray(replicates, dtype=np.float64)
    replicates = replicates[np.isfinite(replicates)]
    groups = replicates.size
    if groups < 2 or not np.isfinite(point):
        return float("nan"), float("nan")
    variance = (groups - 1) / groups * float(np.sum((replicates - replicates.mean()) ** 2)) + max(extra_variance, 0.0)
    half = float(student_t.ppf(0.5 + confidence / 2.0, groups - 1)) * float(np.sqrt(variance))
    return float(max(point - half, bounds[0])), float(min(point + half, bounds[1]))


def t_interval(
    values: np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = (-np.inf, np.inf),
    min_sd: float = 0.0,
) -> tuple[float, float]:
    """
    Student-t interval of a mean over independent units (queries, training seeds): ``mean ± t · sd / sqrt(n)``,
    clipped to the statistic's range.

    :param values: One value per unit (non-finite ones are ignored).
    :param confidence: Coverage, in (0, 1).
    :param bounds: Range of the statistic.
    :param min_sd: A floor on the units' standard deviation (a spread they are known to have at least).
    :return: ``(low, high)``; ``(NaN, NaN)`` with fewer than two finite values.
    """
    check_confidence(confidence)
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size < 2:
        return float("nan"), float("nan")
    mean = float(values.mean())
    quantile = float(student_t.ppf(0.5 + confidence / 2.0, values.size - 1))
    half = quantile * max(float(values.std(ddof=1)), min_sd) / np.sqrt(values.size)
    return float(max(mean - half, bounds[0])), float(min(mean + half, bounds[1]))


def seed_interval(
    points: np.ndarray, confidence: float = 0.95, bounds: tuple[float, float] = (-np.inf, np.inf),
    within: np.ndarray | None = None,
) -> tuple[float, tuple[float, float]]:
    """
    Mean of a statistic over independent runs (training seeds) with a Student-t interval over the runs. Each run's
    estimate already carries its own query noise, so the spread between runs holds it once (a bootstrap of runs
    and then of queries within runs counts it twice); the estimand is the statistic's expected value over training
    seeds and query draws. With fewer than two runs the interval is undefined.

    With ``within``, each run's own standard error over queries: the variance between runs is at least their mean
    square, since each run's estimate varies by its query noise alone even where the runs' expectations agree. With few
    runs the sample variance can fall far below it by chance (two seeds at a boundary, both 0, gave a zero-width
    interval), so the interval takes the larger of the two.

    :param points: The statistic of each run (non-finite ones are ignored).
    :param confidence: Coverage.
    :param bounds: Range of the statistic.
    :param within: Each run's standard error over its queries (non-finite ones are ignored), or ``None``.
    :return: ``(mean, (low, high))``.
    """
    points = np.asarray(points, dtype=np.float64)
    keep = np.isfinite(points)
    finite = points[keep]
    if finite.size == 0:
        return float("nan"), (float("nan"), float("nan"))
    errors = np.asarray(within if within is not None else np.full(points.size, np.nan), dtype=np.float64)[keep]
    floor = float(np.sqrt(np.mean(errors[np.isfinite(errors)] ** 2))) if np.isfinite(errors).any() else 0.0
    return float(finite.mean()), t_interval(finite, confidence, bounds, min_sd=floor)


def check_confidence(confidence: float) -> float:
    """
    :param confidence: Coverage of an interval.
    :return: ``confidence`` unchanged.
    :raises InvalidParameterError: Unless it is a number in (0, 1) (the rule ``CONFIDENCE``, a ``ValueError``).
    """
    return CONFIDENCE(confidence, "confidence")


def z_value(confidence: float) -> float:
    """:return: The two-sided normal quantile of a coverage, ``Φ⁻¹(1/2 + confidence/2)`` (1.96 at 0.95)."""
    check_confidence(confidence)
    return float(norm.ppf(0.5 + confidence / 2.0))
