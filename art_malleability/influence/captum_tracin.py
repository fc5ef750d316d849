"""
Adapter over Captum's TracIn-CP (:class:`captum.influence.TracInCP`).

For users who already rely on Captum, and as an independent reference for
:class:`~art_malleability.influence.gradient.GradientInfluence`: both compute
``Σ_k lr_k · g_q(θ_k) · g_i(θ_k)`` and agree to float precision. By default it uses
Captum's per-batch sample-wise gradients where they are exact (``sample_wise_grads_per_batch="auto"``),
otherwise one backward pass per example; either way it is slower than the factorised estimator.

Captum is given a working copy of the model (never the user's model), its own loss module with
the reduction it requires, in-memory checkpoints (no files are written) and data loaders with a
private random generator (the global RNG is not advanced).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from art_malleability._utils.params import Rule, RuleTable
from art_malleability._utils.torch_utils import frozen_parameters_to_buffers
from art_malleability.influence._tracin import TracInInfluence, snapshot_state
from art_malleability.influence.base import KMostInfluential, per_example_loss
from art_malleability.ntk.cost import MethodCost, loss_step_cost

logger = logging.getLogger(__name__)

# Module types whose per-example gradients Captum's sample-wise trick supports.
_SAMPLE_WISE_MODULES = (nn.Linear, nn.Conv2d)


def _sample_wise_problem(model: nn.Module, x_one: np.ndarray, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why Captum's sample-wise gradients would be wrong for this model (``None``: they are exact)."""
    calls: dict[str, int] = {}
    hooks = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not isinstance(module, _SAMPLE_WISE_MODULES):
            return (
                "every trainable parameter to belong to an nn.Linear or nn.Conv2d layer; module "
                f"{name or '<root>'!r} ({type(module).__name__}) has trainable parameters"
            )
        calls[name] = 0
        hooks.append(module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1)))
    try:
        with torch.no_grad():
            model(torch.as_tensor(x_one, dtype=dtype, device=device))
    finally:
        for hook in hooks:
            hook.remove()
    again = [name for name, count in calls.items() if count != 1]
    if again:
        return f"every nn.Linear / nn.Conv2d layer to be called once per forward pass; {again} are not"
    return None


#: Share of another example's counted backward work that one example's backward pass through its batch's graph pays
#: (Captum's per-example path differentiates the batch's outputs one by one): fitted on the SmallCNN in float64 (15 ms
#: an example in batches of 64 against 1.4 ms counted), and checked on the audits of docs/scale.md.
BATCH_GRAPH_SHARE = 0.15


class CaptumLoss(nn.Module):
    """
    The package's per-example loss (:func:`~art_malleability.influence.base.per_example_loss`)
    as a loss module with the ``reduction`` attribute Captum inspects.

    :param loss: ``"cross_entropy"`` or ``"mse"``.
    :param reduction: ``"none"``, ``"sum"`` or ``"mean"``.
    """

    def __init__(self, loss: str, reduction: str = "none") -> None:
        super().__init__()
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
        self.loss = loss
        self.reduction = reduction

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """
        :param outputs: Model outputs ``(n, C)``.
        :param targets: Class indices ``(n,)``.
        :return: Per-example losses ``(n,)`` or their sum / mean.
        """
        losses = per_example_loss(outputs, targets, self.loss)
        if self.reduction == "sum":
            return losses.sum()
        if self.reduction == "mean":
            return losses.mean()
        return losses


class CaptumInfluence(TracInInfluence):
    """
    TracIn-CP influence through :class:`captum.influence.TracInCP`.

    Scores have shape ``(n_query, n_train)``; **positive = helpful** (Captum's "proponents":
    training on the example lowered the query's loss, removing it would raise it).

    :param loss: Per-example loss, ``"cross_entropy"`` (default) or ``"mse"``.
    :param checkpoints: ``None`` (the model's weights at :meth:`fit` time) or a list of state
        dicts of the same model.
    :param learning_rates: ``None`` (``1.0`` per checkpoint) or one learning rate per checkpoint.
    :param device: ``"auto"``, a device string or a :class:`torch.device`.
    :param dtype: Dtype of the computation (default ``torch.float64``).
    :param batch_size: Batch size of the data loaders handed to Captum.
    :param sample_wise_grads_per_batch: Use Captum's hook-based per-example gradients (one backward pass per
        batch) instead of one backward pass per example. ``"auto"`` (default) uses them when every trainable
        parameter belongs to an ``nn.Linear`` / ``nn.Conv2d`` layer that the forward pass calls once (checked on
        one example at :meth:`fit`); ``True`` requires that, ``False`` never uses them.
    """

    name = "captum"
    _parameter_rules: RuleTable = {
        **TracInInfluence._parameter_rules,
        "sample_wise_grads_per_batch": Rule("be True, False or 'auto'", lambda v: isinstance(v, bool) or v == "auto"),
    }

    def __init__(
        self,
        loss: str = "cross_entropy",
        checkpoints: Sequence[Mapping[str, torch.Tensor]] | None = None,
        learning_rates: Sequence[float] | None = None,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        batch_size: int = 64,
        sample_wise_grads_per_batch: bool | str = "auto",
    ) -> None:
        self._init_params(locals())

    def _loader(self, x: np.ndarray, y: np.ndarray, batch_size: int | None = None) -> DataLoader:
        dataset = TensorDataset(
            torch.tensor(x, dtype=self.dtype, device=self.device_),
            torch.tensor(y, dtype=torch.long, device=self.device_),
        )
        # a private generator: iterating a DataLoader otherwise draws from the global RNG
        return DataLoader(dataset, batch_size=batch_size or self.batch_size, shuffle=False, generator=torch.Generator())

    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        from captum.influence import TracInCP

        self._fit_checkpoints(model)
        checkpoints, learning_rates = self._checkpoints, self._learning_rates
        # Captum differentiates with respect to every entry of model.parameters(): frozen
        # parameters (e.g. a fixed output layer) become buffers of the working copy.
        frozen_parameters_to_buffers(model)
        wanted = self.sample_wise_grads_per_batch is not False
        problem = _sample_wise_problem(model, x_train[:1], self.dtype, self.device_) if wanted else None
        if self.sample_wise_grads_per_batch is True and problem is not None:
            raise ValueError(
                f"sample_wise_grads_per_batch must be False or 'auto' for this model, got True; it needs {problem}"
            )
        self.sample_wise_ = self.sample_wise_grads_per_batch is True or (
            self.sample_wise_grads_per_batch == "auto" and problem is None
        )
        final = snapshot_state(model)
        states = [final if sd is None else sd for sd in checkpoints]

        def load_checkpoint(module: nn.Module, index: int) -> float:
            module.load_state_dict(states[index])
            return learning_rates[index]

        reduction = "sum" if self.sample_wise_ else "none"
        self._final_state = final
        self._tracin = TracInCP(
            model,
            self._loader(x_train, y_train),
            checkpoints=list(range(len(states))),
            checkpoints_load_func=load_checkpoint,
            loss_fn=CaptumLoss(self.loss, reduction),
            sample_wise_grads_per_batch=self.sample_wise_,
        )

    def _score_seconds(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_train: int, n_query: int,
                       device: torch.device) -> float:
        """
        Captum's work for one query batch: a forward and backward pass of every training example and query (in
        batches where its sample-wise gradients are exact, else one example at a time, each through its whole
        batch's graph), each example's gradient of all ``P`` parameters written, and the ``2 q n P`` operations of
        their dot products.
        """
        loss = CaptumLoss(self.loss, "sum")
        step = loss_step_cost(model, x, y, loss)
        wanted = self.sample_wise_grads_per_batch is not False
        sample_wise = wanted and _sample_wise_problem(model, x[:1].cpu().numpy(), self.dtype, device) is None
        examples = n_train + n_query
        passes = examples / self.batch_size if sample_wise else examples
        # one example at a time, Captum differentiates its batch's graph once per example (the training set in batches
        # of batch_size, the queries in one batch): each example's backward pass pays a share of its batch's
        def share(batch: int) -> float:
            return 1.0 + (batch - 1) * BATCH_GRAPH_SHARE

        spread = 1.0 if sample_wise else (n_train * share(min(self.batch_size, n_train))
                                          + n_query * share(n_query)) / examples
        per = MethodCost("captum", step.example_flops * spread, step.example_writes * spread + step.example_numbers,
                         2.0 * step.example_numbers, step.calls, 0.0, step.example_numbers, step.bits)
        return per.seconds(examples, n_query * n_train, passes, device)

    def _captum(self, method: str, *args: object, **kwargs: object) -> object:
        """Call a method of Captum's ``TracInCP`` with gradients on; the model's final weights are restored after."""
        with self._final_weights_after(), torch.enable_grad(), warnings.catch_warnings():
            # the sample-wise path marks its own input copies as requiring grad and says so
            warnings.filterwarnings("ignore", message="Input Tensor .* did not already require gradients")
            return getattr(self._tracin, method)(*args, **kwargs)

    def _run(self, x_query: np.ndarray, y_query: np.ndarray, **kwargs: object) -> object:
        # one batch of queries, as Captum's own tuple form (which would draw from the global RNG): a loader of
        # several query batches makes Captum recompute every training gradient once per query batch
        return self._captum("influence", self._loader(x_query, y_query, batch_size=max(len(x_query), 1)), **kwargs)

    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        result = self._run(x_query, y_query, k=None)
        return result.detach().to(torch.float64).cpu().numpy()

    def influence(
        self, x_query: np.ndarray, y_query: np.ndarray, k: int | None = None, proponents: bool = True
    ) -> np.ndarray | KMostInfluential:
        """
        :meth:`InfluenceEstimator.influence`, with ``k`` answered by Captum's own k-most-influential mode.
        """
        self._check_fitted("influence")
        if k is None:
            return self.scores(x_query, y_query)
        k = self._check_k(k)
        x_query, y_query = self._check_query(x_query, y_query)
        indices, scores = self._run(x_query, y_query, k=k, proponents=bool(proponents))
        return KMostInfluential(
            indices.cpu().numpy().astype(np.int64), scores.detach().to(torch.float64).cpu().numpy()
        )

    def self_influence(self, x: np.ndarray | None = None, y: np.ndarray | None = None) -> np.ndarray:
        """
        Captum's ``self_influence``: ``Σ_k lr_k ‖g(θ_k)‖²`` of the training set (``x=None``) or of given examples.

        :param x: ``None`` (the training set) or inputs ``(n, *input_shape)``.
        :param y: Their labels.
        :return: ``float64`` array ``(n,)``.
        """
        checked = self._check_self_influence(x, y)
        data = None if checked is None else self._loader(*checked)
        result = self._captum("self_influence", data)
        return result.detach().to(torch.float64).cpu().numpy()
