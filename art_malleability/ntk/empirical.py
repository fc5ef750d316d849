"""
Empirical neural tangent kernel (eNTK) of a PyTorch model.

The empirical NTK of a model ``f`` with trainable parameters ``θ`` is

    K[a, b] = Σ_c Σ_θ ∂f_c(x1_a)/∂θ · ∂f_c(x2_b)/∂θ        (``trace=True``, the default)

i.e. the Gram matrix of per-example Jacobians, traced over the model outputs (logits). With
``trace=False`` the full block ``K[a, b, c, d] = Σ_θ ∂f_c(x1_a)/∂θ · ∂f_d(x2_b)/∂θ`` is returned.
Only parameters with ``requires_grad=True`` count.

Any model: the layer registry
-----------------------------
The Jacobian factors come from the layer registry (:mod:`art_malleability.ntk.layers`), which the projection
(:mod:`art_malleability.ntk.projection`) shares. One probe forward pass plans the model: every module a kind of the
registry knows becomes a *site* (linear layers on inputs of any rank, convolutions in 1-3 dimensions with any
grouping, padding, stride and dilation, embeddings, batch norms in evaluation mode, layer / group / RMS norms,
multi-head attention, LSTM / GRU / RNN layers); a module no kind knows, with parameters of its own, takes the batched
path of its own parameters (a module-local vector-Jacobian product, ``vmap``-ped over examples and classes); the
uses of every trained parameter are tracked, and a parameter used outside the calls of the sites that cover it
(class tokens, position embeddings, layer scales, a weight used outside its module) is a *fallback* parameter.
Then every sub-batch takes one class-batched pass (:func:`~art_malleability.ntk.layers.passes.probed_pass`): a zero
probe at each site's outputs, one forward pass and one reverse pass batched over the ``C`` outputs
(``torch.func.jacrev``), whose derivatives with respect to the probes are the sites' per-example output gradients
``δ_c``; with fallback parameters the pass runs under ``vmap`` over the examples and also gives their per-example
Jacobians. No per-example or per-class loop, no host synchronisation.

Each Kronecker block (a weight and its bias whose per-example Jacobian is ``Σ_l Δ_{l,c} ⊗ a_l`` over positions ``l``)
takes one of two forms, chosen per block by counted multiply-adds per pair of examples
(:func:`~art_malleability.ntk._passes.prefers_structured`, ``L²·(d + C·o + 1) < C·o·d``): *structured*, its input
sides ``A`` and output gradients ``Δ`` kept and contracted as ``Σ_{l,l'} (A1 A2ᵀ) ⊙ (Δ1 Δ2ᵀ)`` (every ``nn.Linear``
on 2-D inputs, convolutions on small maps), or *explicit*, its per-example gradients formed by one batched product
(long sequences, large maps, grouped convolutions, tied weights). Every explicit gradient (those blocks', the
normalisation layers', the module sites', the fallback's) is joined in one matrix, contracted by one product per block
pair.

Methods
-------
- ``"batched"``: the factors above, as they come from the pass; nothing is read back to the host.
- ``"structured"``: the same, and the structured blocks with one position whose output gradients factor over the
  classes (``δ_c(x)_j = g_j(x) u_{jc}``: the last hidden layer of an MLP, the reference models' hidden layer, an
  output layer) are stored and contracted in that rank-one form (``C`` times fewer numbers and operations), checked
  for every example on the host (see *Class factorisation* below).
- ``"jacobian"``: per-example Jacobians of every trainable parameter with ``torch.func.vmap(torch.func.jacrev(...))``
  over ``functional_call`` (with the registry's written-out forwards where ``vmap`` cannot run a module's own),
  contracted as ``Σ_c J1_c J2_cᵀ``. Exact for any model; the reference.
- ``"auto"`` (default): the method with the least estimated time for the kernel at hand, from counted work
  (:mod:`art_malleability.ntk.cost`): on one probe sub-batch, the operations, the numbers written and the operator
  calls of the pass, the rank-one check's, and from the factors' shapes the contraction's operations per pair of
  examples, at the device's nominal rate and fixed per-call and per-synchronisation overheads. Nothing is timed, so
  the same call always runs the same method; the choice, each method's counts and estimate are in :attr:`choice`.

All assume that examples are independent in the forward pass (true in evaluation mode; the
model is put in evaluation mode while the kernel is computed and its flags are restored after).

Streaming and memory
--------------------
The per-class output gradients of a layer of width ``m`` take ``C·m`` numbers per example
(``n × C × m`` in all: 5 GB in float64 for ``n = 1,000``, ``C = 10``, ``m = 65,536``), so they
are never held for all examples at once. A backward pass always yields the whole width of a
layer's output gradient, so the work is chunked over *examples*, with chunk sizes derived from
the widths and a memory budget ``chunk_mb``:

- **Sub-batches.** Passes run on sub-batches of at most ``batch_size`` examples whose numbers (every probe's output
  gradients ``C`` times over, what the sites keep of their inputs, the factors formed from them, the explicit
  gradients twice, the forward pass's intermediates and twice its largest tensor ``C`` times over) fit ``chunk_mb``
  MiB; on a device other than CUDA at most ``CPU_PASS_MB`` (64 MiB: larger passes run no faster there), but at least
  ``MIN_PASS_ROWS`` examples where the chunk holds them (a large model's pass pays its operators' fixed overhead).
- **Class factorisation (rank one).** For ``trace=True``, ``C > 1`` and ``"structured"``, a block whose output
  gradients factor over the classes is stored and contracted as ``G1 G2ᵀ``. Every example is checked to float
  precision; a block that fails the check anywhere takes the full ``(C × o)`` form for good and the kernel is
  recomputed (``"auto"``'s probe finds most such blocks before the kernel starts).
- **Blocks.** The kernel is assembled from blocks of at most ``batch_size`` examples whose
  stored factors fit in ``chunk_mb`` MiB; the factors of ``x2`` are computed once and kept when
  they fit in ``2 × chunk_mb`` MiB with one block of ``x1``. Otherwise the blocks of ``x1`` are
  taken in panels that fit ``2 × chunk_mb`` MiB with one block of ``x2``, and the factors of
  ``x2`` are computed once per panel (a memory for time trade: ``n1 + ⌈n1 / panel⌉ n2``
  examples' factors instead of ``n1 + ⌈n1 / block⌉ n2``). With ``x2=None`` only the upper
  block triangle is computed and mirrored. A structured block's ``(n1·L) × (n2·L)`` products are formed for as many
  rows at a time as fit one chunk.
- **The budget from the device.** On the CPU one chunk is ``chunk_mb``. On a CUDA device it is the larger of
  ``chunk_mb`` and an eighth (:data:`~art_malleability.ntk._memory.DEVICE_CHUNK_SHARE`) of the memory available when
  the computation starts (``torch.cuda.mem_get_info``'s free memory plus what the caching allocator holds unused),
  read once before any work is queued.

Peak memory is thus about the model, plus one chunk of raw gradients and the autograd graph
of one sub-batch, plus at most ``2 × chunk_mb`` for kept factors (or a panel) with the block
beside them, plus the ``n1 × n2`` result, whatever the number of examples and the width (default ``chunk_mb = 256``).
Results do not depend on the chunking beyond rounding.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from art_malleability._utils.params import one_of
from art_malleability._utils.torch_utils import eval_mode, no_tf32, to_tensor
from art_malleability.ntk._autograd import (
    OutputFn,
    check_model,
    per_example_jacobian,
)
from art_malleability.ntk._checks import check_batch_size, check_chunk_mb
from art_malleability.ntk._memory import (
    DEFAULT_CHUNK_MB,
    MIN_PASS_ROWS,
    Features,
    budget_elements,
    device_chunk_mb,
    in_sub_batches,
    pass_chunk_mb,
    place_block,
    rows_per_pass,
)
from art_malleability.ntk._passes import FeaturePasses
from art_malleability.ntk._rank_one import ClassDirections, RankChange
from art_malleability.ntk._structured import contract
from art_malleability.ntk.cost import MethodChoice, MethodCost
from art_malleability.ntk.layers.base import Block
from art_malleability.ntk.layers.plan import Plan

__all__ = [
    "DEFAULT_CHUNK_MB",
    "METHOD",
    "NTK_METHODS",
    "JacobianGram",
    "OutputFn",
    "check_batch_size",
    "check_chunk_mb",
    "empirical_ntk",
    "per_example_jacobian",
]

logger = logging.getLogger(__name__)

NTK_METHODS = ("auto", "structured", "batched", "jacobian")
#: The rule of a kernel engine's ``method`` (the gradient and NTK influences' too): one of :data:`NTK_METHODS`.
METHOD = one_of(NTK_METHODS)


def _check_method(method: str) -> str:
    return METHOD(method, "method")


class JacobianGram(FeaturePasses):
    """
    Gram matrices of per-example Jacobians of ``g(x, y) = output_fn(model(x), y)`` with respect
    to the trainable parameters of ``model`` (the engine behind :func:`empirical_ntk` and the
    gradient-similarity influence).

    With ``output_fn=None`` the Gram matrix is the empirical NTK over the model outputs. With
    ``output_fn`` returning one per-example loss, it is the matrix of per-example loss-gradient
    dot products ``g_a · g_b`` used by TracIn.

    The model is used as is (no copy): it is evaluated in evaluation mode, forward hooks (and, for the layers whose
    forward the registry writes out, an instance ``forward``) live only for the duration of a pass and are removed in
    ``finally``, gradients are taken with ``torch.func`` transforms (``.grad`` fields are never written), so the
    model's weights, flags and mode are left as they were. Memory is bounded as described in the module docstring
    (sub-batches, rank-one class factorisation, blocks).

    :param model: The model; computations run in its dtype and on its device.
    :param method: ``"auto"`` (by counted work), ``"structured"`` (the registry's factors, rank one over the classes
        where they are), ``"batched"`` (the same factors, nothing read back to the host) or ``"jacobian"``
        (``torch.func`` for all, the reference); see the module docstring.
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
        self.device, self.dtype = check_model(model)
        self.model = model
        self.method = _check_method(method)
        self._path: str | None = None if method == "auto" else method  # the method that runs (None: not chosen yet)
        #: What ``method="auto"`` chose and why (:class:`~art_malleability.ntk.cost.MethodChoice`), once chosen.
        self.choice: MethodChoice | None = None
        self.batch_size = check_batch_size(batch_size)
        self.output_fn = output_fn
        self.chunk_mb = check_chunk_mb(chunk_mb)
        self._layer_plan: Plan | None = None  # the layer registry's plan of the model
        self._structured: list[Block] = []  # the blocks in the structured form, in the factors' order
        self._explicit: list[nn.Parameter] = []  # the explicit gradients' parameters, in the factors' order
        self._jacobian_params: list[tuple[str, nn.Parameter]] = []  # "jacobian": every used trained parameter
        self._n_outputs: int = 0
        # rank-one class factorisation: per structured block, whether it is still assumed (sticky once a block fails
        # the check), and the class directions, reset for every kernel computation
        self._rank_one: list[bool] = []
        self._classes = ClassDirections.fresh(0)
        self._compress = False
        self._zeros: dict[tuple[int, ...], torch.Tensor] = {}  # zero probes, by shape
        self._forward_size = (0, 0)  # numbers one example's forward pass creates: in all, the largest tensor
        self._budget_mb = self.chunk_mb  # the chunk budget of the current computation (from the device)
        self._clone_inputs = False  # copy the sites' inputs (sticky once the model changed one in place)
        # the first sub-batch's factors that "auto" counted its work on, until they are used: (inputs, labels, factors,
        # the class directions of compressed factors or None)
        self._first: tuple[torch.Tensor, torch.Tensor | None, Features, ClassDirections | None] | None = None

    # ------------------------------------------------------------------ planning
    def _apply_output_fn(self, out: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        g = out if self.output_fn is None else self.output_fn(out, y)
        if g.dim() == 1:
            return g.unsqueeze(1)
        if g.dim() > 2:
            return g.flatten(1)
        return g

    def method_cost(self, x_probe: np.ndarray | torch.Tensor, n1: int | None = None, n2: int | None = None,
                    y_probe: np.ndarray | torch.Tensor | None = None) -> tuple[MethodCost, int]:
        """
        The counted work of the method that runs (:class:`~art_malleability.ntk.cost.MethodCost`; for a method that
        was given, counted now on the probe) and the examples of its passes, for the time estimates of the
        influences that use this engine.

        :param x_probe: A few inputs.
        :param n1: Rows of the kernel to plan for (``"auto"``'s choice; ``None``: ``batch_size``).
        :param n2: Its columns (``None``: symmetric).
        :param y_probe: The probe's labels (for ``output_fn``).
        :return: The cost and the rows of a pass.
        """
        self.prepare(x_probe, n1, n2, y_probe)
        if self.choice is not None:
            cost = self.choice.costs[self._path]
        else:
            x = to_tensor(x_probe[:2], self.device, self.dtype)
            y = None if y_probe is None else to_tensor(y_probe[:2], self.device, torch.long)
            with eval_mode(self.model), no_tf32(self.device):
                blocks = list(self._rank_one_blocks)
                cost = self._count(x, y)[0][self._path]
                self._rank_one_blocks = blocks  # a method that was given keeps its own rank-one trials
                self._take_path(self.method)
        self._start(True)
        try:
            return cost, self._sub_batch_rows()
        finally:
            self._finish()

    def describe_method(self) -> dict | None:
        """
        :return: The method that ran and why (``None`` before any computation): under ``"auto"`` the choice with each
            candidate's counted work and estimated seconds (:class:`~art_malleability.ntk.cost.MethodChoice`).
        """
        if self._path is None:
            return None
        if self.choice is None:
            return {"method": self._path, "reason": f"method={self.method!r} was given"}
        return self.choice.to_dict()

    @property
    def path(self) -> str | None:
        """The method that runs (``None`` until ``"auto"`` has chosen: at the first computation or plan)."""
        return self._path

    def prepare(self, x_probe: np.ndarray | torch.Tensor, n1: int | None = None, n2: int | None = None,
                y_probe: np.ndarray | torch.Tensor | None = None) -> JacobianGram:
        """
        Plan the model on a few inputs and, under ``"auto"``, choose the method by counted work
        (:mod:`~art_malleability.ntk.cost`) for a traced kernel of ``n1 × n2`` examples (``n2=None``: symmetric);
        without sizes, for a symmetric kernel of ``batch_size`` examples. Called by the computations themselves; the
        choice is made once and kept.

        :param x_probe: A few inputs (two are used).
        :param n1: Rows of the kernel the choice is for.
        :param n2: Columns (``None``: a symmetric kernel of ``n1``).
        :param y_probe: Their labels (for ``output_fn``).
        :return: ``self``.
        """
        x = to_tensor(x_probe[:2], self.device, self.dtype)
        y = None if y_probe is None else to_tensor(y_probe[:2], self.device, torch.long)
        with eval_mode(self.model), no_tf32(self.device):
            self._plan(x, y)
            if self._path is None:
                # the work is counted on the computation's own first sub-batch, whose factors are then kept for it
                self._take_path("batched")
                self._start(True)
                rows = self._sub_batch_rows()
                self._finish()
                first = self._rows_of(x_probe, rows, self.dtype)
                labels = None if y_probe is None else self._rows_of(y_probe, rows, torch.long)
                self._choose(first, labels, self.batch_size if n1 is None else int(n1), n2)
        return self

    def _rows_of(self, a: np.ndarray | torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The first ``rows`` of ``a`` on the engine's device in ``dtype``: a view of a tensor that already is (so that
        a computation's own first sub-batch is recognised), else a copy."""
        if isinstance(a, torch.Tensor) and a.device == self.device and a.dtype == dtype:
            return a.detach()[:rows]
        return to_tensor(a[:rows], self.device, dtype)

    def factor_elements(self, x_probe: np.ndarray | torch.Tensor, compressed: bool = True, n: int | None = None) -> int:
        """
        Elements stored per example for the traced kernel (the size of its Jacobian factors): the
        cost of one kernel entry is about this many multiply-adds, and the memory of cached factors
        this many numbers per example.

        :param x_probe: A few inputs (to plan the layers).
        :param compressed: Count layers whose output gradients may factor over the classes at the
            compressed size (the likely cost); ``False`` gives the largest size the factors can
            take (for memory checks).
        :param n: The examples of the kernel to plan for (the choice of ``"auto"``; ``None``: ``batch_size``).
        :return: Elements per example.
        """
        self.prepare(x_probe, n)
        self._start(True)
        try:
            return self._example_size(raw=not compressed)
        finally:
            self._finish()

    def _start(self, trace: bool, classes: ClassDirections | None = None) -> None:
        """
        Set the per-computation state before a kernel computation: fresh class directions, or ``classes`` kept
        from an earlier computation (:class:`~art_malleability.ntk.kept.KeptFactors`).
        """
        # only "structured" compresses: the rank-one check needs the host to read its outcome
        self._compress = trace and self._n_outputs > 1 and self._path == "structured"
        first = self._first
        if classes is None and self._compress and first is not None and first[3] is not None:
            classes = first[3]  # the first sub-batch's factors were compressed with these directions: kept for all
        self._classes = ClassDirections.fresh(len(self._structured)) if classes is None else classes
        self._budget_mb = device_chunk_mb(self.device, self.chunk_mb)

    def _finish(self) -> None:
        """Release the per-computation state after a kernel computation."""
        self._classes = ClassDirections.fresh(0)
        self._compress = False
        self._zeros = {}
        self._budget_mb = self.chunk_mb

    def _compressed(self, k: int) -> bool:
        return self._compress and self._rank_one[k]

    def _example_size(self, raw: bool) -> int:
        """
        Numbers of one example's factors kept for the contraction: the structured blocks' input sides and output
        gradients (compressed where they are rank one, unless ``raw``) and the explicit gradients.
        """
        c = self._n_outputs
        size = c * self._explicit_numel()
        for k, b in enumerate(self._structured):
            classes = 1 if (not raw and self._compressed(k)) else c
            size += b.positions * (b.d_in + classes * b.d_out)
        return max(size, 1)

    def _pass_size(self) -> int:
        """
        Numbers of one example's pass beside the forward pass's intermediates: every probe's output gradients ``C``
        times over, what the sites keep of their inputs, the stored factors formed from them, and the explicit
        gradients once more (their parts before they are joined); for ``"jacobian"`` its per-example Jacobian twice.
        """
        if self._path == "jacobian":
            return 2 * self._example_size(raw=True)
        c = self._n_outputs
        size = sum(c * s.probe_numel() + s.kept_numel() for s in self._layer_plan.sites)
        return size + self._example_size(raw=True) + c * self._explicit_numel()

    def _pass_intermediates(self) -> int:
        """Numbers per example of a pass beside its factors: the forward pass's intermediate tensors and the largest
        cotangent in flight, ``C`` times over (twice)."""
        total, largest = self._forward_size
        return total + 2 * self._n_outputs * largest

    def _block_rows(self) -> int:
        """Examples per kernel block: ``batch_size`` capped by the chunk budget."""
        return rows_per_pass(self.batch_size, self._budget_mb, self.dtype, self._example_size(raw=False))

    def _kept_rows(self) -> int:
        """Examples whose stored factors fit twice the chunk budget: kept factors or a panel, with one more block."""
        return 2 * budget_elements(self._budget_mb, self.dtype) // self._example_size(raw=False)

    def panel_rows(self) -> int:
        """
        Examples whose factors one kernel computation keeps at once when it cannot keep them all: the panel of
        ``x1``'s blocks that the blocks of ``x2`` stream past (call after planning, e.g. :meth:`factor_elements`;
        outside a computation the factors count uncompressed, so the panel is the smallest it can be).
        """
        bs = self._block_rows()
        return max(bs, (self._kept_rows() - bs) // bs * bs)

    def _sub_batch_rows(self) -> int:
        """Examples per forward/backward pass: ``batch_size`` capped by the pass budget (:func:`pass_chunk_mb`), and
        at least :data:`~art_malleability.ntk._memory.MIN_PASS_ROWS` where the chunk budget holds them (a large
        model's pass would otherwise pay its operators' fixed overhead for one or two examples)."""
        size = self._pass_size() + self._pass_intermediates()
        rows = rows_per_pass(self.batch_size, pass_chunk_mb(self.device, self._budget_mb), self.dtype, size)
        whole = rows_per_pass(self.batch_size, self._budget_mb, self.dtype, size)
        return max(rows, min(MIN_PASS_ROWS, whole))

    # ------------------------------------------------------------------ features
    def features(self, x: torch.Tensor, y: torch.Tensor | None = None) -> Features:
        """
        Per-example Jacobian factors of one batch (call inside :meth:`gram`, which plans first),
        computed in sub-batches that fit the chunk budget.

        :param x: Batch of inputs on the model's device and dtype.
        :param y: Labels of the batch (passed to ``output_fn``), or ``None``.
        :return: The factors.
        """
        return in_sub_batches(self._sub_batch_features, x, y, self._sub_batch_rows())

    # ------------------------------------------------------------------ contraction
    def contract(self, f1: Features, f2: Features, trace: bool = True) -> torch.Tensor:
        """
        Gram block between two batches of features.

        :param f1: Features of the first batch (``n1`` examples).
        :param f2: Features of the second batch (``n2`` examples).
        :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
        :return: The block.
        """
        return contract(
            self._structured,
            f1,
            f2,
            self._n_outputs,
            trace,
            self.dtype,
            self.device,
            chunk_elements=budget_elements(self._budget_mb, self.dtype),
        )

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
            raise ValueError(f"x1 and x2 must hold at least one example each, got {n1} and {n2}")

        self.prepare(x1, n1, None if sym else n2, y1)
        with eval_mode(self.model), no_tf32(self.device):
            try:
                while True:
                    self._start(trace)
                    try:
                        return self._gram(x1, x2, y1, y2, sym, trace)
                    except RankChange as change:
                        logger.debug("eNTK: layer %s is not rank one over the classes; recomputing", change)
            finally:
                self._first = None
                self._finish()

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
        if n2 + (0 if sym else bs) <= self._kept_rows():  # x2's factors kept whole: each example's computed once
            cache: dict[int, Features] = {}
            for i in range(0, n1, bs):
                f1 = self._block(x2 if sym else x1, y2 if sym else y1, i, bs, cache if sym else None)
                for j in range(i if sym else 0, n2, bs):
                    f2 = f1 if (sym and j == i) else self._block(x2, y2, j, bs, cache)
                    place_block(kernel, self.contract(f1, f2, trace=trace), i, j, sym)
                del f1, f2  # before the next block's factors are computed
            return kernel
        # a panel of x1's blocks is kept, and x2's blocks stream past it once per panel
        panel_rows = self.panel_rows()
        for start in range(0, n1, panel_rows):
            panel: dict[int, Features] = {}
            for i in range(start, min(start + panel_rows, n1), bs):
                panel[i] = self._block(x1, y1, i, bs, None)
            for j in range(start if sym else 0, n2, bs):
                f2 = panel[j] if (sym and j in panel) else self._block(x2, y2, j, bs, None)
                for i, f1 in panel.items():
                    if not sym or i <= j:
                        place_block(kernel, self.contract(f1, f2, trace=trace), i, j, sym)
                del f1, f2  # the loop's names would hold two blocks past the panel
            del panel
        return kernel

    def _block(self, x: torch.Tensor, y: torch.Tensor | None, start: int, rows: int,
               cache: dict[int, Features] | None) -> Features:
        """The factors of ``x[start:start + rows]``, from ``cache`` when there (and kept in it)."""
        if cache is not None and start in cache:
            return cache[start]
        f = self.features(x[start : start + rows], None if y is None else y[start : start + rows])
        if cache is not None:
            cache[start] = f
        return f


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
    :param method: ``"auto"`` (the method with the least counted work, see :attr:`JacobianGram.choice`),
        ``"structured"``, ``"batched"`` or ``"jacobian"`` (``torch.func`` Jacobian contraction for every parameter;
        slow, the reference); see the module docstring.
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
