"""
All malleability metrics of one clean/perturbed pair, from the passes of :mod:`.accumulators`: each statistic with the
interval whose coverage the test suite measures, the random-sign control's combination of draws, and the excesses of an
attack over its control. :mod:`art_malleability.metrics` exports the public names; docs/metrics.md gives each
statistic's estimand, method, assumptions and measured coverage.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from art_malleability.metrics._bootstrap import TIE_VARIANCE_RATIO, jackknife_interval, normal_interval, t_interval
from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics._scores import _pair, flip_mask, top_indices
from art_malleability.metrics.accumulators import (
    CleanScores,
    PerturbedScores,
    QueryResampling,
    block_rows,
    check_complete,
    finite_mean,
)

#: Range of each reported statistic (intervals are clipped to it).
BOUNDS = {
    "flip_rate": (0.0, 1.0),
    "flip_rate_above_floor": (0.0, 1.0),
    "per_query_flip_rate": (0.0, 1.0),
    "spearman": (-1.0, 1.0),
    "top_k_jaccard": (0.0, 1.0),
    "signed_retention": (-np.inf, np.inf),
    "excess_flip_rate": (-1.0, 1.0),
    "excess_retention": (-np.inf, np.inf),
}

#: Factors on the bootstrap variance of the normal intervals: the top-set overlap is made of examples at its rank
#: cut-off, where the bootstrap variance falls short by up to :data:`TIE_VARIANCE_RATIO` (docs/metrics.md).
VARIANCE_FACTOR = {"top_k_jaccard": TIE_VARIANCE_RATIO}

#: Statistics whose replicates are kept (controls average them; differences pair them), with their kind: bootstrap
#: replicates on the shared resamples, or leave-one-group-out values of the jackknife.
REPLICATED = {"flip_rate": "bootstrap", "top_k_jaccard": "bootstrap", "spearman": "jackknife",
              "signed_retention": "bootstrap"}

#: The excesses of an attack over its control: the statistic they difference.
EXCESSES = {"excess_flip_rate": "flip_rate", "excess_retention": "signed_retention"}

#: Key of the retention's empirical-Bayes loadings among the replicates (:mod:`._retention`): the squares of a pass's
#: (of a control's mean over draws, of an attack-minus-control difference) sum to the variance its bootstrap misses.
EB_LOADINGS = "signed_retention_eb_loadings"


def _eb_variance(name: str, draws: dict[str, np.ndarray]) -> float:
    """The empirical-Bayes part of the retention's variance (0 for the other statistics)."""
    if name != "signed_retention" or EB_LOADINGS not in draws:
        return 0.0
    loadings = np.asarray(draws[EB_LOADINGS], dtype=np.float64)
    return float(np.sum(loadings**2)) if np.isfinite(loadings).all() else float("nan")


def _interval(name: str, point: float, replicates: np.ndarray, confidence: float,
              extra_variance: float = 0.0) -> tuple[float, float]:
    """The interval of a statistic from its replicates (normal with the bootstrap's standard error, or jackknife)."""
    bounds = BOUNDS[name]
    if REPLICATED.get(name) == "jackknife":
        return jackknife_interval(point, replicates, confidence, bounds, extra_variance)
    return normal_interval(point, replicates, confidence, bounds, extra_variance=extra_variance,
                           variance_factor=VARIANCE_FACTOR.get(name, 1.0))


def pass_metrics(
    perturbed: PerturbedScores,
    confidence: float = 0.95,
    noise: tuple[float, float] | None = None,
    control: dict[str, Any] | None = None,
    keep_draws: bool = False,
    selected: bool = True,
) -> dict[str, Any]:
    """
    The metrics of one perturbed pass (see :func:`malleability_metrics` for the keys).

    :param perturbed: A complete :class:`~.accumulators.PerturbedScores`.
    :param confidence: Interval coverage.
    :param noise: A projected estimator's noise model.
    :param control: The control's combined metrics (:func:`combine_controls`), or ``None``.
    :param keep_draws: Also return the replicates and the resampling's identity.
    :param selected: Whether the set was chosen from these clean scores.
    """
    clean = perturbed.clean
    result, draws = replicated(perturbed, selected=selected)
    for name in REPLICATED:
        result[name + "_ci"] = _interval(name, result[name], draws[name], confidence,
                                         extra_variance=_eb_variance(name, draws))
    per_query = perturbed.per_query.cpu().numpy()
    result["per_query_flip_rate"] = finite_mean(per_query)
    result["per_query_flip_rate_ci"] = t_interval(per_query, confidence, BOUNDS["per_query_flip_rate"])
    result.update(_noise_aware(perturbed, clean.threshold(selected), noise, confidence))
    identity = clean.resampling.identity
    if control is not None:
        _check_control(control, identity, draws)
        for excess, name in EXCESSES.items():
            result[excess] = result[name] - control[name]
            between = control.get("draw_variance", {}).get(name, 0.0) / max(control.get("n_draws", 1), 1)
            difference = {key: draws[key] - control["draws"][key] for key in (name, EB_LOADINGS) if key in draws}
            result[excess + "_ci"] = normal_interval(
                result[excess], difference[name], confidence, BOUNDS[excess],
                extra_variance=between + _eb_variance(name, difference),
            )
    if keep_draws:
        result["draws"] = draws
        result["resamples"] = identity
    return result


def replicated(perturbed: PerturbedScores, spearman: bool = True,
               selected: bool = True) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """
    The statistics that have replicates, on all queries and on each resample (:data:`REPLICATED`): the raw flip rate,
    the top-k Jaccard, the signed retention (bootstrap) and Spearman's correlation (jackknife).

    :param perturbed: A complete :class:`~.accumulators.PerturbedScores`.
    :param spearman: Whether to compute Spearman's correlation (the simulations of the others leave it out).
    :param selected: Whether the set was chosen from these clean scores (the retention's prior then covers all
        examples).
    :return: ``(points, replicates)``, both keyed by statistic; the replicates also hold the retention's
        empirical-Bayes loadings under :data:`EB_LOADINGS`.
    """
    check_complete(perturbed)
    clean = perturbed.clean
    top = clean.top
    agg_a = perturbed.aggregates()
    b_top, a_top = clean.aggregates[top], agg_a[top]
    boot_b, boot_a = (t.cpu().numpy() for t in perturbed.resampled_top())
    if top.size:
        retention = clean.retention_basis(selected).retention(perturbed.paired_sums(), a_top, boot_b, boot_a)
    else:
        retention = (float("nan"), np.full(len(boot_b), np.nan), np.zeros(0))
    points = {
        "flip_rate": float(flip_mask(b_top, a_top).mean()) if top.size else float("nan"),
        "top_k_jaccard": _jaccard(agg_a, clean),
        "signed_retention": retention[0],
    }
    draws = {
        "flip_rate": flip_mask(boot_b, boot_a).mean(axis=1) if top.size else np.full(len(boot_b), np.nan),
        "top_k_jaccard": perturbed.resampled_jaccard().cpu().numpy(),
        "signed_retention": retention[1],
        EB_LOADINGS: retention[2],
    }
    if spearman:
        points["spearman"], draws["spearman"] = perturbed.spearman()
    return points, draws


def _jaccard(agg_after: np.ndarray, clean: CleanScores) -> float:
    set_a = set(clean.top.tolist())
    set_b = set(top_indices(agg_after, clean.k, clean.rank_by).tolist())
    union = set_a | set_b
    return float(len(set_a & set_b) / len(union)) if union else float("nan")


def _noise_aware(perturbed: PerturbedScores, threshold: float | None, noise: tuple[float, float] | None,
                 confidence: float) -> dict[str, Any]:
    """The noise-aware flip rate and what its deconvolution gives beside it."""
    clean = perturbed.clean
    nan = float("nan")
    if clean.top.size == 0 or clean.n_query < 2:
        return {"flip_rate_above_floor": nan, "flip_rate_above_floor_ci": (nan, nan), "flip_rate_null": nan,
                "no_flip_statistic": nan, "undecided_share": nan, "counted_flips": []}
    posterior = FlipPosterior(perturbed.paired_sums(), threshold, clean.rank_by, noise)
    probabilities = posterior.flip_probabilities()
    return {
        "flip_rate_above_floor": posterior.estimate(),
        "flip_rate_above_floor_ci": posterior.interval(confidence),
        "flip_rate_null": posterior.null_raw_flip_rate(),
        "no_flip_statistic": posterior.no_flip_statistic(),
        "undecided_share": posterior.undecided_share(),
        "counted_flips": clean.top[np.nan_to_num(probabilities) >= 0.5].tolist(),
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
    noise: tuple[float, float] | None = None,
    control: dict[str, Any] | None = None,
    keep_draws: bool = False,
    selected: bool = True,
) -> dict[str, Any]:
    """
    All malleability metrics of one clean/perturbed pair of influence matrices, each with the interval whose
    coverage the test suite measures (docs/metrics.md): the raw flip rate, the top-k Jaccard and the signed retention
    with a normal interval from the bootstrap standard error (estimand: their expected value at this number of queries;
    the retention's: see :mod:`._retention`); the per-query flip rate with a Student-t
    interval over queries; Spearman's correlation with a delete-a-group jackknife interval; the noise-aware flip rate
    (:func:`~art_malleability.metrics.noise_aware_flip_rate`) with its own interval; the raw flip rate's expectation
    under query noise alone. The bootstrap is over queries, conditional on the influential set (chosen once, held
    fixed), on resamples shared by every statistic of the audit. Time and memory are linear in the number of queries
    (:mod:`art_malleability.metrics.accumulators`, which an audit feeds block by block).

    :param before: Clean influence matrix (n_query, n_train), positive = helpful.
    :param after: Influence matrix after perturbation, same shape.
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param n_bootstrap: Bootstrap resamples over queries.
    :param confidence: Interval coverage.
    :param seed: Seed of the resampling (and of the jackknife's groups and the correlation's pairs).
    :param top: Optional fixed influential set (the perturbed one); default: chosen from all of ``before``.
    :param noise: A projected estimator's noise model (see :func:`~art_malleability.metrics.noise_aware_flip_rate`).
    :param control: The metrics of the random-sign control of the same set (:func:`combine_controls` of one or
        several draws, each computed by this function with ``keep_draws=True`` and the same ``seed`` and
        ``n_bootstrap``); adds the ``excess_flip_rate`` and ``excess_retention`` (this statistic minus the control's
        mean) with a normal interval whose variance adds the paired bootstrap variance and the spread between the
        control's draws.
    :param keep_draws: Also return the replicates of the flip rate, the Jaccard, the retention and Spearman under
        ``"draws"`` and the resampling's identity under ``"resamples"`` (for a control).
    :param selected: Whether ``top`` was chosen from ``before`` (see
        :func:`~art_malleability.metrics.noise_aware_flip_rate`).
    :return: Dict with ``flip_rate``, ``flip_rate_null``, ``flip_rate_above_floor`` (the noise-aware rate; the key
        is kept from earlier versions), ``per_query_flip_rate``, ``spearman``, ``top_k_jaccard``, ``signed_retention``
        (and ``excess_flip_rate``, ``excess_retention`` with a control), each statistic's ``*_ci``, and
        ``counted_flips`` (members of the set whose posterior flip probability is at least one half).
    """
    before, after = _pair(before, after)
    n_query, n_train = before.shape
    clean = CleanScores(QueryResampling(n_query, n_bootstrap, seed), n_train, top_fraction, rank_by, given=before)
    step = block_rows(n_train)
    for s in range(0, n_query, step):
        clean.add(before[s : s + step])
    clean.finish(None if top is None else np.asarray(top, dtype=np.int64))
    perturbed = PerturbedScores(clean)
    for s in range(0, n_query, step):
        perturbed.add(after[s : s + step])
    return pass_metrics(perturbed, confidence, noise, control, keep_draws, selected)


def combine_controls(draws: list[dict[str, Any]], confidence: float = 0.95) -> dict[str, Any]:
    """
    The random-sign control from several independent draws of its signs, each the :func:`malleability_metrics` of
    one draw (``keep_draws=True``, the same resamples): every statistic is the mean over the draws (the estimand is
    its expectation over sign draws); the intervals of the raw flip rate, the Jaccard, the retention and Spearman
    take the variance of the draws' mean on the shared resamples (bootstrap or jackknife) plus the variance between
    the draws over their number; the noise-aware rate's interval spans the draws' intervals (lowest low, highest high).

    :param draws: One metrics dict per draw.
    :param confidence: Coverage.
    :return: A metrics dict usable as the ``control`` of :func:`malleability_metrics`, with ``n_draws`` and
        ``draw_variance`` (between-draw variance of each statistic) added.
    """
    if not draws:
        raise ValueError("draws must hold at least one control draw, got none")
    first = draws[0]
    for other in draws[1:]:
        _check_control(other, first["resamples"], first["draws"], what="the draws of one control")
    n = len(draws)
    combined: dict[str, Any] = {"n_draws": n, "resamples": first["resamples"], "draws": {}, "draw_variance": {}}
    for name in ("flip_rate", "flip_rate_null", "flip_rate_above_floor", "per_query_flip_rate", *REPLICATED):
        values = np.array([d[name] for d in draws], dtype=np.float64)
        combined[name] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        combined["draw_variance"][name] = float(np.nanvar(values, ddof=1)) if np.isfinite(values).sum() > 1 else 0.0
    if all(EB_LOADINGS in d["draws"] for d in draws):
        combined["draws"][EB_LOADINGS] = np.mean([d["draws"][EB_LOADINGS] for d in draws], axis=0)
    for name in REPLICATED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a group undefined in every draw stays NaN
            mean_draws = np.nanmean(np.stack([d["draws"][name] for d in draws]), axis=0)
        combined["draws"][name] = mean_draws
        extra = combined["draw_variance"][name] / max(n, 1) + _eb_variance(name, combined["draws"])
        combined[name + "_ci"] = _interval(name, combined[name], mean_draws, confidence, extra_variance=extra)
    lows = [d["flip_rate_above_floor_ci"][0] for d in draws]
    highs = [d["flip_rate_above_floor_ci"][1] for d in draws]
    finite = np.isfinite(lows) & np.isfinite(highs)
    combined["flip_rate_above_floor_ci"] = (
        (float(np.min(np.asarray(lows)[finite])), float(np.max(np.asarray(highs)[finite])))
        if finite.any() else (float("nan"), float("nan"))
    )
    combined["per_query_flip_rate_ci"] = (float("nan"), float("nan"))
    return combined


def _check_control(control: dict[str, Any], identity: dict[str, Any], draws: dict[str, np.ndarray],
                   what: str = "control") -> None:
    """A control must be evaluated on the very resamples of the attack (paired bootstrap)."""
    given = control.get("resamples")
    length = len(control.get("draws", {}).get("flip_rate", ()))
    if given is None or given != identity or length != len(draws["flip_rate"]):
        raise ValueError(
            f"{what} must be computed by malleability_metrics with keep_draws=True on the same resamples (seed "
            f"{identity['seed']}, n_bootstrap {identity['n_bootstrap']}), got "
            + ("no record of its resamples" if given is None else f"seed {given.get('seed')}, n_bootstrap "
               f"{given.get('n_bootstrap')}" + ("" if given.get("digest") == identity["digest"] else ", other rows"))
        )

