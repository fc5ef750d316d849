"""
Loss landscape of a trained classifier around its weights: the top Hessian eigenvalues of the training loss
(:func:`hessian_top_eigenvalues`) and the filter-normalised 1-D loss profile of Li et al. 2018, "Visualizing the
Loss Landscape of Neural Nets" (:func:`loss_profile`). Both measure how flat the minimum is, e.g. to compare
MLP-Attn with the 2L-ReLU.

The loss is the one of :func:`~art_malleability.models.training.train_model`: the mean over the examples of
cross-entropy on logits, or of the squared error between outputs and one-hot targets averaged over examples and
classes (``torch.nn.MSELoss``). Labels may be class indices `(n,)` or one-hot rows `(n, k)`; for ``"mse"`` both
become one-hot targets over the model's outputs, as in training. Only the data loss is measured: the L2 term of
Adam's ``weight_decay`` (:math:`\\frac{\\lambda}{2} \\lVert \\theta \\rVert^2`) is left out; it would add
:math:`\\lambda` to every Hessian eigenvalue. Only the trainable parameters (``requires_grad=True``) move, taken
in ``model.named_parameters()`` order. Both functions work on a deep copy of the model in eval mode: the model
passed (weights, dtype, device, training mode, ``requires_grad`` flags), the arrays passed and the global random
states are left unchanged. A transductive model (MLP-Attn) needs ``set_context(x_train)`` before the call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from art_malleability._utils.checks import check_loss, check_positive_int, labels_to_indices
from art_malleability._utils.io import json_ready, progress_bar
from art_malleability._utils.params import SEED, check_value
from art_malleability._utils.torch_utils import (
    check_dtype,
    model_device_dtype,
    resolve_device,
    trainable_parameters,
    working_copy,
)

__all__ = ["HessianSpectrum", "LossProfile", "hessian_top_eigenvalues", "loss_profile"]

logger = logging.getLogger(__name__)

_Params = dict[str, torch.Tensor]


@dataclass(eq=False)
class HessianSpectrum:
    """
    Top eigenvalues of the Hessian of the mean training loss (data loss only) with respect to the trainable
    parameters.

    :param eigenvalues: The top-`k` algebraic eigenvalues, descending.
    :param n_parameters: Number of trainable parameters (the Hessian is `n_parameters` square).
    :param n_examples: Number of examples the loss averages over.
    :param loss: ``"cross_entropy"`` or ``"mse"``.
    :param loss_value: The mean loss at the weights.
    :param n_hvp: Number of Hessian-vector products over the whole data set that Lanczos used.
    """

    eigenvalues: np.ndarray
    n_parameters: int
    n_examples: int
    loss: str
    loss_value: float
    n_hvp: int

    def to_dict(self) -> dict:
        """:return: A JSON-ready dictionary of the fields."""
        return json_ready(asdict(self))


@dataclass(eq=False)
class LossProfile:
    """
    Filter-normalised 1-D loss profiles :math:`L(\\theta + \\alpha d)`, one per random direction `d`.

    :param alphas: The step sizes :math:`\\alpha`, shape `(a,)`.
    :param losses: The mean losses, shape `(n_directions, a)`.
    :param loss_at_minimum: :math:`L(\\theta)`, the mean loss at the weights.
    :param fit_radius: Half-width of the window :math:`|\\alpha| \\le` `fit_radius` of the quadratic fit.
    :param loss: ``"cross_entropy"`` or ``"mse"``.
    :param n_examples: Number of examples the loss averages over.
    :param seed: Seed of the directions.
    """

    alphas: np.ndarray
    losses: np.ndarray
    loss_at_minimum: float
    fit_radius: float
    loss: str
    n_examples: int
    seed: int

    @property
    def curvature(self) -> np.ndarray:
        """
        Per direction, the second-order coefficient :math:`c_2` of the least-squares fit
        :math:`L \\approx c_0 + c_1 \\alpha + c_2 \\alpha^2` over :math:`|\\alpha| \\le` `fit_radius`; twice it is the
        directional second derivative :math:`d^\\top H d`. `NaN` when fewer than three alphas lie in the window.
        """
        window = np.abs(self.alphas) <= self.fit_radius * (1 + 1e-9)
        if np.unique(self.alphas[window]).size < 3:
            logger.warning("Fewer than 3 alphas within fit_radius=%g: curvature is NaN.", self.fit_radius)
            return np.full(self.losses.shape[0], np.nan)
        return np.polyfit(self.alphas[window], self.losses[:, window].T, 2)[0]

    def rise(self, at: float) -> float:
        """
        :param at: A step size such that `at` and `-at` are both in :attr:`alphas` (sign ignored).
        :return: Mean over directions of :math:`\\frac{1}{2}(L(\\theta + a d) + L(\\theta - a d)) - L(\\theta)`.
        :raises ValueError: When `at` or `-at` is not in the grid.
        """
        columns = [np.flatnonzero(np.isclose(self.alphas, s * abs(float(at)), rtol=1e-9, atol=1e-12)) for s in (1, -1)]
        if any(c.size == 0 for c in columns):
            raise ValueError(f"at must be a step size with both signs in alphas, got {at!r}")
        both = self.losses[:, [columns[0][0], columns[1][0]]].mean(axis=1)
        return float(both.mean() - self.loss_at_minimum)

    def to_dict(self) -> dict:
        """:return: A JSON-ready dictionary of the fields and the curvatures."""
        return json_ready({**asdict(self), "curvature": self.curvature})

    def plot(self, ax=None):
        """
        One thin line per direction and their mean (thick).

        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        if ax is None:
            from matplotlib.figure import Figure

            ax = Figure(figsize=(5.0, 3.6)).add_subplot()
        for row in self.losses:
            ax.plot(self.alphas, row, lw=0.6, color="tab:blue", alpha=0.5)
        ax.plot(self.alphas, self.losses.mean(axis=0), lw=2.0, color="tab:blue", label="mean over directions")
        ax.set_xlabel("α (filter-normalised)")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=8)
        return ax.figure


def hessian_top_eigenvalues(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    loss: str = "cross_entropy",
    k: int = 1,
    batch_size: int = 512,
    tol: float = 1e-10,
    max_iter: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    seed: int = 0,
    verbose: bool = True,
) -> HessianSpectrum:
    """
    Top-`k` algebraic eigenvalues of the Hessian of the mean training loss (data loss only, see the module) with
    respect to the trainable parameters, by Lanczos (:func:`scipy.sparse.linalg.eigsh`, ``which="LA"``) on exact
    Hessian-vector products (``torch.func`` forward-over-reverse, accumulated over mini-batches, each weighted by
    its share of the examples). A model trained with Adam's ``weight_decay`` :math:`\\lambda` has the Hessian of
    its regularised objective shifted by :math:`\\lambda`: add it to the eigenvalues for that.

    :param model: The trained module, mapping `(b, *input_shape)` to `(b, nb_classes)`; left unchanged.
    :param x: Inputs `(n, *input_shape)` (numpy array or tensor, finite).
    :param y: Labels, class indices `(n,)` or one-hot `(n, nb_classes)`.
    :param loss: ``"cross_entropy"`` or ``"mse"``, as in training.
    :param k: Number of eigenvalues, `1 <= k < n_parameters`.
    :param batch_size: Examples per Hessian-vector product batch (bounds memory).
    :param tol: Relative accuracy of the eigenvalues (``eigsh``'s `tol`; 0 is machine precision).
    :param max_iter: Most Arnoldi restarts (``eigsh``'s `maxiter`); `None` is scipy's default.
    :param dtype: Floating-point dtype of the computation (float64 by default).
    :param device: ``"cpu"``, ``"cuda"``/``"gpu"``, ``"auto"`` or a device.
    :param seed: Seed of Lanczos' start vector (a local numpy generator).
    :param verbose: Show a progress bar over the Hessian-vector products.
    :return: The :class:`HessianSpectrum`.
    """
    loss_name, x_np, y_idx, y_cols = _check_data(model, x, y, loss, batch_size)
    n_params = sum(p.numel() for _, p in trainable_parameters(model))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k < n_params:
        raise ValueError(f"k must be an int with 1 <= k < the {n_params} trainable parameters, got {k!r}")
    if not (isinstance(tol, (int, float, np.floating)) and np.isfinite(tol) and tol >= 0):
        raise ValueError(f"tol must be a finite float >= 0, got {tol!r}")
    if max_iter is not None:
        max_iter = check_positive_int(max_iter, "max_iter")
    seed = _check_seed(seed)
    dtype = check_dtype(dtype)
    torch_device = resolve_device(device)

    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    work = working_copy(model, torch_device, dtype)
    x_t, targets = _tensors(work, x_np, y_idx, y_cols, loss_name, torch_device, dtype)
    params = {name: p.detach() for name, p in trainable_parameters(work)}
    hvp = _hvp_function(work, params, x_t, targets, loss_name, int(batch_size))
    bar = progress_bar(desc="Hessian-vector products", verbose=verbose)
    n_hvp = 0

    def matvec(v: np.ndarray) -> np.ndarray:
        nonlocal n_hvp
        n_hvp += 1
        bar.update()
        v_t = torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(-1), device=torch_device).to(dtype)
        return hvp(v_t).cpu().to(torch.float64).numpy()

    operator = LinearOperator((n_params, n_params), matvec=matvec, dtype=np.float64)
    v0 = np.random.default_rng(seed).standard_normal(n_params)
    try:
        values = eigsh(operator, k=int(k), which="LA", v0=v0, tol=tol, maxiter=max_iter, return_eigenvectors=False)
    except ArpackNoConvergence as error:
        raise RuntimeError(f"Lanczos did not converge within max_iter={max_iter}: raise max_iter or tol") from error
    finally:
        bar.close()
    loss_value = _mean_loss(work, params, x_t, targets, loss_name, int(batch_size))
    logger.info("Top Hessian eigenvalue %.6g of %s after %d Hessian-vector products.", values.max(), loss_name, n_hvp)
    return HessianSpectrum(np.sort(values)[::-1].copy(), n_params, len(x_np), loss_name, loss_value, n_hvp)


def loss_profile(
    model: nn.Module,
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    loss: str = "cross_entropy",
    alphas: np.ndarray | None = None,
    n_directions: int = 5,
    fit_radius: float = 0.1,
    seed: int = 0,
    batch_size: int = 512,
    verbose: bool = True,
) -> LossProfile:
    """
    Filter-normalised 1-D loss profiles (Li et al. 2018): for each of `n_directions` Gaussian directions `d` (one
    tensor per trainable parameter), each filter of `d` is rescaled to the norm of the same filter of
    :math:`\\theta`, then :math:`L(\\theta + \\alpha d)` is evaluated for each :math:`\\alpha`. A filter is one output
    unit: ``weight[i]`` of a linear layer (a row) or of a convolution (an output channel, all remaining
    dimensions). Parameters with at most one dimension (biases, norm layers) get a zero direction, as in Li et al.
    The losses are computed in the model's own dtype and on its device, in eval mode, without gradients.

    :param model: The trained module; left unchanged.
    :param x: Inputs `(n, *input_shape)` (numpy array or tensor, finite).
    :param y: Labels, class indices `(n,)` or one-hot `(n, nb_classes)`.
    :param loss: ``"cross_entropy"`` or ``"mse"``, as in training.
    :param alphas: Finite 1-D step sizes; `None` is ``np.linspace(-1, 1, 41)``.
    :param n_directions: Number of random directions (>= 1).
    :param fit_radius: Window :math:`|\\alpha| \\le` `fit_radius` of the quadratic fit of :attr:`LossProfile.curvature`.
    :param seed: Seed of the local ``torch.Generator`` that draws the directions (on the CPU, in float64).
    :param batch_size: Examples per forward batch.
    :param verbose: Show a progress bar over the loss evaluations.
    :return: The :class:`LossProfile`.
    """
    loss_name, x_np, y_idx, y_cols = _check_data(model, x, y, loss, batch_size)
    grid = np.linspace(-1.0, 1.0, 41) if alphas is None else np.array(alphas, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or not np.all(np.isfinite(grid)):
        raise ValueError(f"alphas must be a non-empty 1-D array of finite floats, got shape {grid.shape}")
    n_directions = check_positive_int(n_directions, "n_directions")
    if not (isinstance(fit_radius, (int, float, np.floating)) and np.isfinite(fit_radius) and fit_radius > 0):
        raise ValueError(f"fit_radius must be a finite float > 0, got {fit_radius!r}")
    seed, batch_size = _check_seed(seed), int(batch_size)

    device, dtype = model_device_dtype(model)
    work = working_copy(model, device, None)
    x_t, targets = _tensors(work, x_np, y_idx, y_cols, loss_name, device, dtype)
    params = {name: p.detach() for name, p in trainable_parameters(work)}
    evaluate = functools.partial(_mean_loss, work, x_t=x_t, targets=targets, loss_name=loss_name, batch_size=batch_size)
    at_minimum = evaluate(params)
    generator = torch.Generator().manual_seed(seed)
    losses = np.empty((n_directions, grid.size))
    bar = progress_bar(total=losses.size, desc="Loss profile", verbose=verbose)
    for i in range(n_directions):
        direction = _filter_normalised_direction(list(params.values()), generator)
        for j, alpha in enumerate(grid):
            losses[i, j] = evaluate(
                {n: p + float(alpha) * d for (n, p), d in zip(params.items(), direction, strict=True)}
            )
            bar.update()
    bar.close()
    return LossProfile(grid, losses, at_minimum, float(fit_radius), loss_name, len(x_np), seed)


def _filter_normalised_direction(params: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """
    :param params: The parameter tensors :math:`\\theta`.
    :param generator: CPU generator the Gaussian entries are drawn from (in float64; nothing for 1-D tensors).
    :return: One direction tensor per parameter: zero for tensors with ``ndim <= 1``, otherwise Gaussian with each
        filter (``d[i]``) scaled to the norm of ``theta[i]``; on the parameters' device and in their dtype.
    """
    direction = []
    for p in params:
        if p.ndim <= 1:
            direction.append(torch.zeros_like(p))
            continue
        d = torch.randn(p.shape, generator=generator, dtype=torch.float64).reshape(p.shape[0], -1)
        theta = p.detach().to("cpu", torch.float64).reshape(p.shape[0], -1)
        d *= theta.norm(dim=1, keepdim=True) / d.norm(dim=1, keepdim=True).clamp_min(torch.finfo(d.dtype).tiny)
        direction.append(d.reshape(p.shape).to(p.device, p.dtype))
    return direction


def _check_seed(seed: object) -> int:
    """:return: ``seed`` as an int, once the package's rule of a seed (``SEED``) holds."""
    return int(check_value(SEED, seed, "seed"))


def _check_data(
    model: nn.Module, x: object, y: object, loss: str, batch_size: int
) -> tuple[str, np.ndarray, np.ndarray, int | None]:
    """:return: The loss name, `x` as an array, `y` as indices and `y`'s one-hot width (or `None`), once checked."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss_name = check_loss(loss)
    if not isinstance(x, (np.ndarray, torch.Tensor)):
        raise TypeError(f"x must be a numpy array or tensor of shape (n, *input_shape), got {type(x).__name__}")
    x_np = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x
    if not (np.issubdtype(x_np.dtype, np.integer) or np.issubdtype(x_np.dtype, np.floating)):
        raise TypeError(f"x must hold real numbers, got dtype {x_np.dtype}")
    if x_np.ndim < 2 or x_np.shape[0] < 1:
        raise ValueError(f"x must have shape (n, *input_shape) with n >= 1, got {x_np.shape}")
    if not np.all(np.isfinite(x_np)):
        raise ValueError(f"x must hold finite values, got {int((~np.isfinite(x_np)).sum())} NaN or infinite entries")
    y_np = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else y
    y_idx = labels_to_indices(y_np, "y")
    if y_idx.shape[0] != x_np.shape[0]:
        raise ValueError(f"y must have the same number of examples as x ({x_np.shape[0]}), got {y_idx.shape[0]}")
    check_positive_int(batch_size, "batch_size")
    if not trainable_parameters(model):
        raise ValueError("model must have a parameter with requires_grad=True, got none")
    y_cols = int(y_np.shape[1]) if y_np.ndim == 2 and y_np.shape[1] > 1 else None
    return loss_name, x_np, y_idx, y_cols


def _tensors(
    work: nn.Module,
    x_np: np.ndarray,
    y_idx: np.ndarray,
    y_cols: int | None,
    loss_name: str,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:return: The inputs (a copy, in `dtype`) and targets (indices, or one-hot rows for ``"mse"``) on `device`."""
    x_t = torch.tensor(x_np, device=device).to(dtype)
    with torch.no_grad():
        nb_outputs = int(work(x_t[:1]).shape[-1])
    if y_cols not in (None, nb_outputs):
        raise ValueError(f"y must have one column per output of the model ({nb_outputs}) when one-hot, got {y_cols}")
    if int(y_idx.max()) >= nb_outputs:
        raise ValueError(f"y must hold class indices below the model's {nb_outputs} outputs, got {int(y_idx.max())}")
    y_t = torch.as_tensor(y_idx, device=device)
    return x_t, (y_t if loss_name == "cross_entropy" else F.one_hot(y_t, nb_outputs).to(dtype))


def _batch_loss(outputs: torch.Tensor, targets: torch.Tensor, loss_name: str) -> torch.Tensor:
    """Mean cross-entropy, or mean squared error over examples and classes (as ``F.mse_loss``, which forward-mode
    differentiation of its backward does not support)."""
    return F.cross_entropy(outputs, targets) if loss_name == "cross_entropy" else (outputs - targets).square().mean()


def _mean_loss(
    work: nn.Module, params: _Params, x_t: torch.Tensor, targets: torch.Tensor, loss_name: str, batch_size: int
) -> float:
    """:return: The mean loss over all examples with the trainable parameters set to `params`."""
    total = 0.0
    with torch.no_grad():
        for start in range(0, x_t.shape[0], batch_size):
            xb, tb = x_t[start : start + batch_size], targets[start : start + batch_size]
            total += float(_batch_loss(functional_call(work, params, (xb,)), tb, loss_name)) * xb.shape[0]
    return total / x_t.shape[0]


def _hvp_function(
    work: nn.Module, params: _Params, x_t: torch.Tensor, targets: torch.Tensor, loss_name: str, batch_size: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """
    :return: The map :math:`v \\mapsto H v` of flat vectors (parameters of `params` concatenated in order), with
        :math:`H` the Hessian of the mean loss over all examples at `params`.
    """
    names, shapes = list(params), [p.shape for p in params.values()]
    sizes = [p.numel() for p in params.values()]
    n = x_t.shape[0]

    def batch_loss(p: _Params, xb: torch.Tensor, tb: torch.Tensor) -> torch.Tensor:
        return _batch_loss(functional_call(work, p, (xb,)), tb, loss_name)

    gradient = torch.func.grad(batch_loss)

    def hvp(v: torch.Tensor) -> torch.Tensor:
        tangents = {name: t.reshape(s) for name, t, s in zip(names, v.split(sizes), shapes, strict=True)}
        out = torch.zeros_like(v)
        for start in range(0, n, batch_size):
            xb, tb = x_t[start : start + batch_size], targets[start : start + batch_size]
            _, hv = torch.func.jvp(functools.partial(gradient, xb=xb, tb=tb), (params,), (tangents,))
            out += (xb.shape[0] / n) * torch.cat([hv[name].reshape(-1) for name in names])
        return out

    return hvp
