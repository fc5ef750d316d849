"""
Rank-one class factorisation of a layer's output gradients, ``δ_c(x)_j = g_j(x) u_{jc}``, checked for every example.

For ``trace=True``, ``C > 1`` and ``"structured"``, the output gradients of
a layer are checked column by column for the structure ``δ_c(x)_j = g_j(x) u_{jc}``, a
per-example scalar times a fixed per-column class direction ``u_j`` (unit norm). This holds
exactly whenever the layer output reaches the logits through an elementwise map followed by a
linear readout, e.g. the last hidden layer of an MLP, the first layer of the NTK-parametrised
reference models, or an output layer. Then ``Σ_c Δ1_c Δ2_cᵀ = G1 G2ᵀ`` (``G`` the ``n × m``
matrix of ``g``): ``C`` times less storage and ``C`` times fewer flops in the contraction. The
direction ``u_j`` is the normalised largest gradient of column ``j`` in the first sub-batch
where that column is non-zero; it is shared by all examples of one kernel computation
(examples seen earlier had a zero gradient there, so the choice is consistent). Every example
is verified: with ``g = δ·u`` the residual ``‖δ‖² − g²`` (the squared norm of
the part of ``δ`` orthogonal to ``u``) must be at most ``τ ‖δ‖²`` with ``τ = 8 (C + 2) ε``
(``ε`` the dtype's machine epsilon). The neglected term ``e1·e2`` is then bounded by
``τ ‖δ1‖ ‖δ2‖`` per column, the size of the rounding error of the direct contraction, so the
result stays exact to float precision. A layer that fails the check anywhere is switched to
the full ``(C × m)`` representation for good (for this engine) and the kernel is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Operators one :meth:`ClassDirections.factor` call dispatches once its directions are set.
CHECK_CALLS = 11


class RankChange(Exception):
    """A layer's output gradients turned out not to be rank one over the classes: recompute."""


@dataclass
class ClassDirections:
    """
    State of one kernel computation per structured layer: the class directions ``u`` ``(C, out)``,
    the mask of columns whose direction is set, and a reusable scratch buffer for raw gradients.
    """

    directions: list[torch.Tensor | None]
    known: list[torch.Tensor | None]
    scratch: list[torch.Tensor | None]

    @classmethod
    def fresh(cls, layers: int) -> ClassDirections:
        """:return: No direction set yet for ``layers`` layers."""
        return cls([None] * layers, [None] * layers, [None] * layers)

    def raw_buffer(self, k: int, shape: tuple[int, int, int], like: torch.Tensor, temporary: bool) -> torch.Tensor:
        """
        Uninitialised ``(n, C, out)`` buffer for the raw output gradients of layer ``k``. When the raw
        gradients are ``temporary`` (a rank-one layer), one scratch buffer is reused across
        sub-batches (fresh large allocations cost page faults); full factors get their own.
        """
        if not temporary:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        buf = self.scratch[k]
        if buf is None or buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:]:
            buf = self.scratch[k] = None  # release before allocating
            buf = self.scratch[k] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf[: shape[0]]

    @staticmethod
    def check_work(n: int, classes: int, width: int) -> tuple[float, int]:
        """
        The work of one :meth:`factor` call on ``(n, classes, width)`` gradients once the directions are set, as
        :func:`~art_malleability.ntk.cost.count` counts it (elementwise work only: no counted operations): the
        numbers its operators write (the squares and the products, ``C`` times over, five ``(n, width)`` results
        and two booleans) and its operator calls.

        :return: Numbers written and operator calls.
        """
        return float(n * width * (2 * classes + 5) + 2), CHECK_CALLS

    def factor(self, k: int, d: torch.Tensor) -> torch.Tensor | None:
        """
        Rank-one factor ``g = δ·u`` (``(n, out)``) of raw output gradients ``d`` (``(n, C, out)``)
        of layer ``k``, after checking ``‖δ‖² − g² ≤ τ ‖δ‖²`` for every example and column.

        :return: The factor, or ``None`` if the check fails.
        """
        n, n_out, width = d.shape
        sq = (d * d).sum(1)  # ‖δ‖² per example and column: the classes summed in one operation
        if self.directions[k] is None:
            self.directions[k] = torch.zeros((n_out, width), dtype=d.dtype, device=d.device)
            self.known[k] = torch.zeros(width, dtype=torch.bool, device=d.device)
        u, known = self.directions[k], self.known[k]
        if not bool(known.all()):
            peak, row = sq.max(dim=0)
            cols = ((~known) & (peak > 0)).nonzero().squeeze(1)
            if cols.numel():
                vec = d[row[cols], :, cols]  # (len(cols), C): the largest gradient of each new column
                u[:, cols] = (vec / peak[cols].sqrt().unsqueeze(1)).T
                known[cols] = True
        g = (d * u).sum(1)
        tol = 8.0 * (n_out + 2) * torch.finfo(d.dtype).eps
        # sq <- ‖δ‖² − g² − τ ‖δ‖², the orthogonal residual beyond the tolerance; non-finite
        # gradients also fail the check, so that they reach the kernel through the full factors
        sq.mul_(1.0 - tol).addcmul_(g, g, value=-1.0)
        return g if bool((sq <= 0).all()) else None
