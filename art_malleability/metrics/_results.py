"""
The typed results of the malleability metrics: an estimate with its interval (:class:`Estimate`), the metrics of one
clean/perturbed pass (:class:`MalleabilityMetrics`), the random-sign control combined over its draws
(:class:`ControlMetrics`), and the replicates a control or a paired difference needs (:class:`Replicates`, on the
resamples named by :class:`ResamplingIdentity`).

Each result keeps its statistics under attributes; :meth:`MalleabilityMetrics.to_dict` and
:meth:`ControlMetrics.to_dict` give them under the keys of an audit's ``report.json`` (the noise-aware flip rate under
its earlier key ``flip_rate_above_floor``, each interval under ``<name>_ci``). Those keys live here only:
:data:`JSON_KEYS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Key of the retention's empirical-Bayes loadings among a pass's replicates (the squares of a pass's, of a control's
#: mean over draws, of an attack-minus-control difference sum to the variance its bootstrap misses).
EB_LOADINGS = "signed_retention_eb_loadings"

#: Report key of every statistic of a result: its attribute, and the key of its value (its interval: ``<key>_ci``).
JSON_KEYS = {
    "flip_rate": "flip_rate",
    "top_k_jaccard": "top_k_jaccard",
    "signed_retention": "signed_retention",
    "spearman": "spearman",
    "per_query_flip_rate": "per_query_flip_rate",
    "noise_aware_flip_rate": "flip_rate_above_floor",
    "excess_flip_rate": "excess_flip_rate",
    "excess_retention": "excess_retention",
}


@dataclass(frozen=True)
class Estimate:
    """
    A statistic with its interval; ``NaN`` marks what is undefined (an interval from a single query, a rate of an
    empty set).

    :param value: The point estimate.
    :param low: Lower end of the interval.
    :param high: Upper end of the interval.
    """

    value: float
    low: float
    high: float

    @classmethod
    def of(cls, value: float, interval: tuple[float, float]) -> Estimate:
        """
        :param value: The point estimate.
        :param interval: ``(low, high)``.
        :return: The estimate, its numbers as Python floats.
        """
        low, high = interval
        return cls(float(value), float(low), float(high))

    @classmethod
    def undefined(cls) -> Estimate:
        """:return: An estimate whose value and interval are all ``NaN``."""
        nan = float("nan")
        return cls(nan, nan, nan)

    @property
    def interval(self) -> tuple[float, float]:
        """The interval, ``(low, high)``."""
        return self.low, self.high


@dataclass(frozen=True)
class ResamplingIdentity:
    """
    What identifies the bootstrap resamples of the queries that a result's replicates were computed on: an attack and
    its control, or the draws of one control, must share them (the bootstrap is paired).

    :param seed: Seed of the resampling.
    :param n_bootstrap: Number of resamples (0 with fewer than two queries).
    :param digest: SHA-256 of the resampled rows (empty without resamples).
    """

    seed: int
    n_bootstrap: int
    digest: str

    def to_dict(self) -> dict[str, Any]:
        """:return: ``{"seed", "n_bootstrap", "digest"}``."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, eq=False)
class Replicates:
    """
    The replicates of the statistics that have them, one value per resample of the queries (bootstrap) or per left-out
    group (Spearman's jackknife): a control averages them over its draws, an excess differences them with the control's.

    :param resamples: The resamples they were computed on.
    :param flip_rate: The raw flip rate on each resample.
    :param top_k_jaccard: The top-k Jaccard on each resample.
    :param signed_retention: The signed retention on each resample.
    :param retention_loadings: The retention's empirical-Bayes loadings (the sum of their squares is the variance its
        bootstrap misses); ``None`` where not computed.
    :param spearman: Spearman's correlation with each jackknife group left out; ``None`` where not computed.
    """

    resamples: ResamplingIdentity
    flip_rate: np.ndarray
    top_k_jaccard: np.ndarray
    signed_retention: np.ndarray
    retention_loadings: np.ndarray | None = None
    spearman: np.ndarray | None = None

    @classmethod
    def from_draws(cls, draws: Mapping[str, np.ndarray], resamples: ResamplingIdentity) -> Replicates:
        """
        :param draws: The replicates by statistic, as :meth:`draws` gives them (loadings under :data:`EB_LOADINGS`).
        :param resamples: The resamples they were computed on.
        :return: The replicates.
        """
        return cls(resamples, draws["flip_rate"], draws["top_k_jaccard"], draws["signed_retention"],
                   draws.get(EB_LOADINGS), draws.get("spearman"))

    def draws(self) -> dict[str, np.ndarray]:
        """:return: The replicates by statistic (loadings under :data:`EB_LOADINGS`), those not computed left out."""
        found = {"flip_rate": self.flip_rate, "top_k_jaccard": self.top_k_jaccard,
                 "signed_retention": self.signed_retention, EB_LOADINGS: self.retention_loadings,
                 "spearman": self.spearman}
        return {name: values for name, values in found.items() if values is not None}

    @property
    def n_resamples(self) -> int:
        """The number of bootstrap resamples the replicates hold."""
        return len(self.flip_rate)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Replicates):
            return NotImplemented
        mine, theirs = self.draws(), other.draws()
        return self.resamples == other.resamples and mine.keys() == theirs.keys() and all(
            np.array_equal(mine[name], theirs[name], equal_nan=True) for name in mine
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, holding arrays


class _Legacy:
    """Key access to a result's :meth:`to_dict`, kept for callers written when the metrics were a dict."""

    def to_dict(self, replicates: bool = True) -> dict[str, Any]:  # pragma: no cover - every result defines it
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        """
        :param key: A key of :meth:`to_dict` (``result["flip_rate"]`` is ``result.flip_rate.value``).
        :return: Its value.
        """
        found = self.to_dict()
        if key not in found:
            raise KeyError(f"key must be one of {sorted(found)}, got {key!r}")
        return found[key]


def _put(out: dict[str, Any], attribute: str, estimate: Estimate) -> None:
    """A statistic and its interval under their report keys."""
    key = JSON_KEYS[attribute]
    out[key], out[key + "_ci"] = estimate.value, estimate.interval


def _with_replicates(out: dict[str, Any], replicates: Replicates | None) -> dict[str, Any]:
    if replicates is not None:
        out["draws"], out["resamples"] = replicates.draws(), replicates.resamples.to_dict()
    return out


@dataclass(frozen=True)
class MalleabilityMetrics(_Legacy):
    """
    The malleability metrics of one clean/perturbed pair of influence matrices
    (:func:`~art_malleability.metrics.malleability_metrics`); docs/metrics.md gives each statistic's estimand, interval
    and measured coverage.

    :param flip_rate: The raw flip rate: the share of the clean top set whose aggregate score changes sign (normal
        interval with the bootstrap's standard error).
    :param flip_rate_null: The raw flip rate expected from query noise alone.
    :param noise_aware_flip_rate: The share of the set whose population aggregate changes sign (empirical-Bayes
        deconvolution; profile-likelihood interval). Report key ``flip_rate_above_floor``.
    :param no_flip_statistic: Likelihood-ratio statistic of "no member of the set flips" (``χ²₁`` scale).
    :param undecided_share: Share of the set whose perturbed aggregate lies within one standard error of zero.
    :param per_query_flip_rate: The mean over queries of the flip rate within each query's own top set (Student-t).
    :param spearman: Spearman's correlation of the scores before and after (delete-a-group jackknife).
    :param top_k_jaccard: Jaccard overlap of the clean and perturbed top sets (normal, bootstrap standard error).
    :param signed_retention: How much of the set's clean influence the perturbed influence keeps, on balance.
    :param counted_flips: Members of the set whose posterior flip probability is at least one half.
    :param undecided_members: Members of the set whose perturbed aggregate lies within one standard error of zero
        (those ``undecided_share`` counts).
    :param excess_flip_rate: The flip rate minus the control's (paired interval); ``None`` without a control.
    :param excess_retention: The signed retention minus the control's; ``None`` without a control.
    :param replicates: The replicates and their resamples (``keep_draws=True``, as a control needs); else ``None``.
    """

    flip_rate: Estimate
    flip_rate_null: float
    noise_aware_flip_rate: Estimate
    no_flip_statistic: float
    undecided_share: float
    per_query_flip_rate: Estimate
    spearman: Estimate
    top_k_jaccard: Estimate
    signed_retention: Estimate
    counted_flips: tuple[int, ...] = ()
    undecided_members: tuple[int, ...] = ()
    excess_flip_rate: Estimate | None = None
    excess_retention: Estimate | None = None
    replicates: Replicates | None = None

    def to_dict(self, replicates: bool = True) -> dict[str, Any]:
        """
        The metrics under their report keys: each statistic's value and ``<key>_ci`` interval ``(low, high)``, the
        noise-aware rate under ``flip_rate_above_floor``, ``flip_rate_null``, ``no_flip_statistic``,
        ``undecided_share``, ``counted_flips`` and ``undecided_members`` (lists), the excesses where a control was
        given.

        :param replicates: Also give the replicates under ``"draws"`` and their resamples under ``"resamples"``
            (where kept).
        :return: A new dict (the arrays of the replicates are shared, not copied).
        """
        out: dict[str, Any] = {}
        for attribute in ("flip_rate", "top_k_jaccard", "signed_retention", "spearman", "per_query_flip_rate",
                          "noise_aware_flip_rate"):
            _put(out, attribute, getattr(self, attribute))
        out["flip_rate_null"] = self.flip_rate_null
        out["no_flip_statistic"] = self.no_flip_statistic
        out["undecided_share"] = self.undecided_share
        out["counted_flips"] = list(self.counted_flips)
        out["undecided_members"] = list(self.undecided_members)
        for attribute in ("excess_flip_rate", "excess_retention"):
            if getattr(self, attribute) is not None:
                _put(out, attribute, getattr(self, attribute))
        return _with_replicates(out, self.replicates if replicates else None)


@dataclass(frozen=True)
class ControlMetrics(_Legacy):
    """
    The random-sign control of an influential set, from several independent draws of its signs
    (:func:`~art_malleability.metrics.combine_controls`): every statistic is the mean over the draws.

    :param n_draws: The number of draws.
    :param flip_rate: Mean raw flip rate; its interval adds the variance between the draws over their number.
    :param flip_rate_null: Mean of the draws' raw flip rates expected from query noise alone.
    :param noise_aware_flip_rate: Mean noise-aware flip rate; its interval spans the draws' intervals.
    :param per_query_flip_rate: Mean per-query flip rate (no interval).
    :param spearman: Mean Spearman's correlation, jackknife interval of the draws' mean plus their spread.
    :param top_k_jaccard: Mean top-k Jaccard, interval as the flip rate's.
    :param signed_retention: Mean signed retention, interval as the flip rate's plus the empirical-Bayes error.
    :param draw_variance: The variance between the draws of each statistic, by report key.
    :param replicates: The draws' mean replicates on their shared resamples.
    """

    n_draws: int
    flip_rate: Estimate
    flip_rate_null: float
    noise_aware_flip_rate: Estimate
    per_query_flip_rate: Estimate
    spearman: Estimate
    top_k_jaccard: Estimate
    signed_retention: Estimate
    draw_variance: dict[str, float]
    replicates: Replicates

    def to_dict(self, replicates: bool = True) -> dict[str, Any]:
        """
        The control under its keys: ``n_draws``, ``draw_variance``, each statistic's value and ``<key>_ci``, the
        noise-aware rate under ``flip_rate_above_floor``, ``flip_rate_null``.

        :param replicates: Also give the replicates under ``"draws"`` and their resamples under ``"resamples"``.
        :return: A new dict (the arrays of the replicates are shared, not copied).
        """
        out: dict[str, Any] = {"n_draws": self.n_draws, "draw_variance": dict(self.draw_variance)}
        for attribute in ("flip_rate", "top_k_jaccard", "signed_retention", "spearman", "per_query_flip_rate",
                          "noise_aware_flip_rate"):
            _put(out, attribute, getattr(self, attribute))
        out["flip_rate_null"] = self.flip_rate_null
        return _with_replicates(out, self.replicates if replicates else None)
