"""
The audit: influence on clean training data, ART attacks on that data, influence again, metrics.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.estimators.classification import PyTorchClassifier
from art.exceptions import EstimatorError
from art.utils import compute_success_array
from torch.utils.data import DataLoader, Dataset

from art_malleability._io import progress_bar
from art_malleability._state import preserved
from art_malleability._torch_utils import resolve_device
from art_malleability._validation import check_features, check_labels, check_range, loss_name, one_hot
from art_malleability.attacks import (
    ATTACK_NAMES,
    CONTROL_LABEL,
    STRATEGIES,
    attack_config,
    attack_label,
    control_eps,
    make_attack,
    perturb_training_set,
    random_sign_perturbation,
)
from art_malleability.distributed import Shard, current_shard, raise_if_any
from art_malleability.influence import INFLUENCE_NAMES, InfluenceEstimator, NTKInfluence, get_influence
from art_malleability.input_pipeline import pipeline_operations, with_input_pipeline
from art_malleability.metrics import (
    RANK_BY,
    aggregate_scores,
    malleability_metrics,
    top_indices,
    top_k_count,
    z_value,
)
from art_malleability.models import is_transductive
from art_malleability.ntk.projection import check_projection_dim
from art_malleability.report import AttackResult, MalleabilityReport
from art_malleability.streaming import ExampleSource, is_torch_data

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
    _estimator_requirements = ((PyTorchClassifier, torch.nn.Module),)

    estimator_params = [
        "attacks",
        "eps",
        "influence",
        "top_fraction",
        "strategy",
        "ridge",
        "n_queries",
        "rank_by",
        "n_bootstrap",
        "confidence",
        "attack_max_iter",
        "batch_size",
        "seed",
        "device",
        "verbose",
        "projection_dim",
        "distributed",
        "controls",
    ]

    def __init__(
        self,
        classifier: PyTorchClassifier | torch.nn.Module,
        attacks: Sequence[str | EvasionAttack] | str | EvasionAttack = ATTACK_NAMES,
        eps: float = 0.3,
        influence: str | InfluenceEstimator = "ntk",
        top_fraction: float = 0.1,
        strategy: str = "top",
        ridge: float = 1e-3,
        n_queries: int = 100,
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
    ) -> None:
        """
        :param classifier: An ART :class:`PyTorchClassifier`, or a raw :class:`torch.nn.Module` together
               with ``input_shape`` and ``nb_classes`` (then wrapped with ``loss`` and ``clip_values``).
        :param attacks: Attack names (``"fgsm"``, ``"pgd"``, ``"mim"``; see :mod:`art_malleability.attacks`
               for their steps) or ready ART ``EvasionAttack`` instances.
        :param eps: ℓ∞ budget of the named attacks, in input units (0.3 for pixels in [0, 1]).
        :param influence: ``"ntk"`` (kernel ridge leave-one-out on the empirical NTK, the paper's),
               ``"gradient"`` (TracIn at the final weights), ``"captum"`` (Captum's TracInCP), or an
               :class:`InfluenceEstimator` instance.
        :param top_fraction: Share of training examples in the influential set, in (0, 1].
        :param strategy: ``"top"`` perturbs the influential set, ``"all"`` every training example.
        :param ridge: Ridge λ of the NTK influence (> 0).
        :param n_queries: Number of query points (a seeded sample when more are available).
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
               ``"auto"`` (exact when ``n ≤ 10,000``, the ``n × n`` solve fits the memory and its estimated cost
               stays below about five minutes of a CPU; otherwise projected with ``k = 4096``), ``None`` (always
               exact) or the projection dimension ``k``. The projection is seeded with ``seed``.
        :param distributed: ``"auto"`` (shard the audit over an initialised ``torch.distributed`` group of several
               processes, see :mod:`art_malleability.distributed`), ``True`` (require one) or ``False``.
        :param controls: Beside every ℓ∞ attack, perturb the same training examples by random signs at the same
               budget (:func:`~art_malleability.attacks.random_sign_perturbation`), recompute the influence and report
               the control's metrics and the attack's *excess* flip rate (attack minus control, paired bootstrap
               interval). One extra influence pass per distinct budget.
        """
        self.classifier = self._as_classifier(classifier, input_shape, nb_classes, loss, clip_values, device)
        self.attacks = attacks
        self.eps = eps
        self.influence = influence
        self.top_fraction = top_fraction
        self.strategy = strategy
        self.ridge = ridge
        self.n_queries = n_queries
        self.rank_by = rank_by
        self.n_bootstrap = n_bootstrap
        self.confidence = confidence
        self.attack_max_iter = attack_max_iter
        self.batch_size = batch_size
        self.seed = seed
        self.device = device
        self.verbose = verbose
        self.projection_dim = projection_dim
        self.distributed = distributed
        self.controls = controls
        self.model_name = model_name or type(self.classifier.model).__name__
        self._configure()

    def __setattr__(self, name: str, value: Any) -> None:
        # after construction, assigning a parameter is set_params: validated, and what depends on it rebuilt
        if name in self.estimator_params and self.__dict__.get("_configured", False):
            self.set_params(**{name: value})
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
            raise ValueError(f"unknown parameter(s) {unknown}; MalleabilityEstimator takes {self.estimator_params}")
        saved = dict(self.__dict__)
        try:
            for name, value in kwargs.items():
                object.__setattr__(self, name, value)
            self._configure()
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def _configure(self) -> None:
        """Validate the parameters, then build the attacks and the influence estimator from them."""
        object.__setattr__(self, "_configured", False)
        self._check_params()
        self._attacks = [self._build_attack(a) for a in self.attacks]
        labels = [attack_label(a) for a in self._attacks]
        if len(set(labels)) != len(labels):
            raise ValueError(f"attacks must be distinct (one result per attack), got {labels}")
        self._influence = self._build_influence()
        object.__setattr__(self, "_configured", True)

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
               (see :mod:`art_malleability.streaming`).
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
                f"x has {source.n} training examples, too few for top_fraction={self.top_fraction}: the influential "
                f"set would be empty; pass at least {int(np.ceil(1 / self.top_fraction))} examples"
            )
        if (x_test is None) != (y_test is None) and not is_torch_data(x_test):
            raise ValueError("x_test and y_test must be given together (both or neither)")
        shard = current_shard(self.distributed)
        if shard is not None and shard.world_size > source.n:
            raise ValueError(
                f"the process group has {shard.world_size} processes but x has only {source.n} examples; "
                "every process needs at least one"
            )
        if shard is not None:
            shard.agree((source.n, weights_digest(clf.model)), "the classifier's weights and the size of x")
        rng = np.random.default_rng(self.seed)
        if x_test is not None:
            test = self._source(x_test, y_test, "x_test", shape, nb_classes)
            rows = np.arange(test.n)
            if len(rows) > self.n_queries:
                rows = np.sort(rng.choice(len(rows), self.n_queries, replace=False))
            (x_q, y_q), self_pairs, queries = test.take(rows, self.batch_size), None, test
        else:
            if source.n < 2:
                raise ValueError("x needs at least 2 examples when queries are drawn from it (x_test is None)")
            rows = np.sort(rng.choice(source.n, min(self.n_queries, source.n), replace=False))
            (x_q, y_q), self_pairs, queries = source.take(rows, self.batch_size), rows, source

        if validation is not None and not hasattr(validation, "fidelity"):
            from art_malleability.validation import ValidationReport

            validation = ValidationReport.load(validation)
        with preserved(clf.model, clf.loss):
            report = self._audit(source, queries, x_q, y_q, self_pairs, k, dataset, shard)
        report.warnings.extend(input_warnings)
        if validation is not None:
            self._state_fidelity(report, validation)
        return report

    def _state_fidelity(self, report: MalleabilityReport, validation: Any) -> None:
        """Put the validated fidelity of the estimator that ran into the report (or a warning why not)."""
        from art_malleability.validation import estimator_label

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
            return ExampleSource(x, y, input_shape=shape, nb_classes=nb_classes, name=name)
        x = check_features(x, name, shape)
        check_range(x, name, self.classifier.clip_values)
        return ExampleSource(x, check_labels(y, "y" + name[1:], len(x), nb_classes), name=name)

    def _check_budget(self) -> None:
        """An ℓ∞ budget that covers the whole valid input range is a unit mistake (8 meant as 8/255), not an audit."""
        clip = self.classifier.clip_values
        named = any(isinstance(a, str) for a in self.attacks)
        if clip is not None and named and self.eps >= float(np.max(np.asarray(clip[1]) - np.asarray(clip[0]))):
            raise ValueError(
                f"eps={self.eps:g} covers the classifier's whole input range clip_values={tuple(map(float, clip))}: "
                "every input could become any other; give eps in the input's units (e.g. 8/255, not 8)"
            )

    def _check_outputs(self, source: ExampleSource) -> list[str]:
        """The model must return one tensor of ``nb_classes`` logits per example; :return: warnings on the labels."""
        x_one, _ = source.take(np.arange(1), 1)
        model = self.classifier.model
        with preserved(model, None), torch.no_grad():
            model.eval()
            param = next(iter(model.parameters()), None)
            out = model(torch.as_tensor(x_one, device=None if param is None else param.device,
                                        dtype=None if param is None else param.dtype))
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"the classifier's model must return one tensor of logits (n, nb_classes), got {type(out).__name__}; "
                "wrap it so that forward returns the logits alone"
            )
        if out.ndim != 2 or out.shape[1] != int(self.classifier.nb_classes):
            raise ValueError(
                f"the classifier's model returns outputs of shape {tuple(out.shape)} but the classifier has "
                f"nb_classes={self.classifier.nb_classes}; build the PyTorchClassifier with the model's output width"
            )
        labels = source.labels(self.batch_size * 8)
        present = np.unique(labels)
        if len(present) < 2:
            message = (f"y holds a single class ({int(present[0])}) of the classifier's {self.classifier.nb_classes}: "
                       "the influence and the flip rates describe that class only")
            logger.warning(message)
            return [message]
        return []

    def _accuracy(self, data: ExampleSource, shard: Shard | None) -> tuple[float, np.ndarray]:
        """Clean accuracy on a source (each process its shard) and the source's labels."""
        start, stop = shard.bounds(data.n) if shard is not None else (0, data.n)
        correct = 0
        for _, xb, yb in data.batches(self.batch_size * 8, start, stop):
            correct += int(np.sum(self.classifier.predict(xb, batch_size=self.batch_size).argmax(axis=1) == yb))
        if shard is not None:
            correct = int(shard.all_reduce(torch.tensor([correct], dtype=torch.int64))[0])
        return correct / data.n, data.labels(self.batch_size * 8)

    def _audit(self, source, queries, x_q, y_q, self_pairs, k, dataset, shard) -> MalleabilityReport:
        clf, nb_classes = self.classifier, int(self.classifier.nb_classes)
        work = copy.deepcopy(clf.model)
        transductive = is_transductive(work)
        influence = self._influence
        dtype = getattr(influence, "dtype", None)
        if transductive and isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            # the context is computed, and stored, in the influence's dtype (a float64 kernel of a float32
            # model must not see a context rounded to float32)
            work = work.to(dtype=dtype)
        work = with_input_pipeline(work, clf)  # the influence sees what classifier.predict feeds the model
        if shard is not None and not (isinstance(influence, NTKInfluence) and influence.projection_dim is not None):
            raise ValueError(
                "a sharded audit needs the projected NTK influence (influence='ntk' with projection_dim 'auto' or "
                f"an integer); got {type(influence).__name__} with this configuration, which runs in one process"
            )
        controls = {}
        if self.controls:
            controls = {a: eps for a in self._attacks if (eps := control_eps(a)) is not None}
        n_controls = len(set(controls.values()))
        seconds: dict[str, float] = {}
        steps = progress_bar(total=1 + 2 * len(self._attacks) + n_controls, desc="malleability", verbose=self.verbose)
        # transductive models need the whole training set as their context: read it into an array
        x_all = source.arrays(self.batch_size * 8)[0] if transductive else None
        y = source.labels(self.batch_size * 8)
        train_data = x_all if x_all is not None else source.given

        def scores_now(estimator: InfluenceEstimator) -> np.ndarray:
            scores = estimator.scores(x_q, y_q)
            if self_pairs is not None:
                scores[np.arange(len(self_pairs)), self_pairs] = np.nan
            if shard is not None:  # rank 0's copy everywhere: every process then takes the same top set
                scores = shard.broadcast_object(scores)
            return scores

        def fit_on(estimator: InfluenceEstimator, x_train: Any, warm_start: bool = False) -> None:
            if transductive:
                work.set_context(x_train)
            if is_torch_data(x_train):
                estimator.fit(work, x_train, warm_start=warm_start)
            else:
                estimator.fit(work, x_train, y, warm_start=warm_start)
            if shard is not None and getattr(estimator, "shard_", None) != shard:
                raise ValueError(
                    "the influence estimator did not shard over the process group (its distributed is "
                    f"{getattr(estimator, 'distributed', None)!r}); pass distributed='auto' or True to it"
                )

        def perturbed_scores(rows: np.ndarray, x_new: np.ndarray) -> np.ndarray:
            """Influence with this process's training rows ``rows`` replaced by ``x_new``."""
            if transductive:
                rows_all, new_all = rows, x_new
                if shard is not None:
                    rows_all = shard.all_gather_rows(torch.as_tensor(rows)).numpy()
                    new_all = shard.all_gather_rows(torch.as_tensor(x_new)).numpy()
                x_full = x_all.copy()
                x_full[rows_all] = new_all
                fit_on(influence, x_full, warm_start=True)  # the same random projection as the clean fit
            else:
                influence.refit(rows, x_new)
            return scores_now(influence)

        def second_seed_scores() -> np.ndarray | None:
            """Clean aggregate scores of a twin estimator with the next projection seed (``None``: not projected)."""
            twin = type(influence)(**{**influence.get_params(), "projection_seed": influence.projection_seed + 1})
            fit_on(twin, train_data)
            if getattr(twin, "mode_", None) != "projected" or twin.projector_.is_exact:
                return None
            return aggregate_scores(scores_now(twin))

        start = time.perf_counter()
        clean_accuracy, y_acc = self._accuracy(queries, shard)
        warnings = near_chance_warnings(clean_accuracy, y_acc, "test" if self_pairs is None else "train")
        seconds["accuracy"] = time.perf_counter() - start
        twin_first = _projection_likely(influence, source.n, shard)
        twin = None
        if twin_first:  # large runs: before the clean fit, so that two fitted estimators never share the memory
            steps.set_postfix_str("influence (second projection seed)")
            start = time.perf_counter()
            twin = second_seed_scores()
            seconds["influence_second_seed"] = time.perf_counter() - start
        steps.set_postfix_str("influence (clean)")
        start = time.perf_counter()
        fit_on(influence, train_data)
        before = scores_now(influence)
        seconds["influence_clean"] = time.perf_counter() - start
        steps.update()
        agg_before = aggregate_scores(before)
        projected = getattr(influence, "mode_", None) == "projected" and not influence.projector_.is_exact
        noise = None
        if projected:
            if not twin_first:
                start = time.perf_counter()
                twin = second_seed_scores()
                seconds["influence_second_seed"] = time.perf_counter() - start
            noise = _seed_noise(agg_before, twin)
        top = top_indices(agg_before, k, self.rank_by)
        perturbed = top if self.strategy == "top" else np.arange(source.n)
        lo, hi = shard.bounds(source.n) if shard is not None else (0, source.n)
        local = np.sort(perturbed[(perturbed >= lo) & (perturbed < hi)])

        def metrics_of(after: np.ndarray, control: dict | None = None) -> dict:
            result = None
            if shard is None or shard.rank == 0:
                result = malleability_metrics(
                    before, after, self.top_fraction, self.rank_by, self.n_bootstrap, self.confidence, self.seed,
                    top, noise=noise or 0.0, control=control, keep_draws=True,
                )
            return shard.broadcast_object(result) if shard is not None else result

        control_metrics: dict[float, dict] = {}
        for eps in sorted(set(controls.values())):
            steps.set_postfix_str(f"control eps={eps:g}")
            start = time.perf_counter()
            error, x_ctrl = None, None
            try:
                x_ctrl = self._control_rows(source, local, eps)
            except Exception as failure:  # noqa: BLE001 - handed to every process below
                error = failure
            raise_if_any(shard, error)
            after = perturbed_scores(local, x_ctrl)
            control_metrics[eps] = metrics_of(after)
            seconds[f"control_eps_{eps:g}"] = time.perf_counter() - start
            steps.update()

        results = []
        for attack in self._attacks:
            label = attack_label(attack)
            timing = {}
            steps.set_postfix_str(f"attack {label}")
            start = time.perf_counter()
            error, x_adv, changed, linf = None, None, 0, 0.0
            try:
                x_adv, changed, linf = self._attack_rows(attack, source, local, nb_classes)
            except Exception as failure:  # noqa: BLE001 - handed to every process below
                error = failure
            raise_if_any(shard, error)  # nobody waits in a collective for a process that failed
            success, linf = self._combine_attack_stats(changed, linf, len(perturbed), shard)
            timing["attack"] = time.perf_counter() - start
            steps.update()
            steps.set_postfix_str(f"influence ({label})")
            start = time.perf_counter()
            after = perturbed_scores(local, x_adv)
            timing["influence"] = time.perf_counter() - start
            start = time.perf_counter()
            control = control_metrics.get(controls.get(attack))
            metrics = metrics_of(after, control)
            timing["metrics"] = time.perf_counter() - start
            steps.update()
            draws = metrics.pop("draws")
            if control is not None:
                draws["control_flip_rate"] = control["draws"]["flip_rate"]
            results.append(
                AttackResult(
                    attack=label,
                    params=attack_config(attack),
                    n_perturbed=len(perturbed),
                    attack_success=success,
                    max_perturbation=linf,
                    scores_after=aggregate_scores(after),
                    seconds=timing,
                    control=_control_summary(control, controls.get(attack)),
                    replicates=draws,
                    **metrics,
                )
            )
            logger.info("%s: flip rate %.3f", label, metrics["flip_rate"])
        steps.close()
        missing = [attack_label(a) for a in self._attacks if a not in controls]
        if self.controls and missing:
            warnings.append(
                f"no random-perturbation control for {missing}: a control needs an l-inf attack with one scalar eps"
            )
        if projected:
            warnings.append(
                f"influence from a {influence.projection_dim_}-dimensional random projection of the NTK features: "
                "at small ridges its scores agree only loosely with the exact NTK influence, and two projection "
                "seeds can disagree (measured in docs/scale.md); compare seeds before trusting these flip rates"
            )
        return MalleabilityReport(
            model=self.model_name,
            config=self.get_params(),
            n_train=source.n,
            n_queries=len(x_q),
            query_source="test" if self_pairs is None else "train",
            top_k=k,
            top_indices=top,
            clean_accuracy=clean_accuracy,
            scores_before=agg_before,
            results=results,
            seconds=seconds,
            versions=library_versions(),
            dataset=dataset,
            warnings=warnings,
            execution=self._execution(influence, shard),
            noise_floor=self._noise_floor_record(noise),
        )

    def _attack_rows(
        self, attack: EvasionAttack, source: ExampleSource, rows: np.ndarray, nb_classes: int
    ) -> tuple[np.ndarray, int, float]:
        """
        Run the attack on some training rows, in chunks read from the source. numpy's global
        generator is seeded with ``seed`` plus the chunk's offset for every chunk: attacks with random
        starts (not the named ones, which are deterministic) therefore depend on the chunking, and a
        sharded run differs from a single-process one for them.

        :return: ``(x_adv rows, number whose prediction changed, largest ℓ∞ change)``.
        """
        x_adv = np.empty((len(rows), *source.input_shape), dtype=np.float32)
        changed, linf = 0, 0.0
        chunk = max(self.batch_size * 8, 1)
        bar = progress_bar(total=len(rows), desc=f"attack {attack_label(attack)}", unit="ex", leave=False,
                           verbose=self.verbose and len(rows) > chunk)
        for s, xb, yb in source.batches(chunk, indices=rows):
            labels = one_hot(yb, nb_classes)
            adv = perturb_training_set(attack, xb, labels, np.arange(len(xb)), seed=self.seed + s)
            x_adv[s : s + len(xb)] = adv
            changed += int(np.sum(compute_success_array(self.classifier, xb, labels, adv, batch_size=self.batch_size)))
            linf = max(linf, float(np.max(np.abs(adv - xb))) if len(xb) else 0.0)
            bar.update(len(xb))
        bar.close()
        return x_adv, changed, linf

    def _control_rows(self, source: ExampleSource, rows: np.ndarray, eps: float) -> np.ndarray:
        """The random-sign control of some training rows, read from the source in chunks."""
        x_ctrl = np.empty((len(rows), *source.input_shape), dtype=np.float32)
        clip = self.classifier.clip_values
        for s, xb, _ in source.batches(max(self.batch_size * 8, 1), indices=rows):
            x_ctrl[s : s + len(xb)] = random_sign_perturbation(xb, rows[s : s + len(xb)], eps, clip, seed=self.seed)
        return x_ctrl

    def _noise_floor_record(self, noise: float | None) -> dict[str, Any]:
        """How the noise floor of the ``flip_rate_above_floor`` metrics was set."""
        return {
            "rule": "a flip counts when the clean and the perturbed aggregate score both exceed "
            "z * sqrt(SE^2 + projection_sd^2) in magnitude (SE: standard error of the mean over queries)",
            "z": z_value(self.confidence),
            "projection_sd": 0.0 if noise is None else noise,
            "projection_seeds": None if noise is None else [int(self.seed), int(self.seed) + 1],
        }

    @staticmethod
    def _combine_attack_stats(changed: int, linf: float, total: int, shard: Shard | None) -> tuple[float, float]:
        """Attack success (share of perturbed examples whose prediction changed) and ℓ∞ over all processes."""
        if shard is not None:
            changed = int(shard.all_reduce(torch.tensor([changed], dtype=torch.int64))[0])
            linf = float(shard.all_reduce(torch.tensor([linf], dtype=torch.float64), "max")[0])
        return changed / total, linf

    @staticmethod
    def _execution(influence: InfluenceEstimator, shard: Shard | None) -> dict[str, Any]:
        """What ran: the influence estimator's parameters and mode, and the process group."""
        params = {
            key: value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
            for key, value in influence.get_params().items()
        }
        details: dict[str, Any] = {"influence": type(influence).__name__, "params": params}
        if hasattr(influence, "mode_"):
            details["mode"] = influence.mode_
        if getattr(influence, "projector_", None) is not None:
            details["projection_dim"] = influence.projection_dim_
            details["projection_seed"] = influence.projection_seed
            details["projection_groups"] = influence.projector_.describe()
        details["world_size"] = 1 if shard is None else shard.world_size
        details["backend"] = None if shard is None else shard.backend
        return details

    def get_params(self) -> dict[str, Any]:
        """:return: The estimator's parameters as JSON-ready values (attacks and influence by name)."""
        params = {name: getattr(self, name) for name in self.estimator_params}
        params["attacks"] = [attack_label(a) for a in self._attacks]
        params["influence"] = getattr(self._influence, "name", type(self._influence).__name__)
        return params

    def _check_params(self) -> None:
        if isinstance(self.attacks, (str, EvasionAttack)):
            self.attacks = (self.attacks,)
        if not isinstance(self.attacks, (list, tuple)):
            raise TypeError(
                f"attacks must be an attack name, an ART EvasionAttack or a sequence of them, got "
                f"{type(self.attacks).__name__}"
            )
        self.attacks = tuple(self.attacks)
        if not self.attacks:
            raise ValueError("attacks must name at least one attack")
        for a in self.attacks:
            if not isinstance(a, (str, EvasionAttack)):
                raise TypeError(
                    f"attacks must hold names {ATTACK_NAMES} or ART EvasionAttack instances, got {type(a).__name__}"
                )
            if isinstance(a, str) and a not in ATTACK_NAMES:
                raise ValueError(f"attacks must name one of {ATTACK_NAMES}, got {a!r}")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float, np.number)):
            raise TypeError(f"eps must be a positive number, got {type(self.eps).__name__}")
        if not np.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"eps must be a positive finite number, got {self.eps!r}")
        self.eps = float(self.eps)
        if not isinstance(self.influence, (str, InfluenceEstimator)):
            raise TypeError(
                f"influence must be one of {INFLUENCE_NAMES} or an InfluenceEstimator, got {type(self.influence)}"
            )
        if isinstance(self.top_fraction, bool) or not 0.0 < float(self.top_fraction) <= 1.0:
            raise ValueError(f"top_fraction must lie in (0, 1], got {self.top_fraction!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, (int, float, np.number)):
            raise TypeError(f"ridge must be a positive number, got {type(self.ridge).__name__} {self.ridge!r}")
        if not (np.isfinite(self.ridge) and self.ridge > 0):
            raise ValueError(f"ridge must be a positive finite number, got {self.ridge!r}")
        if self.rank_by not in RANK_BY:
            raise ValueError(f"rank_by must be one of {RANK_BY}, got {self.rank_by!r}")
        for name in ("n_queries", "n_bootstrap", "attack_max_iter", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise TypeError(f"seed must be an integer, got {self.seed!r}")
        resolve_device(self.device)
        if self.projection_dim is not None and self.projection_dim != "auto":
            check_projection_dim(self.projection_dim)
        if self.distributed not in ("auto", True, False):
            raise ValueError(f"distributed must be 'auto', True or False, got {self.distributed!r}")
        if not isinstance(self.controls, bool):
            raise TypeError(f"controls must be True or False, got {self.controls!r}")

    def _build_attack(self, attack: str | EvasionAttack) -> EvasionAttack:
        if isinstance(attack, EvasionAttack):
            return attack
        return make_attack(attack, self.classifier, self.eps, self.attack_max_iter, self.batch_size)

    def _build_influence(self) -> InfluenceEstimator:
        if isinstance(self.influence, InfluenceEstimator):
            return self.influence
        if self.influence == "ntk":
            return get_influence(
                "ntk",
                ridge=float(self.ridge),
                device=self.device,
                projection_dim=self.projection_dim,
                projection_seed=int(self.seed),
                distributed=self.distributed,
                verbose=self.verbose,
            )
        return get_influence(self.influence, loss=loss_name(self.classifier), device=self.device)

    @staticmethod
    def _as_classifier(classifier, input_shape, nb_classes, loss, clip_values, device) -> PyTorchClassifier:
        if isinstance(classifier, PyTorchClassifier):
            return classifier
        if isinstance(classifier, torch.nn.Module):
            if input_shape is None or nb_classes is None:
                raise ValueError("a raw torch.nn.Module needs input_shape and nb_classes to be wrapped")
            from art_malleability.training import make_classifier

            return make_classifier(
                classifier, tuple(input_shape), int(nb_classes), loss=loss, clip_values=clip_values, device=device
            )
        raise EstimatorError(MalleabilityEstimator, list(MalleabilityEstimator._estimator_requirements), classifier)


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
        raise TypeError("influence_flip_rate measures one attack: pass it as attack=..., not attacks=...; use "
                        "MalleabilityEstimator(classifier, attacks=[...]).evaluate(x, y) for several")
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("n_bootstrap", 1)
    report = MalleabilityEstimator(classifier, attacks=(attack,), **kwargs).evaluate(x, y, x_test, y_test)
    rate = report.results[0].flip_rate
    return float("nan") if rate is None else rate


def _projection_likely(influence: InfluenceEstimator, n: int, shard: Shard | None) -> bool:
    """Whether an NTK influence will surely run projected (then its second seed is fitted before the clean fit)."""
    if not isinstance(influence, NTKInfluence) or influence.projection_dim is None:
        return False
    return influence.projection_dim != "auto" or shard is not None or n > influence.max_exact_n


def _seed_noise(first: np.ndarray, second: np.ndarray | None) -> float:
    """
    Standard deviation of one aggregate score due to the projection: the root mean square difference between
    two projection seeds over ``sqrt(2)`` (two independent draws differ by twice the variance).
    """
    if second is None:
        return 0.0
    gap = first - second
    gap = gap[np.isfinite(gap)]
    return float(np.sqrt(np.mean(gap**2) / 2.0)) if gap.size else 0.0


def _control_summary(control: dict | None, eps: float | None) -> dict[str, Any] | None:
    """The control's metrics as reported beside an attack."""
    if control is None:
        return None
    names = ("flip_rate", "flip_rate_above_floor", "spearman", "top_k_jaccard")
    summary: dict[str, Any] = {"perturbation": CONTROL_LABEL, "eps": eps}
    for name in names:
        summary[name], summary[name + "_ci"] = control[name], control[name + "_ci"]
    return summary


def near_chance_warnings(accuracy: float, y: np.ndarray, source: str) -> list[str]:
    """
    Flag a model close to chance: one that closes less than a quarter of the gap between the
    majority-class rate and perfect accuracy. Its influence scores describe a model that has learnt
    little, so its flip rates say little about a working model.
    """
    chance = float(np.bincount(y).max() / len(y))
    if accuracy - chance >= 0.25 * (1.0 - chance):
        return []
    message = (
        f"clean accuracy {100 * accuracy:.1f}% on the {source} set is close to chance "
        f"({100 * chance:.1f}% by always predicting the majority class); treat these flip rates with care"
    )
    logger.warning(message)
    return [message]


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (to check that every process audits the same model)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    names = ["art-malleability", "adversarial-robustness-toolbox", "torch", "captum", "numpy", "scipy"]
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found
