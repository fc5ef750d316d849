"""
Groups of a model's trainable parameters for :class:`art_malleability.ntk.projection.ProjectedNTK`, from the layer
registry's plan (:mod:`art_malleability.ntk.layers`): each Kronecker block that may be structured is a *Kronecker*
group (projected side by side, as in LoGra); the other blocks' and the sites' explicit gradients form one *explicit*
group per site (a parameter tied between sites belongs to the first); the fallback parameters one more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from art_malleability.ntk.layers.base import Block, IndexSide
from art_malleability.ntk.layers.plan import Plan


@dataclass
class Group:
    """One block of the feature vector: a Kronecker block, a site's explicit gradients, or the fallback."""

    name: str
    kind: str  # the site's kind for Kronecker and explicit groups; "fallback" for the fallback parameters
    block: Block | None = None  # a Kronecker group's block
    d_out: int = 0  # C × o (Kronecker groups) or C × the parameters (others)
    d_in: int = 1  # the block's input side (+1 for the bias), or 1
    params: list[nn.Parameter] = field(default_factory=list)  # the parameters whose gradients the group holds
    k_out: int = 0
    k_in: int = 0
    k: int = 0  # dimension of this group's block of φ
    p_out: torch.Tensor | None = None  # (k_out, d_out) or None for the identity
    p_in: torch.Tensor | None = None  # (k_in, d_in) or None for the identity
    matrix: torch.Tensor | None = None  # (k, dim) Gaussian when stored; None: identity or generated blocks
    seed: int = 0  # seed of the Gaussian matrix's column blocks
    offset: int = 0

    @property
    def kronecker(self) -> bool:
        """Whether the group is a Kronecker-factored block."""
        return self.block is not None

    @property
    def full_dim(self) -> int:
        """Dimension of the group's unprojected Jacobian."""
        return self.d_out * self.d_in

    @property
    def positions(self) -> int:
        return self.block.positions if self.block is not None else 1

    def project_side(self, a: torch.Tensor) -> torch.Tensor:
        """A Kronecker group's stored input side (:meth:`Block.input_side`) projected: ``(n, L, k_in)``."""
        b = self.block
        if b.weight is not None and b.bias is None and isinstance(b.side, IndexSide):
            return b.side.project(a, self.p_in)
        return a if self.p_in is None else a @ self.p_in.T


def find_groups(plan: Plan, n_outputs: int) -> list[Group]:
    """
    The groups of a plan (dimensions unset).

    :param plan: The model's plan.
    :param n_outputs: Outputs ``C``.
    :return: Kronecker groups and explicit groups site by site, then the fallback group.
    """
    c = n_outputs
    groups: list[Group] = []
    assigned: set[int] = set()
    for site in plan.sites:
        explicit: list[nn.Parameter] = []
        in_blocks = {id(p) for b in site.blocks for p in b.params}
        for b in site.blocks:
            if b.may_structure():
                groups.append(Group(b.name, site.kind, b, d_out=c * b.d_out, d_in=b.d_in, params=b.params))
                assigned.update(id(p) for p in b.params)
            else:
                explicit.extend(b.params)
        explicit.extend(p for _, p in site.params if id(p) not in in_blocks)
        mine = []
        for p in explicit:
            if id(p) not in assigned:
                assigned.add(id(p))
                mine.append(p)
        if mine:
            groups.append(Group(site.name or "model", site.kind, d_out=c * sum(p.numel() for p in mine),
                                params=mine))
    if plan.fallback:
        params = [p for _, p in plan.fallback]
        groups.append(Group("fallback", "fallback", d_out=c * sum(p.numel() for p in params), params=params))
    return groups
