"""
The factors of the exact dual solve: what a factor of ``A_QQ⁻¹`` must answer, and the one held whole.

:class:`~art_malleability.linalg.ridge.DualRidge` keeps the inverse Cholesky factor ``M`` of ``A_QQ`` (``A = K + λI``
on the examples a row update leaves alone) and asks it for products, column norms and the blocks of an update only,
through :class:`InverseFactor`. Two factors implement it: :class:`DenseFactor` (one lower-triangular matrix, computed
in the kernel's memory) and :class:`~art_malleability.linalg._tiles.TiledInverseFactor` (square tiles in memory or on
disk, dealt out over a process group). Wide matrices of an update answer :class:`Columns` (:class:`DenseColumns`, or
the tiles' :class:`~art_malleability.linalg._tiles.ColumnBlocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from scipy.linalg import lapack
from threadpoolctl import threadpool_limits

from art_malleability.linalg._checks import check_finite, not_positive_definite

#: ``columns(cols) -> tensor``: the columns ``cols`` (an index array) of a matrix with few rows.
ColumnFn = Callable[[np.ndarray], torch.Tensor]

# Elements of the temporaries of row-block loops over n × n matrices (8 MiB in float64).
_BLOCK_ELEMENTS = 2**20


@runtime_checkable
class Columns(Protocol):
    """A wide matrix ``X`` (``r × c``) known by its products and column norms."""

    def matmul(self, v: torch.Tensor) -> torch.Tensor:
        """``X v``."""

    def t_matmul(self, u: torch.Tensor) -> torch.Tensor:
        """``Xᵀ u``."""

    def column_sq_norms(self) -> torch.Tensor:
        """The squared norms of ``X``'s columns, ``(c,)``."""


@runtime_checkable
class InverseFactor(Columns, Protocol):
    """
    The inverse Cholesky factor ``M = L⁻¹`` of ``A_QQ = LLᵀ`` (lower triangular): its products and column norms (the
    diagonal of ``A_QQ⁻¹ = MᵀM``), the blocks of a row update, and the release of what it holds.
    """

    def schur(self, columns: ColumnFn, a_pp: torch.Tensor,
              invert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Columns, torch.Tensor]:
        """
        The blocks of an update of the rows ``P`` (``m`` of them): with ``A_QP`` given by ``columns`` (its columns
        ``Q``, as an ``m × |Q|`` matrix) and ``A_PP``, the inverse factor ``Y_P`` of the Schur complement
        ``S = A_PP − A_PQ A_QQ⁻¹ A_QP`` (``invert`` turns ``S`` into it) and ``X = −Y_P A_PQ MᵀM`` (``m × |Q|``).

        :return: ``(X, Y_P)``.
        """

    def close(self) -> None:
        """Release what the factor holds (files on disk included); it answers nothing after."""


def row_block(n_cols: int) -> int:
    """Rows per block of a loop over a matrix with ``n_cols`` columns, so that temporaries stay small."""
    return max(1, _BLOCK_ELEMENTS // max(n_cols, 1))



def inverse_cholesky_(a: torch.Tensor, ridge: float, what: str = "K + ridge*I") -> torch.Tensor:
    """
    Overwrite the symmetric positive definite matrix ``a`` with ``L⁻¹`` where ``a = LLᵀ``.

    On the CPU in float64 this runs LAPACK ``potrf`` and ``trtri`` in ``a``'s own memory (no
    second ``n × n`` buffer); elsewhere it uses :mod:`torch.linalg` (two temporary buffers).

    The in-place LAPACK calls run on one OpenBLAS thread. SciPy's bundled OpenBLAS (0.3.30, and numpy's 0.3.31
    alike) crashes with a segmentation fault in its multi-threaded ``potrf`` on matrices of about 2 GB and more
    (``n ≳ 16,000`` in float64) once another thread pool of the process (PyTorch's OpenMP, started by any
    parallel tensor operation) has run: the crash depends on the address layout (it disappears without address
    randomisation) and on OpenBLAS's threads (it disappears with one), not on the data. One thread costs little
    here (measured 40 s for ``n = 16,000`` on 2 cores, against 37 s with two threads).

    :param a: Symmetric positive definite matrix, C-contiguous; its content is destroyed.
    :param ridge: The ridge that was added (for the error message).
    :param what: Name of the matrix (for the error message).
    :return: ``L⁻¹``, lower triangular (on the CPU a transposed view of ``a``'s memory).
    :raises ValueError: If ``a`` has non-finite entries or is not positive definite.
    """
    check_finite(a, what)
    scale = float(a.diagonal().abs().max()) if a.numel() else 0.0
    if a.shape[0] == 0:
        return a
    if a.device.type == "cpu" and a.dtype == torch.float64 and a.is_contiguous():
        arr = a.numpy()
        # arr.T is Fortran-ordered and equal to arr (symmetric): LAPACK works on it in place
        with threadpool_limits(limits=1, user_api="blas"):
            factor, info = lapack.dpotrf(arr.T, lower=1, overwrite_a=1, clean=1)
            if info != 0:
                raise not_positive_definite(what, ridge, scale)
            inverse, info = lapack.dtrtri(factor, lower=1, overwrite_c=1)
        if info != 0 or not np.shares_memory(inverse, arr):  # pragma: no cover - LAPACK contract
            raise RuntimeError(f"the triangular inverse must be computed in place, got LAPACK info {info}")
        return a.T
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0:
        raise not_positive_definite(what, ridge, scale)
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    a.copy_(torch.linalg.solve_triangular(chol, eye, upper=False))
    return a


def sq_column_norms(m: torch.Tensor) -> torch.Tensor:
    """Squared column norms, accumulated over row blocks (no temporary of ``m``'s size)."""
    out = torch.zeros(m.shape[1], dtype=m.dtype, device=m.device)
    step = row_block(m.shape[1])
    for s in range(0, m.shape[0], step):
        block = m[s : s + step]
        out += (block * block).sum(dim=0)
    return out


class DenseColumns:
    """A wide matrix ``X`` held whole (the counterpart of the tiles' ``ColumnBlocks``)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def matmul(self, v: torch.Tensor) -> torch.Tensor:
        return self.x @ v

    def t_matmul(self, u: torch.Tensor) -> torch.Tensor:
        return self.x.T @ u

    def column_sq_norms(self) -> torch.Tensor:
        return sq_column_norms(self.x)


class DenseFactor(DenseColumns):
    """An inverse Cholesky factor held as one lower-triangular matrix (computed in the kernel's memory layout); its
    products and column norms are those of any matrix held whole."""

    def __init__(self, a: torch.Tensor, ridge: float) -> None:
        super().__init__(inverse_cholesky_(a, ridge))

    def schur(self, columns: ColumnFn, a_pp: torch.Tensor,
              invert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[DenseColumns, torch.Tensor]:
        """The blocks of a row update, as :meth:`InverseFactor.schur` asks, with whole matrices (at most
        three ``m × n`` blocks at once)."""
        l_qp = self.x @ columns(np.arange(self.x.shape[0])).to(self.x.dtype).T  # M A_QP, (n - m) × m
        y_p = invert(a_pp - l_qp.T @ l_qp)
        w = self.x.T @ l_qp  # Mᵀ M A_QP
        del l_qp
        x = -(y_p @ w.T)
        del w
        return DenseColumns(x), y_p

    def close(self) -> None:
        self.x = None
