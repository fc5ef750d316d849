"""
All malleability metrics of one clean/perturbed pair, from the passes of :mod:`.accumulators`: each statistic with the
interval whose coverage the test suite measures, the random-sign control's combination of draws, and the excesses of an
attack over its control. :mod:`art_malleability.metrics` exports the public names; docs/metrics.md gives each
statistic's estimand, method, assumptions and measured coverage.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from art_malleability.metrics._bootstrap import (
    MIN_INTERVAL_QUERIES,
    TIE_VARIANCE_RATIO,
    jackknife_interval,
    normal_interval,
    t_interval,
)
from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics._matrices import aggregate_jaccard
from art_malleability.metrics._results import (
    EB_LOADINGS,
    ControlMetrics,
    Estimate,
    MalleabilityMetrics,
    Replicates,
    ResamplingIdentity,
)
from art_malleability.metrics._scores import _pair, flip_mask
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


@dataclass(frozen=True, eq=False)
class PassStatistics:
    """
    What one perturbed pass gives its metrics before the control is known: the statistics with replicates (points and
    replicates), the per-query flip rates, the noise-aware flip rate's deconvolution and the perturbed aggregates.
    :meth:`metrics` completes them (intervals, and the excesses over a control). An audit keeps them in its work folder
    (:meth:`to_arrays`, :meth:`from_arrays`) so that a resumed audit does not refit a finished pass.

    :param points: Each replicated statistic (:data:`REPLICATED`) on all queries.
    :param draws: Their replicates (the retention's loadings under ``EB_LOADINGS``).
    :param per_query: Each query's own flip rate.
    :param noise_aware: The :class:`MalleabilityMetrics` fields of the deconvolution (``noise_aware_flip_rate``,
        ``flip_rate_null``, ``no_flip_statistic``, ``undecided_share``, ``counted_flips``, ``undecided_members``).
    :param aggregates: The perturbed aggregate score of every training example.
    :param identity: The resamples of the queries the replicates were computed on.
    """

    points: dict[str, float]
    draws: dict[str, np.ndarray]
    per_query: np.ndarray
    noise_aware: dict[str, Any]
    aggregates: np.ndarray
    identity: ResamplingIdentity

    @classmethod
    def of(cls, perturbed: PerturbedScores, confidence: float = 0.95, noise: tuple[float, float] | None = None,
           selected: bool = True) -> PassStatistics:
        """
        :param perturbed: A complete :class:`~.accumulators.PerturbedScores`.
        :param confidence: Interval coverage (the noise-aware interval's, and the retention's reporting rule).
        :param noise: A projected estimator's noise model.
        :param selected: Whether the set was chosen from these clean scores.
        """
        clean = perturbed.clean
        points, draws = replicated(perturbed, selected=selected, confidence=confidence)
        return cls(points, draws, perturbed.per_query.cpu().numpy(),
                   _noise_aware(perturbed, clean.threshold(selected), noise, confidence), perturbed.aggregates(),
                   clean.resampling.identity)

    def metrics(self, confidence: float = 0.95, control: MalleabilityMetrics | ControlMetrics | None = None,
                keep_draws: bool = False) -> MalleabilityMetrics:
        """
        :param confidence: Interval coverage.
        :param control: The control's combined metrics (:func:`combine_controls`), or one draw's metrics with their
            replicates, or ``None``.
        :param keep_draws: Also keep the replicates and the resampling's identity.
        :return: The pass's metrics (see :func:`pass_metrics`).
        """
        points, draws = self.points, self.draws
        estimates = {
            name: Estimate.of(points[name], _interval(name, points[name], draws[name], confidence,
                                                      extra_variance=_eb_variance(name, draws)))
            for name in REPLICATED
        }
        per_query_rate = Estimate.of(finite_mean(self.per_query), t_interval(self.per_query, confidence,
                                                                             BOUNDS["per_query_flip_rate"]))
        excesses = {} if control is None else _excesses(points, draws, control, self.identity, confidence)
        return MalleabilityMetrics(
            **estimates,
            per_query_flip_rate=per_query_rate,
            **self.noise_aware,
            **excesses,
            replicates=Replicates.from_draws(draws, self.identity) if keep_draws else None,
        )

    def to_arrays(self) -> dict[str, np.ndarray]:
        """:return: The statistics as named arrays (what :meth:`from_arrays` reads back); the identity left out."""
        rate = self.noise_aware["noise_aware_flip_rate"]
        arrays = {f"point.{name}": np.float64(value) for name, value in self.points.items()}
        arrays.update({f"draw.{name}": np.asarray(values) for name, values in self.draws.items()})
        arrays.update({f"noise_aware.{name}": np.float64(self.noise_aware[name]) for name in _NOISE_AWARE_NUMBERS})
        arrays.update(per_query=self.per_query, aggregates=self.aggregates,
                      noise_aware_rate=np.array([rate.value, rate.low, rate.high], dtype=np.float64),
                      counted_flips=np.asarray(self.noise_aware["counted_flips"], dtype=np.int64),
                      undecided_members=np.asarray(self.noise_aware["undecided_members"], dtype=np.int64))
        return arrays

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], identity: ResamplingIdentity) -> PassStatistics:
        """
        :param arrays: What :meth:`to_arrays` gave.
        :param identity: The resamples they were computed on (the clean pass's).
        """
        def named(prefix: str) -> dict[str, np.ndarray]:
            return {key[len(prefix):]: value for key, value in arrays.items() if key.startswith(prefix)}

        noise_aware: dict[str, Any] = {name: float(v) for name, v in named("noise_aware.").items()}
        noise_aware["noise_aware_flip_rate"] = Estimate(*(float(v) for v in arrays["noise_aware_rate"]))
        noise_aware["counted_flips"] = tuple(int(i) for i in arrays["counted_flips"])
        noise_aware["undecided_members"] = tuple(int(i) for i in arrays["undecided_members"])
        return cls({name: float(v) for name, v in named("point.").items()}, named("draw."),
                   np.asarray(arrays["per_query"]), noise_aware, np.asarray(arrays["aggregates"]), identity)


#: The noise-aware deconvolution's single numbers among :class:`MalleabilityMetrics` fields.
_NOISE_AWARE_NUMBERS = ("flip_rate_null", "no_flip_statistic", "undecided_share")


def pass_metrics(
    perturbed: PerturbedScores,
    confidence: float = 0.95,
    noise: tuple[float, float] | None = None,
    control: MalleabilityMetrics | ControlMetrics | None = None,
    keep_draws: bool = False,
    selected: bool = True,
) -> MalleabilityMetrics:
    """
    The metrics of one perturbed pass (see :func:`malleability_metrics`).

    :param perturbed: A complete :class:`~.accumulators.PerturbedScores`.
    :param confidence: Interval coverage.
    :param noise: A projected estimator's noise model.
    :param control: The control's combined metrics (:func:`combine_controls`), or one draw's metrics with their
        replicates, or ``None``.
    :param keep_draws: Also keep the replicates and the resampling's identity
        (:class:`~art_malleability.metrics.Replicates`).
    :param selected: Whether the set was chosen from these clean scores.
    :return: The metrics.
    """
    return PassStatistics.of(perturbed, confidence, noise, selected).metrics(confidence, control, keep_draws)


def _excesses(points: dict[str, float], draws: dict[str, np.ndarray], control: MalleabilityMetrics | ControlMetrics,
              identity: ResamplingIdentity, confidence: float) -> dict[str, Estimate]:
    """
    The excesses of a pass over its control (:data:`EXCESSES`), each with a normal interval whose variance adds the
    paired bootstrap variance of the difference and the spread between the control's draws over their number.
    """
    _check_control(control, identity, len(draws["flip_rate"]))
    control_draws = control.replicates.draws()
    n_draws, spread = (control.n_draws, control.draw_variance) if isinstance(control, ControlMetrics) else (1, {})
    found = {}
    for excess, name in EXCESSES.items():
        value = points[name] - getattr(control, name).value
        between = spread.get(name, 0.0) / max(n_draws, 1)
        difference = {key: draws[key] - control_draws[key] for key in (name, EB_LOADINGS) if key in draws}
        extra = between + _eb_variance(name, difference)
        found[excess] = Estimate.of(value, normal_interval(value, difference[name], confidence, BOUNDS[excess],
                                                           extra_variance=extra))
    return found


def replicated(perturbed: PerturbedScores, spearman: bool = True, selected: bool = True,
               confidence: float = 0.95) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """
    The statistics that have replicates, on all queries and on each resample (:data:`REPLICATED`): the raw flip rate,
    the top-k Jaccard, the signed retention (bootstrap) and Spearman's correlation (jackknife).

    :param perturbed: A complete :class:`~.accumulators.PerturbedScores`.
    :param spearman: Whether to compute Spearman's correlation (the simulations of the others leave it out).
    :param selected: Whether the set was chosen from these clean scores (the retention's prior then covers all
        examples).
    :param confidence: The intervals' coverage (the retention is reported only where its denominator is decidedly
        positive at it).
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
        retention = clean.retention_basis(selected).retention(perturbed.paired_sums(), a_top, boot_b, boot_a,
                                                              confidence)
    else:
        retention = (float("nan"), np.full(len(boot_b), np.nan), np.zeros(0))
    points = {
        "flip_rate": float(flip_mask(b_top, a_top).mean()) if top.size else float("nan"),
        "top_k_jaccard": aggregate_jaccard(agg_a, top, clean.k, clean.rank_by),
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


def _noise_aware(perturbed: PerturbedScores, threshold: float | None, noise: tuple[float, float] | None,
                 confidence: float) -> dict[str, Any]:
    """The noise-aware flip rate and what its deconvolution gives beside it, by :class:`MalleabilityMetrics` field."""
    clean = perturbed.clean
    nan = float("nan")
    if clean.top.size == 0 or clean.n_query < MIN_INTERVAL_QUERIES:
        return {"noise_aware_flip_rate": Estimate.undefined(), "flip_rate_null": nan, "no_flip_statistic": nan,
                "undecided_share": nan, "counted_flips": (), "undecided_members": ()}
    posterior = FlipPosterior(perturbed.paired_sums(), threshold, clean.rank_by, noise)
    probabilities = posterior.flip_probabilities()
    return {
        "noise_aware_flip_rate": Estimate.of(posterior.estimate(), posterior.interval(confidence)),
        "flip_rate_null": float(posterior.null_raw_flip_rate()),
        "no_flip_statistic": float(posterior.no_flip_statistic()),
        "undecided_share": float(posterior.undecided_share()),
        "counted_flips": tuple(clean.top[np.nan_to_num(probabilities) >= 0.5].tolist()),
        "undecided_members": tuple(clean.top[posterior.undecided_members()].tolist()),
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
    control: MalleabilityMetrics | ControlMetrics | None = None,
    keep_draws: bool = False,
    selected: bool = True,
) -> MalleabilityMetrics:
    """
    All malleability metrics of one clean/perturbed pair of influence matrices, each with the interval whose
    coverage the test suite measures (docs/metrics.md): the raw flip rate, the top-k Jaccard and the signed retention
    with a normal interval from the bootstrap standard error (estimand: their expected value at this number of queries;
    the retention's: see docs/metrics.md); the per-query flip rate with a Student-t interval over queries; Spearman's
    correlation with a delete-a-group jackknife interval; the noise-aware flip rate
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
    :param control: The random-sign control of the same set: :func:`combine_controls` of one or several draws, or
        one draw, each computed by this function with ``keep_draws=True`` and the same ``seed`` and ``n_bootstrap``;
        adds the ``excess_flip_rate`` and ``excess_retention`` (this statistic minus the control's mean) with a normal
        interval whose variance adds the paired bootstrap variance and the spread between the control's draws.
    :param keep_draws: Also keep the replicates of the flip rate, the Jaccard, the retention and Spearman, with the
        resampling's identity (``replicates``; what a control needs).
    :param selected: Whether ``top`` was chosen from ``before`` (see
        :func:`~art_malleability.metrics.noise_aware_flip_rate`).
    :return: The metrics (:class:`~art_malleability.metrics.MalleabilityMetrics`): each statistic an
        :class:`~art_malleability.metrics.Estimate` (``result.flip_rate.value``, ``result.flip_rate.interval``);
        ``result.to_dict()`` gives them under the keys of an audit's report (``result["flip_rate"]`` reads one).
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


def combine_controls(draws: Sequence[MalleabilityMetrics], confidence: float = 0.95) -> ControlMetrics:
    """
    The random-sign control from several independent draws of its signs, each the :func:`malleability_metrics` of
    one draw (``keep_draws=True``, the same resamples): every statistic is the mean over the draws (the estimand is
    its expectation over sign draws); the intervals of the raw flip rate, the Jaccard, the retention and Spearman
    take the variance of the draws' mean on the shared resamples (bootstrap or jackknife) plus the variance between
    the draws over their number; the noise-aware rate's interval spans the draws' intervals (lowest low, highest high).

    :param draws: The metrics of each draw.
    :param confidence: Coverage.
    :return: The control (:class:`~art_malleability.metrics.ControlMetrics`), usable as the ``control`` of
        :func:`malleability_metrics`, with the number of draws and the variance between them of each statistic.
    """
    if not draws:
        raise ValueError("draws must hold at least one control draw, got none")
    first = draws[0]
    _check_metrics(first, "draws")
    if first.replicates is None:
        raise ValueError("draws must be computed by malleability_metrics with keep_draws=True, got a draw without "
                         "replicates")
    for other in draws[1:]:
        _check_control(other, first.replicates.resamples, first.replicates.n_resamples, what="the draws of one control")
    n, dicts = len(draws), [d.to_dict() for d in draws]
    means, spread = {}, {}
    for name in ("flip_rate", "flip_rate_null", "flip_rate_above_floor", "per_query_flip_rate", *REPLICATED):
        values = np.array([d[name] for d in dicts], dtype=np.float64)
        means[name] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        spread[name] = float(np.nanvar(values, ddof=1)) if np.isfinite(values).sum() > 1 else 0.0
    mean_draws = _mean_replicates([d["draws"] for d in dicts])
    estimates = {}
    for name in REPLICATED:
        extra = spread[name] / max(n, 1) + _eb_variance(name, mean_draws)
        estimates[name] = Estimate.of(means[name], _interval(name, means[name], mean_draws[name], confidence,
                                                             extra_variance=extra))
    nan = float("nan")
    noise_aware = _span(d.noise_aware_flip_rate for d in draws)
    return ControlMetrics(
        n_draws=n,
        **estimates,
        flip_rate_null=means["flip_rate_null"],
        noise_aware_flip_rate=Estimate.of(means["flip_rate_above_floor"], noise_aware),
        per_query_flip_rate=Estimate(means["per_query_flip_rate"], nan, nan),
        draw_variance=spread,
        replicates=Replicates.from_draws(mean_draws, first.replicates.resamples),
    )


def _mean_replicates(draws: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The draws' mean replicates of every statistic (and of the retention's loadings where every draw has them)."""
    mean: dict[str, np.ndarray] = {}
    if all(EB_LOADINGS in d for d in draws):
        mean[EB_LOADINGS] = np.mean([d[EB_LOADINGS] for d in draws], axis=0)
    for name in REPLICATED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a group undefined in every draw stays NaN
            mean[name] = np.nanmean(np.stack([d[name] for d in draws]), axis=0)
    return mean


def _span(estimates: Iterable[Estimate]) -> tuple[float, float]:
    """The lowest low and the highest high of the intervals defined at both ends (``NaN`` without any)."""
    lows, highs = np.array([e.interval for e in estimates], dtype=np.float64).reshape(-1, 2).T
    finite = np.isfinite(lows) & np.isfinite(highs)
    if not finite.any():
        return float("nan"), float("nan")
    return float(np.min(lows[finite])), float(np.max(highs[finite]))


def _check_metrics(value: Any, name: str) -> None:
    if not isinstance(value, (MalleabilityMetrics, ControlMetrics)):
        raise TypeError(f"{name} must hold the metrics of malleability_metrics or combine_controls, got "
                        f"{type(value).__name__}")


def _check_control(control: MalleabilityMetrics | ControlMetrics, identity: ResamplingIdentity, n_resamples: int,
                   what: str = "control") -> None:
    """A control must be evaluated on the very resamples of the attack (paired bootstrap)."""
    _check_metrics(control, what)
    given = None if control.replicates is None else control.replicates.resamples
    if given is None or given != identity or control.replicates.n_resamples != n_resamples:
        raise ValueError(
            f"{what} must be computed by malleability_metrics with keep_draws=True on the same resamples (seed "
            f"{identity.seed}, n_bootstrap {identity.n_bootstrap}), got "
            + ("no record of its resamples" if given is None else f"seed {given.seed}, n_bootstrap "
               f"{given.n_bootstrap}" + ("" if given.digest == identity.digest else ", other rows"))
        )
