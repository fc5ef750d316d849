"""
Per-layer Jacobian factors of the batched method of :mod:`art_malleability.ntk.empirical` beyond ``nn.Linear``:
convolutions and batch norms, whose per-example parameter gradients follow in closed form from the layer's input and
its output gradient ``δ_c`` (the derivative of output ``c`` with respect to the layer's output, which the batched pass
gives for every probed layer at once, classes batched).

- **Convolutions** (``nn.Conv2d``, one group, zero padding). With the unfolded input patches ``A`` (``L × d``: ``L``
  output positions, ``d = c_in · k_h · k_w``) and ``Δ_c`` (``L × o``), the per-example weight gradient of output
  ``c`` is ``Δ_cᵀ A`` (the bias gradient: ``Δ_c`` summed over positions), as Opacus and kronfluence compute it. Two
  forms, chosen per layer by :func:`prefers_structured`:

  - *explicit*: one batched product per sub-batch with the classes folded in, ``(n, C·o, L) @ (n, L, d)``, giving
    the ``C × o·d`` gradients of each example, which join the other explicit gradients in one matrix (one product
    per block pair for all of them);
  - *structured* (neural-tangents' "structured derivatives"): ``A`` and ``Δ`` are kept, and the traced kernel is
    ``Σ_{l,l'} (A1 A2ᵀ)[a l, b l'] · (Δ1 Δ2ᵀ)[a l, b l']`` with the classes folded into ``Δ`` (``L × C·o``), never
    forming a gradient.

- **Batch norms in evaluation mode** (running statistics, affine; any ``nn.BatchNorm*d``). With
  ``x̂ = (x − μ) / √(σ² + ε)`` from the running statistics, the per-example gradients of output ``c`` are
  ``Σ_pos δ_c · x̂`` for the scale and ``Σ_pos δ_c`` for the shift: two reductions, no ``vmap`` or ``vjp`` call.
  They join the explicit gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from art_malleability.ntk._autograd import plain_layers
from art_malleability.ntk._groups import _factorisable

__all__ = [
    "ProbedLayer",
    "conv_contract",
    "explicit_gradients",
    "prefers_structured",
    "probed_candidates",
    "probed_call",
    "structured_factors",
]


@dataclass
class ProbedLayer:
    """A convolution or batch norm whose factors the batched method takes from its input and output gradient."""

    name: str
    module: nn.Module
    kind: str  # "conv" or "batchnorm"
    weight: bool
    bias: bool
    out_shape: tuple[int, ...] = ()  # one example's output (the probe's shape)
    in_shape: tuple[int, ...] = ()  # one example's input
    structured: bool = False  # a convolution in the structured form (factors kept, no gradient formed)
    # a batch norm's x̂ = x · scale + shift, per channel (channels, 1), for one kernel computation
    normaliser: tuple[torch.Tensor, torch.Tensor] | None = None

    def refresh(self) -> None:
        """Read a batch norm's running statistics for the computation about to start (``None`` for others)."""
        if self.kind != "batchnorm" or not self.weight:
            self.normaliser = None
            return
        m = self.module
        with torch.no_grad():
            scale = torch.rsqrt(m.running_var + m.eps)
            self.normaliser = (scale.unsqueeze(1), (-m.running_mean * scale).unsqueeze(1))

    @property
    def channels(self) -> int:
        """Output channels ``o``."""
        return int(self.out_shape[0])

    @property
    def positions(self) -> int:
        """Positions ``L`` a gradient sums over (output pixels of a convolution, of a batch norm's input)."""
        return int(math.prod(self.out_shape[1:]))

    @property
    def patch(self) -> int:
        """Columns ``d`` of the input side: the unfolded patch (a convolution's weight) plus one for the bias."""
        if self.kind != "conv":
            return 0
        m = self.module
        return (m.in_channels * math.prod(m.kernel_size) if self.weight else 0) + (1 if self.bias else 0)

    def parameters_per_output(self) -> int:
        """Numbers of one output's explicit gradient: the trained parameters' size."""
        if self.kind == "conv":
            return self.channels * self.patch
        return self.channels * (int(self.weight) + int(self.bias))

    def stored(self, classes: int) -> int:
        """Numbers stored per example for the contraction: the explicit gradients or the structured factors."""
        if self.structured:
            return self.positions * (self.patch + classes * self.channels)
        return classes * self.parameters_per_output()

    def keeps_input(self) -> bool:
        """Whether the layer's input is needed (a trained weight)."""
        return self.weight


def probed_candidates(model: nn.Module) -> list[ProbedLayer]:
    """
    :param model: The model.
    :return: Its plain convolutions of the handled kind and its batch norms with running statistics and affine
        parameters (stock ``forward``), with a trained parameter not shared with another module.
    """
    found = []
    for name, module, w, b in plain_layers(model, (nn.Conv2d, _BatchNorm)):
        if isinstance(module, nn.Conv2d) and _factorisable(module):
            found.append(ProbedLayer(name, module, "conv", w, b))
        elif (
            isinstance(module, _BatchNorm)
            and type(module).forward is _BatchNorm.forward
            and module.affine
            and module.track_running_stats
            and module.running_mean is not None
            and module.running_var is not None
        ):
            found.append(ProbedLayer(name, module, "batchnorm", w, b))
    return found


def probed_call(layer: ProbedLayer, inputs: tuple, output: torch.Tensor, n: int) -> bool:
    """
    Whether one call of a candidate treats the ``n`` probe examples as a batch with the ranks its closed form needs
    (a convolution: 4-D in and out; a batch norm: at least 2-D, same shape out); records the per-example shapes.
    """
    ok = (
        len(inputs) == 1
        and isinstance(inputs[0], torch.Tensor)
        and isinstance(output, torch.Tensor)
        and inputs[0].dim() >= 2
        and inputs[0].shape[0] == n == output.shape[0]
    )
    if ok and layer.kind == "conv":
        ok = inputs[0].dim() == 4 and output.dim() == 4
    elif ok:
        ok = output.shape == inputs[0].shape
    if ok:
        layer.in_shape, layer.out_shape = tuple(inputs[0].shape[1:]), tuple(output.shape[1:])
    return ok


def prefers_structured(positions: int, patch: int, channels: int, classes: int) -> bool:
    """
    The per-layer rule of the batched method for a convolution: the structured form where its multiply-adds per
    pair of examples of the traced kernel are fewer than the explicit form's.

    - explicit: ``C·o·d`` (the dot product of two examples' ``C × o·d`` gradients);
    - structured: ``L²·(d + C·o + 1)`` (the ``L × L`` position pairs of the input-side and the class-folded
      output-side Gram matrices, and their product).

    The explicit form's one-off product per example (``L·C·o·d``) is left out: a kernel of ``n`` examples
    spreads it over ``n`` pairs. Structured is thus chosen for convolutions on small maps with many channels
    (``L² < C·o·d / (d + C·o + 1)``), which then also store fewer numbers per example (``L·(d + C·o)``).

    :param positions: Output positions ``L``.
    :param patch: Input-side columns ``d`` (unfolded patch, plus one for a bias).
    :param channels: Output channels ``o``.
    :param classes: Outputs ``C``.
    :return: Whether the structured form costs fewer multiply-adds.
    """
    return positions**2 * (patch + classes * channels + 1) < classes * channels * patch


def _unfolded(layer: ProbedLayer, inp: torch.Tensor) -> torch.Tensor:
    """The input side ``(n, d, L)``: unfolded patches, with a row of ones for a trained bias."""
    m = layer.module
    n = inp.shape[0]
    if not layer.weight:
        return inp.new_ones((n, 1, layer.positions))
    a = F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
    if layer.bias:
        a = torch.cat([a, a.new_ones((n, 1, a.shape[2]))], dim=1)
    return a


def _normalised(layer: ProbedLayer, inp: torch.Tensor) -> torch.Tensor:
    """A batch norm's ``x̂`` from its running statistics, ``(n, channels, positions)``: one fused operation."""
    if layer.normaliser is None:
        layer.refresh()
    scale, shift = layer.normaliser
    if scale.dtype != inp.dtype:  # once per computation: kept in the inputs' dtype
        scale, shift = scale.to(inp.dtype), shift.to(inp.dtype)
        layer.normaliser = (scale, shift)
    return torch.addcmul(shift, inp.reshape(inp.shape[0], layer.channels, -1), scale)


def explicit_gradients(layer: ProbedLayer, inp: torch.Tensor | None, grad: torch.Tensor) -> list[torch.Tensor]:
    """
    Per-example gradients of a probed layer's trained parameters for every output.

    :param layer: The layer.
    :param inp: Its input ``(n, *in_shape)`` (``None`` when only a bias is trained).
    :param grad: Its output gradients ``(n, C, *out_shape)`` (contiguous or not).
    :return: ``(n, C, P_i)`` parts (weight, bias) whose concatenation along the last axis are the gradients.
    """
    n, c = grad.shape[:2]
    if layer.kind == "conv":
        g = grad.reshape(n, c * layer.channels, layer.positions)
        if not layer.weight:
            return [g.sum(2).reshape(n, c, -1)]
        # one batched product with the classes folded in: (n, C·o, L) @ (n, L, d)
        return [torch.bmm(g, _unfolded(layer, inp).transpose(1, 2)).reshape(n, c, -1)]
    g = grad.flatten(3) if grad.dim() > 3 else grad.unsqueeze(3)  # (n, C, channels, positions), a view
    parts = []
    if layer.weight:
        parts.append((g * _normalised(layer, inp).unsqueeze(1)).sum(3))
    if layer.bias:
        parts.append(g.sum(3))
    return parts


def structured_factors(layer: ProbedLayer, inp: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The structured form's factors of a convolution.

    :param layer: The layer (a convolution with a trained weight).
    :param inp: Its input ``(n, c_in, H, W)``.
    :param grad: Its output gradients ``(n, C, o, H', W')``.
    :return: The input side ``(n, L, d)`` and the output side ``(n, L, C, o)``, contiguous.
    """
    n, c = grad.shape[:2]
    a = _unfolded(layer, inp).transpose(1, 2).contiguous()
    d = grad.reshape(n, c, layer.channels, layer.positions).permute(0, 3, 1, 2).contiguous()
    return a, d


def conv_contract(
    f1: tuple[torch.Tensor, torch.Tensor], f2: tuple[torch.Tensor, torch.Tensor], trace: bool, chunk_elements: int
) -> torch.Tensor:
    """
    A structured convolution's share of a Gram block: ``Σ_{l,l'} (A1 A2ᵀ) ⊙ (Δ1 Δ2ᵀ)`` with the classes folded into
    ``Δ`` (traced) or kept apart. The ``(n1·L) × (n2·L)`` products are formed for rows of ``f1`` at a time so that
    the two of them take at most ``chunk_elements`` numbers (one row at least).

    :param f1: Factors ``(A, Δ)`` of the first batch, as from :func:`structured_factors`.
    :param f2: Factors of the second batch.
    :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
    :param chunk_elements: Numbers the products of one chunk of rows may take.
    :return: The share.
    """
    (a1, d1), (a2, d2) = f1, f2
    n1, n2, length, c = a1.shape[0], a2.shape[0], a1.shape[1], d1.shape[2]
    per_row = 2 * length * n2 * length * (1 if trace else c * c)
    step = max(1, min(n1, chunk_elements // max(per_row, 1)))
    a2f = a2.reshape(n2 * length, -1)
    parts = []
    for i in range(0, n1, step):
        rows = min(step, n1 - i)
        gram_a = a1[i : i + rows].reshape(rows * length, -1) @ a2f.T  # (rows·L, n2·L)
        if trace:
            gram_d = d1[i : i + rows].reshape(rows * length, -1) @ d2.reshape(n2 * length, -1).T
            parts.append(gram_d.mul_(gram_a).view(rows, length, n2, length).sum((1, 3)))
        else:
            gram_d = d1[i : i + rows].reshape(rows * length * c, -1) @ d2.reshape(n2 * length * c, -1).T
            parts.append(
                torch.einsum(
                    "alcbmd,albm->abcd",
                    gram_d.view(rows, length, c, n2, length, c),
                    gram_a.view(rows, length, n2, length),
                )
            )
        del gram_a, gram_d
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
