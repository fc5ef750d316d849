"""
The audit: influence on clean training data, ART attacks on that data, influence again, metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.estimators.classification import PyTorchClassifier
from torch.utils.data import DataLoader, Dataset

from art_malleability._utils.checks import (
    SignatureParams,
    check_features,
    check_labels,
    check_range,
    near_chance_warnings,
)
from art_malleability._utils.provenance import library_versions, weights_digest
from art_malleability._utils.state import preserved
from art_malleability._utils.torch_utils import model_device_dtype, resolve_device
from art_malleability.audit._classifier import ESTIMATOR_REQUIREMENTS, as_classifier
from art_malleability.audit._estimate import AuditEstimate, estimate_audit
from art_malleability.audit._run import AuditRun, timed
from art_malleability.audit.attacks import ATTACK_NAMES, attack_label
from art_malleability.audit.params import (
    CLASSIFIER_ARGS,
    audit_refits,
    build_attacks,
    build_influence,
    check_params,
    check_query_budget,
    default_queries,
    planned_work,
)
from art_malleability.audit.report import MalleabilityReport
from art_malleability.data.input_pipeline import pipeline_operations
from art_malleability.data.streaming import ExampleSource, is_torch_data
from art_malleability.distributed import Shard, current_shard
from art_malleability.influence import InfluenceEstimator
from art_malleability.metrics import top_k_count
from art_malleability.models.reference import is_transductive
from art_malleability.validation import ValidationReport, estimator_label

logger = logging.getLogger(__name__)


class MalleabilityEstimator:
    """
    Audit how much a classifier's reliance on its training data changes when that data is perturbed
    adversarially (the *influence flip rate* of Miñoza et al., 2026).

    :meth:`evaluate` computes the influence of every training example on a set of queries (matrix of
    shape (n_query, n_train), **positive = helpful**: removing the example would raise the query's
    loss), takes the ``top_fraction`` most influential examples (by ``|mean influence over queries|``),
    perturbs training data with each attack (strategy ``"top"``: the influential set only; ``"all"``:
    every example), recomputes the influence with the same trained weights, and reports the share of
    the influential set whose influence changed sign, with Spearman correlation, top-k overlap and
    bootstrap intervals over queries.

    A transductive model (one with ``set_context(x_train)``, such as MLP-Attn) gets its context set to
    the audited training set for the clean influence and to the perturbed set for the perturbed
    influence, on a private copy in the influence estimator's dtype (a float64 kernel of a float32 model
    uses a context computed and kept in float64); queries are mapped with that training-set context. Nothing the
    user passed is changed: weights, buffers, training mode, ``requires_grad`` flags, gradients, the
    loss's reduction, input arrays and global random states are restored on success and on failure.
    """

    #: ART's estimator check (``EstimatorError`` otherwise); a raw ``torch.nn.Module`` is wrapped into one.
    _estimator_requirements = ESTIMATOR_REQUIREMENTS

    #: The audit's parameters, read from the constructor's signature (all but what builds the classifier).
    estimator_params = SignatureParams(leave_out=CLASSIFIER_ARGS)

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
    ) -> None:
        """
        :param classifier: An ART :class:`PyTorchClassifier`, or a raw :class:`torch.nn.Module` together
               with ``input_shape`` and ``nb_classes`` (then wrapped with ``loss`` and ``clip_values``).
        :param attacks: Attack names (``"fgsm"``, ``"pgd"``, ``"mim"``; see :mod:`art_malleability.audit.attacks`
               for their steps) or ready ART ``EvasionAttack`` instances.
        :param eps: ℓ∞ budget of the named attacks, in input units (0.3 for pixels in [0, 1]).
        :param influence: ``"ntk"`` (kernel ridge leave-one-out on the empirical NTK, the paper's),
               ``"gradient"`` (TracIn at the final weights), ``"captum"`` (Captum's TracInCP), or an
               :class:`InfluenceEstimator` instance.
        :param top_fraction: Share of training examples in the influential set, in (0, 1].
        :param strategy: ``"top"`` perturbs the influential set, ``"all"`` every training example.
        :param ridge: Ridge λ of the NTK influence (> 0), or "loo" / "gcv" to choose it on the clean training set
            (see :class:`~art_malleability.influence.NTKInfluence`).
        :param n_queries: Number of query points (a seeded sample when more are available); ``None`` (default): every
               test point given, up to 10,000 (``DEFAULT_MAX_QUERIES``), or as many training examples when the queries
               come from the training set. More queries decide more signs (docs/metrics.md); every statistic's
               cost is linear in them, and a number whose metrics would not fit the memory is refused before any work.
        :param rank_by: Top-set ranking: ``"abs"`` (magnitude) or ``"signed"`` (most helpful).
        :param n_bootstrap: Bootstrap resamples over queries for the intervals.
        :param confidence: Coverage of the intervals.
        :param attack_max_iter: Steps of the named iterative attacks.
        :param batch_size: Batch size of the attacks and predictions.
        :param seed: Seed of every random choice (query sample, attacks' random starts, bootstrap).
        :param device: Device of the influence computation: ``"auto"``, ``"cpu"``, ``"cuda"``.
        :param verbose: Show progress bars.
        :param input_shape: Input shape, only with a raw module.
        :param nb_classes: Number of classes, only with a raw module.
        :param loss: ``"cross_entropy"`` or ``"mse"``, only with a raw module.
        :param clip_values: Valid input range, only with a raw module.
        :param model_name: Name of the model in the report (default: the module's class name).
        :param projection_dim: Mode of the NTK influence (see :class:`~art_malleability.influence.NTKInfluence`):
               ``"auto"`` (exact when its solve fits the memory, in memory or in tiles on disk, and its estimated
               time on this machine stays under 30 minutes; otherwise projected with ``k = 4096``, after a warning
               naming the options), ``None`` (always exact) or the projection dimension ``k``. The projection is
               seeded with ``seed``.
        :param distributed: ``"auto"`` (shard the audit over an initialised ``torch.distributed`` group of several
               processes, see :mod:`art_malleability.distributed`), ``True`` (require one) or ``False``.
        :param controls: Beside every ℓ∞ attack, perturb the same training examples by random signs at the same
               budget (:func:`~art_malleability.audit.attacks.random_sign_perturbation`), recompute the influence and
               report the control's metrics and the attack's *excess* flip rate (attack minus control, paired bootstrap
               interval). ``control_draws`` extra influence passes per distinct budget.
        :param control_draws: Independent draws of the random signs of each control; the control's statistics are
               their means, and the spread between draws enters the excess flip rate's interval.
        :param memory_limit_gb: Memory (GiB) the NTK influence's large matrices and the metrics may take; ``None``:
               80 % of the device's total memory (a fixed fact: the same command runs the same estimator whatever
               else the machine is doing, and stops with a ``MemoryError`` if it does not fit what is available now).
        :param time_budget_s: Longest estimated time (seconds) of the NTK influence's work in the audit (the fit, a
               refit per attack and control draw, the queries' scores after each) for ``projection_dim="auto"`` to
               run the exact mode (the NTK influence's ``exact_budget_s``); :meth:`estimate` gives the whole audit's.
        """
        self.classifier = as_classifier(classifier, input_shape, nb_classes, loss, clip_values, device, type(self))
        values = locals()
        for name in self.estimator_params:
            object.__setattr__(self, name, values[name])
        self.model_name = model_name or type(self.classifier.model).__name__
        self._configure()

    def __setattr__(self, name: str, value: Any) -> None:
        # after construction, assigning a parameter is set_params: validated, and what depends on it rebuilt; a new
        # public name is refused, as set_params refuses it (a typo such as ``epsilon`` would otherwise do nothing)
        configured = self.__dict__.get("_configured", False)
        if name in self.estimator_params and configured:
            self.set_params(**{name: value})
        elif configured and not name.startswith("_") and name not in self.__dict__ and not hasattr(type(self), name):
            import difflib

            close = difflib.get_close_matches(name, self.estimator_params, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(
                f"{type(self).__name__} attribute must be one of its parameters {self.estimator_params}, got the "
                f"unknown name {name!r}{hint}"
            )
        else:
            object.__setattr__(self, name, value)

    def set_params(self, **kwargs: Any) -> None:
        """
        Set parameters, ART's way: the values are validated and the attacks and the influence estimator rebuilt
        from them, so that :meth:`evaluate` runs what :meth:`get_params` describes. Assigning an attribute
        (``estimator.eps = 0.1``) does the same. On an invalid value nothing changes.

        :param kwargs: Parameters named in :attr:`estimator_params`.
        :raises ValueError: On an unknown name or an invalid value (``TypeError`` for a value of the wrong type).
        """
        unknown = sorted(set(kwargs) - set(self.estimator_params))
        if unknown:
            raise ValueError(
                f"set_params arguments must be among {self.estimator_params}, got unknown parameter(s) {unknown}"
            )
        saved = dict(self.__dict__)
        try:
            for name, value in kwargs.items():
                object.__setattr__(self, name, value)
            self._configure()
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def get_params(self) -> dict[str, Any]:
        """:return: The estimator's parameters as JSON-ready values (attacks and influence by name)."""
        params = {name: getattr(self, name) for name in self.estimator_params}
        params["attacks"] = [attack_label(a) for a in self._attacks]
        params["influence"] = getattr(self._influence, "name", type(self._influence).__name__)
        return params

    def _configure(self) -> None:
        """Validate the parameters, then build the attacks and the influence estimator from them."""
        object.__setattr__(self, "_configured", False)
        self._check_params()
        self._attacks = build_attacks(self)
        self._influence = build_influence(self)
        object.__setattr__(self, "_configured", True)

    def _check_params(self) -> None:
        """ART's parameter check (see :func:`~art_malleability.audit.params.check_params`)."""
        check_params(self)

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
        shape, nb_classes = tuple(clf.input_shape), int(clf.nb_classes)
        pipeline_operations(clf)  # an input pipeline the influence cannot follow fails before any work
        self._check_budget()
        source = self._source(x, y, "x", shape, nb_classes)
        input_warnings = self._check_outputs(source)
        k = top_k_count(source.n, self.top_fraction)
        if k < 1:
            raise ValueError(
                f"x must hold at least {int(np.ceil(1 / self.top_fraction))} examples for "
                f"top_fraction={self.top_fraction}, got {source.n}; with fewer the influential set is empty"
            )
        if (x_test is None) != (y_test is None) and not is_torch_data(x_test):
            given = "x_test" if y_test is None else "y_test"
            raise ValueError(f"x_test and y_test must be given together (both or neither), got {given} alone")
        shard = current_shard(self.distributed)
        if shard.world_size > source.n:
            raise ValueError(
                f"x must hold at least one example per process, got {source.n} examples for the "
                f"{shard.world_size} processes of the process group"
            )
        shard.agree((source.n, weights_digest(clf.model)), "the classifier's weights and the size of x")
        rng = np.random.default_rng(self.seed)
        wanted = default_queries(self.n_queries)
        if x_test is not None:
            test = self._source(x_test, y_test, "x_test", shape, nb_classes)
            rows = np.arange(test.n)
            if len(rows) > wanted:
                rows = np.sort(rng.choice(len(rows), wanted, replace=False))
            (x_q, y_q), self_pairs, queries = test.take(rows, self.batch_size), None, test
        else:
            if source.n < 2:
                raise ValueError(
                    f"x must hold at least 2 examples when the queries are drawn from it (x_test=None), got {source.n}"
                )
            rows = np.sort(rng.choice(source.n, min(wanted, source.n), replace=False))
            (x_q, y_q), self_pairs, queries = source.take(rows, self.batch_size), rows, source
        self._check_queries(len(x_q), source.n, k, self_pairs is not None)
        if len(x_q) < 2:
            message = ("x_test holds a single query point: every interval resamples the queries and needs two or more, "
                       "so the intervals are null; pass more test points")
            logger.warning(message)
            input_warnings.append(message)

        if validation is not None and not hasattr(validation, "fidelity"):
            validation = ValidationReport.load(validation)
        with preserved(clf.model, clf.loss), planned_work(self._influence, audit_refits(self), len(x_q)):
            report = self._audit(source, queries, x_q, y_q, self_pairs, k, dataset, shard)
        report.warnings.extend(input_warnings)
        if validation is not None:
            self._state_fidelity(report, validation)
        return report

    def _state_fidelity(self, report: MalleabilityReport, validation: Any) -> None:
        """Put the validated fidelity of the estimator that ran into the report (or a warning why not)."""
        label = estimator_label(self._influence)
        if validation.model_digest != weights_digest(self.classifier.model):
            report.warnings.append(
                f"the validation given is for other weights ({validation.model}, digest "
                f"{validation.model_digest[:12]}) than the audited classifier's; its fidelity is not stated"
            )
            return
        fidelity = validation.fidelity(label)
        if fidelity is None:
            report.warnings.append(
                f"the validation given has no result for the estimator that ran ({label}); it holds "
                f"{sorted(validation.results)}"
            )
            return
        report.fidelity = fidelity

    def _source(self, x: Any, y: Any, name: str, shape: tuple[int, ...], nb_classes: int) -> ExampleSource:
        if is_torch_data(x):
            return ExampleSource(
                x, y, input_shape=shape, nb_classes=nb_classes, name=name, clip_values=self.classifier.clip_values
            )
        x = check_features(x, name, shape)
        check_range(x, name, self.classifier.clip_values)
        return ExampleSource(x, check_labels(y, "y" + name[1:], len(x), nb_classes), name=name)

    def _check_queries(self, n_query: int, n_train: int, k: int, from_train: bool) -> None:
        """The metrics of ``n_query`` queries must fit the memory before any work starts (``check_query_budget``)."""
        limit = self.memory_limit_gb if self.memory_limit_gb is not None else getattr(
            self._influence, "memory_limit_gb", None)
        check_query_budget(n_query, n_train, k, self.n_bootstrap, from_train, limit, resolve_device(self.device))

    def estimate(self, x: Any, x_test: Any = None) -> AuditEstimate:
        """
        What :meth:`evaluate` on these inputs is estimated to take, before any long work (the classifier need not be
        trained: its architecture decides the sizes): the NTK influence's mode and why, the seconds of the influence,
        the attacks and the metrics, and the peak memory, from the sizes, the options and fixed facts of the machine
        (operations counted at a nominal rate; nothing is timed, so the same inputs always get the same estimate).
        Its :meth:`~art_malleability.audit._estimate.AuditEstimate.summary` is the line the command line prints.

        :param x: The training inputs (an array or a dataset of ``(x, y)`` pairs).
        :param x_test: The query inputs, or ``None`` (queries drawn from the training set).
        :return: An :class:`~art_malleability.audit._estimate.AuditEstimate`.
        """
        n_train = len(x)
        wanted = default_queries(self.n_queries)
        n_query = min(wanted, len(x_test) if x_test is not None else n_train)
        rows = range(n_train) if is_transductive(self.classifier.model) else range(min(n_train, 64))
        inputs = np.stack([np.asarray(x[i][0] if is_torch_data(x) else x[i]) for i in rows]).astype(np.float32)
        return estimate_audit(self, n_train, n_query, audit_refits(self), inputs)

    def _check_budget(self) -> None:
        """An ℓ∞ budget that covers the whole valid input range is a unit mistake (8 meant as 8/255), not an audit."""
        clip = self.classifier.clip_values
        named = any(isinstance(a, str) for a in self.attacks)
        if clip is not None and named and self.eps >= float(np.max(np.asarray(clip[1]) - np.asarray(clip[0]))):
            raise ValueError(
                f"eps must be smaller than the classifier's whole input range clip_values={tuple(map(float, clip))}, "
                f"got {self.eps:g}; give eps in the input's units (e.g. 8/255, not 8)"
            )

    def _check_outputs(self, source: ExampleSource) -> list[str]:
        """
        The model's weights must be finite and it must return one tensor of ``nb_classes`` logits per example; every
        label is read (and, for a dataset, every batch checked against ``clip_values``).

        :return: Warnings on the labels.
        """
        model = self.classifier.model
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(
                    f"classifier.model must have finite weights, got {int((~torch.isfinite(tensor)).sum())} NaN or "
                    f"infinite value(s) in {name!r}; the training that produced them diverged"
                )
        x_one, _ = source.take(np.arange(1), 1)
        device, dtype = model_device_dtype(model)
        with preserved(model, None), torch.no_grad():
            model.eval()
            out = model(torch.as_tensor(x_one, device=device, dtype=dtype))
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"classifier.model must return one tensor of logits (n, nb_classes), got {type(out).__name__}; "
                "wrap it so that forward returns the logits alone"
            )
        if out.ndim != 2 or out.shape[1] != int(self.classifier.nb_classes):
            raise ValueError(
                f"classifier.model must return outputs of shape (n, {self.classifier.nb_classes}) for the classifier's "
                f"nb_classes={self.classifier.nb_classes}, got {tuple(out.shape)}; build the PyTorchClassifier with "
                "the model's output width"
            )
        labels = source.labels(self.batch_size * 8)
        present = np.unique(labels)
        if len(present) < 2:
            message = (f"y holds a single class ({int(present[0])}) of the classifier's {self.classifier.nb_classes}: "
                       "the influence and the flip rates describe that class only")
            logger.warning(message)
            return [message]
        return []

    def _accuracy(self, data: ExampleSource, shard: Shard) -> tuple[float, np.ndarray]:
        """Clean accuracy on a source (each process its shard) and the source's labels."""
        start, stop = shard.bounds(data.n)
        correct = 0
        for _, xb, yb in data.batches(self.batch_size * 8, start, stop):
            correct += int(np.sum(self.classifier.predict(xb, batch_size=self.batch_size).argmax(axis=1) == yb))
        correct = int(shard.all_reduce(torch.tensor([correct], dtype=torch.int64))[0])
        return correct / data.n, data.labels(self.batch_size * 8)

    def _audit(self, source: ExampleSource, queries: ExampleSource, x_q: np.ndarray, y_q: np.ndarray,
               self_pairs: np.ndarray | None, k: int, dataset: str | None, shard: Shard) -> MalleabilityReport:
        """The audit proper, on checked inputs: accuracy, clean influence, controls, attacks, then the report."""
        run = AuditRun(self, source, x_q, y_q, self_pairs, shard)
        query_source = "test" if self_pairs is None else "train"
        with timed(run.seconds, "accuracy"):
            clean_accuracy, y_acc = self._accuracy(queries, shard)
            warnings = near_chance_warnings(clean_accuracy, y_acc, query_source)
        run.score_clean(k)
        control_metrics = run.run_controls()
        results = [run.run_attack(attack, control_metrics) for attack in self._attacks]
        run.steps.close()
        return MalleabilityReport(
            model=self.model_name,
            config=self.get_params(),
            n_train=source.n,
            n_queries=len(x_q),
            query_source=query_source,
            top_k=k,
            top_indices=run.top,
            clean_accuracy=clean_accuracy,
            scores_before=run.agg_before,
            results=results,
            seconds=run.seconds,
            versions=library_versions(),
            dataset=dataset,
            warnings=warnings + run.warnings(),
            execution=run.execution(),
            noise_model=run.noise_model(),
        )


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
    kwargs.setdefault("n_bootstrap", 1)
    report = MalleabilityEstimator(classifier, attacks=(attack,), **kwargs).evaluate(x, y, x_test, y_test)
    rate = report.results[0].flip_rate
    return float("nan") if rate is None else rate
