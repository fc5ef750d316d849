"""
Reference models of the influence-malleability study: linearised attention, MLP-Attn, 2L-ReLU and MLP-Attn-QKV.

All reference models are two-layer ReLU networks in NTK parametrisation,

.. math:: f(x) = m^{-1/2} \\, \\mathrm{relu}(W \\tilde{x}) A,

with width :math:`m`, first-layer weights :math:`W` drawn i.i.d. :math:`\\mathcal{N}(0, 1)` (the only trained
parameters of 2L-ReLU and MLP-Attn) and a fixed output matrix :math:`A \\in \\{\\pm 1\\}^{m \\times k}` (one
column per class). They differ only in the features :math:`\\tilde{x}`:

- **2L-ReLU**: :math:`\\tilde{x} = \\hat{x}`, the flattened input scaled to unit :math:`\\ell_2` norm.
- **MLP-Attn**: :math:`\\tilde{x} = \\mathrm{normalise}(C (\\hat{x} - \\mu))` with :math:`C` the centred
  second-moment matrix of the (row-normalised) training set :math:`X` and :math:`\\mu` its mean row (the default,
  ``context="centred"``), or the paper's literal :math:`\\tilde{x} = \\mathrm{normalise}(C \\hat{x})` with
  :math:`C = X^\\top X` (``context="gram"``). This is linearised attention with identity query/key/value maps
  (:math:`\\exp(a) \\approx 1 + a`): attention over :math:`X` gives :math:`X X^\\top X`, whose row :math:`i`
  is :math:`C x_i`; the centred form attends over the centred tokens :math:`X - 1\\mu^\\top`. The model is
  *transductive*: it exposes ``set_context(x_train)``, and test points are mapped with the training-set context.
- **MLP-Attn-QKV** (the paper's v2 extension): the same linearised attention with trained query, key and value
  maps, :math:`\\tilde{x} = \\mathrm{normalise}(W_v S W_k^\\top W_q (\\hat{x} - \\mu))` with :math:`S` the
  context of MLP-Attn (centred by default), initialised near the identity so that it starts near MLP-Attn (see
  :class:`MLPAttnQKV`). Its attention is
  trained, so the infinite-width kernel of the two-layer net on fixed features is not its limit.

All models draw :math:`W` first and then :math:`A` from one local generator seeded by ``seed`` (MLP-Attn-QKV then
draws its query, key and value maps from the same generator), so reference models built with the same seed share
their initial :math:`W` and :math:`A` (when their features have the same dimension). No global random state is
used.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from art_malleability._utils.checks import check_input_shape
from art_malleability.models._attention import (
    _NORM_EPS,
    CONTEXT,
    CONTEXTS,
    LinearizedAttention,
    _flatten_normalise,
)

__all__ = [
    "CONTEXT",
    "CONTEXTS",
    "Transductive",
    "is_transductive",
    "REFERENCE_MODELS",
    "LinearizedAttention",
    "TwoLayerReLU",
    "MLPAttn",
    "MLPAttnQKV",
    "build_reference_model",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Transductive(Protocol):
    """
    A transductive model: its features depend on the training set it is given with ``set_context(x_train)``
    (MLP-Attn's attention context). :func:`is_transductive` is the package's one test for it.
    """

    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """:param x_train: The training inputs the model's features depend on."""


def is_transductive(model: object) -> bool:
    """
    :return: Whether ``model`` has a callable ``set_context`` (see :class:`Transductive`). Read with ``getattr``,
        not ``isinstance(model, Transductive)``: from Python 3.12 a runtime protocol check does not see attributes a
        wrapper forwards through ``__getattr__`` (such as ``torch.compile``'s module).
    """
    return callable(getattr(model, "set_context", None))


REFERENCE_MODELS: tuple[str, ...] = ("2l-relu", "mlp-attn", "mlp-attn-qkv")


class _TwoLayerNTK(nn.Module):
    """
    Two-layer ReLU network in NTK parametrisation on unit-norm features; subclasses define :meth:`features`.
    """

    output_signs: torch.Tensor

    def __init__(
        self,
        input_shape: int | tuple[int, ...],
        width: int,
        nb_classes: int,
        seed: int = 0,
        *,
        feature_dim: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """
        :param input_shape: Shape of one input or its number of features `d`.
        :param width: Hidden width `m` (>= 1).
        :param nb_classes: Number of outputs (>= 2).
        :param seed: Seed of the local generator that draws :math:`W` and then :math:`A`.
        :param feature_dim: Dimension of :meth:`features` (the input of the hidden layer); `None` means `d`.
        :param generator: Generator to draw from instead of a fresh one seeded by `seed` (a subclass passes its
                          own, seeded by `seed`, to continue drawing from it after :math:`W` and :math:`A`).
        """
        super().__init__()
        self.input_shape = check_input_shape(input_shape)
        self.input_dim = d = math.prod(self.input_shape)
        self.width, self.nb_classes = _check_width_classes(width, nb_classes)
        self.seed = _check_int(seed, "seed")
        self.feature_dim = d if feature_dim is None else int(feature_dim)
        self.scale = self.width**-0.5

        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
        weight = torch.randn((self.width, self.feature_dim), generator=generator)
        signs = torch.randint(0, 2, (self.width, self.nb_classes), generator=generator).mul_(2).sub_(1)
        # skip_init: no default initialisation, hence no draw from the global random state.
        self.hidden = nn.utils.skip_init(nn.Linear, self.feature_dim, self.width, bias=False)
        with torch.no_grad():
            self.hidden.weight.copy_(weight)
        self.register_buffer("output_signs", signs.to(torch.float32))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Unit-norm features fed to the first layer.

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, feature_dim)`.
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
        return f"input_dim={self.input_dim}, width={self.width}, nb_classes={self.nb_classes}, seed={self.seed}"


class TwoLayerReLU(_TwoLayerNTK):
    """
    2L-ReLU baseline: :math:`f(x) = m^{-1/2} \\mathrm{relu}(W \\hat{x}) A` with :math:`\\hat{x}` the
    flattened, unit-norm input.

    Only ``hidden.weight`` (:math:`W`, shape `(width, d)`, initialised i.i.d. :math:`\\mathcal{N}(0, 1)`) is a
    parameter. The output signs :math:`A` (shape `(width, nb_classes)`, entries :math:`\\pm 1`) are the buffer
    ``output_signs`` and are never trained.
    """

    def __init__(self, input_shape: int | tuple[int, ...], width: int, nb_classes: int, seed: int = 0) -> None:
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
    :math:`\\tilde{x} = \\mathrm{normalise}(C_c (\\hat{x} - \\mu))` with :math:`\\hat{x}` the unit-norm input,
    :math:`\\mu` the mean of the row-normalised training set :math:`X` and :math:`C_c = (X - 1\\mu^\\top)^\\top
    (X - 1\\mu^\\top)`: the attention over the centred training tokens (:class:`LinearizedAttention`).

    The model is transductive: call :meth:`set_context` with the training inputs before the forward pass (the
    training routines of this package do). Test points are mapped with the training-set context. The context
    lives in ``attention.context`` (and ``attention.mean``) and is part of the ``state_dict``.

    ``context="gram"`` is the paper's literal form, :math:`\\tilde{x} = \\mathrm{normalise}(C \\hat{x})` with
    :math:`C = X^\\top X`. The paper leaves the context's normalisation open; centring is the default because the
    Gram form does not learn: its top eigen-direction (close to the mean image) dominates, so the features of
    different classes are nearly parallel (mean cosine 0.999 on digits, 0.993 on MNIST), and with the command
    line's training settings it reaches 76 % test accuracy on digits where the 2L-ReLU reaches 97 %; the centred
    form reaches 97 % (docs/reproduction.md, and the test
    ``test_the_centred_mlp_attn_learns_digits_as_well_as_the_2l_relu``). A ``state_dict`` of one form does not load
    into the other (the centred form also stores the mean).
    """

    def __init__(
        self,
        input_shape: int | tuple[int, ...],
        width: int,
        nb_classes: int,
        seed: int = 0,
        context: str = "centred",
    ) -> None:
        """
        :param input_shape: Shape of one input (e.g. `(1, 28, 28)`) or its number of features.
        :param width: Hidden width `m` (>= 1).
        :param nb_classes: Number of outputs (>= 2).
        :param seed: Seed of the local generator that draws :math:`W` and then :math:`A` (the same draws as
                     :class:`TwoLayerReLU` with this seed).
        :param context: ``"centred"`` (the default) or ``"gram"`` (:math:`C = X^\\top X`, the paper's literal form;
                        see the class).
        """
        super().__init__(input_shape, width, nb_classes, seed)
        self.attention = LinearizedAttention(dim=self.input_dim, context=context)

    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """
        Set the attention context (centred, or :math:`C = X^\\top X`) from the training inputs.

        :param x_train: Training inputs `(n, *input_shape)`; their rows are flattened and normalised.
        """
        self.attention.set_context(x_train)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Attention features :math:`\\mathrm{normalise}(C_c (\\hat{x} - \\mu))` (Gram form:
        :math:`\\mathrm{normalise}(C \\hat{x})`).

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, d)`.
        """
        return F.normalize(self.attention(_flatten_normalise(x)), p=2.0, dim=1, eps=_NORM_EPS)


class MLPAttnQKV(_TwoLayerNTK):
    """
    MLP-Attn-QKV: linearised attention with trained query, key and value maps, followed by the 2L-ReLU network
    (the trainable-QKV variant of the paper's v2).

    With softmax linearised (:math:`\\exp(a) \\approx 1 + a`, dropping the constant term and the normalisation as
    for the identity maps of :class:`MLPAttn`), attention of a point :math:`x` over the row-normalised training
    matrix :math:`X` (rows :math:`x_i`) with query, key and value maps :math:`W_q, W_k, W_v` (each of shape
    `(qkv_dim, d)`) is

    .. math:: \\sum_i (W_v x_i) \\, \\big((W_k x_i) \\cdot (W_q x)\\big) = W_v S W_k^\\top W_q \\, x,
              \\qquad S = X^\\top X,

    so only the `d x d` second-moment matrix :math:`S` of the training set is stored (the buffer
    ``attention.context``, exactly the context of :class:`MLPAttn` with the same ``context``), never the training
    matrix itself. With the default ``context="centred"`` the tokens are centred as in :class:`MLPAttn`: :math:`S`
    is the centred second-moment matrix and the map is applied to :math:`\\hat{x} - \\mu`. The features are
    :math:`\\tilde{x} = \\mathrm{normalise}(W_v S W_k^\\top W_q (\\hat{x} - \\mu))` (Gram form: without
    :math:`\\mu`; dimension `qkv_dim`), fed to the same NTK-parametrised two-layer ReLU network as the other
    reference models. With :math:`W_q = W_k = W_v = I` the model is exactly :class:`MLPAttn` with the same
    ``context`` (with the same seed, the same :math:`W` and :math:`A` are drawn).

    Trained parameters: ``hidden.weight`` (:math:`W`, shape `(width, qkv_dim)`, i.i.d. :math:`\\mathcal{N}(0,
    1)` at initialisation), ``query.weight`` (:math:`W_q`, shape `(qkv_dim, d)`), ``key.weight``
    (:math:`W_k^\\top`, shape `(d, qkv_dim)`: the key map is stored transposed, see below) and
    ``value.weight`` (:math:`W_v`, shape `(qkv_dim, d)`). The properties :attr:`query_weight`,
    :attr:`key_weight` and :attr:`value_weight` give the three maps in the `(qkv_dim, d)` convention above. The
    output signs :math:`A` stay a fixed buffer.

    Initialisation: each of :math:`W_q, W_k, W_v` is the (rectangular) identity :math:`I_{qkv\\_dim \\times d}`
    plus `init_noise` times i.i.d. :math:`\\mathcal{N}(0, 1/d)` entries, drawn in this order from the seeded
    generator after :math:`W` and :math:`A`. With the default `init_noise` of 0.1 each map is within about 0.2
    in spectral norm of the identity, so the model starts near MLP-Attn (and the symmetry between the three maps
    is broken). When `qkv_dim < d` the identity part keeps the first `qkv_dim` input coordinates; when
    `qkv_dim > d` it pads with zeros.

    Each of the three maps is an ``nn.Linear`` called once per forward pass on the per-example rows
    (:math:`x W_q^\\top`, then :math:`\\cdot W_k`, then :math:`\\cdot S W_v^\\top`; hence the transposed
    storage of :math:`W_k`), so the structured path of :func:`~art_malleability.ntk.empirical.empirical_ntk`
    factorises all four trained layers and needs no ``torch.func`` fallback.

    The model is transductive like :class:`MLPAttn`: call :meth:`set_context` with the training inputs before
    the forward pass (the training routines of this package do); test points are mapped with the training-set
    context, which is part of the ``state_dict``. Because its attention is trained, the infinite-width kernel of
    :func:`~art_malleability.ntk.analytic.analytic_ntk` (a two-layer ReLU net on fixed features) is not its
    limit.
    """

    def __init__(
        self,
        input_shape: int | tuple[int, ...],
        width: int,
        nb_classes: int,
        seed: int = 0,
        qkv_dim: int | None = None,
        *,
        init_noise: float = 0.1,
        context: str = "centred",
    ) -> None:
        """
        :param input_shape: Shape of one input (e.g. `(1, 28, 28)`) or its number of features `d`.
        :param width: Hidden width `m` (>= 1).
        :param nb_classes: Number of outputs (>= 2).
        :param seed: Seed of the local generator that draws :math:`W`, :math:`A` (the same draws as
                     :class:`MLPAttn` with this seed when `qkv_dim` is `d`) and then the noise of
                     :math:`W_q, W_k, W_v`.
        :param qkv_dim: Output dimension of the query, key and value maps (>= 1), which is also the input
                        dimension of the hidden layer; `None` means `d`.
        :param init_noise: Scale (>= 0) of the :math:`\\mathcal{N}(0, 1/d)` noise added to the identity in the
                           initial query, key and value maps; 0 gives exactly the identity (the model is then
                           :class:`MLPAttn` at initialisation).
        :param context: ``"centred"`` (the default) or ``"gram"``, as for :class:`MLPAttn`.
        """
        d = math.prod(check_input_shape(input_shape))
        _check_int(seed, "seed")
        p = d if qkv_dim is None else _check_int(qkv_dim, "qkv_dim", minimum=1)
        if isinstance(init_noise, bool) or not isinstance(init_noise, (int, float, np.integer, np.floating)):
            raise TypeError(f"init_noise must be a float, got {type(init_noise).__name__}")
        if not (math.isfinite(init_noise) and init_noise >= 0):
            raise ValueError(f"init_noise must be a finite float >= 0, got {init_noise!r}")

        generator = torch.Generator().manual_seed(int(seed))
        super().__init__(input_shape, width, nb_classes, seed, feature_dim=p, generator=generator)
        self.qkv_dim = p
        self.init_noise = float(init_noise)

        eye = torch.eye(p, d)
        noise_std = self.init_noise / math.sqrt(d)
        w_q, w_k, w_v = (eye + noise_std * torch.randn((p, d), generator=generator) for _ in range(3))
        # skip_init: no default initialisation, hence no draw from the global random state.
        self.query = nn.utils.skip_init(nn.Linear, d, p, bias=False)
        self.key = nn.utils.skip_init(nn.Linear, p, d, bias=False)
        self.value = nn.utils.skip_init(nn.Linear, d, p, bias=False)
        with torch.no_grad():
            self.query.weight.copy_(w_q)
            self.key.weight.copy_(w_k.T)
            self.value.weight.copy_(w_v)
        self.attention = LinearizedAttention(dim=d, context=context)

    @property
    def has_context(self) -> bool:
        """Whether :meth:`set_context` was called (or a ``state_dict`` holding a context was loaded)."""
        return self.attention.has_context

    def set_context(self, x_train: np.ndarray | torch.Tensor) -> None:
        """
        Set the attention context :math:`S` (centred, or :math:`X^\\top X`) from the training inputs; the query,
        key and value maps are not touched.

        :param x_train: Training inputs `(n, *input_shape)`; their rows are flattened and normalised.
        """
        self.attention.set_context(x_train)

    @property
    def query_weight(self) -> torch.Tensor:
        """Query map :math:`W_q` of shape `(qkv_dim, d)` (a view of ``query.weight``)."""
        return self.query.weight

    @property
    def key_weight(self) -> torch.Tensor:
        """Key map :math:`W_k` of shape `(qkv_dim, d)` (a transposed view of ``key.weight``)."""
        return self.key.weight.T

    @property
    def value_weight(self) -> torch.Tensor:
        """Value map :math:`W_v` of shape `(qkv_dim, d)` (a view of ``value.weight``)."""
        return self.value.weight

    def attention_map(self) -> torch.Tensor:
        """
        The linear map :math:`M = W_v S W_k^\\top W_q` applied by the attention (to :math:`\\hat{x} - \\mu` in the
        centred form, before the second normalisation), with the current weights and context. Differentiable; wrap
        in ``torch.no_grad`` for a plain value.

        :return: Tensor of shape `(qkv_dim, d)`.
        """
        if not self.attention.has_context:
            raise RuntimeError("MLPAttnQKV has no context: call set_context(x_train) with the training inputs first")
        s = self.attention.context.to(self.query.weight.dtype)
        return self.value_weight @ s @ self.key.weight @ self.query_weight

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """
        Attention features :math:`\\mathrm{normalise}(W_v S W_k^\\top W_q (\\hat{x} - \\mu))` (Gram form: without
        :math:`\\mu`), computed row-wise as :math:`(\\hat{x} - \\mu) W_q^\\top W_k S W_v^\\top`.

        :param x: Batch of shape `(b, *input_shape)`.
        :return: Tensor of shape `(b, qkv_dim)`.
        """
        x_hat = _flatten_normalise(x.to(self.query.weight.dtype))
        keyed = self.key(self.query(self.attention.centre(x_hat).to(x_hat.dtype)))
        attended = self.value(self.attention.apply_context(keyed))
        return F.normalize(attended, p=2.0, dim=1, eps=_NORM_EPS)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, qkv_dim={self.qkv_dim}, init_noise={self.init_noise}"


def _check_int(value: object, name: str, minimum: int | None = None) -> int:
    """:return: ``value`` as an int; :raises TypeError: unless an int; :raises ValueError: below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_width_classes(width: int, nb_classes: int) -> tuple[int, int]:
    """:return: ``(width, nb_classes)`` as ints, checked (``width >= 1``, ``nb_classes >= 2``)."""
    return _check_int(width, "width", minimum=1), _check_int(nb_classes, "nb_classes", minimum=2)


def build_reference_model(
    name: str, input_shape: int | tuple[int, ...], nb_classes: int, width: int = 512, seed: int = 0,
    context: str | None = None,
) -> nn.Module:
    """
    Build one of the reference models by name.

    :param name: One of ``REFERENCE_MODELS``: ``"2l-relu"`` (:class:`TwoLayerReLU`), ``"mlp-attn"``
                 (:class:`MLPAttn`) or ``"mlp-attn-qkv"`` (:class:`MLPAttnQKV` with its defaults:
                 `qkv_dim = d`, maps near the identity). The two attention models are transductive: call
                 ``set_context`` before use. Case and ``_`` vs ``-`` are ignored.
    :param input_shape: Shape of one input or its number of features.
    :param nb_classes: Number of classes (>= 2).
    :param width: Hidden width (>= 1).
    :param seed: Seed of the initial weights.
    :param context: The attention context of the two attention models, ``"centred"`` or ``"gram"``
                    (:class:`MLPAttn`); `None` (the only value the 2L-ReLU takes) means the model's default,
                    ``"centred"``.
    :return: The freshly initialised model (float32, on CPU, in training mode).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {REFERENCE_MODELS}, got {type(name).__name__}")
    key = name.strip().lower().replace("_", "-")
    if key not in REFERENCE_MODELS:
        raise ValueError(f"name must be one of {REFERENCE_MODELS}, got {name!r}")
    _check_width_classes(width, nb_classes)
    model_class = _MODEL_CLASSES[key]
    if context is None:
        return model_class(input_shape, width=width, nb_classes=nb_classes, seed=seed)
    if key == "2l-relu":
        raise ValueError(f"context must be None for 2l-relu (it has no attention), got {context!r}")
    return model_class(input_shape, width=width, nb_classes=nb_classes, seed=seed, context=context)


_MODEL_CLASSES: dict[str, type[_TwoLayerNTK]] = {
    "2l-relu": TwoLayerReLU,
    "mlp-attn": MLPAttn,
    "mlp-attn-qkv": MLPAttnQKV,
}
