"""
``nn.Linear`` on inputs of any rank ``(n, *, in)``: one Kronecker block over the ``L = ∏ *`` positions of every call,
``a_l`` the input row and ``Δ_l`` the output gradients (positions of several calls are concatenated).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from art_malleability.ntk.layers.base import Block, InputSide, ParamGradient, ProbeShapes, Site, tensor_batch


class LinearSite(Site):
    """An ``nn.Linear`` layer (or a subclass that keeps its ``forward``, such as attention's output projection)."""

    kind = "linear"
    types = (nn.Linear,)

    def __init__(self, name: str, module: nn.Linear, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        weight, bias = self.trained(module.weight), self.trained(module.bias)
        self.blocks = [Block(name, InputSide(module.in_features), weight, bias, module.out_features)]

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if kwargs or len(args) != 1 or not tensor_batch(args[0], n) or args[0].dim() < 2:
            return None
        if not tensor_batch(output, n) or output.shape[:-1] != args[0].shape[:-1]:
            return None
        return [tuple(output.shape[1:])]

    def finish_plan(self, dtype: torch.dtype) -> None:
        super().finish_plan(dtype)
        for b in self.blocks:
            b.positions = sum(math.prod(call[0][:-1]) for call in self.calls)

    def kept_numel(self) -> int:
        return self.blocks[0].positions * self.module.in_features if self.blocks[0].weight is not None else 0

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args[0] if self.blocks[0].weight is not None else None

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        g = grads[0]
        n, c, o = g.shape[0], g.shape[1], g.shape[-1]
        d = g.reshape(n, c, -1, o)
        a = kept.reshape(n, -1, kept.shape[-1]) if kept is not None else g.new_empty((n, d.shape[2], 0))
        return [(a, d)], []
