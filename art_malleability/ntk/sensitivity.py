"""
Sensitivity of the linearised-attention kernel :math:`G^3` to a perturbation of one training example, and the
first-order bound against which the paper's Proposition 4.5 is checked.

Setting (as in :mod:`art_malleability.ntk.spectral` and :class:`art_malleability.models.reference.MLPAttn`): the rows of
:math:`X` (`n x d`, float64) are the training inputs in the space where the Gram matrix is formed (flattened and
scaled to unit :math:`\\ell_2` norm for MLP-Attn; the functions here take that matrix as given and do not
normalise it), :math:`C = X^\\top X` and :math:`G = X X^\\top`. Linearised attention maps :math:`x \\mapsto C x`,
and its feature Gram matrix is :math:`G^3 = X C^2 X^\\top`, i.e. the kernel

.. math:: K(a, b) = a^\\top C^2 b.

Perturbing the first argument by :math:`\\delta` gives two regimes:

- **fixed context** (:math:`C` held fixed, e.g. :math:`a` a query point outside the training set): :math:`K` is
  linear in :math:`a`, so :math:`K(a + \\delta, b) - K(a, b) = \\delta^\\top C^2 b` exactly, and Hölder's
  inequality gives the bound

  .. math:: |K(a + \\delta, b) - K(a, b)| \\le \\|C^2 b\\|_1 \\, \\|\\delta\\|_\\infty

  (:func:`sensitivity_bound`), attained for :math:`\\delta = \\varepsilon \\, \\mathrm{sign}(C^2 b)`. The vector
  :math:`C^2 b = \\nabla_a K(a, b)` is the dimensionally consistent reading of the ":math:`G x_j`" of the bound
  as paraphrased in the project's issue (the proposition's own text was not available; see docs/ntk.md); for a
  training example :math:`b = x_j` it equals :math:`X^\\top G \\, (X x_j) = X^\\top G^2 e_j`.
- **in context** (:math:`a = x_i` is training example `i`, so the perturbation also changes the context):
  :math:`C' = C - x_i x_i^\\top + (x_i + \\delta)(x_i + \\delta)^\\top` and the perturbed kernel is
  :math:`K'(a, b) = a^\\top C'^2 b`, the entries of :math:`(X' X'^\\top)^3` for the data matrix :math:`X'` with
  row `i` replaced. :func:`kernel_change_in_context` measures :math:`K'(x_i + \\delta, x_j) - K(x_i, x_j)`;
  :func:`context_change` measures :math:`K'(x_k, x_j) - K(x_k, x_j)` for pairs that do not involve `i`, which
  change through :math:`C'` alone.

Everything is computed in float64 with numpy; products with :math:`X` are chunked over its rows
(`chunk_size`), so memory stays at `O(chunk_size · d + n · d + m · n)` for `m` perturbed examples.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from art_malleability._utils.checks import check_positive_int

logger = logging.getLogger(__name__)

_NORM_EPS = 1e-12
DEFAULT_CHUNK = 4096


def _as_matrix(x: Any, name: str) -> np.ndarray:
    """
    `x` as a finite float64 matrix `(n, d)` (a view when possible; the caller must not write to it).

    :param x: Array-like of shape `(n, ...)`.
    :param name: Argument name for error messages.
    :return: Float64 array of shape `(n, d)`.
    """
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim < 2 or arr.shape[0] < 1:
        raise ValueError(f"{name} must have shape (n, ...) with n >= 1 and at least 2 dimensions, got {arr.shape}")
    arr = arr.reshape(arr.shape[0], -1)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite, got NaN or infinite values")
    return arr


def _check_indices(indices: Any, n: int, name: str = "indices") -> np.ndarray:
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D array of integer row indices, got shape {idx.shape}, {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"{name} must lie in [0, {n}), got values in [{idx.min()}, {idx.max()}]")
    return idx


def unit_rows(x: Any) -> np.ndarray:
    """
    Flatten each example and scale it to unit :math:`\\ell_2` norm in float64, as MLP-Attn's input
    normalisation does (``torch.nn.functional.normalize`` with ``eps = 1e-12``: all-zero rows stay zero).

    :param x: Array of shape `(n, ...)`; not modified.
    :return: New float64 array of shape `(n, d)`.
    """
    arr = np.array(_as_matrix(x, "x"), dtype=np.float64, copy=True)
    arr /= np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), _NORM_EPS)
    return arr


def normalised_perturbation(x: Any, x_adv: Any) -> np.ndarray:
    """
    The perturbation in the space where the Gram matrix is formed:
    :math:`\\tilde\\delta = \\mathrm{normalise}(x + \\delta) - \\mathrm{normalise}(x)`, with `x_adv` being
    :math:`x + \\delta`.

    Normalisation changes the budget: an :math:`\\ell_\\infty` budget :math:`\\varepsilon` on the raw inputs becomes
    roughly :math:`\\varepsilon / \\|x\\|_2` per coordinate, and the scaling of the whole row adds a component along
    :math:`x`.

    :param x: Clean inputs `(m, ...)`.
    :param x_adv: Perturbed inputs, same shape.
    :return: Float64 array `(m, d)`.
    """
    x_flat = _as_matrix(x, "x")
    adv_flat = _as_matrix(x_adv, "x_adv")
    if x_flat.shape != adv_flat.shape:
        raise ValueError(f"x and x_adv must have the same shape, got {x_flat.shape} and {adv_flat.shape}")
    return unit_rows(adv_flat) - unit_rows(x_flat)


def context_matrix(x: Any, chunk_size: int = DEFAULT_CHUNK) -> np.ndarray:
    """
    :math:`C = X^\\top X`, accumulated over chunks of rows, in float64.

    :param x: Data matrix `(n, d)` (rows as given; no normalisation).
    :param chunk_size: Rows per chunk.
    :return: Symmetric float64 array `(d, d)`.
    """
    x = _as_matrix(x, "x")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    c = np.zeros((x.shape[1], x.shape[1]), dtype=np.float64)
    for start in range(0, x.shape[0], chunk_size):
        rows = x[start : start + chunk_size]
        c += rows.T @ rows
    return c


def _rows_times(x: np.ndarray, matrix: np.ndarray, chunk_size: int) -> np.ndarray:
    """`x @ matrix`, chunked over the rows of `x`."""
    out = np.empty((x.shape[0], matrix.shape[1]), dtype=np.float64)
    for start in range(0, x.shape[0], chunk_size):
        out[start : start + chunk_size] = x[start : start + chunk_size] @ matrix
    return out


def _times_rows_t(a: np.ndarray, x: np.ndarray, chunk_size: int) -> np.ndarray:
    """`a @ x.T`, chunked over the rows of `x` (the columns of the result)."""
    out = np.empty((a.shape[0], x.shape[0]), dtype=np.float64)
    for start in range(0, x.shape[0], chunk_size):
        out[:, start : start + chunk_size] = a @ x[start : start + chunk_size].T
    return out


def _with_context(x: Any, context: np.ndarray | None, chunk_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """
    The data matrix, its context :math:`C = X^\\top X` (computed when `context` is `None`) and the
    checked chunk size, shared by the functions that take an optional precomputed context.

    :param x: Data matrix `(n, d)`.
    :param context: :math:`C` `(d, d)`, or `None`.
    :param chunk_size: Rows per chunk.
    :return: `(x, C, chunk_size)`, `x` and `C` as float64 arrays.
    """
    x = _as_matrix(x, "x")
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    c = context_matrix(x, chunk_size) if context is None else np.asarray(context, dtype=np.float64)
    if c.shape != (x.shape[1], x.shape[1]):
        raise ValueError(f"context must have shape {(x.shape[1], x.shape[1])}, got {c.shape}")
    return x, c, chunk_size


def kernel_gradients(x: Any, context: np.ndarray | None = None, chunk_size: int = DEFAULT_CHUNK) -> np.ndarray:
    """
    Rows :math:`g_j = C^2 x_j`, the gradient :math:`\\nabla_a K(a, x_j)` of the kernel in its first argument
    (the vector whose :math:`\\ell_1` norm enters :func:`sensitivity_bound`). Row `j` of the result is also row `j`
    of :math:`X C^2`, so :math:`G^3 = (X C^2) X^\\top`.

    :param x: Data matrix `(n, d)` whose rows are the second arguments :math:`x_j`.
    :param context: :math:`C` `(d, d)`; `None` computes :math:`X^\\top X` from `x`.
    :param chunk_size: Rows per chunk.
    :return: Float64 array `(n, d)`.
    """
    x, c, chunk_size = _with_context(x, context, chunk_size)
    return _rows_times(_rows_times(x, c, chunk_size), c, chunk_size)


def _delta_and_gradients(delta: Any, gradients: Any) -> tuple[np.ndarray, np.ndarray]:
    """Perturbations `(m, d)` and kernel gradients `(n, d)` as float64 matrices with the same `d`."""
    delta = _as_matrix(delta, "delta")
    gradients = _as_matrix(gradients, "gradients")
    if delta.shape[1] != gradients.shape[1]:
        raise ValueError(f"delta must have {gradients.shape[1]} features like gradients, got {delta.shape[1]}")
    return delta, gradients


def sensitivity_bound(delta: Any, gradients: Any) -> np.ndarray:
    """
    The Hölder bound :math:`\\|C^2 x_j\\|_1 \\, \\|\\delta_i\\|_\\infty` for every pair (perturbation `i`, column
    `j`): the fixed-context reading of the paper's Proposition 4.5 (":math:`\\|G x_j\\|_1 \\cdot \\|\\delta\\|`").

    :param delta: Perturbations :math:`\\delta_i`, shape `(m, d)`.
    :param gradients: Rows :math:`C^2 x_j` from :func:`kernel_gradients`, shape `(n, d)`.
    :return: Float64 array `(m, n)`.
    """
    delta, gradients = _delta_and_gradients(delta, gradients)
    return np.outer(np.abs(delta).max(axis=1), np.abs(gradients).sum(axis=1))


def kernel_change_fixed_context(delta: Any, gradients: Any, chunk_size: int = DEFAULT_CHUNK) -> np.ndarray:
    """
    Signed kernel change with the context held fixed: :math:`K(a + \\delta_i, x_j) - K(a, x_j) =
    \\delta_i^\\top C^2 x_j` (exact: the kernel is linear in its first argument when :math:`C` does not move).

    :param delta: Perturbations :math:`\\delta_i`, shape `(m, d)`.
    :param gradients: Rows :math:`C^2 x_j` from :func:`kernel_gradients`, shape `(n, d)`.
    :param chunk_size: Columns per chunk.
    :return: Float64 array `(m, n)`.
    """
    delta, gradients = _delta_and_gradients(delta, gradients)
    return _times_rows_t(delta, gradients, check_positive_int(chunk_size, "chunk_size"))


def _perturbed_rows(x: np.ndarray, indices: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if delta.shape != (indices.size, x.shape[1]):
        raise ValueError(f"delta must have shape {(indices.size, x.shape[1])}, got {delta.shape}")
    clean = x[indices]
    return clean, clean + delta


def kernel_change_in_context(
    x: Any,
    indices: Any,
    delta: Any,
    *,
    context: np.ndarray | None = None,
    gradients: np.ndarray | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> np.ndarray:
    """
    Signed kernel change when training example `i` itself is perturbed, so that it also moves the context:
    :math:`K'(x_i + \\delta_i, x_j) - K(x_i, x_j)` with :math:`K'(a, b) = a^\\top C_i'^2 b` and
    :math:`C_i' = C - x_i x_i^\\top + x_i' x_i'^\\top`, :math:`x_i' = x_i + \\delta_i`. Each row `i` of `indices` is
    perturbed on its own (one rebuilt context per row, the other rows clean); `j` runs over all rows of `x`.
    Entry `(r, j)` equals :math:`[(X' X'^\\top)^3]_{ij} - [(X X^\\top)^3]_{ij}` for the data matrix :math:`X'` with
    row `i = indices[r]` replaced, for `j != i` (for `j == i` it pairs the perturbed row with the clean one).

    Computed without forming :math:`C_i'`: :math:`K'(x_i', x_j) = w_i^\\top x_j` with :math:`u_i = C_i' x_i'` and
    :math:`w_i = C_i' u_i`, each a rank-two update of a product with :math:`C`, and :math:`K(x_i, x_j) =
    (C^2 x_i)^\\top x_j`; the difference :math:`w_i - C^2 x_i` is taken before the product with :math:`X^\\top`.

    :param x: Clean data matrix `(n, d)`.
    :param indices: Rows perturbed, shape `(m,)`.
    :param delta: Their perturbations :math:`\\delta_i`, shape `(m, d)`.
    :param context: :math:`C = X^\\top X` when already computed.
    :param gradients: :math:`X C^2` when already computed (:func:`kernel_gradients`).
    :param chunk_size: Rows of `x` per chunk.
    :return: Float64 array `(m, n)`.
    """
    x, c, chunk_size = _with_context(x, context, chunk_size)
    idx = _check_indices(indices, x.shape[0])
    delta = np.asarray(delta, dtype=np.float64).reshape(idx.size, -1)
    clean, moved = _perturbed_rows(x, idx, delta)
    c2_clean = np.asarray(gradients, dtype=np.float64)[idx] if gradients is not None else (clean @ c) @ c

    def apply_new_context(v: np.ndarray) -> np.ndarray:
        # C_i' v = C v - x_i (x_i . v) + x_i' (x_i' . v), row by row
        return (
            v @ c - clean * np.einsum("rd,rd->r", clean, v)[:, None] + moved * np.einsum("rd,rd->r", moved, v)[:, None]
        )

    w = apply_new_context(apply_new_context(moved))
    logger.debug("Kernel change in context for %d perturbed rows of %d x %d data.", idx.size, *x.shape)
    return _times_rows_t(w - c2_clean, x, chunk_size)


def context_change(
    x: Any,
    index: int,
    delta_row: Any,
    rows: Any,
    *,
    context: np.ndarray | None = None,
    x_context: np.ndarray | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> np.ndarray:
    """
    Signed change :math:`K'(x_k, x_j) - K(x_k, x_j) = x_k^\\top (C'^2 - C^2) x_j` of the pairs that do not involve
    the perturbed example `i`, caused by the perturbation of `i` through the context alone
    (:math:`C' = C + \\Delta`, :math:`\\Delta = x_i' x_i'^\\top - x_i x_i^\\top`).

    With :math:`P = [x_i', x_i]` (`d x 2`) and :math:`S = \\mathrm{diag}(1, -1)`, :math:`\\Delta = P S P^\\top` and
    :math:`C'^2 - C^2 = C \\Delta + \\Delta C + \\Delta^2`, so the change is a rank-four matrix
    :math:`B_k S A_j^\\top + A_k S B_j^\\top + A_k S (P^\\top P) S A_j^\\top` with :math:`A = X P`,
    :math:`B = X C P`.

    :param x: Clean data matrix `(n, d)`.
    :param index: The perturbed row `i`.
    :param delta_row: Its perturbation, shape `(d,)`.
    :param rows: Rows `k` to report, shape `(r,)`; `j` runs over all rows of `x` (entries with `k == i` or
                 `j == i` are not pairs of the perturbed kernel: the caller masks them).
    :param context: :math:`C = X^\\top X` when already computed.
    :param x_context: :math:`X C` when already computed.
    :param chunk_size: Rows of `x` per chunk.
    :return: Float64 array `(r, n)`.
    """
    x, c, chunk_size = _with_context(x, context, chunk_size)
    n, d = x.shape
    i = int(_check_indices(np.array([index]), n, "index")[0])
    k = _check_indices(rows, n, "rows")
    delta_row = np.asarray(delta_row, dtype=np.float64).reshape(-1)
    if delta_row.shape != (d,):
        raise ValueError(f"delta_row must have shape {(d,)}, got {delta_row.shape}")
    xc = _rows_times(x, c, chunk_size) if x_context is None else np.asarray(x_context, dtype=np.float64)
    p = np.stack([x[i] + delta_row, x[i]], axis=1)
    s = np.array([1.0, -1.0])
    a = _rows_times(x, p, chunk_size)
    b = _rows_times(xc, p, chunk_size)
    middle = (s[:, None] * (p.T @ p)) * s[None, :]
    left = np.concatenate([b[k] * s, a[k] * s, a[k] @ middle], axis=1)
    right = np.concatenate([a, b, a], axis=1)
    return _times_rows_t(left, right, chunk_size)


def summarise_ratios(
    actual: Any, bound: Any, mask: Any | None = None, *, rtol: float = 1e-9, atol: float = 1e-12
) -> dict[str, float]:
    """
    Compare measured kernel changes with their bounds over the selected pairs.

    A pair *fails* when :math:`|\\Delta K| > \\mathrm{bound} \\cdot (1 + \\mathrm{rtol}) + \\mathrm{atol}` (the
    tolerances absorb float64 rounding where the bound is attained). The ratio is
    :math:`|\\Delta K| / \\mathrm{bound}`, taken over pairs with a positive bound.

    :param actual: Signed or absolute kernel changes, any shape.
    :param bound: Bounds, same shape.
    :param mask: Boolean array of the pairs to count (same shape), `None` for all.
    :param rtol: Relative tolerance of the failure test.
    :param atol: Absolute tolerance of the failure test.
    :return: Dict with ``pairs``, ``failures``, ``failure_share``, ``ratio_median``, ``ratio_p95``,
             ``ratio_max`` and ``zero_bound_pairs`` (pairs with a zero bound; counted as failures when their
             change exceeds `atol`).
    """
    actual = np.abs(np.asarray(actual, dtype=np.float64))
    bound = np.asarray(bound, dtype=np.float64)
    if actual.shape != bound.shape:
        raise ValueError(f"actual and bound must have the same shape, got {actual.shape} and {bound.shape}")
    if mask is not None:
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != actual.shape:
            raise ValueError(f"mask must have shape {actual.shape}, got {mask.shape}")
        actual, bound = actual[mask], bound[mask]
    else:
        actual, bound = actual.reshape(-1), bound.reshape(-1)
    pairs = int(actual.size)
    failures = int(np.count_nonzero(actual > bound * (1.0 + rtol) + atol))
    positive = bound > 0
    ratios = actual[positive] / bound[positive]
    if ratios.size:
        median, p95 = np.percentile(ratios, [50.0, 95.0])
        ratio_max = float(ratios.max())
    else:
        median = p95 = ratio_max = float("nan")
    return {
        "pairs": pairs,
        "failures": failures,
        "failure_share": failures / pairs if pairs else float("nan"),
        "ratio_median": float(median),
        "ratio_p95": float(p95),
        "ratio_max": ratio_max,
        "zero_bound_pairs": int(pairs - np.count_nonzero(positive)),
    }
