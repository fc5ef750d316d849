"""
The class-batched pass of the NTK engines: one forward pass with a zero probe added at every site's probed values
and one reverse pass batched over the ``C`` one-hot cotangents (``torch.func.jacrev``): the derivatives of the
outputs with respect to the probes are the sites' per-example output gradients for every class at once. Without
fallback parameters the pass runs on the whole batch (outputs summed over the examples, which the model treats
independently); with them it is ``vmap(jacrev(...))`` over the examples, which also gives those parameters'
per-example Jacobians. No per-example or per-class loop, no host synchronisation.

Hooks and replaced ``forward`` methods live only for the duration of the pass (restored in ``finally``); nothing of
the model is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from art_malleability.ntk.layers.attention import MathAttention
from art_malleability.ntk.layers.base import Site
from art_malleability.ntk.layers.plan import Plan

OutputFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_MISSING = object()


class InputChanged(Exception):
    """A tensor a site kept was changed in place after the site used it: keep copies instead."""


@dataclass
class PassResult:
    """
    One pass's outcome.

    :param kept: Per site, per call, what the site kept.
    :param grads: Per site, per call, per probe, its output gradients ``(n, C, *shape)`` (views where possible).
    :param jac: The fallback parameters' Jacobian ``(n, C, P)`` in the plan's order, or ``None``.
    """

    kept: list[list[Any]]
    grads: list[list[list[torch.Tensor]]]
    jac: torch.Tensor | None


class _State:
    """A site's part of one forward pass."""

    def __init__(self, site: Site) -> None:
        self.site = site
        self.count = 0
        self.kept: list[Any] = []

    def next_call(self) -> int:
        j = self.count
        if j >= len(self.site.calls):
            raise RuntimeError(f"model must call every layer the same number of times in each forward pass, got "
                               f"{self.site.name} called more than the {len(self.site.calls)} time(s) seen when "
                               "planning")
        self.count += 1
        return j


@contextlib.contextmanager
def installed(plan: Plan, states: list[_State], probes: list[list[list[torch.Tensor]]] | None,
              clone_inputs: bool = False, versions: list | None = None) -> Iterator[None]:
    """
    The pass's hooks and replaced forwards, and the written-out attention; ``probes=None`` installs only what makes
    the model ``vmap``-able (the replaced forwards without probes, the attention), for the whole-model Jacobian.
    """
    handles, patched = [], []

    def keep(value: Any) -> Any:
        if clone_inputs:
            value = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)
        elif versions is not None:
            versions.extend((t, t._version) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        return value

    def hook(state: _State, k: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        j = state.next_call()
        state.kept.append(keep(state.site.keep(args, kwargs)))
        return output + probes[k][j][0]

    def forward(state: _State, k: int, *args: Any, **kwargs: Any) -> Any:
        j = state.next_call()
        site_probes = None if probes is None or not probes[k] else probes[k][j]
        store: list = []
        out = state.site.probed_forward(site_probes, store, *args, **kwargs)
        state.kept.append(keep(store[0]))
        return out

    try:
        for k, (site, state) in enumerate(zip(plan.sites, states, strict=True)):
            module = site.module
            if site.replaces_forward:
                patched.append((module, module.__dict__.get("forward", _MISSING)))
                module.forward = _partial(forward, state, k)
            elif probes is not None and site.params:
                handles.append(module.register_forward_hook(_partial(hook, state, k), prepend=True,
                                                            with_kwargs=True))
        with MathAttention() if plan.attention else contextlib.nullcontext():
            yield
    finally:
        for h in handles:
            h.remove()
        for module, old in patched:
            if old is _MISSING:
                del module.forward
            else:
                module.forward = old


def _partial(fn: Callable, *bound: Any) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*bound, *args, **kwargs)

    return call


def _check_calls(plan: Plan, states: list[_State]) -> None:
    for site, state in zip(plan.sites, states, strict=True):
        if state.count != len(site.calls):
            raise RuntimeError(f"model must call every layer the same number of times in each forward pass, got "
                               f"{site.name} called {state.count} time(s) where planning saw {len(site.calls)}")


def probed_pass(plan: Plan, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, output_fn: OutputFn,
                zeros: dict | None = None, clone_inputs: bool = False) -> PassResult:
    """
    One class-batched pass over a batch (see the module docstring).

    :param plan: The model's plan.
    :param model: The model (in evaluation mode).
    :param x: Inputs ``(n, ...)`` in the model's dtype and device.
    :param y: Labels passed to ``output_fn``, or ``None``.
    :param output_fn: ``(model outputs, labels) -> (n, C)``.
    :param zeros: Zero probes by shape, kept between calls (filled here; never written to).
    :param clone_inputs: Keep copies of the sites' inputs; otherwise they are kept as they are, and the pass raises
        :class:`InputChanged` if the forward pass changed one in place after its site used it.
    :return: The sites' kept inputs and output gradients, and the fallback parameters' Jacobian.
    :raises InputChanged: If a kept input was changed in place (without ``clone_inputs``).
    """
    n = x.shape[0]
    zeros = {} if zeros is None else zeros
    lead = 1 if plan.vmapped else n

    def zero(shape: tuple[int, ...]) -> torch.Tensor:
        z = zeros.get(shape)
        if z is None or z.dtype != x.dtype or z.device != x.device:
            z = zeros[shape] = x.new_zeros(shape)
        return z

    layout = [[len(call) for call in site.calls] if site.params else [] for site in plan.sites]
    flat_probes = [zero((lead, *shape)) for site in plan.sites if site.params for call in site.calls for shape in call]
    spec: dict[str, Any] = {}

    def nested(values: list[torch.Tensor]) -> list[list[list[torch.Tensor]]]:
        it = iter(values)
        return [[[next(it) for _ in range(count)] for count in calls] for calls in layout]

    def run(values: list[torch.Tensor], forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list]:
        states = [_State(site) for site in plan.sites]
        versions: list | None = None if clone_inputs else []
        with installed(plan, states, nested(values), clone_inputs, versions):
            g = forward()
        _check_calls(plan, states)
        if versions and any(t._version != v for t, v in versions):
            raise InputChanged
        leaves, spec["tree"] = tree_flatten([s.kept for s in states])
        spec["leaves"] = leaves
        return g, [t for t in leaves if isinstance(t, torch.Tensor)]

    jac = None
    with torch.no_grad():
        if not plan.vmapped:

            def whole(values: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
                g, aux = run(values, lambda: output_fn(model(x), y))
                return g.sum(0), aux

            d, aux = jacrev(whole, has_aux=True)(flat_probes)
            grads = [dk.transpose(0, 1) for dk in d]  # (C, n, *shape) -> (n, C, *shape)
        else:
            names = [name for name, _ in plan.fallback]
            params = {name: p.detach() for name, p in plan.fallback}

            def single(values: list[torch.Tensor], p: dict[str, torch.Tensor], xi: torch.Tensor,
                       *yi: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list]:
                labels = yi[0].unsqueeze(0) if yi else None
                g, aux = run(values, lambda: output_fn(functional_call(model, p, (xi.unsqueeze(0),)), labels))
                return g.reshape(-1), [t.squeeze(0) for t in aux]

            args: tuple = (flat_probes, params, x) if y is None else (flat_probes, params, x, y)
            in_dims: tuple = (None, None, 0) if y is None else (None, None, 0, 0)
            (d, jd), aux = vmap(jacrev(single, argnums=(0, 1), has_aux=True), in_dims=in_dims)(*args)
            grads = [dk.squeeze(2) for dk in d]  # (n, C, 1, *shape) -> (n, C, *shape)
            parts = [jd[name].reshape(n, jd[name].shape[1], -1) for name in names]
            jac = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    it = iter(aux)
    leaves = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in spec["leaves"]]
    kept = tree_unflatten(leaves, spec["tree"])
    return PassResult(kept, nested(grads), jac)


@contextlib.contextmanager
def vmappable(plan: Plan) -> Iterator[None]:
    """The replaced forwards (without probes) and the written-out attention, so that ``torch.func``'s per-example
    Jacobian of the whole model can run (``method="jacobian"``)."""
    states = [_State(site) for site in plan.sites]

    class _Endless(_State):
        def next_call(self) -> int:
            return 0

    states = [_Endless(site) for site in plan.sites]
    with installed(plan, states, None):
        yield
