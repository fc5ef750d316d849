"""Blocked linear algebra on tiles, in memory and on disk, against the dense computations."""

import numpy as np
import pytest
import torch

from art_malleability.linalg import _tiles as T


def _spd(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n // 2 + 3, generator=g, dtype=torch.float64)
    a = x @ x.T
    a.diagonal().add_(1e-3)
    return a


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize(("n", "block"), [(37, 10), (40, 40), (50, 7), (1, 3)])
def test_cholesky_and_inverse_equal_the_dense_ones(tmp_path, on_disk, n, block):
    a = _spd(n)
    store = T.TileStore(n, block, folder=tmp_path if on_disk else None)
    store.fill(lambda r, c: a[r][:, c])
    T.cholesky_(store, 1e-3)
    chol = torch.linalg.cholesky(a)
    torch.testing.assert_close(store.dense(), chol, rtol=0, atol=1e-10 * float(chol.abs().max()))
    T.triangular_inverse_(store)
    inverse = torch.linalg.inv(chol)
    torch.testing.assert_close(store.dense(), inverse, rtol=0, atol=1e-9 * float(inverse.abs().max()))
    v = torch.randn(n, 3, dtype=torch.float64)
    for got, want in ((T.lower_matmul(store, v), inverse @ v), (T.lower_t_matmul(store, v), inverse.T @ v)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * float(want.abs().max()))
    torch.testing.assert_close(T.column_sq_norms(store), (inverse**2).sum(dim=0), rtol=1e-10, atol=0)
    folder = store.path
    store.close()
    assert folder is None or not folder.exists()
    if on_disk:
        assert list(tmp_path.iterdir()) == []  # the store removes what it created, nothing else


def test_a_matrix_that_is_not_positive_definite_is_named(tmp_path):
    a = _spd(20)
    a[5, 5] = -1.0
    store = T.TileStore(20, 6)
    store.fill(lambda r, c: a[r][:, c])
    with pytest.raises(ValueError, match="positive definite"):
        T.cholesky_(store, 1e-3)
    a[5, 5] = float("nan")
    store.fill(lambda r, c: a[r][:, c])
    with pytest.raises(ValueError, match="finite"):
        T.cholesky_(store, 1e-3)


def test_tiles_are_checked_and_the_upper_triangle_refused():
    store = T.TileStore(10, 4)
    with pytest.raises(IndexError, match="above the diagonal"):
        store.get(0, 1)
    with pytest.raises(ValueError, match=r"tile \(1, 0\) must have shape \(4, 4\)"):
        store.put(1, 0, torch.zeros(3, 4, dtype=torch.float64))
    assert [store.size(i) for i in range(store.count)] == [4, 4, 2]
    assert np.array_equal(np.arange(10)[store.rows(2)], [8, 9])


@pytest.mark.parametrize("on_disk", [False, True])
def test_products_with_row_blocks_equal_the_dense_ones(tmp_path, on_disk):
    """``M B``, ``then((Mᵀ U)_j)`` and the column blocks of ``X`` with the operands held in row blocks by tile row."""
    n, block, width = 37, 10, 4
    a = _spd(n, seed=2)
    store = T.TileStore(n, block, folder=tmp_path if on_disk else None)
    store.fill(lambda r, c: a[r][:, c])
    T.cholesky_(store, 1e-3)
    T.triangular_inverse_(store)
    m = store.dense()
    g = torch.Generator().manual_seed(5)
    b = torch.randn(n, width, generator=g, dtype=torch.float64)
    blocks = {i: b[store.rows(i)].clone() for i in range(store.count)}
    product = T.lower_matmul_rows(store, blocks, width)
    assert blocks == {}  # each block is released once used
    torch.testing.assert_close(torch.cat([product[i] for i in range(store.count)]), m @ b, rtol=0, atol=1e-12)
    shift = torch.randn(width, width, generator=g, dtype=torch.float64)
    x = T.lower_t_matmul_rows(store, {i: b[store.rows(i)] for i in range(store.count)}, width,
                              lambda w_j: -(shift @ w_j.T))
    want = -(shift @ (m.T @ b).T)  # width × n
    assert [tuple(x[j].shape) for j in range(store.count)] == [(width, store.size(j)) for j in range(store.count)]
    torch.testing.assert_close(torch.cat([x[j] for j in range(store.count)], dim=1), want, rtol=0, atol=1e-11)
    columns = T.ColumnBlocks(store, x, width)
    v, u = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(width, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(columns.matmul(v), want @ v, rtol=0, atol=1e-11)
    torch.testing.assert_close(columns.t_matmul(u), want.T @ u, rtol=0, atol=1e-11)
    torch.testing.assert_close(columns.column_sq_norms(), (want**2).sum(dim=0), rtol=1e-12, atol=0)
    store.close()


@pytest.mark.parametrize("on_disk", [False, True])
def test_both_factors_answer_the_factor_protocol_alike(tmp_path, on_disk):
    """The dense and the tiled factor are ``InverseFactor``s, and give the same products, norms and update blocks."""
    from art_malleability.linalg.factors import Columns, DenseFactor, InverseFactor

    rng = np.random.default_rng(3)
    n, m, ridge = 11, 3, 0.5
    g = rng.normal(size=(n + m, 6))
    k = torch.as_tensor(g @ g.T)
    kq = k[:n, :n].contiguous()
    dense = DenseFactor((kq + ridge * torch.eye(n, dtype=torch.float64)).contiguous(), ridge)
    tiled = T.TiledInverseFactor(lambda r, c: kq[np.ix_(r, c)], n, ridge, 4, tmp_path if on_disk else None,
                                 torch.float64, "cpu")
    try:
        for factor in (dense, tiled):
            assert isinstance(factor, InverseFactor)
        v, u = torch.as_tensor(rng.normal(size=(n, 2))), torch.as_tensor(rng.normal(size=(n, 2)))
        assert torch.allclose(dense.matmul(v), tiled.matmul(v), rtol=1e-12, atol=1e-12)
        assert torch.allclose(dense.t_matmul(u), tiled.t_matmul(u), rtol=1e-12, atol=1e-12)
        assert torch.allclose(dense.column_sq_norms(), tiled.column_sq_norms(), rtol=1e-12, atol=1e-12)
        a_pq = k[n:, :n]
        a_pp = k[n:, n:] + ridge * torch.eye(m, dtype=torch.float64)
        invert = torch.linalg.inv
        (x_d, y_d), (x_t, y_t) = (f.schur(lambda idx: a_pq[:, idx], a_pp, invert) for f in (dense, tiled))
        assert isinstance(x_d, Columns) and isinstance(x_t, Columns)
        assert torch.allclose(y_d, y_t, rtol=1e-10, atol=1e-12)
        eye = torch.eye(m, dtype=torch.float64)  # X is m x n: X^T I gives it whole
        assert torch.allclose(x_d.t_matmul(eye), x_t.t_matmul(eye), rtol=1e-10, atol=1e-12)
    finally:
        tiled.close()
        dense.close()
