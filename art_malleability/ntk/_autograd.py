"""
The whole-model per-example Jacobian of the NTK engines (``torch.func``, exact for any model whose forward pass
``vmap`` can run: :func:`~art_malleability.ntk.layers.passes.vmappable` makes the registry's replaced forwards
available to it), and the check of a model given to them. The per-layer factors come from the layer registry
(:mod:`art_malleability.ntk.layers`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from art_malleability._utils.torch_utils import model_device_dtype, trainable_parameters

OutputFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]



def check_model(model: object) -> tuple[torch.device, torch.dtype]:
    """
    Check that ``model`` is a module with trainable parameters.

    :param model: The candidate.
    :return: The model's ``(device, dtype)``.
    :raises TypeError: If it is not a :class:`torch.nn.Module`.
    :raises ValueError: If none of its parameters has ``requires_grad=True``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not trainable_parameters(model):
        raise ValueError("model must have trainable parameters, got none with requires_grad=True")
    return model_device_dtype(model)


def per_example_jacobian(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    output_fn: OutputFn | None = None,
) -> torch.Tensor:
    """
    Per-example Jacobians of the model outputs with respect to some of its parameters, with
    ``torch.func.vmap(torch.func.jacrev(...))`` over ``functional_call`` (exact for any model whose
    forward pass treats examples independently).

    :param model: The model.
    :param params: ``(name, parameter)`` pairs to differentiate (the others are held fixed).
    :param x: Inputs ``(n, ...)``.
    :param y: Labels passed to ``output_fn``, or ``None``.
    :param output_fn: Map ``(outputs, labels) -> (n, C)`` applied after the model; ``None`` keeps the outputs.
    :return: ``(n, C, P)`` with the parameters flattened and concatenated in the order given.
    """
    names = [name for name, _ in params]
    values = {name: p.detach() for name, p in params}

    def head(out: torch.Tensor, yi: torch.Tensor | None) -> torch.Tensor:
        return (out if output_fn is None else output_fn(out, yi)).reshape(-1)

    if y is None:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), None)

        args: tuple = (values, x)
        in_dims: tuple = (None, 0)
    else:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        args = (values, x, y)
        in_dims = (None, 0, 0)

    with torch.no_grad():
        jd = vmap(jacrev(single), in_dims=in_dims)(*args)
    n = x.shape[0]
    return torch.cat([jd[name].reshape(n, jd[name].shape[1], -1) for name in names], dim=2)
