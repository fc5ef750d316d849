"""
Kernel ridge regression with its exact closed-form leave-one-out, in the dual and in the primal.

Both solvers fit targets ``Y`` (``n × C``) with ridge ``λ`` and describe, for every query ``q`` and
training example ``i``, the change of the prediction when ``i`` is removed and the regression is
solved again, without retraining:

    Δf_{q,i} = −b_{q,i} · β_i                (``b`` an ``n_q × n`` matrix, ``β`` an ``n × C`` matrix)

- **Dual** (:class:`DualRidge`, an ``n × n`` kernel ``K``): with ``A = K + λI``, ``α = A⁻¹Y``,
  ``b = K_q A⁻¹`` and ``β_i = α_i / (A⁻¹)_ii``.
- **Primal** (:class:`PrimalRidge`, features ``Φ`` of shape ``n × k`` with ``K = ΦΦᵀ``): with
  ``A = ΦᵀΦ + λI`` (``k × k``), weights ``W = A⁻¹ΦᵀY``, hat diagonal ``h_i = φ_iᵀA⁻¹φ_i`` and
  residual ``r_i = y_i − φ_iᵀW``: ``b_{q,i} = φ_qᵀA⁻¹φ_i`` and ``β_i = r_i / (1 − h_i)``.

The two are the same leave-one-out (``λα = r`` and ``λ(A⁻¹)_ii = 1 − h_i`` for ``K = ΦΦᵀ``). The
dual computes ``(A⁻¹)_ii`` directly; the primal computes ``1 − h_i``, which cancels when the
regression nearly interpolates (``n ≤ k``), so callers use the dual there (its ``n × n`` system is
then no larger than the primal's ``k × k`` one).

**Memory.** On the CPU in float64 the dual holds at most two ``n × n`` matrices: the kernel and an
inverse Cholesky factor computed in place (LAPACK ``potrf`` then ``trtri`` on one buffer); every
other temporary is gathered in row blocks. On other devices a factorisation goes through
:mod:`torch.linalg` and briefly needs three more ``n × n`` buffers (the factor, an identity and the
triangular solve's result). The primal holds ``Φ`` and at most four ``k × k`` matrices (three in
one process), never an ``n × n`` one.

**Failures.** A matrix with non-finite entries is refused before it is factorised, and an update
that fails leaves the solver as it was before the update.

**Updates.** When only the rows ``P`` (``m`` examples) of the training set change:

- the dual keeps the kernel of the base fit and the inverse Cholesky factor ``M`` of ``A_QQ`` (the
  unchanged examples, computed once per ``P``); with the examples ordered ``(Q, P)`` the factor of
  the new ``A'`` is ``[[L_QQ, 0], [A'_PQ L_QQ⁻ᵀ, chol(S)]]`` with the Schur complement
  ``S = A'_PP − A'_PQ A_QQ⁻¹ A'_QP``, so an update costs ``O(m n²)`` instead of ``O(n³)``;
- the primal updates ``ΦᵀΦ`` and ``ΦᵀY`` by the changed rows (``O(m k²)``) and solves the
  ``k × k`` system again.

Either result equals a fit from scratch up to rounding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from art_malleability._utils import cache as _cache
from art_malleability._utils.cache import BoundedCache
from art_malleability._utils.torch_utils import tensor_digest
from art_malleability.distributed import ONE_PROCESS, Shard
from art_malleability.linalg._checks import check_finite, not_positive_definite
from art_malleability.linalg._tiles import TiledInverseFactor
from art_malleability.linalg.factors import (
    ColumnFn,
    DenseColumns,
    DenseFactor,
    InverseFactor,
    inverse_cholesky_,
    row_block,
    sq_column_norms,
)

logger = logging.getLogger(__name__)

# Rows of Φ multiplied at once when the hat diagonal is computed.
_ROW_CHUNK = 8192


Reduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def kernel_ridge_predict(
    k_train: torch.Tensor, k_test: torch.Tensor, targets: torch.Tensor, ridge: float
) -> torch.Tensor:
    """
    Predictions of kernel ridge regression, ``K_test (K_train + λI)⁻¹ Y``, through a Cholesky factorisation.

    :param k_train: ``n × n`` symmetric kernel of the training points.
    :param k_test: ``n_q × n`` kernel between the query and the training points.
    :param targets: ``n × C`` regression targets.
    :param ridge: Ridge ``λ > 0``.
    :return: ``(n_q, C)`` predictions, in ``k_train``'s dtype.
    :raises ValueError: If ``K_train + λI`` has non-finite entries or is not positive definite.
    """
    a = k_train + ridge * torch.eye(k_train.shape[0], dtype=k_train.dtype, device=k_train.device)
    check_finite(a, "k_train + ridge*I")
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) != 0:
        scale = float(a.diagonal().abs().max()) if a.numel() else 0.0
        raise not_positive_definite("k_train + ridge*I", ridge, scale)
    return k_test.to(a.dtype) @ torch.cholesky_solve(targets.to(a.dtype), chol)


class DualRidge:
    """
    Kernel ridge regression on an ``n × n`` kernel, with exact leave-one-out and row updates.

    The inverse Cholesky factor ``M`` of ``A_QQ`` is held either as one matrix computed in place (``block=None``:
    at most two ``n × n`` matrices in memory, the kernel and ``M``), or as tiles of ``block`` rows
    (:mod:`~art_malleability.linalg._tiles`), in memory or, with ``folder``, in files of a temporary folder that
    the solver creates and removes: then the kernel is never held whole either (it is given as a function of tiles)
    and the memory is a few tiles plus two sets of ``(n − m) × m`` blocks of an update of ``m`` rows, held by tile
    row (over a process group each process holds those of its own tile rows). Both give the same results up to
    rounding.

    :param ridge: Ridge ``λ > 0``.
    :param block: ``None`` (one matrix) or the tile size.
    :param folder: With ``block``: ``None`` (tiles in memory) or a folder for the tiles' temporary files.
    :param group: With ``block``: the process group (:class:`~art_malleability.distributed.Shard`) over which the
        tile rows are dealt out (one process by default). Every process calls every method together with the same
        arguments and gets the same results; each computes and holds only its own tiles of the kernel and the factor,
        and its own blocks of an update.

    Fitted attributes: ``kernel_`` (the base kernel, owned by the solver; the tile function with ``block``),
    ``alpha_`` (``A⁻¹Y`` of the current training set), ``cinv_diag_`` (``diag A⁻¹``), ``changed_`` (rows
    that differ from the base fit).
    """

    def __init__(self, ridge: float, block: int | None = None, folder: str | os.PathLike | None = None,
                 group: Shard = ONE_PROCESS) -> None:
        self.ridge = float(ridge)
        self.block = block
        self.folder = folder
        self.group = group
        self._m: InverseFactor | None = None  # inverse Cholesky factor of A_QQ
        self.close()

    def fit(self, kernel: torch.Tensor | Callable, targets: torch.Tensor) -> DualRidge:
        """
        :param kernel: ``n × n`` symmetric kernel, float64 (the solver keeps it, not copied), or, with ``block``, a
            function ``kernel(rows, cols)`` of two index arrays returning that block of the kernel.
        :param targets: ``n × C`` regression targets.
        :return: ``self``.
        """
        if callable(kernel) and not isinstance(kernel, torch.Tensor) and self.block is None:
            raise ValueError("block must be a tile size when the kernel is given as a function of tiles, got None")
        self.kernel_ = kernel
        self._n = int(targets.shape[0])
        self._dtype = targets.dtype if not isinstance(kernel, torch.Tensor) else kernel.dtype
        self._device = targets.device if not isinstance(kernel, torch.Tensor) else kernel.device
        self._dtype = torch.float64 if not self._dtype.is_floating_point else self._dtype
        self.targets_ = targets.to(self._dtype)
        self.close()  # no factor of A_QQ yet
        self.update(np.zeros(0, dtype=np.int64), torch.zeros((0, self._n), dtype=self._dtype, device=self._device))
        return self

    @property
    def n(self) -> int:
        return self._n

    def close(self) -> None:
        """Release the factor (and, for tiles on disk, remove their folder)."""
        if self._m is not None:
            self._m.close()
        self._m, self._q_key = None, None
        self._query_solves = BoundedCache(_cache.QUERY_CACHE_BYTES, lambda t: t.numel() * t.element_size())

    def update(self, changed: np.ndarray, rows: torch.Tensor | ColumnFn) -> DualRidge:
        """
        Solve again for a training set that differs from the base fit only in the rows ``changed``.
        If it fails, the solver is left as it was (its factor and blocks are computed again).

        :param changed: Indices of the changed examples (``m``, distinct).
        :param rows: Their new kernel rows against the whole new training set, ``(m, n)``, or a function
            ``rows(cols)`` returning the columns ``cols`` (an index array) of that ``m × n`` matrix. With tiles, the
            solver asks each process only for the columns of its own tile rows, so the ``m × n`` rows are never
            held whole (nor computed twice over a process group).
        :return: ``self``.
        """
        previous, previous_rows = getattr(self, "_p", None), getattr(self, "_rows", None)
        try:
            return self._update(changed, rows)
        except BaseException:
            if previous is not None:
                if self._q_key != previous.tobytes():
                    self.close()  # the restored state recomputes its factor
                try:
                    self._update(previous, previous_rows)
                except BaseException:
                    self.close()  # no state to answer from: solve() says so (fit again)
                    self._p = self._x = None
            raise

    def _factor(self, qt: torch.Tensor) -> InverseFactor:
        if self.block is None:
            a_qq = self._submatrix(qt)
            a_qq.diagonal().add_(self.ridge)
            return DenseFactor(a_qq, self.ridge)
        q = qt.cpu().numpy()
        if isinstance(self.kernel_, torch.Tensor):
            kernel = self.kernel_

            def tile(rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
                return kernel[torch.as_tensor(q[rows], device=kernel.device)][:, torch.as_tensor(q[cols])]
        else:

            def tile(rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
                return self.kernel_(q[rows], q[cols])

        return TiledInverseFactor(
            tile, len(q), self.ridge, self.block, self.folder, self._dtype, self._device, self.group
        )

    def _update(self, changed: np.ndarray, rows: torch.Tensor | ColumnFn) -> DualRidge:
        n = self.n
        p = np.asarray(changed, dtype=np.int64)
        mask = np.ones(n, dtype=bool)
        mask[p] = False
        q = np.flatnonzero(mask)
        key = p.tobytes()
        dev = self._device
        pt, qt = torch.as_tensor(p, device=dev), torch.as_tensor(q, device=dev)
        self._p, self._x = None, None  # the previous update's blocks go before the new ones are computed
        if self._q_key != key:
            self.close()  # release before the next factor
            self._m = self._factor(qt)
            self._q_key = key
        m = self._m
        if len(p):
            columns = self._columns(rows)
            a_pp = self._changed_block(columns, p)
            a_pp = 0.5 * (a_pp + a_pp.T)
            a_pp.diagonal().add_(self.ridge)

            def invert(schur: torch.Tensor) -> torch.Tensor:
                return inverse_cholesky_(schur.contiguous(), self.ridge, "the Schur complement of the changed rows")

            x, y_p = m.schur(lambda idx: columns(q[idx]), a_pp, invert)
        else:
            x = DenseColumns(torch.zeros((0, len(q)), dtype=self._dtype, device=dev))
            y_p = torch.zeros((0, 0), dtype=self._dtype, device=dev)
        self._p, self._q, self._pt, self._qt = p, q, pt, qt
        self._x, self._yp, self._rows = x, y_p, rows
        self.changed_ = p
        diag = torch.empty(n, dtype=self._dtype, device=dev)
        diag[qt] = m.column_sq_norms() + x.column_sq_norms()
        diag[pt] = sq_column_norms(y_p)
        self.cinv_diag_ = diag
        self.alpha_ = self.solve(self.targets_)
        return self

    def _columns(self, rows: torch.Tensor | ColumnFn) -> ColumnFn:
        """The changed rows as a function of column indices, in the solver's dtype."""
        if callable(rows) and not isinstance(rows, torch.Tensor):
            return lambda cols: rows(cols).to(self._dtype)
        return lambda cols: rows[:, torch.as_tensor(cols, device=rows.device)].to(self._dtype)

    def _changed_block(self, columns: ColumnFn, p: np.ndarray) -> torch.Tensor:
        """``A'_PP`` without the ridge; over a process group each process computes its share of the columns."""
        group = self.group if self.block is not None else ONE_PROCESS  # the dense solve runs whole in every process
        start, stop = group.bounds(len(p))
        # fewer changed rows than processes: some have no columns to compute
        local = group.run_everywhere(
            lambda: columns(p[start:stop]) if stop > start else torch.zeros((len(p), 0), dtype=self._dtype))
        return group.all_gather_columns(local)

    def _submatrix(self, idx: torch.Tensor) -> torch.Tensor:
        """``K[idx][:, idx]`` as a new C-contiguous matrix, gathered in row blocks (no third ``n × n`` buffer)."""
        if len(idx) == self.n:
            return self.kernel_.clone()
        out = self.kernel_.new_empty((len(idx), len(idx)))
        step = row_block(self.n)
        for s in range(0, len(idx), step):
            out[s : s + step] = self.kernel_[idx[s : s + step]][:, idx]
        return out

    def solve(self, v: torch.Tensor, key: object = None) -> torch.Tensor:
        """
        :param v: ``(n, r)`` right-hand sides.
        :param key: Keep ``A_QQ⁻¹ v_Q`` (the part that the rows changed by an update leave alone) by this key while
            the factor of ``A_QQ`` stands, up to ``QUERY_CACHE_BYTES``, so that the same right-hand sides after
            another update of the same rows cost ``O(m n r)`` instead of ``O(n² r)``: ``None`` keeps nothing,
            ``"digest"`` keys by the digest of ``v_Q``, any other hashable is the caller's promise that equal keys
            come with equal rows ``v_Q``.
        :return: ``A⁻¹ v`` for the current training set.
        """
        if self._x is None:
            raise RuntimeError("the solver has no solution: an update failed and so did restoring the previous one; "
                               "fit it again")
        v = v.to(self._dtype)
        vq, vp = v[self._qt], v[self._pt]

        def unchanged() -> torch.Tensor:
            return self._m.t_matmul(self._m.matmul(vq))

        if key is None:
            base = unchanged()
        else:
            base = self._query_solves.get(tensor_digest(vq) if key == "digest" else key, unchanged)
        up = self._x.matmul(vq) + self._yp @ vp
        out = torch.empty_like(v)
        out[self._qt] = base + self._x.t_matmul(up)
        out[self._pt] = self._yp.T @ up
        return out

    def loo_parts(self, k_q: torch.Tensor, key: object = "digest") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        The queries' solves are kept between updates of the same rows (see :meth:`solve`): an audit asks for the
        same blocks of queries after every refit.

        :param k_q: Query kernel rows against the current training set, ``(n_q, n)``.
        :param key: What identifies the queries' kernel rows on the unchanged examples (see :meth:`solve`).
        :return: ``(f, b, β)``: predictions ``(n_q, C)``, ``b = K_q A⁻¹`` and ``β = α / diag A⁻¹``.
        """
        k_q = k_q.to(self._dtype)
        f = k_q @ self.alpha_
        b = self.solve(k_q.T.contiguous(), key).T
        beta = self.alpha_ / self.cinv_diag_[:, None]
        return f, b, beta


class PrimalRidge:
    """
    Ridge regression on features ``Φ`` (``n × k``) with exact leave-one-out, solved with a
    ``k × k`` system; memory ``O(n k + k²)``.

    In a sharded run every process holds the rows of its shard; ``reduce`` sums a tensor over the
    processes (an all-reduce), so that ``ΦᵀΦ`` and ``ΦᵀY`` cover the whole training set while the
    per-example quantities (``h``, ``r``, ``b``) stay local.

    :param ridge: Ridge ``λ > 0``.
    :param reduce: Sum over processes (identity in one process).

    Fitted attributes: ``features_`` (local ``Φ``, as the last update left it), ``gram_`` (the fit's ``ΦᵀΦ``),
    ``cross_`` (the fit's ``ΦᵀY``),
    ``weights_`` (``W``), ``hat_`` (``h``), ``beta_`` (``r / (1 − h)``).
    """

    def __init__(self, ridge: float, reduce: Reduce | None = None) -> None:
        self.ridge = float(ridge)
        self.reduce = reduce or _identity

    def fit(self, features: torch.Tensor, targets: torch.Tensor) -> PrimalRidge:
        """
        :param features: Local rows of ``Φ``, ``(n_local, k)``, float64; kept (not copied).
        :param targets: Their targets ``(n_local, C)``.
        :return: ``self``.
        """
        self.features_ = features
        self.targets_ = targets.to(features.dtype)
        self.gram_ = self.reduce(features.T @ features)
        self.cross_ = self.reduce(features.T @ self.targets_)
        self._changed = np.zeros(0, dtype=np.int64)  # local rows an update replaced (sorted), and their fitted values
        self._fitted_rows = features[:0].clone()
        self._current: tuple[torch.Tensor, torch.Tensor] | None = None  # ΦᵀΦ and ΦᵀY after the last update
        self._linv = None
        self._solve(self.gram_, self.cross_)
        return self

    def update(self, changed: np.ndarray, rows: torch.Tensor) -> PrimalRidge:
        """
        Solve for the fitted training set with the local feature rows ``changed`` replaced by ``rows``; rows an
        earlier update replaced go back to their fitted values in the same call. Each update is taken from the fit's
        ``ΦᵀΦ`` and ``ΦᵀY``, so its result does not depend on the updates before it (an attack's refit is the same
        whichever ran before it, and a resumed audit's is the uninterrupted one's). A collective call in a sharded
        run: every process calls it, possibly with no rows. If it fails, the solver is left as it was.

        :param changed: Local indices of the changed examples (distinct).
        :param rows: Their new features ``(m, k)``.
        :return: ``self``.
        """
        changed = np.asarray(changed, dtype=np.int64)
        order = np.argsort(changed, kind="stable")
        changed, rows = changed[order], rows.to(self.features_.dtype)[torch.as_tensor(order)]
        idx = torch.as_tensor(changed, device=self.features_.device)
        fitted = self._fitted(changed)
        y = self.targets_[idx]
        delta = rows.T @ rows
        delta.addmm_(fitted.T, fitted, alpha=-1.0)
        gram = self.reduce(delta)
        del delta
        gram += self.gram_
        cross = self.cross_ + self.reduce(rows.T @ y - fitted.T @ y)
        back = torch.as_tensor(self._changed, device=self.features_.device)
        current = self.features_[back].clone()  # the rows of the last update, as they are now
        self.features_[back] = self._fitted_rows
        self.features_[idx] = rows
        self._linv = None  # released before the new factor is allocated
        try:
            self._solve(gram, cross)
        except BaseException:
            self.features_[idx] = fitted
            self.features_[back] = current
            self._solve(*(self._current or (self.gram_, self.cross_)))
            raise
        self._current = None if len(changed) == 0 else (gram, cross)
        self._changed, self._fitted_rows = changed, fitted
        return self

    def _fitted(self, changed: np.ndarray) -> torch.Tensor:
        """:return: The fitted feature rows of the sorted local indices ``changed``."""
        rows = self.features_[torch.as_tensor(changed, device=self.features_.device)].clone()
        at = np.searchsorted(self._changed, changed)
        earlier = at < len(self._changed)
        earlier[earlier] = self._changed[at[earlier]] == changed[earlier]
        if earlier.any():  # replaced by the last update: its fitted values were kept
            rows[torch.as_tensor(np.flatnonzero(earlier))] = self._fitted_rows[torch.as_tensor(at[earlier])]
        return rows

    def _solve(self, gram: torch.Tensor, cross: torch.Tensor) -> None:
        a = gram.clone()
        a.diagonal().add_(self.ridge)
        linv = inverse_cholesky_(a, self.ridge, "Phi^T Phi + ridge*I")
        weights = linv.T @ (linv @ cross)
        phi = self.features_
        hat = torch.empty(phi.shape[0], dtype=phi.dtype, device=phi.device)
        for s in range(0, phi.shape[0], _ROW_CHUNK):
            z = phi[s : s + _ROW_CHUNK] @ linv.T
            hat[s : s + _ROW_CHUNK] = (z * z).sum(dim=1)
        residual = self.targets_ - phi @ weights
        self._linv, self.weights_, self.hat_ = linv, weights, hat
        self.beta_ = residual / (1.0 - hat)[:, None]

    def loo_parts(self, phi_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """
        :param phi_q: Query features ``(n_q, k)``.
        :return: ``(f, b, β)`` with ``b`` over the local training rows.
        """
        phi_q = phi_q.to(self.features_.dtype)
        f = phi_q @ self.weights_
        b = ((phi_q @ self._linv.T) @ self._linv) @ self.features_.T
        return f, b, self.beta_
