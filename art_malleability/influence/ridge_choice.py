"""
Choosing the ridge of kernel ridge regression from the data: exact leave-one-out error or generalised
cross-validation over a grid, from one eigendecomposition of the kernel.

With ``K = U diag(s) Uᵀ`` and ``A = K + λI``, every grid value costs ``O(n² (C + 1))`` once ``U`` is known:
``α = U diag(1/(s + λ)) UᵀY``, ``(A⁻¹)_ii = Σ_k U_ik² / (s_k + λ)``, and

- **leave-one-out** (``"loo"``): the mean squared error of the regression targets when each example is predicted
  by the regression fitted without it, ``(1/n) Σ_i ‖α_i / (A⁻¹)_ii‖²`` (exact, no refit; the same closed form the
  influence scores use);
- **generalised cross-validation** (``"gcv"``, Golub, Heath and Wahba 1979): ``(1/n) ‖λα‖² / ((1/n) tr λA⁻¹)²``,
  the rotation-invariant version of the leave-one-out error.

The grid is relative to the kernel's scale (its mean diagonal ``τ``): ``τ · 10^e`` for ``e`` from ``-9`` to ``1``
in steps of ``1/4`` by default. The eigendecomposition runs in the kernel's own memory (LAPACK ``syevr``, no third
``n × n`` buffer), and the kernel is computed back from its eigenvectors afterwards (equal to the input up to
rounding, ``~1e-13`` relative), so the choice needs the memory of the dense exact solve and no more.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from scipy.linalg import lapack
from threadpoolctl import threadpool_limits

from art_malleability._utils.params import Rule, is_number
from art_malleability.linalg import check_finite, row_block

logger = logging.getLogger(__name__)

#: The paper's ridge, the default of every NTK estimator.
DEFAULT_RIDGE = 1e-3

#: Rules that choose the ridge from the data.
RIDGE_RULES = ("loo", "gcv")

#: Default grid, as powers of ten of the kernel's mean diagonal.
DEFAULT_RELATIVE_GRID = tuple(10.0 ** np.arange(-9.0, 1.0 + 1e-9, 0.25))


#: The rule of a ridge: ``λ > 0`` or one of :data:`RIDGE_RULES` (the audit's, the NTK influence's and the command
#: line's ``--ridge``).
RIDGE = Rule(
    f"be a positive float or one of {RIDGE_RULES}",
    lambda v: (isinstance(v, str) and v in RIDGE_RULES) or (is_number(v) and math.isfinite(float(v)) and v > 0),
)


def check_ridge(ridge: float | str) -> None:
    """
    :param ridge: A ridge ``λ > 0`` or one of :data:`RIDGE_RULES`.
    :raises ValueError: Otherwise, naming the argument (the rule :data:`RIDGE`).
    """
    RIDGE(ridge, "ridge")


def ridge_criteria(
    kernel: torch.Tensor, targets: torch.Tensor, grid: np.ndarray
) -> dict[str, np.ndarray]:
    """
    Leave-one-out error and GCV of kernel ridge regression for every ridge of a grid.

    :param kernel: ``n × n`` symmetric positive semi-definite kernel, float64, on the CPU and C-contiguous; it is
        overwritten by its eigendecomposition and computed back (equal to the input up to rounding).
    :param targets: ``n × C`` regression targets.
    :param grid: Ridges ``λ > 0`` (absolute values).
    :return: ``{"ridge", "loo", "gcv"}`` arrays over the grid (``inf`` where ``K + λI`` is not positive definite in
        floating point).
    :raises ValueError: If the kernel has non-finite entries or is not a float64 CPU matrix.
    """
    if kernel.dtype != torch.float64 or kernel.device.type != "cpu" or not kernel.is_contiguous():
        raise ValueError(
            f"kernel must be a C-contiguous float64 CPU matrix to choose the ridge, got {kernel.dtype} on "
            f"{kernel.device}"
        )
    check_finite(kernel, "kernel")
    grid = np.asarray(grid, dtype=np.float64)
    n = kernel.shape[0]
    arr = kernel.numpy()
    with threadpool_limits(limits=1, user_api="blas"):  # the same OpenBLAS guard as the Cholesky (ridge.py)
        values, vectors, _, _, info = lapack.dsyevr(arr.T, compute_v=1, range="A", lower=1, overwrite_a=1)
    if info != 0:  # pragma: no cover - LAPACK contract
        raise RuntimeError(f"the eigendecomposition of the kernel failed, LAPACK info {info}")
    step = row_block(n)
    for s in range(0, n, step):  # the kernel back, row block by row block
        arr[s : s + step] = (vectors[s : s + step] * values) @ vectors.T
    y = targets.detach().to(torch.float64).cpu().numpy()
    projected = vectors.T @ y  # Uᵀ Y, n × C
    shifted = values[:, None] + grid[None, :]  # n × G
    valid = shifted.min(axis=0) > 0
    inverse = np.where(shifted > 0, 1.0 / np.where(shifted > 0, shifted, 1.0), 0.0)
    loo = np.full(grid.size, np.inf)
    gcv = np.full(grid.size, np.inf)
    for g in np.flatnonzero(valid):
        alpha = vectors @ (projected * inverse[:, g : g + 1])
        diag = np.empty(n)
        for s in range(0, n, step):
            block = vectors[s : s + step]
            diag[s : s + step] = (block * block) @ inverse[:, g]
        loo[g] = float(np.mean(np.sum((alpha / diag[:, None]) ** 2, axis=1)))
        trace = grid[g] * float(inverse[:, g].sum()) / n
        gcv[g] = float(np.mean(np.sum((grid[g] * alpha) ** 2, axis=1))) / trace**2
    return {"ridge": grid, "loo": loo, "gcv": gcv}


def choose_ridge(
    kernel: torch.Tensor, targets: torch.Tensor, rule: str = "loo", relative_grid: tuple[float, ...] | None = None
) -> tuple[float, dict[str, np.ndarray]]:
    """
    The ridge of a grid that minimises a rule (see the module docstring).

    :param kernel: As in :func:`ridge_criteria` (overwritten and computed back).
    :param targets: ``n × C`` regression targets.
    :param rule: ``"loo"`` or ``"gcv"``.
    :param relative_grid: Ridges as multiples of the kernel's mean diagonal; default :data:`DEFAULT_RELATIVE_GRID`.
    :return: ``(ridge, criteria)`` with the criteria of :func:`ridge_criteria`.
    :raises ValueError: For an unknown rule, an empty grid or a kernel without a positive diagonal.
    """
    if rule not in RIDGE_RULES:
        raise ValueError(f"rule must be one of {RIDGE_RULES}, got {rule!r}")
    relative = np.asarray(DEFAULT_RELATIVE_GRID if relative_grid is None else relative_grid, dtype=np.float64)
    if relative.size == 0 or not np.all(np.isfinite(relative) & (relative > 0)):
        raise ValueError(f"relative_grid must hold positive finite numbers, got {relative_grid!r}")
    scale = float(kernel.diagonal().mean()) if kernel.numel() else 0.0
    if not scale > 0:
        raise ValueError(f"kernel must have a positive mean diagonal to scale the ridge grid, got {scale!r}")
    criteria = ridge_criteria(kernel, targets, scale * relative)
    values = criteria[rule]
    if not np.isfinite(values).any():
        raise ValueError("the ridge grid holds no value at which K + ridge*I is positive definite; raise relative_grid")
    best = int(np.argmin(values))
    edge = " (at the edge of the grid: widen relative_grid)" if best in (0, values.size - 1) else ""
    logger.info("ridge chosen by %s: %.3g (%.3g times the kernel's mean diagonal)%s", rule, criteria["ridge"][best],
                relative[best], edge)
    return float(criteria["ridge"][best]), criteria
