"""
The plan and the per-sub-batch factors of the kernel engine (:class:`~art_malleability.ntk.empirical.JacobianGram`):
the model's plan from the layer registry (:mod:`art_malleability.ntk.layers`), each Kronecker block's form, and one
class-batched pass per sub-batch (:func:`~art_malleability.ntk.layers.passes.probed_pass`) turned into the Jacobian
factors (:class:`~art_malleability.ntk._memory.Features`): the structured blocks' input sides and output gradients
(rank one over the classes where ``"structured"`` finds them so), and every explicit gradient joined in one matrix.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from art_malleability._utils.torch_utils import trainable_parameters
from art_malleability.ntk._autograd import per_example_jacobian
from art_malleability.ntk._memory import Features
from art_malleability.ntk._rank_one import ClassDirections, RankChange
from art_malleability.ntk.cost import MethodCost, choose, count
from art_malleability.ntk.layers.base import Block
from art_malleability.ntk.layers.passes import InputChanged, probed_pass, vmappable
from art_malleability.ntk.layers.plan import plan_model

logger = logging.getLogger("art_malleability.ntk.empirical")


def factor_count(n: int, panel: int) -> int:
    """Examples whose factors a symmetric kernel of ``n`` computes when panels of ``panel`` rows are kept: the
    panel's own and the rows after it, once per panel."""
    panels = -(-n // panel)
    return panels * n - panel * panels * (panels - 1) // 2


def prefers_structured(positions: int, width: int, channels: int, classes: int) -> bool:
    """
    The per-block rule: the structured form where its multiply-adds per pair of examples of the traced kernel are
    fewer than the explicit form's.

    - explicit: ``C·o·d`` (the dot product of two examples' ``C × o·d`` gradients);
    - structured: ``L²·(d + C·o + 1)`` (the ``L × L`` position pairs of the input-side and the class-folded
      output-side Gram matrices, and their product).

    The explicit form's one-off product per example (``L·C·o·d``) is left out: a kernel of ``n`` examples spreads it
    over ``n`` pairs. Structured is thus chosen for layers with few positions and wide sides (every ``nn.Linear`` on
    2-D inputs, convolutions on small maps with many channels), which then also store fewer numbers per example
    (``L·(d + C·o)``); explicit for long sequences and large maps with few channels.

    :param positions: Positions ``L``.
    :param width: Input-side multiply-adds of a position pair ``d`` (the columns; one for an embedding's tokens).
    :param channels: Output side ``o``.
    :param classes: Outputs ``C``.
    :return: Whether the structured form costs fewer multiply-adds.
    """
    return positions**2 * (width + classes * channels + 1) < classes * channels * width


class FeaturePasses:
    """The plan and the sub-batch factors of :class:`~art_malleability.ntk.empirical.JacobianGram` (a base it
    inherits; the engine holds the state)."""

    def _plan(self, x_probe: torch.Tensor, y_probe: torch.Tensor | None) -> None:
        """Plan the model (one probe forward pass), count its outputs and choose each block's form."""
        if self._layer_plan is not None:
            return
        plan = plan_model(self.model, x_probe, lambda p: p.requires_grad)
        self._forward_size = plan.forward_size
        with torch.no_grad():
            self._n_outputs = int(self._apply_output_fn(plan.output, y_probe).shape[1])
        plan.output = None
        c = self._n_outputs
        for b in plan.blocks:
            b.structured = b.may_structure() and prefers_structured(b.positions, b.gram_width(), b.d_out, c)
        self._layer_plan = plan
        order: dict[int, nn.Parameter] = {}
        for site in plan.sites:
            in_blocks = {id(p) for b in site.blocks for p in b.params}
            for b in site.blocks:
                if not b.structured:
                    for p in b.params:
                        order.setdefault(id(p), p)
            for _, p in site.params:
                if id(p) not in in_blocks:
                    order.setdefault(id(p), p)
        self._explicit = list(order.values())
        unused = set(plan.unused)
        self._jacobian_params = [(n, p) for n, p in trainable_parameters(self.model) if n not in unused]
        self._rank_one_blocks = [b.positions == 1 for b in plan.blocks if b.structured]
        logger.debug("eNTK plan: structured block(s) %s, explicit %s, fallback %s",
                     [b.name for b in plan.blocks if b.structured],
                     [b.name for b in plan.blocks if not b.structured], [n for n, _ in plan.fallback])
        if self._path is not None:
            self._take_path(self._path)

    def _take_path(self, path: str) -> None:
        """Run ``path``: the structured blocks' list (none for ``"jacobian"``) and their rank-one state."""
        self._path = path
        plan = self._layer_plan
        self._structured = [] if path == "jacobian" else [b for b in plan.blocks if b.structured]
        self._rank_one = [] if path == "jacobian" else list(self._rank_one_blocks)

    def _count(self, x: torch.Tensor, y: torch.Tensor | None
               ) -> tuple[dict[str, MethodCost], Features, ClassDirections]:
        """
        Each method's counted work on the probe (:mod:`~art_malleability.ntk.cost`), the probe's factors (the batched
        method's) and the class directions its rank-one check set, from one counted pass:
        ``"batched"``'s pass as it runs; ``"structured"`` the same pass and the rank-one check on its factors (which
        also finds the blocks whose output gradients are not rank one over the classes: they never try to be), with
        the compressed blocks' smaller contraction; ``"jacobian"`` the same pass and every block's per-example
        gradients formed, contracted whole (not run: its Jacobian may not fit a probe).
        """
        c, probe = self._n_outputs, x.shape[0]
        self._take_path("batched")
        self._start(True)
        try:
            features, flops, writes, calls = count(self._sub_batch_features, x, y)
            stored = self._example_size(raw=False)
        finally:
            self._finish()
        classes = ClassDirections.fresh(len(self._structured))

        def rank_one_check() -> list[bool]:
            return [c > 1 and b.positions == 1 and classes.factor(k, f[1][:, 0]) is not None
                    for k, (b, f) in enumerate(zip(self._structured, features.blocks, strict=True))]

        # the check also sets the class directions; its work is a sub-batch's check once they are set, counted by its
        # formula (run under the counter, its dispatch would cost more than the check itself; elementwise work only,
        # so no counted operations)
        rank_one = self._rank_one_blocks = rank_one_check()
        checks = [ClassDirections.check_work(probe, c, b.d_out) for b in self._structured if c > 1 and b.positions == 1]
        check_writes, check_calls = sum(w for w, _ in checks), sum(n for _, n in checks)

        def pair(compressed: list[bool]) -> float:
            total = 2.0 * c * self._explicit_numel()
            for b, one in zip(self._structured, compressed, strict=True):
                width = b.gram_width() + (1 if one else c) * b.d_out
                total += 2.0 * width + 1 if b.positions == 1 else 2.0 * b.positions**2 * (width + 1)
            return total

        compressed = sum(b.positions * (c - 1) * b.d_out for b, one in zip(self._structured, rank_one, strict=True)
                         if one)
        numel = sum(p.numel() for _, p in self._jacobian_params)
        formed = sum(2.0 * c * b.positions * b.d_out * b.d_in for b in self._structured)
        return {
            "batched": MethodCost("batched", flops / probe, writes / probe, pair([False] * len(rank_one)),
                                  float(calls), 0.0, stored),
            # the compressed blocks' stored output gradients are C times smaller: fewer numbers written
            "structured": MethodCost("structured", flops / probe,
                                     (writes + check_writes) / probe - compressed, pair(rank_one),
                                     float(calls + check_calls), 1.0 if any(rank_one) else 0.0, stored - compressed),
            "jacobian": MethodCost("jacobian", flops / probe + formed, writes / probe + c * numel, 2.0 * c * numel,
                                   float(calls), 0.0, c * numel),
        }, features, classes

    def _choose(self, x: torch.Tensor, y: torch.Tensor | None, n1: int, n2: int | None) -> None:
        """``"auto"``: count each method's work on the probe and take the least for a traced kernel of ``n1 × n2``
        examples (``n2=None``: symmetric)."""
        costs, features, classes = self._count(x, y)
        examples, passes = {}, {}
        pairs = n1 * (n1 + 1) / 2 if n2 is None else n1 * n2
        for path in costs:
            self._take_path(path)
            self._start(True)
            rows, kept = self._sub_batch_rows(), self._kept_rows()
            self._finish()
            if n2 is None:
                count_examples = n1 if n1 <= kept else factor_count(n1, max(kept - rows, rows))
            else:
                count_examples = n1 + n2 if n2 + rows <= kept else n1 + n2 * -(-n1 // max(kept - rows, rows))
            examples[path] = float(count_examples)
            passes[path] = float(-(-count_examples // rows))
        choice = choose(costs, examples, pairs, passes, self.device)
        self.choice = choice
        self._take_path(choice.method)
        # the probe's factors are the computation's first sub-batch's: kept for it, as the chosen method stores them
        # ("structured": compressed with the class directions the check set, which the computation then takes)
        if choice.method == "batched":
            self._first = (x, y, features, None)
        elif choice.method == "structured":
            blocks = [(a, classes.factor(k, d[:, 0]).reshape(d.shape[0], 1, 1, -1)) if one else (a, d)
                      for k, ((a, d), one) in enumerate(zip(features.blocks, self._rank_one_blocks, strict=True))]
            self._first = (x, y, Features(n=features.n, blocks=blocks, jac=features.jac), classes)
        logger.info("eNTK method (auto): %s", choice.reason)

    def _unused_ids(self, plan: object) -> list[int]:
        names = set(plan.unused)
        return [id(p) for n, p in trainable_parameters(self.model) if n in names]

    def _sub_batch_features(self, x: torch.Tensor, y: torch.Tensor | None, out: Features | None = None) -> Features:
        """
        Factors of one sub-batch from one class-batched pass (``"jacobian"``: ``torch.func`` for every parameter),
        written into ``out`` when given (rows of a larger batch's factors), else into new tensors.
        """
        n = x.shape[0]
        plan = self._layer_plan
        reused = self._reuse_first(x, y)
        if reused is not None:
            if out is None:
                return reused
            out.fill(reused, 0)
            return out
        if self._path == "jacobian":
            with vmappable(plan):
                jac = per_example_jacobian(self.model, self._jacobian_params, x, y, self._apply_output_fn)
            if out is None:
                return Features(n=n, blocks=[], jac=jac)
            out.jac.copy_(jac)
            return out
        try:
            result = probed_pass(plan, self.model, x, y, self._apply_output_fn, self._zeros, self._clone_inputs)
        except InputChanged:
            logger.debug("eNTK: the model changes a layer's input in place; keeping copies of the inputs")
            self._clone_inputs = True
            result = probed_pass(plan, self.model, x, y, self._apply_output_fn, self._zeros, True)
        pieces: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        parts: dict[int, torch.Tensor] = {}

        def add(p: nn.Parameter, g: torch.Tensor) -> None:
            parts[id(p)] = g if id(p) not in parts else parts[id(p)] + g

        for i, site in enumerate(plan.sites):
            kept, grads = result.kept[i], result.grads[i]
            result.kept[i] = result.grads[i] = None  # released as soon as used: the pass's largest tensors
            for j in range(len(kept)):
                blocks, explicit = site.factors(kept[j], grads[j])
                for b, f in zip(site.blocks, blocks, strict=True):
                    pieces.setdefault(id(b), []).append(f)
                for p, g in explicit:
                    add(p, g)
            del kept, grads
        stored: list[tuple[torch.Tensor, torch.Tensor]] = []
        k = 0
        for b in plan.blocks:
            calls = pieces.pop(id(b))
            a = calls[0][0] if len(calls) == 1 else torch.cat([f[0] for f in calls], dim=1)
            d = calls[0][1] if len(calls) == 1 else torch.cat([f[1] for f in calls], dim=2)
            if b.structured:
                stored.append(self._stored(k, b, a, d, None if out is None else out.blocks[k]))
                k += 1
            else:
                for p, g in b.explicit(a, d):
                    add(p, g)
        width = self._explicit_numel()
        if not width:
            return Features(n=n, blocks=stored, jac=None) if out is None else out
        jac = out.jac if out is not None else x.new_empty((n, self._n_outputs, width))
        offset = 0
        for p in self._explicit:
            jac[:, :, offset : offset + p.numel()] = parts.pop(id(p))
            offset += p.numel()
        if result.jac is not None:
            jac[:, :, offset:] = result.jac
        return Features(n=n, blocks=stored, jac=jac) if out is None else out

    def _reuse_first(self, x: torch.Tensor, y: torch.Tensor | None) -> Features | None:
        """
        The factors ``"auto"`` counted its work on, if ``x`` (and ``y``) are those very rows and they are stored as this
        computation stores them (``"structured"``'s compressed ones only with the class directions they were
        compressed with, which :meth:`_start` then takes); used once.
        """
        first = self._first
        if first is None or (first[1] is None) != (y is None):
            return None
        # the same memory seen the same way (the same rows of the same inputs), compared here, not in a helper the
        # inputs are handed to
        for a, b in ((first[0], x), (first[1], y)):
            if b is not None and (a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype
                                  or a.device != b.device or a.data_ptr() != b.data_ptr()):
                return None
        compressed = first[3] is not None and any(self._rank_one)
        if compressed and (not self._compress or self._classes is not first[3]):
            return None
        self._first = None
        return first[2]

    def _stored(self, k: int, block: Block, a: torch.Tensor, d: torch.Tensor,
                out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A structured block's stored factors: the input side ``(n, L, d_in)`` and the output gradients
        ``(n, L, C, o)``, or ``(n, 1, 1, o)`` where they are rank one over the classes; written into ``out`` when
        given."""
        side = block.input_side(a)
        if self._compressed(k):
            g = self._classes.factor(k, d[:, :, 0, :])
            if g is None:
                self._rank_one[k] = False
                raise RankChange(block.name)
            grads = g.reshape(g.shape[0], 1, 1, -1)
        else:
            grads = d.permute(0, 2, 1, 3)
        if out is None:
            return side.contiguous(), grads.contiguous()
        out[0].copy_(side)
        out[1].copy_(grads)
        return out

    def _explicit_numel(self) -> int:
        """Numbers of the explicit gradients per output: the explicit blocks' and sites' parameters, and the
        fallback's."""
        plan = self._layer_plan
        if self._path == "jacobian":
            return sum(p.numel() for _, p in self._jacobian_params)
        return sum(p.numel() for p in self._explicit) + sum(p.numel() for _, p in plan.fallback)
