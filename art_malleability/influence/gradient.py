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
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from art_malleability.influence.base import InfluenceEstimator, per_example_loss
from art_malleability.ntk.empirical import NTK_METHODS, JacobianGram

logger = logging.getLogger(__name__)


def check_checkpoints(
    checkpoints: Sequence[Mapping[str, torch.Tensor]] | None,
    learning_rates: Sequence[float] | None,
) -> tuple[list[Mapping[str, torch.Tensor] | None], list[float]]:
    """
    Validate TracIn checkpoints and learning rates (shared by the gradient and Captum estimators).

    :param checkpoints: ``None`` (the model's current weights) or a non-empty list of state dicts.
    :param learning_rates: ``None`` (``1.0`` per checkpoint) or one float per checkpoint.
    :return: ``(checkpoints, learning_rates)`` as lists; ``[None]`` stands for the current weights.
    :raises ValueError: On an empty or malformed list, or mismatched lengths.
    """
    if checkpoints is None:
        ckpts: list[Mapping[str, torch.Tensor] | None] = [None]
    else:
        if isinstance(checkpoints, Mapping) or not isinstance(checkpoints, Sequence) or len(checkpoints) == 0:
            given = "an empty list" if isinstance(checkpoints, Sequence) else type(checkpoints).__name__
            raise ValueError(
                f"checkpoints must be None or a non-empty list of state dicts (one per checkpoint), got {given}"
            )
        for k, sd in enumerate(checkpoints):
            if not isinstance(sd, Mapping):
                raise ValueError(f"checkpoints[{k}] must be a state dict (mapping), got {type(sd).__name__}")
        ckpts = list(checkpoints)
    if learning_rates is None:
        lrs = [1.0] * len(ckpts)
    else:
        if not isinstance(learning_rates, Sequence) or isinstance(learning_rates, str):
            raise ValueError(f"learning_rates must be None or a list of floats, got {learning_rates!r}")
        if len(learning_rates) != len(ckpts):
            raise ValueError(
                f"learning_rates must have one value per checkpoint ({len(ckpts)}), got {len(learning_rates)}"
            )
        lrs = []
        for lr in learning_rates:
            if isinstance(lr, bool) or not isinstance(lr, (int, float, np.integer, np.floating)):
                raise ValueError(f"learning_rates must hold finite floats, got {lr!r}")
            if not math.isfinite(float(lr)):
                raise ValueError(f"learning_rates must hold finite floats, got {lr!r}")
            lrs.append(float(lr))
    return ckpts, lrs


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """
    :param model: A module.
    :return: A detached copy of its state dict.
    """
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def validate_checkpoints(model: nn.Module, checkpoints: list[Mapping[str, torch.Tensor] | None]) -> None:
    """
    Check that every checkpoint loads into ``model`` (a working copy), then restore its weights.

    :param model: Working copy of the model.
    :param checkpoints: Checkpoints as returned by :func:`check_checkpoints`.
    :raises ValueError: If a checkpoint does not match the model.
    """
    if all(sd is None for sd in checkpoints):
        return
    final = snapshot_state(model)
    try:
        for k, sd in enumerate(checkpoints):
            if sd is None:
                continue
            try:
                model.load_state_dict(sd)
            except (RuntimeError, KeyError) as err:
                raise ValueError(f"checkpoints[{k}] must match the model's state dict, got: {err}") from err
    finally:
        model.load_state_dict(final)


class GradientInfluence(InfluenceEstimator):
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

    def _check_params(self) -> None:
        super()._check_params()
        check_checkpoints(self.checkpoints, self.learning_rates)
        if self.method not in NTK_METHODS:
            raise ValueError(f"method must be one of {NTK_METHODS}, got {self.method!r}")

    def _loss_fn(self, outputs: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        return per_example_loss(outputs, y, self.loss)

    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self._checkpoints, self._learning_rates = check_checkpoints(self.checkpoints, self.learning_rates)
        validate_checkpoints(model, self._checkpoints)
        self._final_state = snapshot_state(model)

    def self_influence(self, x: np.ndarray | None = None, y: np.ndarray | None = None) -> np.ndarray:
        """
        TracIn self-influence ``Σ_k lr_k ‖g(θ_k)‖²`` (Captum's ``self_influence``), of the training set
        (``x=None``) or of any examples.

        :param x: ``None`` (the training set) or inputs ``(n, *input_shape)``.
        :param y: Their labels.
        :return: ``float64`` array ``(n,)``.
        """
        self._check_fitted("self_influence")
        if (x is None) != (y is None):
            missing, given = ("y", "x") if y is None else ("x", "y")
            raise ValueError(
                f"{missing} must be given with {given} to self_influence (examples and their labels go together; "
                "neither: the training set), got None"
            )
        x, y = (self.x_train_, self.y_train_) if x is None else self._check_query(x, y)
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
        try:
            for sd, lr in zip(self._checkpoints, self._learning_rates, strict=True):
                if sd is not None:
                    model.load_state_dict(sd)
                block = engine.gram(x1, x2, y1, y2).to(torch.float64)
                total = lr * block if total is None else total + lr * block
        finally:
            if any(sd is not None for sd in self._checkpoints):
                model.load_state_dict(self._final_state)
        return total.cpu().numpy()
