"""
Reference training loop of the study and wrapping of trained models as ART classifiers.

The protocol follows the paper: Adam (learning rate 1e-3), mini-batches of 128, L2 regularisation 1e-3 through
Adam's ``weight_decay``, cross-entropy for multi-class tasks or mean squared error on one-hot targets. The
paper trains for 500 epochs; the default here is 100 so that CPU runs stay short.

Notes on ART 1.20's :class:`~art.estimators.classification.PyTorchClassifier`, which :func:`make_classifier`
returns:

- ``predict`` expects float32 inputs (float64 fails).
- ``loss_gradient`` needs one-hot labels (``art.utils.to_categorical``), float or integer dtype. With
  ``torch.nn.CrossEntropyLoss`` the classifier reduces them to indices (``reduce_labels``); index labels of
  shape `(n,)` fail (more than two classes: ``argmax`` over a missing axis; two classes: they are cast to
  float). With ``torch.nn.MSELoss`` ART passes labels to the loss unchanged, so one-hot labels are regressed
  as they are and index labels fail on the shape mismatch with the `(n, nb_classes)` outputs. ART's attacks
  and ``compute_loss`` convert index labels to one-hot themselves, so they accept both.
- With ``torch.nn.MSELoss``, ``compute_loss`` with ``reduction="none"`` returns one loss per output entry,
  shape `(n, nb_classes)`, not one per example.
- Deep-copying or pickling a ``PyTorchClassifier`` writes files under ``~/.art``; copy the ``nn.Module``
  instead.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from art.estimators.classification import PyTorchClassifier
from torch import nn

from art_malleability._utils.checks import check_input_shape, check_loss, labels_to_indices
from art_malleability._utils.io import progress_bar
from art_malleability._utils.params import NON_NEGATIVE, POSITIVE, POSITIVE_INT, RuleTable, check_values
from art_malleability._utils.torch_utils import eval_mode, resolve_device
from art_malleability.models.reference import is_transductive

logger = logging.getLogger(__name__)

#: The rules of :func:`train_model`'s training settings (the package's shared rules).
TRAINING_RULES: RuleTable = {"epochs": POSITIVE_INT, "batch_size": POSITIVE_INT, "lr": POSITIVE,
                             "weight_decay": NON_NEGATIVE}


def train_model(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    loss: str = "cross_entropy",
    epochs: int = 100,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 1e-3,
    seed: int = 0,
    device: str | torch.device = "auto",
    verbose: bool = True,
) -> nn.Module:
    """
    Train a model with the paper's protocol: Adam, L2 regularisation through Adam's ``weight_decay``, shuffled
    mini-batches.

    The model is trained in place (meant for models built by this package, e.g. with
    :func:`art_malleability.models.reference.build_reference_model`) and returned in eval mode on the training device. A
    model with ``set_context`` (transductive, e.g. MLP-Attn) first gets the training inputs `x` as its
    context. Only parameters with ``requires_grad`` are trained. The shuffling uses a local generator seeded
    by `seed`; the global random state and the arrays passed are left unchanged.

    :param model: PyTorch module mapping inputs `(b, *input_shape)` to outputs `(b, nb_classes)`.
    :param x: Training inputs, float array of shape `(n, *input_shape)` (cast to float32).
    :param y: Labels, class indices of shape `(n,)` or one-hot of shape `(n, nb_classes)`.
    :param loss: ``"cross_entropy"`` (on logits) or ``"mse"`` (mean squared error between outputs and one-hot
                 targets, averaged over examples and classes like ``torch.nn.MSELoss``).
    :param epochs: Number of passes over the training set (>= 1).
    :param batch_size: Mini-batch size (>= 1).
    :param lr: Adam learning rate (> 0).
    :param weight_decay: L2 regularisation coefficient of Adam (>= 0).
    :param seed: Seed of the mini-batch shuffling.
    :param device: ``"auto"`` (CUDA when available, otherwise CPU), ``"cpu"``, ``"cuda"``/``"gpu"`` or a
                   device.
    :param verbose: Show a progress bar over epochs.
    :return: The trained model, in eval mode, on the training device.
    :raises InvalidParameterError: Naming the first of ``epochs``, ``batch_size``, ``lr`` and ``weight_decay`` that
        its rule (:data:`TRAINING_RULES`) refuses (a ``ValueError``).
    """
    loss_name, y_idx = _check_training(model, x, y, loss, epochs, batch_size, lr, weight_decay)
    torch_device = resolve_device(device)

    model.to(torch_device)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    x_t = torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32), device=torch_device).to(dtype)
    y_t = torch.as_tensor(y_idx, device=torch_device)
    if is_transductive(model):
        logger.debug("Setting the context of %s to the %d training inputs.", type(model).__name__, x.shape[0])
        model.set_context(x_t)

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model must have a parameter with requires_grad=True to train, got none")

    with torch.no_grad(), eval_mode(model):  # a probe: no batch statistics of one example (nor their update)
        nb_outputs = model(x_t[:1]).shape[-1]
    if int(y_t.max()) >= nb_outputs:
        raise ValueError(f"y must hold class indices below the model's {nb_outputs} outputs, got {int(y_t.max())}")
    if np.asarray(y).ndim == 2 and np.asarray(y).shape[1] not in (1, nb_outputs):
        raise ValueError(
            f"y must have one column per output of the model ({nb_outputs} outputs) when one-hot, got "
            f"{np.asarray(y).shape[1]} columns"
        )
    targets = y_t if loss_name == "cross_entropy" else F.one_hot(y_t, nb_outputs).to(dtype)
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    mean_loss = _fit(model, x_t, targets, loss_name, optimizer, int(epochs), int(batch_size), int(seed), verbose)
    logger.info(
        "Trained %s for %d epochs, final mean training loss %.4g.", type(model).__name__, epochs, mean_loss
    )
    return model.eval()


def _check_training(
    model: nn.Module, x: np.ndarray, y: np.ndarray, loss: str, epochs: int, batch_size: int, lr: float,
    weight_decay: float,
) -> tuple[str, np.ndarray]:
    """:return: The loss name and the labels as class indices, once the arguments of :func:`train_model` hold."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss_name = check_loss(loss)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy array of shape (n, *input_shape), got {type(x).__name__}")
    if x.ndim < 2 or x.shape[0] < 1:
        raise ValueError(f"x must have shape (n, *input_shape) with n >= 1, got {x.shape}")
    y_idx = labels_to_indices(y, "y")
    if y_idx.shape[0] != x.shape[0]:
        raise ValueError(f"y must have the same number of examples as x ({x.shape[0]}), got {y_idx.shape[0]}")
    check_values(TRAINING_RULES, {"epochs": epochs, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay})
    return loss_name, y_idx


def _fit(
    model: nn.Module, x_t: torch.Tensor, targets: torch.Tensor, loss_name: str, optimizer: torch.optim.Optimizer,
    epochs: int, batch_size: int, seed: int, verbose: bool,
) -> float:
    """Shuffled mini-batch epochs of ``optimizer``; :return: the mean training loss of the last epoch."""
    generator = torch.Generator().manual_seed(seed)
    n = x_t.shape[0]
    model.train()
    progress = progress_bar(range(epochs), desc=f"Training {type(model).__name__}", verbose=verbose)
    total = 0.0
    for _ in progress:
        order = torch.randperm(n, generator=generator).to(x_t.device)
        total = 0.0
        for start in range(0, n, batch_size):
            batch = order[start : start + batch_size]
            outputs = model(x_t[batch])
            if loss_name == "cross_entropy":
                batch_loss = F.cross_entropy(outputs, targets[batch])
            else:
                batch_loss = F.mse_loss(outputs, targets[batch])
            optimizer.zero_grad(set_to_none=True)
            batch_loss.backward()
            optimizer.step()
            total += float(batch_loss.detach()) * batch.shape[0]
        progress.set_postfix(loss=f"{total / n:.4f}", refresh=False)
    return total / n


def make_classifier(
    model: nn.Module,
    input_shape: int | tuple[int, ...],
    nb_classes: int,
    *,
    loss: str = "cross_entropy",
    clip_values: tuple[float, float] | None = (0.0, 1.0),
    device: str | torch.device = "auto",
    optimizer: torch.optim.Optimizer | None = None,
) -> PyTorchClassifier:
    """
    Wrap a module as an ART :class:`~art.estimators.classification.PyTorchClassifier`.

    With ``loss="cross_entropy"`` the classifier's loss is ``torch.nn.CrossEntropyLoss()`` and ART reduces
    one-hot labels to indices. With ``loss="mse"`` it is ``torch.nn.MSELoss()``, which ART applies to the
    labels as given, so labels must be one-hot. For both losses and any number of classes, pass one-hot labels
    to ``loss_gradient`` (index labels of shape `(n,)` fail there) and float32 inputs to ``predict``.

    :param model: The module, mapping `(b, *input_shape)` to `(b, nb_classes)` outputs (logits for
                  cross-entropy).
    :param input_shape: Shape of one input, or its number of features.
    :param nb_classes: Number of classes (>= 2).
    :param loss: ``"cross_entropy"`` or ``"mse"``, the loss the model was trained with.
    :param clip_values: `(min, max)` of the input features, used by ART's attacks, or `None`.
    :param device: ``"auto"``, ``"cpu"`` or ``"cuda"``/``"gpu"``; ART's ``device_type`` is ``"gpu"`` for CUDA
                   (ART then uses the current CUDA device) and ``"cpu"`` otherwise.
    :param optimizer: Optimizer over the module's parameters, for training through ART (``fit``, ART's
                      trainers); `None` (default) for a trained module that is only evaluated and attacked.
    :return: The ART classifier; the module is moved to its device.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss_name = check_loss(loss)
    shape = check_input_shape(input_shape)
    if isinstance(nb_classes, bool) or not isinstance(nb_classes, (int, np.integer)) or nb_classes < 2:
        raise ValueError(f"nb_classes must be an int >= 2, got {nb_classes!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    torch_device = resolve_device(device)
    loss_fn: nn.Module = nn.CrossEntropyLoss() if loss_name == "cross_entropy" else nn.MSELoss()
    return PyTorchClassifier(
        model=model,
        loss=loss_fn,
        input_shape=shape,
        nb_classes=int(nb_classes),
        optimizer=optimizer,
        clip_values=clip_values,
        device_type="gpu" if torch_device.type == "cuda" else "cpu",
    )


def train_classifier(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    input_shape: int | tuple[int, ...] | None = None,
    nb_classes: int | None = None,
    loss: str = "cross_entropy",
    clip_values: tuple[float, float] | None = (0.0, 1.0),
    device: str | torch.device = "auto",
    **train_kwargs,
) -> PyTorchClassifier:
    """
    Train a model with :func:`train_model` and wrap it with :func:`make_classifier`.

    :param model: The module to train in place.
    :param x: Training inputs of shape `(n, *input_shape)`.
    :param y: Labels, class indices `(n,)` or one-hot `(n, nb_classes)`.
    :param input_shape: Shape of one input; `None` takes `x.shape[1:]`.
    :param nb_classes: Number of classes; `None` takes the model's number of outputs.
    :param loss: ``"cross_entropy"`` or ``"mse"``.
    :param clip_values: `(min, max)` of the input features, or `None`.
    :param device: ``"auto"``, ``"cpu"`` or ``"cuda"``/``"gpu"``.
    :param train_kwargs: Further keyword arguments of :func:`train_model` (``epochs``, ``batch_size``, ``lr``,
                         ``weight_decay``, ``seed``, ``verbose``).
    :return: The ART classifier around the trained model.
    """
    trained = train_model(model, x, y, loss=loss, device=device, **train_kwargs)
    if input_shape is None:
        input_shape = tuple(int(s) for s in np.asarray(x).shape[1:])
    if nb_classes is None:
        reference = next(trained.parameters())
        probe = torch.as_tensor(np.ascontiguousarray(x[:1]), dtype=reference.dtype, device=reference.device)
        with torch.no_grad():
            nb_classes = int(trained(probe).shape[-1])
    return make_classifier(
        trained, input_shape, nb_classes, loss=loss, clip_values=clip_values, device=device
    )
