"""
Audit a small CNN on 10,000 MNIST images, reading the training set as a ``torch.utils.data.Dataset`` (the
audit streams it in batches and never holds it as float64).

    python examples/audit_mnist_cnn.py --data-root PATH/mnist          # 10,000 images, projected NTK influence
    python examples/audit_mnist_cnn.py --data-root PATH --quick        # smoke run
    python examples/audit_mnist_cnn.py --data-root PATH --projection-dim none   # exact n x n influence (slow)

``--data-root`` is a local MNIST folder (torchvision layout, or the IDX files of the test split alone). With
the full training split, the first 10,000 training images (a seeded subset) are audited and the queries come
from the test split; with the test split alone, all its 10,000 images are the training set and the queries are
a seeded sample of them (each query's score on itself excluded). The model is
:class:`art_malleability.models.architectures.SmallCNN` trained with Adam. The script prints the report, the time of
every phase and the peak memory, and writes the report folder (``--output``).
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
from torch.utils.data import TensorDataset

from art_malleability import MalleabilityEstimator
from art_malleability.data import load_dataset
from art_malleability.models import SmallCNN, make_classifier, train_model


def load(root: str, n_train: int, seed: int) -> tuple:
    """``(x_train, y_train, x_test, y_test)``; the test pair is ``None`` when only 10,000 images exist."""
    try:
        data = load_dataset("mnist", root=root, n_train=n_train, n_test=1000, seed=seed)
        return data.x_train, data.y_train, data.x_test, data.y_test
    except ValueError:  # the test split alone: audit all of it
        data = load_dataset("mnist", root=root, n_train=n_train - 1000, n_test=1000, seed=seed)
        return np.concatenate([data.x_train, data.x_test]), np.concatenate([data.y_train, data.y_test]), None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", required=True, help="local MNIST folder")
    parser.add_argument("--n-train", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--projection-dim", default="auto", help="'auto', 'none' (exact) or an integer k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="audit-mnist-cnn")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.n_train, args.epochs = 1200, 1
    k = {"auto": "auto", "none": None}.get(args.projection_dim.lower(), None)
    projection_dim = k if args.projection_dim.lower() in ("auto", "none") else int(args.projection_dim)

    start = time.perf_counter()
    x, y, x_test, y_test = load(args.data_root, args.n_train, args.seed)
    model = train_model(SmallCNN((1, 28, 28), 10, seed=args.seed), x, y, epochs=args.epochs, lr=1e-3,
                        weight_decay=0.0, seed=args.seed, device="cpu", verbose=True)
    trained = time.perf_counter() - start
    classifier = make_classifier(model, (1, 28, 28), 10, device="cpu")
    train_set = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))  # any map-style Dataset works

    start = time.perf_counter()
    report = MalleabilityEstimator(
        classifier, projection_dim=projection_dim, seed=args.seed, device="cpu", model_name="SmallCNN"
    ).evaluate(train_set, x_test=x_test, y_test=y_test, dataset=f"MNIST ({len(x)} images)")
    audited = time.perf_counter() - start
    report.seconds["train"] = trained
    print()
    print(report.summary())
    print(f"\ntrained in {trained:.0f} s, audited in {audited:.0f} s ({report.execution.get('mode')} NTK influence"
          + (f", k = {report.execution['projection_dim']}" if "projection_dim" in report.execution else "") + ")")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report.seconds.items()))
    for r in report.results:
        print(f"  {r.attack}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.seconds.items()))
    print(f"peak memory (RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    print(f"report in {report.save(args.output)}/")


if __name__ == "__main__":
    main()
