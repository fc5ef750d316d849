"""
The audit: influence on clean training data, ART attacks on that data, influence again, metrics.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.estimators.classification import PyTorchClassifier
from torch.utils.data import DataLoader, Dataset

from art_malleability._utils.params import MIN_BOOTSTRAP
from art_malleability._utils.state import preserved
from art_malleability.audit import _classifier as inputs
from art_malleability.audit._estimate import AuditEstimate, estimate_audit
from art_malleability.audit._run import run_audit
from art_malleability.audit.attacks import ATTACK_NAMES
from art_malleability.audit.params import (
    AuditParams,
    audit_refits,
    default_queries,
    planned_work,
)
from art_malleability.audit.report import MalleabilityReport
from art_malleability.data.input_pipeline import pipeline_operations
from art_malleability.influence import InfluenceEstimator
from art_malleability.validation import ValidationReport

logger = logging.getLogger(__name__)


class MalleabilityEstimator(AuditParams):
    """
    Audit how much a classifier's reliance on its training data changes when that data is perturbed
    adversarially (the *influence flip rate* of Miñoza et al., 2026).

    :meth:`evaluate` computes the influence of every training example on a set of queries (matrix of shape
    (n_query, n_train), **positive = helpful**: removing the example would raise the query's loss), takes the
    ``top_fraction`` most influential examples (by ``|mean influence over queries|``), perturbs training data with
    each attack (strategy ``"top"``: the influential set only; ``"all"``: every example), recomputes the influence
    with the same trained weights, and reports the share of the influential set whose influence changed sign, with
    Spearman correlation, top-k overlap and bootstrap intervals over queries.

    A transductive model (one with ``set_context(x_train)``, such as MLP-Attn) gets its context set to the audited
    training set for the clean influence and to the perturbed set for the perturbed influence, on a private copy in
    the influence estimator's dtype; queries are mapped with that training-set context. Nothing the user passed is
    changed: weights, buffers, training mode, ``requires_grad`` flags, gradients, the loss's reduction, input arrays
    and global random states are restored on success and on failure.

    :param classifier: An ART :class:`PyTorchClassifier`, or a raw :class:`torch.nn.Module` together with
        ``input_shape`` and ``nb_classes`` (then wrapped with ``loss`` and ``clip_values``).
    :param attacks: Attack names (``"fgsm"``, ``"pgd"``, ``"mim"``; see :mod:`art_malleability.audit.attacks`) or
        ready ART ``EvasionAttack`` instances.
    :param eps: ℓ∞ budget of the named attacks, in input units (0.3 for pixels in [0, 1]).
    :param influence: ``"ntk"`` (kernel ridge leave-one-out on the empirical NTK, the paper's), ``"gradient"``
        (TracIn at the final weights), ``"captum"`` (Captum's TracInCP), or a configured :class:`InfluenceEstimator`
        such as ``NTKInfluence(ridge="loo", projection_dim=None)``, used as it is: an ``NTKInfluence``'s ``ridge``,
        ``projection_dim`` and ``exact_budget_s`` then become the audit's ``ridge``, ``projection_dim`` and
        ``time_budget_s``, which need not be repeated.
    :param top_fraction: Share of training examples in the influential set, in (0, 1].
    :param strategy: ``"top"`` perturbs the influential set, ``"all"`` every training example.
    :param ridge: The NTK influence's ``ridge`` (> 0, or ``"loo"`` / ``"gcv"``), see
        :class:`~art_malleability.influence.NTKInfluence`.
    :param n_queries: Number of query points (a seeded sample when more are available); ``None``: every test point
        given, up to 10,000 (``DEFAULT_MAX_QUERIES``), or as many training examples when the queries come from the
        training set. Every statistic's cost is linear in them; a number whose metrics would not fit the memory is
        refused before any work.
    :param rank_by: Top-set ranking: ``"abs"`` (magnitude) or ``"signed"`` (most helpful).
    :param n_bootstrap: Bootstrap resamples over queries for the intervals.
    :param confidence: Coverage of the intervals.
    :param attack_max_iter: Steps of the named iterative attacks.
    :param batch_size: Batch size of the attacks and predictions.
    :param seed: Seed of every random choice (query sample, attacks' random starts, bootstrap, NTK projection).
    :param device: Device of the influence computation: ``"auto"``, ``"cpu"``, ``"cuda"``.
    :param verbose: Show progress bars.
    :param input_shape: Input shape, only with a raw module.
    :param nb_classes: Number of classes, only with a raw module.
    :param loss: ``"cross_entropy"`` or ``"mse"``, only with a raw module.
    :param clip_values: Valid input range, only with a raw module.
    :param model_name: Name of the model in the report (default: the module's class name).
    :param projection_dim: The NTK influence's mode: ``"auto"``, ``None`` (exact) or the projection dimension ``k``,
        see :class:`~art_malleability.influence.NTKInfluence`.
    :param distributed: ``"auto"`` (shard over an initialised ``torch.distributed`` group of several processes, see
        :mod:`art_malleability.distributed`), ``True`` (require one) or ``False``.
    :param controls: Beside every ℓ∞ attack, perturb the same training examples by random signs at the same budget
        (:func:`~art_malleability.audit.attacks.random_sign_perturbation`) and report the control's metrics and the
        attack's *excess* flip rate (attack minus control, paired bootstrap interval).
    :param control_draws: Independent draws of each control's random signs (their mean is the control; their spread
        enters the excess flip rate's interval).
    :param memory_limit_gb: Memory (GiB) the NTK influence's large matrices and the metrics may take; ``None``: 80 %
        of the device's total memory (a fixed fact, so the same command runs the same way).
    :param time_budget_s: The NTK influence's ``exact_budget_s`` for the audit's work (the fit, a refit per attack and
        control draw, the queries' scores after each); :meth:`estimate` gives the whole audit's.
    :param work_dir: A work folder of finished stages (:mod:`art_malleability._utils.work_folder`): each attack's
        perturbed inputs are kept there, chunk by chunk, keyed by the model's weights and architecture, the rows,
        the attack's parameters, the seed, the dtype and the package's version, so that rerunning the same audit
        after an interruption reuses what was finished (the report is the same number for number). ``None``: nothing
        is kept. The folder is created where missing; an existing one must be empty or one the package created.
    """

    #: ART's estimator check (``EstimatorError`` otherwise); a raw ``torch.nn.Module`` is wrapped into one.
    _estimator_requirements = inputs.ESTIMATOR_REQUIREMENTS

    def __init__(
        self,
        classifier: PyTorchClassifier | torch.nn.Module,
        attacks: Sequence[str | EvasionAttack] | str | EvasionAttack = ATTACK_NAMES,
        eps: float = 0.3,
        influence: str | InfluenceEstimator = "ntk",
        top_fraction: float = 0.1,
        strategy: str = "top",
        ridge: float | str = 1e-3,
        n_queries: int | None = None,
        rank_by: str = "abs",
        n_bootstrap: int = 1000,
        confidence: float = 0.95,
        attack_max_iter: int = 20,
        batch_size: int = 128,
        seed: int = 0,
        device: str = "auto",
        verbose: bool = True,
        input_shape: tuple[int, ...] | None = None,
        nb_classes: int | None = None,
        loss: str = "cross_entropy",
        clip_values: tuple[float, float] | None = (0.0, 1.0),
        model_name: str | None = None,
        projection_dim: int | str | None = "auto",
        distributed: bool | str = "auto",
        controls: bool = True,
        control_draws: int = 5,
        memory_limit_gb: float | None = None,
        time_budget_s: float = 1800.0,
        work_dir: str | os.PathLike | None = None,
    ) -> None:
        self.classifier = inputs.as_classifier(classifier, input_shape, nb_classes, loss, clip_values, device,
                                               type(self))
        values = locals()
        for name in self.estimator_params:
            object.__setattr__(self, name, values[name])
        self.model_name = model_name or type(self.classifier.model).__name__
        self._configure()

    def evaluate(
        self,
        x: np.ndarray | Dataset | DataLoader,
        y: np.ndarray | None = None,
        x_test: np.ndarray | Dataset | DataLoader | None = None,
        y_test: np.ndarray | None = None,
        dataset: str | None = None,
        validation: Any = None,
    ) -> MalleabilityReport:
        """
        Audit the influence malleability of the classifier on its training data.

        :param x: Training inputs whose influence is audited, ``(n, *input_shape)``, in the classifier's input space;
               or a map-style ``torch.utils.data.Dataset`` / ``DataLoader`` of ``(x, y)`` pairs, read in batches
               (see :mod:`art_malleability.data.streaming`).
        :param y: Their labels: class indices (n,) or one-hot (n, nb_classes); ``None`` for a dataset.
        :param x_test: Query points (array or dataset); when omitted, a seeded sample of ``n_queries`` training
               examples is used and each query's score on itself is excluded.
        :param y_test: Labels of ``x_test``; ``None`` for a dataset.
        :param dataset: Optional name of the data set for the report.
        :param validation: A :class:`~art_malleability.validation.ValidationReport` (or the path of its folder or
               ``validation.json``) of this classifier's model: the report then states the fidelity against
               retraining (LDS, leave-one-out sign agreement) of the estimator that ran, under ``fidelity``. A
               validation of other weights (by their digest) or without this estimator is reported as a warning.
        :return: A :class:`MalleabilityReport`. In a sharded run every process returns the same report.
        """
        clf = self.classifier
        pipeline_operations(clf)  # an input pipeline the influence cannot follow fails before any work
        given = inputs.audit_inputs(self, x, y, x_test, y_test)
        if validation is not None and not hasattr(validation, "fidelity"):
            validation = ValidationReport.load(validation)
        with preserved(clf.model, clf.loss), planned_work(self._influence, audit_refits(self), len(given.x_q)):
            report = run_audit(self, given, dataset)
        report.warnings.extend(given.warnings)
        if validation is not None:
            inputs.state_fidelity(report, validation, self._influence, clf)
        return report

    def estimate(self, x: Any, x_test: Any = None) -> AuditEstimate:
        """
        What :meth:`evaluate` on these inputs is estimated to take, before any long work (the classifier need not be
        trained: its architecture decides the sizes): the NTK influence's mode and why, the seconds of the influence,
        the attacks and the metrics, and the peak memory, from the sizes, the options and fixed facts of the machine
        (nothing is timed, so the same inputs always get the same estimate). Its
        :meth:`~art_malleability.audit._estimate.AuditEstimate.summary` is the line the command line prints.

        :param x: The training inputs (an array or a dataset of ``(x, y)`` pairs).
        :param x_test: The query inputs, or ``None`` (queries drawn from the training set).
        :return: An :class:`~art_malleability.audit._estimate.AuditEstimate`.
        """
        n_query = min(default_queries(self.n_queries), len(x_test) if x_test is not None else len(x))
        return estimate_audit(self, len(x), n_query, audit_refits(self), inputs.probe_inputs(self.classifier, x))


def influence_flip_rate(
    classifier: PyTorchClassifier,
    x: np.ndarray,
    y: np.ndarray,
    attack: str | EvasionAttack = "pgd",
    x_test: np.ndarray | None = None,
    y_test: np.ndarray | None = None,
    **kwargs: Any,
) -> float:
    """
    Influence flip rate of one attack, in the style of :mod:`art.metrics`.

    :param classifier: An ART PyTorch classifier.
    :param x: Training inputs.
    :param y: Training labels (indices or one-hot).
    :param attack: Attack name or ART ``EvasionAttack`` instance.
    :param x_test: Optional query points.
    :param y_test: Their labels.
    :param kwargs: Further :class:`MalleabilityEstimator` parameters (``eps``, ``influence``, ``top_fraction``...).
    :return: Share of the most influential training examples whose influence changes sign (positive =
             helpful before and after).
    """
    if "attacks" in kwargs:
        raise TypeError(
            "attacks must not be given to influence_flip_rate, which measures one attack, got attacks=...; pass "
            "attack=..., or use MalleabilityEstimator(classifier, attacks=[...]).evaluate(x, y) for several"
        )
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("n_bootstrap", MIN_BOOTSTRAP)  # the point alone is returned: the fewest resamples
    report = MalleabilityEstimator(classifier, attacks=(attack,), **kwargs).evaluate(x, y, x_test, y_test)
    rate = report.results[0].flip_rate
    return float("nan") if rate is None else rate
