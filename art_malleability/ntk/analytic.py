"""
Infinite-width neural tangent kernels of two-layer ReLU networks in NTK parametrisation.

For the network :math:`f_c(z) = m^{-1/2} \\sum_r A_{rc} \\, \\mathrm{relu}(w_r \\cdot z)` with
:math:`w_r \\sim \\mathcal{N}(0, I_d)` and :math:`A_{rc}` of unit second moment (the reference models of this
package draw :math:`A_{rc} = \\pm 1`), the empirical NTK of each output concentrates, as the width
:math:`m \\to \\infty`, around

- (only :math:`W` trained, the reference models)

  .. math:: K_1(z, z') = (z \\cdot z') \\, \\mathbb{E}_w[\\mathbf{1}\\{w \\cdot z > 0\\}
            \\mathbf{1}\\{w \\cdot z' > 0\\}] = (z \\cdot z') \\, \\frac{\\pi - \\theta}{2 \\pi},

- (both layers trained) :math:`K_1` plus the second-layer term, the arc-cosine kernel of degree 1,

  .. math:: K_2(z, z') = \\mathbb{E}_w[\\mathrm{relu}(w \\cdot z) \\, \\mathrm{relu}(w \\cdot z')]
            = \\lVert z \\rVert \\lVert z' \\rVert \\, \\frac{\\sin \\theta + (\\pi - \\theta) \\cos \\theta}{2 \\pi},

where :math:`\\theta \\in [0, \\pi]` is the angle between :math:`z` and :math:`z'`. Both formulas hold for any
norms (the expectations are over the direction of :math:`w` relative to the plane of :math:`z, z'`); for unit
inputs :math:`z \\cdot z' = \\cos \\theta` and the diagonal of :math:`K_1` is :math:`1/2`. The empirical kernel
is an average of :math:`m` i.i.d. terms with exactly this expectation, so its mean over initialisations equals
the limit at every width and its fluctuations fall like :math:`m^{-1/2}`.

Angles are computed stably as :math:`\\theta = 2 \\, \\mathrm{atan2}(\\lVert u - v \\rVert, \\lVert u + v \\rVert)`
for unit vectors :math:`u, v` (and :math:`\\pi - \\theta = 2 \\, \\mathrm{atan2}(\\lVert u + v \\rVert,
\\lVert u - v \\rVert)`), never as the arccosine of a dot product, which returns 0 or about 1e-8 of rounding
noise for angles below about 1e-8 (and likewise near :math:`\\pi`).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from art_malleability._utils.torch_utils import model_device_dtype, to_tensor, working_copy
from art_malleability.models.reference import MLPAttn, TwoLayerReLU

logger = logging.getLogger(__name__)

TRAINED_LAYERS: tuple[str, ...] = ("first", "both")

# Pairs with |cos| above 1 - _NEAR_COS get their chord lengths from explicit differences; for the others the
# Gram-matrix route is accurate to about eps / sin(theta) <= 5e-15 rad.
_NEAR_COS = 1e-3
# Elements per chunk of explicit pair differences.
_PAIR_CHUNK_ELEMENTS = 2**22
# Relative tolerance on the norms of the rows passed to unit_angle.
_UNIT_RTOL = 1e-6


def _as_matrix(x: np.ndarray | torch.Tensor, name: str, device: torch.device | None = None) -> torch.Tensor:
    """
    Float64 copy of a 2-D (or 1-D, read as one row) array.

    :param x: Numpy array or tensor.
    :param name: Argument name for error messages.
    :param device: Target device; `None` keeps a tensor's device (numpy goes to the CPU).
    :return: Tensor of shape `(n, d)`.
    """
    if isinstance(x, torch.Tensor):
        t = to_tensor(x, x.device if device is None else device, torch.float64)
    elif isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
            raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        t = to_tensor(x, torch.device("cpu") if device is None else device, torch.float64)
    else:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")
    if t.ndim == 1:
        t = t.unsqueeze(0)
    if t.ndim != 2:
        raise ValueError(f"{name} must have shape (n, d) (or (d,)), got {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite, got NaN or infinite values")
    return t


def _chords(u: torch.Tensor, v: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Pairwise chord lengths :math:`a = \\lVert u_i - v_j \\rVert` and :math:`b = \\lVert u_i + v_j \\rVert` of
    unit (or zero) rows.

    Far from :math:`\\theta = 0` and :math:`\\theta = \\pi` they follow from the dot products
    (:math:`a^2 = 2 - 2 c`, :math:`b^2 = 2 + 2 c`); for the pairs with :math:`|c| > 1 - 10^{-3}` (and for the
    diagonal of a symmetric call) they are recomputed from explicit differences, which keeps small angles
    accurate to full relative precision.

    :param u: Rows of shape `(n1, d)`, unit norm or zero.
    :param v: Rows of shape `(n2, d)`, unit norm or zero.
    :param symmetric: Whether `v` is `u` (the diagonal is then set to exactly `a = 0`, `b = 2 |u|`).
    :return: `(a, b)`, each of shape `(n1, n2)`.
    """
    c = u @ v.T
    if symmetric:
        c = 0.5 * (c + c.T)
    a = torch.sqrt(torch.clamp(2.0 - 2.0 * c, min=0.0))
    b = torch.sqrt(torch.clamp(2.0 + 2.0 * c, min=0.0))
    near = c.abs() > 1.0 - _NEAR_COS
    if symmetric:
        near = torch.triu(near, diagonal=1)
    pairs = near.nonzero()
    if pairs.shape[0]:
        chunk = max(1, _PAIR_CHUNK_ELEMENTS // u.shape[1])
        for block in pairs.split(chunk):
            i, j = block[:, 0], block[:, 1]
            a[i, j] = torch.linalg.vector_norm(u[i] - v[j], dim=1)
            b[i, j] = torch.linalg.vector_norm(u[i] + v[j], dim=1)
        logger.debug("Angles: %d pair(s) near 0 or pi computed from explicit differences.", pairs.shape[0])
    if symmetric:
        a = torch.triu(a, diagonal=1) + torch.triu(a, diagonal=1).T
        b = torch.triu(b, diagonal=1) + torch.triu(b, diagonal=1).T
        b.diagonal().copy_(2.0 * torch.linalg.vector_norm(u, dim=1))
    return a, b


def unit_angle(u: np.ndarray | torch.Tensor, v: np.ndarray | torch.Tensor | None = None) -> torch.Tensor:
    """
    Pairwise angles between unit vectors, computed stably as
    :math:`\\theta = 2 \\, \\mathrm{atan2}(\\lVert u - v \\rVert, \\lVert u + v \\rVert)` (not as
    :math:`\\arccos(u \\cdot v)`, which cannot resolve angles below about 1e-8 rad or within 1e-8 of
    :math:`\\pi`).

    :param u: Unit rows, shape `(n1, d)` (a single vector of shape `(d,)` is read as one row).
    :param v: Unit rows, shape `(n2, d)`; `None` means `u` (the diagonal is then exactly 0).
    :return: Float64 tensor of shape `(n1, n2)` with values in `[0, pi]`, on the device of `u`.
    :raises ValueError: If a row is not of unit norm (relative tolerance 1e-6), shapes disagree or values are
                        not finite.
    :raises TypeError: If an argument is neither a numpy array nor a tensor.
    """
    u_t = _as_matrix(u, "u")
    v_t = u_t if v is None else _as_matrix(v, "v", device=u_t.device)
    if v_t.shape[1] != u_t.shape[1]:
        raise ValueError(f"u and v must have the same number of columns, got {u_t.shape[1]} and {v_t.shape[1]}")
    for name, t in (("u", u_t), ("v", v_t)):
        norms = torch.linalg.vector_norm(t, dim=1)
        bad = (norms - 1.0).abs() > _UNIT_RTOL
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{name} must have rows of unit l2 norm, got norm {float(norms[row]):.6g} in row {row}; "
                "normalise the rows first (relu_ntk accepts any norms)"
            )
    a, b = _chords(u_t, v_t, symmetric=v is None)
    return 2.0 * torch.atan2(a, b)


def _check_trained(trained: str) -> str:
    if not isinstance(trained, str) or trained not in TRAINED_LAYERS:
        raise ValueError(f"trained must be one of {TRAINED_LAYERS}, got {trained!r}")
    return trained


def relu_ntk(
    z1: np.ndarray | torch.Tensor,
    z2: np.ndarray | torch.Tensor | None = None,
    *,
    trained: str = "first",
) -> torch.Tensor:
    """
    Infinite-width NTK of one output of a two-layer ReLU network in NTK parametrisation (first-layer weights
    i.i.d. :math:`\\mathcal{N}(0, 1)`, output weights of unit second moment), on its first-layer inputs.

    With :math:`\\theta` the angle between :math:`z` and :math:`z'`:

    - ``trained="first"`` (only the first layer trained, as in the reference models):
      :math:`K(z, z') = (z \\cdot z') (\\pi - \\theta) / (2 \\pi)`;
    - ``trained="both"``: adds the second-layer term
      :math:`\\lVert z \\rVert \\lVert z' \\rVert (\\sin \\theta + (\\pi - \\theta) \\cos \\theta) / (2 \\pi)`
      (the arc-cosine kernel of degree 1).

    The formulas hold for any norms; for unit inputs the diagonal of the ``"first"`` kernel is 1/2 and that of
    the ``"both"`` kernel is 1. Pairs involving a zero row are 0. Angles use the stable atan2 form (see
    :func:`unit_angle`).

    :param z1: First-layer inputs, shape `(n1, d)` (numpy array or tensor, any float dtype).
    :param z2: First-layer inputs, shape `(n2, d)`; `None` means `z1` (the result is then exactly symmetric).
    :param trained: ``"first"`` or ``"both"``.
    :return: Float64 tensor of shape `(n1, n2)` on the device of `z1` (the CPU for numpy input).
    :raises ValueError: On an unknown `trained`, mismatched shapes or non-finite values.
    :raises TypeError: If an input is neither a numpy array nor a tensor.
    """
    trained = _check_trained(trained)
    z1_t = _as_matrix(z1, "z1")
    symmetric = z2 is None
    z2_t = z1_t if symmetric else _as_matrix(z2, "z2", device=z1_t.device)
    if z2_t.shape[1] != z1_t.shape[1]:
        raise ValueError(f"z1 and z2 must have the same number of columns, got {z1_t.shape[1]} and {z2_t.shape[1]}")
    norms1 = torch.linalg.vector_norm(z1_t, dim=1)
    norms2 = norms1 if symmetric else torch.linalg.vector_norm(z2_t, dim=1)
    u = z1_t / torch.where(norms1 > 0, norms1, 1.0).unsqueeze(1)
    v = u if symmetric else z2_t / torch.where(norms2 > 0, norms2, 1.0).unsqueeze(1)
    a, b = _chords(u, v, symmetric=symmetric)
    complement = 2.0 * torch.atan2(b, a)  # pi - theta, accurate near theta = pi as well
    dots = z1_t @ z2_t.T
    if symmetric:
        dots = 0.5 * (dots + dots.T)
    kernel = dots * complement / (2.0 * math.pi)
    if trained == "both":
        sin_theta = 2.0 * a * b / torch.clamp(a * a + b * b, min=torch.finfo(torch.float64).tiny)
        outer = norms1.unsqueeze(1) * norms2.unsqueeze(0)
        kernel = kernel + (outer * sin_theta + dots * complement) / (2.0 * math.pi)
    return kernel


def _model_input(x: np.ndarray | torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """
    :param x: Model inputs `(n, *input_shape)`.
    :param name: Argument name for error messages.
    :param device: Target device.
    :return: A float64 copy on `device`.
    """
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")
    x_t = to_tensor(x, device, torch.float64)
    if x_t.ndim < 1 or x_t.shape[0] == 0:
        raise ValueError(f"{name} must have shape (n, *input_shape) with n >= 1, got {tuple(x_t.shape)}")
    return x_t


def _count_outputs(model: nn.Module, x: torch.Tensor) -> int:
    nb_classes = getattr(model, "nb_classes", None)
    if isinstance(nb_classes, (int, np.integer)) and not isinstance(nb_classes, bool) and nb_classes >= 1:
        return int(nb_classes)
    with torch.no_grad():
        out = model(x[:1])
    return int(out.reshape(1, -1).shape[1])


def analytic_ntk(
    model: nn.Module,
    x1: np.ndarray | torch.Tensor,
    x2: np.ndarray | torch.Tensor | None = None,
    *,
    trained: str = "first",
) -> torch.Tensor:
    """
    Infinite-width limit of ``empirical_ntk(model, x1, x2)`` for the reference models
    (:class:`~art_malleability.models.reference.TwoLayerReLU`, :class:`~art_malleability.models.reference.MLPAttn`).

    The first-layer inputs :math:`z = ` ``model.features(x)`` (unit-norm inputs for 2L-ReLU; attention features
    :math:`\\mathrm{normalise}(C \\, \\mathrm{normalise}(x))` with the training-set context for MLP-Attn, so
    MLP-Attn's limit is the same formula on the C-mapped features) are fed to :func:`relu_ntk`. As
    :func:`~art_malleability.ntk.empirical.empirical_ntk` traces the kernel over the `k` outputs and every
    output column of the sign matrix has :math:`\\mathbb{E}[A_{rc}^2] = 1`, the per-output kernel is multiplied
    by `k` (``model.nb_classes`` when present, otherwise the output size of one forward pass). The mean of the
    empirical NTK over random initialisations equals this kernel at every width.

    The model is not modified: features are computed under ``torch.no_grad`` by a float64 working copy (in
    evaluation mode) on the model's device. The formula assumes the reference architecture: a bias-free first
    layer with i.i.d. :math:`\\mathcal{N}(0, 1)` weights on ``features(x)``, ReLU, and an output matrix with
    entries of unit second moment scaled by :math:`m^{-1/2}`. For other models with a ``features`` method the
    result is this formula on their features, not necessarily their limit.

    :param model: A reference model (with ``features``; MLP-Attn needs its context set).
    :param x1: Inputs, shape `(n1, *input_shape)` (numpy array or tensor).
    :param x2: Inputs, shape `(n2, *input_shape)`; `None` means `x1` (the kernel is then exactly symmetric).
    :param trained: ``"first"`` (only the first layer trained, the reference models) or ``"both"`` (the limit
                    if the output weights were trained too).
    :return: Float64 tensor of shape `(n1, n2)` on the model's device.
    :raises TypeError: If `model` is not a module or has no ``features`` method.
    :raises ValueError: On an unknown `trained`, empty inputs, or trained parameters besides ``hidden.weight``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(getattr(model, "features", None)):
        raise TypeError(
            f"model must have a features(x) method, got {type(model).__name__} without one; analytic_ntk needs "
            "the first-layer inputs of a reference model (TwoLayerReLU or MLPAttn)"
        )
    trained = _check_trained(trained)
    extra = [n for n, p in model.named_parameters() if p.requires_grad and n != "hidden.weight"]
    if extra:
        raise ValueError(
            f"model must train the first layer only (hidden.weight), got {type(model).__name__} training "
            f"{', '.join(extra)}; their share of the empirical NTK is not width-scaled and does not vanish, so the "
            "two-layer ReLU limit does not apply (e.g. MLP-Attn-QKV's trained attention has no infinite-width "
            "kernel here)"
        )
    if not isinstance(model, (TwoLayerReLU, MLPAttn)):
        logger.warning(
            "analytic_ntk: %s is not a reference model; the two-layer ReLU formula is applied to its features.",
            type(model).__name__,
        )
    device, _ = model_device_dtype(model)
    clone = working_copy(model, device, torch.float64)
    inputs = [None if x is None else _model_input(x, name, device) for name, x in (("x1", x1), ("x2", x2))]
    with torch.no_grad():
        nb_outputs = _count_outputs(clone, inputs[0])
        z1 = clone.features(inputs[0])
        z2 = None if inputs[1] is None else clone.features(inputs[1])
    kernel = relu_ntk(z1, z2, trained=trained)
    logger.debug(
        "Analytic NTK (%s layer(s) trained) of %s: %s x %d outputs.",
        trained,
        type(model).__name__,
        tuple(kernel.shape),
        nb_outputs,
    )
    return kernel * float(nb_outputs)
