"""
Convolutions (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``; any stride, dilation, padding and padding mode): one
Kronecker block over the output positions, ``a_l`` the unfolded input patch and ``Δ_l`` the output gradients at
position ``l``, as Opacus and kronfluence compute per-example convolution gradients. A grouped or depthwise
convolution's weight gradient is one batched product per group (:class:`~art_malleability.ntk.layers.base.GroupedSide`)
and stays explicit.

On small maps (input positions no more than the kernel's, e.g. ResNet-18's last two stages at 32 x 32) a pass runs
the convolution as the matrix it is on the flattened input (:func:`operator`): no more arithmetic than the
convolution, and its class-batched reverse pass is one matrix product where the stock convolution's backward loops
over the ``n · C`` rows with a matrix-vector product each (float64 on the CPU: 18-23 GFLOP/s against 40-47 for the
product on these maps). The weight is read as a constant there: its gradients come from the factors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from art_malleability.ntk.layers.base import (
    Block,
    GroupedSide,
    InputSide,
    ParamGradient,
    ProbeShapes,
    Site,
    tensor_batch,
)


def unfold(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """
    The input patches of a convolution, ``(n, L, c_in · ∏ kernel)`` in the weight's column order (channel, then
    kernel offsets), for 1, 2 or 3 spatial dimensions.

    :param module: The convolution.
    :param x: Its input ``(n, c_in, *spatial)``.
    :return: The patches at each output position.
    """
    dims = x.dim() - 2
    kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
    padding = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * dims
    if dims == 2:
        return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride).transpose(1, 2)
    if dims == 1:
        cols = F.unfold(x.unsqueeze(2), (1, kernel[0]), dilation=(1, dilation[0]), padding=(0, padding[0]),
                        stride=(1, stride[0]))
        return cols.transpose(1, 2)
    x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for i in range(dims):
        span = dilation[i] * (kernel[i] - 1) + 1
        x = x.unfold(2 + i, span, stride[i])  # (n, c, L1, .., span_i) appended
    x = x[(...,) + tuple(slice(None, None, d) for d in dilation)]  # (n, c, L1, L2, L3, k1, k2, k3)
    n, c = x.shape[:2]
    positions = math.prod(x.shape[2 : 2 + dims])
    perm = (0, *range(2, 2 + dims), 1, *range(2 + dims, 2 + 2 * dims))
    return x.permute(perm).reshape(n, positions, c * math.prod(kernel))


def operator(module: nn.modules.conv._ConvNd, in_shape: tuple[int, ...]) -> torch.Tensor:
    """
    An ungrouped convolution without its bias as a matrix on the flattened input: ``(c_out · L, c_in · ∏ spatial)``,
    rows in the output's layout (channel, then position), columns in the input's; built from the weight (detached)
    and the positions :func:`unfold` reads, so that any padding mode, stride and dilation hold.

    :param module: The convolution (``groups == 1``).
    :param in_shape: One example's input shape ``(c_in, *spatial)``.
    :return: The matrix.
    """
    weight = module.weight.detach()
    spatial = in_shape[1:]
    size = math.prod(spatial)
    index = torch.arange(1, size + 1, dtype=weight.dtype, device=weight.device).reshape(1, 1, *spatial)
    where = unfold(module, index)[0].round().long()  # (L, K): the input position read, 1-based; 0 is zero padding
    picks = F.one_hot(where, size + 1)[..., 1:].to(weight.dtype)  # (L, K, positions)
    w = weight.reshape(module.out_channels, module.in_channels, -1)  # (o, c, K)
    return torch.einsum("ock,lkp->olcp", w, picks).reshape(module.out_channels * where.shape[0], -1)


class ConvSite(Site):
    """A convolution with its stock ``forward``."""

    kind = "conv"
    types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def __init__(self, name: str, module: nn.modules.conv._ConvNd, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        width = module.in_channels // module.groups * math.prod(module.kernel_size)
        side = InputSide(width) if module.groups == 1 else GroupedSide(width, module.groups)
        weight, bias = self.trained(module.weight), self.trained(module.bias)
        self.blocks = [Block(name, side, weight, bias, module.out_channels)]
        self._spatial = len(module.kernel_size)
        self._shapes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        self.replaces_forward = False  # set when planning: the small-map form (see the module docstring)

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if kwargs or len(args) != 1 or not tensor_batch(args[0], n) or args[0].dim() != self._spatial + 2:
            return None
        if not tensor_batch(output, n) or output.dim() != self._spatial + 2:
            return None
        self._in_shape = tuple(args[0].shape[1:])
        self._shapes.add((self._in_shape, tuple(output.shape[1:])))
        return [tuple(output.shape[1:])]

    def finish_plan(self, dtype: torch.dtype) -> None:
        super().finish_plan(dtype)
        for b in self.blocks:
            b.positions = sum(math.prod(call[0][1:]) for call in self.calls)
        m = self.module
        if not self.calls:
            return
        kernel = math.prod(m.kernel_size)
        size = math.prod(self._in_shape[1:])
        positions = math.prod(self.calls[0][0][1:])
        # one input shape in every call, no more arithmetic than the convolution (input positions at most the
        # kernel's), and the matrix (c_out · L · c_in · positions numbers) at most twice the weight
        self.replaces_forward = bool(
            self.blocks and self.blocks[0].weight is not None and m.groups == 1 and len(self._shapes) == 1
            and size <= kernel and positions * size <= 2 * kernel)

    def kept_numel(self) -> int:
        return len(self.calls) * math.prod(self._in_shape) if self.blocks[0].weight is not None else 0

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args[0] if self.blocks[0].weight is not None else None

    def probed_forward(self, probes: list[torch.Tensor] | None, store: list, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        m = self.module
        store.append(input)
        if probes is None:  # the whole-model Jacobian differentiates the weight: the stock convolution
            return m._conv_forward(input, m.weight, m.bias)
        (_, out_shape), = self._shapes
        out = (input.flatten(1) @ operator(m, tuple(input.shape[1:])).T).reshape(input.shape[0], *out_shape)
        if m.bias is not None:
            out = out + m.bias.reshape(-1, *(1,) * self._spatial)
        return out + probes[0]

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        g = grads[0]
        n, c, o = g.shape[:3]
        d = g.reshape(n, c, o, -1).transpose(2, 3)  # (n, C, L, o), a view
        a = unfold(self.module, kept) if kept is not None else g.new_empty((n, d.shape[2], 0))
        return [(a, d)], []
