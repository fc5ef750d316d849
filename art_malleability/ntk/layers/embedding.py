"""
``nn.Embedding``: one Kronecker block whose input side is the one-hot row of each position's token, kept as the token
indices (:class:`~art_malleability.ntk.layers.base.IndexSide`): the Gram of two examples' input sides counts equal
tokens, the projection takes columns, and the explicit gradient adds each position's output gradient into its token's
row. Positions at ``padding_idx`` have no gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from art_malleability.ntk.layers.base import Block, IndexSide, ParamGradient, ProbeShapes, Site, tensor_batch


class EmbeddingSite(Site):
    """An ``nn.Embedding`` with its stock ``forward``, without ``max_norm`` (which rewrites the weight in place) or
    ``scale_grad_by_freq`` (whose gradient depends on the batch)."""

    kind = "embedding"
    types = (nn.Embedding,)

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return super().accepts(module) and module.max_norm is None and not module.scale_grad_by_freq

    def __init__(self, name: str, module: nn.Embedding, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        self.blocks = [Block(name, IndexSide(module.num_embeddings, module.weight.dtype), self.trained(module.weight),
                             None, module.embedding_dim)]

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if kwargs or len(args) != 1 or not tensor_batch(args[0], n) or args[0].is_floating_point():
            return None
        if not tensor_batch(output, n) or output.shape[:-1] != args[0].shape:
            return None
        return [tuple(output.shape[1:])]

    def finish_plan(self, dtype: torch.dtype) -> None:
        super().finish_plan(dtype)
        for b in self.blocks:
            b.side = IndexSide(self.module.num_embeddings, dtype)
            b.positions = sum(math.prod(call[0][:-1]) for call in self.calls)

    def kept_numel(self) -> int:
        return sum(math.prod(call[0][:-1]) for call in self.calls)

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args[0]

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        g = grads[0]
        n, c, o = g.shape[0], g.shape[1], g.shape[-1]
        a = kept.reshape(n, -1)
        d = g.reshape(n, c, -1, o)
        pad = self.module.padding_idx
        if pad is not None:
            d = d * (a != pad).to(d.dtype)[:, None, :, None]
        return [(a, d)], []
