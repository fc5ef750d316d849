"""
Fidelity of influence estimators against retraining: the linear datamodeling score (LDS) and
leave-one-out sign agreement.

Influence scores claim to predict what retraining would do. :func:`validate` measures how well they
do, for any model that comes with a training function:

- **Linear datamodeling score** (Park et al., 2023, "TRAK"): ``n_models`` models are trained on
  random subsets ``S_1 … S_M`` of ``round(alpha · n)`` training examples (uniform, without
  replacement, each with its own seeded training run), and each query's outcome is measured on every
  one of them. With the package's convention (**positive = helpful**: removing the example would raise
  the query's loss), a linear datamodel predicts ``loss_q(S) ≈ c_q − Σ_{i∈S} τ(q, i)``, so the LDS of a
  query is the Spearman correlation, across the ``M`` subsets, between ``Σ_{i∈S_m} τ(q, i)`` and the
  measured ``−loss_q(S_m)`` (``outcome="loss"``) or the measured margin (``outcome="margin"``, where
  higher is better too). **Higher LDS = better** (1: the estimator ranks the subsets exactly as
  retraining does; 0: no better than chance). The reported LDS is the mean over queries, with a
  percentile bootstrap interval over queries.
- **Leave-one-out sign agreement**: for ``loo_queries`` queries and, per estimator, each query's
  ``loo_top`` training examples of largest ``|τ(q, i)|``, the model is retrained without the example
  with ``loo_seeds`` seeds, and the measured loss change ``mean_s [loss_q(without i, s) − loss_q(all, s)]``
  is compared with the predicted sign (``τ > 0`` predicts a rise). Reported: the share of pairs whose
  signs agree, with a Clopper–Pearson interval (pairs share queries and retrained models, so the
  interval is optimistic).

The influence being validated is computed on the model trained on the whole set with ``seed``; its
weights' digest is kept in the report (``model_digest``) so that an audit can state the fidelity of
exactly the model it audited.
"""

from art_malleability.validation.lds import (
    OUTCOMES,
    LDSResult,
    TrainFn,
    linear_datamodeling_score,
    sign_agreement,
    subset_sums,
)
from art_malleability.validation.report import EstimatorFidelity, ValidationReport
from art_malleability.validation.run import estimator_label, validate

__all__ = [
    "OUTCOMES",
    "EstimatorFidelity",
    "LDSResult",
    "TrainFn",
    "ValidationReport",
    "estimator_label",
    "linear_datamodeling_score",
    "sign_agreement",
    "subset_sums",
    "validate",
]
