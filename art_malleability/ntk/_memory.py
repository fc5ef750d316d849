"""
Memory planning of the NTK engines: the budget of one chunk of per-example factors, the number of
examples per pass that fits it, and the per-example Jacobian factors of the structured engine,
computed in sub-batches and assembled into blocks (see :mod:`art_malleability.ntk.empirical`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Default memory budget (MiB) of one chunk of Jacobian factors, see :mod:`art_malleability.ntk.empirical`.
DEFAULT_CHUNK_MB = 256.0


def budget_elements(chunk_mb: float, dtype: torch.dtype) -> int:
    """
    :param chunk_mb: Memory budget in MiB.
    :param dtype: Dtype of the stored numbers.
    :return: Numbers of that dtype that fit the budget (at least one).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, int(chunk_mb * 2**20) // itemsize)


def rows_per_pass(batch_size: int, chunk_mb: float, dtype: torch.dtype, per_example: int) -> int:
    """
    Examples per pass or block: ``batch_size`` capped by the budget on the per-example buffers.

    :param batch_size: Largest number of examples.
    :param chunk_mb: Memory budget in MiB.
    :param dtype: Dtype of the buffers.
    :param per_example: Numbers stored per example.
    :return: At least one.
    """
    return max(1, min(batch_size, budget_elements(chunk_mb, dtype) // max(per_example, 1)))


@dataclass
class Features:
    """Per-example Jacobian factors of one batch."""

    n: int
    acts: list[torch.Tensor | None]  # per structured layer: (n, in) layer inputs, None if weight frozen
    # per structured layer: (n, C, out) output gradients, or (n, out) rank-one factors g with
    # δ_c = g u_c (see the module docstring of art_malleability.ntk.empirical)
    grads: list[torch.Tensor]
    jac: torch.Tensor | None  # (n, C, P) Jacobian of the fallback parameters

    def nbytes(self) -> int:
        """:return: Memory of the stored factors."""
        return sum(t.numel() * t.element_size() for t in [*self.acts, *self.grads, self.jac] if t is not None)

    def empty_like(self, n: int) -> Features:
        """:return: Uninitialised factors for ``n`` examples, shaped like these."""

        def like(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.new_empty((n, *t.shape[1:]))

        return Features(n=n, acts=[like(a) for a in self.acts], grads=[like(g) for g in self.grads], jac=like(self.jac))

    def fill(self, part: Features, start: int) -> None:
        """Copy the factors of ``part`` into rows ``start:start + part.n``."""
        stop = start + part.n
        pairs = [*zip(self.acts, part.acts, strict=True), *zip(self.grads, part.grads, strict=True)]
        for dst, src in [*pairs, (self.jac, part.jac)]:
            if dst is not None:
                dst[start:stop] = src


def place_block(kernel: torch.Tensor, block: torch.Tensor, i: int, j: int, symmetric: bool) -> None:
    """
    Write a Gram block at rows ``i`` and columns ``j`` of ``kernel`` (``(n1, n2)`` or ``(n1, n2, C, C)``).
    For a symmetric kernel (upper block triangle computed, ``j >= i``) a diagonal block is
    symmetrised and an off-diagonal one mirrored.

    :param kernel: The kernel being assembled.
    :param block: The block.
    :param i: First row of the block.
    :param j: First column of the block.
    :param symmetric: Whether ``kernel`` is symmetric.
    """

    def transposed(b: torch.Tensor) -> torch.Tensor:
        return b.T if b.dim() == 2 else b.permute(1, 0, 3, 2)

    target = kernel[i : i + block.shape[0], j : j + block.shape[1]]
    if symmetric and j == i:
        torch.add(block, transposed(block), out=target)
        target.mul_(0.5)
    else:
        target.copy_(block)
    if symmetric and j > i:
        kernel[j : j + block.shape[1], i : i + block.shape[0]] = transposed(block)


def in_sub_batches(
    compute: Callable[[torch.Tensor, torch.Tensor | None], Features],
    x: torch.Tensor,
    y: torch.Tensor | None,
    step: int,
) -> Features:
    """
    Factors of a batch computed ``step`` examples at a time and gathered.

    :param compute: Factors of one sub-batch ``(x, y) -> Features``.
    :param x: Inputs.
    :param y: Labels, or ``None``.
    :param step: Examples per sub-batch.
    :return: The factors of all of ``x``.
    """
    n = x.shape[0]
    if n <= step:
        return compute(x, y)
    out: Features | None = None
    for i in range(0, n, step):
        part = compute(x[i : i + step], None if y is None else y[i : i + step])
        if out is None:
            out = part.empty_like(n)
        out.fill(part, i)
        del part
    return out
