"""
Benchmark: fidelity of the projected NTK influence to the exact one.

:class:`~art_malleability.influence.NTKInfluence` has two modes: the **exact** mode (closed-form
leave-one-out of kernel ridge regression on the ``n × n`` empirical NTK) and the **projected**
mode (the same leave-one-out on ``k``-dimensional features from a seeded, unbiased random
projection of each example's logit Jacobian, Kronecker-factored per ``Linear``/``Conv2d`` layer as
in LoGra). This script measures how far the projected scores are from the exact ones, and how much
that matters for the audit's output (the influence flip rate).

For every setting (a data set and a model, trained once with a fixed seed) it computes

1. the exact scores ``(n_query, n_train)`` and, for every projection dimension ``k`` and projection
   seed, the projected scores; Spearman and Pearson correlation of projected vs exact over all
   (query, train) entries;
2. Spearman correlation of the aggregate scores (mean over queries per training example) and the
   Jaccard overlap of the two top-10 % sets by ``|aggregate|`` (the audit's influential set);
3. the flip rate of FGSM, PGD and MIM (``eps`` 0.3, strategy ``"top"``): the clean top set of each
   mode is perturbed with the library's attacks, the influence is recomputed with the same weights
   (``refit``), and the flip rate is the share of that top set whose aggregate influence changes
   sign. Each mode uses its *own* top set (what a user of that mode gets); the report gives the
   difference projected − exact in percentage points. The projected mode is also refitted on the
   exact mode's perturbed top set, to report the agreement of the two modes on the same examples:
   share of the exact top set where the clean aggregate signs agree, where the flip decisions
   agree, and the projected flip rate on that set;
4. an **ideal dense Gaussian sketch** as a reference: with the exact kernel over train and query
   points ``K = U Λ Uᵀ``, features ``Φ̃ = U Λ^{1/2} G / √k`` (``G`` an i.i.d. standard Gaussian
   ``(n_train + n_query) × k`` matrix) have a Gram ``Φ̃Φ̃ᵀ`` distributed exactly like that of a dense
   Gaussian projection ``J Rᵀ`` of the full Jacobians ``J`` (rotation invariance). Its scores come
   from the library's dual ridge solver on ``Φ̃Φ̃ᵀ``. This is what an unbiased projection of
   dimension ``k`` with i.i.d. entries achieves; a Kronecker-factored projection has a larger
   variance per kernel entry (about ``1/k_out + 1/k_in``, i.e. ``≈ 2/√k``, instead of ``≈ 1/k``);
5. wall time of the exact and projected fits, their clean scores and their refits.

Settings (``n_train`` 2000, 100 queries from the test split, ridge ``1e-3`` = the library default):
MNIST with the 2L-ReLU reference model (width 512, Adam lr 3e-2, 100 epochs, no weight decay),
MNIST with :class:`~art_malleability.models.architectures.SmallCNN` (Adam lr 1e-3, 30 epochs) and CIFAR-10
with SmallCNN (same training); for MNIST 2L-ReLU also a ridge sweep (``1e-3``, ``1e-1``, ``1``):
Spearman of all scores vs ``k``, the exact scores recomputed for every ridge.

Attacks: every attack is deterministic and acts on each example independently (FGSM; PGD and MIM
without random start), so every training example is attacked once with
:func:`~art_malleability.audit.attacks.perturb_training_set` and the rows of each top set are taken from
that array; the script checks this against attacking the exact top set alone.

Outputs: a JSON of every number (``--output``), a figure (``--figure``) and a Markdown summary
(printed, and written next to the JSON as ``summary.md``).

Usage (from the repository root)::

    python benchmarks/fidelity_projection.py                 # full study (about an hour on 2 CPU cores)
    python benchmarks/fidelity_projection.py --quick         # tiny sizes, under a minute
    python benchmarks/fidelity_projection.py --settings mnist-2l-relu --ks 256 1024
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
from torch import nn

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)

from art_malleability.audit.attacks import ATTACK_NAMES, make_attack, perturb_training_set  # noqa: E402
from art_malleability.data import Dataset, load_dataset  # noqa: E402
from art_malleability.influence import NTKInfluence  # noqa: E402
from art_malleability.influence.base import regression_targets  # noqa: E402
from art_malleability.influence.ridge import DualRidge, loo_scores  # noqa: E402
from art_malleability.metrics import (  # noqa: E402
    aggregate_scores,
    flip_mask,
    flip_rate,
    spearman,
    top_indices,
    top_k_count,
    top_k_jaccard,
)
from art_malleability.models import (  # noqa: E402
    SmallCNN,
    build_reference_model,
    make_classifier,
    train_model,
)
from art_malleability.ntk.empirical import empirical_ntk  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
DEFAULT_FIGURE = REPO / "docs" / "figures" / "projection_fidelity.png"
SETTING_NAMES = ("mnist-2l-relu", "mnist-cnn", "cifar10-cnn")
TOP_FRACTION = 0.1
LOSS = "mse"  # NTKInfluence's default loss, the one the audit uses


@dataclass
class Setting:
    """A data set, a model and its training recipe."""

    name: str
    dataset: str  # "mnist" or "cifar10"
    model: str  # "2l-relu" or "cnn"
    epochs: int
    lr: float
    ridges: tuple[float, ...] = (1e-3,)  # the first is the main ridge; the others form the sweep
    notes: list[str] = field(default_factory=list)


@dataclass
class Config:
    """Sizes of the study."""

    n_train: int
    n_test: int
    n_queries: int
    ks: tuple[int, ...]
    ideal_ks: tuple[int, ...]
    seeds: tuple[int, ...]
    eps: float
    attack_max_iter: int
    width: int
    epochs_mlp: int
    epochs_cnn: int
    sweep_ridges: tuple[float, ...]
    seed: int


def full_config(args: argparse.Namespace) -> Config:
    if args.quick:
        return Config(
            n_train=200, n_test=60, n_queries=20, ks=(64, 256), ideal_ks=(64, 256, 1024), seeds=(0, 1),
            eps=0.3, attack_max_iter=5, width=128, epochs_mlp=5, epochs_cnn=2, sweep_ridges=(1e-3, 1.0),
            seed=args.seed,
        )
    return Config(
        n_train=args.n_train, n_test=args.n_test, n_queries=args.n_queries, ks=tuple(args.ks),
        ideal_ks=tuple(sorted(set(args.ks) | set(args.ideal_extra_ks))), seeds=tuple(args.projection_seeds),
        eps=args.eps, attack_max_iter=args.attack_max_iter, width=args.width, epochs_mlp=args.epochs_mlp,
        epochs_cnn=args.epochs_cnn, sweep_ridges=tuple(args.sweep_ridges), seed=args.seed,
    )


def make_settings(cfg: Config, names: list[str]) -> list[Setting]:
    table = {
        "mnist-2l-relu": Setting("mnist-2l-relu", "mnist", "2l-relu", cfg.epochs_mlp, 3e-2, cfg.sweep_ridges),
        "mnist-cnn": Setting("mnist-cnn", "mnist", "cnn", cfg.epochs_cnn, 1e-3),
        "cifar10-cnn": Setting("cifar10-cnn", "cifar10", "cnn", cfg.epochs_cnn, 1e-3),
    }
    return [table[n] for n in names]


# --------------------------------------------------------------------------- helpers
def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load(setting: Setting, cfg: Config, data_root: Path) -> Dataset:
    if setting.dataset == "mnist":
        return load_dataset("mnist", root=data_root / "mnist", n_train=cfg.n_train, n_test=cfg.n_test, seed=cfg.seed)
    return load_dataset(
        data_root / "cifar10" / "cifar10_test_jpeg.npz", n_train=cfg.n_train, n_test=cfg.n_test, seed=cfg.seed
    )


def build_model(setting: Setting, data: Dataset, cfg: Config) -> nn.Module:
    if setting.model == "2l-relu":
        return build_reference_model("2l-relu", data.input_shape, data.nb_classes, width=cfg.width, seed=cfg.seed)
    return SmallCNN(data.input_shape, data.nb_classes, seed=cfg.seed)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        pred = torch.cat([model(torch.as_tensor(x[s : s + 500])).argmax(1) for s in range(0, len(x), 500)])
    return float((pred.numpy() == y).mean())


def one_hot(y: np.ndarray, c: int) -> np.ndarray:
    out = np.zeros((len(y), c), dtype=np.float32)
    out[np.arange(len(y)), y] = 1.0
    return out


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


def summarise(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Mean, min and max over seeds of every numeric entry (nested one level for per-attack dicts)."""
    seeds = list(per_seed)
    out: dict[str, Any] = {"mean": {}, "min": {}, "max": {}}
    for key, value in per_seed[seeds[0]].items():
        if isinstance(value, dict):
            for stat in out:
                out[stat][key] = {}
            for sub in value:
                vals = [per_seed[s][key][sub] for s in seeds]
                if all(isinstance(v, (int, float)) for v in vals):
                    out["mean"][key][sub] = float(np.mean(vals))
                    out["min"][key][sub] = float(np.min(vals))
                    out["max"][key][sub] = float(np.max(vals))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = [per_seed[s][key] for s in seeds]
            out["mean"][key], out["min"][key], out["max"][key] = (
                float(np.mean(vals)), float(np.min(vals)), float(np.max(vals))
            )
    return out


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


# --------------------------------------------------------------------------- one setting
def run_setting(setting: Setting, cfg: Config, data_root: Path) -> dict[str, Any]:
    t_setting = time.perf_counter()
    log(f"=== {setting.name}: loading data")
    data = load(setting, cfg, data_root)
    c = data.nb_classes
    rng = np.random.default_rng(cfg.seed)  # query sample as MalleabilityEstimator draws it
    rows = np.sort(rng.choice(data.n_test, min(cfg.n_queries, data.n_test), replace=False))
    xq, yq = data.x_test[rows], data.y_test[rows]
    result: dict[str, Any] = {
        "dataset": data.name, "source": data.source, "model": setting.model, "n_train": data.n_train,
        "n_queries": len(rows), "query_rows": rows.tolist(), "ridge": setting.ridges[0], "notes": setting.notes,
    }

    model = build_model(setting, data, cfg)
    log(f"training {setting.model} ({setting.epochs} epochs, lr {setting.lr})")
    start = time.perf_counter()
    train_model(
        model, data.x_train, data.y_train, epochs=setting.epochs, lr=setting.lr, weight_decay=0.0,
        seed=cfg.seed, device="cpu", verbose=False,
    )
    result["train"] = {
        "epochs": setting.epochs, "lr": setting.lr, "weight_decay": 0.0, "seconds": time.perf_counter() - start,
        "train_accuracy": accuracy(model, data.x_train, data.y_train),
        "test_accuracy": accuracy(model, data.x_test, data.y_test),
        "n_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    log(f"trained in {result['train']['seconds']:.0f} s: train accuracy {result['train']['train_accuracy']:.3f}, "
        f"test accuracy {result['train']['test_accuracy']:.3f}")

    # attacks: every training example once (deterministic, per-example attacks)
    classifier = make_classifier(model, data.input_shape, c, device="cpu")
    y_onehot = one_hot(data.y_train, c)
    x_adv, result["attacks"] = {}, {}
    attacks = {}
    for name in ATTACK_NAMES:
        attack = make_attack(name, classifier, cfg.eps, cfg.attack_max_iter)
        attacks[name] = attack
        start = time.perf_counter()
        x_adv[name] = perturb_training_set(attack, data.x_train, y_onehot, np.arange(data.n_train), seed=cfg.seed)
        pred_clean = classifier.predict(data.x_train).argmax(1)
        pred_adv = classifier.predict(x_adv[name]).argmax(1)
        result["attacks"][name] = {
            "seconds": time.perf_counter() - start,
            "success_rate": float(np.mean(pred_clean != pred_adv)),
            "max_linf": float(np.max(np.abs(x_adv[name] - data.x_train))),
        }
        log(f"attack {name}: {result['attacks'][name]['seconds']:.0f} s, "
            f"success {result['attacks'][name]['success_rate']:.3f}")

    # exact kernel over train + query points (ideal sketch and cross-check)
    model64 = copy.deepcopy(model).to(torch.float64).eval()
    start = time.perf_counter()
    kernel_all = empirical_ntk(model64, np.concatenate([data.x_train, xq]))
    kernel_s = time.perf_counter() - start
    log(f"full kernel ({kernel_all.shape[0]} points) in {kernel_s:.0f} s")
    ideal = IdealSketch(kernel_all, data.n_train, data.y_train, yq, c)
    result["kernel"] = {
        "seconds": kernel_s, "n_points": int(kernel_all.shape[0]), "negative_eigenvalues_clipped": ideal.clipped,
        "min_eigenvalue": ideal.min_eval, "max_eigenvalue": ideal.max_eval,
        "trace_train_mean": float(kernel_all[: data.n_train].diagonal().mean()),
    }

    result["by_ridge"] = {}
    for r_idx, ridge in enumerate(setting.ridges):
        main = r_idx == 0
        log(f"--- ridge {ridge:g}: exact")
        exact = run_mode(model, data, xq, yq, x_adv, ridge, None, 0, None, with_attacks=main)
        ref = exact_scores_from_kernel(kernel_all, data.n_train, data.y_train, yq, c, ridge)
        scale = float(np.abs(exact["scores"]).max())
        block: dict[str, Any] = {
            "exact": {
                "fit_seconds": exact["fit_seconds"], "scores_seconds": exact["scores_seconds"],
                "phase_seconds_fit": exact["phase_seconds_fit"],
                "max_abs_scores": scale,
                "crosscheck_max_rel_diff": float(np.abs(exact["scores"] - ref).max() / scale),
                "crosscheck_spearman": spearman(exact["scores"], ref),
            }
        }
        log(f"exact: fit {exact['fit_seconds']:.1f} s, scores {exact['scores_seconds']:.1f} s, cross-check "
            f"max rel diff {block['exact']['crosscheck_max_rel_diff']:.2e}")
        if main:
            block["exact"].update(flip_rate=exact["flip_rate"], refit_seconds=exact["refit_seconds"],
                                  top_k=len(exact["top"]))
            log("exact flip rates: " + ", ".join(f"{a} {v:.3f}" for a, v in exact["flip_rate"].items()))
            check = {}
            for name, attack in attacks.items():  # attacking the top set alone gives the same rows
                alone = perturb_training_set(attack, data.x_train, y_onehot, exact["top"], seed=cfg.seed)
                check[name] = float(np.abs(alone[exact["top"]] - x_adv[name][exact["top"]]).max())
            block["exact"]["attack_rows_max_abs_diff"] = check

        block["projected"] = {}
        for k in cfg.ks:
            runs, per_seed = {}, {}
            for s in cfg.seeds:
                proj = run_mode(model, data, xq, yq, x_adv, ridge, k, s, exact["top"], with_attacks=main)
                runs[s] = proj
                per_seed[s] = projected_vs_exact(proj, exact)
                m = per_seed[s]
                msg = (f"k={k} seed {s} (realised {proj['realised_k']}, {proj['solver']}): "
                       f"fit {proj['fit_seconds']:.1f} s, Spearman all {m['spearman_all']:.3f}, "
                       f"aggregate {m['spearman_aggregate']:.3f}, Jaccard {m['jaccard_top']:.3f}")
                if main:
                    msg += ", dFR " + " ".join(f"{a} {v:+.1f}" for a, v in m["flip_rate_diff_pp"].items())
                log(msg)
            entry: dict[str, Any] = {"per_seed": {str(s): v for s, v in per_seed.items()}, **summarise(per_seed)}
            entry["groups"] = runs[cfg.seeds[0]]["groups"]
            entry["solver"] = runs[cfg.seeds[0]]["solver"]
            if len(cfg.seeds) >= 2:
                a, b = runs[cfg.seeds[0]], runs[cfg.seeds[1]]
                s2s: dict[str, Any] = compare(a["scores"], b["scores"])
                if main:
                    s2s["flip_rate_abs_diff_pp"] = {
                        att: 100.0 * abs(a["flip_rate"][att] - b["flip_rate"][att]) for att in a["flip_rate"]
                    }
                entry["seed_to_seed"] = s2s
            block["projected"][str(k)] = entry
            del runs

        block["ideal"] = {}
        result["by_ridge"][f"{ridge:g}"] = block
        log(f"ridge {ridge:g} done")

    # ideal sketch: one sketched kernel per (k, seed), evaluated at every ridge
    exact_refs = {
        ridge: exact_scores_from_kernel(kernel_all, data.n_train, data.y_train, yq, c, ridge)
        for ridge in setting.ridges
    }
    for k in cfg.ideal_ks:
        per_ridge: dict[float, dict[int, dict[str, float]]] = {r: {} for r in setting.ridges}
        scores_by: dict[float, dict[int, np.ndarray]] = {r: {} for r in setting.ridges}
        for s in cfg.seeds:
            start = time.perf_counter()
            gram = ideal.gram(k, seed=10_000 * cfg.seed + 1000 + 17 * s + k)
            gram_s = time.perf_counter() - start
            for ridge in setting.ridges:
                sc = ideal.scores(gram, ridge)
                scores_by[ridge][s] = sc
                per_ridge[ridge][s] = {**compare(exact_refs[ridge], sc), "sketch_seconds": gram_s}
            log(f"ideal k={k} seed {s}: Spearman all "
                + ", ".join(f"ridge {r:g} {per_ridge[r][s]['spearman_all']:.3f}" for r in setting.ridges))
            del gram
        for ridge in setting.ridges:
            entry = {"per_seed": {str(s): v for s, v in per_ridge[ridge].items()}, **summarise(per_ridge[ridge])}
            if len(cfg.seeds) >= 2:
                entry["seed_to_seed"] = compare(scores_by[ridge][cfg.seeds[0]], scores_by[ridge][cfg.seeds[1]])
            result["by_ridge"][f"{ridge:g}"]["ideal"][str(k)] = entry

    result["seconds"] = time.perf_counter() - t_setting
    log(f"=== {setting.name} done in {result['seconds'] / 60:.1f} min")
    return result


# --------------------------------------------------------------------------- reporting
def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Projected vs exact NTK influence", ""]
    cfg = results["config"]
    lines.append(
        f"n_train {cfg['n_train']}, {cfg['n_queries']} test queries, eps {cfg['eps']}, "
        f"top {int(100 * TOP_FRACTION)} %, "
        f"projection seeds {cfg['seeds']}; values are means over the projection seeds, `s2s` the same statistic "
        "between the two seeds' projected scores. dFR = flip rate (projected, own top set) − flip rate (exact), "
        "percentage points. Ideal = dense Gaussian sketch of the same k (simulation)."
    )
    lines.append("")
    for name, res in results["settings"].items():
        main = res["by_ridge"][f"{res['ridge']:g}"]
        ex = main["exact"]
        tr = res["train"]
        lines.append(f"## {name} (ridge {res['ridge']:g})")
        lines.append("")
        lines.append(
            f"Training: {tr['epochs']} epochs, lr {tr['lr']:g}: train accuracy {100 * tr['train_accuracy']:.1f} %, "
            f"test accuracy {100 * tr['test_accuracy']:.1f} % ({tr['seconds']:.0f} s). "
            f"Exact: fit {ex['fit_seconds']:.1f} s, "
            f"scores {ex['scores_seconds']:.1f} s, refit+scores {np.mean(list(ex['refit_seconds'].values())):.1f} s "
            "per attack; flip rates "
            + ", ".join(f"{a.upper()} {100 * v:.1f} %" for a, v in ex["flip_rate"].items())
            + ". Attack success on the training set: "
            + ", ".join(f"{a.upper()} {100 * v['success_rate']:.0f} %" for a, v in res["attacks"].items())
            + "."
        )
        for note in res.get("notes", []):
            lines.append(f"Note: {note}")
        lines.append("")
        lines.append(
            "| k | Spearman all (s2s) | Pearson all | ideal Spearman all | Spearman agg (s2s) | ideal Spearman agg "
            "| Jaccard top (s2s) | ideal Jaccard | dFR FGSM | dFR PGD | dFR MIM | sign agree (exact top) "
            "| flip agree (exact top, mean) | fit+scores s |"
        )
        lines.append("|" + "---|" * 14)
        for k, entry in main["projected"].items():
            m, s2s = entry["mean"], entry.get("seed_to_seed", {})
            ideal = main["ideal"].get(k, {}).get("mean", {})
            dfr = m.get("flip_rate_diff_pp", {})
            agree = m.get("flip_agreement_exact_top", {})
            lines.append(
                f"| {k} | {_fmt(m['spearman_all'])} ({_fmt(s2s.get('spearman_all'))}) | {_fmt(m['pearson_all'])} "
                f"| {_fmt(ideal.get('spearman_all'))} "
                f"| {_fmt(m['spearman_aggregate'])} ({_fmt(s2s.get('spearman_aggregate'))}) "
                f"| {_fmt(ideal.get('spearman_aggregate'))} "
                f"| {_fmt(m['jaccard_top'])} ({_fmt(s2s.get('jaccard_top'))}) | {_fmt(ideal.get('jaccard_top'))} "
                + "".join(f"| {_fmt(dfr.get(a), '+.1f')} " for a in ATTACK_NAMES)
                + f"| {_fmt(m.get('clean_sign_agreement_exact_top'))} "
                f"| {_fmt(float(np.mean(list(agree.values()))) if agree else None)} "
                f"| {m['fit_seconds'] + m['scores_seconds']:.1f} |"
            )
        extra = [k for k in main["ideal"] if k not in main["projected"]]
        if extra:
            lines.append("")
            lines.append(
                "Ideal sketch beyond the projected k's: "
                + "; ".join(
                    f"k={k}: Spearman all {_fmt(main['ideal'][k]['mean']['spearman_all'])}, "
                    f"aggregate {_fmt(main['ideal'][k]['mean']['spearman_aggregate'])}, "
                    f"Jaccard {_fmt(main['ideal'][k]['mean']['jaccard_top'])}"
                    for k in extra
                )
            )
        lines.append("")
        if len(res["by_ridge"]) > 1:
            lines.append(f"### {name}: ridge sweep (Spearman of all scores, projected / ideal sketch)")
            lines.append("")
            ks = list(next(iter(res["by_ridge"].values()))["ideal"])
            lines.append("| ridge | exact fit+scores s | " + " | ".join(f"k={k}" for k in ks) + " |")
            lines.append("|" + "---|" * (2 + len(ks)))
            for ridge, block in res["by_ridge"].items():
                cells = []
                for k in ks:
                    proj = block["projected"].get(k, {}).get("mean", {}).get("spearman_all")
                    ideal = block["ideal"][k]["mean"]["spearman_all"]
                    cells.append(f"{_fmt(proj)} / {_fmt(ideal)}")
                ex_s = block["exact"]["fit_seconds"] + block["exact"]["scores_seconds"]
                lines.append(f"| {ridge} | {ex_s:.1f} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(f"Total runtime: {results['total_seconds'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def series(block: dict[str, Any], key: str, stat: str = "mean") -> list[float]:
    """A statistic of a per-k block, in increasing k."""
    return [block[str(k)][stat][key] for k in sorted(int(x) for x in block)]


def figure(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax_all, ax_agg, ax_fr, ax_ridge = axes.ravel()
    for i, (name, res) in enumerate(results["settings"].items()):
        col = colours[i % len(colours)]
        main = res["by_ridge"][f"{res['ridge']:g}"]
        ks = [int(k) for k in main["projected"]]

        lo, hi, mean = (series(main["projected"], "spearman_all", s) for s in ("min", "max", "mean"))
        ax_all.errorbar(ks, mean, yerr=[np.subtract(mean, lo), np.subtract(hi, mean)], color=col, marker="o",
                        capsize=3, label=f"{name} (Kronecker)")
        iks = sorted(int(k) for k in main["ideal"])
        ax_all.plot(iks, series(main["ideal"], "spearman_all"), color=col, ls="--", marker="x",
                    label=f"{name} (ideal dense sketch)")
        ax_agg.plot(ks, series(main["projected"], "spearman_aggregate"), color=col, marker="o",
                    label=f"{name}: Spearman aggregate")
        ax_agg.plot(ks, series(main["projected"], "jaccard_top"), color=col, marker="s", ls=":",
                    label=f"{name}: Jaccard top 10 %")
        ax_agg.plot(iks, series(main["ideal"], "spearman_aggregate"), color=col, ls="--", alpha=0.5)
        markers = {"fgsm": "o", "pgd": "s", "mim": "^"}
        for a in ATTACK_NAMES:
            vals = [abs(main["projected"][str(k)]["mean"]["flip_rate_diff_pp"][a]) for k in ks]
            ax_fr.plot(ks, vals, color=col, marker=markers[a], label=f"{name} {a.upper()}")
        if len(res["by_ridge"]) > 1:
            styles = ["-", "-.", ":", (0, (5, 1))]
            for j, (ridge, block) in enumerate(res["by_ridge"].items()):
                rcol = colours[(j + 3) % len(colours)]
                pks = sorted(int(k) for k in block["projected"])
                ax_ridge.plot(pks, series(block["projected"], "spearman_all"), color=rcol, marker="o",
                              ls=styles[0], label=f"{name} ridge {ridge} (Kronecker)")
                ax_ridge.plot(sorted(int(k) for k in block["ideal"]), series(block["ideal"], "spearman_all"),
                              color=rcol, marker="x", ls="--", label=f"{name} ridge {ridge} (ideal)")
    for ax, title, ylabel in (
        (ax_all, "Spearman of all (query, train) scores vs exact", "Spearman"),
        (ax_agg, "Aggregate scores: Spearman (solid) and top-10 % Jaccard (dotted); ideal dashed", "value"),
        (ax_fr, "|flip rate (projected, own top set) − flip rate (exact)|", "percentage points"),
        (ax_ridge, "Ridge sweep: Spearman of all scores vs exact", "Spearman"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("projection dimension k")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    cfg = results["config"]
    fig.suptitle(
        f"Projected vs exact NTK influence (n_train {cfg['n_train']}, {cfg['n_queries']} queries, "
        f"ridge {cfg['main_ridge']:g}, eps {cfg['eps']}; error bars: range over projection seeds)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def library_state() -> dict[str, Any]:
    """Commit, locally modified files and a digest of the library's sources (read-only git calls)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    for path in sorted((REPO / "art_malleability").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode())
        digest.update(path.read_bytes())
    return {
        "commit": git("rev-parse", "HEAD"),
        "modified": git("status", "--short", "--untracked-files=no").splitlines(),
        "sources_sha256": digest.hexdigest(),
    }


def to_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_json(value.tolist())
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return None if math.isnan(v) else v
    if isinstance(value, np.integer):
        return int(value)
    return value


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (n_train 200, k 64/256), under a minute")
    p.add_argument("--settings", nargs="+", choices=SETTING_NAMES, default=list(SETTING_NAMES))
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--n-queries", type=int, default=100)
    p.add_argument("--ks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--ideal-extra-ks", type=int, nargs="*", default=[65536],
                   help="further k's for the ideal sketch only")
    p.add_argument("--projection-seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--sweep-ridges", type=float, nargs="+", default=[1e-3, 1e-1, 1.0],
                   help="ridges of the MNIST 2L-ReLU sweep; the first is the main ridge of every setting")
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--attack-max-iter", type=int, default=20)
    p.add_argument("--width", type=int, default=512, help="width of 2L-ReLU")
    p.add_argument("--epochs-mlp", type=int, default=100)
    p.add_argument("--epochs-cnn", type=int, default=30)
    p.add_argument("--seed", type=int, default=0, help="data split, query sample, initial weights, shuffling")
    p.add_argument("--data-root", type=Path, default=DEFAULT_DATA)
    p.add_argument("--output", type=Path, default=Path("/tmp/fid/fidelity.json"))
    p.add_argument("--figure", type=Path, default=None,
                   help=f"figure path (default: {DEFAULT_FIGURE.relative_to(REPO)}; with --quick: next to --output)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = full_config(args)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    settings = make_settings(cfg, args.settings)
    main_ridge = cfg.sweep_ridges[0]
    for s in settings:
        if s.name != "mnist-2l-relu":
            s.ridges = (main_ridge,)
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "config": {**vars(cfg), "main_ridge": main_ridge, "quick": args.quick,
                   "top_fraction": TOP_FRACTION, "loss": LOSS, "attacks": list(ATTACK_NAMES)},
        "environment": {
            "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "machine": platform.machine(), "library": library_state(),
        },
        "settings": {},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for setting in settings:
        results["settings"][setting.name] = run_setting(setting, cfg, args.data_root)
        results["total_seconds"] = time.perf_counter() - t0
        args.output.write_text(json.dumps(to_json(results), indent=1))  # partial results survive a crash
    results["total_seconds"] = time.perf_counter() - t0
    args.output.write_text(json.dumps(to_json(results), indent=1))
    summary = markdown(results)
    (args.output.parent / "summary.md").write_text(summary)
    fig_path = args.figure or (
        args.output.parent / "projection_fidelity_quick.png" if args.quick else DEFAULT_FIGURE
    )
    figure(results, fig_path)
    print(summary, flush=True)
    log(f"wrote {args.output}, {args.output.parent / 'summary.md'} and {fig_path}")
    return results


if __name__ == "__main__":
    main()
