"""
What every layer kind of the registry gives the NTK engines: a :class:`Site` (one tracked module: where its probes
go, what a pass keeps of its inputs, and its per-example Jacobian factors), and the :class:`Block` (a weight and its
bias whose per-example Jacobian is Kronecker-factored, ``J_c = Σ_l Δ_{l,c} ⊗ a_l`` over the positions ``l``) with the
:class:`InputSide` that says how the block's input side is stored, multiplied and projected.

A *probe* is a zero tensor added to a value the module computes (its output, or for the modules whose forward the
kind replaces, an internal pre-activation): the derivative of output ``c`` of the model with respect to a probe is
the per-example output gradient ``δ_c`` of that value, which one class-batched reverse pass gives for every probe at
once (:mod:`~art_malleability.ntk.layers.passes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

#: Per call of a module: the shapes of one example's probes.
ProbeShapes = list[tuple[int, ...]]
#: Per-example gradients of one parameter for every output: ``(parameter, (n, C, numel))``.
ParamGradient = tuple[nn.Parameter, torch.Tensor]


class InputSide:
    """
    The input side ``a`` of a Kronecker-factored block, dense ``(n, L, width)``: its Gram matrix over position rows,
    its projection, and the weight's per-example gradient ``Σ_l Δ_l ⊗ a_l`` in the weight's layout ``(o, width)``.
    """

    #: Whether the block may take the structured form (its factors kept and contracted position pair by pair).
    structured: bool = True
    #: Whether the weight is laid out ``(width, o)`` (an embedding) rather than ``(o, width)``.
    transposed: bool = False

    def __init__(self, width: int) -> None:
        self.width = int(width)

    def gram(self, a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
        """``(n1·L1, n2·L2)`` inner products of the position rows of two batches."""
        return a1.reshape(-1, a1.shape[-1]) @ a2.reshape(-1, a2.shape[-1]).T

    def project(self, a: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        """``(n, L, k)``: each position row times ``pᵀ`` (``None``: the identity)."""
        return a if p is None else a @ p.T

    def weight_gradient(self, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """
        :param a: ``(n, L, width)``.
        :param d: Output gradients ``(n, C, L, o)`` (any strides).
        :return: ``(n, C, o·width)``: one batched product with the classes folded in.
        """
        n, c, length, o = d.shape
        g = d.transpose(2, 3).reshape(n, c * o, length)
        return torch.bmm(g, a).reshape(n, c, -1)

    def dense(self, a: torch.Tensor) -> torch.Tensor:
        """The side as a dense ``(n, L, width)`` tensor."""
        return a

    def ones(self, a: torch.Tensor) -> torch.Tensor:
        """A column of ones ``(n, L, 1)`` beside ``a`` (the bias's input side)."""
        return torch.ones(a.shape[:2] + (1,), dtype=self.dtype_of(a), device=a.device)

    def dtype_of(self, a: torch.Tensor) -> torch.dtype:
        return a.dtype


class GroupedSide(InputSide):
    """
    A grouped (or depthwise) convolution's unfolded input ``(n, L, groups·width)``: the weight's gradient is one
    batched product per group (``(n·g, C·o/g, L) @ (n·g, L, width)``); the block is always explicit (the structured
    form's position pairs would run over every group).
    """

    structured = False

    def __init__(self, width: int, groups: int) -> None:
        super().__init__(width)
        self.groups = int(groups)

    def weight_gradient(self, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        n, c, length, o = d.shape
        g = self.groups
        # d: (n, C, L, g, o/g) -> (n, g, C·o/g, L); a: (n, L, g, width) -> (n, g, L, width)
        dd = d.reshape(n, c, length, g, o // g).permute(0, 3, 1, 4, 2).reshape(n * g, c * (o // g), length)
        aa = a.reshape(n, length, g, self.width).transpose(1, 2).reshape(n * g, length, self.width)
        out = torch.bmm(dd, aa).reshape(n, g, c, o // g, self.width)  # (n, g, C, o/g, width)
        return out.transpose(1, 2).reshape(n, c, -1)  # the weight's layout (o, width), o = g · o/g


@dataclass
class Block:
    """
    A weight and its bias (either may be absent or frozen) whose per-example Jacobian is ``Σ_l Δ_{l,c} ⊗ a_l`` with
    the input side ``a`` extended by a one for the bias. One block owns its parameters whole.

    :param name: The block's name (the module's, with a suffix where it has several).
    :param side: How the input side is held.
    :param weight: The trained weight, or ``None``.
    :param bias: The trained bias, or ``None``.
    :param d_out: Output-side size ``o``.
    """

    name: str
    side: InputSide
    weight: nn.Parameter | None
    bias: nn.Parameter | None
    d_out: int
    #: Positions ``L`` of one example over all of the module's calls (set when planning).
    positions: int = 0
    #: The form the exact engine uses (set when planning): kept factors (structured) or explicit gradients.
    structured: bool = False
    #: Whether the explicit form is the only one allowed (a parameter shared with another module).
    explicit_only: bool = False

    @property
    def d_in(self) -> int:
        """Input-side columns: the weight's (when trained) plus one for a trained bias."""
        return (self.side.width if self.weight is not None else 0) + (1 if self.bias is not None else 0)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def gram_width(self) -> int:
        """Multiply-adds of one pair of position rows' input-side product (one for an index side)."""
        return 1 if self.weight is not None and self.bias is None and isinstance(self.side, IndexSide) else self.d_in

    def may_structure(self) -> bool:
        """Whether the block may take the structured form (and a Kronecker projection)."""
        return not self.explicit_only and (self.weight is None or self.side.structured)

    def input_side(self, a: torch.Tensor) -> torch.Tensor:
        """The stored input side ``(n, L, d_in)``: ``a`` with a column of ones for a trained bias (only ones without
        a trained weight); an index side (an embedding, no bias) as it is."""
        if self.weight is None:
            return self.side.ones(a)
        if self.bias is None:
            return a
        return torch.cat([a, self.side.ones(a)], dim=2)

    def gram(self, a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
        """Inner products of the stored input sides' position rows (``a`` as :meth:`input_side` gives it)."""
        if self.weight is not None and self.bias is None:
            return self.side.gram(a1, a2)
        return a1.reshape(-1, a1.shape[-1]) @ a2.reshape(-1, a2.shape[-1]).T

    def explicit(self, a: torch.Tensor, d: torch.Tensor) -> list[ParamGradient]:
        """
        :param a: The input side as the site gives it (``(n, L, width)``, or the indices of an embedding).
        :param d: Output gradients ``(n, C, L, o)``.
        :return: Per-example gradients of the block's trained parameters, each in its own layout.
        """
        out = []
        n, c = d.shape[:2]
        if self.weight is not None:
            out.append((self.weight, self.side.weight_gradient(a, d)))
        if self.bias is not None:
            out.append((self.bias, d.sum(2).reshape(n, c, -1)))
        return out


class IndexSide(InputSide):
    """
    An embedding's input side: the token indices ``(n, L)`` stand for one-hot rows of width ``vocab``, never formed.
    Gram: equal tokens; projection: the columns of ``p`` at the tokens; the weight's ``(vocab, o)`` gradient: the
    output gradients added into the tokens' rows. Positions at ``padding_idx`` have no gradient (the site zeroes
    their output gradients).
    """

    transposed = True

    def __init__(self, vocab: int, dtype: torch.dtype) -> None:
        super().__init__(vocab)
        self._dtype = dtype

    def dtype_of(self, a: torch.Tensor) -> torch.dtype:
        return self._dtype

    def gram(self, a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
        return (a1.reshape(-1, 1) == a2.reshape(1, -1)).to(self._dtype)

    def project(self, a: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        if p is None:
            return self.dense(a)
        return p.T[a]  # (n, L, k)

    def dense(self, a: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(a, self.width).to(self._dtype)

    def weight_gradient(self, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        n, c, length, o = d.shape
        out = d.new_zeros((n, c, self.width, o))
        index = a.reshape(n, 1, length, 1).expand(n, c, length, o)
        return out.scatter_add_(2, index, d).reshape(n, c, -1)  # the weight's layout (vocab, o)


def stock_forward(module: nn.Module, base: type) -> bool:
    """Whether ``module`` runs ``base``'s own ``forward`` (not a subclass's)."""
    return type(module).forward is base.forward


def tensor_batch(value: Any, n: int) -> bool:
    """Whether ``value`` is a tensor whose first dimension holds the ``n`` examples."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == n


class Site:
    """
    One tracked module of the model: its kind's rules for where probes go, what a pass keeps, and the factors.

    Subclasses set :attr:`kind` and :attr:`types`, and give :meth:`check` (is one call usable; the probe shapes),
    :meth:`keep` (what a pass keeps of a call's inputs) and :meth:`factors` (the call's Kronecker factors per block,
    and the explicit gradients of its other parameters). Kinds that replace the module's forward during a pass (to
    probe values inside it) set :attr:`replaces_forward` and give :meth:`probed_forward` instead of :meth:`keep`.

    :param name: The module's qualified name.
    :param module: The module.
    :param params: The trained parameters the site covers (qualified names), all used only in its calls.
    """

    kind: ClassVar[str] = ""
    types: ClassVar[tuple[type, ...]] = ()
    replaces_forward: ClassVar[bool] = False
    #: Whether the site covers the parameters of the module's children too (a module whose forward uses them).
    covers_children: ClassVar[bool] = False

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        self.name = name
        self.module = module
        self.params = params
        self.calls: list[ProbeShapes] = []
        self.blocks: list[Block] = []
        self.candidate = -1  # the index the plan's probe pass knows the site by

    def mark_tied(self, p: nn.Parameter) -> None:
        """``p`` is covered by another site too: the blocks holding it take the explicit form."""
        for b in self.blocks:
            if any(q is p for q in b.params):
                b.explicit_only = True

    def drop(self, p: nn.Parameter) -> None:
        """Stop covering ``p`` (it is used outside the site's calls: the fallback gives its Jacobian)."""
        self.params = [(name, q) for name, q in self.params if q is not p]
        for b in self.blocks:
            if b.weight is p:
                b.weight = None
            if b.bias is p:
                b.bias = None

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        """Whether the kind handles this module (type and stock forward)."""
        return isinstance(module, cls.types) and any(stock_forward(module, t) for t in cls.types)

    @staticmethod
    def own_parameters(name: str, module: nn.Module, wanted: Any, children: bool) -> list[tuple[str, nn.Parameter]]:
        """The wanted parameters of ``module`` (and of its children when ``children``), with qualified names."""
        found = module.named_parameters(remove_duplicate=False) if children else module._parameters.items()
        prefix = f"{name}." if name else ""
        return [(prefix + pname, p) for pname, p in found if p is not None and wanted(p)]

    # ------------------------------------------------------------------ planning
    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        """
        One call seen when planning (``n`` probe examples).

        :return: The shapes of one example's probes for this call, or ``None`` if the call cannot be handled.
        """
        raise NotImplementedError

    def finish_plan(self, dtype: torch.dtype) -> None:
        """Set the blocks' positions (and anything else the calls decide) once every call has been checked, and
        leave out the blocks with no trained parameter (kinds that index their blocks keep the index in step)."""
        self.blocks = [b for b in self.blocks if b.params]

    def trained(self, p: nn.Parameter | None) -> nn.Parameter | None:
        """``p`` if the site covers it, else ``None``."""
        return p if p is not None and any(q is p for _, q in self.params) else None

    def block_params(self) -> set[int]:
        return {id(p) for b in self.blocks for p in b.params}

    def explicit_numel(self) -> int:
        """Numbers of the parameters outside the blocks (their gradients are always explicit)."""
        covered = self.block_params()
        return sum(p.numel() for _, p in self.params if id(p) not in covered)

    def probe_numel(self) -> int:
        """Numbers of one example's probes over all calls (each output gradient is ``C`` times this)."""
        return sum(math.prod(s) for call in self.calls for s in call)

    def kept_numel(self) -> int:
        """Numbers a pass keeps per example of the calls' inputs (the default: none)."""
        return 0

    # ------------------------------------------------------------------ passes
    def keep(self, args: tuple, kwargs: dict) -> Any:
        """What a pass keeps of one call's inputs (for the factors). Tensors kept as they are are checked for
        in-place changes after the pass (:func:`kept_tensors`)."""
        return None

    def probed_forward(self, probes: list[torch.Tensor] | None, store: list, *args: Any, **kwargs: Any) -> Any:
        """The module's forward with ``probes`` added to the probed values (``None``: none), appending what the
        factors need to ``store`` (for kinds that replace the forward)."""
        raise NotImplementedError

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                                     list[ParamGradient]]:
        """
        One call's factors.

        :param kept: What :meth:`keep` (or :meth:`probed_forward`) kept of the call.
        :param grads: The call's probes' output gradients, ``(n, C, *shape)`` each.
        :return: Per block, its input side and output gradients ``(n, C, L, o)`` for this call; and the explicit
            gradients of the site's parameters outside the blocks.
        """
        raise NotImplementedError


@dataclass
class SiteState:
    """A site's part of one pass: its probes per call (flat) and what each call kept."""

    probes: list[list[torch.Tensor]] = field(default_factory=list)
    kept: list[Any] = field(default_factory=list)
