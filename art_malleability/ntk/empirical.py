"""
Empirical neural tangent kernel (eNTK) of a PyTorch model.

The empirical NTK of a model ``f`` with trainable parameters ``θ`` is

    K[a, b] = Σ_c Σ_θ ∂f_c(x1_a)/∂θ · ∂f_c(x2_b)/∂θ        (``trace=True``, the default)

i.e. the Gram matrix of per-example Jacobians, traced over the model outputs (logits). With
``trace=False`` the full block ``K[a, b, c, d] = Σ_θ ∂f_c(x1_a)/∂θ · ∂f_d(x2_b)/∂θ`` is returned.
Only parameters with ``requires_grad=True`` count.

Two methods give the same numbers (to float precision):

- ``"structured"`` (``"auto"``): for every ``nn.Linear`` layer called exactly once per forward
  pass on 2-D inputs, the per-example Jacobian factorises into the layer input ``a`` and the
  gradient ``δ_c`` of output ``c`` with respect to the layer output, so the layer's share of the
  kernel is ``(A1 A2ᵀ) ⊙ Σ_c Δ1_c Δ2_cᵀ`` for the weight and ``Σ_c Δ1_c Δ2_cᵀ`` for the bias. This
  costs one forward and ``C`` backward passes per example and never materialises a Jacobian. All
  other trainable parameters (convolutions, shared or reused layers, 3-D inputs, free-standing
  parameters, ...) go through the ``torch.func`` fallback below.
- ``"jacobian"``: per-example Jacobians of every trainable parameter with
  ``torch.func.vmap(torch.func.jacrev(...))`` over ``functional_call``, contracted as
  ``Σ_c J1_c J2_cᵀ``. Exact for any model; the reference the structured path is tested against.

Both assume that examples are independent in the forward pass (true in evaluation mode; the
model is put in evaluation mode while the kernel is computed and its flags are restored after).

Streaming and memory
--------------------
The per-class output gradients of a layer of width ``m`` take ``C·m`` numbers per example
(``n × C × m`` in all: 5 GB in float64 for ``n = 1,000``, ``C = 10``, ``m = 65,536``), so they
are never held for all examples at once. A backward pass always yields the whole width of a
layer's output gradient, so the work is chunked over *examples*, with chunk sizes derived from
the widths and a memory budget ``chunk_mb``:

- **Sub-batches.** Forward and backward passes run on sub-batches of at most ``batch_size``
  examples and at most ``chunk_mb`` MiB of raw output gradients (``rows × C × Σ widths``); the
  autograd graph of the pass (a few ``rows × width`` tensors) comes on top.
- **Class factorisation (rank one).** For ``trace=True`` and ``C > 1``, the output gradients of
  a layer are checked column by column for the structure ``δ_c(x)_j = g_j(x) u_{jc}``, a
  per-example scalar times a fixed per-column class direction ``u_j`` (unit norm). This holds
  exactly whenever the layer output reaches the logits through an elementwise map followed by a
  linear readout, e.g. the last hidden layer of an MLP, the first layer of the NTK-parametrised
  reference models, or an output layer. Then ``Σ_c Δ1_c Δ2_cᵀ = G1 G2ᵀ`` (``G`` the ``n × m``
  matrix of ``g``): ``C`` times less storage and ``C`` times fewer flops in the contraction. The
  direction ``u_j`` is the normalised largest gradient of column ``j`` in the first sub-batch
  where that column is non-zero; it is shared by all examples of one kernel computation
  (examples seen earlier had a zero gradient there, so the choice is consistent). Every example
  is verified: with ``g = δ·u`` the residual ``‖δ‖² − g²`` (the squared norm of
  the part of ``δ`` orthogonal to ``u``) must be at most ``τ ‖δ‖²`` with ``τ = 8 (C + 2) ε``
  (``ε`` the dtype's machine epsilon). The neglected term ``e1·e2`` is then bounded by
  ``τ ‖δ1‖ ‖δ2‖`` per column, the size of the rounding error of the direct contraction, so the
  result stays exact to float precision. A layer that fails the check anywhere is switched to
  the full ``(C × m)`` representation for good (for this engine) and the kernel is recomputed.
- **Blocks.** The kernel is assembled from blocks of at most ``batch_size`` examples whose
  stored factors fit in ``chunk_mb`` MiB; the factors of ``x2`` are computed once and kept when
  they fit in ``2 × chunk_mb`` MiB, otherwise recomputed for every block of ``x1`` (a memory for
  time trade). With ``x2=None`` only the upper block triangle is computed and mirrored.

Peak memory is thus about the model, plus ``chunk_mb`` of raw gradients and the autograd graph
of one sub-batch, plus at most ``2 × chunk_mb`` for cached factors (or two blocks), plus the
``n1 × n2`` result, whatever the number of examples and the width (default ``chunk_mb = 256``:
for ``n = 1,000``, ``m = 65,536``, ``C = 10`` in float64 the call adds about 1 GB to the model).
Results do not depend on the chunking beyond rounding.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from art_malleability._torch_utils import (
    eval_mode,
    model_device_dtype,
    no_tf32,
    tensor_digest,
    to_tensor,
    trainable_parameters,
)

logger = logging.getLogger(__name__)

NTK_METHODS = ("auto", "structured", "jacobian")

# Default memory budget (MiB) of one chunk of Jacobian factors, see the module docstring.
DEFAULT_CHUNK_MB = 256.0

OutputFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass
class _LinearPlan:
    """A ``nn.Linear`` layer handled by the structured (factorised) path."""

    name: str
    module: nn.Linear
    weight: bool
    bias: bool


@dataclass
class _Features:
    """Per-example Jacobian factors of one batch."""

    n: int
    acts: list[torch.Tensor | None]  # per structured layer: (n, in) layer inputs, None if weight frozen
    # per structured layer: (n, C, out) output gradients, or (n, out) rank-one factors g with
    # δ_c = g u_c (see the module docstring)
    grads: list[torch.Tensor]
    jac: torch.Tensor | None  # (n, C, P) Jacobian of the fallback parameters


class _RankChange(Exception):
    """A layer's output gradients turned out not to be rank one over the classes: recompute."""


def _check_method(method: str) -> str:
    if method not in NTK_METHODS:
        raise ValueError(f"method must be one of {NTK_METHODS}, got {method!r}")
    return method


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def check_chunk_mb(chunk_mb: float) -> float:
    ok = not isinstance(chunk_mb, bool) and isinstance(chunk_mb, (int, float, np.integer, np.floating))
    if not ok or not math.isfinite(float(chunk_mb)) or chunk_mb <= 0:
        raise ValueError(f"chunk_mb must be a positive number of MiB, got {chunk_mb!r}")
    return float(chunk_mb)


def _allocate(part: _Features, n: int) -> _Features:
    """Empty factors for ``n`` examples, shaped like ``part``."""

    def like(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.new_empty((n, *t.shape[1:]))

    return _Features(n=n, acts=[like(a) for a in part.acts], grads=[like(g) for g in part.grads], jac=like(part.jac))


def _fill(out: _Features, part: _Features, start: int) -> None:
    """Copy the factors of ``part`` into rows ``start:start + part.n`` of ``out``."""
    stop = start + part.n
    pairs = [*zip(out.acts, part.acts, strict=True), *zip(out.grads, part.grads, strict=True), (out.jac, part.jac)]
    for dst, src in pairs:
        if dst is not None:
            dst[start:stop] = src


def plain_layers(model: nn.Module, types: tuple[type, ...]) -> list[tuple[str, nn.Module, bool, bool]]:
    """
    Modules of ``model`` of the given types whose ``weight`` (and ``bias``) are plain parameters used
    nowhere else, with at least one of them trainable: the candidates of a factorised (per-layer)
    treatment. Parametrised or tied weights are left out (they go through a generic fallback).

    :param model: The model.
    :param types: Module classes to look for.
    :return: ``(name, module, weight trainable, bias trainable)`` per candidate, in registration order.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, types):
            continue
        weight = module._parameters.get("weight")
        bias = module._parameters.get("bias")
        if weight is None or (module.bias is not None and bias is None):
            continue  # parametrised weights are not plain parameters
        if uses[id(weight)] != 1 or (bias is not None and uses[id(bias)] != 1):
            continue  # shared (tied) parameters go through the fallback
        w_train = weight.requires_grad
        b_train = bias is not None and bias.requires_grad
        if w_train or b_train:
            found.append((name, module, w_train, b_train))
    return found


def per_example_jacobian(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    output_fn: OutputFn | None = None,
) -> torch.Tensor:
    """
    Per-example Jacobians of the model outputs with respect to some of its parameters, with
    ``torch.func.vmap(torch.func.jacrev(...))`` over ``functional_call`` (exact for any model whose
    forward pass treats examples independently).

    :param model: The model.
    :param params: ``(name, parameter)`` pairs to differentiate (the others are held fixed).
    :param x: Inputs ``(n, ...)``.
    :param y: Labels passed to ``output_fn``, or ``None``.
    :param output_fn: Map ``(outputs, labels) -> (n, C)`` applied after the model; ``None`` keeps the outputs.
    :return: ``(n, C, P)`` with the parameters flattened and concatenated in the order given.
    """
    names = [name for name, _ in params]
    values = {name: p.detach() for name, p in params}

    def head(out: torch.Tensor, yi: torch.Tensor | None) -> torch.Tensor:
        return (out if output_fn is None else output_fn(out, yi)).reshape(-1)

    if y is None:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), None)

        args: tuple = (values, x)
        in_dims: tuple = (None, 0)
    else:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        args = (values, x, y)
        in_dims = (None, 0, 0)

    with torch.no_grad():
        jd = vmap(jacrev(single), in_dims=in_dims)(*args)
    n = x.shape[0]
    return torch.cat([jd[name].reshape(n, jd[name].shape[1], -1) for name in names], dim=2)


class JacobianGram:
    """
    Gram matrices of per-example Jacobians of ``g(x, y) = output_fn(model(x), y)`` with respect
    to the trainable parameters of ``model`` (the engine behind :func:`empirical_ntk` and the
    gradient-similarity influence).

    With ``output_fn=None`` the Gram matrix is the empirical NTK over the model outputs. With
    ``output_fn`` returning one per-example loss, it is the matrix of per-example loss-gradient
    dot products ``g_a · g_b`` used by TracIn.

    The model is used as is (no copy): it is evaluated in evaluation mode, forward hooks are
    registered only for the duration of a forward pass and removed in ``finally``, gradients are
    taken with :func:`torch.autograd.grad` (``.grad`` fields are never written), so the model's
    weights, flags and mode are left as they were. Memory is bounded as described in the module
    docstring (sub-batches, rank-one class factorisation, blocks).

    :param model: The model; computations run in its dtype and on its device.
    :param method: ``"auto"`` / ``"structured"`` (factorised ``nn.Linear`` layers plus a
        ``torch.func`` fallback for the other parameters) or ``"jacobian"`` (``torch.func`` for all).
    :param batch_size: Largest number of examples per forward pass and per kernel block.
    :param output_fn: Optional map ``(model outputs (n, C), labels (n,) or None) -> (n, C')``
        (or ``(n,)``) applied after the model; it must treat examples independently.
    :param chunk_mb: Memory budget in MiB of one chunk of Jacobian factors: the raw output
        gradients of one sub-batch, and the stored factors of one block (cached factors of the
        second argument may take twice this). Smaller values bound memory more tightly at the
        price of more passes; the result does not depend on it beyond rounding.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        method: str = "auto",
        batch_size: int = 256,
        output_fn: OutputFn | None = None,
        chunk_mb: float = DEFAULT_CHUNK_MB,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.method = _check_method(method)
        self.batch_size = check_batch_size(batch_size)
        self.output_fn = output_fn
        self.chunk_mb = check_chunk_mb(chunk_mb)
        self.device, self.dtype = model_device_dtype(model)
        if not trainable_parameters(model):
            raise ValueError("model has no trainable parameters (none with requires_grad=True)")
        self._layers: list[_LinearPlan] | None = None
        self._fallback: list[tuple[str, nn.Parameter]] = []
        self._exact_rest = None  # exact factor-based Jacobians of the fallback parameters (traced NTK)
        self._trace = False
        self._n_outputs: int = 0
        # rank-one class factorisation: per structured layer, whether it is still assumed
        # (sticky once a layer fails the check), and the class directions u (C, out) with the
        # mask of columns whose direction is set, both reset for every kernel computation
        self._rank_one: list[bool] = []
        self._directions: list[torch.Tensor | None] = []
        self._known: list[torch.Tensor | None] = []
        self._scratch: list[torch.Tensor | None] = []
        self._compress = False

    # ------------------------------------------------------------------ planning
    def _apply_output_fn(self, out: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        g = out if self.output_fn is None else self.output_fn(out, y)
        if g.dim() == 1:
            return g.unsqueeze(1)
        if g.dim() > 2:
            return g.flatten(1)
        return g

    def _linear_candidates(self) -> list[_LinearPlan]:
        return [
            _LinearPlan(name, module, w, b)
            for name, module, w, b in plain_layers(self.model, (nn.Linear,))
            if type(module).forward is nn.Linear.forward
        ]

    def _plan(self, x_probe: torch.Tensor, y_probe: torch.Tensor | None) -> None:
        """Decide which ``nn.Linear`` layers take the structured path (probe forward pass)."""
        if self._layers is not None:
            return
        candidates = [] if self.method == "jacobian" else self._linear_candidates()
        calls: list[list[bool]] = [[] for _ in candidates]

        def record(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            ok = (
                len(inputs) == 1
                and isinstance(inputs[0], torch.Tensor)
                and inputs[0].dim() == 2
                and isinstance(output, torch.Tensor)
                and output.dim() == 2
            )
            calls[k].append(ok)

        handles = [c.module.register_forward_hook(partial(record, k)) for k, c in enumerate(candidates)]
        try:
            with torch.no_grad():
                out = self.model(x_probe)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():
            self._n_outputs = int(self._apply_output_fn(out, y_probe).shape[1])
        layers = [c for k, c in enumerate(candidates) if calls[k] == [True]]
        covered = set()
        for c in layers:
            if c.weight:
                covered.add(id(c.module.weight))
            if c.bias:
                covered.add(id(c.module.bias))
        self._fallback = [(n, p) for n, p in trainable_parameters(self.model) if id(p) not in covered]
        self._layers = layers
        self._rank_one = [True] * len(layers)
        logger.debug(
            "eNTK plan: %d structured linear layer(s) %s, %d fallback parameter(s) %s",
            len(layers),
            [c.name for c in layers],
            len(self._fallback),
            [n for n, _ in self._fallback],
        )

    def factor_elements(self, x_probe: np.ndarray | torch.Tensor, compressed: bool = True) -> int:
        """
        Elements stored per example for the traced kernel (the size of its Jacobian factors): the
        cost of one kernel entry is about this many multiply-adds, and the memory of cached factors
        this many numbers per example.

        :param x_probe: A few inputs (to plan the layers).
        :param compressed: Count layers whose output gradients may factor over the classes at the
            compressed size (the likely cost); ``False`` gives the largest size the factors can
            take (for memory checks).
        :return: Elements per example.
        """
        x = to_tensor(x_probe[:2], self.device, self.dtype)
        with eval_mode(self.model):
            self._plan(x, None)
        self._start(True)
        try:
            return self._example_size(raw=not compressed)
        finally:
            self._directions, self._known, self._scratch = [], [], []
            self._compress = False

    def _start(self, trace: bool) -> None:
        """Reset the per-computation state (class directions) before a kernel computation."""
        self._compress = trace and self._n_outputs > 1
        self._trace = trace
        self._directions = [None] * len(self._layers)
        self._known = [None] * len(self._layers)
        self._scratch = [None] * len(self._layers)

    def _compressed(self, k: int) -> bool:
        return self._compress and self._rank_one[k]

    def _example_size(self, raw: bool) -> int:
        """
        Stored elements per example: of the raw factors of a forward/backward pass (``raw``) or
        of the (possibly compressed) factors kept for the contraction.
        """
        c = self._n_outputs
        size = 0
        for k, plan in enumerate(self._layers):
            out = plan.module.out_features
            size += out if (not raw and self._compressed(k)) else c * out
            size += plan.module.in_features if plan.weight else 0
        size += c * sum(p.numel() for _, p in self._fallback)
        return max(size, 1)

    def _budget_elements(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return max(1, int(self.chunk_mb * 2**20) // itemsize)

    def _block_rows(self) -> int:
        """Examples per kernel block: ``batch_size`` capped by the chunk budget."""
        return max(1, min(self.batch_size, self._budget_elements() // self._example_size(raw=False)))

    def _sub_batch_rows(self) -> int:
        """Examples per forward/backward pass: ``batch_size`` capped by the chunk budget."""
        return max(1, min(self.batch_size, self._budget_elements() // self._example_size(raw=True)))

    # ------------------------------------------------------------------ features
    def features(self, x: torch.Tensor, y: torch.Tensor | None = None) -> _Features:
        """
        Per-example Jacobian factors of one batch (call inside :meth:`gram`, which plans first),
        computed in sub-batches that fit the chunk budget.

        :param x: Batch of inputs on the model's device and dtype.
        :param y: Labels of the batch (passed to ``output_fn``), or ``None``.
        :return: The factors.
        """
        n = x.shape[0]
        step = self._sub_batch_rows()
        if n <= step:
            return self._sub_batch_features(x, y)
        out: _Features | None = None
        for i in range(0, n, step):
            part = self._sub_batch_features(x[i : i + step], None if y is None else y[i : i + step])
            if out is None:
                out = _allocate(part, n)
            _fill(out, part, i)
            del part
        return out

    def _sub_batch_features(self, x: torch.Tensor, y: torch.Tensor | None) -> _Features:
        """Factors of one sub-batch: one forward pass and ``C`` backward passes."""
        n = x.shape[0]
        acts: list[torch.Tensor | None] = []
        grads: list[torch.Tensor] = []
        if self._layers:
            captured: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self._layers)

            def hook(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
                captured[k] = (inputs[0].detach().clone(), output)
                # hand a copy downstream so that in-place ops after the layer cannot alter the
                # captured output tensor we differentiate against
                return output.clone()

            handles = [
                c.module.register_forward_hook(partial(hook, k), prepend=True)
                for k, c in enumerate(self._layers)
            ]
            try:
                with torch.enable_grad():
                    g = self._apply_output_fn(self.model(x), y)
            finally:
                for h in handles:
                    h.remove()
            if any(c is None for c in captured):
                raise RuntimeError(
                    "a linear layer seen in the planning pass was not called; use method='jacobian'"
                )
            outs = [c[1] for c in captured]
            n_out = g.shape[1]
            # raw output gradients, filled class by class: (n, C, out) per layer
            grads = [self._raw_buffer(k, n, n_out, o) for k, o in enumerate(outs)]
            for c in range(n_out):
                if g.requires_grad:
                    dc = torch.autograd.grad(g[:, c].sum(), outs, retain_graph=c < n_out - 1, allow_unused=True)
                else:
                    dc = (None,) * len(outs)
                for k, d in enumerate(dc):
                    if d is None:
                        grads[k][:, c].zero_()
                    else:
                        grads[k][:, c] = d
                del dc
            acts = [c[0] if plan.weight else None for c, plan in zip(captured, self._layers, strict=True)]
            del g, outs, captured
            for k in range(len(grads)):
                if self._compressed(k):
                    grads[k] = self._rank_one_factor(k, grads[k])

        jac = None
        if self._fallback:
            jac = self._fallback_jacobian(x, y)
        return _Features(n=n, acts=acts, grads=grads, jac=jac)

    def _raw_buffer(self, k: int, n: int, n_out: int, out: torch.Tensor) -> torch.Tensor:
        """
        Uninitialised ``(n, C, out)`` buffer for the raw output gradients of layer ``k``. For a
        rank-one layer the raw gradients are temporary, so one scratch buffer is reused across
        sub-batches (fresh large allocations cost page faults); full factors get their own.
        """
        shape = (n, n_out, out.shape[1])
        if not self._compressed(k):
            return torch.empty(shape, dtype=out.dtype, device=out.device)
        buf = self._scratch[k]
        if buf is None or buf.shape[0] < n or buf.shape[1:] != shape[1:]:
            buf = self._scratch[k] = None  # release before allocating
            buf = self._scratch[k] = torch.empty(shape, dtype=out.dtype, device=out.device)
        return buf[:n]

    def _rank_one_factor(self, k: int, d: torch.Tensor) -> torch.Tensor:
        """
        Rank-one factor ``g = δ·u`` (``(n, out)``) of raw output gradients ``d`` (``(n, C, out)``)
        of layer ``k``, after checking ``‖δ‖² − g² ≤ τ ‖δ‖²`` for every example and column.

        :raises _RankChange: If the check fails (the layer is then marked as not rank one).
        """
        n, n_out, width = d.shape
        sq = d[:, 0] * d[:, 0]
        for c in range(1, n_out):
            sq.addcmul_(d[:, c], d[:, c])
        if self._directions[k] is None:
            self._directions[k] = torch.zeros((n_out, width), dtype=d.dtype, device=d.device)
            self._known[k] = torch.zeros(width, dtype=torch.bool, device=d.device)
        u, known = self._directions[k], self._known[k]
        if not bool(known.all()):
            peak, row = sq.max(dim=0)
            cols = ((~known) & (peak > 0)).nonzero().squeeze(1)
            if cols.numel():
                vec = d[row[cols], :, cols]  # (len(cols), C): the largest gradient of each new column
                u[:, cols] = (vec / peak[cols].sqrt().unsqueeze(1)).T
                known[cols] = True
        g = d[:, 0] * u[0]
        for c in range(1, n_out):
            g.addcmul_(d[:, c], u[c])
        tol = 8.0 * (n_out + 2) * torch.finfo(d.dtype).eps
        # sq <- ‖δ‖² − g² − τ ‖δ‖², the orthogonal residual beyond the tolerance; non-finite
        # gradients also fail the check, so that they reach the kernel through the full factors
        sq.mul_(1.0 - tol).addcmul_(g, g, value=-1.0)
        if not bool((sq <= 0).all()):
            self._rank_one[k] = False
            raise _RankChange(self._layers[k].name)
        return g

    def _fallback_jacobian(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        if self.output_fn is None and self._trace and self.method != "jacobian":
            # traced NTK: exact Jacobians of convolutions and of modules' own parameters from their
            # factors (an unprojected ProjectedNTK), whole-model torch.func only for the rest
            if self._exact_rest is None:
                from art_malleability.ntk.projection import ProjectedNTK

                params = [p for _, p in self._fallback]
                self._exact_rest = ProjectedNTK(
                    self.model, 2**31 - 1, batch_size=self.batch_size, chunk_mb=self.chunk_mb, parameters=params
                ).plan(x)
            return self._exact_rest._features(x).unsqueeze(1)
        return per_example_jacobian(self.model, self._fallback, x, y, self._apply_output_fn)

    # ------------------------------------------------------------------ contraction
    def contract(self, f1: _Features, f2: _Features, trace: bool = True) -> torch.Tensor:
        """
        Gram block between two batches of features.

        :param f1: Features of the first batch (``n1`` examples).
        :param f2: Features of the second batch (``n2`` examples).
        :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
        :return: The block.
        """
        c = self._n_outputs
        shape = (f1.n, f2.n) if trace else (f1.n, f2.n, c, c)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for plan, a1, d1, a2, d2 in zip(self._layers, f1.acts, f1.grads, f2.acts, f2.grads, strict=True):
            if trace:
                # full (n, C, out) factors or rank-one (n, out) factors: the same product
                s = d1.reshape(f1.n, -1) @ d2.reshape(f2.n, -1).T
            else:
                s = torch.einsum("acn,bdn->abcd", d1, d2)
            if plan.weight:
                gram_a = a1 @ a2.T
                if plan.bias:
                    gram_a += 1.0
                k += s * (gram_a if trace else gram_a[:, :, None, None])
            else:
                k += s
            del s
        if f1.jac is not None:
            if trace:
                k += f1.jac.reshape(f1.n, -1) @ f2.jac.reshape(f2.n, -1).T
            else:
                k += torch.einsum("acp,bdp->abcd", f1.jac, f2.jac)
        return k

    # ------------------------------------------------------------------ full matrix
    def gram(
        self,
        x1: np.ndarray | torch.Tensor,
        x2: np.ndarray | torch.Tensor | None = None,
        y1: np.ndarray | torch.Tensor | None = None,
        y2: np.ndarray | torch.Tensor | None = None,
        *,
        trace: bool = True,
    ) -> torch.Tensor:
        """
        Gram matrix between the per-example Jacobians of ``x1`` and ``x2``, computed block by
        block (see the module docstring for the chunking).

        :param x1: First inputs, shape ``(n1, *input_shape)``.
        :param x2: Second inputs, shape ``(n2, *input_shape)``; ``None`` means ``x1`` (only the
            upper block triangle is computed and mirrored).
        :param y1: Labels for ``x1`` (only used by ``output_fn``).
        :param y2: Labels for ``x2``; ignored when ``x2`` is ``None``.
        :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
        :return: The Gram matrix on the model's device, in the model's dtype.
        """
        x1 = to_tensor(x1, self.device, self.dtype)
        y1 = None if y1 is None else to_tensor(y1, self.device, torch.long)
        sym = x2 is None
        if sym:
            x2, y2 = x1, y1
        else:
            x2 = to_tensor(x2, self.device, self.dtype)
            y2 = None if y2 is None else to_tensor(y2, self.device, torch.long)
        n1, n2 = x1.shape[0], x2.shape[0]
        if n1 == 0 or n2 == 0:
            raise ValueError(f"empty input: x1 has {n1} and x2 has {n2} examples")

        with eval_mode(self.model), no_tf32(self.device):
            self._plan(x1[:2], None if y1 is None else y1[:2])
            try:
                while True:
                    self._start(trace)
                    try:
                        return self._gram(x1, x2, y1, y2, sym, trace)
                    except _RankChange as change:
                        logger.debug("eNTK: layer %s is not rank one over the classes; recomputing", change)
            finally:
                self._directions, self._known, self._scratch = [], [], []
                self._compress = False

    def _gram(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        y1: torch.Tensor | None,
        y2: torch.Tensor | None,
        sym: bool,
        trace: bool,
    ) -> torch.Tensor:
        n1, n2 = x1.shape[0], x2.shape[0]
        c = self._n_outputs
        bs = self._block_rows()
        shape = (n1, n2) if trace else (n1, n2, c, c)
        kernel = torch.empty(shape, dtype=self.dtype, device=self.device)
        use_cache = n2 * self._example_size(raw=False) <= 2 * self._budget_elements()
        cache: dict[int, _Features] = {}

        def second(j: int) -> _Features:
            if j in cache:
                return cache[j]
            f = self.features(x2[j : j + bs], None if y2 is None else y2[j : j + bs])
            if use_cache:
                cache[j] = f
            return f

        for i in range(0, n1, bs):
            if sym:
                f1 = second(i)
            else:
                f1 = self.features(x1[i : i + bs], None if y1 is None else y1[i : i + bs])
            for j in range(i if sym else 0, n2, bs):
                f2 = f1 if (sym and j == i) else second(j)
                block = self.contract(f1, f2, trace=trace)
                if sym and j == i:
                    block = 0.5 * (block + (block.T if trace else block.permute(1, 0, 3, 2)))
                kernel[i : i + f1.n, j : j + f2.n] = block
                if sym and j > i:
                    kernel[j : j + f2.n, i : i + f1.n] = block.T if trace else block.permute(1, 0, 3, 2)
                del f2, block
            del f1
        return kernel


class KeptFactors:
    """
    The Jacobian factors of a fixed set of examples (a training set), kept between traced-kernel
    computations, so that kernel rows of new examples against the set cost the new examples'
    factors and the contractions only. Some rows of the set can be swapped for new inputs
    (:meth:`set_changed`) without recomputing the others.

    The rank-one class directions (see the module docstring) of the kept factors are carried from
    call to call; if a later example shows that a layer is not rank one after all, every kept
    factor is computed again in the full representation.

    :param engine: The engine (traced kernel, no ``output_fn``).
    :param x: The examples to keep, ``(n, *input_shape)``.
    """

    def __init__(self, engine: JacobianGram, x: np.ndarray | torch.Tensor) -> None:
        self.engine = engine
        self.x = to_tensor(x, engine.device, engine.dtype)
        self._changed = np.zeros(0, dtype=np.int64)
        self._x_changed = self.x[:0]
        self._build()

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def nbytes(self) -> int:
        """Memory of the kept factors."""
        sizes = [t for b in self._blocks + self._changed_blocks for t in [*b.acts, *b.grads, b.jac] if t is not None]
        return sum(t.numel() * t.element_size() for t in sizes)

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        engine = self.engine
        with eval_mode(engine.model), no_tf32(engine.device):
            engine._directions, engine._known, engine._scratch = self._state
            engine._compress, engine._trace = engine._n_outputs > 1, True
            try:
                yield
            finally:
                self._state = (engine._directions, engine._known, [None] * len(engine._layers))
                engine._directions, engine._known, engine._scratch = [], [], []
                engine._compress = False

    def _blocks_of(self, x: torch.Tensor) -> list[_Features]:
        bs = self.engine._block_rows()
        return [self.engine.features(x[i : i + bs]) for i in range(0, x.shape[0], bs)]

    def _build(self) -> None:
        engine = self.engine
        self._last = None
        with eval_mode(engine.model):
            engine._plan(self.x[:2], None)
        while True:
            engine._start(True)
            self._state = (engine._directions, engine._known, engine._scratch)
            try:
                with self._session():
                    self._blocks = self._blocks_of(self.x)
                    self._changed_blocks = self._blocks_of(self._x_changed) if len(self._changed) else []
                return
            except _RankChange as change:
                logger.debug("eNTK: layer %s is not rank one over the classes; recomputing", change)

    def _retrying(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        while True:
            try:
                with self._session():
                    return compute()
            except _RankChange as change:
                logger.debug("eNTK: layer %s is not rank one over the classes; recomputing kept factors", change)
                self._build()

    def _contract_all(self, f: list[_Features], blocks: list[_Features], n: int) -> torch.Tensor:
        rows = sum(b.n for b in f)
        out = torch.empty((rows, n), dtype=self.engine.dtype, device=self.engine.device)
        i = 0
        for a in f:
            j = 0
            for b in blocks:
                out[i : i + a.n, j : j + b.n] = self.engine.contract(a, b)
                j += b.n
            i += a.n
        return out

    def gram(self) -> torch.Tensor:
        """:return: The ``n × n`` traced kernel of the kept examples (with the changed rows swapped in)."""

        def compute() -> torch.Tensor:
            kernel = torch.empty((self.n, self.n), dtype=self.engine.dtype, device=self.engine.device)
            starts = np.cumsum([0] + [b.n for b in self._blocks])
            for bi, a in enumerate(self._blocks):
                for bj in range(bi, len(self._blocks)):
                    b = self._blocks[bj]
                    block = self.engine.contract(a, b)
                    if bi == bj:
                        block = 0.5 * (block + block.T)
                    kernel[starts[bi] : starts[bi] + a.n, starts[bj] : starts[bj] + b.n] = block
                    kernel[starts[bj] : starts[bj] + b.n, starts[bi] : starts[bi] + a.n] = block.T
            if len(self._changed):
                rows = self._swap_columns(self._contract_all(self._changed_blocks, self._blocks, self.n))
                idx = torch.as_tensor(self._changed, device=kernel.device)
                kernel[idx] = rows
                kernel[:, idx] = rows.T
            return kernel

        return self._retrying(compute)

    def _swap_columns(self, rows: torch.Tensor, f: list[_Features] | None = None) -> torch.Tensor:
        if len(self._changed):
            f = self._changed_blocks if f is None else f
            rows[:, torch.as_tensor(self._changed, device=rows.device)] = self._contract_all(
                f, self._changed_blocks, len(self._changed)
            )
        return rows

    def rows(self, x_new: np.ndarray | torch.Tensor) -> torch.Tensor:
        """
        :param x_new: Inputs ``(m, *input_shape)``.
        :return: ``(m, n)`` traced kernel between ``x_new`` and the kept examples (changed rows swapped in).
        """
        x_new = to_tensor(x_new, self.engine.device, self.engine.dtype)
        key = tensor_digest(x_new)

        def compute() -> torch.Tensor:
            # the factors of the last inputs are kept too: an audit asks for the same queries again
            if self._last is None or self._last[0] != key:
                self._last = None
                self._last = (key, self._blocks_of(x_new))
            f = self._last[1]
            return self._swap_columns(self._contract_all(f, self._blocks, self.n), f)

        return self._retrying(compute)

    def changed_rows(self) -> torch.Tensor:
        """:return: ``(m, n)`` kernel rows of the swapped-in examples against the kept set (their factors reused)."""
        return self._retrying(
            lambda: self._swap_columns(self._contract_all(self._changed_blocks, self._blocks, self.n))
        )

    def set_changed(self, changed: np.ndarray, x_changed: np.ndarray | torch.Tensor) -> None:
        """
        Swap the kept examples ``changed`` for ``x_changed`` in later results (rows not listed are
        back to the examples given at construction).

        :param changed: Indices into the kept examples (distinct).
        :param x_changed: Their new inputs.
        """
        self._changed = np.asarray(changed, dtype=np.int64)
        self._x_changed = to_tensor(x_changed, self.engine.device, self.engine.dtype)

        def compute() -> torch.Tensor:
            self._changed_blocks = self._blocks_of(self._x_changed) if len(self._changed) else []
            return self._x_changed

        self._retrying(compute)


def empirical_ntk(
    model: nn.Module,
    x1: np.ndarray | torch.Tensor,
    x2: np.ndarray | torch.Tensor | None = None,
    *,
    method: str = "auto",
    batch_size: int = 256,
    trace: bool = True,
    chunk_mb: float = DEFAULT_CHUNK_MB,
) -> torch.Tensor:
    """
    Empirical NTK of ``model`` between ``x1`` and ``x2``, over its trainable parameters.

    ``K[a, b] = Σ_c Σ_θ ∂f_c(x1_a)/∂θ · ∂f_c(x2_b)/∂θ`` (traced over the outputs/logits ``c``,
    the package-wide convention); with ``trace=False``, ``K[a, b, c, d] = Σ_θ ∂f_c(x1_a)/∂θ ·
    ∂f_d(x2_b)/∂θ``. Computed in the model's dtype and on its device (inputs are converted); the
    model is not copied and not modified (its mode is switched to evaluation for the duration and
    restored).

    Memory stays bounded whatever the width and the number of examples: work is streamed in
    sub-batches and blocks that fit ``chunk_mb``, and layers whose output gradients factor over
    the classes (e.g. the hidden layer of the reference models) are stored and contracted in
    factored form (see the module docstring). At ``n = 1,000``, width ``65,536`` and ``C = 10``
    in float64 the default budget keeps the peak near the model size plus about 1 GB, where
    holding all output gradients would take 5 GB.

    :param model: A PyTorch model mapping ``(n, *input_shape)`` to outputs ``(n, C)``.
    :param x1: Inputs, shape ``(n1, *input_shape)`` (numpy array or tensor).
    :param x2: Inputs, shape ``(n2, *input_shape)``; ``None`` means ``x1`` (symmetric kernel).
    :param method: ``"auto"`` or ``"structured"`` (factorised ``nn.Linear`` layers with a
        ``torch.func`` fallback for the rest) or ``"jacobian"`` (``torch.func`` Jacobian
        contraction for every parameter; slow, the reference).
    :param batch_size: Largest number of examples per forward pass and per kernel block.
    :param trace: Sum over outputs (default) or return the full output block.
    :param chunk_mb: Memory budget in MiB of one chunk of Jacobian factors (default 256); smaller
        values bound memory more tightly at the price of more passes.
    :return: Tensor of shape ``(n1, n2)`` (``trace=True``) or ``(n1, n2, C, C)``.
    :raises ValueError: On an unknown ``method``, a non-positive ``batch_size`` or ``chunk_mb``,
        empty inputs or a model without trainable parameters.
    """
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be a bool, got {trace!r}")
    engine = JacobianGram(model, method=method, batch_size=batch_size, chunk_mb=chunk_mb)
    return engine.gram(x1, x2, trace=trace)
