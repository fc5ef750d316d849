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
* **Noise-aware flip rate** (key ``flip_rate_above_floor``): the estimated share of the top set whose
  *population* aggregate (the mean over infinitely many queries) changes sign, by empirical-Bayes
  deconvolution of the paired clean and perturbed aggregates (:func:`noise_aware_flip_rate`). Beside the raw
  flip rate, its expectation under query noise alone (``flip_rate_null``).
* **Intervals** (each one's estimand, method, assumptions and measured coverage: docs/metrics.md): the raw flip
  rate, the top-k Jaccard and the excess flip rate take a normal interval with the standard error of a
  bootstrap over queries (:func:`normal_interval`; estimand: the statistic's expected value at this number of
  queries); Spearman a BCa interval (:func:`bca_interval`, through :func:`scipy.stats.bootstrap`); the per-query
  flip rate a Student-t interval over queries (:func:`t_interval`); the noise-aware rate bootstrap refits of
  its deconvolution. The bootstrap is *conditional on the influential set*: the top set is chosen once from all
  clean scores (it is the set an audit perturbs) and held fixed in every resample. Every statistic of one audit
  uses the same resamples (:func:`resample_rows`), so an attack and its control are paired. Results over
  training seeds are pooled with a Student-t interval over the seeds (:func:`seed_interval`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import norm, spearmanr

from art_malleability.metrics._bootstrap import (
    TIE_VARIANCE_RATIO,
    bca_interval,
    check_confidence,
    evaluate_resamples,
    normal_interval,
    percentile_interval,
    resample_rows,
    seed_interval,
    t_interval,
)
from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics._resampled import _ResampledAggregates, _ResampledSpearman
from art_malleability.metrics._scores import (
    RANK_BY,
    _pair,
    _pair_and_top,
    aggregate_scores,
    flip_mask,
    top_indices,
    top_k_count,
)
from art_malleability.metrics._scores import _top_masks as _top_masks  # the batched top sets, kept reachable here

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
    "evaluate_resamples",
    "percentile_interval",
    "normal_interval",
    "t_interval",
    "bca_interval",
    "seed_interval",
    "BOUNDS",
    "TIE_VARIANCE_RATIO",
    "VARIANCE_FACTOR",
    "malleability_metrics",
    "combine_controls",
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
    n_bootstrap: int = 200,
    seed: int = 0,
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
    :param confidence: Coverage of the interval.
    :param n_bootstrap: Bootstrap resamples of the queries for the interval.
    :param seed: Seed of the resampling and of the posterior draws.
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
    posterior = FlipPosterior(before, after, top, threshold, rank_by, noise)
    return {
        "estimate": posterior.estimate(),
        "ci": posterior.interval(resample_rows(before.shape[0], n_bootstrap, seed), confidence, seed),
        "flip_probabilities": posterior.flip_probabilities(),
        "null_raw_flip_rate": posterior.null_raw_flip_rate(),
        "no_flip_statistic": posterior.no_flip_statistic(),
        "undecided_share": posterior.undecided_share(),
    }


#: Range of each reported statistic (intervals are clipped to it).
BOUNDS = {
    "flip_rate": (0.0, 1.0),
    "flip_rate_above_floor": (0.0, 1.0),
    "per_query_flip_rate": (0.0, 1.0),
    "spearman": (-1.0, 1.0),
    "top_k_jaccard": (0.0, 1.0),
    "excess_flip_rate": (-1.0, 1.0),
}

#: Factors on the bootstrap variance of the normal intervals: the top-set overlap is made of examples at its rank
#: cut-off, where the bootstrap variance falls short by up to :data:`TIE_VARIANCE_RATIO` (docs/metrics.md).
VARIANCE_FACTOR = {"top_k_jaccard": TIE_VARIANCE_RATIO}

#: Bootstrap refits behind the noise-aware interval (each one refits the deconvolution).
NOISE_AWARE_RESAMPLES = 100

#: Statistics whose replicates on the shared resamples are kept (controls average them; differences pair them).
_REPLICATED = ("flip_rate", "top_k_jaccard", "spearman")


def malleability_metrics(
    before: ArrayLike,
    after: ArrayLike,
    top_fraction: float = 0.1,
    rank_by: str = "abs",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    top: ArrayLike | None = None,
    noise: tuple[float, float] | None = None,
    control: dict[str, Any] | None = None,
    keep_draws: bool = False,
    selected: bool = True,
) -> dict[str, Any]:
    """
    All malleability metrics of one clean/perturbed pair of influence matrices, each with the interval whose
    coverage the test suite measures (docs/metrics.md): the raw flip rate and the top-k Jaccard with a normal
    interval from the bootstrap standard error (estimand: their expected value at this number of queries); the
    per-query flip rate with a Student-t interval over queries; Spearman's correlation with a BCa interval; the
    noise-aware flip rate (:func:`noise_aware_flip_rate`) with its own interval; the raw flip rate's expectation
    under query noise alone. The bootstrap is over queries, conditional on the influential set (chosen once, held
    fixed), on resamples shared by every statistic of the audit.

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param n_bootstrap: Bootstrap resamples over queries.
    :param confidence: Interval coverage.
    :param seed: Seed of the resampling.
    :param top: Optional fixed influential set (the perturbed one); default: chosen from all of ``before``.
    :param noise: A projected estimator's noise model (see :func:`noise_aware_flip_rate`).
    :param control: The metrics of the random-sign control of the same set (:func:`combine_controls` of one or
        several draws, each computed by this function with ``keep_draws=True`` and the same ``seed`` and
        ``n_bootstrap``); adds the ``excess_flip_rate`` (this flip rate minus the control's mean) with a normal
        interval whose variance adds the paired bootstrap variance and the spread between the control's draws.
    :param keep_draws: Also return the replicates of the flip rate, the Jaccard and Spearman under ``"draws"`` and
        the resampling's identity under ``"resamples"`` (for a control).
    :param selected: Whether ``top`` was chosen from ``before`` (see :func:`noise_aware_flip_rate`).
    :return: Dict with ``flip_rate``, ``flip_rate_null``, ``flip_rate_above_floor`` (the noise-aware rate; the key
        is kept from earlier versions), ``per_query_flip_rate``, ``spearman``, ``top_k_jaccard`` (and
        ``excess_flip_rate`` with a control), each statistic's ``*_ci``, and ``counted_flips`` (members of the set
        whose posterior flip probability is at least one half).
    """
    before, after, top, k = _pair_and_top(before, after, top_fraction, rank_by, top)
    n_query = before.shape[0]
    everything = np.arange(n_query)
    rows = resample_rows(n_query, n_bootstrap, seed) if n_query >= 2 else None
    aggregates = _ResampledAggregates(before, after, top, k, rank_by)
    spearman_of = _ResampledSpearman(before, after)
    statistics: dict[str, Callable[[np.ndarray], float]] = {
        "flip_rate": aggregates.statistic("flip_rate"),
        "top_k_jaccard": aggregates.statistic("top_k_jaccard"),
        "spearman": spearman_of,
    }
    result: dict[str, Any] = {}
    draws: dict[str, np.ndarray] = {}
    for name, statistic in statistics.items():
        result[name] = float(statistic(everything))
        draws[name] = evaluate_resamples(statistic, rows) if rows is not None else np.full(0, np.nan)
    for name in ("flip_rate", "top_k_jaccard"):
        result[name + "_ci"] = normal_interval(
            result[name], draws[name], confidence, BOUNDS[name], variance_factor=VARIANCE_FACTOR.get(name, 1.0)
        )
    result["spearman_ci"] = bca_interval(spearman_of.batch, n_query, n_bootstrap, confidence, seed, BOUNDS["spearman"])
    per_query = per_query_flip_rates(before, after, top_fraction, rank_by)
    result["per_query_flip_rate"] = float(np.nanmean(per_query)) if np.isfinite(per_query).any() else float("nan")
    result["per_query_flip_rate_ci"] = t_interval(per_query, confidence, BOUNDS["per_query_flip_rate"])
    aware = noise_aware_flip_rate(
        before, after, top=top, rank_by=rank_by, selected=selected, noise=noise, confidence=confidence,
        n_bootstrap=min(n_bootstrap, NOISE_AWARE_RESAMPLES), seed=seed,
    )
    result["flip_rate_above_floor"], result["flip_rate_above_floor_ci"] = aware["estimate"], aware["ci"]
    result["flip_rate_null"] = aware["null_raw_flip_rate"]
    result["no_flip_statistic"] = aware["no_flip_statistic"]
    result["undecided_share"] = aware["undecided_share"]
    result["counted_flips"] = top[np.nan_to_num(aware["flip_probabilities"]) >= 0.5].tolist()
    identity = _resampling(seed, rows)
    if control is not None:
        _check_control(control, identity, draws["flip_rate"])
        result["excess_flip_rate"] = result["flip_rate"] - control["flip_rate"]
        paired = draws["flip_rate"] - control["draws"]["flip_rate"]
        between = control.get("draw_variance", {}).get("flip_rate", 0.0) / max(control.get("n_draws", 1), 1)
        result["excess_flip_rate_ci"] = normal_interval(
            result["excess_flip_rate"], paired, confidence, BOUNDS["excess_flip_rate"], extra_variance=between
        )
    if keep_draws:
        result["draws"] = draws
        result["resamples"] = identity
    return result


def combine_controls(draws: list[dict[str, Any]], confidence: float = 0.95) -> dict[str, Any]:
    """
    The random-sign control from several independent draws of its signs, each the :func:`malleability_metrics` of
    one draw (``keep_draws=True``, the same resamples): every statistic is the mean over the draws (the estimand is
    its expectation over sign draws); the intervals of the raw flip rate, the Jaccard and Spearman are normal, with
    the bootstrap variance of the draws' mean plus the variance between the draws over their number; the
    noise-aware rate's interval spans the draws' intervals (lowest low, highest high).

    :param draws: One metrics dict per draw.
    :param confidence: Coverage.
    :return: A metrics dict usable as the ``control`` of :func:`malleability_metrics`, with ``n_draws`` and
        ``draw_variance`` (between-draw variance of each statistic) added.
    """
    if not draws:
        raise ValueError("draws must hold at least one control draw, got none")
    first = draws[0]
    for other in draws[1:]:
        _check_control(other, first["resamples"], first["draws"]["flip_rate"], what="the draws of one control")
    n = len(draws)
    combined: dict[str, Any] = {"n_draws": n, "resamples": first["resamples"], "draws": {}, "draw_variance": {}}
    for name in ("flip_rate", "flip_rate_null", "flip_rate_above_floor", "per_query_flip_rate", *_REPLICATED):
        values = np.array([d[name] for d in draws], dtype=np.float64)
        combined[name] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        combined["draw_variance"][name] = float(np.nanvar(values, ddof=1)) if np.isfinite(values).sum() > 1 else 0.0
    for name in _REPLICATED:
        mean_draws = np.mean(np.stack([d["draws"][name] for d in draws]), axis=0)
        combined["draws"][name] = mean_draws
        combined[name + "_ci"] = normal_interval(
            combined[name], mean_draws, confidence, BOUNDS[name],
            extra_variance=combined["draw_variance"][name] / max(n, 1), variance_factor=VARIANCE_FACTOR.get(name, 1.0),
        )
    lows = [d["flip_rate_above_floor_ci"][0] for d in draws]
    highs = [d["flip_rate_above_floor_ci"][1] for d in draws]
    finite = np.isfinite(lows) & np.isfinite(highs)
    combined["flip_rate_above_floor_ci"] = (
        (float(np.min(np.asarray(lows)[finite])), float(np.max(np.asarray(highs)[finite])))
        if finite.any() else (float("nan"), float("nan"))
    )
    combined["per_query_flip_rate_ci"] = (float("nan"), float("nan"))
    return combined


def _resampling(seed: int, rows: np.ndarray | None) -> dict[str, Any]:
    """What identifies the resamples of a metrics dict: the seed, their number and a digest of the rows."""
    digest = "" if rows is None else hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()
    return {"seed": int(seed), "n_bootstrap": 0 if rows is None else int(len(rows)), "digest": digest}


def _check_control(control: dict[str, Any], identity: dict[str, Any], flip_draws: np.ndarray,
                   what: str = "control") -> None:
    """A control must be evaluated on the very resamples of the attack (paired bootstrap)."""
    given = control.get("resamples")
    if given is None or given != identity or len(control.get("draws", {}).get("flip_rate", ())) != len(flip_draws):
        raise ValueError(
            f"{what} must be computed by malleability_metrics with keep_draws=True on the same resamples (seed "
            f"{identity['seed']}, n_bootstrap {identity['n_bootstrap']}), got "
            + ("no record of its resamples" if given is None else f"seed {given.get('seed')}, n_bootstrap "
               f"{given.get('n_bootstrap')}" + ("" if given.get("digest") == identity["digest"] else ", other rows"))
        )
