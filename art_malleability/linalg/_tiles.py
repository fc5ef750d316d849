"""
Blocked linear algebra on the lower triangle of an ``n × n`` matrix held as square tiles, in memory or in a
folder on disk: the exact dual solve of the NTK influence beyond one matrix in memory.

A :class:`TileStore` holds the tiles ``(i, j)``, ``i ≥ j``, of a lower-triangular (or symmetric, lower half)
matrix in blocks of ``block`` rows; on disk every tile is its own file, read and written whole (plain file I/O,
not a memory map, so the operating system's cache never counts as the process's memory). The algorithms work
tile by tile, so the memory they need is a few tiles plus their inputs and outputs:

- :func:`cholesky_` — left-looking blocked Cholesky, ``A = LLᵀ`` in place (``A``'s lower tiles become ``L``'s);
- :func:`triangular_inverse_` — ``L⁻¹`` in place, block column by block column;
- :func:`lower_matmul`, :func:`lower_t_matmul` — ``M V`` and ``Mᵀ U`` for the stored lower-triangular ``M``;
- :func:`column_sq_norms` — squared column norms of ``M`` (the diagonal of ``MᵀM``);
- :func:`lower_matmul_rows`, :func:`lower_t_matmul_rows` — the same products for tall operands held in row blocks
  by the process that owns each tile row (the ``(n − m) × m`` blocks of a row update), never whole on one process.

Each is checked against the dense computation in the tests (``tests/test_tiles.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from art_malleability.distributed import ONE_PROCESS, Shard
from art_malleability.linalg._checks import not_positive_definite
from art_malleability.linalg.factors import ColumnFn, Columns, InverseFactor

#: ``tile(rows, cols) -> tensor``: one block of a matrix, rows and columns given as index arrays.
TileFn = Callable[[np.ndarray, np.ndarray], torch.Tensor]
#: A tall matrix in row blocks by tile row: ``{i: rows i of it}``, each process holding the tile rows it owns.
RowBlocks = dict[int, torch.Tensor]

class TileStore:
    """
    The lower tiles of an ``n × n`` matrix, in memory or in files of a temporary folder that the store creates and
    removes (:meth:`close`, also on garbage collection).

    Over a process group the tile rows are dealt out cyclically: rank ``r`` of ``w`` holds the tiles of the tile rows
    ``i`` with ``i mod w = r`` (:meth:`owns`), so each process holds about ``1/w`` of the matrix, and the algorithms
    below exchange the tiles a step needs with broadcasts and sum their parts with an all-reduce. Every process of the
    group calls them together. In one process (``group=None``) every collective is the identity.

    :param n: Matrix size.
    :param block: Tile size (the last tile row and column may be smaller).
    :param dtype: Dtype of the tiles.
    :param device: Device the tiles are handed out on.
    :param folder: ``None``: tiles in memory; a folder: tiles in a new temporary subfolder of it (removed on close).
    :param group: The process group (a :class:`~art_malleability.distributed.Shard`; one process by default).
    """

    def __init__(
        self, n: int, block: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu",
        folder: str | os.PathLike | None = None, group: Shard = ONE_PROCESS,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be a positive integer, got {block!r}")
        self.n, self.block, self.dtype, self.device = int(n), int(block), dtype, torch.device(device)
        self.group = group
        self.count = -(-self.n // self.block)
        self._memory: dict[tuple[int, int], torch.Tensor] | None = None
        self.path: Path | None = None
        if folder is None:
            self._memory = {}
        else:
            self.path = Path(tempfile.mkdtemp(prefix="art-malleability-tiles-", dir=folder))

    def rows(self, i: int) -> slice:
        """:return: The matrix rows of tile row ``i``."""
        return slice(i * self.block, min((i + 1) * self.block, self.n))

    def size(self, i: int) -> int:
        return self.rows(i).stop - self.rows(i).start

    def owner(self, i: int) -> int:
        """:return: The rank that holds tile row ``i``."""
        return i % self.group.world_size

    def owns(self, i: int) -> bool:
        """:return: Whether this process holds tile row ``i``."""
        return self.owner(i) == self.group.rank

    def get(self, i: int, j: int) -> torch.Tensor:
        """:return: Tile ``(i, j)`` (``i ≥ j``, a row this process holds); from disk a new tensor, from memory the
        stored one (which a later :meth:`put` of the same tile overwrites in place)."""
        if j > i:
            raise IndexError(f"tile ({i}, {j}) is above the diagonal; the store holds the lower tiles")
        if self._memory is not None:
            return self._memory[(i, j)]
        array = np.fromfile(self._file(i, j), dtype=_numpy_dtype(self.dtype))
        return torch.from_numpy(array.reshape(self.size(i), self.size(j))).to(self.device)

    def put(self, i: int, j: int, tile: torch.Tensor) -> None:
        """Store tile ``(i, j)`` (``i ≥ j``)."""
        if j > i:
            raise IndexError(f"tile ({i}, {j}) is above the diagonal; the store holds the lower tiles")
        if tuple(tile.shape) != (self.size(i), self.size(j)):
            raise ValueError(f"tile ({i}, {j}) must have shape {(self.size(i), self.size(j))}, got {tuple(tile.shape)}")
        tile = tile.to(dtype=self.dtype)
        if self._memory is not None:
            kept = self._memory.get((i, j))
            if kept is not None:  # overwrite in place: a replaced tile would leave a hole of its size in the heap
                kept.copy_(tile)
            else:
                self._memory[(i, j)] = tile.to(self.device).contiguous()
            return
        tile.detach().cpu().contiguous().numpy().tofile(self._file(i, j))

    def fill(self, tile_fn: TileFn, diagonal: float = 0.0) -> None:
        """Store this process's lower tiles of a symmetric matrix from ``tile_fn``, adding ``diagonal`` to its
        diagonal."""
        for i, j in self.lower():
            tile = tile_fn(np.arange(self.n)[self.rows(i)], np.arange(self.n)[self.rows(j)]).to(self.dtype)
            if i == j:
                tile = 0.5 * (tile + tile.T)
                tile.diagonal().add_(diagonal)
            self.put(i, j, tile)

    def lower(self) -> Iterator[tuple[int, int]]:
        """The indices ``(i, j)``, ``i ≥ j``, of the tiles this process holds, column by column."""
        for j in range(self.count):
            for i in range(j, self.count):
                if self.owns(i):
                    yield i, j

    def broadcast(self, tile: torch.Tensor | None, i: int, j: int, src: int) -> torch.Tensor:
        """:return: Rank ``src``'s tensor of tile ``(i, j)``'s shape on every process."""
        return self.group.broadcast(tile, (self.size(i), self.size(j)), self.dtype, src, self.device)

    def dense(self) -> torch.Tensor:
        """:return: The whole lower-triangular matrix on every process (for tests and small problems)."""
        out = torch.zeros((self.n, self.n), dtype=self.dtype, device=self.device)
        for i, j in self.lower():
            out[self.rows(i), self.rows(j)] = self.get(i, j)
        return self.group.all_reduce(out)

    def close(self) -> None:
        """Release the tiles; on disk, remove the folder the store created."""
        if self.path is not None and self.path.exists():
            shutil.rmtree(self.path)
        self.path = None
        self._memory = {}

    def __del__(self) -> None:  # pragma: no cover - a safety net; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def _file(self, i: int, j: int) -> Path:
        if self.path is None:
            raise RuntimeError("the tile store is closed")
        return self.path / f"{i}_{j}.bin"


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


def cholesky_(store: TileStore, ridge: float, what: str = "K + ridge*I") -> None:
    """
    Left-looking blocked Cholesky in place: the lower tiles of the symmetric positive definite ``A`` become those
    of ``L`` with ``A = LLᵀ``. For each block column ``j``: ``A_ij -= Σ_{k<j} L_ik L_jkᵀ`` for ``i ≥ j``, then the
    diagonal tile is factorised and the tiles below it solved (``L_ij = A_ij L_jj⁻ᵀ``). Over a process group, the
    owner of tile row ``j`` broadcasts that row's finished tiles ``L_jk`` (``k < j``) and then ``L_jj``; every
    process updates and solves the tiles of its own rows.

    :param store: The lower tiles of ``A``; overwritten with ``L``.
    :param ridge: The ridge that was added (for the error message).
    :param what: Name of the matrix (for the error message).
    :raises ValueError: If ``A`` is not positive definite (or holds non-finite values), on every process.
    """
    group = store.group
    for j in range(store.count):
        owner, mine = store.owner(j), store.owns(j)
        row_j = [store.broadcast(store.get(j, k) if mine else None, j, k, owner) for k in range(j)]
        l_jj, status = None, torch.zeros(3, dtype=torch.float64)  # (failed, not finite, scale)
        if mine:
            diag = store.get(j, j).clone()
            for l_jk in row_j:
                diag.addmm_(l_jk, l_jk.T, alpha=-1.0)
            if not bool(torch.isfinite(diag).all()):
                status[:2] = 1.0
            else:
                l_jj, info = torch.linalg.cholesky_ex(diag)
                status[0], status[2] = float(int(info) != 0), float(diag.diagonal().abs().max())
        status = group.broadcast(status if mine else None, (3,), torch.float64, owner)
        if status[1]:
            raise ValueError(f"{what} must be finite, got NaN or infinite values; check the inputs and the model's "
                             "outputs")
        if status[0]:
            raise not_positive_definite(what, ridge, float(status[2]))
        l_jj = store.broadcast(l_jj, j, j, owner)
        if mine:
            store.put(j, j, l_jj)
        for i in range(j + 1, store.count):
            if not store.owns(i):
                continue
            tile = store.get(i, j).clone()
            for k, l_jk in enumerate(row_j):
                tile.addmm_(store.get(i, k), l_jk.T, alpha=-1.0)
            # L_ij = A_ij L_jj⁻ᵀ, i.e. L_jj L_ijᵀ = A_ijᵀ
            store.put(i, j, torch.linalg.solve_triangular(l_jj, tile.T, upper=False).T)


def triangular_inverse_(store: TileStore) -> None:
    """
    ``L⁻¹`` in place, block column by block column: with ``M = L⁻¹``, ``M_jj = L_jj⁻¹`` and, for ``i > j``,
    ``M_ij = −L_ii⁻¹ Σ_{j≤k<i} L_ik M_kj``. Within column ``j`` the tiles are finished top-down; as soon as
    ``M_kj`` is finished (and, over a process group, broadcast by its owner), every process adds ``L_ik M_kj`` to
    the running sums of its own rows ``i > k``. Column ``j`` reads ``L`` tiles of columns ``≥ j`` only, which are still
    ``L``; the inverses of the diagonal tiles are computed once and kept beside the tiles.

    :param store: The lower tiles of ``L``; overwritten with ``L⁻¹``.
    """
    count = store.count
    inverses = TileStore(store.n, store.block, store.dtype, store.device, store.path, store.group)
    try:
        for i in range(count):
            if store.owns(i):
                l_ii = store.get(i, i)
                eye = torch.eye(store.size(i), dtype=l_ii.dtype, device=l_ii.device)
                inverses.put(i, i, torch.linalg.solve_triangular(l_ii, eye, upper=False))
        for j in range(count):
            sums = {i: torch.zeros((store.size(i), store.size(j)), dtype=store.dtype, device=store.device)
                    for i in range(j + 1, count) if store.owns(i)}
            for k in range(j, count):
                m_kj = None
                if store.owns(k):
                    m_kj = inverses.get(j, j) if k == j else -(inverses.get(k, k) @ sums.pop(k))
                    store.put(k, j, m_kj)  # L_kj was last read at step k = j of this column
                if k + 1 == count:
                    break
                m_kj = store.broadcast(m_kj, k, j, store.owner(k))
                for i, acc in sums.items():
                    if i > k:
                        acc.addmm_(store.get(i, k), m_kj)
    finally:
        inverses.close()


def lower_matmul(store: TileStore, v: torch.Tensor) -> torch.Tensor:
    """:return: ``M v`` for the stored lower-triangular ``M`` and ``v`` of shape ``(n, r)`` (on every process)."""
    out = torch.zeros((store.n, v.shape[1]), dtype=store.dtype, device=v.device)
    for i, j in store.lower():
        out[store.rows(i)] += store.get(i, j).to(v.device) @ v[store.rows(j)]
    return store.group.all_reduce(out)


def lower_t_matmul(store: TileStore, u: torch.Tensor) -> torch.Tensor:
    """:return: ``Mᵀ u`` for the stored lower-triangular ``M`` and ``u`` of shape ``(n, r)`` (on every process)."""
    out = torch.zeros((store.n, u.shape[1]), dtype=store.dtype, device=u.device)
    for i, j in store.lower():
        out[store.rows(j)] += store.get(i, j).to(u.device).T @ u[store.rows(i)]
    return store.group.all_reduce(out)


def column_sq_norms(store: TileStore) -> torch.Tensor:
    """:return: The squared column norms of the stored lower-triangular ``M`` (on every process)."""
    out = torch.zeros(store.n, dtype=store.dtype, device=store.device)
    for i, j in store.lower():
        tile = store.get(i, j)
        out[store.rows(j)] += (tile * tile).sum(dim=0)
    return store.group.all_reduce(out)


def lower_matmul_rows(store: TileStore, b: RowBlocks, width: int) -> RowBlocks:
    """
    ``M B`` for the stored lower-triangular ``M`` and ``B`` of shape ``(n, width)`` held in row blocks: each process
    passes the blocks of the tile rows it owns and gets its own row blocks of the product. Block row ``j`` of ``B`` is
    broadcast by its owner at step ``j`` and released from ``b`` there (``b`` is emptied), so a process holds at most
    its own blocks of ``B`` and of the product and one broadcast block.
    """
    out = {i: torch.zeros((store.size(i), width), dtype=store.dtype, device=store.device)
           for i in range(store.count) if store.owns(i)}
    for j in range(store.count):
        b_j = store.group.broadcast(b.pop(j) if store.owns(j) else None, (store.size(j), width), store.dtype,
                                    store.owner(j), store.device)
        for i, acc in out.items():
            if i >= j:
                acc.addmm_(store.get(i, j), b_j)
        del b_j
    return out


def lower_t_matmul_rows(store: TileStore, u: RowBlocks, width: int,
                        then: Callable[[torch.Tensor], torch.Tensor]) -> RowBlocks:
    """
    ``then`` of each row block of ``Mᵀ U``, for ``U`` of shape ``(n, width)`` held in row blocks like
    :func:`lower_matmul_rows`: block ``j`` of ``Mᵀ U`` is summed over the processes, handed to ``then`` on its owner
    and only ``then``'s result is kept, so ``Mᵀ U`` is never held whole.

    :return: ``{j: then((Mᵀ U)_j)}`` for the tile rows ``j`` this process owns.
    """
    out: RowBlocks = {}
    for j in range(store.count):
        part = torch.zeros((store.size(j), width), dtype=store.dtype, device=store.device)
        for i, u_i in u.items():
            if i >= j:
                part.addmm_(store.get(i, j).T, u_i)
        part = store.group.all_reduce(part)
        if store.owns(j):
            out[j] = then(part)
        del part
    return out


class ColumnBlocks(Columns):
    """
    A wide matrix ``X`` (``rows × n``) held in column blocks by the store's tile rows, each on the process that owns
    that tile row: ``X v``, ``Xᵀ u`` and the squared column norms, summed over the processes.
    """

    def __init__(self, store: TileStore, blocks: RowBlocks, rows: int) -> None:
        self.store, self.blocks, self.rows = store, blocks, int(rows)

    def matmul(self, v: torch.Tensor) -> torch.Tensor:
        """:return: ``X v`` for ``v`` of shape ``(n, r)`` (on every process)."""
        out = torch.zeros((self.rows, v.shape[1]), dtype=self.store.dtype, device=v.device)
        for j, x_j in self.blocks.items():
            out.addmm_(x_j, v[self.store.rows(j)])
        return self.store.group.all_reduce(out)

    def t_matmul(self, u: torch.Tensor) -> torch.Tensor:
        """:return: ``Xᵀ u`` for ``u`` of shape ``(rows, r)`` (on every process)."""
        out = torch.zeros((self.store.n, u.shape[1]), dtype=self.store.dtype, device=u.device)
        for j, x_j in self.blocks.items():
            out[self.store.rows(j)] = x_j.T @ u
        return self.store.group.all_reduce(out)

    def column_sq_norms(self) -> torch.Tensor:
        """:return: The squared column norms of ``X`` (on every process)."""
        out = torch.zeros(self.store.n, dtype=self.store.dtype, device=self.store.device)
        for j, x_j in self.blocks.items():
            out[self.store.rows(j)] = (x_j * x_j).sum(dim=0)
        return self.store.group.all_reduce(out)


class TiledInverseFactor(InverseFactor):
    """
    The inverse Cholesky factor ``M = L⁻¹`` of ``A = K + λI`` held as lower tiles, in memory or on disk: filled from a
    tile function, factorised (:func:`cholesky_`) and inverted (:func:`triangular_inverse_`) in place.

    :param tile_fn: ``K``'s blocks by row and column index arrays.
    :param n: Matrix size.
    :param ridge: ``λ``, added to the diagonal.
    :param block: Tile size.
    :param folder: ``None`` (in memory) or a folder for the tiles' temporary files.
    :param dtype: Dtype of the tiles.
    :param device: Their device.
    :param group: The process group over which the tile rows are dealt out (each process computes its own tiles of
        ``K``; one process by default).
    """

    def __init__(self, tile_fn: TileFn, n: int, ridge: float, block: int, folder: str | os.PathLike | None,
                 dtype: torch.dtype, device: torch.device | str, group: Shard = ONE_PROCESS) -> None:
        self.store = TileStore(n, block, dtype, device, folder, group)
        try:  # every process computes its tiles before the first collective
            self.store.group.run_everywhere(self.store.fill, tile_fn, ridge)
            cholesky_(self.store, ridge)
            triangular_inverse_(self.store)
        except BaseException:
            self.store.close()
            raise

    def matmul(self, v: torch.Tensor) -> torch.Tensor:
        return lower_matmul(self.store, v)

    def t_matmul(self, u: torch.Tensor) -> torch.Tensor:
        return lower_t_matmul(self.store, u)

    def column_sq_norms(self) -> torch.Tensor:
        return column_sq_norms(self.store)

    def schur(self, columns: ColumnFn, a_pp: torch.Tensor,
              invert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[ColumnBlocks, torch.Tensor]:
        """
        The blocks of a row update (:class:`~art_malleability.linalg.ridge.DualRidge`) with this factor ``M`` of
        ``A_QQ``: ``Y_P = invert(A_PP − A_PQ Mᵀ M A_QP)`` and ``X = −Y_P A_PQ Mᵀ M``, in the layout of the tiles. Every
        process asks ``columns`` once, for the kernel columns ``A_QP`` of its own tile rows (so the changed examples'
        Jacobians are computed once per process, not once per tile row), and keeps only its own column blocks of
        ``X``: per process, two ``(n − m) × m / w`` sets of blocks at most, never an ``m × n`` one.

        :param columns: ``columns(idx)``: the ``m × len(idx)`` kernel block ``A_PQ`` at positions ``idx`` of ``Q``.
        :param a_pp: ``A_PP`` with the ridge, ``m × m``, the same on every process.
        :param invert: The inverse Cholesky factor of the Schur complement (``m × m``).
        :return: ``(X, Y_P)``.
        :raises ValueError: If ``columns`` returns a block of another shape (on every process).
        """
        store, width = self.store, int(a_pp.shape[0])
        owned = [i for i in range(store.count) if store.owns(i)]
        blocks: RowBlocks = {}

        def own_columns() -> None:  # every process computes its columns before the first collective
            idx = np.concatenate([np.arange(store.n)[store.rows(i)] for i in owned] or [np.zeros(0, np.int64)])
            found = columns(idx) if len(idx) else torch.zeros((width, 0), dtype=store.dtype)
            if tuple(found.shape) != (width, len(idx)):
                raise ValueError(f"the changed rows' kernel columns must have shape {(width, len(idx))}, got "
                                 f"{tuple(found.shape)}")
            start = 0
            for i in owned:  # one block at a time out of the process's columns
                blocks[i] = found[:, start : start + store.size(i)].T.to(store.device, store.dtype).contiguous()
                start += store.size(i)

        store.group.run_everywhere(own_columns)
        l_qp = lower_matmul_rows(store, blocks, width)  # M A_QP
        gram = torch.zeros((width, width), dtype=store.dtype, device=store.device)
        for l_i in l_qp.values():
            gram.addmm_(l_i.T, l_i)
        y_p = invert(a_pp - store.group.all_reduce(gram))
        x = lower_t_matmul_rows(store, l_qp, width, lambda w_j: -(y_p @ w_j.T))
        return ColumnBlocks(store, x, width), y_p

    def close(self) -> None:
        self.store.close()
