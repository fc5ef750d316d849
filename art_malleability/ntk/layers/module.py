"""
Any other module with trained parameters of its own that the registry does not know (a custom layer, a layer norm
subclass with its own ``forward``, a transposed convolution, ...), called on tensors that hold the examples along
their first dimension: the batched path of its own parameters. Its output gradients ``δ_c`` come from the pass's
probe like any other site's; the per-example gradients of its parameters are then the vector-Jacobian products of
*the module alone* with them, ``vmap`` over the examples and the classes of ``vjp(functional_call(module, ...))``:
one more forward of the module and one class-batched backward, no loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from art_malleability.ntk.layers.base import ParamGradient, ProbeShapes, Site, tensor_batch


class ModuleSite(Site):
    """A module whose own parameters (and its children's, with :attr:`covers_children`) take the module-local
    vector-Jacobian product. Not in the registry's kinds: the plan gives it the modules no kind accepts."""

    kind = "module"

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        self._prefix = f"{name}." if name else ""

    @property
    def _relative(self) -> list[tuple[str, nn.Parameter]]:
        return [(qualified[len(self._prefix):], p) for qualified, p in self.params]

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if not args or not all(tensor_batch(a, n) for a in args):
            return None
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()) or not tensor_batch(output, n):
            return None
        return [tuple(output.shape[1:])]

    def kept_numel(self) -> int:
        return 0  # the inputs are kept as the model holds them

    def keep(self, args: tuple, kwargs: dict) -> Any:
        return args, kwargs

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        args, kwargs = kept
        d = grads[0]  # (n, C, *out)
        n, c = d.shape[:2]
        values = {rel: p.detach() for rel, p in self._relative}
        module = self.module

        def one(xs: tuple[torch.Tensor, ...], di: torch.Tensor) -> dict[str, torch.Tensor]:
            def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                return functional_call(module, p, tuple(a.unsqueeze(0) for a in xs), kwargs)

            _, back = vjp(f, values)
            return vmap(lambda dc: back(dc.unsqueeze(0))[0])(di)

        with torch.no_grad():
            per = vmap(one)(tuple(a.detach() for a in args), d)
        return [], [(p, per[rel].reshape(n, c, -1)) for rel, p in self._relative]
