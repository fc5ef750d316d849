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
  the estimate). With a single query the interval is undefined (``NaN``). The package does its own
  resampling rather than :func:`scipy.stats.bootstrap` (``method="percentile"``), which on the same draws gives the same
  plain percentile interval but resamples one statistic at a time with its own draws, so it cannot pair all
  statistics (and a control) on the same resamples, evaluate them in batches, take replicates made
  elsewhere (the two-level bootstrap over runs) or shift the interval onto the estimate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import norm, spearmanr

from art_malleability._bootstrap import (
    _batched,
    bootstrap_interval,
    check_confidence,
    evaluate_resamples,
    hierarchical_interval,
    hierarchical_replicates,
    percentile_interval,
    resample_rows,
    shifted_percentile_interval,
)
from art_malleability._resampled import _nanmean_rows, _ResampledAggregates, _ResampledSpearman
from art_malleability._scores import (
    RANK_BY,
    _as_matrix,
    _mean_and_error,
    _pair,
    _pair_and_top,
    aggregate_scores,
    flip_mask,
    top_indices,
    top_k_count,
)
from art_malleability._scores import _top_masks as _top_masks  # the batched top sets, kept reachable here

__all__ = [
    "RANK_BY",
    "top_k_count",
    "aggregate_scores",
    "top_indices",
    "flip_mask",
    "flip_rate",
    "per_query_flip_rates",
    "spearman",
    "top_k_jaccard",
    "z_value",
    "noise_thresholds",
    "flip_rate_above_floor",
    "counted_flips",
    "resample_rows",
    "evaluate_resamples",
    "percentile_interval",
    "shifted_percentile_interval",
    "bootstrap_interval",
    "hierarchical_replicates",
    "hierarchical_interval",
    "BOUNDS",
    "malleability_metrics",
]

logger = logging.getLogger(__name__)


def flip_rate(
    before: ArrayLike, after: ArrayLike, top_fraction: float = 0.1, rank_by: str = "abs", top: ArrayLike | None = None
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
    before, after, top, _ = _pair_and_top(before, after, top_fraction, rank_by, top)
    return _aggregate_flip_rate(aggregate_scores(before), aggregate_scores(after), top)


def per_query_flip_rates(
    before: ArrayLike, after: ArrayLike, top_fraction: float = 0.1, rank_by: str = "abs"
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


def spearman(before: ArrayLike, after: ArrayLike) -> float:
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
    before: ArrayLike, after: ArrayLike, top_fraction: float = 0.1, rank_by: str = "abs", top: ArrayLike | None = None
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
    before, after, top, k = _pair_and_top(before, after, top_fraction, rank_by, top)
    return _aggregate_jaccard(aggregate_scores(after), top, k, rank_by)


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
    check_confidence(confidence)
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
    before: ArrayLike,
    after: ArrayLike,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    top: ArrayLike | None = None,
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
    before, after, top, _ = _pair_and_top(before, after, top_fraction, rank_by, top)
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
    before: ArrayLike,
    after: ArrayLike,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    top: ArrayLike | None = None,
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
    before, after, top, k = _pair_and_top(before, after, top_fraction, rank_by, top)
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
        n_control = len(control.get("draws", {}).get("flip_rate", ()))
        if n_control != len(draws["flip_rate"]):
            raise ValueError(
                f"control must hold {len(draws['flip_rate'])} flip-rate replicates, got {n_control}; compute it "
                "by malleability_metrics with keep_draws=True and the same n_bootstrap"
            )
        result["excess_flip_rate"] = result["flip_rate"] - control["flip_rate"]
        draws["excess_flip_rate"] = draws["flip_rate"] - control["draws"]["flip_rate"]
    for name, values in draws.items():
        result[name + "_ci"] = shifted_percentile_interval(result[name], values, confidence, BOUNDS[name])
    result["counted_flips"] = aggregates.counted_flips()
    if keep_draws:
        result["draws"] = draws
    return result
