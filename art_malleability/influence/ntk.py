"""
NTK influence: exact leave-one-out influence of kernel ridge regression on the empirical NTK.

This is the paper's estimator (after Zhang & Zhang, 2022): the trained network is replaced by
kernel ridge regression on its empirical NTK ``K`` (``n_train × n_train``, traced over logits),
with ``A = K + λI``, ``Cinv = A⁻¹`` and ``α = Cinv Y`` (``Y`` the one-hot training targets). The
kernel predictor at a query ``q`` is ``f_q = K_q α``. Removing training example ``i`` and
re-solving changes it by exactly

    Δf_{q,i} = −(K_q Cinv)_i · α_i / Cinv_ii            (a ``C``-vector; no retraining)

and the influence of ``i`` on ``q`` is ``loss(f_q + Δf_{q,i}, y_q) − loss(f_q, y_q)``:
**positive = helpful** (removing ``i`` raises the query's loss).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from art_malleability.influence.base import InfluenceEstimator, per_example_loss, regression_targets
from art_malleability.ntk.empirical import NTK_METHODS, empirical_ntk

logger = logging.getLogger(__name__)

# Elements of the (queries × n_train × C) leave-one-out prediction block processed at once.
_CHUNK_ELEMENTS = 2**24


class NTKInfluence(InfluenceEstimator):
    """
    Leave-one-out influence of kernel ridge regression on the empirical NTK of the model.

    Scores have shape ``(n_query, n_train)``; **positive = helpful**: removing the training
    example from the kernel ridge regression would raise the query's loss.

    :param ridge: Ridge ``λ > 0`` added to the kernel diagonal (the paper uses ``1e-3``).
    :param loss: Loss applied to the kernel predictor's outputs: ``"mse"`` (the kernel ridge
        regression's own loss, default) or ``"cross_entropy"`` (outputs treated as logits).
    :param device: ``"auto"``, a device string or a :class:`torch.device`.
    :param dtype: Dtype of the kernel computation (default ``torch.float64``); the ridge solve
        is always done in float64.
    :param batch_size: Examples per block in the kernel computation.
    :param method: eNTK method, see :func:`~art_malleability.ntk.empirical.empirical_ntk`.

    Fitted attributes: ``kernel_`` (``n_train × n_train`` eNTK, tensor), ``alpha_`` (dual
    coefficients ``(K + λI)⁻¹ Y``, ``n_train × C`` float64 tensor), ``model_`` (working copy).
    """

    name = "ntk"
    estimator_params = ("ridge", "loss", "device", "dtype", "batch_size", "method")

    def __init__(
        self,
        ridge: float = 1e-3,
        loss: str = "mse",
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        batch_size: int = 256,
        method: str = "auto",
    ) -> None:
        self.ridge = ridge
        self.method = method
        super().__init__(loss=loss, device=device, dtype=dtype, batch_size=batch_size)

    def _check_params(self) -> None:
        super()._check_params()
        if isinstance(self.ridge, bool) or not isinstance(self.ridge, (int, float, np.integer, np.floating)):
            raise ValueError(f"ridge must be a positive float, got {self.ridge!r}")
        if not math.isfinite(float(self.ridge)) or self.ridge <= 0:
            raise ValueError(f"ridge must be a positive float, got {self.ridge!r}")
        if self.method not in NTK_METHODS:
            raise ValueError(f"method must be one of {NTK_METHODS}, got {self.method!r}")

    def _kernel(self, model: nn.Module, x1: np.ndarray, x2: np.ndarray | None = None) -> torch.Tensor:
        return empirical_ntk(model, x1, x2, method=self.method, batch_size=self.batch_size)

    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        kernel = self._kernel(model, x_train)
        k64 = kernel.to(torch.float64)
        n = k64.shape[0]
        system = k64 + float(self.ridge) * torch.eye(n, dtype=torch.float64, device=k64.device)
        chol, info = torch.linalg.cholesky_ex(system)
        if int(info) != 0:
            raise ValueError(
                f"K + ridge*I is not positive definite (ridge={self.ridge!r}, kernel scale "
                f"{float(k64.diagonal().abs().max()):.3g}); increase ridge"
            )
        cinv = torch.cholesky_inverse(chol)
        cinv = 0.5 * (cinv + cinv.T)
        y = torch.as_tensor(y_train, device=k64.device)
        targets = regression_targets(y, self.n_outputs_, torch.float64)
        self.kernel_ = kernel
        self.alpha_ = cinv @ targets
        self._cinv = cinv
        self._cinv_diag = cinv.diagonal().clone()
        logger.debug("NTK influence: kernel %s, ridge %g", tuple(kernel.shape), self.ridge)

    def _query_quantities(self, x_query: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kernel predictions ``f`` (n_q, C), ``B = K_q Cinv`` (n_q, n) and ``α / diag(Cinv)`` (n, C)."""
        k_q = self._kernel(self.model_, x_query, self.x_train_).to(torch.float64)
        f = k_q @ self.alpha_
        b = k_q @ self._cinv
        beta = self.alpha_ / self._cinv_diag[:, None]
        return f, b, beta

    def _check_fitted(self) -> None:
        if not self.is_fitted:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit(model, x, y) first")

    def predict(self, x_query: np.ndarray) -> np.ndarray:
        """
        Kernel ridge regression predictions ``f_q = K_q α``.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, C)``.
        """
        self._check_fitted()
        k_q = self._kernel(self.model_, np.asarray(x_query), self.x_train_).to(torch.float64)
        return (k_q @ self.alpha_).cpu().numpy()

    def loo_predictions(self, x_query: np.ndarray) -> np.ndarray:
        """
        Exact leave-one-out predictions of the kernel predictor, without retraining:
        ``f_q + Δf_{q,i}`` is the prediction at query ``q`` after removing training example ``i``.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, n_train, C)``.
        """
        self._check_fitted()
        f, b, beta = self._query_quantities(np.asarray(x_query))
        return (f[:, None, :] - b[:, :, None] * beta[None, :, :]).cpu().numpy()

    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        f, b, beta = self._query_quantities(x_query)
        y = torch.as_tensor(y_query, device=f.device)
        base = per_example_loss(f, y, self.loss)
        n_query, n_train = b.shape
        out = torch.empty((n_query, n_train), dtype=torch.float64, device=f.device)
        chunk = max(1, _CHUNK_ELEMENTS // max(1, n_train * f.shape[1]))
        for s in range(0, n_query, chunk):
            e = min(s + chunk, n_query)
            loo = f[s:e, None, :] - b[s:e, :, None] * beta[None, :, :]
            out[s:e] = per_example_loss(loo, y[s:e, None], self.loss) - base[s:e, None]
        return out.cpu().numpy()
