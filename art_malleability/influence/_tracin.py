"""
The TracIn-CP base shared by :class:`~art_malleability.influence.gradient.GradientInfluence` and
:class:`~art_malleability.influence.captum_tracin.CaptumInfluence`: their common parameters and rules
(checkpoints and their learning rates), the checkpoints' check against the model at fit time, and the model's final
weights, restored after every pass over the checkpoints.

Both compute ``Σ_k lr_k · g_q(θ_k) · g_i(θ_k)`` over checkpoints ``θ_k`` (by default the model's weights at fit
time with ``lr = 1``); **positive = helpful**.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from art_malleability._utils.params import RuleTable, invalid, is_number
from art_malleability._utils.torch_utils import resolve_device, working_copy
from art_malleability.influence.base import InfluenceEstimator

logger = logging.getLogger(__name__)

#: A checkpoint: a state dict of the model, or ``None`` for the model's weights at fit time.
Checkpoint = Mapping[str, torch.Tensor] | None


def check_checkpoints(
    checkpoints: Sequence[Mapping[str, torch.Tensor]] | None,
    learning_rates: Sequence[float] | None,
) -> tuple[list[Checkpoint], list[float]]:
    """
    The rule of TracIn's checkpoints and learning rates (one per checkpoint, so they are checked together).

    :param checkpoints: ``None`` (the model's current weights) or a non-empty list of state dicts.
    :param learning_rates: ``None`` (``1.0`` per checkpoint) or one finite float per checkpoint.
    :return: ``(checkpoints, learning_rates)`` as lists; ``[None]`` stands for the current weights.
    :raises InvalidParameterError: On an empty or malformed list, or mismatched lengths, naming the parameter.
    """
    if checkpoints is None:
        ckpts: list[Checkpoint] = [None]
    else:
        if isinstance(checkpoints, Mapping) or not isinstance(checkpoints, Sequence) or len(checkpoints) == 0:
            given = "an empty list" if isinstance(checkpoints, Sequence) else type(checkpoints).__name__
            raise invalid("checkpoints", "be None or a non-empty list of state dicts (one per checkpoint)", given)
        for k, sd in enumerate(checkpoints):
            if not isinstance(sd, Mapping):
                raise invalid(f"checkpoints[{k}]", "be a state dict (mapping)", type(sd).__name__)
        ckpts = list(checkpoints)
    if learning_rates is None:
        return ckpts, [1.0] * len(ckpts)
    if not isinstance(learning_rates, Sequence) or isinstance(learning_rates, str):
        raise invalid("learning_rates", "be None or a list of floats", learning_rates)
    if len(learning_rates) != len(ckpts):
        raise invalid("learning_rates", f"have one value per checkpoint ({len(ckpts)})", len(learning_rates))
    for lr in learning_rates:
        if not is_number(lr) or not np.isfinite(float(lr)):
            raise invalid("learning_rates", "hold finite floats", lr)
    return ckpts, [float(lr) for lr in learning_rates]


def snapshot_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """
    :param model: A module.
    :return: A detached copy of its state dict.
    """
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def validate_checkpoints(model: nn.Module, checkpoints: list[Checkpoint]) -> None:
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


def _checkpoints_rule(value: object, name: str) -> object:
    """``checkpoints`` alone (its learning rates are checked with it by :meth:`TracInInfluence._check_params`)."""
    check_checkpoints(value, None)
    return value


class TracInInfluence(InfluenceEstimator):
    """
    Base of the TracIn-CP estimators, ``Σ_k lr_k · g_q(θ_k) · g_i(θ_k)``. Subclasses declare their constructor
    (``loss``, ``checkpoints``, ``learning_rates``, ``device``, ``dtype``, ``batch_size`` and their own options,
    stored by ``self._init_params(locals())``) and compute the scores with the checkpoints of :meth:`_fit`.

    :param loss: Per-example loss, ``"cross_entropy"`` (default) or ``"mse"``, or a callable ``loss_fn``.
    :param checkpoints: ``None`` (the model's weights at :meth:`fit` time) or a list of state dicts of the same
        model, e.g. saved during training.
    :param learning_rates: ``None`` (``1.0`` for each checkpoint) or one learning rate per checkpoint.
    :param device: ``"auto"``, a device string or a :class:`torch.device`.
    :param dtype: Dtype of the computation (default ``torch.float64``).
    :param batch_size: Examples per block.
    """

    _parameter_rules: RuleTable = {**InfluenceEstimator._parameter_rules, "checkpoints": _checkpoints_rule}

    def _check_params(self) -> None:
        super()._check_params()
        check_checkpoints(self.checkpoints, self.learning_rates)

    def _fit_checkpoints(self, model: nn.Module) -> None:
        """At fit time: the checkpoints (checked against ``model``, the working copy) and its final weights."""
        self._checkpoints, self._learning_rates = check_checkpoints(self.checkpoints, self.learning_rates)
        validate_checkpoints(model, self._checkpoints)
        self._final_state = snapshot_state(model)

    def score_seconds(self, model: nn.Module, x_probe: np.ndarray, y_probe: np.ndarray, n_train: int,
                      n_query: int) -> float:
        """
        Estimated seconds of one :meth:`scores` call of ``n_query`` queries against ``n_train`` training examples, from
        counted work at the device's nominal rate (:mod:`~art_malleability.ntk.cost`; nothing timed), for an
        audit's plan.

        :param model: The model (a working copy is counted; its weights do not matter).
        :param x_probe: A few training inputs.
        :param y_probe: Their labels (class indices).
        :param n_train: Training examples.
        :param n_query: Queries of the call.
        :return: Seconds.
        """
        device = resolve_device(self.device)
        work = working_copy(model, device, self.dtype)
        x = torch.as_tensor(np.asarray(x_probe[:2]), dtype=self.dtype, device=device)
        y = torch.as_tensor(np.asarray(y_probe[:2]), dtype=torch.long, device=device)
        checkpoints = 1 if self.checkpoints is None else len(self.checkpoints)
        return checkpoints * self._score_seconds(work, x, y, int(n_train), int(n_query), device)

    def _score_seconds(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_train: int, n_query: int,
                       device: torch.device) -> float:
        """One checkpoint's part of :meth:`score_seconds` (the subclass's way of computing the scores)."""
        raise NotImplementedError

    @contextmanager
    def _final_weights_after(self) -> Iterator[None]:
        """Within the block the checkpoints may be loaded into the working copy; its final weights come back after."""
        try:
            yield
        finally:
            if any(sd is not None for sd in self._checkpoints):
                self.model_.load_state_dict(self._final_state)

    def _check_self_influence(self, x: np.ndarray | None, y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
        """:return: The checked examples of ``self_influence(x, y)``, or ``None`` for the training set."""
        self._check_fitted("self_influence")
        if (x is None) != (y is None):
            missing, given = ("y", "x") if y is None else ("x", "y")
            raise ValueError(
                f"{missing} must be given with {given} to self_influence (examples and their labels go together; "
                "neither: the training set), got None"
            )
        return None if x is None else self._check_query(x, y)
