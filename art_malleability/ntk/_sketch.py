"""
Seeded random projections and the sharing of a projection budget among groups of parameters, for
:class:`art_malleability.ntk.projection.ProjectedNTK` (see its module docstring).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Columns of a fallback Gaussian block generated at once.
FALLBACK_BLOCK = 4096


def seed_of(seed: int, *keys: int) -> int:
    """:return: A seed derived from ``seed`` and the integer ``keys`` (the same on every machine)."""
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
    fixed blocks of :data:`FALLBACK_BLOCK` columns (each from its own seed), so any column range
    can be regenerated without the rest.
    """
    parts = []
    first = start // FALLBACK_BLOCK
    for block in range(first, (stop - 1) // FALLBACK_BLOCK + 1):
        gen = torch.Generator().manual_seed(seed_of(seed, block))
        cols = torch.randn((k, FALLBACK_BLOCK), generator=gen, dtype=torch.float64)
        lo = max(start, block * FALLBACK_BLOCK) - block * FALLBACK_BLOCK
        hi = min(stop, (block + 1) * FALLBACK_BLOCK) - block * FALLBACK_BLOCK
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
