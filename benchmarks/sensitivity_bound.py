"""
Benchmark: the sensitivity bound of the linearised-attention kernel (the paper's Proposition 4.5) under real attacks.

The kernel is :math:`K(a, b) = a^\\top C^2 b`, the entries of :math:`G^3` with :math:`C = X^\\top X`,
:math:`G = X X^\\top` over the unit-normalised training rows (MLP-Attn's input normalisation). The bound checked is
:math:`|K(x_i + \\delta, x_j) - K(x_i, x_j)| \\le \\|C^2 x_j\\|_1 \\, \\|\\delta\\|_\\infty` (see
:mod:`art_malleability.ntk.sensitivity` and docs/ntk.md for why this reading).

For each dataset (digits, embedded; MNIST from ``--mnist-root``) the script trains the MLP-Attn reference
model (:func:`~art_malleability.models.reference.build_reference_model`,
:func:`~art_malleability.models.training.train_model`),
draws a seeded sample of training examples, attacks them with FGSM, PGD and MIM at ``eps`` 0.3
(:func:`~art_malleability.audit.attacks.make_attack`, :func:`~art_malleability.audit.attacks.perturb_training_set`;
the model's context stays the clean training set during the attack), maps each perturbation to the space where
:math:`G` is formed, :math:`\\tilde\\delta = \\mathrm{normalise}(x + \\delta) - \\mathrm{normalise}(x)`, and measures
for every perturbed example `i` (each perturbed on its own) and every other training example `j`:

- ``fixed C``: :math:`|\\tilde\\delta_i^\\top C^2 x_j|`, the change with the context held fixed (a query-like
  point; the bound must hold here);
- ``in context``: :math:`|K'(x_i + \\tilde\\delta_i, x_j) - K(x_i, x_j)|` with the context rebuilt from the
  perturbed training set, :math:`C' = C - x_i x_i^\\top + x_i' x_i'^\\top` (entry `(i, j)` of :math:`(X'X'^\\top)^3`
  against that of :math:`G^3`);
- ``other pairs``: :math:`|K'(x_k, x_j) - K(x_k, x_j)|` for a seeded sample of rows `k != i` and all `j != i`: these
  pairs change through :math:`C'` alone; the literal bound (neither argument moves) allows no change, and they are
  compared with the allowance :math:`\\|C^2 x_j\\|_1 \\|\\tilde\\delta_i\\|_\\infty` of a pair whose first
  argument moved.

Two last rows per dataset replace the attack by the Hölder-worst perturbation :math:`\\tilde\\delta_i =
\\tilde\\varepsilon \\, \\mathrm{sign}(C^2 x_j)` for one seeded partner `j` of each perturbed `i`
(:math:`\\tilde\\varepsilon` = the median :math:`\\|\\tilde\\delta\\|_\\infty` of the attacks; not a perturbation
of an image, only of the vector): it attains the bound with :math:`C` fixed, and shows by how much the context term
pushes it over when :math:`x_i` is a training example.

The bound always uses the clean :math:`C`. Printed: a Markdown table (dataset x attack x regime: pairs, failure share,
ratio actual / bound median / 95th percentile / max, :math:`\\|\\tilde\\delta\\|_\\infty` median and max over the
perturbed rows, raw :math:`\\|\\delta\\|_\\infty`), and the size of the context term.

Usage (from the repository root)::

    python benchmarks/sensitivity_bound.py                       # digits n=1000 and MNIST n=2000, ~ minutes
    python benchmarks/sensitivity_bound.py --quick               # tiny sizes, seconds
    python benchmarks/sensitivity_bound.py --datasets digits --n-digits 50 --n-perturbed 50   # small n
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from art_malleability.audit.attacks import ATTACK_NAMES, make_attack, perturb_training_set
from art_malleability.data import load_dataset
from art_malleability.models import build_reference_model, make_classifier, train_model
from art_malleability.ntk.sensitivity import (
    context_change,
    context_matrix,
    kernel_change_fixed_context,
    kernel_change_in_context,
    kernel_gradients,
    normalised_perturbation,
    sensitivity_bound,
    summarise_ratios,
    unit_rows,
)

logger = logging.getLogger("sensitivity_bound")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MNIST_ROOT = REPO_ROOT.parent / "shared" / "data" / "mnist"
DATASETS = ("digits", "mnist")
REGIMES = ("fixed C", "in context", "other pairs")


def _train(name: str, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    n_train = args.n_digits if name == "digits" else args.n_mnist
    root = None if name == "digits" else args.mnist_root
    data = load_dataset(name, root=root, n_train=n_train, n_test=args.n_test, seed=args.seed)
    model = build_reference_model("mlp-attn", data.input_shape, data.nb_classes, width=args.width, seed=args.seed)
    epochs = args.epochs_digits if name == "digits" else args.epochs_mnist
    start = time.perf_counter()
    train_model(model, data.x_train, data.y_train, epochs=epochs, seed=args.seed, device="cpu", verbose=False)
    classifier = make_classifier(model, data.input_shape, data.nb_classes, clip_values=data.clip_values, device="cpu")
    accuracy = float(np.mean(classifier.predict(data.x_test).argmax(axis=1) == data.y_test))
    info = {
        "n_train": data.n_train,
        "d": int(np.prod(data.input_shape)),
        "epochs": epochs,
        "train_seconds": time.perf_counter() - start,
        "test_accuracy": accuracy,
        "source": data.source,
    }
    logger.info("%s: trained MLP-Attn (%d epochs, %.1f s), test accuracy %.3f", name, epochs,
                info["train_seconds"], accuracy)
    return data, classifier, info


def run_dataset(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train, attack and measure one dataset; returns every number as JSON-ready values."""
    data, classifier, info = _train(name, args)
    n = data.n_train
    rng = np.random.default_rng(args.seed)
    indices = np.sort(rng.choice(n, size=min(args.n_perturbed, n), replace=False))
    m = indices.size
    others = [np.sort(rng.choice(np.delete(np.arange(n), i), size=min(args.other_rows, n - 1), replace=False))
              for i in indices]

    x_unit = unit_rows(data.x_train)
    context = context_matrix(x_unit)
    gradients = kernel_gradients(x_unit, context)
    x_context = x_unit @ context
    onehot = np.eye(data.nb_classes, dtype=np.float32)[data.y_train]
    pair_mask = np.ones((m, n), dtype=bool)
    pair_mask[np.arange(m), indices] = False

    results: dict[str, Any] = {"dataset": name, **info, "n_perturbed": int(m), "other_rows": args.other_rows,
                               "attacks": {}}
    for attack_name in args.attacks:
        start = time.perf_counter()
        attack = make_attack(attack_name, classifier, eps=args.eps)
        x_adv = perturb_training_set(attack, data.x_train, onehot, indices, seed=args.seed)[indices]
        raw = np.abs(x_adv.astype(np.float64) - data.x_train[indices]).reshape(m, -1).max(axis=1)
        delta = normalised_perturbation(data.x_train[indices], x_adv)
        delta_inf = np.abs(delta).max(axis=1)

        bound = sensitivity_bound(delta, gradients)
        fixed = kernel_change_fixed_context(delta, gradients)
        in_context = kernel_change_in_context(x_unit, indices, delta, context=context, gradients=gradients)
        other_actual = np.empty((m, others[0].size, n))
        for r, i in enumerate(indices):
            other_actual[r] = context_change(x_unit, int(i), delta[r], others[r], context=context,
                                             x_context=x_context)
        other_bound = np.broadcast_to(bound[:, None, :], other_actual.shape)
        other_mask = np.broadcast_to(pair_mask[:, None, :], other_actual.shape)

        context_term = np.abs(in_context - fixed)[pair_mask] / bound[pair_mask]
        regimes = {
            "fixed C": summarise_ratios(fixed, bound, pair_mask),
            "in context": summarise_ratios(in_context, bound, pair_mask),
            "other pairs": summarise_ratios(other_actual, other_bound, other_mask),
        }
        results["attacks"][attack_name] = {
            "raw_delta_inf_max": float(raw.max()),
            "raw_delta_inf_median": float(np.median(raw)),
            "delta_inf_median": float(np.median(delta_inf)),
            "delta_inf_max": float(delta_inf.max()),
            "delta_l2_median": float(np.median(np.linalg.norm(delta, axis=1))),
            "context_term_over_bound_median": float(np.median(context_term)),
            "context_term_over_bound_max": float(context_term.max()),
            "regimes": regimes,
            "seconds": time.perf_counter() - start,
        }
        if regimes["fixed C"]["failures"]:
            logger.error("%s %s: the fixed-context bound failed on %d pairs (it cannot: a bug)", name,
                         attack_name, regimes["fixed C"]["failures"])
        logger.info("%s %s: %.1f s", name, attack_name, results["attacks"][attack_name]["seconds"])

    # Hölder-worst perturbation: delta_i = eps~ sign(C^2 x_j) for one seeded partner j of each i, eps~ the median
    # ||delta~||_inf of the attacks. It attains the bound with C fixed; in context the context term adds to it.
    eps_tilde = float(np.median([e["delta_inf_median"] for e in results["attacks"].values()]))
    partners = (indices + rng.integers(1, n, size=m)) % n
    worst = eps_tilde * np.sign(gradients[partners])
    rows = np.arange(m)
    worst_bound = sensitivity_bound(worst, gradients)[rows, partners]
    worst_fixed = kernel_change_fixed_context(worst, gradients)[rows, partners]
    worst_context = kernel_change_in_context(x_unit, indices, worst, context=context, gradients=gradients)
    results["worst_case"] = {
        "eps_tilde": eps_tilde,
        "regimes": {
            "fixed C": summarise_ratios(worst_fixed, worst_bound),
            "in context": summarise_ratios(worst_context[rows, partners], worst_bound),
        },
    }
    return results


def _fmt(value: float) -> str:
    if value != value:  # NaN
        return "–"
    if value == 0:
        return "0"
    return f"{value:.2g}" if abs(value) < 1e-2 or abs(value) >= 1e3 else f"{value:.3f}"


def markdown(all_results: Sequence[dict[str, Any]]) -> str:
    """The Markdown summary of :func:`run_dataset` results."""
    lines = [
        "| dataset (n × d) | attack | regime | pairs | failures (share) | ratio median | ratio 95th pct | ratio max "
        "| ‖δ̃‖∞ median [max] | raw ‖δ‖∞ max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in all_results:
        for attack_name, entry in res["attacks"].items():
            for regime in REGIMES:
                s = entry["regimes"][regime]
                lines.append(
                    f"| {res['dataset']} ({res['n_train']} × {res['d']}) | {attack_name.upper()} | {regime} "
                    f"| {s['pairs']:,} | {s['failures']:,} ({100 * s['failure_share']:.1f} %) "
                    f"| {_fmt(s['ratio_median'])} | {_fmt(s['ratio_p95'])} | {_fmt(s['ratio_max'])} "
                    f"| {_fmt(entry['delta_inf_median'])} [{_fmt(entry['delta_inf_max'])}] "
                    f"| {_fmt(entry['raw_delta_inf_max'])} |"
                )
    for res in all_results:
        if "worst_case" not in res:
            continue
        entry = res["worst_case"]
        for regime, s in entry["regimes"].items():
            lines.append(
                f"| {res['dataset']} ({res['n_train']} × {res['d']}) | sign(C²x_j) | {regime} "
                f"| {s['pairs']:,} | {s['failures']:,} ({100 * s['failure_share']:.1f} %) "
                f"| {_fmt(s['ratio_median'])} | {_fmt(s['ratio_p95'])} | {_fmt(s['ratio_max'])} "
                f"| {_fmt(entry['eps_tilde'])} | – |"
            )
    lines += ["", "Context term |K' − K − δ̃ᵀC²x_j| / bound, pairs (i, j) (median / max); ‖δ̃‖₂ median; model:", ""]
    for res in all_results:
        parts = [
            f"{a.upper()} {_fmt(e['context_term_over_bound_median'])} / {_fmt(e['context_term_over_bound_max'])}, "
            f"‖δ̃‖₂ {_fmt(e['delta_l2_median'])}"
            for a, e in res["attacks"].items()
        ]
        lines.append(
            f"- {res['dataset']}: " + "; ".join(parts)
            + f" (MLP-Attn, {res['epochs']} epochs, test accuracy {res['test_accuracy']:.3f})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    p.add_argument("--attacks", nargs="+", choices=ATTACK_NAMES, default=list(ATTACK_NAMES))
    p.add_argument("--mnist-root", default=str(DEFAULT_MNIST_ROOT), help="folder of the MNIST files")
    p.add_argument("--n-digits", type=int, default=1000, help="digits training examples (default 1000)")
    p.add_argument("--n-mnist", type=int, default=2000, help="MNIST training examples (default 2000)")
    p.add_argument("--n-test", type=int, default=200, help="test examples (accuracy only)")
    p.add_argument("--n-perturbed", type=int, default=100, help="perturbed training examples (default 100)")
    p.add_argument("--other-rows", type=int, default=20, help="rows k sampled per example for 'other pairs'")
    p.add_argument("--eps", type=float, default=0.3)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--epochs-digits", type=int, default=200, help="default 200 (paper: 500)")
    p.add_argument("--epochs-mnist", type=int, default=200, help="default 200 (paper: 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--output", help="write every number to this JSON file")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script in seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.n_digits, args.n_mnist, args.n_test, args.n_perturbed, args.other_rows = 300, 300, 50, 10, 5
        args.epochs_digits = args.epochs_mnist = 5
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    all_results = [run_dataset(name, args) for name in args.datasets]
    elapsed = time.perf_counter() - start
    print(markdown(all_results))
    print(f"\n{elapsed:.0f} s in total on {platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; seed {args.seed}, eps {args.eps}.")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": all_results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
