"""
Malleability metrics on influence matrices (torch, float64, on the device of the scores).

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
* **Spearman**: rank correlation of all finite (query, train) scores before and after (on a seeded sample of the pairs
  above :data:`~art_malleability.metrics._spearman.SPEARMAN_PAIRS` of them).
* **Top-k overlap**: Jaccard index of the clean and perturbed aggregate top sets.
* **Signed retention**: ``Σ_j s_j μ_a,j / Σ_j s_j μ_b,j`` over the influential set, ``μ_b``/``μ_a`` the clean/perturbed
  *population* aggregates and ``s`` the measured clean signs: 1 influence unchanged, 0 wiped out, below 0 reversed on
  balance. Estimated with the selection of the set corrected (empirical Bayes on the clean aggregates, a regression on
  the clean noise for the perturbed ones: :mod:`art_malleability.metrics._retention`). A mean over the set, it is
  decided where single signs are not.
* **Noise-aware flip rate** (key ``flip_rate_above_floor``): the estimated share of the top set whose
  *population* aggregate (the mean over infinitely many queries) changes sign, by empirical-Bayes
  deconvolution of the paired clean and perturbed aggregates (:func:`noise_aware_flip_rate`). Beside the raw
  flip rate, its expectation under query noise alone (``flip_rate_null``).
* **Intervals** (each one's estimand, method, assumptions and measured coverage: docs/metrics.md): the raw flip
  rate, the top-k Jaccard, the signed retention and the excesses over the control take a normal interval with the
  standard error of a bootstrap over queries (:func:`normal_interval`); Spearman a delete-a-group jackknife over the
  queries (:func:`jackknife_interval`); the per-query flip rate a Student-t interval over queries
  (:func:`t_interval`); the noise-aware rate a profile likelihood; the retention's adds the empirical-Bayes error
  to its bootstrap variance. Every statistic costs time and
  memory linear in the number of queries: the metrics are accumulated over blocks of queries
  (:mod:`art_malleability.metrics.accumulators`).
  The bootstrap is *conditional on the influential set*: the top set is chosen once from all
  clean scores (it is the set an audit perturbs) and held fixed in every resample. Every statistic of one audit
  uses the same resamples (:func:`resample_rows`), so an attack and its control are paired. Results over
  training seeds are pooled with a Student-t interval over the seeds (:func:`seed_interval`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import norm, spearmanr

from art_malleability.metrics._bootstrap import (
    TIE_VARIANCE_RATIO,
    check_confidence,
    jackknife_interval,
    normal_interval,
    percentile_interval,
    resample_rows,
    seed_interval,
    t_interval,
)
from art_malleability.metrics._flip_posterior import FlipPosterior, projection_noise
from art_malleability.metrics._scores import (
    RANK_BY,
    _pair,
    _pair_and_top,
    aggregate_scores,
    flip_mask,
    top_indices,
    top_k_count,
)
from art_malleability.metrics._spearman import SPEARMAN_PAIRS
from art_malleability.metrics._summary import (
    BOUNDS,
    VARIANCE_FACTOR,
    combine_controls,
    malleability_metrics,
    pass_metrics,
    replicated,
)
from art_malleability.metrics.accumulators import QueryResampling, top_masks

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
    "selection_threshold",
    "noise_aware_flip_rate",
    "resample_rows",
    "percentile_interval",
    "normal_interval",
    "jackknife_interval",
    "t_interval",
    "seed_interval",
    "BOUNDS",
    "TIE_VARIANCE_RATIO",
    "VARIANCE_FACTOR",
    "QueryResampling",
    "top_masks",
    "malleability_metrics",
    "combine_controls",
    "aggregate_jaccard",
    "check_confidence",
    "pass_metrics",
    "replicated",
    "projection_noise",
    "SPEARMAN_PAIRS",
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
    return aggregate_jaccard(aggregate_scores(after), top, k, rank_by)


def _aggregate_flip_rate(agg_before: np.ndarray, agg_after: np.ndarray, top: np.ndarray) -> float:
    if top.size == 0:
        return float("nan")
    return float(flip_mask(agg_before[top], agg_after[top]).mean())


def aggregate_jaccard(agg_after: np.ndarray, top: np.ndarray, k: int, rank_by: str) -> float:
    set_a = set(top.tolist())
    set_b = set(top_indices(agg_after, k, rank_by).tolist())
    union = set_a | set_b
    return float(len(set_a & set_b) / len(union)) if union else float("nan")


def z_value(confidence: float) -> float:
    """:return: The two-sided normal quantile of a coverage, ``Φ⁻¹(1/2 + confidence/2)`` (1.96 at 0.95)."""
    check_confidence(confidence)
    return float(norm.ppf(0.5 + confidence / 2.0))


def selection_threshold(before: ArrayLike, top: ArrayLike, rank_by: str = "abs") -> float | None:
    """
    The clean aggregate that the influential set cleared when it was chosen from these scores: the smallest
    ``|aggregate|`` of the set (``rank_by="abs"``) or its smallest aggregate (``"signed"``).

    :param before: Clean influence matrix (n_query, n_train).
    :param top: The set (training indices).
    :param rank_by: ``"abs"`` or ``"signed"``.
    :return: The threshold; ``None`` for an empty set.
    """
    top = np.asarray(top, dtype=int)
    if top.size == 0:
        return None
    values = aggregate_scores(before)[top]
    return float(np.nanmin(np.abs(values) if rank_by == "abs" else values))


def noise_aware_flip_rate(
    before: ArrayLike,
    after: ArrayLike,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    top: ArrayLike | None = None,
    selected: bool = True,
    noise: tuple[float, float] | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """
    The share of the influential set whose *population* aggregate (the mean over infinitely many queries) changes
    sign, estimated by empirical-Bayes deconvolution of the paired clean and perturbed aggregates (see
    :mod:`art_malleability.metrics._flip_posterior` and docs/metrics.md for the model, its assumptions and its
    measured bias and coverage). Unlike the raw :func:`flip_rate`, sign changes that query noise alone would produce
    are not counted.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same queries and weights.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param top: Optional fixed influential set; default: chosen from ``before``.
    :param selected: Whether the set was chosen from these clean scores (then the likelihood is corrected for the
        selection); ``False`` for a set fixed in advance.
    :param noise: A projected estimator's noise model ``(α, β)``: ``sd = α + β |score|`` per aggregate
        (:func:`~art_malleability.metrics._flip_posterior.projection_noise`); ``None`` for a deterministic estimator.
    :param confidence: Coverage of the interval (profile likelihood; deterministic, no resampling).
    :return: ``{"estimate", "ci", "flip_probabilities" (per member of the set), "null_raw_flip_rate",
        "no_flip_statistic", "undecided_share"}`` (the last: the share of the set whose perturbed aggregate lies
        within one standard error of zero, where the estimate's bias grows).
    """
    before, after, top, _ = _pair_and_top(before, after, top_fraction, rank_by, top)
    if top.size == 0 or before.shape[0] < 2:
        nan = float("nan")
        return {"estimate": nan, "ci": (nan, nan), "flip_probabilities": np.full(top.size, nan),
                "null_raw_flip_rate": nan, "no_flip_statistic": nan, "undecided_share": nan}
    threshold = selection_threshold(before, top, rank_by) if selected else None
    posterior = FlipPosterior.from_scores(before, after, top, threshold, rank_by, noise)
    return {
        "estimate": posterior.estimate(),
        "ci": posterior.interval(confidence),
        "flip_probabilities": posterior.flip_probabilities(),
        "null_raw_flip_rate": posterior.null_raw_flip_rate(),
        "no_flip_statistic": posterior.no_flip_statistic(),
        "undecided_share": posterior.undecided_share(),
    }
