"""The classifier an audit needs: an ART ``PyTorchClassifier``, or a raw ``torch.nn.Module`` wrapped into one."""

from __future__ import annotations

import torch
from art.estimators.classification import PyTorchClassifier
from art.exceptions import EstimatorError

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
