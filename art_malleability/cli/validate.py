"""``art-malleability validate``: its options and its run, one report folder per model and a ``summary.md``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from art_malleability.cli import options
from art_malleability.cli.checks import build_model, load_data, model_names, note_replaced
from art_malleability.influence import INFLUENCE_NAMES, InfluenceEstimator
from art_malleability.validation import OUTCOMES

if TYPE_CHECKING:
    from art_malleability.data.datasets import Dataset
    from art_malleability.validation.lds import TrainFn

#: ``art-malleability validate``'s line in the command's help and its own help.
_SUMMARY = "measure how well each influence estimator predicts retraining (LDS, leave-one-out signs)"
_DESCRIPTION = (
    "Influence fidelity against retraining. Trains the model on the whole training set (influence "
    "computed there), on --n-models random --alpha subsets (linear datamodeling score: Spearman correlation "
    "between the summed influence of each subset and the measured -loss or margin, mean over queries with a "
    "bootstrap interval) and without each of the top --loo-top examples of --loo-queries queries with "
    "--loo-seeds seeds (leave-one-out sign agreement). Defaults (digits, 500 training examples, 100 queries, "
    "both reference models, M = 50, the audit's training settings) take about 10 minutes on 2 CPU cores."
)


def add_validate(sub: argparse._SubParsersAction, run: options.Runner) -> None:
    """The ``validate`` subcommand and its options, run by ``run`` (:func:`run_validate`)."""
    val = options.add_command(sub, "validate", run, _SUMMARY, _DESCRIPTION)
    options.add_data_options(val, n_train=500, n_test=300)
    options.add_model_options(
        val, batch_help="training batch size", loss_help="training loss, also the measured loss of the outcomes"
    )
    group = val.add_argument_group("validation")
    group.add_argument("--estimators", nargs="+", choices=INFLUENCE_NAMES, default=list(INFLUENCE_NAMES),
                       help="influence estimators to validate")
    group.add_argument(
        "--projection-dim",
        type=options.projection_dim,
        nargs="+",
        default=[None, 512],
        action=options.Typed,
        help="NTK influence modes, one estimator each: 'none' (exact), an integer k (projected), 'auto'; "
        "default: exact and projected with k = 512",
    )
    group.add_argument(
        "--ridge", type=options.ridge_value, nargs="+", default=[1e-3], action=options.Typed,
        help="ridge lambda of the NTK influence, or 'loo' / 'gcv' (chosen on the training set); several values give "
        "one estimator each, all checked against the same retrained models",
    )
    group.add_argument("--n-queries", type=int, default=100, help="query points drawn from the test set")
    group.add_argument("--n-models", type=int, default=50, help="subset models of the LDS (M)")
    group.add_argument("--alpha", type=float, default=0.5, help="share of the training set in each subset")
    group.add_argument("--outcome", choices=OUTCOMES, default="loss",
                       help="measured outcome: the query's loss (LDS against -loss) or its margin")
    group.add_argument("--loo-queries", type=int, default=3, help="queries of the leave-one-out check (0: skip)")
    group.add_argument("--loo-top", type=int, default=5,
                       help="top examples per query and estimator, by absolute influence")
    group.add_argument("--loo-seeds", type=int, default=3, help="training seeds averaged per removal")
    group.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples of the LDS interval")
    options.add_run_options(val, "malleability-validation")


def run_validate(args: argparse.Namespace) -> int:
    """Run ``art-malleability validate`` with the parsed ``args``: one report folder per model and a side-by-side
    ``summary.md``, staged in ``args.out`` (the open ``--output`` folder); return the exit status."""
    import numpy as np

    from art_malleability._utils.report_base import slugify
    from art_malleability.validation import validate

    note_replaced(args)
    start = time.perf_counter()
    data = load_data(args)
    rows = np.sort(np.random.default_rng(args.seed).permutation(len(data.x_test))[: args.n_queries])
    x_query, y_query = data.x_test[rows], data.y_test[rows]
    estimators = _estimators(args)
    options.say(args, f"data: {data.name}, {len(data.x_train)} train / {len(x_query)} queries, input "
                      f"{data.input_shape}, {data.nb_classes} classes")
    sections = []
    for name in model_names(args):
        # fail early on a bad name
        build_model(name, data.input_shape, data.nb_classes, args.width, args.seed, args.attention_context)
        began = time.perf_counter()
        report = validate(
            _train_fn(args, name, data), data.x_train, data.y_train, x_query, y_query, estimators=estimators,
            n_models=args.n_models, alpha=args.alpha, outcome=args.outcome, loo_queries=args.loo_queries,
            loo_top=args.loo_top, loo_seeds=args.loo_seeds, seed=args.seed, loss=args.loss,
            n_bootstrap=args.n_bootstrap, device=args.device, model_name=name, dataset=data.name,
            verbose=not args.quiet,
        )
        report.stage(args.out, slugify(name))
        options.say(args, f"\n{name}: validated in {time.perf_counter() - began:.1f} s -> "
                          f"{Path(args.output) / slugify(name)}", report.summary())
        sections.append(f"## {name}\n\n{report.summary()}\n\n{report.differences_table()}\n")
    args.out.write("summary.md", f"# Influence fidelity on {data.name}\n\n" + "\n".join(sections))
    options.say(args, f"\nreports in {args.output}/ ({time.perf_counter() - start:.0f} s in all)")
    return 0


def _estimators(args: argparse.Namespace) -> list[InfluenceEstimator]:
    """The influence estimators of ``--estimators``: the NTK once per ``--projection-dim`` mode."""
    from art_malleability.influence import get_influence

    estimators = []
    for name in args.estimators:
        if name == "ntk":
            estimators += [
                get_influence("ntk", ridge=ridge, projection_dim=k, projection_seed=args.seed, device=args.device)
                for k in dict.fromkeys(args.projection_dim) for ridge in dict.fromkeys(args.ridge)
            ]
        else:
            estimators.append(get_influence(name, loss=args.loss, device=args.device))
    return estimators


def _train_fn(args: argparse.Namespace, name: str, data: Dataset) -> TrainFn:
    """``train_fn(x, y, seed)`` of :func:`~art_malleability.validation.validate`: a fresh ``--model name``, trained."""
    from art_malleability.models.training import train_model

    def train_fn(x, y, seed):
        module = build_model(name, data.input_shape, data.nb_classes, args.width, seed, args.attention_context)
        return train_model(
            module, x, y, loss=args.loss, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
            weight_decay=args.weight_decay, seed=seed, device=args.device, verbose=False,
        )

    return train_fn
