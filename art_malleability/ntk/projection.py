"""
Random projections of the empirical NTK's feature map: ``φ(x) ∈ R^k`` with ``E[φ(x)·φ(x')] = K(x, x')``.

The traced empirical NTK (see :mod:`art_malleability.ntk.empirical`) is the Gram matrix of the
per-example Jacobians ``J(x)``, the logit Jacobians of all classes side by side: ``K(x, x') =
J(x)·J(x')``. :class:`ProjectedNTK` maps each ``J(x)`` to ``k`` dimensions with a seeded random
linear map ``R`` (``E[RᵀR] = I``, so ``K ≈ ΦΦᵀ`` without bias) and never materialises a
per-example Jacobian larger than a layer's factors:

- **Kronecker-factored layers** (``nn.Linear`` on inputs of any rank, ``nn.Conv2d`` with
  ``groups=1`` and zero padding), as in LoGra (Choe et al., 2024). The Jacobian of such a layer is
  ``Σ_p vec(Δ_p) ⊗ a_p`` over positions ``p`` (one for a linear layer on 2-D inputs; the output
  pixels for a convolution), with ``Δ_p`` the ``C × out`` output gradients of all classes and
  ``a_p`` the layer input (the unfolded patch for a convolution), extended by a constant 1 when the
  bias is trained. Its projection ``(P_out ⊗ P_in)`` is computed as
  ``Σ_p (P_out vec Δ_p) ⊗ (P_in a_p)``: each factor is projected first, then the small outer
  products are summed over positions. The output side accumulates class by class during the
  ``C`` backward passes, so the ``C × out`` gradients are never stored for all classes at once.
- **Parameters of other modules called once** (batch norm, layer norm, any layer that owns its
  parameters and treats examples independently): the module's input and output are captured in
  the same forward pass, and the per-example gradients of its own parameters for each class come
  from a ``torch.func`` vector-Jacobian product of *that module alone*
  (``vmap(vjp(functional_call(module, ...)))``) with the output gradients of the same ``C``
  backward passes; they are multiplied by a Gaussian matrix class block by class block.
- **All other trainable parameters** (free-standing parameters of the root module, tied
  parameters, modules called several times) form one *fallback* group: per-example Jacobians of
  the whole model from ``torch.func.vmap(torch.func.jacrev(...))`` in sub-batches, multiplied by a
  Gaussian matrix.

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
import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from art_malleability._torch_utils import eval_mode, model_device_dtype, no_tf32, to_tensor, trainable_parameters
from art_malleability.ntk.empirical import (
    DEFAULT_CHUNK_MB,
    check_batch_size,
    check_chunk_mb,
    per_example_jacobian,
    plain_layers,
)

logger = logging.getLogger(__name__)

# Columns of a fallback Gaussian block generated at once.
_FALLBACK_BLOCK = 4096
# Side dimension of the pilot projection that estimates each group's trace share.
_PILOT_SIDE = 16


@dataclass
class _Group:
    """One block of the feature vector: a Kronecker-factored layer, a module's own parameters, or the fallback."""

    name: str
    kind: str  # "linear" / "conv" (Kronecker), "module" (module-local vjp) or "fallback" (whole model)
    module: nn.Module | None = None
    weight: bool = False
    bias: bool = False
    d_out: int = 0  # C × out (Kronecker groups)
    d_in: int = 0  # layer input (+1 for the bias), or 1 when only the bias is trained
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # module and fallback groups
    k_out: int = 0
    k_in: int = 0
    k: int = 0  # dimension of this group's block of φ
    p_out: torch.Tensor | None = None  # (k_out, d_out) or None for the identity
    p_in: torch.Tensor | None = None  # (k_in, d_in) or None for the identity
    matrix: torch.Tensor | None = None  # (k, dim) Gaussian when stored; None: identity or generated blocks
    seed: int = 0  # seed of the Gaussian matrix's column blocks
    positions: int = 1  # positions summed over (output pixels of a convolution)
    offset: int = 0

    @property
    def kronecker(self) -> bool:
        return self.kind in ("linear", "conv")

    @property
    def full_dim(self) -> int:
        return self.d_out * self.d_in


def _seed_of(seed: int, *keys: int) -> int:
    state = np.random.SeedSequence([int(seed) % 2**63, *keys]).generate_state(2, np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def orthogonal_projection(dim: int, k: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """
    ``k × dim`` projection ``sqrt(dim/k) Qᵀ`` with ``Q`` an orthonormal basis of the columns of a
    seeded Gaussian ``dim × k`` matrix (``E[PᵀP] = I``); ``None`` (the identity) when ``k ≥ dim``.

    :param dim: Input dimension.
    :param k: Output dimension.
    :param seed: Seed of the Gaussian matrix.
    :param dtype: Dtype of the result.
    :param device: Device of the result.
    :return: The projection matrix, or ``None``.
    """
    if k >= dim:
        return None
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn((dim, k), generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(gauss)
    return (math.sqrt(dim / k) * q.T).to(dtype=dtype, device=device).contiguous()


def gaussian_block(k: int, start: int, stop: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """
    Columns ``start:stop`` of a ``k × dim`` matrix of i.i.d. ``N(0, 1/k)`` entries, generated in
    fixed blocks of :data:`_FALLBACK_BLOCK` columns (each from its own seed), so any column range
    can be regenerated without the rest.
    """
    parts = []
    first = start // _FALLBACK_BLOCK
    for block in range(first, (stop - 1) // _FALLBACK_BLOCK + 1):
        gen = torch.Generator().manual_seed(_seed_of(seed, block))
        cols = torch.randn((k, _FALLBACK_BLOCK), generator=gen, dtype=torch.float64)
        lo = max(start, block * _FALLBACK_BLOCK) - block * _FALLBACK_BLOCK
        hi = min(stop, (block + 1) * _FALLBACK_BLOCK) - block * _FALLBACK_BLOCK
        parts.append(cols[:, lo:hi])
    return (torch.cat(parts, dim=1) / math.sqrt(k)).to(dtype=dtype, device=device)


def allocate(traces: list[float], dims: list[int], k: int) -> list[int]:
    """
    Share ``k`` dimensions among groups: one each, and the rest in proportion to ``traces``, none
    above its ``dims`` (water-filling, then largest remainders). The total is ``k``, unless the
    groups are more than ``k`` (one each) or their dimensions add up to less (each at its dimension).

    :param traces: Non-negative weight of each group (its share of the kernel trace).
    :param dims: Largest useful dimension of each group.
    :param k: Budget.
    :return: Dimension of each group.
    """
    out = [1 if d > 0 else 0 for d in dims]
    caps = [max(d - 1, 0) for d in dims]
    remaining = k - sum(out)
    weights = [max(float(t), 0.0) for t in traces]
    active = [g for g in range(len(dims)) if caps[g] > 0]
    if sum(weights[g] for g in active) <= 0:
        weights = [1.0] * len(dims)
    while active and remaining > 0:
        total = sum(weights[g] for g in active)
        capped = [g for g in active if total <= 0 or remaining * weights[g] / total >= caps[g]]
        if not capped:
            shares = {g: remaining * weights[g] / total for g in active}
            extra = {g: int(math.floor(shares[g])) for g in active}
            left = remaining - sum(extra.values())
            for g in sorted(active, key=lambda g: shares[g] - extra[g], reverse=True)[:left]:
                extra[g] += 1
            for g in active:
                out[g] += extra[g]
            break
        for g in capped:
            out[g] += caps[g]
            remaining -= caps[g]
            active.remove(g)
    return out


def kronecker_split(k: int, d_out: int, d_in: int) -> tuple[int, int]:
    """
    Split a Kronecker group's budget ``k`` into ``(k_out, k_in)`` with ``k_out · k_in ≤ k``,
    ``k_in ≈ sqrt(k)``, neither above its side's dimension.
    """
    if k >= d_out * d_in:
        return d_out, d_in
    k_in = min(d_in, max(1, round(math.sqrt(k))))
    k_out = min(d_out, max(1, k // k_in))
    k_in = min(d_in, max(1, k // k_out))
    return k_out, k_in


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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.projection_dim = check_projection_dim(projection_dim)
        self.seed = int(seed)
        self.batch_size = check_batch_size(batch_size)
        self.chunk_mb = check_chunk_mb(chunk_mb)
        self.probe_size = max(1, int(probe_size))
        self.device, self.dtype = model_device_dtype(model)
        self._include = None if parameters is None else {id(p) for p in parameters}
        self.max_bytes = max_bytes
        self.like = like
        if not trainable_parameters(model):
            raise ValueError("model has no trainable parameters (none with requires_grad=True)")
        self.groups: list[_Group] | None = None
        self.n_outputs = 0

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
            earlier = self.like
            if self.projection_dim >= sum(g.full_dim for g in groups):
                ks = [g.full_dim for g in groups]  # nothing to share: every group unprojected
            elif earlier is not None and earlier.groups is not None and self._signature(groups) == earlier.signature:
                ks = [g.k for g in earlier.groups]  # the same random features as the earlier projection
            else:
                # pilot: small projections estimate each group's squared Jacobian norm
                for g_idx, g in enumerate(groups):
                    self._draw(g, g_idx, _PILOT_SIDE * _PILOT_SIDE, pilot=True)
                self.groups = groups
                self._offsets()
                pilot = self._features(x)
                traces = [float(pilot[:, g.offset : g.offset + g.k].pow(2).sum()) for g in groups]
                ks = allocate(traces, [g.full_dim for g in groups], self.projection_dim)
        self.groups = groups
        self._check_matrix_memory(ks)
        for g_idx, (g, k) in enumerate(zip(groups, ks, strict=True)):
            self._draw(g, g_idx, k, pilot=False)
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

    def _signature(self, groups: list[_Group]) -> tuple:
        return (self.seed, self.projection_dim, tuple((g.name, g.kind, g.d_out, g.d_in) for g in groups))

    def _check_matrix_memory(self, ks: list[int]) -> None:
        """Refuse, before drawing them, projection matrices that would not fit ``max_bytes``."""
        if self.max_bytes is None:
            return
        need = 0
        for g, k in zip(self.groups, ks, strict=True):
            if not g.kronecker:
                stored = k < g.full_dim and k * g.full_dim * 8 <= self.chunk_mb * 2**20
                need += 8 * k * g.full_dim if stored else 8 * k * _FALLBACK_BLOCK
                continue
            k_out, k_in = kronecker_split(k, g.d_out, g.d_in)
            for d, kk in ((g.d_out, k_out), (g.d_in, k_in)):
                need += 0 if kk >= d else 3 * 8 * d * kk  # the Gaussian, its QR factor and the result
        if need > self.max_bytes:
            raise ValueError(
                f"projection_dim={self.projection_dim} needs about {need / 2**30:.1f} GiB of projection matrices for "
                f"this model, more than the {self.max_bytes / 2**30:.1f} GiB budget; lower projection_dim"
            )

    def _offsets(self) -> None:
        offset = 0
        for g in self.groups:
            g.offset = offset
            offset += g.k

    def _find_groups(self, x_probe: torch.Tensor) -> list[_Group]:
        def wanted(p: nn.Parameter | None) -> bool:
            return p is not None and p.requires_grad and (self._include is None or id(p) in self._include)

        kron = [
            c
            for c in plain_layers(self.model, (nn.Linear, nn.Conv2d))
            if _factorisable(c[1])
            and all(wanted(p) == t for p, t in ((c[1].weight, c[2]), (c[1].bias, c[3])) if p is not None)
        ]
        kron_ids = {id(c[1]) for c in kron}
        uses = Counter(id(p) for _, p in self.model.named_parameters(remove_duplicate=False))
        owners = []  # other submodules owning trainable parameters used nowhere else
        for name, module in self.model.named_modules():
            if module is self.model or id(module) in kron_ids:
                continue
            own = [
                (f"{name}.{pname}", p)
                for pname, p in module._parameters.items()
                if wanted(p) and uses[id(p)] == 1
            ]
            if own:
                owners.append((name, module, own))
        watched = [c[1] for c in kron] + [o[1] for o in owners]
        calls: list[list[bool]] = [[] for _ in watched]
        positions = [1] * len(watched)

        def record(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            ok = (
                len(inputs) == 1
                and isinstance(inputs[0], torch.Tensor)
                and isinstance(output, torch.Tensor)
                and inputs[0].dim() >= 1
                and output.dim() >= 1
                and inputs[0].shape[0] == x_probe.shape[0] == output.shape[0]
            )
            if ok and isinstance(module, nn.Conv2d) and id(module) in kron_ids:
                ok = inputs[0].dim() == 4 and output.dim() == 4
            elif ok and id(module) in kron_ids:
                ok = inputs[0].dim() >= 2 and output.dim() == inputs[0].dim()
            calls[k].append(ok)
            if ok and id(module) in kron_ids:
                positions[k] = _positions(module, output)

        handles = [m.register_forward_hook(partial(record, k)) for k, m in enumerate(watched)]
        try:
            with torch.no_grad():
                out = self.model(x_probe)
        finally:
            for h in handles:
                h.remove()
        if out.dim() != 2:
            raise ValueError(f"model must return outputs of shape (n, C), got shape {tuple(out.shape)}")
        c = self.n_outputs = int(out.shape[1])
        groups, covered = [], set()
        for k, (name, module, w, b) in enumerate(kron):
            if calls[k] != [True]:
                continue
            if isinstance(module, nn.Conv2d):
                kind, n_in = "conv", module.in_channels * math.prod(module.kernel_size)
                out_size = module.out_channels
            else:
                kind, n_in, out_size = "linear", module.in_features, module.out_features
            d_in = (n_in if w else 0) + (1 if b else 0)
            groups.append(_Group(name, kind, module, w, b, d_out=c * out_size, d_in=d_in, positions=positions[k]))
            covered.update(id(p) for p, t in ((module.weight, w), (module.bias, b)) if t)
        for k, (name, module, own) in enumerate(owners, start=len(kron)):
            if calls[k] != [True]:
                continue
            dim = c * sum(p.numel() for _, p in own)
            groups.append(_Group(name, "module", module, params=own, d_out=dim, d_in=1))
            covered.update(id(p) for _, p in own)
        rest = [(n, p) for n, p in trainable_parameters(self.model) if id(p) not in covered and wanted(p)]
        if rest:
            dim = c * sum(p.numel() for _, p in rest)
            groups.append(_Group("fallback", "fallback", params=rest, d_out=dim, d_in=1))
        logger.debug(
            "projected NTK plan: %s; fallback %s",
            [(g.name, g.kind) for g in groups if g.kind != "fallback"],
            [n for n, _ in rest],
        )
        return groups

    def _draw(self, g: _Group, index: int, k: int, pilot: bool) -> None:
        seed = _seed_of(self.seed, index, 1 if pilot else 0)
        if not g.kronecker:
            g.k = g.k_out = min(k, g.full_dim)
            g.k_in = 1
            g.matrix = None
            if g.k < g.full_dim and g.k * g.full_dim * 8 <= self.chunk_mb * 2**20:
                g.matrix = gaussian_block(g.k, 0, g.full_dim, seed, self.dtype, self.device)
            g.p_out = g.p_in = None
            g.seed = seed
            return
        if pilot:
            k_out, k_in = min(g.d_out, _PILOT_SIDE), min(g.d_in, _PILOT_SIDE)
        else:
            k_out, k_in = kronecker_split(k, g.d_out, g.d_in)
        g.k_out, g.k_in, g.k = k_out, k_in, k_out * k_in
        g.p_out = orthogonal_projection(g.d_out, k_out, _seed_of(seed, 0), self.dtype, self.device)
        g.p_in = orthogonal_projection(g.d_in, k_in, _seed_of(seed, 1), self.dtype, self.device)

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
        """Examples per pass: ``batch_size`` capped by the budget on the per-example buffers."""
        per_example = self.dim
        for g in self.groups:
            if not g.kronecker:
                per_example += 2 * g.full_dim
            else:
                per_example += g.positions * (g.k_out + g.k_in + g.d_in + g.d_out // max(self.n_outputs, 1))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        budget = int(self.chunk_mb * 2**20) // itemsize
        return max(1, min(self.batch_size, budget // max(per_example, 1)))

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        out = torch.empty((n, self.dim), dtype=self.dtype, device=self.device)
        hooked = [g for g in self.groups if g.kind != "fallback"]
        if hooked:
            captured: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(hooked)

            def hook(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
                captured[k] = (inputs[0].detach(), output)
                # hand a copy downstream so that in-place operations after the layer cannot alter
                # the output tensor we differentiate against
                return output.clone()

            handles = [g.module.register_forward_hook(partial(hook, k), prepend=True) for k, g in enumerate(hooked)]
            try:
                with torch.enable_grad():
                    logits = self.model(x)
            finally:
                for h in handles:
                    h.remove()
            if any(c is None for c in captured):
                raise RuntimeError("a layer seen when planning was not called in this forward pass")
            outs = [c[1] for c in captured]
            acc = [
                torch.zeros((n, _positions(g.module, o), g.k_out), dtype=self.dtype, device=self.device)
                if g.kronecker
                else torch.zeros((n, g.k), dtype=self.dtype, device=self.device)
                for g, o in zip(hooked, outs, strict=True)
            ]
            n_out = logits.shape[1]
            for c in range(n_out):
                if logits.requires_grad:
                    grads = torch.autograd.grad(
                        logits[:, c].sum(), outs, retain_graph=c < n_out - 1, allow_unused=True
                    )
                else:
                    grads = (None,) * len(outs)
                for g, a, d, (inp, _) in zip(hooked, acc, grads, captured, strict=True):
                    if d is None:
                        continue
                    width = g.d_out // n_out
                    if not g.kronecker:
                        jac = _module_gradients(g, inp, d)
                        self._project_columns(g, jac, c * width, (c + 1) * width, a)
                        continue
                    d = d.flatten(2).transpose(1, 2) if g.kind == "conv" else d.reshape(n, -1, width)
                    if g.p_out is None:
                        a[:, :, c * width : (c + 1) * width] = d
                    else:
                        a += d @ g.p_out[:, c * width : (c + 1) * width].T
                del grads
            del logits, outs
            for g, a, (inp, _) in zip(hooked, acc, captured, strict=True):
                if not g.kronecker:
                    out[:, g.offset : g.offset + g.k] = a
                    continue
                side = self._input_side(g, inp, a.shape[1])
                if g.p_in is not None:
                    side = side @ g.p_in.T
                block = torch.bmm(a.transpose(1, 2), side)  # (n, k_out, k_in): Σ_p over positions
                out[:, g.offset : g.offset + g.k] = block.reshape(n, -1)
            del acc, captured
        for g in self.groups:
            if g.kind == "fallback":
                jac = per_example_jacobian(self.model, g.params, x).reshape(n, -1)
                a = torch.zeros((n, g.k), dtype=self.dtype, device=self.device)
                self._project_columns(g, jac, 0, g.full_dim, a)
                out[:, g.offset : g.offset + g.k] = a
        return out

    def _project_columns(self, g: _Group, jac: torch.Tensor, start: int, stop: int, acc: torch.Tensor) -> None:
        """``acc += jac @ R[:, start:stop]ᵀ`` for the group's Gaussian matrix ``R`` (or the identity)."""
        if g.k >= g.full_dim:
            acc[:, start:stop] += jac
        elif g.matrix is not None:
            acc += jac @ g.matrix[:, start:stop].T
        else:
            for s in range(start, stop, _FALLBACK_BLOCK):
                e = min(s + _FALLBACK_BLOCK, stop)
                acc += jac[:, s - start : e - start] @ gaussian_block(g.k, s, e, g.seed, self.dtype, self.device).T

    @staticmethod
    def _input_side(g: _Group, inp: torch.Tensor, length: int) -> torch.Tensor:
        """Layer inputs per position ``(n, L, d_in)`` (unfolded patches for a convolution), with a 1 for the bias."""
        n = inp.shape[0]
        if not g.weight:
            return inp.new_ones((n, length, 1))
        if g.kind == "conv":
            m = g.module
            side = F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride).transpose(1, 2)
        else:
            side = inp.reshape(n, -1, inp.shape[-1])
        if g.bias:
            side = torch.cat([side, side.new_ones(side.shape[:2] + (1,))], dim=2)
        return side



def _module_gradients(g: _Group, inp: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """
    Per-example gradients of a module's own parameters for one class: the vector-Jacobian product
    of the module alone with its output gradient ``d``, vmapped over examples.

    :return: ``(n, P)``, parameters flattened in the group's order.
    """
    names = [name.rsplit(".", 1)[-1] if "." in name else name for name, _ in g.params]
    values = {name: p.detach() for name, (_, p) in zip(names, g.params, strict=True)}
    module = g.module

    def single(params: dict[str, torch.Tensor], xi: torch.Tensor, di: torch.Tensor) -> dict[str, torch.Tensor]:
        _, vjp = torch.func.vjp(lambda p: functional_call(module, p, (xi.unsqueeze(0),)), params)
        return vjp(di.unsqueeze(0))[0]

    with torch.no_grad():
        grads = vmap(single, in_dims=(None, 0, 0))(values, inp, d.detach())
    n = inp.shape[0]
    return torch.cat([grads[name].reshape(n, -1) for name in names], dim=1)


def _positions(module: nn.Module, output: torch.Tensor) -> int:
    """Positions a layer's Jacobian sums over: output pixels of a convolution, middle dimensions of a linear layer."""
    if isinstance(module, nn.Conv2d):
        return int(output.shape[2] * output.shape[3])
    return int(math.prod(output.shape[1:-1]))


def _factorisable(module: nn.Module) -> bool:
    """Whether a layer's Jacobian has the Kronecker structure handled here."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    if isinstance(module, nn.Conv2d):
        return (
            type(module).forward is nn.Conv2d.forward
            and module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
    return False


def check_projection_dim(projection_dim: object, name: str = "projection_dim") -> int:
    """
    Check a projection dimension: a positive integer below 2**31.

    :param projection_dim: The candidate.
    :param name: Argument name for the error message.
    :return: It, as an int.
    :raises ValueError: Otherwise.
    """
    ok = not isinstance(projection_dim, bool) and isinstance(projection_dim, (int, np.integer))
    if not ok or not 0 < int(projection_dim) < 2**31:
        raise ValueError(f"{name} must be a positive integer below 2**31, got {projection_dim!r}")
    return int(projection_dim)
