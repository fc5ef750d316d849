"""Sensitivity of the linearised-attention kernel G³: oracles against brute-force G³ and the Hölder bound."""

import numpy as np
import pytest

from art_malleability.ntk.sensitivity import (
    context_change,
    context_matrix,
    kernel_change_fixed_context,
    kernel_change_in_context,
    kernel_gradients,
    normalised_perturbation,
    sensitivity_bound,
    summarise_ratios,
    unit_rows,
)


def _problem(seed: int = 0, n: int = 30, d: int = 12, m: int = 5, eps: float = 0.05):
    rng = np.random.default_rng(seed)
    x = unit_rows(rng.random((n, d)))
    indices = rng.choice(n, size=m, replace=False)
    delta = rng.uniform(-eps, eps, size=(m, d))
    return x, indices, delta


def _g3(x: np.ndarray) -> np.ndarray:
    return np.linalg.matrix_power(x @ x.T, 3)


def test_kernel_is_g_cubed():
    x, _, _ = _problem()
    gradients = kernel_gradients(x, chunk_size=7)
    np.testing.assert_allclose(gradients @ x.T, _g3(x), rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(context_matrix(x, chunk_size=4), x.T @ x, rtol=1e-13, atol=1e-13)


def test_fixed_context_change_and_bound():
    x, indices, delta = _problem(1)
    c = x.T @ x
    c2 = c @ c
    gradients = kernel_gradients(x, c, chunk_size=8)
    change = kernel_change_fixed_context(delta, gradients, chunk_size=9)
    # brute force: K(a, b) = aᵀ C² b with C fixed, a = x_i + δ_i
    brute = (x[indices] + delta) @ c2 @ x.T - x[indices] @ c2 @ x.T
    np.testing.assert_allclose(change, brute, rtol=0, atol=1e-10)
    bound = sensitivity_bound(delta, gradients)
    expected = np.abs(delta).max(axis=1)[:, None] * np.abs(x @ c2).sum(axis=1)[None, :]
    np.testing.assert_allclose(bound, expected, rtol=1e-13)
    assert summarise_ratios(change, bound)["failures"] == 0


def test_fixed_context_bound_never_fails_on_random_delta_and_is_tight():
    rng = np.random.default_rng(2)
    x = unit_rows(rng.standard_normal((40, 10)))
    gradients = kernel_gradients(x)
    delta = rng.standard_normal((200, 10)) * rng.uniform(1e-3, 1.0, size=(200, 1))
    change = kernel_change_fixed_context(delta, gradients)
    bound = sensitivity_bound(delta, gradients)
    summary = summarise_ratios(change, bound)
    assert summary["failures"] == 0 and summary["pairs"] == 200 * 40
    assert summary["ratio_max"] <= 1.0 + 1e-12
    # δ = ε sign(C² x_j) attains the bound for pair (·, j)
    eps = 0.3
    tight = eps * np.sign(gradients)
    ratio = np.abs(np.diag(kernel_change_fixed_context(tight, gradients))) / np.diag(
        sensitivity_bound(tight, gradients)
    )
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 3])
def test_in_context_change_matches_explicit_rebuild(seed):
    x, indices, delta = _problem(seed, eps=0.2)
    change = kernel_change_in_context(x, indices, delta, chunk_size=7)
    g3 = _g3(x)
    for r, i in enumerate(indices):
        x_new = x.copy()
        x_new[i] = x[i] + delta[r]
        g3_new = _g3(x_new)
        mask = np.arange(x.shape[0]) != i
        np.testing.assert_allclose(change[r, mask], (g3_new[i] - g3[i])[mask], rtol=0, atol=1e-10)
        # explicit C' = C - x_i x_iᵀ + x_i' x_i'ᵀ, also for j == i (clean x_i as second argument)
        c_new = x.T @ x - np.outer(x[i], x[i]) + np.outer(x_new[i], x_new[i])
        explicit = x_new[i] @ c_new @ c_new @ x.T - g3[i]
        np.testing.assert_allclose(change[r], explicit, rtol=0, atol=1e-10)
    # precomputed context and gradients give the same numbers
    c = context_matrix(x)
    again = kernel_change_in_context(x, indices, delta, context=c, gradients=kernel_gradients(x, c))
    np.testing.assert_allclose(again, change, rtol=0, atol=1e-12)


def test_context_change_matches_explicit_rebuild():
    x, indices, delta = _problem(4, eps=0.2)
    i, d_i = int(indices[0]), delta[0]
    rows = np.array([k for k in range(x.shape[0]) if k != i][:9])
    change = context_change(x, i, d_i, rows, chunk_size=6)
    x_new = x.copy()
    x_new[i] = x[i] + d_i
    brute = (_g3(x_new) - _g3(x))[rows]
    mask = np.arange(x.shape[0]) != i
    np.testing.assert_allclose(change[:, mask], brute[:, mask], rtol=0, atol=1e-10)
    c = x.T @ x
    again = context_change(x, i, d_i, rows, context=c, x_context=x @ c)
    np.testing.assert_allclose(again, change, rtol=0, atol=1e-12)


def test_in_context_reduces_to_fixed_context_plus_context_term():
    # K'(x_i', x_j) − K(x_i, x_j) = δᵀC²x_j (fixed-context part) + x_i'ᵀ(C'² − C²)x_j (context part)
    x, indices, delta = _problem(5)
    c = x.T @ x
    gradients = kernel_gradients(x, c)
    total = kernel_change_in_context(x, indices, delta, context=c)
    fixed = kernel_change_fixed_context(delta, gradients)
    for r, i in enumerate(indices):
        moved = x[i] + delta[r]
        c_new = c - np.outer(x[i], x[i]) + np.outer(moved, moved)
        context_term = moved @ (c_new @ c_new - c @ c) @ x.T
        np.testing.assert_allclose(total[r], fixed[r] + context_term, rtol=0, atol=1e-10)


def test_normalised_perturbation():
    rng = np.random.default_rng(6)
    x = rng.random((4, 3, 3)).astype(np.float32)
    x_adv = np.clip(x + rng.choice([-0.3, 0.3], size=x.shape), 0.0, 1.0).astype(np.float32)
    x_before = x.copy()
    delta = normalised_perturbation(x, x_adv)
    assert delta.shape == (4, 9) and delta.dtype == np.float64
    expected = unit_rows(x_adv) - unit_rows(x)
    np.testing.assert_allclose(delta, expected)
    np.testing.assert_array_equal(x, x_before)
    np.testing.assert_allclose(np.linalg.norm(unit_rows(x) + delta, axis=1), 1.0, rtol=1e-12)
    assert np.all(unit_rows(np.zeros((1, 3))) == 0)


def test_summarise_ratios():
    actual = np.array([[0.5, -2.0], [0.0, 1.0]])
    bound = np.array([[1.0, 1.0], [0.0, 1.0]])
    summary = summarise_ratios(actual, bound)
    assert summary["pairs"] == 4 and summary["failures"] == 1 and summary["zero_bound_pairs"] == 1
    assert summary["ratio_max"] == 2.0 and summary["failure_share"] == 0.25
    masked = summarise_ratios(actual, bound, mask=np.array([[True, False], [True, True]]))
    assert masked["pairs"] == 3 and masked["failures"] == 0 and masked["ratio_max"] == 1.0


def test_errors():
    x, indices, delta = _problem()
    with pytest.raises(ValueError, match="delta must have shape"):
        kernel_change_in_context(x, indices[:2], delta[:2, :5])
    with pytest.raises(ValueError, match="indices must lie"):
        kernel_change_in_context(x, np.array([99]), delta[:1])
    with pytest.raises(ValueError, match="chunk_size"):
        kernel_gradients(x, chunk_size=0)
    with pytest.raises(ValueError, match="NaN"):
        unit_rows(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match="same shape"):
        summarise_ratios(np.zeros(3), np.zeros(2))
