"""
Building blocks of the malleability metrics on influence matrices ``(n_query, n_train)`` (positive =
helpful, ``NaN`` = excluded pair): the influential set's size and ranking, aggregate scores over queries,
sign flips, and weighted column means. The definitions are
those of :mod:`art_malleability.metrics`, which exports the public names.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from art_malleability._utils.params import RANK_BY as RANK_BY_RULE
from art_malleability._utils.params import RANK_BY_NAMES as RANK_BY  # noqa: F401 - the metrics' public name
from art_malleability._utils.params import TOP_FRACTION


def top_k_count(n_train: int, top_fraction: float) -> int:
    """
    Size of the influential set: ``floor(top_fraction * n_train)``.

    :param n_train: Number of training examples.
    :param top_fraction: Share of training examples in the set, in (0, 1].
    :return: Number of examples in the set (0 when the share selects none).
    :raises InvalidParameterError: For a share outside (0, 1] (the rule ``TOP_FRACTION``).
    """
    TOP_FRACTION(top_fraction, "top_fraction")
    return int(math.floor(top_fraction * n_train + 1e-9))


def smallest_training_set(top_fraction: float) -> int:
    """
    The fewest training examples whose influential set is not empty (:func:`top_k_count` at least 1).

    :param top_fraction: Share of training examples in the set, in (0, 1].
    :return: Training examples.
    """
    TOP_FRACTION(top_fraction, "top_fraction")
    return max(1, math.ceil((1.0 - 1e-9) / top_fraction))


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
    RANK_BY_RULE(rank_by, "rank_by")
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


def _as_matrix(scores: np.ndarray, name: str) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim == 1:
        scores = scores[None, :]
    if scores.ndim != 2:
        raise ValueError(f"{name} must be an influence matrix of shape (n_query, n_train), got shape {scores.shape}")
    return scores


def _pair(before: np.ndarray, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    before, after = _as_matrix(before, "before"), _as_matrix(after, "after")
    if before.shape != after.shape:
        raise ValueError(f"before and after must have the same shape, got {before.shape} and {after.shape}")
    return before, after


def _pair_and_top(
    before: ArrayLike, after: ArrayLike, top_fraction: float, rank_by: str, top: ArrayLike | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """
    :return: ``(before, after, top, k)``: the checked pair of influence matrices, the influential set (``top``
             as given, else the clean aggregate ranking's first ``k``) and its nominal size ``k``.
    """
    before, after = _pair(before, after)
    k = top_k_count(before.shape[1], top_fraction)
    top = top_indices(aggregate_scores(before), k, rank_by) if top is None else np.asarray(top, dtype=int)
    return before, after, top, k
