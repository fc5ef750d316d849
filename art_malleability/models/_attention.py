"""
Linearised self-attention with identity query, key and value maps (the attention of MLP-Attn, and the stored
training-set context of MLP-Attn-QKV), and the unit-norm flattening of inputs shared by the reference models.
:mod:`art_malleability.models` exports :class:`LinearizedAttention`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from art_malleability._utils.checks import check_input_shape
from art_malleability._utils.params import one_of

logger = logging.getLogger(__name__)

_NORM_EPS = 1e-12
_CONTEXT_CHUNK = 4096
#: The contexts of :class:`LinearizedAttention`: the training set's centred covariance, or its Gram matrix.
CONTEXTS = ("centred", "gram")
#: The rule of an attention context (the attention's ``context``, and the ``attention_context`` of the studies that
#: build attention models): one of :data:`CONTEXTS`.
CONTEXT = one_of(CONTEXTS)


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

    With ``context="centred"`` the training tokens are centred first: :math:`C = (X - 1\\mu^\top)^\top
    (X - 1\\mu^\top)` with :math:`\\mu` the mean row of :math:`X` (buffer ``mean``), and each row maps to
    :math:`(x - \\mu) C`: the same attention over the centred tokens. On images the Gram matrix is dominated by
    its top eigen-direction (close to the mean image: on MNIST its features of different classes have mean cosine
    0.99); centring removes it. A positive rescaling of :math:`C` (by :math:`1/n`, :math:`1/d` or its trace)
    changes nothing once the features are normalised, as :class:`MLPAttn` does.

    :math:`C` is computed in float64 and stored in the dtype of the ``context`` buffer, which follows
    ``module.to(dtype)``.
    """

    context: torch.Tensor
    context_size: torch.Tensor

    def __init__(self, dim: int | None = None, context: str = "gram") -> None:
        """
        Create the attention map without a context; call :meth:`set_context` before the forward pass.

        :param dim: Number of input features `d`. When given, ``context`` is allocated with shape `(d, d)` so
                    that a ``state_dict`` holding a context can be loaded; when `None`, the shape is set by
                    :meth:`set_context`.
        :param context: ``"gram"`` (:math:`C = X^\top X`, the paper's form) or ``"centred"`` (the centred tokens'
                        :math:`C`, applied to centred rows).
        """
        super().__init__()
        CONTEXT(context, "context")
        self.centred = context == "centred"
        if dim is not None:
            dim = math.prod(check_input_shape(dim, "dim"))
        self.dim = dim
        shape = (dim, dim) if dim is not None else (0, 0)
        self.register_buffer("context", torch.zeros(shape))
        # Number of training examples behind the context; 0 means "no context set yet".
        self.register_buffer("context_size", torch.zeros((), dtype=torch.int64))
        if self.centred:  # only then: state_dicts of the Gram form stay as they were
            self.register_buffer("mean", torch.zeros(shape[0]))

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
        Store :math:`C = X^\\top X` of the training set (centred: with the mean row subtracted, and the mean), with
        each row of :math:`X` flattened and scaled to unit :math:`\\ell_2` norm. The input is not modified.

        :param x_train: Training inputs of shape `(n, ...)` (numpy array or tensor).
        """
        if isinstance(x_train, np.ndarray):
            x_t = torch.from_numpy(x_train)
        elif isinstance(x_train, torch.Tensor):
            x_t = x_train.detach()
        else:
            raise TypeError(f"x_train must be a numpy array or a torch tensor, got {type(x_train).__name__}")
        if x_t.ndim < 2 or x_t.shape[0] < 1:
            raise ValueError(f"x_train must have shape (n, ...) with n >= 1, got {tuple(x_t.shape)}")
        n = int(x_t.shape[0])
        d = int(np.prod(x_t.shape[1:]))
        if self.dim is not None and d != self.dim:
            raise ValueError(f"x_train must have {self.dim} features per example (the attention's dim), got {d}")
        device = self.context.device
        x_flat = x_t.reshape(n, d)

        def normalised_rows() -> Iterator[torch.Tensor]:
            for start in range(0, n, _CONTEXT_CHUNK):
                rows = x_flat[start : start + _CONTEXT_CHUNK].to(device=device, dtype=torch.float64)
                yield F.normalize(rows, p=2.0, dim=1, eps=_NORM_EPS)

        mean = torch.zeros(d, dtype=torch.float64, device=device)
        if self.centred:  # two passes: the mean, then the centred rows (no cancellation of a large X^T X)
            for rows in normalised_rows():
                mean += rows.sum(dim=0)
            mean /= n
            self.mean = mean.to(self.context.dtype)
        c = torch.zeros((d, d), dtype=torch.float64, device=device)
        for rows in normalised_rows():
            rows = rows - mean
            c += rows.T @ rows
        self.context = c.to(self.context.dtype)
        self.context_size = torch.tensor(n, dtype=torch.int64, device=device)
        logger.debug("Linearised-attention context set from %d examples of dimension %d.", n, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """
        Map each flattened row :math:`x` to :math:`x C` (centred: :math:`(x - \\mu) C`).

        :param x: Batch of shape `(b, ...)` with `d` features per example.
        :return: Tensor of shape `(b, d)`.
        """
        return self.apply_context(self.centre(x))

    def centre(self, x: torch.Tensor) -> torch.Tensor:
        """
        Flatten each row and, for the centred context, subtract the training tokens' mean :math:`\\mu`.

        :param x: Batch of shape `(b, ...)` with `d` features per example.
        :return: Tensor of shape `(b, d)` in the context's dtype.
        """
        x = self._rows(x)
        return x - self.mean if self.centred else x

    def apply_context(self, x: torch.Tensor) -> torch.Tensor:
        """
        Map each flattened row :math:`x` to :math:`x C`, without centring (rows already centred, or mapped by
        query and key maps as in MLP-Attn-QKV).

        :param x: Batch of shape `(b, ...)` with `d` features per example.
        :return: Tensor of shape `(b, d)`.
        """
        return self._rows(x) @ self.context

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """:return: ``x`` flattened to `(b, d)` in the context's dtype; :raises: without a context or on `d`."""
        if not self.has_context:
            raise RuntimeError(
                "LinearizedAttention has no context: call set_context(x_train) with the training inputs first"
            )
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.context.shape[0]:
            raise ValueError(
                f"x must have {self.context.shape[0]} features per example (the context's), got {x.shape[1]}"
            )
        return x.to(self.context.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + (", context=centred" if self.centred else "")
