"""
The classifier an audit needs (an ART ``PyTorchClassifier``, or a raw ``torch.nn.Module`` wrapped into one) and the
checks of what an audit is given: the inputs against the classifier, the model's outputs, the budget's units.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np
import torch
from art.estimators.classification import PyTorchClassifier
from art.exceptions import EstimatorError

from art_malleability._utils.provenance import weights_digest
from art_malleability._utils.state import preserved
from art_malleability._utils.torch_utils import model_device_dtype, resolve_device
from art_malleability.audit.params import check_query_budget, default_queries
from art_malleability.data.streaming import ExampleSource, is_torch_data
from art_malleability.distributed import Shard, current_shard
from art_malleability.metrics import MIN_INTERVAL_QUERIES, smallest_training_set, top_k_count
from art_malleability.models.reference import is_transductive

logger = logging.getLogger(__name__)

#: ART's estimator check (``EstimatorError`` otherwise); a raw ``torch.nn.Module`` is wrapped into one.
ESTIMATOR_REQUIREMENTS = ((PyTorchClassifier, torch.nn.Module),)


def as_classifier(
    classifier: object,
    input_shape: tuple[int, ...] | None,
    nb_classes: int | None,
    loss: str,
    clip_values: tuple[float, float] | None,
    device: str,
    owner: type,
) -> PyTorchClassifier:
    """
    :param classifier: An ART :class:`PyTorchClassifier` (returned as it is) or a raw :class:`torch.nn.Module`.
    :param input_shape: Input shape of a raw module.
    :param nb_classes: Number of classes of a raw module.
    :param loss: ``"cross_entropy"`` or ``"mse"``, for a raw module.
    :param clip_values: Valid input range of a raw module.
    :param device: Device of a raw module's classifier.
    :param owner: The class that needs the classifier (named by ART's ``EstimatorError``).
    :return: The classifier.
    :raises EstimatorError: For anything else.
    """
    if isinstance(classifier, PyTorchClassifier):
        return classifier
    if isinstance(classifier, torch.nn.Module):
        if input_shape is None or nb_classes is None:
            raise ValueError(
                "input_shape and nb_classes must be given with a raw torch.nn.Module, got "
                f"input_shape={input_shape!r}, nb_classes={nb_classes!r}; they are needed to wrap it"
            )
        from art_malleability.models.training import make_classifier

        return make_classifier(
            classifier, tuple(input_shape), int(nb_classes), loss=loss, clip_values=clip_values, device=device
        )
    raise EstimatorError(owner, list(ESTIMATOR_REQUIREMENTS), classifier)


# ----------------------------------------------------------------------------------------------------
# What an audit is given, checked before any long work.
# ----------------------------------------------------------------------------------------------------


class AuditInputs(NamedTuple):
    """
    What :meth:`~art_malleability.audit.estimator.MalleabilityEstimator.evaluate` audits, checked and converted once:
    the steps of the audit take from it what each needs.
    """

    #: The training examples.
    source: ExampleSource
    #: Their labels (int64 class indices), every one read once.
    y: np.ndarray
    #: What the influence estimator is fitted on: the training inputs as an array or the dataset as given, or for a
    #: transductive model every input read into an array (its context).
    train: Any
    #: The labels given with ``train`` (``None`` for a dataset, which yields them).
    train_labels: np.ndarray | None
    #: The first training inputs (up to :data:`PROBE_ROWS`), on which the NTK influence's mode is planned.
    probe: np.ndarray
    #: Where the queries come from (the test points, or ``source``).
    queries: ExampleSource
    #: The queries' inputs and labels.
    x_q: np.ndarray
    y_q: np.ndarray
    #: With queries drawn from the training set, their training rows (their self-pairs are excluded), else ``None``.
    self_pairs: np.ndarray | None
    #: Size of the influential set.
    k: int
    #: The process group.
    shard: Shard
    #: Warnings on the inputs, for the report.
    warnings: list[str]


class PerturbedRows(NamedTuple):
    """This process's rows of the perturbed set, read once from the training source for every control and attack."""

    #: Their training indices, sorted.
    rows: np.ndarray
    #: Their clean inputs (float32).
    x: np.ndarray
    #: Their labels, one-hot (float32), as the attacks take them.
    y_onehot: np.ndarray
    #: A transductive model's whole training set, inputs and labels (its refits patch the rows into it), else None.
    whole: tuple[np.ndarray, np.ndarray] | None


#: Training inputs the NTK influence's mode is planned on.
PROBE_ROWS = 64


def audit_inputs(est: Any, x: Any, y: Any, x_test: Any, y_test: Any) -> AuditInputs:
    """
    Check and convert what an audit is given, against the estimator's parameters and classifier, before any long
    work: the inputs and labels, the model's outputs, the influential set's size, the process
    group, a seeded sample of the queries and whether their metrics fit the memory.

    :param est: The :class:`~art_malleability.audit.estimator.MalleabilityEstimator`.
    :return: The checked :class:`AuditInputs`.
    """
    clf = est.classifier
    source, labels, warnings = training_examples(clf, x, y, est.batch_size)
    k = top_k_count(source.n, est.top_fraction)
    shard = _check_sizes(est, source.n, k, x_test, y_test)
    rng, wanted = np.random.default_rng(est.seed), default_queries(est.n_queries)
    if x_test is not None:
        queries, self_pairs = example_source(clf, x_test, y_test, "x_test"), None
        rows = np.arange(queries.n)
        if len(rows) > wanted:
            rows = np.sort(rng.choice(len(rows), wanted, replace=False))
    else:
        if source.n < 2:
            raise ValueError(
                f"x must hold at least 2 examples when the queries are drawn from it (x_test=None), got {source.n}"
            )
        queries = source
        rows = self_pairs = np.sort(rng.choice(source.n, min(wanted, source.n), replace=False))
    if est.n_queries is not None and len(rows) < est.n_queries:
        message = (f"n_queries={est.n_queries} asked for more queries than the "
                   f"{'test set' if x_test is not None else 'training set (x_test=None)'} holds: its {len(rows)} "
                   "points are the queries")
        logger.warning(message)
        warnings.append(message)
    x_q, y_q = queries.take(rows, est.batch_size)
    limit = est.memory_limit_gb if est.memory_limit_gb is not None else getattr(est._influence, "memory_limit_gb", None)
    check_query_budget(len(x_q), source.n, k, est.n_bootstrap, self_pairs is not None, limit,
                       resolve_device(est.device))
    if len(x_q) < MIN_INTERVAL_QUERIES:
        message = (f"{len(x_q)} quer{'y' if len(x_q) == 1 else 'ies'}: the intervals that resample the queries and "
                   f"the noise-aware flip rate need at least {MIN_INTERVAL_QUERIES} (fewer would under-cover), so they "
                   "are null; pass more test points (or n_queries)")
        logger.warning(message)
        warnings.append(message)
    train = source.arrays(est.batch_size * 8)[0] if is_transductive(clf.model) else source.given
    probe, _ = source.take(np.arange(min(source.n, PROBE_ROWS)), est.batch_size)
    return AuditInputs(source, labels, train, None if is_torch_data(train) else labels, probe, queries, x_q, y_q,
                       self_pairs, k, shard, warnings)


def _check_sizes(est: Any, n: int, k: int, x_test: Any, y_test: Any) -> Shard:
    """
    The influential set must not be empty, the test points come with their labels, every process gets a training
    example, and every process audits the same weights and training set size.

    :return: The process group.
    """
    if k < 1:
        raise ValueError(
            f"x must hold at least {smallest_training_set(est.top_fraction)} examples for "
            f"top_fraction={est.top_fraction}, got {n}; with fewer the influential set is empty"
        )
    if (x_test is None) != (y_test is None) and not is_torch_data(x_test):
        given = "x_test" if y_test is None else "y_test"
        raise ValueError(f"x_test and y_test must be given together (both or neither), got {given} alone")
    shard = current_shard(est.distributed)
    if shard.world_size > n:
        raise ValueError(
            f"x must hold at least one example per process, got {n} examples for the {shard.world_size} "
            "processes of the process group"
        )
    shard.agree((n, weights_digest(est.classifier.model)), "the classifier's weights and the size of x")
    return shard


def example_source(classifier: PyTorchClassifier, x: Any, y: Any, name: str) -> ExampleSource:
    """
    :return: The examples of ``x`` (an array, checked against the classifier's input shape and ``clip_values``, or a
        dataset read in batches, each batch checked so) and their labels ``y`` (argument ``"y" + name[1:]``).
    """
    return ExampleSource(x, y, input_shape=tuple(classifier.input_shape), nb_classes=int(classifier.nb_classes),
                         name=name, clip_values=classifier.clip_values)


def training_examples(classifier: PyTorchClassifier, x: Any, y: Any,
                      batch_size: int) -> tuple[ExampleSource, np.ndarray, list[str]]:
    """
    The training examples, checked in this order before any long work: the inputs and labels against the classifier
    (:func:`example_source`); the model (finite weights, one tensor of ``nb_classes`` logits for the first example);
    then every label, read once (and, for a dataset, every batch checked against ``clip_values``).

    :return: The examples, their labels (int64 class indices) and the warnings on the labels.
    """
    source = example_source(classifier, x, y, "x")
    model, nb_classes = classifier.model, int(classifier.nb_classes)
    check_finite_weights(model)
    x_one, _ = source.take(np.arange(1), 1)
    device, dtype = model_device_dtype(model)
    with preserved(model, None), torch.no_grad():
        model.eval()
        check_logits(model(torch.as_tensor(x_one, device=device, dtype=dtype)), nb_classes)
    labels = source.labels(batch_size * 8)
    present = np.unique(labels)
    if len(present) > 1:
        return source, labels, []
    message = (f"y holds a single class ({int(present[0])}) of the classifier's {nb_classes}: "
               "the influence and the flip rates describe that class only")
    logger.warning(message)
    return source, labels, [message]


def check_finite_weights(model: torch.nn.Module) -> None:
    """A model with NaN or infinite weights or buffers is refused before any work."""
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"classifier.model must have finite weights, got {int((~torch.isfinite(tensor)).sum())} NaN or "
                f"infinite value(s) in {name!r}; the training that produced them diverged"
            )


def check_logits(out: Any, nb_classes: int) -> None:
    """The model must return one tensor of ``nb_classes`` logits per example (``out``: its output)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"classifier.model must return one tensor of logits (n, nb_classes), got {type(out).__name__}; "
            "wrap it so that forward returns the logits alone"
        )
    if out.ndim != 2 or out.shape[1] != nb_classes:
        raise ValueError(
            f"classifier.model must return outputs of shape (n, {nb_classes}) for the classifier's "
            f"nb_classes={nb_classes}, got {tuple(out.shape)}; build the PyTorchClassifier with the model's output "
            "width"
        )


def probe_inputs(classifier: PyTorchClassifier, x: Any) -> np.ndarray:
    """
    :return: The inputs that decide an audit's sizes: every one for a transductive model, else the first
        :data:`PROBE_ROWS`.
    """
    n = len(x)
    rows = range(n) if is_transductive(classifier.model) else range(min(n, PROBE_ROWS))
    return np.stack([np.asarray(x[i][0] if is_torch_data(x) else x[i]) for i in rows]).astype(np.float32)


def state_fidelity(report: Any, validation: Any, influence: Any, classifier: PyTorchClassifier) -> None:
    """Put the validated fidelity of the influence estimator that ran into the report (or a warning why not)."""
    from art_malleability.validation import estimator_label

    label = estimator_label(influence)
    if validation.model_digest != weights_digest(classifier.model):
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
