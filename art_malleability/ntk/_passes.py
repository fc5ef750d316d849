"""
The per-sub-batch passes of the kernel engine (:class:`~art_malleability.ntk.empirical.JacobianGram`): one forward
pass and the class gradients of a sub-batch, as the engine's method asks, turned into its Jacobian factors
(:class:`~art_malleability.ntk._memory.Features`).

- ``"structured"``: one forward pass capturing the structured layers' inputs and outputs and ``C`` backward passes
  (:func:`~art_malleability.ntk._autograd.class_gradients`), the output gradients compressed to rank one where they
  factor over the classes; the other parameters' Jacobians exactly (an unprojected
  :class:`~art_malleability.ntk.projection.ProjectedNTK`, ``torch.func`` for the rest);
- ``"batched"``: one class-batched ``torch.func`` pass with zero probes at the layers' outputs
  (:func:`~art_malleability.ntk._autograd.probed_jacobians`), the probed convolutions and batch norms in closed form
  (:mod:`~art_malleability.ntk._probed`).

The plan (which layers take which path, from one probe forward pass) is made here too; the engine holds it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from art_malleability._utils.torch_utils import trainable_parameters
from art_malleability.ntk._autograd import (
    InputChanged,
    class_gradients,
    forward_capturing,
    per_example_jacobian,
    probe_calls,
    probed_jacobians,
)
from art_malleability.ntk._memory import Features, OutputElements
from art_malleability.ntk._probed import (
    explicit_gradients,
    prefers_structured,
    probed_call,
    probed_candidates,
    structured_factors,
)
from art_malleability.ntk._rank_one import RankChange
from art_malleability.ntk._structured import linear_candidates, two_dimensional_call
from art_malleability.ntk.projection import ProjectedNTK

logger = logging.getLogger("art_malleability.ntk.empirical")


class FeaturePasses:
    """The plan and the sub-batch passes of :class:`~art_malleability.ntk.empirical.JacobianGram` (a base it
    inherits; the engine holds the state)."""

    def _plan(self, x_probe: torch.Tensor, y_probe: torch.Tensor | None) -> None:
        """
        Decide which layers take a factorised path (probe forward pass): ``nn.Linear`` layers called once on 2-D
        inputs, and for the batched method convolutions and batch norms (:mod:`~art_malleability.ntk._probed`),
        each convolution in the form :func:`~art_malleability.ntk._probed.prefers_structured` picks.
        """
        if self._layers is not None:
            return
        candidates = [] if self._path == "jacobian" else linear_candidates(self.model)
        probed = probed_candidates(self.model) if self._path == "batched" else []
        rows = x_probe.shape[0]

        def check(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> bool:
            if k < len(candidates):
                return two_dimensional_call(k, module, inputs, output)
            return probed_call(probed[k - len(candidates)], inputs, output, rows)

        watched = [c.module for c in candidates] + [p.module for p in probed]
        with OutputElements() as sizes:
            out, calls = probe_calls(self.model, watched, x_probe, check)
        self._forward_size = (-(-sizes.total // rows), -(-sizes.largest // rows))
        with torch.no_grad():
            self._n_outputs = int(self._apply_output_fn(out, y_probe).shape[1])
        layers = [c for k, c in enumerate(candidates) if calls[k] == [True]]
        self._probed = [p for k, p in enumerate(probed, start=len(candidates)) if calls[k] == [True]]
        for p in self._probed:
            p.structured = (
                p.kind == "conv"
                and p.weight
                and prefers_structured(p.positions, p.patch, p.channels, self._n_outputs)
            )
        covered = set()
        for module, weight, bias in [(c.module, c.weight, c.bias) for c in layers] + [
            (p.module, p.weight, p.bias) for p in self._probed
        ]:
            if weight:
                covered.add(id(module.weight))
            if bias:
                covered.add(id(module.bias))
        self._fallback = [(n, p) for n, p in trainable_parameters(self.model) if id(p) not in covered]
        self._layers = layers
        self._rank_one = [True] * len(layers)
        logger.debug(
            "eNTK plan (%s): %d structured linear layer(s) %s, probed layer(s) %s, %d fallback parameter(s) %s",
            self._path,
            len(layers),
            [c.name for c in layers],
            [(p.name, "structured" if p.structured else "explicit") for p in self._probed],
            len(self._fallback),
            [n for n, _ in self._fallback],
        )

    def _sub_batch_features(self, x: torch.Tensor, y: torch.Tensor | None) -> Features:
        """Factors of one sub-batch: one forward pass and ``C`` backward passes (one batched for ``"batched"``)."""
        n = x.shape[0]
        if self._path == "batched":
            return self._batched_features(x, y)
        acts: list[torch.Tensor | None] = []
        grads: list[torch.Tensor] = []
        if self._layers:
            g, captured = forward_capturing(
                [c.module for c in self._layers],
                lambda: self._apply_output_fn(self.model(x), y),
                clone_inputs=True,
                hint="; use method='jacobian'",
            )
            outs = [c[1] for c in captured]
            n_out = g.shape[1]
            # raw output gradients, filled class by class: (n, C, out) per layer
            grads = [
                self._classes.raw_buffer(k, (n, n_out, o.shape[1]), o, temporary=self._compressed(k))
                for k, o in enumerate(outs)
            ]
            for c, dc in class_gradients(g, outs):
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
        return Features(n=n, acts=acts, grads=grads, jac=jac)

    def _batched_features(self, x: torch.Tensor, y: torch.Tensor | None) -> Features:
        """
        Factors of one sub-batch from one class-batched ``torch.func`` pass (:func:`probed_jacobians`): the linear
        layers' inputs and output gradients as they come, each probed convolution's and batch norm's explicit
        gradients (joined with the fallback's Jacobian in one matrix) or structured factors.
        """
        lin = len(self._layers)
        try:
            acts, grads, jac = self._probed_pass(x, y)
        except InputChanged:
            logger.debug("eNTK: the model changes a layer's input in place; keeping copies of the inputs")
            self._clone_inputs = True
            acts, grads, jac = self._probed_pass(x, y)
        parts: list[torch.Tensor] = []
        convs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, p in enumerate(self._probed, start=lin):
            inp, grad = acts[k], grads[k]
            acts[k] = grads[k] = None  # released as soon as used: they are the pass's largest tensors
            if p.structured:
                convs.append(structured_factors(p, inp, grad))
            else:
                parts.extend(explicit_gradients(p, inp, grad))
            del inp, grad
        if jac is not None:
            parts.append(jac)
        del jac
        joined = None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return Features(n=x.shape[0], acts=acts[:lin], grads=grads[:lin], jac=joined, convs=convs)

    def _probed_pass(
        self, x: torch.Tensor, y: torch.Tensor | None
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], torch.Tensor | None]:
        """The class-batched pass of :meth:`_batched_features` over the linear and the probed layers."""
        lin = len(self._layers)
        return probed_jacobians(
            self.model,
            [c.module for c in self._layers] + [p.module for p in self._probed],
            [c.weight for c in self._layers] + [p.keeps_input() for p in self._probed],
            [(c.module.out_features,) for c in self._layers] + [p.out_shape for p in self._probed],
            self._fallback,
            x,
            y,
            self._apply_output_fn,
            self._zeros,
            contiguous=[True] * lin + [False] * len(self._probed),
            clone_inputs=self._clone_inputs,
        )

    def _rank_one_factor(self, k: int, d: torch.Tensor) -> torch.Tensor:
        """
        Rank-one factor of the raw output gradients ``d`` of layer ``k``
        (:meth:`ClassDirections.factor <art_malleability.ntk._rank_one.ClassDirections.factor>`).

        :raises RankChange: If the check fails (the layer is then marked as not rank one).
        """
        g = self._classes.factor(k, d)
        if g is None:
            self._rank_one[k] = False
            raise RankChange(self._layers[k].name)
        return g

    def _fallback_jacobian(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        if self.output_fn is None and self._trace and self._path == "structured":
            # traced NTK: exact Jacobians of convolutions and of modules' own parameters from their
            # factors (an unprojected ProjectedNTK), whole-model torch.func only for the rest
            if self._exact_rest is None:
                params = [p for _, p in self._fallback]
                self._exact_rest = ProjectedNTK(
                    self.model, 2**31 - 1, batch_size=self.batch_size, chunk_mb=self.chunk_mb, parameters=params
                ).plan(x)
            return self._exact_rest._features(x).unsqueeze(1)
        return per_example_jacobian(self.model, self._fallback, x, y, self._apply_output_fn)
