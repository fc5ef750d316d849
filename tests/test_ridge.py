"""Kernel ridge leave-one-out in the dual and the primal, and their row updates, against explicit re-solves."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from art_malleability.influence.ridge import loo_scores
from art_malleability.linalg.ridge import DualRidge, PrimalRidge, inverse_cholesky_, kernel_ridge_predict


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _problem(n, k, c=3, seed=0):
    rng = np.random.default_rng(seed)
    phi = rng.normal(size=(n, k))
    phi_q = rng.normal(size=(5, k))
    y = rng.integers(0, c, size=n)
    return phi, phi_q, np.eye(c)[y]


def _explicit_loo(phi, phi_q, targets, ridge):
    """Prediction at each query after removing each example: re-solve the primal ridge system without it."""
    n, k = phi.shape
    out = np.empty((len(phi_q), n, targets.shape[1]))
    for i in range(n):
        keep = np.arange(n) != i
        w = np.linalg.solve(phi[keep].T @ phi[keep] + ridge * np.eye(k), phi[keep].T @ targets[keep])
        out[:, i] = phi_q @ w
    return out


def _loo_from(parts):
    f, b, beta = (t.numpy() for t in parts)
    return f[:, None, :] - b[:, :, None] * beta[None, :, :]


@pytest.mark.parametrize("n,k", [(40, 12), (12, 40)])
def test_primal_and_dual_equal_explicit_leave_one_out(n, k):
    phi, phi_q, targets = _problem(n, k)
    ridge = 0.3
    expected = _explicit_loo(phi, phi_q, targets, ridge)
    primal = PrimalRidge(ridge).fit(torch.tensor(phi), torch.tensor(targets))
    assert _rel(_loo_from(primal.loo_parts(torch.tensor(phi_q))), expected) < 1e-9
    dual = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    assert _rel(_loo_from(dual.loo_parts(torch.tensor(phi_q @ phi.T))), expected) < 1e-9


def test_inverse_cholesky_in_place_on_cpu():
    rng = np.random.default_rng(1)
    g = rng.normal(size=(30, 30))
    a = torch.tensor(g @ g.T + np.eye(30))
    ptr = a.data_ptr()
    linv = inverse_cholesky_(a, 0.0)
    assert linv.data_ptr() == ptr  # no second buffer
    chol = np.linalg.cholesky(g @ g.T + np.eye(30))
    assert _rel(linv.numpy(), np.linalg.inv(chol)) < 1e-10
    with pytest.raises(ValueError, match="must be positive definite"):
        inverse_cholesky_(torch.tensor(-np.eye(3)), 1e-3)


@pytest.mark.parametrize("changed", [[3], [0, 7, 19], list(range(10, 24))])
def test_dual_row_update_equals_fit_from_scratch(changed):
    n, k, ridge = 24, 30, 1e-2
    phi, phi_q, targets = _problem(n, k, seed=2)
    changed = np.array(changed)
    new = phi.copy()
    new[changed] = np.random.default_rng(3).normal(size=(len(changed), k))
    kernel_new = new @ new.T
    dual = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    dual.update(changed, torch.tensor(kernel_new[changed]))
    fresh = DualRidge(ridge).fit(torch.tensor(kernel_new), torch.tensor(targets))
    k_q = torch.tensor(phi_q @ new.T)
    for a, b in zip(dual.loo_parts(k_q), fresh.loo_parts(k_q), strict=True):
        assert _rel(a.numpy(), b.numpy()) < 1e-9
    assert _rel(_loo_from(dual.loo_parts(k_q)), _explicit_loo(new, phi_q, targets, ridge)) < 1e-8
    # back to the base training set
    dual.update(np.zeros(0, dtype=int), torch.zeros((0, n), dtype=torch.float64))
    base = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    assert _rel(dual.alpha_.numpy(), base.alpha_.numpy()) < 1e-10


@pytest.mark.parametrize("block", [None, 7])
def test_the_queries_solves_kept_between_updates_of_the_same_rows(monkeypatch, block):
    """The part of the queries' solve that updates of the same rows leave alone is computed once per factor, and
    every answer equals a fit from scratch: updates of the same rows, of other rows, back to the base set."""
    from art_malleability._utils import cache

    n, k, ridge = 20, 30, 1e-2
    phi, phi_q, targets = _problem(n, k, seed=8)
    rng = np.random.default_rng(9)
    dual = DualRidge(ridge, block=block).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    factor_products = []
    for changed in ([2, 9, 13], [2, 9, 13], [4], [4], [], [2, 9, 13]):
        changed = np.array(changed, dtype=int)
        new = phi.copy()
        new[changed] = rng.normal(size=(len(changed), k))
        dual.update(changed, torch.tensor((new @ new.T)[changed]))
        matmul = dual._m.matmul
        calls = []
        monkeypatch.setattr(dual._m, "matmul", lambda v, f=matmul, c=calls: c.append(1) or f(v))
        fresh = DualRidge(ridge).fit(torch.tensor(new @ new.T), torch.tensor(targets))
        k_q = torch.tensor(phi_q @ new.T)
        for _ in range(2):
            for a, b in zip(dual.loo_parts(k_q), fresh.loo_parts(k_q), strict=True):
                assert _rel(a.numpy(), b.numpy()) < 1e-9
        factor_products.append(len(calls))
    # once per factor: the second ask, and the same rows updated again, reuse it (a new factor for other rows)
    assert factor_products == [1, 0, 1, 0, 1, 1]
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 1)  # nothing kept: the same answers
    dual.close()
    dual.update(np.array([4]), torch.tensor((phi @ phi.T)[[4]]))
    k_q = torch.tensor(phi_q @ phi.T)
    fresh = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    assert _rel(dual.loo_parts(k_q)[1].numpy(), fresh.loo_parts(k_q)[1].numpy()) < 1e-9


def test_primal_row_update_equals_fit_from_scratch():
    n, k, ridge = 60, 10, 1e-1
    phi, phi_q, targets = _problem(n, k, seed=4)
    changed = np.array([1, 5, 30, 59])
    new = phi.copy()
    new[changed] = np.random.default_rng(5).normal(size=(len(changed), k))
    primal = PrimalRidge(ridge).fit(torch.tensor(phi), torch.tensor(targets))
    primal.update(changed, torch.tensor(new[changed]))
    fresh = PrimalRidge(ridge).fit(torch.tensor(new), torch.tensor(targets))
    q = torch.tensor(phi_q)
    for a, b in zip(primal.loo_parts(q), fresh.loo_parts(q), strict=True):
        assert _rel(a.numpy(), b.numpy()) < 1e-10


def test_a_primal_update_puts_the_last_ones_rows_back_and_does_not_depend_on_it():
    # each update is the fitted set with its own rows replaced: the same numbers, bit for bit, whichever update ran
    # before it (the rows of an earlier update go back to their fitted values)
    n, k, ridge = 80, 12, 1e-1
    phi, phi_q, targets = _problem(n, k, seed=6)
    rng = np.random.default_rng(7)
    first, second = np.array([3, 17, 40, 41]), np.array([41, 3, 60])  # overlapping, and given unsorted
    rows_first = torch.tensor(rng.normal(size=(len(first), k)))
    rows_second = torch.tensor(rng.normal(size=(len(second), k)))
    q = torch.tensor(phi_q)
    after_first = PrimalRidge(ridge).fit(torch.tensor(phi.copy()), torch.tensor(targets))
    after_first.update(first, rows_first)
    after_first.update(second, rows_second)
    alone = PrimalRidge(ridge).fit(torch.tensor(phi.copy()), torch.tensor(targets))
    alone.update(second, rows_second)
    for a, b in zip(after_first.loo_parts(q), alone.loo_parts(q), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(after_first.features_, alone.features_)
    new = phi.copy()
    new[second] = rows_second.numpy()
    fresh = PrimalRidge(ridge).fit(torch.tensor(new), torch.tensor(targets))
    for a, b in zip(alone.loo_parts(q), fresh.loo_parts(q), strict=True):
        assert _rel(a.numpy(), b.numpy()) < 1e-10
    alone.update(np.zeros(0, dtype=np.int64), torch.zeros((0, k), dtype=torch.float64))  # back to the fit
    assert torch.equal(alone.features_, torch.tensor(phi))


def test_loo_scores_are_loss_differences():
    f = torch.tensor([[0.2, 0.8], [0.6, 0.1]], dtype=torch.float64)
    b = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 3.0]], dtype=torch.float64)
    beta = torch.tensor([[0.1, 0.0], [0.2, -0.1], [0.0, 0.3]], dtype=torch.float64)
    y = torch.tensor([1, 0])
    scores = loo_scores(f, b, beta, y, "mse").numpy()
    target = np.eye(2)[[1, 0]]
    for qi in range(2):
        for i in range(3):
            loo = f[qi].numpy() - b[qi, i].item() * beta[i].numpy()
            expected = 0.5 * np.sum((loo - target[qi]) ** 2) - 0.5 * np.sum((f[qi].numpy() - target[qi]) ** 2)
            assert scores[qi, i] == pytest.approx(expected, abs=1e-15)


def test_dual_update_of_every_row():
    n, k, ridge = 15, 20, 1e-2
    phi, phi_q, targets = _problem(n, k, seed=6)
    new = np.random.default_rng(7).normal(size=(n, k))
    dual = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    dual.update(np.arange(n)[::-1].copy(), torch.tensor((new @ new.T)[::-1].copy()))
    fresh = DualRidge(ridge).fit(torch.tensor(new @ new.T), torch.tensor(targets))
    k_q = torch.tensor(phi_q @ new.T)
    for a, b in zip(dual.loo_parts(k_q), fresh.loo_parts(k_q), strict=True):
        assert _rel(a.numpy(), b.numpy()) < 1e-9


def test_exact_solve_holds_at_most_two_n_by_n_matrices():
    """Peak memory of a dual fit and update, measured in a fresh process: the kernel plus one n x n factor."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import resource, numpy as np, torch
        from art_malleability.linalg.ridge import DualRidge
        torch.set_num_threads(1)
        n = 3000
        phi = torch.randn(n, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        kernel = phi @ phi.T
        targets = torch.eye(3, dtype=torch.float64)[torch.arange(n) % 3]
        rows = kernel[:300].clone()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        solver = DualRidge(1e-2).fit(kernel, targets)
        solver.loo_parts(kernel[:50])
        fitted = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        solver.update(np.arange(300), rows)
        updated = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print((fitted - before) / (8 * n * n), (updated - before) / (8 * n * n))
        """
    )
    # large temporaries through mmap, so that freed blocks leave the resident set (no allocator slack)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    fit_extra, update_extra = (float(v) for v in done.stdout.split())
    # beyond the kernel: one n x n factor, LAPACK's workspace and blocks of the m changed rows; a
    # second n x n matrix would read >= 2
    assert fit_extra < 1.6 and update_extra < 1.6, (fit_extra, update_extra)


def test_failed_updates_leave_the_solvers_as_they_were():
    n, k, ridge = 30, 8, 0.1
    phi, phi_q, targets = _problem(n, k, seed=8)
    q = torch.tensor(phi_q)
    primal = PrimalRidge(ridge).fit(torch.tensor(phi.copy()), torch.tensor(targets))
    before = [t.clone() for t in primal.loo_parts(q)]
    bad = torch.full((2, k), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN or infinite"):
        primal.update(np.array([3, 4]), bad)
    for a, b in zip(primal.loo_parts(q), before, strict=True):
        assert torch.equal(a, b)
    primal.update(np.array([4, 9]), torch.tensor(phi[[4, 9]] + 0.5))  # a valid change, then a failed one after it
    before, features = [t.clone() for t in primal.loo_parts(q)], primal.features_.clone()
    with pytest.raises(ValueError, match="NaN or infinite"):
        primal.update(np.array([9, 11]), bad)
    for a, b in zip(primal.loo_parts(q), before, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(primal.features_, features)
    dual = DualRidge(ridge).fit(torch.tensor(phi @ phi.T), torch.tensor(targets))
    dual.update(np.array([1, 2]), torch.tensor(phi[[1, 2]] @ phi.T))  # a first, valid change
    k_q = torch.tensor(phi_q @ phi.T)
    before = [t.clone() for t in dual.loo_parts(k_q)]
    with pytest.raises(ValueError, match="NaN or infinite"):
        dual.update(np.array([5, 6, 7]), torch.full((3, n), float("nan"), dtype=torch.float64))
    for a, b in zip(dual.loo_parts(k_q), before, strict=True):
        assert _rel(a.numpy(), b.numpy()) < 1e-12


@pytest.mark.parametrize("n, k", [(40, 100), (60, 20)])  # full rank, and rank-deficient (n > k) as NTKs often are
def test_kernel_ridge_predict_matches_a_plain_solve(n, k):
    phi, phi_q, targets = _problem(n, k)
    k_train, k_test = torch.tensor(phi @ phi.T), torch.tensor(phi_q @ phi.T)
    targets = torch.tensor(targets)
    ridge = 1e-3
    expected = k_test @ torch.linalg.solve(k_train + ridge * torch.eye(n, dtype=torch.float64), targets)
    assert _rel(kernel_ridge_predict(k_train, k_test, targets, ridge), expected) < 1e-10
    with pytest.raises(ValueError, match="k_train \\+ ridge\\*I must be positive definite"):
        kernel_ridge_predict(-k_train, k_test, targets, ridge)
    with pytest.raises(ValueError, match="must be finite"):
        kernel_ridge_predict(k_train * float("nan"), k_test, targets, ridge)


@pytest.mark.slow
def test_the_in_place_factorisation_survives_matrices_above_16000(tmp_path):
    """
    n = 16,500 (2.2 GB in float64) after PyTorch's thread pool has run: scipy's threaded OpenBLAS potrf crashed here
    with a segmentation fault. Run in a subprocess, so that a crash is a failure and not the end of the test run;
    ``L⁻¹ A L⁻ᵀ = I`` is checked on sampled rows.
    """
    script = textwrap.dedent("""
        import numpy as np, torch
        from art_malleability.linalg.ridge import inverse_cholesky_
        torch.manual_seed(0)
        (torch.randn(4_000_000) * 2).sum()  # any parallel operation starts PyTorch's OpenMP threads
        n = 16_500
        x = torch.randn(n, 32, dtype=torch.float64)
        a = x @ x.T
        a.diagonal().add_(1.0)
        inverse = inverse_cholesky_(a, 1.0)
        worst = 0.0
        for i in np.random.default_rng(0).choice(n, 5, replace=False):
            v = inverse[i].clone()
            worst = max(worst, abs(float(v @ (x @ (x.T @ v)) + v @ v) - 1.0))
        print("identity error", worst)
        assert worst < 1e-8
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "identity error" in done.stdout


@pytest.mark.parametrize("where", ["memory", "disk"])
@pytest.mark.parametrize("kernel_as", ["tensor", "tiles"])
def test_the_tiled_dual_solve_equals_the_dense_one_with_updates(tmp_path, where, kernel_as):
    """Tiles of 7 rows (a ragged last one), in memory or on disk, before and after two updates of the rows."""
    rng = np.random.default_rng(3)
    n, ridge = 40, 1e-3
    phi = rng.normal(size=(n, 25))
    targets = torch.tensor(rng.normal(size=(n, 3)))
    kernel = torch.tensor(phi @ phi.T)
    dense = DualRidge(ridge).fit(kernel.clone(), targets)
    source = kernel if kernel_as == "tensor" else (lambda r, c: kernel[torch.as_tensor(r)][:, torch.as_tensor(c)])
    tiled = DualRidge(ridge, block=7, folder=tmp_path if where == "disk" else None).fit(source, targets)
    k_q = torch.tensor(rng.normal(size=(5, 25)) @ phi.T)

    def same(a, b):
        for x, y in zip(a.loo_parts(k_q), b.loo_parts(k_q), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-8 * float(y.abs().max()))
        torch.testing.assert_close(a.cinv_diag_, b.cinv_diag_, rtol=1e-8, atol=0)

    same(tiled, dense)
    changed = np.array([3, 17, 18, 39])
    for shift in (0.3, -0.2):  # the same rows twice: the factor of A_QQ is computed once
        new = phi.copy()
        new[changed] += shift
        rows = torch.tensor(new[changed] @ new.T)
        dense.update(changed, rows)
        tiled.update(changed, rows)
        same(tiled, dense)
    if where == "disk":
        assert len(list(tmp_path.iterdir())) == 1  # one tile folder while the solver lives
    tiled.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("block", [None, 7])
def test_an_update_takes_the_changed_rows_as_a_function_of_columns(tmp_path, block):
    """Rows given as a function of columns: asked once for the changed columns and once for the others (over a group,
    each process for its own tile rows: tests/test_distributed.py), with what the rows given whole give; a failing
    or wrong function leaves the solver as it was; when restoring fails too, the solver says to fit again."""
    n, ridge = 40, 1e-3
    phi, phi_q, targets = _problem(n, 25, seed=4)
    targets, kernel = torch.tensor(targets), torch.tensor(phi @ phi.T)
    whole = DualRidge(ridge).fit(kernel.clone(), targets)
    by_columns = DualRidge(ridge, block=block).fit(kernel.clone(), targets)
    changed = np.array([3, 17, 18, 39])
    new = phi.copy()
    new[changed] += 0.3
    rows = torch.tensor(new[changed] @ new.T)
    asked, broken = [], []

    def columns(cols):
        if broken:
            raise RuntimeError("the kernel columns could not be computed")
        asked.append(np.array(cols))
        return rows[:, torch.as_tensor(cols)]

    whole.update(changed, rows)
    by_columns.update(changed, columns)
    k_q = torch.tensor(phi_q @ phi.T)
    for x, y in zip(by_columns.loo_parts(k_q), whole.loo_parts(k_q), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-8, atol=1e-8 * float(y.abs().max()))
    torch.testing.assert_close(by_columns.cinv_diag_, whole.cinv_diag_, rtol=1e-8, atol=0)
    assert [a.tolist() for a in asked] == [changed.tolist(), np.setdiff1d(np.arange(n), changed).tolist()]
    before = [t.clone() for t in by_columns.loo_parts(k_q)]
    other = np.array([1, 2, 5])
    new[other] -= 0.2
    other_rows = torch.tensor(new[other] @ new.T)
    calls = []

    def failing(cols):  # the changed columns, then a failure
        if calls:
            raise RuntimeError("the kernel columns could not be computed")
        calls.append(cols)
        return other_rows[:, torch.as_tensor(cols)]

    def wrong(cols):  # a block of the wrong shape
        return other_rows[:, torch.as_tensor(cols)][:, :-1] if len(cols) > len(other) else other_rows[:, cols]

    for bad, error, match in ((failing, RuntimeError, "could not be computed"), (wrong, ValueError, "shape")):
        calls.clear()
        if block is None and bad is wrong:
            continue  # the dense form takes what it gets: the shapes fail inside the products
        with pytest.raises(error, match=match):
            by_columns.update(other, bad)
        for a, b in zip(by_columns.loo_parts(k_q), before, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * float(b.abs().max()))
    broken.append(True)  # the previous rows cannot be computed again either
    calls.clear()
    with pytest.raises(RuntimeError, match="could not be computed"):
        by_columns.update(other, failing)
    with pytest.raises(RuntimeError, match="fit it again"):
        by_columns.loo_parts(k_q)
    fresh = phi.copy()
    fresh[other] = new[other]
    fresh_rows = torch.tensor(fresh[other] @ fresh.T)
    by_columns.update(other, fresh_rows)  # a new update starts afresh
    whole.update(other, fresh_rows)
    torch.testing.assert_close(by_columns.alpha_, whole.alpha_, rtol=1e-8, atol=1e-8 * float(whole.alpha_.abs().max()))


@pytest.mark.parametrize("n_outputs", [1, 3, 10])
def test_the_mse_scores_closed_form_equals_the_losses_difference(n_outputs):
    """``-b (r·β) + ½ b² ‖β‖²`` against the two losses of every leave-one-out prediction, computed elementwise."""
    from art_malleability.influence.base import per_example_loss
    from art_malleability.influence.ridge import loo_scores

    gen = torch.Generator().manual_seed(n_outputs)
    f = torch.randn((7, n_outputs), generator=gen, dtype=torch.float64)
    b = torch.randn((7, 11), generator=gen, dtype=torch.float64)
    beta = torch.randn((11, n_outputs), generator=gen, dtype=torch.float64)
    y = torch.randint(0, n_outputs, (7,), generator=gen)
    loo = f[:, None, :] - b[:, :, None] * beta[None]
    expected = per_example_loss(loo, y[:, None], "mse") - per_example_loss(f, y, "mse")[:, None]
    torch.testing.assert_close(loo_scores(f, b, beta, y, "mse"), expected, rtol=0, atol=1e-13)
