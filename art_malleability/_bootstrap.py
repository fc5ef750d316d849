"""
Bootstrap over queries: resamples of query rows, batched evaluation of a statistic on them, the percentile
interval and its shifted form, and the two-level (runs x queries) bootstrap. :mod:`art_malleability.metrics`
exports the public names and describes the method.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def resample_rows(n_query: int, n_bootstrap: int = 1000, seed: int = 0) -> np.ndarray:
    """
    Bootstrap resamples of query rows: ``(n_bootstrap, n_query)`` indices drawn with replacement from a
    generator seeded with ``seed``. Every statistic of one audit is evaluated on the same resamples, so
    differences between statistics (an attack's flip rate minus its control's) are paired.

    :param n_query: Number of queries.
    :param n_bootstrap: Number of resamples (>= 1).
    :param seed: Seed of the generator.
    :return: Integer array.
    """
    if isinstance(n_bootstrap, bool) or int(n_bootstrap) != n_bootstrap or n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be a positive integer, got {n_bootstrap!r}")
    return np.random.default_rng(seed).integers(0, n_query, (int(n_bootstrap), n_query))


def evaluate_resamples(statistic: Callable[[np.ndarray], float], rows: np.ndarray) -> np.ndarray:
    """
    Values of a statistic on resamples of query rows.

    :param statistic: Function of an index array of query rows returning a float; when it also has a
        ``batch`` method (``(B, n_query)`` index arrays to ``B`` values) and a ``batch_rows`` attribute,
        resamples are evaluated in batches of that many.
    :param rows: Resamples, ``(n_bootstrap, n_query)``.
    :return: ``(n_bootstrap,)`` values (``NaN`` where undefined).
    """
    batch = getattr(statistic, "batch", None)
    if batch is None:
        return np.array([statistic(r) for r in rows], dtype=np.float64)
    step = max(1, int(getattr(statistic, "batch_rows", len(rows))))
    return np.concatenate([np.asarray(batch(rows[s : s + step]), dtype=np.float64) for s in range(0, len(rows), step)])


def percentile_interval(draws: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """
    The plain percentile interval of bootstrap replicates: their ``(1 ∓ confidence)/2`` quantiles (the package's
    one home for it; :func:`shifted_percentile_interval` moves it onto a point estimate).

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


def shifted_percentile_interval(
    point: float,
    draws: np.ndarray,
    confidence: float = 0.95,
    bounds: tuple[float, float] = (-np.inf, np.inf),
) -> tuple[float, float]:
    """
    Percentile interval of bootstrap replicates, moved so that their median sits on the point estimate:
    ``[point + q_lo − m, point + q_hi − m]`` with ``q_lo, q_hi`` the replicates' ``(1 ∓ confidence)/2``
    quantiles and ``m`` their median, then clipped to the statistic's range ``bounds``.

    Why not the plain percentile interval: the audit's statistics are discontinuous functions of means
    over queries (signs of aggregate scores, membership of a top set). A resample with repeated queries
    has noisier means, so its replicates are biased (flip rates up, overlaps down) and a percentile
    interval can exclude the estimate it is meant to bound. BCa corrects that bias only while the
    estimate lies inside the central ``confidence`` share of the replicates, which is exactly when the
    problem does not arise. The shift keeps the percentile interval's width and shape, removes the
    replicates' median bias, contains the estimate by construction (``q_lo ≤ m ≤ q_hi``) and equals the
    percentile interval whenever the replicates are median-unbiased. It describes the query-sampling
    variability of the reported statistic; it does not correct the statistic's own small-sample bias.

    :param point: The statistic on all queries.
    :param draws: Its bootstrap replicates (non-finite ones are ignored).
    :param confidence: Coverage, in (0, 1).
    :param bounds: Range of the statistic (e.g. ``(0, 1)`` for a rate).
    :return: ``(low, high)``; ``(NaN, NaN)`` when the point or every replicate is undefined.
    """
    check_confidence(confidence)
    draws = np.asarray(draws, dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    if draws.size == 0 or not np.isfinite(point):
        return float("nan"), float("nan")
    (low, high), median = percentile_interval(draws, confidence), float(np.median(draws))
    low, high = point + (low - median), point + (high - median)
    # min/max keep the point inside when rounding moves an endpoint across it
    return float(max(min(low, point), bounds[0])), float(min(max(high, point), bounds[1]))


def bootstrap_interval(
    statistic: Callable[[np.ndarray], float],
    n_query: int,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    bounds: tuple[float, float] = (-np.inf, np.inf),
) -> tuple[float, float]:
    """
    Bootstrap interval over queries of a statistic of the query rows (see
    :func:`shifted_percentile_interval` for the method; it always contains ``statistic(all rows)``).

    :param statistic: Function of an index array of query rows (see :func:`evaluate_resamples`).
    :param n_query: Number of queries.
    :param n_bootstrap: Number of resamples.
    :param confidence: Coverage of the interval, in (0, 1).
    :param seed: Seed of the resampling generator.
    :param bounds: Range of the statistic.
    :return: (low, high); (NaN, NaN) with fewer than two queries or no finite resample.
    """
    check_confidence(confidence)
    rows = resample_rows(n_query, n_bootstrap, seed)
    if n_query < 2:
        return float("nan"), float("nan")
    point = float(statistic(np.arange(n_query)))
    return shifted_percentile_interval(point, evaluate_resamples(statistic, rows), confidence, bounds)


def hierarchical_replicates(draws: np.ndarray, n_bootstrap: int = 1000, seed: int = 0) -> np.ndarray:
    """
    Two-level bootstrap replicates of the mean of a statistic over independent runs (training seeds): each
    replicate draws the runs with replacement and, for every drawn run, one of that run's own bootstrap
    replicates over queries (independently each time a run is drawn twice), and averages them.

    :param draws: Each run's bootstrap replicates over queries, ``(R, B)`` (``NaN`` allowed).
    :param n_bootstrap: Number of two-level replicates.
    :param seed: Seed of the resampling.
    :return: ``(n_bootstrap,)`` replicates of the mean over runs.
    """
    draws = np.asarray(draws, dtype=np.float64)
    if draws.ndim != 2 or draws.shape[0] == 0 or draws.shape[1] == 0:
        raise ValueError(f"draws must hold one row of replicates per run, got shape {draws.shape}")
    rng = np.random.default_rng(seed)
    runs = rng.integers(0, draws.shape[0], (int(n_bootstrap), draws.shape[0]))
    picked = draws[runs, rng.integers(0, draws.shape[1], runs.shape)]
    finite = np.isfinite(picked)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(finite, picked, 0.0).sum(axis=1) / np.where(finite.any(axis=1), finite.sum(axis=1), np.nan)


def hierarchical_interval(
    points: np.ndarray,
    draws: list[np.ndarray] | np.ndarray,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    bounds: tuple[float, float] = (-np.inf, np.inf),
) -> tuple[float, tuple[float, float]]:
    """
    Mean of a statistic over independent runs (training seeds) with a two-level bootstrap interval
    (:func:`hierarchical_replicates`): it includes both the run-to-run spread and each run's query-sampling
    noise, and is a :func:`shifted_percentile_interval` around the mean of the runs' point estimates.

    :param points: The statistic of each run (R,).
    :param draws: Each run's bootstrap replicates over queries, ``(R, B)`` (``NaN`` allowed).
    :param n_bootstrap: Number of two-level replicates.
    :param confidence: Coverage.
    :param seed: Seed of the resampling.
    :param bounds: Range of the statistic.
    :return: ``(mean, (low, high))``; with one run only the query level remains.
    """
    points = np.asarray(points, dtype=np.float64)
    draws = np.asarray(draws, dtype=np.float64)
    if draws.ndim != 2 or draws.shape[0] != points.size or points.size == 0:
        raise ValueError(f"draws must have one row of replicates per run ({points.size}), got shape {draws.shape}")
    keep = np.isfinite(points)
    if not keep.any():
        return float("nan"), (float("nan"), float("nan"))
    mean = float(points[keep].mean())
    pooled = hierarchical_replicates(draws[keep], n_bootstrap, seed)
    return mean, shifted_percentile_interval(mean, pooled, confidence, bounds)


def _batched(batch: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], float]:
    """A statistic of one resample from its batched form (kept as ``batch``)."""

    def single(rows: np.ndarray) -> float:
        return float(batch(np.asarray(rows)[None, :])[0])

    single.batch = batch  # type: ignore[attr-defined]
    return single


def check_confidence(confidence: float) -> float:
    """
    :param confidence: Coverage of an interval.
    :return: ``confidence`` unchanged.
    :raises ValueError: Unless it lies in (0, 1).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return confidence
