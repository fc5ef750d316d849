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
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import library_state, to_json
from _fidelity_modes import (
    LOSS,
    TOP_FRACTION,
    IdealSketch,
    compare,
    exact_scores_from_kernel,
    projected_vs_exact,
    run_mode,
)
from _fidelity_report import figure, markdown
from torch import nn

from art_malleability.audit.attacks import ATTACK_NAMES, make_attack, perturb_training_set
from art_malleability.data import Dataset, load_dataset
from art_malleability.metrics import spearman
from art_malleability.models import (
    SmallCNN,
    build_reference_model,
    make_classifier,
    train_model,
)
from art_malleability.ntk.empirical import empirical_ntk

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
DEFAULT_FIGURE = REPO / "docs" / "figures" / "projection_fidelity.png"
SETTING_NAMES = ("mnist-2l-relu", "mnist-cnn", "cifar10-cnn")


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
