"""
The structured strategy of :mod:`art_malleability.ntk.empirical`: ``nn.Linear`` layers called once
per forward pass on 2-D inputs, whose per-example Jacobians factor into the layer inputs and the
output gradients, contracted without ever forming a Jacobian.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from art_malleability.ntk._autograd import plain_layers
from art_malleability.ntk._memory import Features
from art_malleability.ntk._probed import conv_contract


@dataclass
class LinearPlan:
    """A ``nn.Linear`` layer handled by the structured (factorised) path."""

    name: str
    module: nn.Linear
    weight: bool
    bias: bool


def linear_candidates(model: nn.Module) -> list[LinearPlan]:
    """
    :param model: The model.
    :return: Its plain ``nn.Linear`` layers (not subclasses with their own ``forward``) with a trained parameter.
    """
    return [
        LinearPlan(name, module, w, b)
        for name, module, w, b in plain_layers(model, (nn.Linear,))
        if type(module).forward is nn.Linear.forward
    ]


def two_dimensional_call(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> bool:
    """Whether one call of a candidate layer maps a 2-D input to a 2-D output (the structured case)."""
    return (
        len(inputs) == 1
        and isinstance(inputs[0], torch.Tensor)
        and inputs[0].dim() == 2
        and isinstance(output, torch.Tensor)
        and output.dim() == 2
    )


def contract(
    layers: list[LinearPlan],
    f1: Features,
    f2: Features,
    n_outputs: int,
    trace: bool,
    dtype: torch.dtype,
    device: torch.device,
    chunk_elements: int = 2**25,
) -> torch.Tensor:
    """
    Gram block between two batches of factors: per structured layer ``(A1 A2ᵀ) ⊙ (Δ1 Δ2ᵀ)`` (classes folded into
    ``Δ``), the structured convolutions' position-pair sums (:func:`~art_malleability.ntk._probed.conv_contract`),
    and one product of the explicit Jacobians.

    :param layers: The structured layers the factors belong to.
    :param f1: Factors of the first batch (``n1`` examples).
    :param f2: Factors of the second batch (``n2`` examples).
    :param n_outputs: Number of outputs ``C``.
    :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
    :param dtype: Dtype of the block.
    :param device: Device of the block.
    :param chunk_elements: Numbers the intermediate products of one structured convolution may take.
    :return: The block.
    """
    c = n_outputs
    k: torch.Tensor | None = None  # the first term is the block itself: no zero fill, no extra add
    for plan, a1, d1, a2, d2 in zip(layers, f1.acts, f1.grads, f2.acts, f2.grads, strict=True):
        if trace:
            # full (n, C, out) factors or rank-one (n, out) factors: the same product
            s = d1.reshape(f1.n, -1) @ d2.reshape(f2.n, -1).T
        else:
            s = torch.einsum("acn,bdn->abcd", d1, d2)
        if plan.weight:
            gram_a = a1 @ a2.T
            if plan.bias:
                gram_a += 1.0
            s.mul_(gram_a if trace else gram_a[:, :, None, None])
        if k is None:
            k = s
        else:
            k += s
        del s
    for c1, c2 in zip(f1.convs, f2.convs, strict=True):
        s = conv_contract(c1, c2, trace, chunk_elements)
        k = s if k is None else k.add_(s)
    if f1.jac is not None:
        if trace:
            j1, j2 = f1.jac.reshape(f1.n, -1), f2.jac.reshape(f2.n, -1)
            k = j1 @ j2.T if k is None else k.addmm_(j1, j2.T)
        else:
            s = torch.einsum("acp,bdp->abcd", f1.jac, f2.jac)
            k = s if k is None else k.add_(s)
    if k is None:  # nothing trained reaches the outputs
        shape = (f1.n, f2.n) if trace else (f1.n, f2.n, c, c)
        k = torch.zeros(shape, dtype=dtype, device=device)
    return k
