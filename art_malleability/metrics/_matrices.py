"""
The malleability statistics of one clean/perturbed pair of whole influence matrices, one sample each (no interval):
the flip rate with aggregate or per-query ranking, Spearman's correlation and the top-k Jaccard. They are the
definitions of :mod:`art_malleability.metrics`, which exports them; the streamed statistics of an audit
(:mod:`art_malleability.metrics.accumulators`) are tested against them.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import spearmanr

from art_malleability.metrics._scores import _pair, _pair_and_top, aggregate_scores, flip_mask, top_indices, top_k_count


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
    if top.size == 0:
        return float("nan")
    return float(flip_mask(aggregate_scores(before)[top], aggregate_scores(after)[top]).mean())


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
    return aggregate_jaccard(aggregate_scores(after), top, k, rank_by)


def aggregate_jaccard(agg_after: np.ndarray, top: np.ndarray, k: int, rank_by: str) -> float:
    """
    Jaccard overlap of a given clean set and the top set of perturbed aggregate scores.

    :param agg_after: Aggregate score of every training example after the perturbation.
    :param top: The clean set (training indices).
    :param k: Size of the perturbed set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :return: ``|A ∩ B| / |A ∪ B|`` in [0, 1]; ``NaN`` when both sets are empty.
    """
    set_a = set(np.asarray(top).tolist())
    set_b = set(top_indices(agg_after, k, rank_by).tolist())
    union = set_a | set_b
    return float(len(set_a & set_b) / len(union)) if union else float("nan")
