"""
The two ways ``fidelity_projection.py`` scores a setting besides the training and the attacks: the ideal dense
Gaussian sketch simulated from the exact kernel (:class:`IdealSketch`, and the exact scores from that kernel as a
cross-check), and one fit of :class:`~art_malleability.influence.NTKInfluence` in exact or projected mode with its
refits on the attacked top sets (:func:`run_mode`), compared with the exact mode (:func:`projected_vs_exact`,
:func:`compare`). Imported by that script (``from _fidelity_modes import ...``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import nn

from art_malleability.data import Dataset
from art_malleability.influence import NTKInfluence
from art_malleability.influence.base import regression_targets
from art_malleability.influence.ridge import loo_scores
from art_malleability.linalg.ridge import DualRidge
from art_malleability.metrics import (
    aggregate_scores,
    flip_mask,
    flip_rate,
    spearman,
    top_indices,
    top_k_count,
    top_k_jaccard,
)

TOP_FRACTION = 0.1
LOSS = "mse"  # NTKInfluence's default loss, the one the audit uses


# --------------------------------------------------------------------------- comparison

def pearson(a: np.ndarray, b: np.ndarray) -> float:
    keep = np.isfinite(a) & np.isfinite(b)
    return float(np.corrcoef(a[keep].ravel(), b[keep].ravel())[0, 1])


def compare(ref: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """Agreement of two influence matrices (query × train): all entries, aggregates and top sets."""
    agg_ref, agg_other = aggregate_scores(ref), aggregate_scores(other)
    return {
        "spearman_all": spearman(ref, other),
        "pearson_all": pearson(ref, other),
        "spearman_aggregate": spearman(agg_ref[None, :], agg_other[None, :]),
        "jaccard_top": top_k_jaccard(ref, other, TOP_FRACTION, "abs"),
    }


# --------------------------------------------------------------------------- ideal Gaussian sketch
class IdealSketch:
    """
    Scores of kernel ridge leave-one-out on the Gram of an ideal dense Gaussian sketch of the
    Jacobians, simulated from the exact kernel over training and query points.
    """

    def __init__(self, kernel_all: torch.Tensor, n_train: int, y_train: np.ndarray, y_query: np.ndarray, c: int):
        k = kernel_all.to(torch.float64)
        k = 0.5 * (k + k.T)
        evals, evecs = torch.linalg.eigh(k)
        self.clipped = int((evals < 0).sum())
        self.min_eval, self.max_eval = float(evals.min()), float(evals.max())
        self.root = (evecs * evals.clamp_min(0.0).sqrt()).numpy()  # U Λ^{1/2}, (n_all, n_all)
        self.n_train = n_train
        self.targets = regression_targets(torch.as_tensor(y_train), c, torch.float64)
        self.y_query = torch.as_tensor(y_query)

    def gram(self, k: int, seed: int) -> torch.Tensor:
        """``B (G Gᵀ / k) Bᵀ`` with ``B = U Λ^{1/2}``: the sketched kernel over all points."""
        n = self.root.shape[0]
        rng = np.random.default_rng(seed)
        wishart = np.zeros((n, n))
        for s in range(0, k, 4096):
            g = rng.standard_normal((n, min(4096, k - s)))
            wishart += g @ g.T
        wishart /= k
        gram = self.root @ wishart @ self.root.T
        return torch.as_tensor(0.5 * (gram + gram.T))

    def scores(self, gram: torch.Tensor, ridge: float) -> np.ndarray:
        n = self.n_train
        solver = DualRidge(ridge).fit(gram[:n, :n].contiguous().clone(), self.targets)
        f, b, beta = solver.loo_parts(gram[n:, :n].contiguous())
        return loo_scores(f, b, beta, self.y_query, LOSS).numpy()


def exact_scores_from_kernel(
    kernel_all: torch.Tensor, n: int, y: np.ndarray, yq: np.ndarray, c: int, ridge: float
) -> np.ndarray:
    """Exact scores from the full kernel (a cross-check of the library's exact mode)."""
    targets = regression_targets(torch.as_tensor(y), c, torch.float64)
    solver = DualRidge(ridge).fit(kernel_all[:n, :n].contiguous().clone(), targets)
    f, b, beta = solver.loo_parts(kernel_all[n:, :n].contiguous())
    return loo_scores(f, b, beta, torch.as_tensor(yq), LOSS).numpy()


# --------------------------------------------------------------------------- one mode
def run_mode(
    model: nn.Module,
    data: Dataset,
    xq: np.ndarray,
    yq: np.ndarray,
    x_adv: dict[str, np.ndarray],
    ridge: float,
    projection_dim: int | None,
    projection_seed: int,
    exact_top: np.ndarray | None,
    with_attacks: bool,
) -> dict[str, Any]:
    """
    Fit one mode, score the queries and (optionally) refit on each attack's perturbed top set.

    :return: Dict with ``scores``, ``top``, timings, flip rates per attack and, for the projected
        mode, the refits on the exact top set (``after_on_exact_top``).
    """
    est = NTKInfluence(ridge=ridge, projection_dim=projection_dim, projection_seed=projection_seed, device="cpu")
    start = time.perf_counter()
    est.fit(model, data.x_train, data.y_train)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    before = est.scores(xq, yq)
    scores_s = time.perf_counter() - start
    k_top = top_k_count(data.n_train, TOP_FRACTION)
    top = top_indices(aggregate_scores(before), k_top, "abs")
    out: dict[str, Any] = {
        "scores": before,
        "top": top,
        "fit_seconds": fit_s,
        "scores_seconds": scores_s,
        "mode": est.mode_,
        "solver": type(est.solver_).__name__,
        "realised_k": est.projection_dim_,
        "phase_seconds_fit": dict(est.seconds_),
    }
    if projection_dim is not None:
        out["groups"] = est.projector_.describe()
    if not with_attacks:
        return out
    out["flip_rate"], out["refit_seconds"], out["after"] = {}, {}, {}
    out["after_on_exact_top"] = {}
    for name, adv in x_adv.items():
        start = time.perf_counter()
        est.refit(top, adv[top])
        after = est.scores(xq, yq)
        out["refit_seconds"][name] = time.perf_counter() - start
        out["flip_rate"][name] = flip_rate(before, after, TOP_FRACTION, "abs", top=top)
        out["after"][name] = aggregate_scores(after)
        if exact_top is not None:
            est.refit(exact_top, adv[exact_top])
            out["after_on_exact_top"][name] = aggregate_scores(est.scores(xq, yq))
    return out


def projected_vs_exact(proj: dict[str, Any], exact: dict[str, Any]) -> dict[str, Any]:
    """Metrics of one projected run against the exact run of the same setting and ridge."""
    res: dict[str, Any] = compare(exact["scores"], proj["scores"])
    res.update(
        fit_seconds=proj["fit_seconds"], scores_seconds=proj["scores_seconds"], realised_k=proj["realised_k"]
    )
    if "flip_rate" not in proj:
        return res
    agg_e, agg_p = aggregate_scores(exact["scores"]), aggregate_scores(proj["scores"])
    top_e = exact["top"]
    res["clean_sign_agreement_exact_top"] = float(np.mean(np.sign(agg_e[top_e]) == np.sign(agg_p[top_e])))
    res["flip_rate"] = dict(proj["flip_rate"])
    res["flip_rate_diff_pp"] = {a: 100.0 * (proj["flip_rate"][a] - exact["flip_rate"][a]) for a in proj["flip_rate"]}
    res["refit_seconds"] = dict(proj["refit_seconds"])
    res["flip_rate_on_exact_top"], res["flip_agreement_exact_top"], res["after_sign_agreement_exact_top"] = {}, {}, {}
    for a, after_p in proj["after_on_exact_top"].items():
        flips_e = flip_mask(agg_e[top_e], exact["after"][a][top_e])
        flips_p = flip_mask(agg_p[top_e], after_p[top_e])
        res["flip_rate_on_exact_top"][a] = float(flips_p.mean())
        res["flip_agreement_exact_top"][a] = float(np.mean(flips_e == flips_p))
        res["after_sign_agreement_exact_top"][a] = float(
            np.mean(np.sign(exact["after"][a][top_e]) == np.sign(after_p[top_e]))
        )
    return res
