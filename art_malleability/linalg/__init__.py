"""
Exact linear algebra of kernel ridge regression: the dual and primal solves with their closed-form leave-one-out and
row updates (:mod:`~art_malleability.linalg.ridge`), and the factors of the dual solve, held whole or in tiles in
memory or on disk (:mod:`~art_malleability.linalg.factors`, the protocol both implement). It imports nothing of the
package above the process group, so that the influence estimators and the NTK diagnostics both build on it.
"""

from art_malleability.linalg._checks import check_finite
from art_malleability.linalg.factors import Columns, InverseFactor, inverse_cholesky_, row_block
from art_malleability.linalg.ridge import DualRidge, PrimalRidge, kernel_ridge_predict

__all__ = [
    "Columns",
    "DualRidge",
    "InverseFactor",
    "PrimalRidge",
    "check_finite",
    "inverse_cholesky_",
    "kernel_ridge_predict",
    "row_block",
]
