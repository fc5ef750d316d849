"""
The classifier's input pipeline in front of its model, for the influence estimators.

An ART classifier does not feed its inputs to its model directly: ``predict`` first applies its preprocessing
defences (those with ``apply_predict``) and its ``preprocessing=(mean, std)`` standardisation. Influence
computed on ``classifier.model`` alone would therefore see other inputs than the model sees — a classifier with
``preprocessing=(0.3, 0.4)`` and one with the same standardisation written inside its module predict the same
but would get different scores. :func:`with_input_pipeline` puts the pipeline in front of the model as a
PyTorch module, so every influence estimator (and the context of a transductive model) sees exactly what
``classifier.predict`` feeds the model.

Choices:

- The *predict-time* pipeline is used for every input, training examples included: influence is computed at the
  final weights, on the inputs as the trained model reads them (a defence applied only during ``fit`` is not part
  of it).
- Standardisation is applied in the input's own dtype and device (ART's PyTorch standardisation rounds the mean
  and standard deviation to float32 and keeps them on the classifier's device); other preprocessors must be ART
  PyTorch preprocessors (``PreprocessorPyTorch``) and are called through their ``forward``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from art.defences.preprocessor.preprocessor import PreprocessorPyTorch
from art.preprocessing.standardisation_mean_std.numpy import StandardisationMeanStd
from art.preprocessing.standardisation_mean_std.pytorch import StandardisationMeanStdPyTorch
from art.preprocessing.standardisation_mean_std.utils import broadcastable_mean_std
from torch import nn

from art_malleability.models.reference import is_transductive


def pipeline_operations(classifier: Any) -> list[Any]:
    """
    The preprocessing operations ``classifier.predict`` applies, in order, checked for use inside a model.

    :param classifier: An ART classifier.
    :return: The operations with ``apply_predict``, less the identity standardisation ART adds by default (empty
        when the classifier feeds its model directly).
    :raises ValueError: When an operation is neither a standardisation nor an ART PyTorch preprocessor: the
        influence could not see what the model sees.
    """
    operations = [
        op for op in (getattr(classifier, "preprocessing_operations", None) or [])
        if op.apply_predict and not _identity(op)
    ]
    for op in operations:
        if not isinstance(op, (StandardisationMeanStd, StandardisationMeanStdPyTorch, PreprocessorPyTorch)):
            raise ValueError(
                f"classifier.preprocessing must hold PyTorch preprocessors, got {type(op).__name__}; the influence "
                "estimators must see the inputs the model sees, so pass the defence's PyTorch version "
                "(art.defences.preprocessor ...PyTorch) or apply it to the data before the audit"
            )
    return operations


def _identity(op: Any) -> bool:
    return (
        isinstance(op, (StandardisationMeanStd, StandardisationMeanStdPyTorch))
        and np.all(np.asarray(op.mean) == 0)
        and np.all(np.asarray(op.std) == 1)
    )


class PreprocessedModel(nn.Module):
    """
    ``model(pipeline(x))``: a classifier's predict-time preprocessing in front of its model.

    :param model: The model (its parameters are this module's, under ``model.``).
    :param operations: The operations of :func:`pipeline_operations`.
    """

    def __init__(self, model: nn.Module, operations: list[Any]) -> None:
        super().__init__()
        self.model = model
        self.operations = list(operations)

    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        """:return: ``x`` as the classifier feeds it to its model."""
        for op in self.operations:
            if isinstance(op, (StandardisationMeanStd, StandardisationMeanStdPyTorch)):
                mean, std = broadcastable_mean_std(x, np.asarray(op.mean), np.asarray(op.std))
                x = (x - torch.as_tensor(mean, dtype=x.dtype, device=x.device)) / torch.as_tensor(
                    std, dtype=x.dtype, device=x.device
                )
            else:
                x = op.forward(x, None)[0]
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """:return: The model's output on the preprocessed input."""
        return self.model(self.preprocess(x))


class TransductivePreprocessedModel(PreprocessedModel):
    """:class:`PreprocessedModel` of a transductive model: its context is set from preprocessed inputs too."""

    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """
        :param x_train: Training inputs as given to the classifier; preprocessed, then passed to the model's
            ``set_context``.
        """
        x = torch.as_tensor(x_train)
        with torch.no_grad():
            self.model.set_context(self.preprocess(x))


def with_input_pipeline(model: nn.Module, classifier: Any) -> nn.Module:
    """
    The model behind the classifier's predict-time input pipeline.

    :param model: The module (typically a private copy of ``classifier.model``).
    :param classifier: The ART classifier whose preprocessing applies.
    :return: ``model`` itself when the classifier has no preprocessing, else a :class:`PreprocessedModel` (a
        :class:`TransductivePreprocessedModel` when the model has ``set_context``).
    :raises ValueError: See :func:`pipeline_operations`.
    """
    operations = pipeline_operations(classifier)
    if not operations:
        return model
    wrapper = TransductivePreprocessedModel if is_transductive(model) else PreprocessedModel
    return wrapper(model, operations)
