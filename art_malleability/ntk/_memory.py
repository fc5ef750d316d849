"""
Memory planning of the NTK engines: the budget of one chunk of per-example factors, the number of
examples per pass that fits it, and the per-example Jacobian factors of the structured engine,
computed in sub-batches and assembled into blocks (see :mod:`art_malleability.ntk.empirical`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from art_malleability._utils.torch_utils import available_memory

# Default memory budget (MiB) of one chunk of Jacobian factors, see :mod:`art_malleability.ntk.empirical`.
DEFAULT_CHUNK_MB = 256.0

# Largest pass (MiB of intermediates) on the CPU: a larger one runs no faster there (the SmallCNN's factors of 1,024
# examples, one thread: passes of 11 to 256 examples all took 7.4-11.7 s, within the spread of repeated runs), while
# its intermediates add to the peak memory (1.78 GB at 22 examples a pass, 2.05 GB at 91, 2.70 GB at 256).
CPU_PASS_MB = 64.0

# Fewest examples a CPU pass takes where the chunk budget holds them, whatever CPU_PASS_MB says: a pass pays a fixed
# overhead per operator (about 20 µs under torch.func), which ResNet-18's 1,400 operators make 28 ms, against 35 ms of
# arithmetic an example (its float64 pass: 65 ms an example one at a time, 39 ms eight at a time).
MIN_PASS_ROWS = 8

# Share of a CUDA device's available memory one chunk may take: the engine holds about four chunks at its peak (the
# raw factors of a sub-batch, kept factors or a panel of twice a chunk, one more block), so an eighth leaves room for
# the result and the caller's own tensors.
DEVICE_CHUNK_SHARE = 1.0 / 8.0


def device_chunk_mb(device: torch.device, chunk_mb: float) -> float:
    """
    The chunk budget of one kernel computation on ``device``: ``chunk_mb`` on the CPU (the caller's budget); on a
    CUDA device the larger of ``chunk_mb`` and :data:`DEVICE_CHUNK_SHARE` of the memory available to this process
    (free device memory plus what PyTorch's caching allocator holds unused), so that sub-batches and blocks grow to
    what the device can hold. Read once per computation, before any work is queued (``cudaMemGetInfo`` does not
    wait for the device's queue).

    :param device: The compute device.
    :param chunk_mb: The caller's budget in MiB.
    :return: The budget in MiB.
    """
    if torch.device(device).type != "cuda":
        return chunk_mb
    free = available_memory(torch.device(device))
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(chunk_mb, DEVICE_CHUNK_SHARE * (free + max(cached, 0)) / 2**20)


def pass_chunk_mb(device: torch.device, budget_mb: float) -> float:
    """
    The budget of one forward/backward pass's intermediates: the chunk budget ``budget_mb``, on the CPU at most
    :data:`CPU_PASS_MB` (and on any device other than CUDA); on a CUDA device larger passes keep the device busy,
    so they take the whole budget.

    :param device: The compute device.
    :param budget_mb: The computation's chunk budget in MiB (:func:`device_chunk_mb`).
    :return: The pass budget in MiB.
    """
    if torch.device(device).type == "cuda":
        return budget_mb
    return min(budget_mb, CPU_PASS_MB)


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


class OutputElements(TorchDispatchMode):
    """
    Sizes of the tensors an operator-level pass creates: the numbers of all non-view operator outputs, and the
    largest one (the forward pass's intermediate tensors, what its autograd graph may hold).
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.total += t.numel()
                    self.largest = max(self.largest, t.numel())
        return out


@dataclass
class Features:
    """Per-example Jacobian factors of one batch (see :mod:`art_malleability.ntk.empirical`)."""

    n: int
    # per structured block: its input side (n, L, d_in) (an embedding's token indices (n, L)) and its output gradients
    # (n, L, C, o), or (n, 1, 1, o) rank-one factors g with δ_c = g u_c
    blocks: list[tuple[torch.Tensor, torch.Tensor]]
    jac: torch.Tensor | None  # (n, C, P): the explicit gradients and the fallback parameters' Jacobian, joined

    def _tensors(self) -> list[torch.Tensor | None]:
        return [*(t for pair in self.blocks for t in pair), self.jac]

    def nbytes(self) -> int:
        """:return: Memory of the stored factors."""
        return sum(t.numel() * t.element_size() for t in self._tensors() if t is not None)

    def empty_like(self, n: int) -> Features:
        """:return: Uninitialised factors for ``n`` examples, shaped like these."""

        def like(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.new_empty((n, *t.shape[1:]))

        return Features(n=n, blocks=[(like(a), like(d)) for a, d in self.blocks], jac=like(self.jac))

    def take(self, start: int, stop: int) -> Features:
        """:return: The factors of the examples ``start:stop`` (views, nothing copied)."""
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop]

        return Features(n=stop - start, blocks=[(rows(a), rows(d)) for a, d in self.blocks], jac=rows(self.jac))

    def fill(self, part: Features, start: int) -> None:
        """Copy the factors of ``part`` into rows ``start:start + part.n``."""
        stop = start + part.n
        for dst, src in zip(self._tensors(), part._tensors(), strict=True):
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
    compute: Callable[[torch.Tensor, torch.Tensor | None, Features | None], Features],
    x: torch.Tensor,
    y: torch.Tensor | None,
    step: int,
) -> Features:
    """
    Factors of a batch computed ``step`` examples at a time: the first sub-batch's factors give the shapes of the
    whole batch's, and each later sub-batch writes its factors straight into their rows (no copy of a gathered
    part).

    :param compute: Factors of one sub-batch ``(x, y, out) -> Features``, written into ``out`` when it is given (the
        rows of the whole batch's factors), else into new tensors.
    :param x: Inputs.
    :param y: Labels, or ``None``.
    :param step: Examples per sub-batch.
    :return: The factors of all of ``x``.
    """
    n = x.shape[0]
    if n <= step:
        return compute(x, y, None)
    out: Features | None = None
    for i in range(0, n, step):
        xi, yi = x[i : i + step], None if y is None else y[i : i + step]
        if out is None:
            part = compute(xi, yi, None)
            out = part.empty_like(n)
            out.fill(part, i)
            del part
        else:
            compute(xi, yi, out.take(i, i + xi.shape[0]))
    return out
