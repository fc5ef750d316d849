"""
How the audit's reports read its numbers: when a noise-aware flip rate reads *undecided* (one rule for the tables,
the figures and the warning), and the cells and axes they share (the report's tables, the budget sweep's).
"""

from __future__ import annotations

import math
from typing import Any

from art_malleability._utils.report_base import format_percent_ci, value_ci

#: A noise-aware flip rate whose interval is wider than this share of the set reads "undecided" in the tables: such an
#: interval cannot tell a rate of a few percent (the paper's 2L-ReLU) from one of 20 to 40 % (its MLP-Attn), so its
#: point value says nothing. The interval itself is shown; the JSON keeps every number.
UNDECIDED_WIDTH = 0.2
#: A noise-aware flip rate whose influential set has more than this share of undecidable perturbed signs (the
#: ``undecided_share``: perturbed aggregates within a standard error of zero, as attacks leave the members they do
#: not flip) also reads "undecided". There the deconvolution's estimate leans upward and its interval's low end can
#: stand above the truth: in the planted grid (``benchmarks/noise_aware_grid.py``, docs/metrics.md) the intervals no
#: wider than ``UNDECIDED_WIDTH`` covered 0.88-1.00 in every design once those with a share above 0.15 were set
#: aside, where 11 of the 40 narrow intervals above it missed (each one above the truth).
UNDECIDED_SHARE_LIMIT = 0.15


def undecided(v: float | None, ci: list[float | None], share: float | None = None) -> bool:
    """
    Whether a noise-aware flip rate reads undecided (the tables, the figure and the warning use this one rule): its
    interval wider than :data:`UNDECIDED_WIDTH`, or more than :data:`UNDECIDED_SHARE_LIMIT` of its set undecidable.

    :param v: The rate.
    :param ci: Its interval.
    :param share: The set's ``undecided_share`` (``None``: not known, as for a control's mean over draws).
    """
    if v is None or None in ci:
        return False
    return wide_interval(ci) or (share is not None and math.isfinite(share) and share > UNDECIDED_SHARE_LIMIT)


def wide_interval(ci: list[float]) -> bool:
    """Whether an interval is wider than :data:`UNDECIDED_WIDTH` (the one comparison of the width rule)."""
    return ci[1] - ci[0] > UNDECIDED_WIDTH + 1e-12


def noise_aware_text(v: float | None, ci: list[float | None], share: float | None = None) -> str:
    """The noise-aware flip rate [CI]; ``"undecided [CI]"`` where :func:`undecided` says so."""
    if undecided(v, ci, share):
        return f"undecided [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
    return format_percent_ci(v, ci)


def points_ci(v: float | None, ci: list[float | None]) -> str:
    """A difference of rates in percentage points, signed, with its interval."""
    return value_ci(v, ci, 100.0, "+.1f", " pts")


def axes(ax: Any, size: tuple[float, float]) -> Any:
    """:return: ``ax``, or the axes of a new matplotlib figure of ``size`` inches."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=size)
    return ax
