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
  above :data:`SPEARMAN_PAIRS` of them).
* **Top-k overlap**: Jaccard index of the clean and perturbed aggregate top sets.
* **Signed retention**: ``Σ_j s_j μ_a,j / Σ_j s_j μ_b,j`` over the influential set, ``μ_b``/``μ_a`` the clean/perturbed
  *population* aggregates and ``s`` the measured clean signs: 1 influence unchanged, 0 wiped out, below 0 reversed on
  balance. Estimated with the selection of the set corrected (empirical Bayes on the clean aggregates, a regression on
  the clean noise for the perturbed ones: docs/metrics.md). A mean over the set, it is decided where single signs
  are not.
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

Results are typed: :func:`malleability_metrics` and :func:`pass_metrics` return a :class:`MalleabilityMetrics`,
:func:`combine_controls` a :class:`ControlMetrics`; each statistic is an :class:`Estimate` (``value``, ``low``,
``high``), and the replicates a control pairs with are a :class:`Replicates` on the resamples its
:class:`ResamplingIdentity` names. ``to_dict()`` gives a result under the keys of an audit's ``report.json`` (the
noise-aware rate under ``flip_rate_above_floor``, each interval under ``<key>_ci``), and ``result["flip_rate"]`` reads
one of them, as when the metrics were a dict.
"""

from __future__ import annotations

from art_malleability.metrics._bootstrap import (
    MIN_INTERVAL_QUERIES,
    TIE_VARIANCE_RATIO,
    check_confidence,
    jackknife_interval,
    normal_interval,
    percentile_interval,
    resample_rows,
    seed_interval,
    t_interval,
    z_value,
)
from art_malleability.metrics._flip_posterior import projection_noise
from art_malleability.metrics._matrices import (
    aggregate_jaccard,
    flip_rate,
    per_query_flip_rates,
    spearman,
    top_k_jaccard,
)
from art_malleability.metrics._noise_aware import noise_aware_flip_rate, selection_threshold
from art_malleability.metrics._results import (
    ControlMetrics,
    Estimate,
    MalleabilityMetrics,
    Replicates,
    ResamplingIdentity,
)
from art_malleability.metrics._scores import (
    RANK_BY,
    aggregate_scores,
    flip_mask,
    smallest_training_set,
    top_indices,
    top_k_count,
)
from art_malleability.metrics._spearman import SPEARMAN_PAIRS
from art_malleability.metrics._summary import (
    BOUNDS,
    VARIANCE_FACTOR,
    PassStatistics,
    combine_controls,
    malleability_metrics,
    pass_metrics,
    replicated,
)
from art_malleability.metrics.accumulators import QueryResampling, top_masks

__all__ = [
    "MIN_INTERVAL_QUERIES",
    "RANK_BY",
    "smallest_training_set",
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
    "PassStatistics",
    "replicated",
    "projection_noise",
    "SPEARMAN_PAIRS",
    "Estimate",
    "MalleabilityMetrics",
    "ControlMetrics",
    "Replicates",
    "ResamplingIdentity",
]
