"""
Checks of user input at the API boundary: clear errors that name the argument, and no mutation.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from art_malleability._utils.params import LOSS, LOSS_NAMES, POSITIVE_INT  # noqa: F401 - LOSS_NAMES: its old path

if TYPE_CHECKING:
    from art.estimators.classification import PyTorchClassifier

logger = logging.getLogger(__name__)



def check_loss(loss: str) -> str:
    """
    Check a loss name (the rule :data:`~art_malleability._utils.params.LOSS`).

    :param loss: ``"cross_entropy"`` or ``"mse"``.
    :return: ``loss`` unchanged.
    :raises ValueError: For any other value (an :class:`~art_malleability._utils.params.InvalidParameterError`).
    """
    return LOSS(loss, "loss")


def labels_to_indices(y: object, name: str = "y") -> np.ndarray:
    """
    Class indices from labels given as indices ``(n,)`` or one-hot / scores ``(n, C)`` (argmax): :func:`check_labels`
    when neither the number of examples nor the number of classes is known.

    :param y: Labels (an array or anything :func:`numpy.asarray` takes).
    :param name: Argument name used in error messages.
    :return: ``int64`` array of shape ``(n,)``.
    :raises ValueError: If ``y`` has another shape, or non-integer or negative values.
    """
    return check_labels(np.asarray(y), name)


def loss_name(classifier: PyTorchClassifier) -> str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """
    The influence estimators' loss for the classifier's loss: ``"mse"`` for :class:`torch.nn.MSELoss`,
    ``"cross_entropy"`` for a plain :class:`torch.nn.CrossEntropyLoss`, and otherwise the classifier's own loss
    module as a per-example ``loss_fn(outputs, targets)`` (a copy with ``reduction="none"``, targets as class
    indices), so any ART classifier's loss is the one the influence differentiates.

    :param classifier: An ART PyTorch classifier.
    :return: ``"cross_entropy"``, ``"mse"`` or a callable.
    """
    loss = classifier.loss
    if isinstance(loss, torch.nn.MSELoss):
        return "mse"
    plain = isinstance(loss, torch.nn.CrossEntropyLoss) and loss.weight is None and loss.label_smoothing == 0
    if plain or loss is None:
        return "cross_entropy"
    if not hasattr(loss, "reduction"):
        logger.warning("Loss %s has no reduction setting; influence uses cross-entropy.", loss)
        return "cross_entropy"
    per_example = copy.deepcopy(loss)
    per_example.reduction = "none"
    return per_example


def check_features(x: object, name: str, input_shape: tuple[int, ...]) -> np.ndarray:
    """
    Validate an input array and return a float32 copy.

    :param x: Candidate array (n, *input_shape).
    :param name: Argument name used in error messages.
    :param input_shape: The classifier's input shape.
    :return: A new float32 array.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of shape (n, {_shape(input_shape)}), got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one example, got shape {x.shape}")
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise ValueError(
            f"{name} must have shape (n, {_shape(input_shape)}) to match the classifier's input_shape, "
            f"got {x.shape}"
        )
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must hold finite values, got {int((~np.isfinite(x)).sum())} NaN or infinite entries")
    return np.array(x, dtype=np.float32, copy=True)


def check_finite(x: np.ndarray, name: str) -> None:
    """
    Inputs must be real and finite: a NaN or infinite input makes every score of its row (or, in a training set,
    every score) NaN. One pass without a copy (a float64 sum, finite exactly when every value is, barring an
    overflow); the bad index is searched only when it is not.

    :param x: Inputs ``(n, ...)`` (not changed).
    :param name: Argument name used in error messages.
    :raises TypeError: When ``x`` does not hold real numbers.
    :raises ValueError: Naming the first example with a NaN or infinite value.
    """
    if x.dtype.kind in "biu":
        return
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(x, axis=None, dtype=np.float64)):
            return
    finite = np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1) if x.ndim else np.isfinite(x).reshape(1)
    if not finite.all():  # else the sum overflowed
        raise ValueError(
            f"{name} must hold finite values, got a NaN or infinite value at index {int(np.argmin(finite))} "
            f"({int((~finite).sum())} such example(s))"
        )


def check_range(x: np.ndarray, name: str, clip_values: tuple | None) -> None:
    """
    Inputs must lie in the classifier's valid range: attacks clip to it, so data outside it (pixels in 0..255
    or centred data with ``clip_values=(0, 1)``) would be audited against a model that never sees such inputs.

    :param x: Inputs.
    :param name: Argument name used in error messages.
    :param clip_values: The classifier's ``clip_values`` (``None``: no range).
    :raises ValueError: When a value lies outside the range (beyond a float32 rounding margin).
    """
    if clip_values is None or x.size == 0:
        return
    low, high = (np.asarray(v, dtype=np.float64) for v in clip_values)
    margin = 1e-6 * max(1.0, float(np.max(np.abs(high))))
    if np.any(x < low - margin) or np.any(x > high + margin):
        raise ValueError(
            f"{name} must lie in the classifier's clip_values ({float(np.min(low)):g}, {float(np.max(high)):g}), got "
            f"values in [{float(x.min()):g}, {float(x.max()):g}]; scale the data to that range (e.g. divide uint8 "
            "pixels by 255) or build the classifier with the data's range"
        )


def check_labels(y: object, name: str = "y", n: int | None = None, nb_classes: int | None = None) -> np.ndarray:
    """
    Validate labels and return class indices: the one check of labels in the package. ART's
    :func:`~art.utils.check_and_transform_label_format` turns them into indices; this checks what it does not (the
    type, the number of rows, integer values, one-hot rows, the range) and names the argument in every error.

    :param y: Candidate labels: class indices ``(n,)`` or ``(n, 1)``, or one-hot rows ``(n, nb_classes)``; boolean
        labels are read as 0 and 1. With ``nb_classes=None``, rows ``(n, C)`` of any scores give their argmax.
    :param name: Argument name used in error messages.
    :param n: Number of examples the labels must describe (``None``: any).
    :param nb_classes: Number of classes (``None``: not known; indices need only be non-negative).
    :return: A new ``int64`` array of class indices, shape ``(n,)``.
    :raises TypeError: If ``y`` is not a numpy array or holds no numbers.
    :raises ValueError: On any other invalid label.
    """
    if not isinstance(y, np.ndarray):
        raise TypeError(f"{name} must be a numpy array of class indices or one-hot rows, got {type(y).__name__}")
    if n is not None and y.shape[0:1] != (n,):
        raise ValueError(f"{name} must have {n} rows to match the inputs, got shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating) or y.dtype == bool):
        raise TypeError(f"{name} must hold integer class indices or one-hot rows, got dtype {y.dtype}")
    values = y.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name} must hold finite values, got NaN or infinite values")
    rows = y.ndim == 2 and y.shape[1] > 1 and (nb_classes is None or y.shape[1] == nb_classes)
    if rows and nb_classes is not None:
        if not (np.all((values == 0) | (values == 1)) and np.all(values.sum(axis=1) == 1)):
            raise ValueError(f"{name} must have one-hot rows at shape {y.shape}, got rows that are not one-hot")
    elif not rows:
        if y.ndim == 2 and y.shape[1] == 1:
            values = values[:, 0]
        elif y.ndim != 1:
            raise ValueError(f"{name} must have shape (n,) or (n, {nb_classes or 'C'}) (one-hot), got {y.shape}")
        if not np.all(values == np.round(values)):
            raise ValueError(f"{name} must hold integer class indices, got non-integer values")
    from art.utils import check_and_transform_label_format

    try:
        indices = check_and_transform_label_format(values, nb_classes=nb_classes, return_one_hot=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be class indices or one-hot rows, got shape {y.shape}; {error}") from error
    indices = indices.reshape(-1).astype(np.int64)
    if indices.size and (indices.min() < 0 or (nb_classes is not None and indices.max() >= nb_classes)):
        expected = "non-negative class indices" if nb_classes is None else f"class indices in [0, {nb_classes - 1}]"
        raise ValueError(f"{name} must hold {expected}, got values in [{indices.min()}, {indices.max()}]")
    return indices


def one_hot(y: np.ndarray, nb_classes: int) -> np.ndarray:
    """
    One-hot float32 rows of class indices (the label form ART's ``loss_gradient`` needs), by ART's
    :func:`art.utils.to_categorical`.

    :param y: Class indices (n,).
    :param nb_classes: Number of classes.
    :return: Array (n, nb_classes).
    """
    from art.utils import to_categorical

    return to_categorical(np.asarray(y), nb_classes).astype(np.float32, copy=False)


def _shape(input_shape: tuple[int, ...]) -> str:
    return ", ".join(str(s) for s in input_shape)


def check_input_shape(input_shape: object, name: str = "input_shape", image: bool = False) -> tuple[int, ...]:
    """
    The package's one reading of a user's ``input_shape``: the shape of one input as a tuple of positive ints
    (its flat width is the product, ``math.prod``).

    :param input_shape: Shape of one input (a tuple, list or ``torch.Size`` of positive ints) or its number of
                        features (a positive int, read as ``(n,)``).
    :param name: Argument name used in error messages.
    :param image: Require an image shape ``(channels, height, width)``.
    :return: The shape as a tuple of Python ints.
    :raises TypeError: For a bool, a non-int entry or another type.
    :raises ValueError: For an empty shape, a size below 1, or (with ``image``) a shape of another length.
    """
    expected = "a positive int or a non-empty tuple of positive ints"
    if isinstance(input_shape, (int, np.integer)) and not isinstance(input_shape, bool):
        shape: tuple = (input_shape,)
    elif isinstance(input_shape, (tuple, list, torch.Size)):
        shape = tuple(input_shape)
    else:
        raise TypeError(f"{name} must be {expected}, got {input_shape!r}")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in shape):
        raise TypeError(f"{name} must be {expected}, got {input_shape!r}")
    if not shape or min(shape) < 1:
        raise ValueError(f"{name} must be {expected}, got {input_shape!r}")
    if image and len(shape) != 3:
        raise ValueError(f"{name} must be an image shape (channels, height, width), got {input_shape!r}")
    return tuple(int(s) for s in shape)


def check_positive_int(value: object, name: str) -> int:
    """
    Check a count: a positive integer (``bool`` is refused).

    :param value: The candidate.
    :param name: Argument name for the error message.
    :return: It, as an int.
    :raises ValueError: Otherwise (an :class:`~art_malleability._utils.params.InvalidParameterError`).
    """
    return POSITIVE_INT(value, name)


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


class SignatureParams:
    """
    An estimator's ``estimator_params``, read from its constructor's signature (every named parameter but those
    left out), so that no hand-kept list can drift from what the constructor takes: ``get_params()`` then rebuilds
    an equal estimator.

    :param leave_out: Constructor parameters that are not the estimator's parameters (what builds its inputs).
    """

    def __init__(self, leave_out: tuple[str, ...] = ()) -> None:
        self.leave_out = leave_out

    def __get__(self, obj: object, owner: type) -> tuple[str, ...]:
        import inspect

        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return tuple(
            name for name, p in inspect.signature(owner.__init__).parameters.items()
            if name != "self" and p.kind in kinds and name not in self.leave_out
        )
