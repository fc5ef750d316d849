"""
Common interface of the influence estimators, and the per-example losses they share.

Every estimator follows one convention: ``scores`` returns a matrix of shape
``(n_query, n_train)`` (like Captum) where **positive means helpful**: removing (or
down-weighting) the training example would *raise* the query's loss.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from art_malleability._utils.checks import (  # noqa: F401 - labels_to_indices: public path of the influence package
    SignatureParams,
    check_finite,
    check_labels,
    labels_to_indices,
)
from art_malleability._utils.params import (
    DEVICE,
    DTYPE,
    LOSS_NAMES,
    POSITIVE_INT,
    Rule,
    RuleTable,
    check_values,
)
from art_malleability._utils.torch_utils import resolve_device, trainable_parameters, working_copy
from art_malleability.data.streaming import ExampleSource, is_torch_data
from art_malleability.models.reference import is_transductive

logger = logging.getLogger(__name__)


def regression_targets(y: torch.Tensor, n_outputs: int, dtype: torch.dtype) -> torch.Tensor:
    """
    Regression targets of the ``"mse"`` loss: one-hot rows of length ``n_outputs`` for class
    indices ``y`` (any leading shape); for a single-output model the label itself, as a float.

    Written with a comparison rather than :func:`torch.nn.functional.one_hot` so that it also
    works under ``torch.func.vmap``.

    :param y: Integer class indices, shape ``(...)``.
    :param n_outputs: Number of model outputs ``C``.
    :param dtype: Floating-point dtype of the result.
    :return: Tensor of shape ``(..., C)``.
    """
    if n_outputs == 1:
        return y.unsqueeze(-1).to(dtype)
    classes = torch.arange(n_outputs, device=y.device)
    return (y.unsqueeze(-1) == classes).to(dtype)


#: A loss: a name of ``LOSS_NAMES`` or a callable ``loss_fn(outputs (n, C), targets (n,)) -> (n,)`` per-example losses.
Loss = str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: The rule of an influence estimator's loss: a name of ``LOSS_NAMES`` or a per-example ``loss_fn``.
INFLUENCE_LOSS = Rule(f"be one of {LOSS_NAMES} or a callable loss_fn(outputs, targets)",
                      lambda v: callable(v) or (isinstance(v, str) and v in LOSS_NAMES))


def check_influence_loss(loss: object) -> Loss:
    """
    :param loss: A loss name or a callable ``loss_fn(outputs, targets)`` returning one loss per example.
    :return: ``loss`` unchanged.
    :raises ValueError: For anything else (:data:`INFLUENCE_LOSS`).
    """
    return INFLUENCE_LOSS(loss, "loss")


def per_example_loss(outputs: torch.Tensor, y: torch.Tensor, loss: Loss) -> torch.Tensor:
    """
    Per-example loss shared by all influence estimators.

    - ``"cross_entropy"``: ``logsumexp(f) - f[y]`` on logits ``f`` (softmax cross-entropy with a
      class index);
    - ``"mse"``: ``½‖f - onehot(y)‖²`` (for a single-output model: ``½ (f - y)²``);
    - a callable ``loss_fn(outputs, targets)`` (Captum's ``loss_fn`` with ``reduction="none"``): called on
      ``(n, C)`` outputs and ``(n,)`` class indices, it must return ``n`` losses (trailing dimensions are summed,
      as for ``torch.nn.MSELoss(reduction="none")``); it must be differentiable and work under ``torch.func``.

    :param outputs: Model outputs, shape ``(..., C)`` (leading dimensions are broadcast with ``y``).
    :param y: Integer class indices, shape broadcastable to ``outputs.shape[:-1]``.
    :param loss: ``"cross_entropy"``, ``"mse"`` or a callable.
    :return: Loss per example, shape ``outputs.shape[:-1]``.
    """
    y = y.expand(outputs.shape[:-1])
    if callable(loss):
        flat = loss(outputs.reshape(-1, outputs.shape[-1]), y.reshape(-1))
        if not isinstance(flat, torch.Tensor) or flat.shape[:1] != (y.numel(),):
            raise ValueError(
                f"loss_fn must return one loss per example ({y.numel()}), got "
                f"{getattr(flat, 'shape', type(flat).__name__)}; use reduction='none'"
            )
        return flat.reshape(flat.shape[0], -1).sum(-1).reshape(outputs.shape[:-1])
    if loss == "cross_entropy":
        picked = outputs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return torch.logsumexp(outputs, dim=-1) - picked
    if loss == "mse":
        target = regression_targets(y, outputs.shape[-1], outputs.dtype)
        return 0.5 * (outputs - target).pow(2).sum(-1)
    raise ValueError(f"loss must be one of {LOSS_NAMES}, got {loss!r}")


def check_data(x: np.ndarray, y: np.ndarray, x_name: str, y_name: str) -> tuple[np.ndarray, np.ndarray]:
    """
    Validate a pair of inputs and labels.

    :param x: Inputs, shape ``(n, *input_shape)``.
    :param y: Labels (indices or one-hot), ``n`` rows.
    :param x_name: Name of the input argument (for error messages).
    :param y_name: Name of the label argument (for error messages).
    :return: ``(x, y)`` with ``x`` as a numpy array (not copied) and ``y`` as ``int64`` indices.
    :raises TypeError: When ``x`` does not hold real numbers.
    :raises ValueError: On empty inputs, a NaN or infinite input (naming the first such example) or mismatched
        lengths.
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[0] == 0:
        raise ValueError(
            f"{x_name} must be a non-empty array of shape (n, *input_shape), got shape {x.shape}"
        )
    check_finite(x, x_name)
    if isinstance(y, torch.Tensor):
        y = y.detach().cpu().numpy()
    return x, check_labels(np.asarray(y), y_name, n=x.shape[0])


class KMostInfluential(NamedTuple):
    """The ``k`` most influential training examples of every query (Captum's ``KMostInfluentialResults``)."""

    #: Training indices, ``(n_query, k)``, most influential first.
    indices: np.ndarray
    #: Their scores, ``(n_query, k)`` (positive = helpful).
    influence_scores: np.ndarray


def k_most_influential(scores: np.ndarray, k: int, proponents: bool = True) -> KMostInfluential:
    """
    Per row of a score matrix, the ``k`` highest (``proponents``) or lowest scores and their columns; ties are
    broken by the lower index, undefined (``NaN``) scores come last.

    :param scores: ``(n_query, n_train)`` scores, positive = helpful.
    :param k: Number of examples per row.
    :param proponents: Highest first (``True``) or lowest first.
    :return: :class:`KMostInfluential`.
    """
    key = np.where(np.isnan(scores), np.inf, -scores if proponents else scores)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    return KMostInfluential(order.astype(np.int64), np.take_along_axis(scores, order, axis=1))


class InfluenceEstimator(abc.ABC):
    """
    Base class of influence estimators: ``fit(model, x_train, y_train)`` then
    ``scores(x_query, y_query)``, an ``(n_query, n_train)`` matrix where **positive = helpful**
    (removing the training example would raise the query's loss).

    Estimators work on a deep copy of the model (by default in float64, on ``device``, in
    evaluation mode); the model passed to :meth:`fit` is never modified. Transductive models
    (with ``set_context``) are treated as fixed functions: the copy carries the context that the
    model holds at fit time.

    Subclasses implement :meth:`_fit` and :meth:`_scores`, and get argument checks, label
    normalisation and the working copy from :meth:`fit` / :meth:`scores`.

    :param loss: Per-example loss, ``"cross_entropy"`` (logits and class index), ``"mse"``
        (``½‖f - onehot(y)‖²``) or a callable ``loss_fn(outputs, targets)`` returning one loss per example
        (see :func:`per_example_loss`).
    :param device: ``"auto"`` (CUDA when available, otherwise CPU), a device string or a
        :class:`torch.device`.
    :param dtype: Floating-point dtype of the computation (default ``torch.float64``).
    :param batch_size: Examples per block in the per-example computations.
    """

    name: str = ""
    #: The constructor's parameters, read from its signature (``get_params`` returns them all).
    estimator_params = SignatureParams()
    #: Each parameter's rule (:mod:`art_malleability._utils.params`), checked by :meth:`_check_params`; a subclass
    #: extends its base's table.
    _parameter_rules: RuleTable = {
        "loss": INFLUENCE_LOSS, "device": DEVICE, "dtype": DTYPE, "batch_size": POSITIVE_INT,
    }

    def __init__(
        self,
        loss: str = "cross_entropy",
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        batch_size: int = 256,
    ) -> None:
        self._init_params(locals())

    def _init_params(self, values: Mapping[str, Any]) -> None:
        """
        The one way every estimator's constructor stores its arguments: each of ``values`` (the constructor's
        ``locals()``) becomes an attribute of the same name, then all are checked (:meth:`_check_params`).

        :param values: The constructor's arguments by name (``self`` is skipped).
        """
        for name, value in values.items():
            if name not in ("self", "__class__"):
                setattr(self, name, value)
        self.model_: nn.Module | None = None
        self._check_params()

    def _check_params(self) -> None:
        """
        Every parameter against its rule in :attr:`_parameter_rules`.

        :raises InvalidParameterError: Naming the first parameter refused (a ``ValueError``; also a ``TypeError``
            for a value of the wrong type).
        """
        check_values(self._parameter_rules, {name: getattr(self, name) for name in self._parameter_rules})

    def get_params(self) -> dict:
        """
        :return: The constructor parameters of this estimator.
        """
        return {name: getattr(self, name) for name in self.estimator_params}

    def __repr__(self) -> str:
        def short(value: object) -> str:
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], Mapping):
                return f"[{len(value)} state dict(s)]"
            return repr(value)

        params = ", ".join(f"{k}={short(v)}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"

    @property
    def is_fitted(self) -> bool:
        """Whether :meth:`fit` has been called."""
        return self.model_ is not None

    def fit(
        self, model: nn.Module, x_train: Any, y_train: np.ndarray | None = None, *, warm_start: bool = False
    ) -> InfluenceEstimator:
        """
        Prepare the estimator for ``model`` trained on ``(x_train, y_train)``.

        :param model: The trained PyTorch model (outputs ``(n, C)``); it is copied, never modified.
        :param x_train: Training inputs, shape ``(n_train, *input_shape)``, float32 (ART convention),
            or a map-style ``torch.utils.data.Dataset`` / ``DataLoader`` of ``(x, y)`` pairs (see
            :mod:`art_malleability.data.streaming`; estimators that do not stream read it into an array).
        :param y_train: Training labels, class indices ``(n_train,)`` or one-hot ``(n_train, C)``;
            ``None`` for a dataset.
        :param warm_start: Keep the random choices of the previous fit where they still apply (the
            projection of the projected NTK influence), as when a transductive model is fitted
            again on a perturbed training set; ``False`` makes the fit independent of earlier ones.
        :return: ``self``.
        """
        self._check_params()
        self._warm_start = bool(warm_start)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not trainable_parameters(model):
            raise ValueError("model must have trainable parameters (requires_grad=True), got none")
        if is_torch_data(x_train):
            source = ExampleSource(x_train, y_train, name="x_train")
        else:
            x_train, y_train = check_data(x_train, y_train, "x_train", "y_train")
            source = ExampleSource(x_train, y_train, name="x_train")
        self.device_ = resolve_device(self.device)
        self.model_ = None
        model_copy = working_copy(model, self.device_, self.dtype)
        first, _ = source.take(np.arange(1))
        with torch.no_grad():
            out = model_copy(torch.tensor(first, dtype=self.dtype, device=self.device_))
        if out.dim() != 2:
            raise ValueError(f"model must return outputs of shape (n, C), got shape {tuple(out.shape)}")
        self.n_outputs_ = int(out.shape[1])
        if self.loss == "cross_entropy" and self.n_outputs_ < 2:
            raise ValueError(
                f"loss must be 'mse' for a model with {self.n_outputs_} output, got 'cross_entropy' (it needs at least "
                "2 logits)"
            )
        source.nb_classes = max(self.n_outputs_, 2)
        if source.is_array:  # before any expensive pass
            self._check_labels(source.labels(), "y_train")
        self.n_train_ = source.n
        self.input_shape_ = source.input_shape
        self._x_base = None
        if self.streams:
            self._fit_source(model_copy, source)
        else:
            x_train, y_train = source.arrays(self.batch_size)
            self._check_labels(y_train, "y_train")
            self.x_train_ = np.array(x_train, copy=True)
            self.y_train_ = y_train
            self._fit(model_copy, x_train, y_train)
        self.model_ = model_copy
        logger.debug("%s fitted on %d training examples", type(self).__name__, self.n_train_)
        return self

    #: Whether the estimator fits from an :class:`~art_malleability.data.streaming.ExampleSource` read in
    #: batches (:meth:`_fit_source`) instead of from arrays (:meth:`_fit`, a dataset read whole).
    streams: bool = False

    def _fit_source(self, model: nn.Module, source: ExampleSource) -> None:
        """
        Estimator-specific fit from a source of examples (estimators with ``streams = True``); it
        sets ``y_train_`` (and ``x_train_`` where it keeps the inputs) itself.
        """
        raise NotImplementedError

    def refit(self, changed: np.ndarray, x_changed: np.ndarray) -> InfluenceEstimator:
        """
        Fit again, with the same model and labels, on the training set of the last :meth:`fit`
        with the rows ``changed`` replaced by ``x_changed`` (rows not listed are back to their
        fitted values). Estimators that can reuse their fitted state override
        :meth:`_refit`; the default fits from scratch on the patched array.

        Only valid for models whose features of one example do not depend on the others
        (transductive models, whose context changes with the training set, are refused). In a
        sharded run every process calls it (it is collective) and may pass the whole change or
        just the rows of its own block (:meth:`~art_malleability.distributed.Shard.bounds`); each
        process uses the rows of its block.

        :param changed: Indices of the replaced training rows (distinct).
        :param x_changed: Their new inputs, ``(len(changed), *input_shape)``.
        :return: ``self``.
        """
        self._check_fitted("refit")
        changed = np.asarray(changed, dtype=np.int64).reshape(-1)
        out_of_range = len(changed) and not 0 <= changed.min() <= changed.max() < self.n_train_
        if len(np.unique(changed)) != len(changed) or out_of_range:
            raise ValueError(f"changed must hold distinct indices in [0, {self.n_train_}), got {changed!r}")
        x_changed = np.asarray(x_changed)
        if x_changed.shape != (len(changed), *self.input_shape_):
            raise ValueError(
                f"x_changed must have shape {(len(changed), *self.input_shape_)} (one row per changed index), "
                f"got {x_changed.shape}"
            )
        check_finite(x_changed, "x_changed")
        if is_transductive(self.model_):
            raise ValueError(
                f"model must not be transductive (with set_context) for refit, got {type(self.model_).__name__}: its "
                "features depend on the whole training set; set the new context on the model and call fit again"
            )
        self._refit(changed, x_changed)
        return self

    def _refit(self, changed: np.ndarray, x_changed: np.ndarray) -> None:
        base = getattr(self, "_x_base", None)
        if base is None:
            base = self._x_base = self.x_train_
        x = np.array(base, copy=True)
        x[changed] = x_changed
        self.x_train_ = x
        self._fit(self.model_, x, self.y_train_)

    def scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        """
        Influence of every training example on every query.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :param y_query: Query labels, class indices ``(n_query,)`` or one-hot ``(n_query, C)``.
        :return: ``float64`` array of shape ``(n_query, n_train)``; **positive = helpful**
            (removing the training example would raise the query's loss), negative = harmful.
        :raises RuntimeError: If called before :meth:`fit`.
        """
        self._check_fitted("scores")
        x_query, y_query = self._check_query(x_query, y_query)
        return np.asarray(self._scores(x_query, y_query), dtype=np.float64)

    def influence(
        self, x_query: np.ndarray, y_query: np.ndarray, k: int | None = None, proponents: bool = True
    ) -> np.ndarray | KMostInfluential:
        """
        Captum's ``influence`` (as :meth:`captum.influence.TracInCP.influence`): all scores, or the ``k`` most
        influential training examples of every query.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :param y_query: Query labels, class indices or one-hot.
        :param k: ``None``: the ``(n_query, n_train)`` scores of :meth:`scores`. An integer ``1 <= k <= n_train``:
            per query, the ``k`` training examples of highest score (``proponents=True``: most helpful) or lowest
            (``proponents=False``: most harmful), ordered from the most influential.
        :param proponents: Proponents (helpful, positive scores first) or opponents (harmful, negative first).
        :return: The scores, or a :class:`KMostInfluential` ``(indices, influence_scores)``, each ``(n_query, k)``
            (numpy arrays; Captum returns tensors).
        """
        self._check_fitted("influence")
        if k is None:
            return self.scores(x_query, y_query)
        k = self._check_k(k)
        return k_most_influential(self.scores(x_query, y_query), k, proponents)

    def self_influence(self, x: np.ndarray | None = None, y: np.ndarray | None = None) -> np.ndarray:
        """
        Self-influence, as Captum's ``self_influence``: the score of every training example on itself (for the
        NTK leave-one-out influence: how much removing the example raises its own loss).

        :param x: ``None`` (the fitted training set). Examples outside the training set have a self-influence only
            for the gradient estimators (TracIn), which accept them.
        :param y: Their labels (with ``x``).
        :return: ``float64`` array ``(n,)``.
        """
        self._check_fitted("self_influence")
        if x is not None or y is not None:
            raise ValueError(
                f"x must be None for {type(self).__name__}.self_influence, got inputs; the self-influence of examples "
                "outside the training set is defined for the gradient estimators (TracIn) only"
            )
        if getattr(self, "x_train_", None) is None:
            raise ValueError(
                f"x must be given to the self_influence of a {type(self).__name__} fitted from a dataset, got None; "
                "it keeps no training inputs to score on themselves"
            )
        out = np.empty(self.n_train_, dtype=np.float64)
        for start in range(0, self.n_train_, self.batch_size):
            rows = np.arange(start, min(start + self.batch_size, self.n_train_))
            out[rows] = self.scores(self.x_train_[rows], self.y_train_[rows])[np.arange(len(rows)), rows]
        return out

    def _check_fitted(self, method: str) -> None:
        if not self.is_fitted:
            raise RuntimeError(f"{type(self).__name__}.{method}() called before fit(); call fit(model, x, y) first")

    def _check_k(self, k: object) -> int:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= self.n_train_:
            raise ValueError(f"k must be None or an integer between 1 and n_train={self.n_train_}, got {k!r}")
        return int(k)

    def _check_query(self, x_query: np.ndarray, y_query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Validate queries against the fitted training data; labels become ``int64`` indices."""
        x_query, y_query = check_data(x_query, y_query, "x_query", "y_query")
        self._check_input_shape(x_query, "x_query")
        self._check_labels(y_query, "y_query")
        return x_query, y_query

    def _check_inputs(self, x: Any, name: str) -> np.ndarray:
        """Inputs without labels (``predict``): a non-empty, finite array of the fitted input shape (not copied)."""
        x = np.asarray(x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x)
        if x.ndim < 1 or x.shape[0] == 0:
            raise ValueError(f"{name} must be a non-empty array of shape (n, *input_shape), got shape {x.shape}")
        check_finite(x, name)
        self._check_input_shape(x, name)
        return x

    def _check_input_shape(self, x: np.ndarray, name: str) -> None:
        if tuple(x.shape[1:]) != self.input_shape_:
            raise ValueError(f"{name} must have input shape {self.input_shape_} like x_train, got {tuple(x.shape[1:])}")

    def _check_labels(self, y: np.ndarray, name: str) -> None:
        """Class indices must name one of the model's outputs (any index for a single-output model)."""
        check_labels(y, name, nb_classes=self.n_outputs_ if self.n_outputs_ > 1 else None)

    @abc.abstractmethod
    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        """
        Estimator-specific part of :meth:`fit`.

        :param model: Working copy of the model (compute device and dtype, evaluation mode); the
            estimator may keep and modify it.
        :param x_train: Validated training inputs.
        :param y_train: Training labels as ``int64`` class indices.
        """


    @abc.abstractmethod
    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        """
        Estimator-specific part of :meth:`scores`.

        :param x_query: Validated query inputs.
        :param y_query: Query labels as ``int64`` class indices.
        :return: ``(n_query, n_train)`` scores, positive = helpful.
        """
