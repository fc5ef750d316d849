"""
Malleability metrics on influence matrices, in numpy alone.

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
* **Intervals**: percentile bootstrap over queries (rows resampled with replacement, every
  statistic recomputed) *conditional on the influential set*: the top set is chosen once from all
  clean scores (it is the set an audit perturbs) and held fixed in every resample; only the
  aggregate scores, and the perturbed top set of the overlap, are recomputed. Re-selecting the set
  per resample would mix in examples that were never perturbed and bias the interval low. With a
  single query the interval is undefined (``NaN``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
from scipy.stats import spearmanr

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


def bootstrap_interval(
    statistic: Callable[[np.ndarray], float],
    n_query: int,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """
    Percentile bootstrap interval of a statistic of the query rows.

    :param statistic: Function of an index array of query rows (drawn with replacement) returning a float.
    :param n_query: Number of queries.
    :param n_bootstrap: Number of resamples.
    :param confidence: Coverage of the interval, in (0, 1).
    :param seed: Seed of the resampling generator.
    :return: (low, high); (NaN, NaN) with fewer than two queries or no finite resample.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    if n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be a positive integer, got {n_bootstrap!r}")
    if n_query < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    draws = np.array([statistic(rng.integers(0, n_query, n_query)) for _ in range(n_bootstrap)])
    draws = draws[np.isfinite(draws)]
    if draws.size == 0:
        return float("nan"), float("nan")
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(draws, [tail, 100.0 - tail])
    return float(low), float(high)


def malleability_metrics(
    before: np.ndarray,
    after: np.ndarray,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    top: np.ndarray | None = None,
) -> dict[str, float | tuple[float, float]]:
    """
    All malleability metrics of one clean/perturbed pair of influence matrices, with bootstrap intervals
    conditional on the influential set.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param n_bootstrap: Bootstrap resamples over queries.
    :param confidence: Interval coverage.
    :param seed: Seed of the resampling.
    :param top: Optional fixed influential set (the perturbed one); default: chosen from all of ``before``.
    :return: Dict with ``flip_rate``, ``per_query_flip_rate``, ``spearman``, ``top_k_jaccard`` and each
             one's ``*_ci`` interval.
    """
    before, after = _pair(before, after)
    per_query = per_query_flip_rates(before, after, top_fraction, rank_by)
    k = top_k_count(before.shape[1], top_fraction)
    top = top_indices(aggregate_scores(before), k, rank_by) if top is None else np.asarray(top, dtype=int)
    n_query = before.shape[0]

    def resampled(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        weights = np.bincount(rows, minlength=n_query).astype(np.float64)
        return aggregate_scores(before, weights), aggregate_scores(after, weights)

    statistics: dict[str, Callable[[np.ndarray], float]] = {
        "flip_rate": lambda rows: _aggregate_flip_rate(*resampled(rows), top),
        "per_query_flip_rate": lambda rows: _nanmean(per_query[rows]),
        "spearman": _ResampledSpearman(before, after),
        "top_k_jaccard": lambda rows: _aggregate_jaccard(resampled(rows)[1], top, k, rank_by),
    }
    everything = np.arange(before.shape[0])
    result: dict[str, float | tuple[float, float]] = {}
    for offset, (name, statistic) in enumerate(statistics.items()):
        result[name] = statistic(everything)
        result[name + "_ci"] = bootstrap_interval(
            statistic, before.shape[0], n_bootstrap, confidence, seed + offset
        )
    return result


class _ResampledSpearman:
    """
    Spearman correlation of a resample of query rows, exact and without re-sorting.

    A resample repeats rows; its ranks are the tie-averaged ranks of the multiset, which follow from
    one global sort by cumulative multiplicities (``O(N)`` per resample instead of ``O(N log N)``).
    Verified against :func:`spearman` on explicitly repeated rows in the tests.
    """

    def __init__(self, before: np.ndarray, after: np.ndarray) -> None:
        keep = np.isfinite(before) & np.isfinite(after)
        self.n_query = before.shape[0]
        self.row = np.nonzero(keep)[0]
        self.sides = [self._sorted_groups(before[keep]), self._sorted_groups(after[keep])]

    @staticmethod
    def _sorted_groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        group = np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])]) if values.size else order
        return order, group, int(group[-1]) + 1 if values.size else 0

    def __call__(self, rows: np.ndarray) -> float:
        weight = np.bincount(rows, minlength=self.n_query)[self.row].astype(np.float64)
        ranks = []
        for order, group, n_groups in self.sides:
            sorted_weight = weight[order]
            if n_groups == weight.size:  # no ties: each value is its own group
                midrank = np.cumsum(sorted_weight) - (sorted_weight - 1.0) / 2.0
            else:
                group_weight = np.bincount(group, weights=sorted_weight, minlength=n_groups)
                midrank = (np.cumsum(group_weight) - (group_weight - 1.0) / 2.0)[group]
            rank = np.empty_like(weight)
            rank[order] = midrank
            ranks.append(rank)
        total = weight.sum()
        if total < 2:
            return float("nan")
        centred = [r - (weight * r).sum() / total for r in ranks]
        cov = (weight * centred[0] * centred[1]).sum()
        var_a, var_b = (weight * centred[0] ** 2).sum(), (weight * centred[1] ** 2).sum()
        if var_a <= 0 or var_b <= 0:
            return float("nan")
        return float(cov / np.sqrt(var_a * var_b))


def _nanmean(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else float("nan")


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
