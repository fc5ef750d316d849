"""
The plan of a model for the NTK engines: which site (tracked module) gives each trained parameter's per-example
Jacobian, found by one forward pass on a few examples.

- Every module is offered to the registry's kinds (:data:`KINDS`, in order) from the root down; a kind that covers
  its module's children (attention) takes the whole subtree. A module no kind accepts that owns trained parameters
  and has no trained descendants becomes a :class:`~art_malleability.ntk.layers.module.ModuleSite` (the batched
  path of its own parameters); so does a kind's module whose calls its kind cannot handle.
- The probe pass checks each call of each site (:meth:`~art_malleability.ntk.layers.base.Site.check`) and records,
  with a ``TorchFunctionMode``, *where every trained parameter is used* (a call that takes it and gives a result
  that depends on it, gradients enabled): inside the call of which site, or outside any. A parameter is left to its
  sites only when every use is inside a call of a site that covers it; a parameter covered by several sites (tied
  weights) takes the explicit form in each, and the gradients are added. Any other used parameter (a free-standing
  parameter of a module's own ``forward``: class tokens, position embeddings, layer scales; a weight used outside
  its module) is a *fallback* parameter: its per-example Jacobian comes from the same class-batched pass run under
  ``vmap`` over the examples. A parameter no pass uses has a zero Jacobian.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from art_malleability.ntk._memory import OutputElements
from art_malleability.ntk.layers.attention import AttentionSite
from art_malleability.ntk.layers.base import Block, Site
from art_malleability.ntk.layers.conv import ConvSite
from art_malleability.ntk.layers.embedding import EmbeddingSite
from art_malleability.ntk.layers.linear import LinearSite
from art_malleability.ntk.layers.module import ModuleSite
from art_malleability.ntk.layers.norm import NORM_KINDS
from art_malleability.ntk.layers.recurrent import RecurrentSite

logger = logging.getLogger("art_malleability.ntk.empirical")

#: The layer kinds, in the order a module is offered to them. A new kind is one module of this package and one entry.
KINDS: list[type[Site]] = [LinearSite, ConvSite, EmbeddingSite, *NORM_KINDS, AttentionSite, RecurrentSite]


@dataclass
class Plan:
    """
    What the probe pass found.

    :param sites: The tracked modules, in registration order (those with no trained parameter left only rewrite a
        forward that ``vmap`` cannot run: a recurrent layer's).
    :param fallback: The parameters whose per-example Jacobians come from the pass under ``vmap``.
    :param unused: Names of trained parameters that no forward pass used (their Jacobian is zero).
    :param attention: Whether the model calls ``scaled_dot_product_attention`` (computed written out in a pass).
    :param forward_size: Numbers one example's forward pass creates: in all, and the largest tensor.
    :param output: The model's outputs on the probe examples.
    """

    sites: list[Site]
    fallback: list[tuple[str, nn.Parameter]]
    unused: list[str] = field(default_factory=list)
    attention: bool = False
    forward_size: tuple[int, int] = (0, 0)
    output: torch.Tensor | None = None

    @property
    def blocks(self) -> list[Block]:
        """Every Kronecker block, site by site."""
        return [b for s in self.sites for b in s.blocks]

    @property
    def vmapped(self) -> bool:
        """Whether the pass runs under ``vmap`` over the examples (fallback parameters)."""
        return bool(self.fallback)

    def describe(self) -> list[dict[str, Any]]:
        """:return: One dict per site (name, kind, calls, its blocks with their form), and one for the fallback."""
        out = [{"name": s.name, "kind": s.kind, "calls": len(s.calls),
                "blocks": [{"name": b.name, "positions": b.positions, "d_in": b.d_in, "d_out": b.d_out,
                            "form": "structured" if b.structured else "explicit"} for b in s.blocks],
                "explicit_parameters": s.explicit_numel()} for s in self.sites if s.params]
        if self.fallback:
            out.append({"name": "fallback", "kind": "fallback", "parameters": [n for n, _ in self.fallback]})
        return out


class _Uses(TorchFunctionMode):
    """Records, for every call of a torch function, which watched parameters it takes and inside which site."""

    def __init__(self, watched: set[int], stack: list[int]) -> None:
        super().__init__()
        self.watched, self.stack = watched, stack
        self.uses: dict[int, set[int | None]] = {}
        self.attention = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.attention = True
        out = func(*args, **kwargs)
        # a use is a call that takes the parameter and gives a result that depends on it differentiably (not
        # ``.dtype``, ``.shape``, ``detach``, ``zeros_like``, ...): the pass runs with gradients enabled
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(out)[0]):
            where = self.stack[-1] if self.stack else None
            for leaf in tree_flatten((args, kwargs))[0]:
                if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                    self.uses.setdefault(id(leaf), set()).add(where)
        return out


def _candidates(model: nn.Module, wanted: Callable[[nn.Parameter], bool]) -> tuple[list[Site], list]:
    """The sites the registry offers (kinds first, then module sites) and the free parameters of modules with
    trained descendants (the root's own included)."""
    sites: list[Site] = []
    free: list[tuple[str, nn.Parameter]] = []
    claimed: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in claimed:
            continue
        kind = next((k for k in KINDS if k.accepts(module)), None)
        if kind is not None:
            params = Site.own_parameters(name, module, wanted, kind.covers_children)
            if params or kind.replaces_forward:
                sites.append(kind(name, module, params))
            if kind.covers_children:
                claimed.update(id(m) for m in module.modules())
            continue
        own = Site.own_parameters(name, module, wanted, children=False)
        if not own:
            continue
        inner = any(wanted(p) for child in module.children() for p in child.parameters())
        if module is model or inner:
            free.extend(own)
        else:
            sites.append(ModuleSite(name, module, own))
    return sites, free


def plan_model(model: nn.Module, x_probe: torch.Tensor, wanted: Callable[[nn.Parameter], bool]) -> Plan:
    """
    Plan the per-layer treatment of ``model`` from one forward pass on ``x_probe`` (see the module docstring).

    :param model: The model (in evaluation mode).
    :param x_probe: A few inputs (two are enough).
    :param wanted: Whether a trainable parameter counts.
    :return: The plan.
    """
    trained = {id(p): (name, p) for name, p in model.named_parameters() if wanted(p)}
    sites, free = _candidates(model, wanted)
    for k, s in enumerate(sites):
        s.candidate = k
    n = x_probe.shape[0]
    stack: list[int] = []
    records: list[list[tuple]] = [[] for _ in sites]

    def enter(k: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        stack.append(k)

    def leave(k: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stack.pop()
        records[k].append((args, kwargs, output))

    handles = []
    uses = _Uses(set(trained), stack)
    try:
        for k, s in enumerate(sites):
            handles.append(s.module.register_forward_pre_hook(_bound(enter, k), with_kwargs=True))
            handles.append(s.module.register_forward_hook(_bound(leave, k), with_kwargs=True))
        with OutputElements() as sizes, torch.enable_grad(), uses:
            out = model(x_probe).detach()
    finally:
        for h in handles:
            h.remove()
    accepted = _checked(sites, records, n)
    fallback = _resolve(accepted, free, uses.uses, trained)
    for s in accepted:
        s.finish_plan(x_probe.dtype)
    unused = [name for pid, (name, _) in trained.items() if pid not in uses.uses]
    plan = Plan([s for s in accepted if s.params or s.replaces_forward], fallback, unused, uses.attention,
                (-(-sizes.total // n), -(-sizes.largest // n)), out)
    logger.debug("eNTK plan: sites %s; fallback %s; unused %s",
                 [(s.name, s.kind, [(b.name, b.positions) for b in s.blocks]) for s in plan.sites],
                 [name for name, _ in fallback], unused)
    return plan


def _bound(fn: Callable, k: int) -> Callable:
    def hook(*args: Any) -> Any:
        return fn(k, *args)

    return hook


def _checked(sites: list[Site], records: list[list[tuple]], n: int) -> list[Site]:
    """The sites whose every call their kind handles; the others as module sites where those can, else dropped (their
    parameters become free: :func:`_resolve` finds their uses outside any site)."""
    accepted = []
    for site, calls in zip(sites, records, strict=True):
        if not calls:
            continue
        shapes = [site.check(args, kwargs, out, n) for args, kwargs, out in calls]
        if all(s is not None for s in shapes):
            site.calls = shapes
            accepted.append(site)
            continue
        if not site.params:
            continue
        module_site = ModuleSite(site.name, site.module, site.params)
        module_site.candidate = site.candidate
        shapes = [module_site.check(args, kwargs, out, n) for args, kwargs, out in calls]
        if all(s is not None for s in shapes):
            module_site.calls = shapes
            accepted.append(module_site)
            logger.debug("eNTK plan: %s (%s) takes the module path: a call its kind cannot handle", site.name,
                         site.kind)
    return accepted


def _resolve(sites: list[Site], free: list, uses: dict[int, set[int | None]], trained: dict) -> list:
    """
    Leave each parameter to the sites that cover it where every use is inside their calls (tied: explicit in each);
    the others that are used become fallback parameters, in the model's order.
    """
    covering: dict[int, list[int]] = {}
    for k, s in enumerate(sites):
        for _, p in s.params:
            covering.setdefault(id(p), []).append(k)
    fallback_ids = set()
    for pid in trained:
        where = uses.get(pid, set())
        owners = covering.get(pid, [])
        if owners and where <= {sites[k].candidate for k in owners}:
            if len(owners) > 1:
                for k in owners:
                    sites[k].mark_tied(trained[pid][1])
            continue
        for k in owners:
            sites[k].drop(trained[pid][1])
        if where:
            fallback_ids.add(pid)
    return [(name, p) for pid, (name, p) in trained.items() if pid in fallback_ids]
