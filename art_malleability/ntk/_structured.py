"""
The contraction of the kernel engine (:mod:`art_malleability.ntk.empirical`): a Gram block between two batches of
Jacobian factors, from each structured block's position-pair products ``Σ_{l,l'} (A1 A2ᵀ) ⊙ (Δ1 Δ2ᵀ)`` (classes
folded into ``Δ``, or kept apart) and one product of the explicit gradients.
"""

from __future__ import annotations

import torch

from art_malleability.ntk._memory import Features
from art_malleability.ntk.layers.base import Block


def block_contract(block: Block, f1: tuple[torch.Tensor, torch.Tensor], f2: tuple[torch.Tensor, torch.Tensor],
                   trace: bool, chunk_elements: int) -> torch.Tensor:
    """
    A structured block's share of a Gram block: ``Σ_{l,l'} (A1 A2ᵀ) ⊙ (Δ1 Δ2ᵀ)`` with the classes folded into ``Δ``
    (traced) or kept apart. With more than one position the ``(n1·L) × (n2·L)`` products are formed for rows of
    ``f1`` at a time so that the two of them take at most ``chunk_elements`` numbers (one row at least).

    :param block: The block (its input side's Gram).
    :param f1: Stored factors ``(A, Δ)`` of the first batch: ``(n1, L, d_in)`` (or token indices) and
        ``(n1, L, C, o)``.
    :param f2: Stored factors of the second batch.
    :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
    :param chunk_elements: Numbers the intermediate products may take.
    :return: The share.
    """
    (a1, d1), (a2, d2) = f1, f2
    n1, n2, length, c = d1.shape[0], d2.shape[0], d1.shape[1], d1.shape[2]
    if length == 1:
        gram_a = block.gram(a1, a2)
        if trace:
            return (d1.reshape(n1, -1) @ d2.reshape(n2, -1).T).mul_(gram_a)
        return torch.einsum("acn,bdn->abcd", d1[:, 0], d2[:, 0]).mul_(gram_a[:, :, None, None])
    per_row = 2 * length * n2 * length * (1 if trace else c * c)
    step = max(1, min(n1, chunk_elements // max(per_row, 1)))
    d2f = d2.reshape(n2 * length, -1) if trace else d2.reshape(n2 * length * c, -1)
    parts = []
    for i in range(0, n1, step):
        rows = min(step, n1 - i)
        gram_a = block.gram(a1[i : i + rows], a2)  # (rows·L, n2·L)
        if trace:
            gram_d = d1[i : i + rows].reshape(rows * length, -1) @ d2f.T
            parts.append(gram_d.mul_(gram_a).view(rows, length, n2, length).sum((1, 3)))
        else:
            gram_d = d1[i : i + rows].reshape(rows * length * c, -1) @ d2f.T
            parts.append(torch.einsum("alcbmd,albm->abcd", gram_d.view(rows, length, c, n2, length, c),
                                      gram_a.view(rows, length, n2, length)))
        del gram_a, gram_d
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def contract(blocks: list[Block], f1: Features, f2: Features, n_outputs: int, trace: bool, dtype: torch.dtype,
             device: torch.device, chunk_elements: int = 2**25) -> torch.Tensor:
    """
    Gram block between two batches of factors: each structured block's share (:func:`block_contract`) and one
    product of the explicit gradients.

    :param blocks: The structured blocks the factors belong to.
    :param f1: Factors of the first batch (``n1`` examples).
    :param f2: Factors of the second batch (``n2`` examples).
    :param n_outputs: Number of outputs ``C``.
    :param trace: Sum over outputs (``(n1, n2)``) or keep them (``(n1, n2, C, C)``).
    :param dtype: Dtype of the block.
    :param device: Device of the block.
    :param chunk_elements: Numbers the intermediate products of one block may take.
    :return: The block.
    """
    k: torch.Tensor | None = None  # the first term is the block itself: no zero fill, no extra add
    for block, b1, b2 in zip(blocks, f1.blocks, f2.blocks, strict=True):
        s = block_contract(block, b1, b2, trace, chunk_elements)
        k = s if k is None else k.add_(s)
        del s
    if f1.jac is not None:
        if trace:
            j1, j2 = f1.jac.reshape(f1.n, -1), f2.jac.reshape(f2.n, -1)
            k = j1 @ j2.T if k is None else k.addmm_(j1, j2.T)
        else:
            s = torch.einsum("acp,bdp->abcd", f1.jac, f2.jac)
            k = s if k is None else k.add_(s)
    if k is None:  # nothing trained reaches the outputs
        shape = (f1.n, f2.n) if trace else (f1.n, f2.n, n_outputs, n_outputs)
        k = torch.zeros(shape, dtype=dtype, device=device)
    return k
