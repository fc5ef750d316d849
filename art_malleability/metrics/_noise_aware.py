"""
The noise-aware flip rate of whole influence matrices: the share of the influential set whose *population* aggregate
changes sign, by the empirical-Bayes deconvolution of :mod:`art_malleability.metrics._flip_posterior`.
:mod:`art_malleability.metrics` exports the public names; docs/metrics.md gives the model, its assumptions and its
measured bias and coverage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics._scores import _pair_and_top, aggregate_scores


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
    sign, estimated by empirical-Bayes deconvolution of the paired clean and perturbed aggregates (docs/metrics.md
    gives the model, its assumptions and its measured bias and coverage). Unlike the raw
    :func:`~art_malleability.metrics.flip_rate`, sign changes that query noise alone would produce are not counted.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same queries and weights.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param top: Optional fixed influential set; default: chosen from ``before``.
    :param selected: Whether the set was chosen from these clean scores (then the likelihood is corrected for the
        selection); ``False`` for a set fixed in advance.
    :param noise: A projected estimator's noise model ``(α, β)``: ``sd = α + β |score|`` per aggregate
        (:func:`~art_malleability.metrics.projection_noise`); ``None`` for a deterministic estimator.
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
