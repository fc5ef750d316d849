"""
The audit: an ART classifier's influence on clean training data, ART's attacks on that data, the influence
again, and the report.

- :mod:`~art_malleability.audit.estimator`: :class:`MalleabilityEstimator` and :func:`influence_flip_rate`;
- :mod:`~art_malleability.audit.attacks`: ART's evasion attacks by name, the perturbation of training sets and
  the random-sign control;
- :mod:`~art_malleability.audit.report`: :class:`MalleabilityReport`, its text, JSON and Markdown writers and
  figures.

Private pieces: ``_run`` (the audit's steps once its inputs are checked), ``_params`` (ART's parameter
contract), ``_classifier`` (wrapping a raw module) and ``_report_nulls`` (why a value of the report is null).
"""

from art_malleability.audit.estimator import MalleabilityEstimator, influence_flip_rate
from art_malleability.audit.report import AttackResult, MalleabilityReport

__all__ = ["AttackResult", "MalleabilityEstimator", "MalleabilityReport", "influence_flip_rate"]
