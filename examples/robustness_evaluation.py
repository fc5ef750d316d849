"""
The malleability audit as one step of an ordinary ART robustness evaluation, on your own CNN.

A user's model (a small CNN defined here, trained with a plain PyTorch loop), wrapped in ART's
``PyTorchClassifier``, evaluated the usual ART way — clean accuracy, adversarial accuracy under PGD and
``art.metrics.empirical_robustness`` — and audited for influence malleability beside them. One table,
one JSON file.

    python examples/robustness_evaluation.py                 # digits, about a minute on 2 CPU cores
    python examples/robustness_evaluation.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from art.attacks.evasion import ProjectedGradientDescent
from art.estimators.classification import PyTorchClassifier
from art.metrics import empirical_robustness
from torch import nn

from art_malleability import MalleabilityEstimator
from art_malleability.data import load_dataset


class MyCNN(nn.Module):
    """Stands for your own model: any module mapping images to logits."""

    def __init__(self, nb_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(32 * 2 * 2, nb_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int, seed: int = 0) -> nn.Module:
    """A plain PyTorch training loop (Adam, mini-batches of 64)."""
    torch.manual_seed(seed)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    xt, yt = torch.as_tensor(x), torch.as_tensor(y)
    for _ in range(epochs):
        for rows in torch.randperm(len(xt)).split(64):
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(xt[rows]), yt[rows]).backward()
            optimiser.step()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eps", type=float, default=0.3, help="l-inf budget on [0, 1] inputs")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--output", default="robustness-evaluation.json", help="JSON file")
    args = parser.parse_args()

    n_train, epochs = (200, 5) if args.quick else (1000, 60)
    data = load_dataset("digits", n_train=n_train, n_test=100 if args.quick else 300, seed=0)
    torch.manual_seed(0)
    model = train(MyCNN(data.nb_classes), data.x_train, data.y_train, epochs)
    classifier = PyTorchClassifier(model, nn.CrossEntropyLoss(), data.input_shape, data.nb_classes,
                                   clip_values=(0.0, 1.0), device_type="cpu")

    # the usual ART evaluation
    clean = float(np.mean(classifier.predict(data.x_test).argmax(1) == data.y_test))
    pgd = ProjectedGradientDescent(classifier, eps=args.eps, eps_step=args.eps / 8, max_iter=10, verbose=False)
    adversarial = float(np.mean(classifier.predict(pgd.generate(data.x_test)).argmax(1) == data.y_test))
    robustness = float(empirical_robustness(classifier, data.x_test, "fgsm", {"eps": args.eps}))

    # ... and the malleability audit of the same classifier on its training data
    audit = MalleabilityEstimator(classifier, eps=args.eps, n_queries=50 if args.quick else None, verbose=False)
    report = audit.evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)

    row = {"clean_accuracy": clean, "pgd_accuracy": adversarial, "empirical_robustness_fgsm": robustness,
           **{f"signed_retention_{r.attack}": r.signed_retention for r in report.results},
           **{f"excess_retention_{r.attack}": r.excess_retention for r in report.results},
           **{f"flip_rate_{r.attack}": r.flip_rate for r in report.results},
           **{f"excess_flip_rate_{r.attack}": r.excess_flip_rate for r in report.results}}
    print(f"{'metric':<28} value")
    for name, value in row.items():  # a statistic the audit does not report is None (report.json says why)
        print(f"{name:<28} {'n/a (null_reasons)' if value is None else f'{value:.3f}'}")
    print("\n" + report.summary())
    Path(args.output).write_text(json.dumps({"robustness": row, "malleability": report.to_dict()}, indent=1))
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
