"""
Normalisation layers with an elementwise affine map, ``y = x̂ ⊙ w + b``: batch norms in evaluation mode (``x̂`` from
the running statistics), layer norms, group norms and RMS norms (``x̂`` from the example itself). The per-example
gradients of output ``c`` are ``Σ δ_c ⊙ x̂`` (scale) and ``Σ δ_c`` (shift), summed over the dimensions the
parameters are broadcast along: two reductions, always explicit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from art_malleability.ntk.layers.base import ParamGradient, ProbeShapes, Site, stock_forward, tensor_batch


class NormSite(Site):
    """The shared rules: one input, an output of its shape, parameters along :meth:`param_dims`."""

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if kwargs or len(args) != 1 or not tensor_batch(args[0], n) or args[0].dim() < 2:
            return None
        if not isinstance(output, torch.Tensor) or output.shape != args[0].shape or not self.usable(args[0]):
            return None
        return [tuple(output.shape[1:])]

    def usable(self, x: torch.Tensor) -> bool:
        return True

    def kept_numel(self) -> int:
        return sum(math.prod(call[0]) for call in self.calls) if self.trained(self.module.weight) is not None else 0

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args[0] if self.trained(self.module.weight) is not None else None

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        """``x̂``, the input before the affine map."""
        raise NotImplementedError

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``(n, C, *shape)`` over the dimensions the parameters are broadcast along: ``(n, C, numel)``."""
        raise NotImplementedError

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        g = grads[0]
        out: list[ParamGradient] = []
        weight, bias = self.trained(self.module.weight), self.trained(getattr(self.module, "bias", None))
        if weight is not None:
            out.append((weight, self.reduce(g * self.normalised(kept).unsqueeze(1))))
        if bias is not None:
            out.append((bias, self.reduce(g)))
        return [], out


class ChannelNorm(NormSite):
    """Norms with one parameter per channel (dimension 1)."""

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t.flatten(3).sum(3) if t.dim() > 3 else t


class BatchNormSite(ChannelNorm):
    """``nn.BatchNorm1d/2d/3d`` in evaluation mode, with running statistics and an affine map."""

    kind = "batchnorm"
    types = (_BatchNorm,)

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return (isinstance(module, _BatchNorm) and stock_forward(module, _BatchNorm) and module.affine
                and module.track_running_stats and module.running_mean is not None
                and module.running_var is not None)

    def usable(self, x: torch.Tensor) -> bool:
        return not self.module.training

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = torch.rsqrt(m.running_var + m.eps).to(x.dtype)
        return (x - m.running_mean.to(x.dtype).view(shape)) * scale.view(shape)


class GroupNormSite(ChannelNorm):
    """``nn.GroupNorm`` with an affine map."""

    kind = "groupnorm"
    types = (nn.GroupNorm,)

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return super().accepts(module) and module.affine

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.module.num_groups, None, None, self.module.eps)


class TrailingNorm(NormSite):
    """Norms over the trailing ``normalized_shape`` dimensions, one parameter per element of it."""

    def usable(self, x: torch.Tensor) -> bool:
        shape = tuple(self.module.normalized_shape)
        return x.dim() > len(shape) and tuple(x.shape[-len(shape):]) == shape

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        k = len(self.module.normalized_shape)
        n, c = t.shape[:2]
        return t.reshape(n, c, -1, math.prod(t.shape[t.dim() - k:])).sum(2)


class LayerNormSite(TrailingNorm):
    """``nn.LayerNorm`` with an elementwise affine map."""

    kind = "layernorm"
    types = (nn.LayerNorm,)

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return super().accepts(module) and module.elementwise_affine

    def normalised(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.module.normalized_shape, None, None, self.module.eps)


NORM_KINDS: list[type[Site]] = [BatchNormSite, LayerNormSite, GroupNormSite]

if hasattr(nn, "RMSNorm"):  # torch >= 2.4

    class RMSNormSite(TrailingNorm):
        """``nn.RMSNorm`` with an elementwise affine map."""

        kind = "rmsnorm"
        types = (nn.RMSNorm,)

        @classmethod
        def accepts(cls, module: nn.Module) -> bool:
            return super().accepts(module) and module.elementwise_affine

        def normalised(self, x: torch.Tensor) -> torch.Tensor:
            return F.rms_norm(x, self.module.normalized_shape, None, self.module.eps)

    NORM_KINDS.append(RMSNormSite)
