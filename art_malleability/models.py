"""
Reference models of the influence-malleability study: linearised attention, MLP-Attn and 2L-ReLU.

Both reference models are two-layer ReLU networks in NTK parametrisation,

.. math:: f(x) = m^{-1/2} \\, \\mathrm{relu}(W \\tilde{x}) A,

with width :math:`m`, first-layer weights :math:`W` drawn i.i.d. :math:`\\mathcal{N}(0, 1)` (the only trained
parameters) and a fixed output matrix :math:`A \\in \\{\\pm 1\\}^{m \\times k}` (one column per class). They
differ only in the features :math:`\\tilde{x}`:

- **2L-ReLU**: :math:`\\tilde{x} = \\hat{x}`, the flattened input scaled to unit :math:`\\ell_2` norm.
- **MLP-Attn**: :math:`\\tilde{x} = \\mathrm{normalise}(C \\hat{x})` with :math:`C = X^\\top X` computed over
  the (row-normalised) training set :math:`X`. This is linearised attention with identity query/key/value maps
  (:math:`\\exp(a) \\approx 1 + a`): attention over :math:`X` gives :math:`X X^\\top X`, whose row :math:`i`
  is :math:`C x_i`. The model is *transductive*: it exposes ``set_context(x_train)``, and test points are
  mapped with the training-set context.

Both models draw :math:`W` first and then :math:`A` from one local generator seeded by ``seed``, so the two
reference models built with the same seed share their initial weights. No global random state is used.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

REFERENCE_MODELS: tuple[str, ...] = ("2l-relu", "mlp-attn")

_NORM_EPS = 1e-12
_CONTEXT_CHUNK = 4096


def _input_dim(input_shape: int | tuple[int, ...]) -> int:
    """
    Number of features of one (flattened) input.

    :param input_shape: Shape of one input, or its number of features.
    :return: Product of the entries of `input_shape`.
    """
    if isinstance(input_shape, bool):
        raise TypeError("input_shape must be a positive int or a tuple of positive ints, got a bool.")
    if isinstance(input_shape, (int, np.integer)):
        dims: tuple[int, ...] = (int(input_shape),)
    elif isinstance(input_shape, (tuple, list, torch.Size)):
        if len(input_shape) == 0:
            raise ValueError("input_shape must not be empty.")
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in input_shape):
            raise TypeError(f"input_shape must contain only ints, got {tuple(input_shape)!r}.")
        dims = tuple(int(s) for s in input_shape)
    else:
        raise TypeError(
            "input_shape must be a positive int or a tuple of positive ints, "
            f"got {type(input_shape).__name__}."
        )
    if any(s < 1 for s in dims):
        raise ValueError(f"input_shape must contain only positive sizes, got {dims}.")
    return math.prod(dims)


def _flatten_normalise(x: torch.Tensor) -> torch.Tensor:
    """
    Flatten each input and scale it to unit :math:`\\ell_2` norm (all-zero inputs stay zero).

    :param x: Batch of shape `(n, ...)`.
    :return: Tensor of shape `(n, d)`.
    """
    return F.normalize(x.reshape(x.shape[0], -1), p=2.0, dim=1, eps=_NORM_EPS)


class LinearizedAttention(nn.Module):
    """
    Linearised self-attention with identity query, key and value maps.

    With softmax linearised, attention over the row-normalised training matrix :math:`X` (`n x d`) is
    :math:`X X^\\top X`; row :math:`i` equals :math:`C x_i` with :math:`C = X^\\top X` (`d x d`, symmetric).
    The module stores :math:`C` as the buffer ``context`` (so ``state_dict`` and deep copies carry it) and
    maps each row :math:`x` to :math:`x C`. The forward pass does not normalise its input; :class:`MLPAttn`
    does.

    :math:`C` is computed in float64 and stored in the dtype of the ``context`` buffer, which follows
    ``module.to(dtype)``.
    """

    context: torch.Tensor
    context_size: torch.Tensor

    def __init__(self, dim: int | None = None) -> None:
        """
        Create the attention map without a context; call :meth:`set_context` before the forward pass.

        :param dim: Number of input features `d`. When given, ``context`` is allocated with shape `(d, d)` so
                    that a ``state_dict`` holding a context can be loaded; when `None`, the shape is set by
                    :meth:`set_context`.
        """
        super().__init__()
        if dim is not None:
            dim = _input_dim(dim)
        self.dim = dim
        shape = (dim, dim) if dim is not None else (0, 0)
        self.register_buffer("context", torch.zeros(shape))
        # Number of training examples behind the context; 0 means "no context set yet".
        self.register_buffer("context_size", torch.zeros((), dtype=torch.int64))

    @property
    def has_context(self) -> bool:
        """
        Whether a context has been set (directly or through ``load_state_dict``).

        :return: `True` once :meth:`set_context` was called.
        """
        return bool(self.context_size.item() > 0)

    @torch.no_grad()
    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """
        Store :math:`C = X^\\top X` of the training set, with each row of :math:`X` flattened and scaled to
        unit :math:`\\ell_2` norm. The input is not modified.

        :param x_train: Training inputs of shape `(n, ...)` (numpy array or tensor).
        """
        if isinstance(x_train, np.ndarray):
            x_t = torch.from_numpy(x_train)
        elif isinstance(x_train, torch.Tensor):
            x_t = x_train.detach()
        else:
            raise TypeError(f"x_train must be a numpy array or a torch tensor, got {type(x_train).__name__}.")
        if x_t.ndim < 2 or x_t.shape[0] < 1:
            raise ValueError(f"x_train must have shape (n, ...) with n >= 1, got {tuple(x_t.shape)}.")
        n = int(x_t.shape[0])
        d = int(np.prod(x_t.shape[1:]))
        if self.dim is not None and d != self.dim:
            raise ValueError(
                f"x_train has {d} features per example, expected {self.dim} (the attention's dim)."
            )
        device = self.context.device
        c = torch.zeros((d, d), dtype=torch.float64, device=device)
        x_flat = x_t.reshape(n, d)
        for start in range(0, n, _CONTEXT_CHUNK):
            rows = x_flat[start : start + _CONTEXT_CHUNK].to(device=device, dtype=torch.float64)
            rows = F.normalize(rows, p=2.0, dim=1, eps=_NORM_EPS)
            c += rows.T @ rows
        self.context = c.to(self.context.dtype)
        self.context_size = torch.tensor(n, dtype=torch.int64, device=device)
        logger.debug("Linearised-attention context set from %d examples of dimension %d.", n, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Map each flattened row :math:`x` to :math:`x C`.

        :param x: Batch of shape `(b, ...)` with `d` features per example.
        :return: Tensor of shape `(b, d)`.
        """
        if not self.has_context:
            raise RuntimeError(
                "LinearizedAttention has no context: "
                "call set_context(x_train) with the training inputs first."
            )
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.context.shape[0]:
            raise ValueError(
                f"Input has {x.shape[1]} features per example, "
                f"but the context was set for {self.context.shape[0]}."
            )
        return x.to(self.context.dtype) @ self.context

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class _TwoLayerNTK(nn.Module):
    """
    Two-layer ReLU network in NTK parametrisation on unit-norm features; subclasses define :meth:`features`.
    """

    output_signs: torch.Tensor

    def __init__(
        self, input_shape: int | tuple[int, ...], width: int, nb_classes: int, seed: int = 0
    ) -> None:
        super().__init__()
        d = _input_dim(input_shape)
        _check_width_classes(width, nb_classes)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
        self.input_shape = (
            (int(input_shape),) if isinstance(input_shape, (int, np.integer)) else tuple(input_shape)
        )
        self.input_dim = d
        self.width = int(width)
        self.nb_classes = int(nb_classes)
        self.seed = int(seed)
        self.scale = self.width**-0.5

        generator = torch.Generator().manual_seed(self.seed)
        weight = torch.randn((self.width, d), generator=generator)
        signs = torch.randint(0, 2, (self.width, self.nb_classes), generator=generator).mul_(2).sub_(1)
        # skip_init: no default initialisation, hence no draw from the global random state.
        self.hidden = nn.utils.skip_init(nn.Linear, d, self.width, bias=False)
        with torch.no_grad():
            self.hidden.weight.copy_(weight)
        self.register_buffer("output_signs", signs.to(torch.float32))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Unit-norm features fed to the first layer.

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, d)`.
        """
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Compute the logits :math:`m^{-1/2} \\mathrm{relu}(W \\tilde{x}) A`.

        :param x: Batch of shape `(b, *input_shape)` (or `(b, d)`).
        :return: Logits of shape `(b, nb_classes)`.
        """
        x = x.to(self.hidden.weight.dtype)
        hidden = torch.relu(self.hidden(self.features(x)))
        return (hidden @ self.output_signs) * self.scale

    def extra_repr(self) -> str:
        return (
            f"input_dim={self.input_dim}, width={self.width}, nb_classes={self.nb_classes}, seed={self.seed}"
        )


class TwoLayerReLU(_TwoLayerNTK):
    """
    2L-ReLU baseline: :math:`f(x) = m^{-1/2} \\mathrm{relu}(W \\hat{x}) A` with :math:`\\hat{x}` the
    flattened, unit-norm input.

    Only ``hidden.weight`` (:math:`W`, shape `(width, d)`, initialised i.i.d. :math:`\\mathcal{N}(0, 1)`) is a
    parameter. The output signs :math:`A` (shape `(width, nb_classes)`, entries :math:`\\pm 1`) are the buffer
    ``output_signs`` and are never trained.
    """

    def __init__(
        self, input_shape: int | tuple[int, ...], width: int, nb_classes: int, seed: int = 0
    ) -> None:
        """
        :param input_shape: Shape of one input (e.g. `(1, 28, 28)`) or its number of features.
        :param width: Hidden width `m` (>= 1).
        :param nb_classes: Number of outputs (>= 2).
        :param seed: Seed of the local generator that draws :math:`W` and then :math:`A`.
        """
        super().__init__(input_shape, width, nb_classes, seed)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Flattened input scaled to unit :math:`\\ell_2` norm.

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, d)`.
        """
        return _flatten_normalise(x)


class MLPAttn(_TwoLayerNTK):
    """
    MLP-Attn: linearised attention followed by the 2L-ReLU network,
    :math:`\\tilde{x} = \\mathrm{normalise}(C \\, \\mathrm{normalise}(x))` with :math:`C = X^\\top X` over the
    row-normalised training set.

    The model is transductive: call :meth:`set_context` with the training inputs before the forward pass (the
    training routines of this package do). Test points are mapped with the training-set context. The context
    lives in ``attention.context`` and is part of the ``state_dict``.
    """

    def __init__(
        self, input_shape: int | tuple[int, ...], width: int, nb_classes: int, seed: int = 0
    ) -> None:
        """
        :param input_shape: Shape of one input (e.g. `(1, 28, 28)`) or its number of features.
        :param width: Hidden width `m` (>= 1).
        :param nb_classes: Number of outputs (>= 2).
        :param seed: Seed of the local generator that draws :math:`W` and then :math:`A` (the same draws as
                     :class:`TwoLayerReLU` with this seed).
        """
        super().__init__(input_shape, width, nb_classes, seed)
        self.attention = LinearizedAttention(dim=self.input_dim)

    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """
        Set the attention context :math:`C = X^\\top X` from the training inputs (rows flattened and
        normalised).

        :param x_train: Training inputs of shape `(n, *input_shape)`.
        """
        self.attention.set_context(x_train)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Attention features :math:`\\mathrm{normalise}(C \\hat{x})`.

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, d)`.
        """
        return F.normalize(self.attention(_flatten_normalise(x)), p=2.0, dim=1, eps=_NORM_EPS)


def _check_width_classes(width: int, nb_classes: int) -> None:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise TypeError(f"width must be an int, got {type(width).__name__}.")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}.")
    if isinstance(nb_classes, bool) or not isinstance(nb_classes, (int, np.integer)):
        raise TypeError(f"nb_classes must be an int, got {type(nb_classes).__name__}.")
    if nb_classes < 2:
        raise ValueError(f"nb_classes must be >= 2, got {nb_classes}.")


def build_reference_model(
    name: str, input_shape: int | tuple[int, ...], nb_classes: int, width: int = 512, seed: int = 0
) -> nn.Module:
    """
    Build one of the reference models by name.

    :param name: One of ``REFERENCE_MODELS``: ``"2l-relu"`` (:class:`TwoLayerReLU`) or ``"mlp-attn"``
                 (:class:`MLPAttn`, transductive: call ``set_context`` before use). Case and ``_`` vs ``-``
                 are ignored.
    :param input_shape: Shape of one input or its number of features.
    :param nb_classes: Number of classes (>= 2).
    :param width: Hidden width (>= 1).
    :param seed: Seed of the initial weights.
    :return: The freshly initialised model (float32, on CPU, in training mode).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {REFERENCE_MODELS}, got {type(name).__name__}.")
    key = name.strip().lower().replace("_", "-")
    if key not in REFERENCE_MODELS:
        raise ValueError(f"Unknown reference model name {name!r}; expected one of {REFERENCE_MODELS}.")
    _check_width_classes(width, nb_classes)
    model_class = TwoLayerReLU if key == "2l-relu" else MLPAttn
    return model_class(input_shape, width=width, nb_classes=nb_classes, seed=seed)
