"""
Study: does MLP-Attn learn its task, and which attention context makes it (issue: a reference MLP-Attn that learns).

For each data set (digits, embedded; MNIST from ``--mnist-root``: 2,000 training and 1,000 test images of the
10,000-image split), each training setting and each seed, the script trains

- the 2L-ReLU reference model (``build_reference_model("2l-relu")``);
- MLP-Attn with the paper's literal context ``C = XᵀX`` (``context="gram"``, the default);
- MLP-Attn with the centred context (``context="centred"``: ``C_c = (X − 1μᵀ)ᵀ(X − 1μᵀ)`` applied to ``x̂ − μ``);

with the package's training loop (``train_model``: Adam, cross-entropy, batch 128, 300 epochs) under

- ``cli``: the command line's defaults (learning rate 3e-2, no weight decay);
- ``paper``: the paper's optimiser settings (learning rate 1e-3, L2 weight decay 1e-3), the rest unchanged;

and reports train and test accuracy (mean ± standard deviation over the seeds), the gap of each MLP-Attn to the
2L-ReLU of the same setting and seed (mean and range), and the geometry of the features each model's first layer
sees (``model.features`` of up to 1,000 test images): mean cosine similarity between images of different classes
and of the same class. The share of ``C``'s trace in its top eigenvalue is printed per data set.

Usage (from the repository root)::

    python benchmarks/mlp_attn_context.py                      # about 15 minutes on 2 CPU cores
    python benchmarks/mlp_attn_context.py --quick              # digits, one seed, 30 epochs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from _common import REPO_ROOT, accuracy, library_state, table, to_json

from art_malleability.data import load_dataset
from art_malleability.models import build_reference_model, train_model

SETTINGS = {"cli": {"lr": 3e-2, "weight_decay": 0.0}, "paper": {"lr": 1e-3, "weight_decay": 1e-3}}
MODELS = (("2l-relu", "gram"), ("mlp-attn", "gram"), ("mlp-attn", "centred"))


def label(name: str, context: str) -> str:
    return name if name == "2l-relu" else f"{name} ({context})"


def feature_cosines(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, limit: int = 1000) -> tuple[float, float]:
    """Mean cosine similarity of the first layer's inputs between images of different classes and of one class."""
    with torch.no_grad():
        f = torch.nn.functional.normalize(model.features(torch.as_tensor(x[:limit])).double(), dim=1)
    sim, labels = (f @ f.T).numpy(), y[:limit]
    same = labels[:, None] == labels[None, :]
    return float(sim[~same].mean()), float(sim[same & ~np.eye(len(labels), dtype=bool)].mean())


def top_share(x: np.ndarray) -> float:
    """Share of the trace of ``C = XᵀX`` (rows unit-normalised) in its top eigenvalue."""
    rows = torch.nn.functional.normalize(torch.as_tensor(x, dtype=torch.float64).reshape(len(x), -1), dim=1)
    values = torch.linalg.eigvalsh(rows.T @ rows)
    return float(values[-1] / values.sum())


def run(args: argparse.Namespace) -> dict:
    results: dict = {"library": library_state(), "epochs": args.epochs, "datasets": {}}
    for name in args.datasets:
        data = (load_dataset("digits") if name == "digits"
                else load_dataset("mnist", root=args.mnist_root, n_train=2000, n_test=1000, seed=0))
        runs = []
        for setting in args.settings:
            for seed in args.seeds:
                for model_name, context in MODELS:
                    start = time.perf_counter()
                    model = build_reference_model(model_name, data.input_shape, data.nb_classes, 512, seed=seed,
                                                  context=context)
                    train_model(model, data.x_train, data.y_train, epochs=args.epochs, batch_size=128, seed=seed,
                                verbose=False, **SETTINGS[setting])
                    between, within = feature_cosines(model, data.x_test, data.y_test)
                    runs.append({"setting": setting, "seed": seed, "model": label(model_name, context),
                                 "train": accuracy(model, data.x_train, data.y_train),
                                 "test": accuracy(model, data.x_test, data.y_test), "cos_between": between,
                                 "cos_within": within, "seconds": time.perf_counter() - start})
                    print(f"  {name} {setting} seed {seed} {runs[-1]['model']}: test {runs[-1]['test']:.3f} "
                          f"({runs[-1]['seconds']:.0f} s)", flush=True)
        results["datasets"][name] = {"top_share": top_share(data.x_train), "n_train": len(data.x_train),
                                     "n_test": len(data.x_test), "runs": runs}
    return results


def _mean_sd(values: np.ndarray) -> str:
    return f"{values.mean():.1f}" + (f" ± {values.std(ddof=1):.1f}" if len(values) > 1 else "")


def report(results: dict) -> str:
    lines = []
    for name, block in results["datasets"].items():
        lines.append(f"\n### {name}: {block['n_train']:,} training / {block['n_test']:,} test images; top eigenvalue "
                     f"{100 * block['top_share']:.1f} % of trace(XᵀX)\n")
        rows = []
        for setting in SETTINGS:
            mine = [r for r in block["runs"] if r["setting"] == setting]
            if not mine:
                continue
            relu = {r["seed"]: r["test"] for r in mine if r["model"] == "2l-relu"}
            for model_name, context in MODELS:
                runs = [r for r in mine if r["model"] == label(model_name, context)]
                train, test = (100 * np.array([r[k] for r in runs]) for k in ("train", "test"))
                gaps = 100 * np.array([r["test"] - relu[r["seed"]] for r in runs])
                gap = "–" if model_name == "2l-relu" else f"{gaps.mean():+.1f} [{gaps.min():+.1f}, {gaps.max():+.1f}]"
                rows.append([setting, label(model_name, context), _mean_sd(train), _mean_sd(test), gap,
                             f"{np.mean([r['cos_between'] for r in runs]):.3f}",
                             f"{np.mean([r['cos_within'] for r in runs]):.3f}"])
        lines.append(table(["setting", "model", "train %", "test %", "test − 2L-ReLU (pts) [range]",
                            "cos between classes", "cos within a class"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", choices=("digits", "mnist"), default=["digits", "mnist"])
    p.add_argument("--mnist-root", default=str(REPO_ROOT.parent / "shared" / "data" / "mnist"))
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="digits, one seed, 30 epochs")
    p.add_argument("--output", help="write every number to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.seeds, args.epochs = ["digits"], [0], 30
    results = run(args)
    print(report(results))
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(results), indent=1))


if __name__ == "__main__":
    main()
