"""
The paper's loss-landscape claim, measured: MLP-Attn is said to find flatter minima than the 2L-ReLU.

For each of the paper's two reference models and each seed, the Table 2 model (the paper's protocol, cross-entropy)
is measured on its training set with :func:`~art_malleability.models.landscape.hessian_top_eigenvalues` (the top
eigenvalue of the Hessian of the data loss, Lanczos on exact Hessian-vector products) and
:func:`~art_malleability.models.landscape.loss_profile` (filter-normalised 1-D profiles along random directions, Li
et al. 2018). Every statistic is a mean over seeds with a Student-t interval over the seeds; the difference
MLP-Attn − 2L-ReLU is paired by seed. Both models share their parametrisation (NTK, only the first layer trained),
so the top eigenvalue compares like with like; the filter-normalised profile is the scale-free check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from art_malleability._utils.io import figure_png
from art_malleability._utils.report_base import markdown_table
from art_malleability.data.datasets import Dataset
from art_malleability.models.landscape import hessian_top_eigenvalues, loss_profile
from art_malleability.paper.common import fmt_ci, mean_ci, progress

#: Step sizes of the profiles, and those whose rise the table reports.
ALPHAS = np.linspace(-1.0, 1.0, 41)
RISES = (0.5, 1.0)
N_DIRECTIONS = 5


def landscape_table(config, data: Dataset, models: list[str], trained: Callable[[str, int], tuple]) -> tuple:
    """
    Measure the Table 2 models' loss landscapes.

    :param config: The run's :class:`~art_malleability.paper.reproduce.ReproductionConfig`.
    :param data: The Table 2 data.
    :param models: The reference models to measure.
    :param trained: ``(model, seed) -> (classifier, accuracy)``: the Table 2 model, trained once.
    :return: ``(rows, markdown, png_bytes)``: one row per model and seed, the table and the profiles' figure.
    """
    rows, profiles = [], {}
    for model in models:
        for seed in progress(config, config.seeds, f"loss landscape {model}"):
            clf, accuracy = trained(model, seed)
            spectrum = hessian_top_eigenvalues(clf.model, data.x_train, data.y_train, k=1, tol=1e-6, seed=seed,
                                               device=config.device, verbose=False)
            profile = loss_profile(clf.model, data.x_train, data.y_train, alphas=ALPHAS, n_directions=N_DIRECTIONS,
                                   seed=seed, verbose=False)
            profiles[(model, seed)] = profile
            rows.append({
                "table": "landscape", "model": model, "seed": seed, "accuracy": accuracy,
                "train_loss": spectrum.loss_value, "lambda_max": float(spectrum.eigenvalues[0]),
                "lambda_max_regularised": float(spectrum.eigenvalues[0]) + config.weight_decay,
                "curvature": float(np.mean(2 * profile.curvature)),
                **{f"rise_{a}": profile.rise(a) for a in RISES}, "n_hvp": spectrum.n_hvp,
            })
    return rows, _markdown(config, data, models, rows), figure_png(_figure(models, config.seeds, profiles))


_COLUMNS = (("train_loss", 4), ("lambda_max", 4), ("curvature", 4)) + tuple((f"rise_{a}", 3) for a in RISES)
_UNBOUNDED = (-np.inf, np.inf)


def _markdown(config, data: Dataset, models: list[str], rows: list[dict[str, Any]]) -> str:
    table = []
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        table.append([model, *[fmt_ci(*mean_ci([r[key] for r in mine]), digits, _UNBOUNDED)
                               for key, digits in _COLUMNS],
                      fmt_ci(*mean_ci([100 * r["accuracy"] for r in mine]), 1)])
    if {"2l-relu", "mlp-attn"} <= set(models):
        by_seed = {(r["model"], r["seed"]): r for r in rows}
        table.append(["MLP-Attn − 2L-ReLU (paired)", *[
            fmt_ci(*mean_ci([by_seed[("mlp-attn", s)][key] - by_seed[("2l-relu", s)][key] for s in config.seeds]),
                   digits, _UNBOUNDED) for key, digits in _COLUMNS], "–"])
    rises = [f"rise at α = {a}" for a in RISES]
    return "\n".join([
        f"## Loss landscape of the Table 2 models ({len(data.x_train):,} training examples, cross-entropy)", "",
        f"Mean over seeds {tuple(config.seeds)} [95 % t-interval]. λ_max: top eigenvalue of the Hessian of the data "
        f"loss (Lanczos, exact Hessian-vector products; the L2 term would add {config.weight_decay:g}). dᵀHd: "
        f"directional second derivative along {N_DIRECTIONS} filter-normalised random directions (quadratic fit "
        "over |α| ≤ 0.1). Rise: mean loss increase at ±α along them. Lower = flatter.", "",
        markdown_table(["model", "train loss", "λ_max", "dᵀHd", *rises, "test acc. %"], table), "",
        "![loss profiles](landscape.png)",
    ])


def _figure(models: list[str], seeds, profiles: dict) -> Any:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(5.5, 3.6))
    for colour, model in zip(("tab:blue", "tab:orange", "tab:green"), models, strict=False):
        for i, seed in enumerate(seeds):
            profile = profiles[(model, seed)]
            ax.plot(profile.alphas, profile.losses.mean(axis=0), color=colour, lw=1.2, alpha=0.7,
                    label=model if i == 0 else None)
    ax.set_xlabel("α (filter-normalised)")
    ax.set_ylabel("training loss (mean over directions)")
    ax.set_title("1-D loss profiles, one line per seed")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


__all__ = ["landscape_table"]
