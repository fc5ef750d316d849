"""
Convolutions (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``; any stride, dilation, padding and padding mode): one
Kronecker block over the output positions, ``a_l`` the unfolded input patch and ``Δ_l`` the output gradients at
position ``l``, as Opacus and kronfluence compute per-example convolution gradients. A grouped or depthwise
convolution's weight gradient is one batched product per group (:class:`~art_malleability.ntk.layers.base.GroupedSide`)
and stays explicit.
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

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if kwargs or len(args) != 1 or not tensor_batch(args[0], n) or args[0].dim() != self._spatial + 2:
            return None
        if not tensor_batch(output, n) or output.dim() != self._spatial + 2:
            return None
        self._in_shape = tuple(args[0].shape[1:])
        return [tuple(output.shape[1:])]

    def finish_plan(self, dtype: torch.dtype) -> None:
        super().finish_plan(dtype)
        for b in self.blocks:
            b.positions = sum(math.prod(call[0][1:]) for call in self.calls)

    def kept_numel(self) -> int:
        return len(self.calls) * math.prod(self._in_shape) if self.blocks[0].weight is not None else 0

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args[0] if self.blocks[0].weight is not None else None

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        g = grads[0]
        n, c, o = g.shape[:3]
        d = g.reshape(n, c, o, -1).transpose(2, 3)  # (n, C, L, o), a view
        a = unfold(self.module, kept) if kept is not None else g.new_empty((n, d.shape[2], 0))
        return [(a, d)], []
