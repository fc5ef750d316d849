"""The checks of the linear algebra: finite entries, and the error of a matrix that is not positive definite."""

from __future__ import annotations

import torch

#: Elements of a row block in the finiteness check (8 MiB in float64).
_CHECK_ELEMENTS = 2**20


def check_finite(a: torch.Tensor, what: str) -> None:
    """Refuse a matrix with NaN or infinite entries, checked in row blocks (no temporary of ``a``'s size)."""
    step = max(1, _CHECK_ELEMENTS // max(a.shape[1] if a.ndim > 1 else 1, 1))
    for s in range(0, a.shape[0], step):
        if not bool(torch.isfinite(a[s : s + step]).all()):
            raise ValueError(
                f"{what} must be finite, got NaN or infinite values; check the inputs and the model's outputs"
            )


def not_positive_definite(what: str, ridge: float, scale: float) -> ValueError:
    """:return: The error of a matrix that is not positive definite, with what to change."""
    return ValueError(f"{what} must be positive definite, got ridge={ridge!r} at scale {scale:.3g}; increase ridge")
