"""
Leave-one-out influence scores from the closed-form leave-one-out of kernel ridge regression.

The solves themselves live in :mod:`art_malleability.linalg.ridge` (:class:`~art_malleability.linalg.ridge.DualRidge`,
:class:`~art_malleability.linalg.ridge.PrimalRidge`); they describe the change of the prediction at a query ``q`` when
training example ``i`` is removed as ``Δf_{q,i} = −b_{q,i} β_i``. This module turns that change into the influence
on the query's loss (:func:`loo_scores`), and keeps the solvers importable from here, where they were first
documented.
"""

from __future__ import annotations

import torch

from art_malleability.influence.base import per_example_loss, regression_targets
from art_malleability.linalg.ridge import (  # noqa: F401 - their first public path
    DualRidge,
    PrimalRidge,
    inverse_cholesky_,
    kernel_ridge_predict,
)

# Elements of the (queries × n_train × C) leave-one-out prediction block processed at once.
_CHUNK_ELEMENTS = 2**24


def loo_scores(
    f: torch.Tensor, b: torch.Tensor, beta: torch.Tensor, y: torch.Tensor, loss: str
) -> torch.Tensor:
    """
    Leave-one-out influence ``loss(f_q + Δf_{q,i}, y_q) − loss(f_q, y_q)`` with
    ``Δf_{q,i} = −b_{q,i} β_i``: **positive = helpful** (removing ``i`` raises ``q``'s loss).

    :param f: Predictions at the queries, ``(n_q, C)``.
    :param b: ``(n_q, n)`` leave-one-out coefficients.
    :param beta: ``(n, C)`` leave-one-out directions.
    :param y: Query class indices ``(n_q,)``.
    :param loss: ``"mse"`` or ``"cross_entropy"`` (see :func:`~art_malleability.influence.per_example_loss`).
    :return: ``(n_q, n)`` float64 scores.
    """
    n_query, n_train = b.shape
    if isinstance(loss, str) and loss == "mse":
        # ½‖r − b β‖² − ½‖r‖² = −b (r·β) + ½ b² ‖β‖² with the residual r = f − target: one product, no (n_q, n, C)
        # temporaries, and no cancellation of the two losses
        residual = f - regression_targets(y, f.shape[1], f.dtype)
        return b * (0.5 * b * (beta * beta).sum(1)[None, :] - residual @ beta.T)
    base = per_example_loss(f, y, loss)
    out = torch.empty((n_query, n_train), dtype=torch.float64, device=f.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, n_train * f.shape[1]))
    for s in range(0, n_query, chunk):
        e = min(s + chunk, n_query)
        loo = f[s:e, None, :] - b[s:e, :, None] * beta[None, :, :]
        out[s:e] = per_example_loss(loo, y[s:e, None], loss) - base[s:e, None]
    return out

