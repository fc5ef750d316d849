"""
Random projections of the empirical NTK's feature map: ``φ(x) ∈ R^k`` with ``E[φ(x)·φ(x')] = K(x, x')``.

The traced empirical NTK (see :mod:`art_malleability.ntk.empirical`) is the Gram matrix of the
per-example Jacobians ``J(x)``, the logit Jacobians of all classes side by side: ``K(x, x') =
J(x)·J(x')``. :class:`ProjectedNTK` maps each ``J(x)`` to ``k`` dimensions with a seeded random
linear map ``R`` (``E[RᵀR] = I``, so ``K ≈ ΦΦᵀ`` without bias) and never materialises a
per-example Jacobian larger than a layer's factors:

The groups come from the layer registry's plan (:mod:`art_malleability.ntk.layers`), the same as the exact
engine's, and their factors from the same class-batched pass
(:func:`~art_malleability.ntk.layers.passes.probed_pass`):

- **Kronecker blocks** (``nn.Linear`` on inputs of any rank, convolutions with one group, embeddings, attention's
  and recurrent layers' projections), as in LoGra (Choe et al., 2024). The Jacobian of such a block is
  ``Σ_p vec(Δ_p) ⊗ a_p`` over positions ``p`` (tokens, output pixels, time steps), with ``Δ_p`` the ``C × o``
  output gradients of all classes and ``a_p`` the block's input side (the unfolded patch for a convolution, the
  token's one-hot row for an embedding), extended by a constant 1 when the bias is trained. Its projection
  ``(P_out ⊗ P_in)`` is computed as ``Σ_p (P_out vec Δ_p) ⊗ (P_in a_p)``: each factor is projected first, then the
  small outer products are summed over positions.
- **Explicit gradients** (normalisation layers, grouped convolutions, tied weights, the modules the registry does
  not know, taken by the batched path of their own parameters): one group per site, its per-example gradients for
  every class multiplied by a Gaussian matrix.
- **The fallback parameters** (free-standing parameters, weights used outside their module): their per-example
  Jacobians from the pass run under ``vmap`` over the examples, multiplied by a Gaussian matrix.

Gaussian matrices are generated in column blocks from the seed and stored only when small.

**Projections.** A side of dimension ``D`` projected to ``d < D`` dimensions uses
``sqrt(D/d) Qᵀ`` with ``Q`` (``D × d``) the orthonormal basis of a Gaussian matrix's columns, so
``E[PᵀP] = I`` and the projection becomes exact as ``d`` reaches ``D``; with ``d ≥ D`` the side is
not projected at all (identity). Independent factors give ``E[(P_out ⊗ P_in)ᵀ(P_out ⊗ P_in)] = I``.
Module and fallback groups use i.i.d. ``N(0, 1/d)`` entries (or the identity when ``d`` reaches
their dimension). Every matrix is drawn from a generator seeded by ``(seed, group, side)``: the same
seed gives the same features on any machine and in every process of a sharded run.

**Dimensions.** The budget ``k`` is shared among the groups in proportion to their share of the
kernel's trace on a probe batch (the first ``probe_size`` examples given to :meth:`plan`), which
minimises the summed variance of the projected inner products (``Σ_g T_g²/k_g`` for ``Σ_g k_g = k``);
every group gets at least one dimension and none more than its own. A Kronecker group's ``k_g`` is
split as ``d_out · d_in ≤ k_g`` with ``d_in ≈ sqrt(k_g)``. The realised total :attr:`dim` is
usually a little below ``k`` (rounding of the products), above it only when there are more groups
than ``k``; it equals the full Jacobian dimension when ``k`` reaches it, and the features are then
exact (``ΦΦᵀ = K`` to rounding).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from art_malleability._utils.torch_utils import eval_mode, no_tf32, to_tensor
from art_malleability.ntk._autograd import check_model
from art_malleability.ntk._checks import check_batch_size, check_chunk_mb, check_projection_dim
from art_malleability.ntk._groups import Group, find_groups
from art_malleability.ntk._memory import DEFAULT_CHUNK_MB, MIN_PASS_ROWS, pass_chunk_mb, rows_per_pass
from art_malleability.ntk._sketch import (
    FALLBACK_BLOCK,
    allocate,
    gaussian_block,
    kronecker_split,
    orthogonal_projection,
    seed_of,
)
from art_malleability.ntk.cost import MethodCost, count
from art_malleability.ntk.layers.passes import InputChanged, probed_pass
from art_malleability.ntk.layers.plan import Plan, plan_model

__all__ = [
    "ProjectedNTK",
    "allocate",
    "check_projection_dim",
    "gaussian_block",
    "kronecker_split",
    "orthogonal_projection",
]

logger = logging.getLogger(__name__)

# Side dimension of the pilot projection that estimates each group's trace share.
_PILOT_SIDE = 16


class ProjectedNTK:
    """
    Seeded random projection of the per-example Jacobians of a model's outputs (the feature map
    of its traced empirical NTK) to about ``k`` dimensions, with ``E[φ(x)·φ(x')] = K(x, x')``.
    See the module docstring for the construction.

    The model is used as is (no copy), evaluated in evaluation mode (restored afterwards); forward
    hooks live only during a pass and gradients are taken with :func:`torch.autograd.grad`, so
    weights, flags and ``.grad`` fields are untouched.

    :param model: The model; features are computed in its dtype and on its device.
    :param projection_dim: The budget ``k`` (> 0).
    :param seed: Seed of every projection matrix.
    :param batch_size: Largest number of examples per forward/backward pass.
    :param chunk_mb: Memory budget (MiB) of the per-pass buffers (projected factors, unfolded
        patches, fallback Jacobians); passes shrink below ``batch_size`` to fit it.
    :param probe_size: Examples of the first :meth:`plan` batch used to share ``k`` among groups.
    :param parameters: Only these trainable parameters (``None``: all); the exact NTK engine uses this
        with an unbounded ``projection_dim`` for the exact Jacobians of the layers it does not factorise.
    :param max_bytes: Memory the projection matrices may take; :meth:`plan` raises before drawing
        matrices that would exceed it (``None``: no limit).
    :param like: An earlier projection of a model with the same layers (same seed and budget): its
        per-layer dimensions are reused instead of being shared anew from a probe batch, so both
        give the same random features (a transductive model refitted on perturbed data keeps its
        projection).
    """

    def __init__(
        self,
        model: nn.Module,
        projection_dim: int,
        *,
        seed: int = 0,
        batch_size: int = 256,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        probe_size: int = 64,
        parameters: list[nn.Parameter] | None = None,
        max_bytes: int | None = None,
        like: ProjectedNTK | None = None,
    ) -> None:
        self.device, self.dtype = check_model(model)
        self.model = model
        self.projection_dim = check_projection_dim(projection_dim)
        self.seed = int(seed)
        self.batch_size = check_batch_size(batch_size)
        self.chunk_mb = check_chunk_mb(chunk_mb)
        self.probe_size = max(1, int(probe_size))
        self._include = None if parameters is None else {id(p) for p in parameters}
        self.max_bytes = max_bytes
        self.like = like
        self.groups: list[Group] | None = None
        self.n_outputs = 0
        self._plan: Plan | None = None
        self._zeros: dict = {}
        self._clone_inputs = False
        # counting (:func:`projected_costs`): the matrices' shapes without their values, and what drawing them costs
        self._counting = False
        self._drawn = 0.0
        self._draw_flops = 0.0

    # ------------------------------------------------------------------ planning
    @property
    def dim(self) -> int:
        """Realised feature dimension (after :meth:`plan`)."""
        self._check_planned()
        return sum(g.k for g in self.groups)

    @property
    def full_dim(self) -> int:
        """Dimension of the unprojected Jacobian ``C × P`` (after :meth:`plan`)."""
        self._check_planned()
        return sum(g.full_dim for g in self.groups)

    @property
    def is_exact(self) -> bool:
        """Whether every group is left unprojected (the features are the exact Jacobians)."""
        return self.dim == self.full_dim

    def describe(self) -> list[dict]:
        """:return: One dict per group: name, kind, dimensions of its sides and block."""
        self._check_planned()
        return [
            {"name": g.name, "kind": g.kind, "full_dim": g.full_dim, "dim": g.k, "dim_out": g.k_out, "dim_in": g.k_in}
            for g in self.groups
        ]

    def _check_planned(self) -> None:
        if self.groups is None:
            raise RuntimeError("ProjectedNTK.plan(x) must be called before features are computed")

    def plan(self, x_probe: np.ndarray | torch.Tensor) -> ProjectedNTK:
        """
        Find the factorised layers, share the budget among the groups (probe batch) and draw the
        projection matrices. Called once; later calls do nothing.

        :param x_probe: A few inputs (the first ``probe_size`` are used).
        :return: ``self``.
        """
        if self.groups is not None:
            return self
        x = to_tensor(x_probe[: self.probe_size], self.device, self.dtype)
        with eval_mode(self.model), no_tf32(self.device):
            groups = self._find_groups(x[:2])
            earlier, splits = self.like, None
            if self.projection_dim >= sum(g.full_dim for g in groups):
                ks = [g.full_dim for g in groups]  # nothing to share: every group unprojected
            elif earlier is not None and earlier.groups is not None and self._signature(groups) == earlier.signature:
                # the same random features as the earlier projection: its budgets and their Kronecker splits (a split
                # of k_out * k_in need not give k_out, k_in again)
                ks, splits = [g.k for g in earlier.groups], [(g.k_out, g.k_in) for g in earlier.groups]
            else:
                # pilot: small projections estimate each group's squared Jacobian norm (counting: its work is
                # counted and the budget shared by the groups' dimensions, no numbers having been drawn)
                for g_idx, g in enumerate(groups):
                    self._draw(g, g_idx, _PILOT_SIDE * _PILOT_SIDE, pilot=True)
                self.groups = groups
                self._offsets()
                pilot = self._features(x)
                traces = [g.full_dim if self._counting else float(pilot[:, g.offset : g.offset + g.k].pow(2).sum())
                          for g in groups]
                ks = allocate(traces, [g.full_dim for g in groups], self.projection_dim)
        self.groups = groups
        self._check_matrix_memory(ks)
        for g_idx, (g, k) in enumerate(zip(groups, ks, strict=True)):
            self._draw(g, g_idx, k, pilot=False, split=None if splits is None else splits[g_idx])
        self._offsets()
        logger.debug(
            "projected NTK: %d dimensions of %d; groups %s",
            self.dim,
            self.full_dim,
            [(g.name, g.k_out, g.k_in, g.k) for g in groups],
        )
        return self

    @property
    def signature(self) -> tuple:
        """What makes two projections share their dimensions and matrices: seed, budget and the groups."""
        self._check_planned()
        return self._signature(self.groups)

    def _signature(self, groups: list[Group]) -> tuple:
        return (self.seed, self.projection_dim, tuple((g.name, g.kind, g.d_out, g.d_in) for g in groups))

    def _check_matrix_memory(self, ks: list[int]) -> None:
        """Refuse, before drawing them, projection matrices that would not fit ``max_bytes``."""
        if self.max_bytes is None:
            return
        need = 0
        for g, k in zip(self.groups, ks, strict=True):
            if not g.kronecker:
                need += 8 * k * g.full_dim if self._stored(k, g.full_dim) else 8 * k * FALLBACK_BLOCK
                continue
            k_out, k_in = kronecker_split(k, g.d_out, g.d_in)
            for d, kk in ((g.d_out, k_out), (g.d_in, k_in)):
                need += 0 if kk >= d else 3 * 8 * d * kk  # the Gaussian, its QR factor and the result
        if need > self.max_bytes:
            raise ValueError(
                f"projection_dim must keep the projection matrices within {self.max_bytes / 2**30:.1f} GiB for "
                f"this model, got {self.projection_dim} needing about {need / 2**30:.1f} GiB of projection matrices; "
                "lower projection_dim"
            )

    def _stored(self, k: int, full_dim: int) -> bool:
        """Whether a dense projection ``(k, full_dim)`` is drawn once and kept (else drawn in blocks when used)."""
        return k < full_dim and k * full_dim * 8 <= self.chunk_mb * 2**20

    def _offsets(self) -> None:
        offset = 0
        for g in self.groups:
            g.offset = offset
            offset += g.k

    def _find_groups(self, x_probe: torch.Tensor) -> list[Group]:
        def wanted(p: nn.Parameter) -> bool:
            return p.requires_grad and (self._include is None or id(p) in self._include)

        plan = plan_model(self.model, x_probe, wanted)
        if plan.output.dim() != 2:
            raise ValueError(f"model must return outputs of shape (n, C), got shape {tuple(plan.output.shape)}")
        self.n_outputs = int(plan.output.shape[1])
        plan.output = None
        self._plan = plan
        groups = find_groups(plan, self.n_outputs)
        logger.debug("projected NTK plan: %s", [(g.name, g.kind, g.kronecker) for g in groups])
        return groups

    def _draw(self, g: Group, index: int, k: int, pilot: bool, split: tuple[int, int] | None = None) -> None:
        seed = seed_of(self.seed, index, 1 if pilot else 0)
        if not g.kronecker:
            g.k = g.k_out = min(k, g.full_dim)
            g.k_in = 1
            g.matrix = None
            if self._stored(g.k, g.full_dim):
                g.matrix = self._gaussian(g.k, 0, g.full_dim, seed)
            g.p_out = g.p_in = None
            g.seed = seed
            return
        if pilot:
            k_out, k_in = min(g.d_out, _PILOT_SIDE), min(g.d_in, _PILOT_SIDE)
        else:
            k_out, k_in = kronecker_split(k, g.d_out, g.d_in) if split is None else split
        g.k_out, g.k_in, g.k = k_out, k_in, k_out * k_in
        g.p_out = self._orthogonal(g.d_out, k_out, seed_of(seed, 0))
        g.p_in = self._orthogonal(g.d_in, k_in, seed_of(seed, 1))

    def _gaussian(self, k: int, start: int, stop: int, seed: int) -> torch.Tensor:
        """Columns ``start:stop`` of a group's Gaussian matrix (:func:`gaussian_block`); counting, their shape only
        and the numbers drawn for them (whole blocks of :data:`FALLBACK_BLOCK` columns)."""
        if not self._counting:
            return gaussian_block(k, start, stop, seed, self.dtype, self.device)
        self._drawn += k * FALLBACK_BLOCK * ((stop - 1) // FALLBACK_BLOCK - start // FALLBACK_BLOCK + 1)
        return torch.empty((k, stop - start), dtype=self.dtype, device=self.device)

    def _orthogonal(self, dim: int, k: int, seed: int) -> torch.Tensor | None:
        """A Kronecker side's projection (:func:`orthogonal_projection`); counting, its shape only, and the Gaussian
        numbers and the QR factorisation's operations (``4 dim k²``, Householder with ``Q`` formed) it costs."""
        if not self._counting:
            return orthogonal_projection(dim, k, seed, self.dtype, self.device)
        if k >= dim:
            return None
        self._drawn += dim * k
        self._draw_flops += 4.0 * dim * k * k
        return torch.empty((k, dim), dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ features
    def features(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        """
        Projected features of a batch, computed in passes that fit the memory budget.

        :param x: Inputs ``(n, *input_shape)``.
        :return: ``(n, dim)`` tensor in the model's dtype, on its device.
        """
        if self.groups is None:
            self.plan(x)
        x = to_tensor(x, self.device, self.dtype)
        with eval_mode(self.model), no_tf32(self.device):
            return self._features(x)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        step = self._rows_per_pass(x)
        for s in range(0, n, step):
            out[s : s + step] = self._pass(x[s : s + step])
        return out

    def _rows_per_pass(self, x: torch.Tensor) -> int:
        """Examples per pass: ``batch_size`` capped by the budget on the per-example buffers (the pass's output
        gradients and kept inputs, the forward pass's intermediates, the explicit gradients and the projected
        sides)."""
        c = self.n_outputs
        plan = self._plan
        total, largest = plan.forward_size
        per_example = self.dim + total + 2 * c * largest
        per_example += sum(c * s.probe_numel() + s.kept_numel() for s in plan.sites)
        for g in self.groups:
            if g.kronecker:
                per_example += g.positions * (g.k_out + g.k_in + g.d_in)
            else:
                per_example += 2 * g.full_dim
        rows = rows_per_pass(self.batch_size, pass_chunk_mb(self.device, self.chunk_mb), self.dtype, per_example)
        return max(rows, min(MIN_PASS_ROWS, rows_per_pass(self.batch_size, self.chunk_mb, self.dtype, per_example)))

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        plan = self._plan
        try:
            result = probed_pass(plan, self.model, x, None, _outputs, self._zeros, self._clone_inputs)
        except InputChanged:
            self._clone_inputs = True
            result = probed_pass(plan, self.model, x, None, _outputs, self._zeros, True)
        kron = {id(g.block): g for g in self.groups if g.kronecker}
        parts: dict[int, torch.Tensor] = {}

        def add(p: nn.Parameter, grad: torch.Tensor) -> None:
            parts[id(p)] = grad if id(p) not in parts else parts[id(p)] + grad

        for i, site in enumerate(plan.sites):
            kept, grads = result.kept[i], result.grads[i]
            result.kept[i] = result.grads[i] = None
            pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in site.blocks]
            for j in range(len(kept)):
                blocks, explicit = site.factors(kept[j], grads[j])
                for k, f in enumerate(blocks):
                    pieces[k].append(f)
                for p, grad in explicit:
                    add(p, grad)
            del kept, grads
            for b, calls in zip(site.blocks, pieces, strict=True):
                a = calls[0][0] if len(calls) == 1 else torch.cat([f[0] for f in calls], dim=1)
                d = calls[0][1] if len(calls) == 1 else torch.cat([f[1] for f in calls], dim=2)
                g = kron.get(id(b))
                if g is None:
                    for p, grad in b.explicit(a, d):
                        add(p, grad)
                    continue
                # (n, C, L, o) -> (n, L, C·o), class-major: projected on the output side, then summed over positions
                side_out = d.permute(0, 2, 1, 3).reshape(n, d.shape[2], -1)
                if g.p_out is not None:
                    side_out = side_out @ g.p_out.T
                side_in = g.project_side(b.input_side(a))
                block = torch.bmm(side_out.transpose(1, 2), side_in)  # (n, k_out, k_in)
                out[:, g.offset : g.offset + g.k] = block.reshape(n, -1)
        for g in self.groups:
            if g.kronecker:
                continue
            if g.kind == "fallback":
                jac = result.jac.reshape(n, -1)
            else:
                cols = [parts.pop(id(p)) for p in g.params]
                jac = (cols[0] if len(cols) == 1 else torch.cat(cols, dim=2)).reshape(n, -1)
            acc = torch.zeros((n, g.k), dtype=self.dtype, device=self.device)
            self._project_columns(g, jac, 0, g.full_dim, acc)
            out[:, g.offset : g.offset + g.k] = acc
        return out

    def _project_columns(self, g: Group, jac: torch.Tensor, start: int, stop: int, acc: torch.Tensor) -> None:
        """``acc += jac @ R[:, start:stop]ᵀ`` for the group's Gaussian matrix ``R`` (or the identity)."""
        if g.k >= g.full_dim:
            acc[:, start:stop] += jac
        elif g.matrix is not None:
            acc += jac @ g.matrix[:, start:stop].T
        else:
            for s in range(start, stop, FALLBACK_BLOCK):
                e = min(s + FALLBACK_BLOCK, stop)
                acc += jac[:, s - start : e - start] @ self._gaussian(g.k, s, e, g.seed).T


def _outputs(out: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """The model's outputs as they are (the projection is of the logits' Jacobians)."""
    return out


def projected_costs(model: nn.Module, probe: np.ndarray | torch.Tensor, projection_dim: int,
                    batch_size: int = 256, device: torch.device | None = None) -> tuple[float, float]:
    """
    Estimated seconds of the projection's plan and of one example's projected features (:mod:`~art_malleability.ntk.
    cost`'s counts at the device's nominal rate), counted on a projection planned on up to eight probe examples
    whose matrices are given their shapes but not drawn: the Gaussian numbers a plan or a pass would draw (one by one
    from a seeded generator, :data:`~art_malleability.ntk.cost.RANDOM_SECONDS` each) and the orthogonal sides'
    factorisations are counted instead. The pilot that shares the budget among the groups is counted as well; its
    shares are not measured, the groups' dimensions stand in for them.

    :param model: The model.
    :param probe: A few inputs.
    :param projection_dim: The budget ``k``.
    :param batch_size: Examples per pass at most.
    :param device: The device (``None``: the model's).
    :return: ``(plan seconds, seconds per example)``.
    """
    projector = ProjectedNTK(model, projection_dim, batch_size=batch_size, probe_size=8)
    projector._counting = True
    _, flops, writes, calls = count(projector.plan, probe[:8])
    device = projector.device if device is None else device
    plan = MethodCost("plan", flops + projector._draw_flops, writes, 0.0, float(calls), 0.0, 0,
                      random=projector._drawn)
    x = to_tensor(probe[:2], projector.device, projector.dtype)
    projector._drawn = 0.0
    with eval_mode(model), no_tf32(projector.device):
        _, flops, writes, calls = count(projector._features, x)
        rows = projector._rows_per_pass(x)
    n = x.shape[0]
    cost = MethodCost("projected", flops / n, writes / n, 0.0, float(calls), 0.0, projector.dim,
                      random=projector._drawn)
    return plan.seconds(1.0, 0.0, 1.0, device), cost.example_seconds(rows, device)
