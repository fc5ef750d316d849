"""
Malleability metrics on influence matrices (numpy; large matrix products through torch).

Every function takes influence matrices of shape ``(n_query, n_train)`` with the package's sign
convention (**positive = helpful**: removing the training example would raise the query's loss).
``NaN`` entries mark excluded pairs (a query that is itself a training example is never scored
against itself) and are ignored everywhere.

Definitions (the paper leaves them open; these are this package's choices):

* **Top set.** ``k = floor(top_fraction * n_train)`` training examples ranked by ``|score|``
  (``rank_by="abs"``, default) or by signed score (``rank_by="signed"``, most helpful first).
  Ties are broken by the lower training index; ``NaN`` ranks last. ``k = 0`` gives ``NaN`` metrics.
* **Aggregate ranking** (default): a training example's score is the mean of its column over the
  queries, the top set is taken from the clean scores, and the **flip rate** is the share of the
  top set whose aggregate score has strictly opposite sign after the perturbation
  (``sign(before) * sign(after) < 0``; a score that becomes exactly 0 is not a flip).
* **Per-query ranking**: the same computed within each query row, averaged over queries.
* **Spearman**: rank correlation of all finite (query, train) scores before and after.
* **Top-k overlap**: Jaccard index of the clean and perturbed aggregate top sets.
* **Flip rate above the noise floor**: the flip rate counting only sign changes between aggregate
  scores distinguishable from zero: both the clean and the perturbed score exceed
  ``z · sqrt(SE² + noise²)`` (``SE``: standard error of the mean over queries; ``noise``: the
  estimator's own randomness, a projection's; ``z``: the normal quantile of the confidence). See
  :func:`noise_thresholds`.
* **Intervals**: bootstrap over queries (rows resampled with replacement, every statistic
  recomputed by the same function that gives its point estimate, all statistics on the same
  resamples) *conditional on the influential set*: the top set is chosen once from all clean scores
  (it is the set an audit perturbs) and held fixed in every resample; only the aggregate scores, and
  the perturbed top set of the overlap, are recomputed. Re-selecting the set per resample would mix
  in examples that were never perturbed. The interval is the percentile interval moved so that the
  replicates' median sits on the estimate (:func:`shifted_percentile_interval`: it always contains
  the estimate). With a single query the interval is undefined (``NaN``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.stats import norm, spearmanr

logger = logging.getLogger(__name__)

RANK_BY = ("abs", "signed")


def top_k_count(n_train: int, top_fraction: float) -> int:
    """
    Size of the influential set: ``floor(top_fraction * n_train)``.

    :param n_train: Number of training examples.
    :param top_fraction: Share of training examples in the set, in (0, 1].
    :return: Number of examples in the set (0 when the share selects none).
    """
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction must lie in (0, 1], got {top_fraction!r}")
    return int(math.floor(top_fraction * n_train + 1e-9))


def aggregate_scores(scores: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """
    Mean influence of each training example over the queries, ignoring ``NaN`` (excluded pairs).

    :param scores: Influence matrix (n_query, n_train), positive = helpful.
    :param weights: Optional multiplicity of each query row (a bootstrap resample); default one each.
    :return: Vector (n_train,); ``NaN`` where a column has no finite entry of positive weight.
    """
    scores = _as_matrix(scores, "scores")
    weights = np.ones(scores.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    finite = np.isfinite(scores)
    counts = weights @ finite
    sums = weights @ np.where(finite, scores, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.nan)


def top_indices(values: np.ndarray, k: int, rank_by: str = "abs") -> np.ndarray:
    """
    Indices of the ``k`` most influential entries, most influential first.

    :param values: Scores (n,), positive = helpful.
    :param k: How many to return (at most the number of finite scores).
    :param rank_by: ``"abs"`` ranks by magnitude, ``"signed"`` by signed score (most helpful first).
    :return: Integer indices; ties go to the lower index, ``NaN`` never selected.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    values = np.asarray(values, dtype=np.float64)
    key = np.abs(values) if rank_by == "abs" else values.copy()
    finite = np.isfinite(key)
    key[~finite] = -np.inf
    order = np.argsort(-key, kind="stable")
    return order[: min(int(k), int(finite.sum()))]


def flip_mask(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """
    Whether each score changed sign strictly (helpful <-> harmful).

    :param before: Clean scores.
    :param after: Scores after perturbation, same shape.
    :return: Boolean array; zeros and ``NaN`` never count as a flip.
    """
    before = np.asarray(before, dtype=np.float64)
    after = np.asarray(after, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.sign(before) * np.sign(after) < 0


def flip_rate(
    before: np.ndarray,
    after: np.ndarray,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    top: np.ndarray | None = None,
) -> float:
    """
    Influence flip rate with aggregate ranking over queries.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param top: Optional fixed influential set (training indices); default: chosen from ``before``.
    :return: Share of the clean top set whose aggregate score flips sign; ``NaN`` when the set is empty.
    """
    before, after = _pair(before, after)
    agg_before = aggregate_scores(before)
    if top is None:
        top = top_indices(agg_before, top_k_count(before.shape[1], top_fraction), rank_by)
    return _aggregate_flip_rate(agg_before, aggregate_scores(after), np.asarray(top, dtype=int))


def per_query_flip_rates(
    before: np.ndarray, after: np.ndarray, top_fraction: float = 0.1, rank_by: str = "abs"
) -> np.ndarray:
    """
    Flip rate within each query: top set ranked on that query's own clean scores.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of (finite) training scores in each query's influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :return: Vector (n_query,); ``NaN`` for a query whose set is empty.
    """
    before, after = _pair(before, after)
    rates = np.full(before.shape[0], np.nan)
    for q in range(before.shape[0]):
        k = top_k_count(int(np.isfinite(before[q]).sum()), top_fraction)
        top = top_indices(before[q], k, rank_by)
        if top.size:
            rates[q] = flip_mask(before[q, top], after[q, top]).mean()
    return rates


def spearman(before: np.ndarray, after: np.ndarray) -> float:
    """
    Spearman rank correlation of all finite score pairs.

    :param before: Clean influence matrix (n_query, n_train).
    :param after: Influence matrix after perturbation, same shape.
    :return: Correlation in [-1, 1]; ``NaN`` with fewer than two pairs or a constant side.
    """
    before, after = _pair(before, after)
    keep = np.isfinite(before) & np.isfinite(after)
    a, b = before[keep], after[keep]
    if a.size < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(spearmanr(a, b).statistic)


def top_k_jaccard(
    before: np.ndarray,
    after: np.ndarray,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    top: np.ndarray | None = None,
) -> float:
    """
    Jaccard overlap of the clean and perturbed aggregate top sets.

    :param before: Clean influence matrix (n_query, n_train).
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in each set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param top: Optional fixed clean set (training indices); default: chosen from ``before``.
    :return: ``|A ∩ B| / |A ∪ B|`` in [0, 1]; ``NaN`` when both sets are empty.
    """
    before, after = _pair(before, after)
    k = top_k_count(before.shape[1], top_fraction)
    if top is None:
        top = top_indices(aggregate_scores(before), k, rank_by)
    return _aggregate_jaccard(aggregate_scores(after), np.asarray(top, dtype=int), k, rank_by)


def _aggregate_flip_rate(agg_before: np.ndarray, agg_after: np.ndarray, top: np.ndarray) -> float:
    if top.size == 0:
        return float("nan")
    return float(flip_mask(agg_before[top], agg_after[top]).mean())


def _aggregate_jaccard(agg_after: np.ndarray, top: np.ndarray, k: int, rank_by: str) -> float:
    set_a = set(top.tolist())
    set_b = set(top_indices(agg_after, k, rank_by).tolist())
    union = set_a | set_b
    return float(len(set_a & set_b) / len(union)) if union else float("nan")


def z_value(confidence: float) -> float:
    """:return: The two-sided normal quantile of a coverage, ``Φ⁻¹(1/2 + confidence/2)`` (1.96 at 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    return float(norm.ppf(0.5 + confidence / 2.0))


def noise_thresholds(scores: np.ndarray, noise: float = 0.0, confidence: float = 0.95) -> np.ndarray:
    """
    The noise floor of each aggregate score: ``z · sqrt(SE² + noise²)``, with ``SE`` the standard error
    of the column's mean over the queries (sample standard deviation of its finite entries over the
    square root of their number), ``noise`` the standard deviation of the estimator's own randomness
    (a projection's; 0 for a deterministic estimator) and ``z`` the two-sided normal quantile of
    ``confidence``. A score whose magnitude does not exceed its threshold is indistinguishable from
    zero: its sign is not determined by these queries and this estimator. A column with fewer than two
    finite entries has an infinite threshold.

    :param scores: Influence matrix (n_query, n_train), positive = helpful.
    :param noise: Standard deviation of the estimator's randomness in one aggregate score (>= 0).
    :param confidence: Coverage defining ``z``.
    :return: Thresholds (n_train,).
    """
    scores = _as_matrix(scores, "scores")
    if not np.isfinite(noise) or noise < 0:
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    finite = np.isfinite(scores)
    filled = np.where(finite, scores, 0.0)
    _, se = _mean_and_error(finite.sum(axis=0), filled.sum(axis=0), (filled**2).sum(axis=0))
    return z_value(confidence) * np.sqrt(se**2 + float(noise) ** 2)


def flip_rate_above_floor(
    before: np.ndarray,
    after: np.ndarray,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    top: np.ndarray | None = None,
    noise: float = 0.0,
    confidence: float = 0.95,
) -> float:
    """
    Flip rate counting only sign changes between scores distinguishable from zero: an example of the
    clean top set counts when its aggregate score changes sign and both the clean and the perturbed
    score exceed their :func:`noise_thresholds`. The denominator stays the whole top set, so this rate
    never exceeds :func:`flip_rate`.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param top: Optional fixed influential set; default: chosen from ``before``.
    :param noise: Standard deviation of the estimator's randomness in one aggregate score.
    :param confidence: Coverage defining the thresholds' ``z``.
    :return: Share of the top set; ``NaN`` when the set is empty.
    """
    before, after = _pair(before, after)
    if top is None:
        top = top_indices(aggregate_scores(before), top_k_count(before.shape[1], top_fraction), rank_by)
    top = np.asarray(top, dtype=int)
    if top.size == 0:
        return float("nan")
    counted = counted_flips(before, after, top, noise, confidence)
    return float(len(counted) / top.size)


def counted_flips(
    before: np.ndarray, after: np.ndarray, top: np.ndarray, noise: float = 0.0, confidence: float = 0.95
) -> np.ndarray:
    """
    :param before: Clean influence matrix (n_query, n_train).
    :param after: Influence matrix after perturbation.
    :param top: The influential set (training indices).
    :param noise: Standard deviation of the estimator's randomness in one aggregate score.
    :param confidence: Coverage defining the thresholds' ``z``.
    :return: The members of ``top`` whose aggregate score flips sign above the noise floor (see
             :func:`flip_rate_above_floor`).
    """
    top = np.asarray(top, dtype=int)
    agg_b, agg_a = aggregate_scores(before)[top], aggregate_scores(after)[top]
    thr_b = noise_thresholds(before[:, top], noise, confidence)
    thr_a = noise_thresholds(after[:, top], noise, confidence)
    return top[flip_mask(agg_b, agg_a) & (np.abs(agg_b) > thr_b) & (np.abs(agg_a) > thr_a)]


# ------------------------------------------------------------------------------------------ intervals


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
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
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
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
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
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
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
        raise ValueError(
            f"draws must have one row of replicates per run ({points.size}), got shape {draws.shape}"
        )
    keep = np.isfinite(points)
    if not keep.any():
        return float("nan"), (float("nan"), float("nan"))
    mean = float(points[keep].mean())
    pooled = hierarchical_replicates(draws[keep], n_bootstrap, seed)
    return mean, shifted_percentile_interval(mean, pooled, confidence, bounds)


#: Range of each reported statistic (intervals are clipped to it).
BOUNDS = {
    "flip_rate": (0.0, 1.0),
    "flip_rate_above_floor": (0.0, 1.0),
    "per_query_flip_rate": (0.0, 1.0),
    "spearman": (-1.0, 1.0),
    "top_k_jaccard": (0.0, 1.0),
    "excess_flip_rate": (-1.0, 1.0),
}


def malleability_metrics(
    before: np.ndarray,
    after: np.ndarray,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    top: np.ndarray | None = None,
    noise: float = 0.0,
    control: dict[str, Any] | None = None,
    keep_draws: bool = False,
) -> dict[str, Any]:
    """
    All malleability metrics of one clean/perturbed pair of influence matrices, with bootstrap intervals
    over queries conditional on the influential set. Every statistic is evaluated on the same resamples
    (:func:`resample_rows` with ``seed``), each interval is a :func:`shifted_percentile_interval` and
    contains its point estimate.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param n_bootstrap: Bootstrap resamples over queries.
    :param confidence: Interval coverage.
    :param seed: Seed of the resampling.
    :param top: Optional fixed influential set (the perturbed one); default: chosen from all of ``before``.
    :param noise: Standard deviation of the estimator's randomness in one aggregate score (see
                  :func:`noise_thresholds`).
    :param control: The metrics of a control perturbation of the same set, computed by this function with
                    the same ``before``, ``seed`` and ``n_bootstrap`` and ``keep_draws=True``; adds the
                    ``excess_flip_rate`` (this flip rate minus the control's) with a paired interval.
    :param keep_draws: Also return the replicates of every statistic under ``"draws"`` (for pooling runs
                       with :func:`hierarchical_interval`, or as a ``control``).
    :return: Dict with ``flip_rate``, ``flip_rate_above_floor``, ``per_query_flip_rate``, ``spearman``,
             ``top_k_jaccard`` (and ``excess_flip_rate`` with a control), each one's ``*_ci`` interval, and
             ``counted_flips`` (members of the top set that flip above the noise floor).
    """
    before, after = _pair(before, after)
    k = top_k_count(before.shape[1], top_fraction)
    top = top_indices(aggregate_scores(before), k, rank_by) if top is None else np.asarray(top, dtype=int)
    per_query = per_query_flip_rates(before, after, top_fraction, rank_by)
    aggregates = _ResampledAggregates(before, after, top, k, rank_by, z_value(confidence), noise)
    statistics: dict[str, Callable[[np.ndarray], float]] = {
        "flip_rate": aggregates.statistic("flip_rate"),
        "flip_rate_above_floor": aggregates.statistic("flip_rate_above_floor"),
        "per_query_flip_rate": _batched(lambda rows: _nanmean_rows(per_query[np.atleast_2d(rows)])),
        "spearman": _ResampledSpearman(before, after),
        "top_k_jaccard": aggregates.statistic("top_k_jaccard"),
    }
    n_query = before.shape[0]
    everything = np.arange(n_query)
    rows = resample_rows(n_query, n_bootstrap, seed) if n_query >= 2 else None
    result: dict[str, Any] = {}
    draws: dict[str, np.ndarray] = {}
    for name, statistic in statistics.items():
        result[name] = float(statistic(everything))
        draws[name] = evaluate_resamples(statistic, rows) if rows is not None else np.full(0, np.nan)
    if control is not None:
        if len(control.get("draws", {}).get("flip_rate", ())) != len(draws["flip_rate"]):
            raise ValueError(
                "control must come from malleability_metrics with keep_draws=True and the same n_bootstrap"
            )
        result["excess_flip_rate"] = result["flip_rate"] - control["flip_rate"]
        draws["excess_flip_rate"] = draws["flip_rate"] - control["draws"]["flip_rate"]
    for name, values in draws.items():
        result[name + "_ci"] = shifted_percentile_interval(result[name], values, confidence, BOUNDS[name])
    result["counted_flips"] = aggregates.counted_flips()
    if keep_draws:
        result["draws"] = draws
    return result


def _batched(batch: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], float]:
    """A statistic of one resample from its batched form (kept as ``batch``)."""

    def single(rows: np.ndarray) -> float:
        return float(batch(np.asarray(rows)[None, :])[0])

    single.batch = batch  # type: ignore[attr-defined]
    return single


def _nanmean_rows(values: np.ndarray) -> np.ndarray:
    finite = np.isfinite(values)
    counts = finite.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, np.where(finite, values, 0.0).sum(axis=1) / np.maximum(counts, 1), np.nan)


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product through torch (numpy's BLAS competes with torch's threads for the same cores)."""
    return (torch.from_numpy(np.ascontiguousarray(a)) @ torch.from_numpy(np.ascontiguousarray(b))).numpy()


def _weights(rows: np.ndarray, n_query: int) -> np.ndarray:
    """Multiplicity of every query in each resample: ``(B, n_query)`` from ``(B, n_query)`` row indices."""
    rows = np.atleast_2d(rows)
    counts = np.zeros((rows.shape[0], n_query))
    np.add.at(counts, (np.arange(rows.shape[0])[:, None], rows), 1.0)
    return counts


def _mean_and_error(counts: np.ndarray, sums: np.ndarray, squares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """
    Means and standard errors of columns from their (weighted) counts, sums and sums of squares: ``NaN``
    mean without data, infinite error with fewer than two values.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, sums / np.where(counts > 0, counts, 1.0), np.nan)
        spread = np.maximum(squares - counts * np.nan_to_num(mean) ** 2, 0.0)
        variance = spread / np.where(counts > 1, counts - 1.0, 1.0)
        error = np.where(counts > 1, np.sqrt(variance / np.where(counts > 0, counts, 1.0)), np.inf)
    return mean, error


def _top_masks(values: np.ndarray, k: int, rank_by: str) -> np.ndarray:
    """
    Membership masks ``(B, n)`` of :func:`top_indices` of every row of ``values`` (same sets: the
    ``k`` largest keys, ties to the lower index, ``NaN`` never), in ``O(n)`` per row.
    """
    key = np.abs(values) if rank_by == "abs" else values.copy()
    key[~np.isfinite(key)] = -np.inf
    b, n = key.shape
    counts = np.minimum(k, np.isfinite(values).sum(axis=1))
    mask = np.zeros((b, n), dtype=bool)
    for i in np.flatnonzero(counts > 0):
        c = int(counts[i])
        threshold = np.partition(key[i], n - c)[n - c]
        above = key[i] > threshold
        equal = np.flatnonzero(key[i] == threshold)[: c - int(above.sum())]
        mask[i] = above
        mask[i, equal] = True
    return mask


class _ResampledAggregates:
    """
    The aggregate flip rates and top-k Jaccard of resamples of query rows, many resamples at once:
    a resample's aggregate scores are ``(W @ S) / (W @ F)`` with ``W`` its query multiplicities, ``S``
    the scores with ``NaN`` set to 0 and ``F`` the finite mask; their standard errors add ``W @ S²``.
    The flip rates need the top set's columns only; the overlap needs every perturbed column.
    """

    def __init__(
        self, before: np.ndarray, after: np.ndarray, top: np.ndarray, k: int, rank_by: str, z: float, noise: float
    ) -> None:
        self.n_query = before.shape[0]
        self.top, self.k, self.rank_by = np.asarray(top, dtype=int), k, rank_by
        self.z, self.noise = float(z), float(noise)
        self.top_sides = [self._side(scores[:, self.top]) for scores in (before, after)]
        self.after = self._side(after, squares=False)
        self.batch_rows = max(1, 2**24 // max(before.shape[1], 1))

    @staticmethod
    def _side(scores: np.ndarray, squares: bool = True) -> tuple[np.ndarray, ...]:
        finite = np.isfinite(scores)
        filled = np.where(finite, scores, 0.0)
        return (finite.astype(np.float64), filled) + ((filled**2,) if squares else ())

    def _top_scores(self, weights: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
        finite, filled, squares = self.top_sides[side]
        return _mean_and_error(_mm(weights, finite), _mm(weights, filled), _mm(weights, squares))

    def _flips(self, weights: np.ndarray, floor: bool) -> np.ndarray:
        (before, se_b), (after, se_a) = self._top_scores(weights, 0), self._top_scores(weights, 1)
        flips = flip_mask(before, after)
        if floor:
            with np.errstate(invalid="ignore"):
                flips &= np.abs(before) > self.z * np.sqrt(se_b**2 + self.noise**2)
                flips &= np.abs(after) > self.z * np.sqrt(se_a**2 + self.noise**2)
        return flips

    def flip_rate(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        if self.top.size == 0:
            return np.full(len(weights), np.nan)
        return self._flips(weights, False).mean(axis=1)

    def flip_rate_above_floor(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        if self.top.size == 0:
            return np.full(len(weights), np.nan)
        return self._flips(weights, True).mean(axis=1)

    def counted_flips(self) -> list[int]:
        """:return: Members of the top set whose aggregate score flips above the noise floor (all queries)."""
        if self.top.size == 0:
            return []
        return self.top[self._flips(np.ones((1, self.n_query)), True)[0]].tolist()

    def top_k_jaccard(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        finite, filled = self.after
        after, _ = _mean_and_error(_mm(weights, finite), _mm(weights, filled), np.zeros(1))
        mask = _top_masks(after, self.k, self.rank_by)
        both = mask[:, self.top].sum(axis=1)
        union = self.top.size + mask.sum(axis=1) - both
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(union > 0, both / np.where(union > 0, union, 1), np.nan)

    def statistic(self, name: str) -> Callable[[np.ndarray], float]:
        """A bootstrap statistic (a function of one resample, with the batched form as ``batch``)."""
        single = _batched(getattr(self, name))
        single.batch_rows = self.batch_rows  # type: ignore[attr-defined]
        return single


class _ResampledSpearman:
    """
    Spearman correlation of resamples of query rows, exact, in ``O(n_q³)`` per resample.

    A resample gives every query row ``q`` a multiplicity ``w_q``; the ranks are the tie-averaged
    ranks of the multiset and the correlation is weighted by the multiplicities. The midrank of
    element ``i`` in a resample is ``C_i · w`` plus ``1/2``, where ``C_i[r] = L_i[r] + E_i[r] / 2``
    with ``L_i[r]`` the elements of row ``r`` below ``i``'s value and ``E_i[r]`` those equal to it
    (``i`` itself included). Every sum the correlation needs is then a quadratic or cubic form in
    ``w``: ``Σ_i w_{q(i)} (C^a_i·w)(C^b_i·w) = Σ_q w_q wᵀ T_q w`` with ``T_q = Σ_{i∈q} C^a_i C^b_iᵀ``.
    The ``n_q × n_q × n_q`` tensors are computed once (``O(N n_q)`` counts from one global sort per
    side, and matrix products; ``N`` = finite score pairs: six million at 100 queries and 60,000
    training examples), after which a resample costs ``O(n_q³)`` instead of a sort of ``N`` values.

    Verified against :func:`spearman` on explicitly repeated rows in the tests, with and without ties.
    """

    def __init__(self, before: np.ndarray, after: np.ndarray) -> None:
        keep = np.isfinite(before) & np.isfinite(after)
        self.n_query = before.shape[0]
        self.row = np.nonzero(keep)[0]
        self.size = int(self.row.size)
        self.batch_rows = 1024
        if self.size:
            self._forms(before[keep], after[keep])

    def _counts(self, values: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``C`` (``(m_q, n_query)``) and the element indices of each row ``q`` in turn, from one sort of ``values``."""
        n, size = self.n_query, values.size
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        new_group = np.concatenate([[True], ordered[1:] != ordered[:-1]])
        group = np.cumsum(new_group) - 1
        start = np.flatnonzero(new_group)[group]  # first sorted position of each element's group
        labels = self.row[order]  # query row of each sorted element
        ties = int(group[-1]) + 1 != size
        if ties:  # E_i: elements of every row in i's group
            equal = csr_matrix((np.ones(size), (group, labels)), shape=(int(group[-1]) + 1, n))
        by_row = np.argsort(labels, kind="stable")  # sorted positions of each row's elements, ascending
        bounds = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=n))])
        for q in range(n):
            at = by_row[bounds[q] : bounds[q + 1]]
            m = at.size
            if m == 0:
                yield np.zeros((0, n)), np.zeros(0, dtype=np.int64)
                continue
            # L at the group starts of row q's elements (markers): an element at sorted position p lies
            # before marker j iff at most j markers sit at or before p
            before_marker = np.cumsum(np.bincount(start[at], minlength=size))
            before_marker *= n
            before_marker += labels
            counts = np.bincount(before_marker, minlength=(m + 1) * n).reshape(m + 1, n).astype(np.float64)
            np.cumsum(counts, axis=0, out=counts)
            counts = counts[:-1]
            if ties:
                counts += 0.5 * equal[group[at]].toarray()
            else:
                counts[:, q] += 0.5
            yield counts, order[at]

    def _forms(self, before: np.ndarray, after: np.ndarray) -> None:
        n = self.n_query
        self.m = np.bincount(self.row, minlength=n).astype(np.float64)
        self.s = [np.zeros((n, n)), np.zeros((n, n))]
        self.t = {key: np.zeros((n, n, n)) for key in ("ab", "aa", "bb")}
        for q, ((ca, ia), (cb, ib)) in enumerate(zip(self._counts(before), self._counts(after), strict=True)):
            if not len(ia):
                continue
            ca, cb = ca[np.argsort(ia)], cb[np.argsort(ib)]  # the same element on the same line
            self.s[0][q], self.s[1][q] = ca.sum(axis=0), cb.sum(axis=0)
            self.t["ab"][q], self.t["aa"][q], self.t["bb"][q] = _mm(ca.T, cb), _mm(ca.T, ca), _mm(cb.T, cb)

    def __call__(self, rows: np.ndarray) -> float:
        return float(self.batch(np.asarray(rows)[None, :])[0])

    def batch(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        if self.size == 0:
            return np.full(len(weights), np.nan)
        n = self.n_query
        pairs = (weights[:, :, None] * weights[:, None, :]).reshape(len(weights), n * n)

        def cubic(t: np.ndarray) -> np.ndarray:  # Σ_q w_q wᵀ T_q w, for every resample
            return (_mm(pairs, t.reshape(n, n * n).T) * weights).sum(axis=1)

        total = weights @ self.m
        sum_a = ((weights @ self.s[0]) * weights).sum(axis=1)
        sum_b = ((weights @ self.s[1]) * weights).sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cov = cubic(self.t["ab"]) - sum_a * sum_b / total
            var_a = cubic(self.t["aa"]) - sum_a**2 / total
            var_b = cubic(self.t["bb"]) - sum_b**2 / total
            ok = (total >= 2) & (var_a > 0) & (var_b > 0)
            return np.where(ok, cov / np.sqrt(np.where(ok, var_a * var_b, 1.0)), np.nan)


def _as_matrix(scores: np.ndarray, name: str) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim == 1:
        scores = scores[None, :]
    if scores.ndim != 2:
        raise ValueError(
            f"{name} must be an influence matrix of shape (n_query, n_train), got shape {scores.shape}"
        )
    return scores


def _pair(before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    before, after = _as_matrix(before, "before"), _as_matrix(after, "after")
    if before.shape != after.shape:
        raise ValueError(f"before and after must have the same shape, got {before.shape} and {after.shape}")
    return before, after
