"""
Gradient-similarity influence (TracIn-CP) computed with per-layer factorisation.

``score[q, i] = Σ_k lr_k · g_q(θ_k) · g_i(θ_k)`` where ``g`` is the gradient of the per-example
loss over the trainable parameters at checkpoint ``θ_k`` (by default only the final weights,
``lr = 1``). A gradient step on training example ``i`` changes the query loss by about
``−lr · g_q · g_i``, so **positive = helpful** (a proponent: training on ``i`` lowered the
query's loss, removing it would raise it).

For every ``nn.Linear`` layer called once on 2-D inputs the per-example weight gradient is the
outer product ``δ aᵀ`` of the gradient ``δ`` of the loss with respect to the layer output and the
layer input ``a``, so its share of the dot product is ``(a_q · a_i)(δ_q · δ_i)`` (bias:
``δ_q · δ_i``) and no per-example gradient is ever formed. Other trainable parameters use
``torch.func`` per-example gradients. Same engine as the empirical NTK
(:class:`~art_malleability.ntk.empirical.JacobianGram`), applied to the per-example loss.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from art_malleability._utils.params import RuleTable
from art_malleability.influence._tracin import (  # noqa: F401 - the checkpoint helpers' public path
    TracInInfluence,
    check_checkpoints,
    snapshot_state,
    validate_checkpoints,
)
from art_malleability.influence.base import per_example_loss
from art_malleability.ntk.empirical import METHOD, JacobianGram

logger = logging.getLogger(__name__)


class GradientInfluence(TracInInfluence):
    """
    TracIn-CP gradient-similarity influence, ``Σ_k lr_k · g_q(θ_k) · g_i(θ_k)``.

    Scores have shape ``(n_query, n_train)``; **positive = helpful**: the training example's
    loss gradient is aligned with the query's, so training on it lowered the query's loss and
    removing it would raise it.

    :param loss: Per-example loss, ``"cross_entropy"`` (default) or ``"mse"``.
    :param checkpoints: ``None`` (the model's weights at :meth:`fit` time) or a list of state
        dicts of the same model, e.g. saved during training.
    :param learning_rates: ``None`` (``1.0`` for each checkpoint) or one learning rate per
        checkpoint.
    :param device: ``"auto"``, a device string or a :class:`torch.device`.
    :param dtype: Dtype of the computation (default ``torch.float64``).
    :param batch_size: Examples per block.
    :param method: The kernel engine's method (:func:`~art_malleability.ntk.empirical.empirical_ntk`):
        ``"auto"`` (per device), ``"structured"`` (factorised linear layers plus ``torch.func`` for the rest),
        ``"batched"`` (the same factors from one class-batched ``torch.func`` pass per sub-batch) or ``"jacobian"``
        (``torch.func`` per-example gradients for every parameter).
    """

    name = "gradient"
    _parameter_rules: RuleTable = {**TracInInfluence._parameter_rules, "method": METHOD}

    def __init__(
        self,
        loss: str = "cross_entropy",
        checkpoints: Sequence[Mapping[str, torch.Tensor]] | None = None,
        learning_rates: Sequence[float] | None = None,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        batch_size: int = 256,
        method: str = "auto",
    ) -> None:
        self._init_params(locals())

    def _loss_fn(self, outputs: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        return per_example_loss(outputs, y, self.loss)

    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self._fit_checkpoints(model)

    def _score_seconds(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_train: int, n_query: int,
                       device: torch.device) -> float:
        """The kernel engine's counted work for the queries' and the training set's factors and their contraction."""
        engine = JacobianGram(model, method=self.method, batch_size=self.batch_size, output_fn=self._loss_fn)
        cost, rows = engine.method_cost(x, n_query, n_train, y)
        examples = n_query + n_train
        return cost.seconds(examples, n_query * n_train, examples / rows, device)

    def self_influence(self, x: np.ndarray | None = None, y: np.ndarray | None = None) -> np.ndarray:
        """
        TracIn self-influence ``Σ_k lr_k ‖g(θ_k)‖²`` (Captum's ``self_influence``), of the training set
        (``x=None``) or of any examples.

        :param x: ``None`` (the training set) or inputs ``(n, *input_shape)``.
        :param y: Their labels.
        :return: ``float64`` array ``(n,)``.
        """
        checked = self._check_self_influence(x, y)
        x, y = (self.x_train_, self.y_train_) if checked is None else checked
        return np.concatenate([
            np.diagonal(self._gram(x[s : s + self.batch_size], y[s : s + self.batch_size], None, None))
            for s in range(0, len(x), self.batch_size)
        ])

    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        return self._gram(x_query, y_query, self.x_train_, self.y_train_)

    def _gram(self, x1: np.ndarray, y1: np.ndarray, x2: np.ndarray | None, y2: np.ndarray | None) -> np.ndarray:
        """``Σ_k lr_k`` times the Gram matrix of the loss gradients of ``x1`` and ``x2`` (``None``: ``x1``)."""
        model = self.model_
        engine = JacobianGram(model, method=self.method, batch_size=self.batch_size, output_fn=self._loss_fn)
        total = None
        with self._final_weights_after():
            for sd, lr in zip(self._checkpoints, self._learning_rates, strict=True):
                if sd is not None:
                    model.load_state_dict(sd)
                block = engine.gram(x1, x2, y1, y2).to(torch.float64)
                total = lr * block if total is None else total + lr * block
        self.kernel_method_ = engine.describe_method()
        return total.cpu().numpy()
