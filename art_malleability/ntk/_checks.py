"""
Argument checks shared by the NTK tools (counts through
:func:`art_malleability._utils.checks.check_positive_int`).
"""

from __future__ import annotations

import math

import numpy as np

from art_malleability._utils.checks import check_positive_int
from art_malleability._utils.params import PROJECTION_DIM


def check_batch_size(batch_size: int) -> int:
    """
    :param batch_size: Largest number of examples per pass.
    :return: It, as an int.
    :raises ValueError: Unless it is a positive integer.
    """
    return check_positive_int(batch_size, "batch_size")


def check_chunk_mb(chunk_mb: float) -> float:
    """
    :param chunk_mb: A memory budget in MiB.
    :return: It, as a float.
    :raises ValueError: Unless it is a finite positive number.
    """
    ok = not isinstance(chunk_mb, bool) and isinstance(chunk_mb, (int, float, np.integer, np.floating))
    if not ok or not math.isfinite(float(chunk_mb)) or chunk_mb <= 0:
        raise ValueError(f"chunk_mb must be a positive number of MiB, got {chunk_mb!r}")
    return float(chunk_mb)


def check_projection_dim(projection_dim: object, name: str = "projection_dim") -> int:
    """
    Check a projection dimension through the rule :data:`~art_malleability._utils.params.PROJECTION_DIM`: a positive
    integer below 2**31.

    :param projection_dim: The candidate.
    :param name: Argument name for the error message.
    :return: It, as an int.
    :raises InvalidParameterError: Otherwise, naming ``name`` (a ``ValueError``).
    """
    return PROJECTION_DIM(projection_dim, name)
