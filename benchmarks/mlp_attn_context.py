"""
Study: does MLP-Attn learn its task, and which attention context makes it (issue: a reference MLP-Attn that learns).

For each data set (digits, embedded; MNIST from ``--mnist-root``: 2,000 training and 1,000 test images of the
10,000-image split), each task (all ten classes with cross-entropy; 3 vs 8 with the mean squared error, as the
paper trains its binary tasks; MNIST 3 vs 8: 1,000 training / 500 test images), each training setting and each
seed, the script trains

- the 2L-ReLU reference model (``build_reference_model("2l-relu")``);
- MLP-Attn with the paper's literal context ``C = XᵀX`` (``context="gram"``);
- MLP-Attn with the centred context (``context="centred"``, the default: ``C_c = (X − 1μᵀ)ᵀ(X − 1μᵀ)`` applied to
  ``x̂ − μ``);

with the package's training loop (``train_model``: Adam, batch 128) under

- ``cli``: the command line's defaults (learning rate 3e-2, no weight decay, 300 epochs);
- ``paper``: the paper's optimiser (learning rate 1e-3, L2 weight decay 1e-3) and its 500 epochs;
- ``paper-long`` (not run by default): the paper's optimiser for 2,000 epochs, the 2L-ReLU and the centred
  MLP-Attn only: does the gap under the paper's optimiser close with more steps?
- ``paper-standard`` (not run by default): the paper's optimiser on the same networks in standard
  parametrisation (first-layer weights of variance 1/d on inputs of O(1) entries). Under Adam that is the NTK
  parametrisation with the learning rate times sqrt(d) and the L2 coefficient over d (Adam ignores the gradient's
  scale), which is how it is run.

and reports train and test accuracy (mean ± standard deviation over the seeds), the gap of each MLP-Attn to the
2L-ReLU of the same setting and seed (mean and range), and the geometry of the features each model's first layer
sees (``model.features`` of up to 1,000 test images): mean cosine similarity between images of different classes
and of the same class. The share of ``C``'s trace in its top eigenvalue is printed per data set.

Usage (from the repository root)::

    python benchmarks/mlp_attn_context.py                      # about 25 minutes on 2 CPU cores
    python benchmarks/mlp_attn_context.py --settings paper-long --tasks 10-class
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

SETTINGS = {
    "cli": {"lr": 3e-2, "weight_decay": 0.0, "epochs": 300},
    "paper": {"lr": 1e-3, "weight_decay": 1e-3, "epochs": 500},
    "paper-long": {"lr": 1e-3, "weight_decay": 1e-3, "epochs": 2000},
    "paper-standard": {"lr": 1e-3, "weight_decay": 1e-3, "epochs": 500, "standard": True},
}
MODELS = (("2l-relu", None), ("mlp-attn", "gram"), ("mlp-attn", "centred"))
TASKS = {"10-class": (None, "cross_entropy"), "3-vs-8": ((3, 8), "mse")}


def label(name: str, context: str | None) -> str:
    return name if context is None else f"{name} ({context})"


def load(name: str, task: str, mnist_root: str):
    classes = TASKS[task][0]
    if name == "digits":
        return load_dataset("digits", classes=classes)
    n_train, n_test = (2000, 1000) if classes is None else (1000, 500)
    return load_dataset("mnist", root=mnist_root, n_train=n_train, n_test=n_test, classes=classes, seed=0)


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
    results: dict = {"library": library_state(), "epochs": args.epochs, "settings": SETTINGS, "datasets": {}}
    for name, task in ((n, t) for n in args.datasets for t in args.tasks):
        data, loss = load(name, task, args.mnist_root), TASKS[task][1]
        runs = []
        for setting in args.settings:
            options = {**SETTINGS[setting], **({"epochs": args.epochs} if args.epochs else {})}
            if options.pop("standard", False):  # Adam on V = W / sqrt(d) with L2 on V: lr * sqrt(d), L2 / d on W
                d = int(np.prod(data.input_shape))
                options["lr"], options["weight_decay"] = options["lr"] * d**0.5, options["weight_decay"] / d
            for seed in args.seeds:
                for model_name, context in MODELS:
                    if setting == "paper-long" and context == "gram":
                        continue
                    start = time.perf_counter()
                    model = build_reference_model(model_name, data.input_shape, data.nb_classes, 512, seed=seed,
                                                  context=context)
                    train_model(model, data.x_train, data.y_train, loss=loss, batch_size=128, seed=seed,
                                verbose=False, **options)
                    between, within = feature_cosines(model, data.x_test, data.y_test)
                    runs.append({"setting": setting, "seed": seed, "model": label(model_name, context),
                                 "train": accuracy(model, data.x_train, data.y_train),
                                 "test": accuracy(model, data.x_test, data.y_test), "cos_between": between,
                                 "cos_within": within, "seconds": time.perf_counter() - start})
                    print(f"  {name} {task} {setting} seed {seed} {runs[-1]['model']}: test {runs[-1]['test']:.3f} "
                          f"({runs[-1]['seconds']:.0f} s)", flush=True)
        results["datasets"][f"{name} {task}"] = {"loss": loss, "top_share": top_share(data.x_train),
                                                 "n_train": len(data.x_train), "n_test": len(data.x_test), "runs": runs}
    return results


def _mean_sd(values: np.ndarray) -> str:
    return f"{values.mean():.1f}" + (f" ± {values.std(ddof=1):.1f}" if len(values) > 1 else "")


def report(results: dict) -> str:
    lines = []
    for name, block in results["datasets"].items():
        lines.append(f"\n### {name} ({block['loss']}): {block['n_train']:,} training / {block['n_test']:,} test "
                     f"images; top eigenvalue {100 * block['top_share']:.1f} % of trace(XᵀX)\n")
        rows = []
        for setting in SETTINGS:
            mine = [r for r in block["runs"] if r["setting"] == setting]
            if not mine:
                continue
            relu = {r["seed"]: r["test"] for r in mine if r["model"] == "2l-relu"}
            for model_name, context in MODELS:
                runs = [r for r in mine if r["model"] == label(model_name, context)]
                if not runs:
                    continue
                train, test = (100 * np.array([r[k] for r in runs]) for k in ("train", "test"))
                gaps = 100 * np.array([r["test"] - relu[r["seed"]] for r in runs])
                gap = "–" if model_name == "2l-relu" else f"{gaps.mean():+.1f} [{gaps.min():+.1f}, {gaps.max():+.1f}]"
                epochs = results["epochs"] or SETTINGS[setting]["epochs"]
                rows.append([f"{setting} ({epochs} ep)", label(model_name, context), _mean_sd(train), _mean_sd(test),
                             gap,
                             f"{np.mean([r['cos_between'] for r in runs]):.3f}",
                             f"{np.mean([r['cos_within'] for r in runs]):.3f}"])
        lines.append(table(["setting", "model", "train %", "test %", "test − 2L-ReLU (pts) [range]",
                            "cos between classes", "cos within a class"], rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", choices=("digits", "mnist"), default=["digits", "mnist"])
    p.add_argument("--mnist-root", default=str(REPO_ROOT.parent / "shared" / "data" / "mnist"))
    p.add_argument("--tasks", nargs="+", choices=tuple(TASKS), default=list(TASKS))
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=["cli", "paper"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=None, help="epochs of every setting (default: the setting's own)")
    p.add_argument("--quick", action="store_true", help="digits, one seed, 30 epochs")
    p.add_argument("--output", help="write every number to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.tasks, args.seeds, args.epochs = ["digits"], ["10-class"], [0], 30
    results = run(args)
    print(report(results))
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(results), indent=1))


if __name__ == "__main__":
    main()
