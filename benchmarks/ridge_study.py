"""
Study: how the NTK influence's ridge changes what the audit can see.

For each model (trained once) and each ridge (fixed values, and the ``"loo"`` / ``"gcv"`` rules of
:mod:`art_malleability.influence.ridge_choice`), the exact NTK audit (FGSM, PGD, MIM at ``eps``, five random-sign
control draws) gives the control's flip rate, the attacks' excess over it with its interval, the noise-aware rate
and the Spearman correlation of the clean and perturbed score matrices; :func:`~art_malleability.validation.validate`
gives each ridge's linear datamodeling score (LDS) against the same retrained models. A ridge carries signal when
the control's rate falls (noise flips less), the excess moves away from zero and the LDS rises.

Usage (from the repository root)::

    python benchmarks/ridge_study.py                                   # digits, both reference models
    python benchmarks/ridge_study.py --dataset mnist --data-root PATH --model cnn --n-train 1000 --epochs 20 \\
        --lr 1e-3
    python benchmarks/ridge_study.py --quick                           # tiny sizes, about a minute

Prints a Markdown table per model and writes every number to ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from art_malleability import MalleabilityEstimator
from art_malleability.cli.checks import build_model
from art_malleability.cli.options import ridge_value
from art_malleability.data import load_dataset
from art_malleability.influence import NTKInfluence
from art_malleability.models import make_classifier, train_model
from art_malleability.validation import validate


def _percent(value: float) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{100 * value:.1f}"


def _interval(ci) -> str:
    return f"[{_percent(ci[0])}, {_percent(ci[1])}]"


def audit_row(classifier, data, ridge, args) -> dict:
    """One exact audit at one ridge: per attack the raw, by-noise, noise-aware and control rates and the excess."""
    estimator = MalleabilityEstimator(
        classifier, ridge=ridge, projection_dim=None, eps=args.eps, seed=args.seed, verbose=False,
        n_bootstrap=args.n_bootstrap,
    )
    report = estimator.evaluate(data.x_train, data.y_train, x_test=data.x_test, y_test=data.y_test)
    row = {"ridge": ridge, "ridge_used": report.execution.get("ridge"), "attacks": {}}
    for result in report.to_dict()["results"]:
        row["attacks"][result["attack"]] = {
            key: result.get(key) for key in (
                "flip_rate", "flip_rate_ci", "flip_rate_null", "flip_rate_above_floor", "flip_rate_above_floor_ci",
                "excess_flip_rate", "excess_flip_rate_ci", "spearman", "undecided_share",
            )
        } | {"control_flip_rate": result["control"]["flip_rate"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--model", action="append", default=None, help="default: 2l-relu and mlp-attn")
    parser.add_argument("--n-train", type=int, default=500)
    parser.add_argument("--n-test", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--ridges", type=ridge_value, nargs="+", default=[1e-3, 1e-2, 1e-1, 1.0, "loo", "gcv"])
    parser.add_argument("--eps", type=float, default=0.3)
    parser.add_argument("--n-models", type=int, default=30, help="retrained models of the LDS")
    parser.add_argument("--lds-epochs", type=int, default=None, help="retrained models' epochs (default: --epochs)")
    parser.add_argument("--n-bootstrap", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="ridge_study.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.n_train, args.n_test, args.epochs, args.n_models, args.n_bootstrap = 200, 100, 100, 6, 200
        args.ridges = [1e-3, "loo"]
    models = args.model or ["2l-relu", "mlp-attn"]
    data = load_dataset(args.dataset, root=args.data_root, n_train=args.n_train, n_test=args.n_test, seed=args.seed)
    out = {"settings": {k: v for k, v in vars(args).items() if k != "quick"}, "models": {}}
    for name in models:
        start = time.perf_counter()

        def train_fn(x, y, seed, epochs=None, name=name):
            module = build_model(name, data.input_shape, data.nb_classes, args.width, seed)
            return train_model(module, x, y, epochs=epochs or args.epochs, lr=args.lr, seed=seed, verbose=False)

        model = train_fn(data.x_train, data.y_train, args.seed)
        classifier = make_classifier(model, data.input_shape, data.nb_classes)
        accuracy = float(np.mean(classifier.predict(data.x_test).argmax(1) == data.y_test))
        rows = [audit_row(classifier, data, ridge, args) for ridge in args.ridges]
        try:
            fidelity = validate(
                lambda x, y, seed: train_fn(x, y, seed, args.lds_epochs), data.x_train, data.y_train,
                data.x_test[:100], data.y_test[:100],
                estimators=[NTKInfluence(ridge=r, projection_dim=None) for r in args.ridges], n_models=args.n_models,
                loo_queries=0, seed=args.seed, verbose=False, model_name=name, dataset=data.name,
            )
            results = list(fidelity.results.values())
        except ValueError as refusal:  # e.g. a model that has not learnt its task: no LDS to speak of
            print(f"{name}: no LDS ({refusal})")
            results = [None] * len(rows)
        for row, result in zip(rows, results, strict=True):
            row["lds"] = float("nan") if result is None or result.lds is None else result.lds
            row["lds_ci"] = [float("nan")] * 2 if result is None else [
                float("nan") if v is None else v for v in result.lds_ci
            ]
        out["models"][name] = {"test_accuracy": accuracy, "rows": rows, "seconds": time.perf_counter() - start}
        print(f"\n### {name} on {data.name} ({len(data.x_train)} images, test accuracy {100 * accuracy:.1f} %, "
              f"{time.perf_counter() - start:.0f} s)\n")
        attacks = list(rows[0]["attacks"])
        print("| ridge | used | control | " + " | ".join(f"{a} raw / by noise / excess [95 %]" for a in attacks)
              + " | Spearman clean-perturbed (FGSM) | LDS [95 %] |")
        print("|---|---|---|" + "---|" * len(attacks) + "---|---|")
        for row in rows:
            cells = [
                f"{_percent(a['flip_rate'])} / {_percent(a['flip_rate_null'])} / "
                f"{_percent(a['excess_flip_rate'])} {_interval(a['excess_flip_rate_ci'])}"
                for a in row["attacks"].values()
            ]
            first = row["attacks"][attacks[0]]
            print(f"| {row['ridge']} | {row['ridge_used']:.3g} | {_percent(first['control_flip_rate'])} | "
                  + " | ".join(cells) + f" | {first['spearman']:.2f} | {row['lds']:.3f} "
                  f"[{row['lds_ci'][0]:.3f}, {row['lds_ci'][1]:.3f}] |", flush=True)
        with open(args.output, "w") as handle:  # after every model
            json.dump(out, handle, indent=1, default=float)


if __name__ == "__main__":
    main()
