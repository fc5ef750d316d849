"""
Spectral tools for the kernel-regime width bounds: the spectrum of the data Gram matrix :math:`G = X X^\\top`,
its condition numbers, the amplification :math:`\\kappa(G^3) = \\kappa(G)^3` of linearised attention and the
widths that the kernel-regime bounds require.

Definitions used throughout (rows of :math:`X` flattened and scaled to unit :math:`\\ell_2` norm, float64;
:math:`\\lambda_1 \\ge \\dots \\ge \\lambda_n \\ge 0` the eigenvalues of :math:`G`, :math:`r = \\min(n, d)`):

- **Numerical rank**: the number of eigenvalues above
  :math:`\\mathrm{tol} = \\mathrm{rtol} \\cdot \\lambda_1` with the default
  :math:`\\mathrm{rtol} = \\max(n, d) \\cdot \\varepsilon` (NumPy's ``matrix_rank`` rule applied to the
  eigenvalues of :math:`G`, with :math:`\\max(n, d)` as the size factor). Eigenvalues below it are rounding
  noise of the computed :math:`G`; hence no condition number derived from them exceeds :math:`1 / \\mathrm{rtol}`
  (about :math:`4.5 \\cdot 10^{12}` at :math:`n = 1000`), and values within a decade of it are flagged as lower
  bounds.
- :math:`\\kappa(G) = \\lambda_1 / \\lambda_n` over all :math:`n` eigenvalues; it is reported as infinite when
  :math:`G` is numerically singular (numerical rank below :math:`n`, which is always the case when
  :math:`d < n`).
- :math:`\\kappa_d = \\lambda_1 / \\lambda_r`, the condition number of the rank-:math:`\\min(n, d)` truncation
  of :math:`G` (the paper's definition and the headline value). When :math:`\\lambda_r` is numerically zero
  (MNIST: pixels that are zero in every image make :math:`G` rank-deficient for :math:`n` above about 700),
  the headline falls back to :math:`\\lambda_1 / \\lambda_{\\mathrm{rank}}` over the numerical rank and the
  report says so (``kappa_d_rule == "numerical rank"``); both versions are always reported.
- :math:`\\kappa(G^3) = \\kappa(G)^3`, derived from the eigenvalues of :math:`G` (the spectrum of :math:`G^3`
  is the cube of that of :math:`G`). A direct eigendecomposition of :math:`G^3` only resolves
  :math:`\\lambda_n^3` while :math:`\\kappa(G)^3` stays well inside float64's :math:`1/\\varepsilon \\approx
  4.5 \\cdot 10^{15}`, so the direct cross-check runs only when :math:`\\kappa(G)` is at most
  ``direct_check_max_kappa``. Condition numbers overflow floats quickly (:math:`\\kappa^6`), so every one is
  also reported as a base-10 logarithm computed from logarithms of eigenvalues.
- **Required widths** (base-10 logarithms): v1 of the paper, :math:`m = \\Omega(\\kappa^6)`,
  ``log10_width_v1 = 6 log10 kappa_d``; v2, :math:`m = \\Omega(\\kappa_d^6 \\, n \\ln n)`,
  ``log10_width_v2 = 6 log10 kappa_d + log10(n ln n)`` (natural logarithm). v1 is fed with :math:`\\kappa_d`
  as well: the paper's reported :math:`\\kappa \\approx 1.2 \\cdot 10^3` for MNIST cannot be the full-:math:`n`
  condition number of a :math:`G` that is singular (there :math:`n \\gg d`), and the paper's widths
  (:math:`m \\gg 10^{24}` for MNIST, :math:`\\gg 10^{29}` for CIFAR-10) are exactly the v2 formula with
  :math:`\\kappa = 1.2 \\cdot 10^3`, resp. :math:`8.7 \\cdot 10^3`, and the full training-set sizes
  :math:`n = 60{,}000`, resp. :math:`50{,}000` (see :func:`required_width_log10`). Neither :math:`\\kappa(G)`
  nor :math:`\\kappa_d` of the unit-normalised data reproduces those :math:`\\kappa` values: on 1,000 to
  10,000 images :math:`\\kappa_d` is above :math:`10^{10}` for MNIST (over the numerical rank) and
  :math:`4 \\cdot 10^7` to :math:`6 \\cdot 10^8` for CIFAR-10, so the widths reported here are far larger
  than the paper's.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np
import torch

from art_malleability.ntk.spectral_report import SPECTRUM_JSON as SPECTRUM_JSON  # public path
from art_malleability.ntk.spectral_report import SpectralReport

logger = logging.getLogger(__name__)

_EPS = float(np.finfo(np.float64).eps)
_NORM_EPS = 1e-12
_FEATURE_MODELS = ("2l-relu", "mlp-attn")
_WIDTH_VERSIONS = ("v1", "v2")


# ----------------------------------------------------------------------------------------------------
# Eigenvalues and rank
# ----------------------------------------------------------------------------------------------------


def _unit_rows(x: np.ndarray | torch.Tensor, name: str = "x") -> np.ndarray:
    """
    Flatten each example and scale it to unit :math:`\\ell_2` norm (all-zero rows stay zero), in float64.

    :param x: Array of shape `(n, ...)` (numpy or torch).
    :param name: Argument name for error messages.
    :return: New float64 array of shape `(n, d)`.
    """
    if isinstance(x, torch.Tensor):
        arr = x.detach().to("cpu", torch.float64).numpy().copy()
    elif isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
            raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        arr = np.array(x, dtype=np.float64, copy=True)
    else:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")
    if arr.ndim < 2 or arr.shape[0] < 1:
        raise ValueError(f"{name} must have shape (n, ...) with n >= 1 and at least 2 dimensions, got {arr.shape}")
    arr = arr.reshape(arr.shape[0], -1)
    if arr.shape[1] == 0:
        raise ValueError(f"{name} must have at least one feature, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} must be finite, got NaN or infinite values")
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    arr /= np.maximum(norms, _NORM_EPS)
    return arr


def _gram_eigenvalues(x: np.ndarray) -> np.ndarray:
    """
    Eigenvalues of :math:`X X^\\top` for float64 rows already normalised (descending, clipped, padded to `n`).

    :param x: Array of shape `(n, d)`.
    :return: Array of length `n`.
    """
    n, d = x.shape
    small = x @ x.T if n <= d else x.T @ x
    eigenvalues = np.linalg.eigvalsh(small)[::-1]
    eigenvalues = np.clip(eigenvalues, 0.0, None)
    if d < n:
        eigenvalues = np.concatenate([eigenvalues, np.zeros(n - d)])
    return np.ascontiguousarray(eigenvalues)


def gram_spectrum(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """
    Eigenvalues of the Gram matrix :math:`G = X X^\\top` of the flattened, unit-normalised rows of `x`.

    Computed in float64 with :func:`numpy.linalg.eigvalsh` on the smaller of :math:`X X^\\top` (`n x n`) and
    :math:`X^\\top X` (`d x d`), which share their nonzero eigenvalues. When `d < n` the `n - d` eigenvalues
    that :math:`G` has on top of those of :math:`X^\\top X` are exactly zero and are appended as zeros.
    Tiny negative eigenvalues (rounding noise of a positive semi-definite matrix) are clipped to 0. All-zero
    rows stay zero. The input is not modified.

    :param x: Data of shape `(n, ...)` (numpy array or tensor).
    :return: Float64 array of length `n`, in descending order.
    :raises ValueError: If `x` is empty, has fewer than 2 dimensions or holds non-finite values.
    :raises TypeError: If `x` is neither a numpy array nor a tensor.
    """
    return _gram_eigenvalues(_unit_rows(x))


def numerical_rank(
    eigvals: np.ndarray, rtol: float | None = None, *, n_features: int | None = None
) -> tuple[int, float]:
    """
    Numerical rank of a positive semi-definite Gram matrix from its eigenvalues.

    Rule: an eigenvalue counts when it exceeds :math:`\\mathrm{tol} = \\mathrm{rtol} \\cdot \\lambda_{\\max}`,
    with the default :math:`\\mathrm{rtol} = \\max(n, d) \\cdot \\varepsilon` (float64 machine epsilon; `n` the
    number of eigenvalues, `d` = `n_features`, or `n` when not given). This is NumPy's ``matrix_rank`` rule
    applied to the eigenvalues of :math:`G = X X^\\top`.

    :param eigvals: Eigenvalues (any order), length `n`.
    :param rtol: Relative tolerance; `None` for the default above.
    :param n_features: Number of features `d` of the data behind the Gram matrix.
    :return: `(rank, tol)`.
    :raises ValueError: On an empty or non-finite `eigvals`, a negative `rtol` or a non-positive `n_features`.
    """
    values = np.asarray(eigvals, dtype=np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("eigvals must not be empty, got no eigenvalues")
    if not np.isfinite(values).all():
        raise ValueError("eigvals must be finite, got NaN or infinite values")
    if n_features is not None:
        if isinstance(n_features, bool) or not isinstance(n_features, (int, np.integer)) or n_features < 1:
            raise ValueError(f"n_features must be a positive int, got {n_features!r}")
    rtol = _default_rtol(values.size, n_features, rtol)
    lam_max = float(values.max())
    tol = rtol * max(lam_max, 0.0)
    rank = int(np.count_nonzero(values > tol))
    return rank, float(tol)


def _default_rtol(n: int, d: int | None, rtol: float | None) -> float:
    if rtol is None:
        return max(n, d or n) * _EPS
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.floating, np.integer)):
        raise TypeError(f"rtol must be a float or None, got {type(rtol).__name__}")
    rtol = float(rtol)
    if not math.isfinite(rtol) or rtol < 0:
        raise ValueError(f"rtol must be a finite non-negative float, got {rtol}")
    return rtol


def required_width_log10(log10_kappa: float, n: int | None = None, *, version: str = "v2") -> float:
    """
    Base-10 logarithm of the width the kernel-regime bound requires.

    - ``"v1"``: :math:`m = \\Omega(\\kappa^6)`, i.e. :math:`6 \\log_{10} \\kappa`;
    - ``"v2"``: :math:`m = \\Omega(\\kappa_d^6 \\, n \\ln n)`, i.e.
      :math:`6 \\log_{10} \\kappa_d + \\log_{10}(n \\ln n)` (natural logarithm inside).

    For example, ``required_width_log10(math.log10(1.2e3), 60_000)`` is 24.3 and
    ``required_width_log10(math.log10(8.7e3), 50_000)`` is 29.4: the paper's :math:`m \\gg 10^{24}` (MNIST) and
    :math:`\\gg 10^{29}` (CIFAR-10) are v2 at the full training-set sizes.

    :param log10_kappa: :math:`\\log_{10}` of the condition number (may be `inf`).
    :param n: Number of training examples (>= 2); required for ``"v2"``, ignored for ``"v1"``.
    :param version: ``"v1"`` or ``"v2"``.
    :return: :math:`\\log_{10} m`.
    :raises ValueError: On an unknown `version`, a NaN `log10_kappa` or a missing / too small `n` for v2.
    """
    if version not in _WIDTH_VERSIONS:
        raise ValueError(f"version must be one of {_WIDTH_VERSIONS}, got {version!r}")
    log10_kappa = float(log10_kappa)
    if math.isnan(log10_kappa):
        raise ValueError(f"log10_kappa must not be NaN, got {log10_kappa}")
    if version == "v1":
        return 6.0 * log10_kappa
    if n is None or isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"n must be an int >= 2 for the v2 width (n ln n), got {n!r}")
    return 6.0 * log10_kappa + math.log10(n * math.log(n))


def _log10_ratio(top: float, bottom: float) -> float:
    """:math:`\\log_{10}(\\mathrm{top} / \\mathrm{bottom})` without overflow; `inf` when `bottom` is 0."""
    if bottom <= 0.0:
        return math.inf
    return math.log10(top) - math.log10(bottom)


def _ratio(top: float, bottom: float) -> float:
    """`top / bottom`, `inf` when `bottom` is 0 or the quotient overflows."""
    if bottom <= 0.0:
        return math.inf
    with np.errstate(over="ignore"):
        return float(np.float64(top) / np.float64(bottom))


# ----------------------------------------------------------------------------------------------------
# Analysis
# ----------------------------------------------------------------------------------------------------


def _direct_g3_check(
    x: np.ndarray, kappa: float, max_kappa: float
) -> tuple[str, float | None, float | None, float | None]:
    """
    Compare :math:`\\kappa(G^3)` from a direct eigendecomposition of :math:`G^3` with :math:`\\kappa(G)^3`.

    :return: `(status, kappa_direct, rel_error, tol)`.
    """
    if not math.isfinite(kappa):
        return "skipped: G is numerically singular (kappa(G) = inf)", None, None, None
    if kappa > max_kappa:
        return (
            f"skipped: kappa(G)^3 beyond float64 resolution (kappa(G) = {kappa:.3g} > {max_kappa:.3g})",
            None,
            None,
            None,
        )
    n = x.shape[0]
    gram = x @ x.T
    gram = 0.5 * (gram + gram.T)
    cube = gram @ gram @ gram
    cube = 0.5 * (cube + cube.T)
    direct = np.linalg.eigvalsh(cube)
    kappa_direct = _ratio(float(direct[-1]), float(direct[0])) if direct[0] > 0 else math.inf
    expected = kappa**3
    rel_error = abs(kappa_direct / expected - 1.0) if math.isfinite(kappa_direct) else math.inf
    tol = 1e-6 + 10.0 * n * _EPS * expected
    status = "passed" if rel_error <= tol else "failed"
    if status == "failed":
        logger.warning(
            "Direct kappa(G^3) = %.6g differs from kappa(G)^3 = %.6g by %.3g (tolerance %.3g).",
            kappa_direct, expected, rel_error, tol,
        )
    return status, float(kappa_direct), float(rel_error), float(tol)


def spectral_analysis(
    x: np.ndarray | torch.Tensor,
    *,
    name: str | None = None,
    rtol: float | None = None,
    direct_check_max_kappa: float = 1e4,
    features: str = "unit-normalised inputs",
) -> SpectralReport:
    """
    Spectral analysis of the Gram matrix :math:`G = X X^\\top` of the flattened, unit-normalised rows of `x`:
    numerical rank, :math:`\\kappa(G)`, :math:`\\kappa_d` (both truncation rules), :math:`\\kappa(G^3)` with a
    direct cross-check when meaningful, and the required widths of the v1 and v2 bounds (base-10 logarithms).
    See the module docstring for the definitions. The input is not modified.

    :param x: Data of shape `(n, ...)` with `n >= 2` (numpy array or tensor).
    :param name: Label stored in the report.
    :param rtol: Relative tolerance of the rank rule; `None` for `max(n, d) * eps`.
    :param direct_check_max_kappa: Largest :math:`\\kappa(G)` for which :math:`G^3` is also eigendecomposed
                                   directly and compared with :math:`\\kappa(G)^3` (beyond about 1e4 the
                                   smallest eigenvalue of the computed :math:`G^3` is rounding noise).
    :param features: Description of the rows, stored in the report.
    :return: The :class:`~art_malleability.ntk.spectral_report.SpectralReport`.
    :raises ValueError: On fewer than 2 examples, all-zero data, non-finite values or bad tolerances.
    :raises TypeError: On arguments of the wrong type.
    """
    _check_analysis_arguments(name, features, direct_check_max_kappa)
    rows = _unit_rows(x)
    n, d = rows.shape
    if n < 2:
        raise ValueError(f"x must hold at least 2 examples, got {n}")
    zero_rows = int(np.count_nonzero(~rows.any(axis=1)))
    if zero_rows == n:
        raise ValueError("x must hold a nonzero example, got only all-zero examples; G = 0 has no spectrum")
    flags = [f"{zero_rows} all-zero example(s): each adds a zero eigenvalue to G."] if zero_rows else []
    rtol = _default_rtol(n, d, rtol)
    if rtol >= 1.0:
        raise ValueError(f"rtol must be below 1 (it is relative to lambda_max), got {rtol}")
    eigenvalues = _gram_eigenvalues(rows)
    rank, tol = numerical_rank(eigenvalues, rtol)
    values = _condition_numbers(eigenvalues, d, rank, tol, rtol, flags)
    status, kappa_direct, rel_error, check_tol = _direct_g3_check(rows, values["kappa"], float(direct_check_max_kappa))
    log10_kappa_d = values["log10_kappa_d"]
    report = SpectralReport(
        name=name, features=features, n=n, d=d, rank=rank, rank_rtol=rtol, rank_tol=tol, eigenvalues=eigenvalues,
        **values, g3_check=status, g3_check_kappa_direct=kappa_direct, g3_check_rel_error=rel_error,
        g3_check_tol=check_tol, log10_width_v1=required_width_log10(log10_kappa_d, version="v1"),
        log10_width_v2=required_width_log10(log10_kappa_d, n, version="v2"), flags=flags,
    )
    logger.info(
        "Spectrum of %s (%d x %d): rank %d, kappa_d %.4g (%s), log10 widths v1 %.2f, v2 %.2f.",
        name or "data", n, d, rank, report.kappa_d, report.kappa_d_rule, report.log10_width_v1, report.log10_width_v2,
    )
    return report


def _check_analysis_arguments(name: str | None, features: str, direct_check_max_kappa: float) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    if not isinstance(features, str):
        raise TypeError(f"features must be a str, got {type(features).__name__}")
    if (
        isinstance(direct_check_max_kappa, bool)
        or not isinstance(direct_check_max_kappa, (int, float, np.integer, np.floating))
        or not direct_check_max_kappa >= 0
    ):
        raise ValueError(f"direct_check_max_kappa must be a non-negative number, got {direct_check_max_kappa!r}")


def _condition_numbers(
    eigenvalues: np.ndarray, d: int, rank: int, tol: float, rtol: float, flags: list[str]
) -> dict[str, Any]:
    """
    The condition numbers of :class:`~art_malleability.ntk.spectral_report.SpectralReport` (see the module
    docstring for the rules); what a reader must know about them is appended to ``flags``.

    :return: ``kappa``, ``kappa_d`` under both truncation rules, the headline ``kappa_d`` with its rule,
             :math:`\\kappa(G^3)`, each with its base-10 logarithm.
    """
    n = len(eigenvalues)
    r = min(n, d)
    lam_max, lam_n, lam_r = float(eigenvalues[0]), float(eigenvalues[n - 1]), float(eigenvalues[r - 1])
    lam_rank = float(eigenvalues[rank - 1])
    kappa = math.inf if lam_n <= tol else _ratio(lam_max, lam_n)
    log10_kappa = math.inf if lam_n <= tol else _log10_ratio(lam_max, lam_n)
    if math.isinf(kappa):
        reason = "d < n" if d < n else f"numerical rank {rank} < n = {n}"
        flags.append(f"G is singular ({reason}): kappa(G) and kappa(G^3) are infinite.")
    kappa_d_min_nd = math.inf if lam_r <= tol else _ratio(lam_max, lam_r)
    log10_kappa_d_min_nd = math.inf if lam_r <= tol else _log10_ratio(lam_max, lam_r)
    kappa_d_rank, log10_kappa_d_rank = _ratio(lam_max, lam_rank), _log10_ratio(lam_max, lam_rank)
    if math.isfinite(log10_kappa_d_min_nd):
        kappa_d, log10_kappa_d, rule = kappa_d_min_nd, log10_kappa_d_min_nd, "min(n, d)"
    else:
        kappa_d, log10_kappa_d, rule = kappa_d_rank, log10_kappa_d_rank, "numerical rank"
        flags.append(
            f"G is rank-deficient (numerical rank {rank} < min(n, d) = {r}): lambda_{r} is numerically zero, "
            f"so kappa_d is reported over the numerical rank (lambda_1 / lambda_{rank})."
        )
    if math.isfinite(log10_kappa_d) and rtol > 0 and log10_kappa_d > -math.log10(rtol) - 1.0:
        flags.append(
            f"kappa_d = {kappa_d:.3g} is within a decade of 1 / rtol = {1.0 / rtol:.3g}, the largest condition "
            "number that the eigenvalues of the computed G resolve: treat it as a lower bound."
        )
    with np.errstate(over="ignore"):
        kappa_g3 = float(np.float64(kappa) ** 3)
    return {
        "kappa": kappa, "log10_kappa": log10_kappa, "kappa_d_min_nd": kappa_d_min_nd,
        "log10_kappa_d_min_nd": log10_kappa_d_min_nd, "kappa_d_rank": kappa_d_rank,
        "log10_kappa_d_rank": log10_kappa_d_rank, "kappa_d": kappa_d, "log10_kappa_d": log10_kappa_d,
        "kappa_d_rule": rule, "kappa_g3": kappa_g3, "log10_kappa_g3": 3.0 * log10_kappa,
        "log10_kappa_d_g3": 3.0 * log10_kappa_d,
    }


def spectral_analysis_of_dataset(
    name_or_path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    n: int | None = None,
    seed: int = 0,
    classes: list[int] | tuple[int, ...] | None = None,
    model: str = "2l-relu",
    rtol: float | None = None,
    direct_check_max_kappa: float = 1e4,
) -> SpectralReport:
    """
    :func:`spectral_analysis` of a dataset's training subset, loaded with
    :func:`~art_malleability.data.datasets.load_dataset` (``n_train=n``, with that function's defaults for the test
    part and for `n=None`).

    - ``model="2l-relu"`` (default, as in the paper): the rows are the flattened, unit-normalised inputs, so
      the analysed matrix is :math:`G = X X^\\top`.
    - ``model="mlp-attn"``: the rows are MLP-Attn's first-layer inputs
      :math:`z_i = \\mathrm{normalise}(C x_i)` with :math:`C = X^\\top X` over the same (unit-normalised)
      training subset, computed in float64. Their Gram matrix is :math:`D G^3 D` with
      :math:`D = \\mathrm{diag}(1 / \\lVert C x_i \\rVert)`: the spectrum the attention model actually trains
      on, whose condition number is about :math:`\\kappa(G)^3` up to the diagonal rescaling. These are the
      features of the paper's literal MLP-Attn (``MLPAttn(context="gram")``), whose amplification the paper's
      claim is about; the package's default, centred MLP-Attn trains on other features.

    :param name_or_path: Dataset name or ``.npz`` path (see :func:`~art_malleability.data.datasets.load_dataset`).
    :param root: Data folder for the torchvision datasets.
    :param n: Size of the training subset.
    :param seed: Seed of the subset selection.
    :param classes: Optional class filter.
    :param model: ``"2l-relu"`` or ``"mlp-attn"``: which model's first-layer inputs to analyse.
    :param rtol: Relative tolerance of the rank rule.
    :param direct_check_max_kappa: See :func:`spectral_analysis`.
    :return: The report, named after the dataset, subset size and features.
    :raises ValueError: On an unknown `model` (and whatever :func:`load_dataset` raises).
    """
    from art_malleability.data.datasets import load_dataset

    if not isinstance(model, str):
        raise TypeError(f"model must be a str, one of {_FEATURE_MODELS}, got {type(model).__name__}")
    key = model.strip().lower().replace("_", "-")
    if key not in _FEATURE_MODELS:
        raise ValueError(f"model must be one of {_FEATURE_MODELS}, got {model!r}")
    data = load_dataset(name_or_path, root=root, n_train=n, classes=classes, seed=seed)
    x = data.x_train
    if key == "mlp-attn":
        rows = _unit_rows(x)
        n_rows, n_cols = rows.shape
        # rows C = rows (X^T X) = (X X^T) rows: take the cheaper product first.
        mapped = rows @ (rows.T @ rows) if n_rows >= n_cols else (rows @ rows.T) @ rows
        mapped /= np.maximum(np.linalg.norm(mapped, axis=1, keepdims=True), _NORM_EPS)
        x, features = mapped, "attention features normalise(C x), C = X^T X"
    else:
        features = "unit-normalised inputs"
    label = f"{data.name} (n={data.n_train}, seed {seed}{', classes ' + str(list(classes)) if classes else ''})"
    return spectral_analysis(
        x, name=label, rtol=rtol, direct_check_max_kappa=direct_check_max_kappa, features=features
    )
