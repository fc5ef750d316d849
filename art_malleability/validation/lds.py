"""
The linear datamodeling score (LDS; Park et al., 2023, "TRAK") and leave-one-out sign agreement: the metrics of
:func:`art_malleability.validation.validate`, computed from influence scores, subset masks and measured outcomes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import binomtest, rankdata
from torch import nn

from art_malleability._utils.params import one_of
from art_malleability.metrics import percentile_interval

#: Measured outcome of the retrained models: the query's loss or its margin.
OUTCOMES = ("loss", "margin")
#: The rule of ``outcome`` (:func:`linear_datamodeling_score` and :func:`~art_malleability.validation.validate`).
OUTCOME = one_of(OUTCOMES)

#: ``train_fn(x_subset, y_subset, seed) -> trained model``; see :func:`validate`.
TrainFn = Callable[[np.ndarray, np.ndarray, int], nn.Module]


@dataclass
class LDSResult:
    """
    Linear datamodeling score of one influence matrix.

    :param per_query: LDS of each query (``NaN`` where undefined: constant predictions or outcomes).
    :param mean: Mean over the queries where it is defined (``NaN`` when none is).
    :param ci: Percentile interval of a two-way bootstrap over the subset models and the queries
        (:func:`lds_interval`).
    :param n_defined: Number of queries with a defined LDS.
    """

    per_query: np.ndarray
    mean: float
    ci: tuple[float, float]
    n_defined: int


def subset_sums(scores: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """
    Influence summed over each subset: the linear datamodel's prediction (up to a constant).

    :param scores: Influence ``(n_query, n_train)``, positive = helpful.
    :param masks: Subset membership ``(n_models, n_train)``, boolean.
    :return: ``(n_models, n_query)`` array of ``Σ_{i∈S_m} τ(q, i)``.
    """
    return masks.astype(np.float64) @ np.asarray(scores, dtype=np.float64).T


def _column_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each column of ``a`` with the same column of ``b`` (``NaN`` if one is constant)."""
    ra = rankdata(a, axis=0)
    rb = rankdata(b, axis=0)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    denom = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = (ra * rb).sum(axis=0) / denom
    rho[denom == 0] = np.nan
    return np.clip(rho, -1.0, 1.0)


def linear_datamodeling_score(
    scores: np.ndarray, masks: np.ndarray, outcomes: np.ndarray, *, outcome: str = "loss", n_bootstrap: int = 1000,
    confidence: float = 0.95, seed: int = 0,
) -> LDSResult:
    """
    Linear datamodeling score (TRAK's LDS) of an influence matrix against measured retraining outcomes.

    For each query ``q``: the Spearman correlation across the ``M`` subsets between the predicted
    ``Σ_{i∈S_m} τ(q, i)`` and the measured utility, ``−outcomes[m, q]`` for ``outcome="loss"`` (a
    helpful set lowers the loss) or ``outcomes[m, q]`` for ``outcome="margin"``. Higher is better. With
    ``outcome="loss"`` this equals dattri's ``dattri.metric.lds(scores.T, (−outcomes, subset_indices))``.

    :param scores: Influence ``(n_query, n_train)``, **positive = helpful** (removing the example would
        raise the query's loss).
    :param masks: Boolean subset membership ``(n_models, n_train)``, ``n_models >= 2``.
    :param outcomes: Measured outcomes ``(n_models, n_query)`` of the model trained on each subset.
    :param outcome: ``"loss"`` (lower is better) or ``"margin"`` (higher is better).
    :param n_bootstrap: Bootstrap resamples of the queries for the interval.
    :param confidence: Coverage of the interval.
    :param seed: Seed of the bootstrap.
    :return: Per-query LDS, their mean and its bootstrap interval.
    :raises ValueError: On mismatched shapes or an unknown ``outcome``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    masks = np.asarray(masks)
    outcomes = np.asarray(outcomes, dtype=np.float64)
    OUTCOME(outcome, "outcome")
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape (n_query, n_train), got {scores.shape}")
    if masks.ndim != 2 or masks.dtype != bool or masks.shape[1] != scores.shape[1]:
        raise ValueError(
            f"masks must be a boolean array of shape (n_models, {scores.shape[1]}), got {masks.dtype} {masks.shape}"
        )
    if masks.shape[0] < 2:
        raise ValueError(f"masks must describe at least 2 subsets (n_models >= 2), got {masks.shape[0]}")
    if outcomes.shape != (masks.shape[0], scores.shape[0]):
        raise ValueError(
            f"outcomes must have shape (n_models, n_query) = {(masks.shape[0], scores.shape[0])}, got {outcomes.shape}"
        )
    utility = -outcomes if outcome == "loss" else outcomes
    predicted = subset_sums(scores, masks)
    per_query = _column_spearman(predicted, utility)
    defined = per_query[np.isfinite(per_query)]
    mean = float(defined.mean()) if defined.size else float("nan")
    ci = lds_interval(predicted, utility, n_bootstrap, confidence, seed)
    return LDSResult(per_query=per_query, mean=mean, ci=ci, n_defined=int(defined.size))


def lds_interval(
    predicted: np.ndarray, utility: np.ndarray, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """
    Interval of the LDS by a two-way bootstrap: every resample draws the subset models and the queries with
    replacement, independently, and recomputes each drawn query's Spearman correlation over the drawn models. The
    LDS has two sources of sampling noise, the queries and the subset models that every query shares; resampling
    queries alone (as before) left the second out. The estimand is the expected LDS of ``M`` models over the query
    population; the two-way (pigeonhole) bootstrap counts the query-model interaction twice, so it leans wide
    (coverage measured in the test suite).

    :param predicted: ``(n_models, n_query)`` predicted utilities (influence summed over each subset).
    :param utility: ``(n_models, n_query)`` measured utilities.
    :param n_bootstrap: Resamples.
    :param confidence: Coverage.
    :param seed: Seed of the resampling.
    :return: ``(low, high)``; ``(NaN, NaN)`` with fewer than two models or queries.
    """
    n_models, n_query = predicted.shape
    if n_models < 2 or n_query < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    draws = np.empty(int(n_bootstrap))
    for b in range(int(n_bootstrap)):
        models, queries = rng.integers(0, n_models, n_models), rng.integers(0, n_query, n_query)
        per_query = _column_spearman(predicted[models][:, queries], utility[models][:, queries])
        draws[b] = np.nanmean(per_query) if np.isfinite(per_query).any() else np.nan
    low, high = percentile_interval(draws, confidence)
    return float(low), float(high)


def sign_agreement(predicted: np.ndarray, measured: np.ndarray, confidence: float = 0.95) -> dict[str, Any]:
    """
    Share of pairs whose measured change has the predicted sign, with a Clopper–Pearson interval.

    :param predicted: Predicted influence per pair (positive: removing the example raises the loss).
    :param measured: Measured loss change on removal per pair.
    :param confidence: Coverage of the interval.
    :return: ``{"rate", "ci", "n_agree", "n_pairs"}``; pairs where either value is exactly 0 are left out.
    """
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    keep = (predicted != 0) & (measured != 0) & np.isfinite(predicted) & np.isfinite(measured)
    n_pairs = int(keep.sum())
    n_agree = int((np.sign(predicted[keep]) == np.sign(measured[keep])).sum())
    if n_pairs == 0:
        return {"rate": None, "ci": [None, None], "n_agree": 0, "n_pairs": 0}
    interval = binomtest(n_agree, n_pairs).proportion_ci(confidence_level=confidence, method="exact")
    return {"rate": n_agree / n_pairs, "ci": [interval.low, interval.high], "n_agree": n_agree, "n_pairs": n_pairs}


