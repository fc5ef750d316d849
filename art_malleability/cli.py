"""
Command line: ``art-malleability audit`` (more subcommands come with the NTK checker and the
paper reproduction).

``art-malleability audit`` with no arguments trains the two reference models (2L-ReLU and MLP-Attn)
on scikit-learn's bundled digits, audits both with FGSM, PGD and MIM, prints the tables and writes
one report folder per model plus a side-by-side ``summary.md``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from art_malleability._io import atomic_write
from art_malleability.attacks import ATTACK_NAMES, STRATEGIES
from art_malleability.distributed import launched_by_torchrun
from art_malleability.influence import INFLUENCE_NAMES
from art_malleability.metrics import RANK_BY

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """:return: The argument parser of the ``art-malleability`` command."""
    parser = argparse.ArgumentParser(
        prog="art-malleability",
        description="Influence-malleability audits of PyTorch classifiers with ART attacks.",
    )
    from art_malleability import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    audit = sub.add_parser(
        "audit",
        help="train or load models, attack their training data, report influence flip rates",
        description="Audit influence malleability. With no arguments: both reference models on the "
        "embedded scikit-learn digits, FGSM/PGD/MIM at eps 0.3.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_data_options(audit, n_train=1000, n_test=300)
    model = audit.add_argument_group("model")
    model.add_argument(
        "--model",
        action="append",
        default=None,
        help="reference model name ('2l-relu', 'mlp-attn'), architecture ('cnn', 'resnet20': see "
        "art_malleability.architectures) or 'package.module:factory' returning an nn.Module (called with "
        "input_shape= and nb_classes= when it takes them); repeat for several; default: both reference models",
    )
    model.add_argument(
        "--weights",
        default=None,
        help="state_dict file loaded with torch.load(weights_only=True) instead of training (one model only)",
    )
    model.add_argument("--width", type=int, default=512, help="hidden width of the reference models")
    model.add_argument("--epochs", type=int, default=300, help="training epochs (Adam)")
    model.add_argument("--batch-size", type=int, default=128, help="training and attack batch size")
    model.add_argument(
        "--lr",
        type=float,
        default=3e-2,
        help="Adam learning rate (the paper's 1e-3 with L2 1e-3 leaves MLP-Attn near chance on digits)",
    )
    model.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty (Adam weight_decay; paper 1e-3)")
    model.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy", help="training loss")
    audit_group = audit.add_argument_group("audit")
    audit_group.add_argument("--attacks", nargs="+", choices=ATTACK_NAMES, default=list(ATTACK_NAMES))
    audit_group.add_argument("--eps", type=float, default=0.3, help="l-inf attack budget on [0, 1] inputs")
    audit_group.add_argument("--attack-max-iter", type=int, default=20, help="steps of PGD and MIM")
    audit_group.add_argument("--influence", choices=INFLUENCE_NAMES, default="ntk", help="influence estimator")
    audit_group.add_argument("--ridge", type=float, default=1e-3, help="ridge lambda of the NTK influence")
    audit_group.add_argument(
        "--projection-dim",
        type=_projection_dim,
        default="auto",
        help="NTK influence mode: 'auto' (exact n x n solve when n <= 10000, it fits the memory and its estimated "
        "cost is below ~1e13 flops; else projected with k = 4096), 'none' (always exact) or the projection "
        "dimension k (always projected)",
    )
    audit_group.add_argument("--top-fraction", type=float, default=0.1, help="share of training data in the top set")
    audit_group.add_argument("--strategy", choices=STRATEGIES, default="top", help="perturb the top set or all")
    audit_group.add_argument("--rank-by", choices=RANK_BY, default="abs",
                             help="rank the top set by absolute or signed score")
    audit_group.add_argument("--n-queries", type=int, default=100, help="query points drawn from the test set")
    audit_group.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for intervals")
    audit_group.add_argument(
        "--no-controls", action="store_true",
        help="skip the random-sign control of each attack (same examples, random signs at +-eps) and the excess "
        "flip rate",
    )
    audit_group.add_argument(
        "--validation", default=None,
        help="output folder of 'art-malleability validate' for the same data and training settings: each report "
        "then states its estimator's LDS against retraining (from <folder>/<model>/validation.json)",
    )
    run = audit.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    run.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    run.add_argument("--output", default="malleability-audit", help="report folder")
    dist = audit.add_argument_group(
        "distributed",
        "launch with torchrun (e.g. torchrun --standalone --nproc-per-node 2 -m art_malleability.cli audit ...): "
        "every process computes the NTK features and the attack of its share of the training set; rank 0 "
        "trains the model, prints and writes the reports",
    )
    dist.add_argument(
        "--dist-backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo"
    )
    dist.add_argument(
        "--dist-timeout", type=float, default=600.0,
        help="seconds a collective waits for the other processes before failing (a dead process ends the job)",
    )
    audit.set_defaults(func=run_audit)
    _add_ntk_check(sub)
    _add_spectrum(sub)
    _add_reproduce(sub)
    _add_validate(sub)
    for command in sub.choices.values():
        group = command.add_argument_group("output")
        group.add_argument("-q", "--quiet", action="store_true",
                           help="no progress bars or tables while running; log errors only")
        group.add_argument("-v", "--verbose", action="count", default=0,
                           help="log progress (-vv: debug) and show the traceback of an error")
    return parser


def _add_data_options(parser: argparse.ArgumentParser, n_train: int, n_test: int | None) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--dataset",
        default="digits",
        help="'digits' (embedded), 'mnist', 'fashion-mnist', 'cifar10' (torchvision, from --data-root) "
        "or a path to an .npz file with arrays x and y",
    )
    group.add_argument("--data-root", default=None, help="local torchvision root folder (no download)")
    group.add_argument("--classes", type=int, nargs="+", default=None, help="keep only these labels (e.g. 3 8)")
    group.add_argument("--n-train", type=int, default=n_train, help="training examples")
    if n_test is not None:
        group.add_argument("--n-test", type=int, default=n_test, help="held-out examples")


def _add_ntk_check(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser(
        "ntk-check",
        help="measure how close the reference models come to their infinite-width NTK at growing widths",
        description="NTK-convergence check at three levels reported separately (static kernel distance at "
        "initialisation, spectrum and kernel predictor, training dynamics), each with a fitted width "
        "exponent, a bootstrap interval over seeds and its own verdict.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_data_options(check, n_train=500, n_test=100)
    group = check.add_argument_group("check")
    group.add_argument("--models", nargs="+", default=["2l-relu", "mlp-attn"], help="reference models")
    group.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256, 1024, 4096], help="widths m")
    group.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="initialisation seeds")
    group.add_argument("--protocols", nargs="*", choices=("gd", "adam"), default=["gd", "adam"],
                       help="training protocols of the dynamic level (none: skip training)")
    group.add_argument("--gd-steps", type=int, default=200, help="full-batch gradient-descent steps")
    group.add_argument("--gd-lr-scale", type=float, default=1.0, help="GD step times 1/lambda_max of the limit")
    group.add_argument("--adam-epochs", type=int, default=20, help="epochs of the Adam protocol (paper: 500)")
    group.add_argument("--ridge", type=float, default=1e-3, help="ridge lambda of the kernel predictors")
    group.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="kernel precision")
    group.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    group.add_argument("--seed", type=int, default=0, help="seed of the data subsets")
    group.add_argument("--output", default="ntk-check", help="report folder")
    check.set_defaults(func=run_ntk_check)


def run_ntk_check(args: argparse.Namespace) -> int:
    """
    Run the ``ntk-check`` subcommand.

    :param args: Parsed arguments.
    :return: Exit status.
    """
    from art_malleability.datasets import load_dataset
    from art_malleability.ntk.convergence import NTKConvergenceChecker

    data = load_dataset(
        args.dataset, root=args.data_root, n_train=args.n_train, n_test=args.n_test, classes=args.classes,
        seed=args.seed,
    )
    checker = NTKConvergenceChecker(
        models=args.models, widths=args.widths, seeds=list(args.seeds), protocols=args.protocols,
        ridge=args.ridge, gd_steps=args.gd_steps, gd_lr_scale=args.gd_lr_scale, adam_epochs=args.adam_epochs,
        device=args.device, dtype=getattr(torch, args.dtype), verbose=not args.quiet,
    )
    start = time.perf_counter()
    report = checker.run(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)
    folder = report.save(args.output)
    print(report.summary())
    print(f"\n{len(data.x_train)} training / {len(data.x_test)} test points of {data.name}; "
          f"{time.perf_counter() - start:.1f} s; report in {folder}/")
    return 0


def _add_spectrum(sub: argparse._SubParsersAction) -> None:
    spectrum = sub.add_parser(
        "spectrum",
        help="condition numbers of G = XX^T and the widths the kernel regime would need",
        description="Spectrum of the Gram matrix G = XX^T of unit-normalised inputs: kappa(G), kappa(G^3) = "
        "kappa(G)^3, kappa_d of the rank-min(n, d) truncation, and the required widths of the paper's v1 "
        "and v2 bounds (as log10).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_data_options(spectrum, n_train=1000, n_test=None)
    spectrum.add_argument("--features", choices=("inputs", "mlp-attn"), default="inputs",
                          help="analyse the raw inputs (the paper's G) or MLP-Attn's attention-mapped features")
    spectrum.add_argument("--seed", type=int, default=0, help="seed of the subset")
    spectrum.add_argument("--output", default="spectrum", help="report folder")
    spectrum.set_defaults(func=run_spectrum)


def run_spectrum(args: argparse.Namespace) -> int:
    """
    Run the ``spectrum`` subcommand.

    :param args: Parsed arguments.
    :return: Exit status.
    """
    from art_malleability.ntk.spectral import spectral_analysis_of_dataset

    report = spectral_analysis_of_dataset(
        args.dataset, root=args.data_root, n=args.n_train, seed=args.seed, classes=args.classes,
        model="2l-relu" if args.features == "inputs" else "mlp-attn",
    )
    folder = report.save(args.output)
    print(report.summary())
    print(f"\nreport in {folder}/")
    return 0


def _projection_dim(text: str) -> int | str | None:
    key = text.strip().lower()
    if key == "auto":
        return "auto"
    if key == "none":
        return None
    try:
        value = int(key)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a positive integer, got {text!r}")
    return value


def run_audit(args: argparse.Namespace) -> int:
    """
    Run the ``audit`` subcommand (sharded over the processes of a ``torchrun`` launch).

    :param args: Parsed arguments.
    :return: Exit status.
    """
    from art_malleability.datasets import load_dataset
    from art_malleability.distributed import init_from_env
    from art_malleability.estimator import MalleabilityEstimator
    from art_malleability.report import comparison_table, slugify
    from art_malleability.training import make_classifier, train_model

    shard = init_from_env(args.dist_backend, args.dist_timeout)
    lead = shard is None or shard.rank == 0

    def say(text: str) -> None:
        if lead:
            print(text)

    names = args.model or ["2l-relu", "mlp-attn"]
    if args.weights is not None and len(names) != 1:
        raise ValueError("--weights loads one model: pass exactly one --model with it")
    start = time.perf_counter()
    data = load_dataset(
        args.dataset, root=args.data_root, n_train=args.n_train, n_test=args.n_test, classes=args.classes,
        seed=args.seed,
    )
    say(
        f"data: {data.name}, {len(data.x_train)} train / {len(data.x_test)} test, input {data.input_shape}, "
        f"{data.nb_classes} classes ({time.perf_counter() - start:.1f} s)"
        + (f"; {shard.world_size} processes ({shard.backend})" if shard is not None else "")
    )
    out = Path(args.output)
    reports = []
    for name in names:
        start = time.perf_counter()
        module = _build_model(name, data.input_shape, data.nb_classes, args.width, args.seed)
        if args.weights is not None:
            _load_weights(module, args.weights, name)
            what = f"loaded {args.weights}"
        else:
            if lead:
                module = train_model(
                    module, data.x_train, data.y_train, loss=args.loss, epochs=args.epochs,
                    batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                    device=args.device, verbose=not args.quiet,
                )
            if shard is not None:  # every process audits rank 0's weights
                module.load_state_dict(shard.broadcast_object({k: v.cpu() for k, v in module.state_dict().items()}))
            what = f"trained {args.epochs} epochs"
        trained = time.perf_counter() - start
        classifier = make_classifier(
            module, data.input_shape, data.nb_classes, loss=args.loss, clip_values=data.clip_values,
            device=args.device,
        )
        start = time.perf_counter()
        report = MalleabilityEstimator(
            classifier,
            attacks=args.attacks,
            eps=args.eps,
            influence=args.influence,
            top_fraction=args.top_fraction,
            strategy=args.strategy,
            ridge=args.ridge,
            n_queries=args.n_queries,
            rank_by=args.rank_by,
            n_bootstrap=args.n_bootstrap,
            attack_max_iter=args.attack_max_iter,
            batch_size=args.batch_size,
            seed=args.seed,
            device=args.device,
            verbose=lead and not args.quiet,
            model_name=name,
            projection_dim=args.projection_dim,
            controls=not args.no_controls,
        ).evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name,
                   validation=_validation_for(args.validation, name))
        report.seconds["train"] = trained
        reports.append(report)
        if not lead:
            continue
        if len(reports) == 1:
            _clear_owned(out, "report.json")
        folder = report.save(out / slugify(name))
        print(f"\n{name}: {what} in {trained:.1f} s, audited in {time.perf_counter() - start:.1f} s -> {folder}")
        print(report.summary())
    if lead:
        table = comparison_table(reports)
        atomic_write(out / "summary.md", f"# Influence malleability on {data.name}\n\n{table}\n")
        print(f"\n{table}\n\nreports in {out}/")
    return 0


def _validation_for(folder: str | None, name: str) -> Path | None:
    """The ``validation.json`` of one model in a ``validate`` output folder (``None`` without a folder)."""
    from art_malleability.report import slugify

    if folder is None:
        return None
    for path in (Path(folder) / slugify(name) / "validation.json", Path(folder) / "validation.json"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"--validation {folder!r} holds no validation.json for model {name!r}")


def _add_reproduce(sub: argparse._SubParsersAction) -> None:
    from art_malleability.paper.reproduce import STUDIES, TABLES, ReproductionConfig

    defaults = ReproductionConfig()
    rep = sub.add_parser(
        "reproduce",
        help="regenerate the paper's Tables 1-4, the eps ablation and spectral numbers next to its values",
        description="Reproduce the paper's comparisons with the paper's training protocol by default "
        "(Adam, lr 1e-3, batch 128, L2 1e-3, 500 epochs). Every flip rate: mean over seeds with a 95% "
        "two-level bootstrap interval (seeds, then queries), beside the random-sign control, the excess flip rate, "
        "the paper's value and the ratio MLP-Attn / 2L-ReLU; Table 2 adds the LDS of its influence estimator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_data_options(rep, n_train=defaults.n_train, n_test=defaults.n_test)
    group = rep.add_argument_group("reproduction")
    group.add_argument(
        "--tables",
        nargs="+",
        choices=TABLES + STUDIES,
        default=list(TABLES),
        help="what to run; 'open_choices' runs the sensitivity study of the paper's unstated details instead",
    )
    group.add_argument("--models", nargs="+", default=list(defaults.models), help="models of Tables 1-2")
    group.add_argument("--width", type=int, default=defaults.width, help="width of the flip-rate tables")
    group.add_argument("--widths", type=int, nargs="+", default=list(defaults.widths), help="Table 1 sweep")
    group.add_argument("--seeds", type=int, nargs="+", default=list(defaults.seeds), help="seeds")
    group.add_argument("--epochs", type=int, default=defaults.epochs, help="training epochs (paper: 500)")
    group.add_argument("--lr", type=float, default=defaults.lr, help="Adam learning rate (paper: 1e-3)")
    group.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="L2 (paper: 1e-3)")
    group.add_argument("--adv-epochs", type=int, default=defaults.adv_epochs, help="PGD adversarial training")
    group.add_argument("--eps", type=float, default=defaults.eps, help="attack budget of Tables 2-4")
    group.add_argument("--eps-grid", type=float, nargs="+", default=list(defaults.eps_grid), help="ablation")
    group.add_argument("--n-queries", type=int, default=defaults.n_queries, help="queries per audit")
    group.add_argument("--lds-models", type=int, default=defaults.lds_models,
                       help="models retrained on random halves for Table 2's LDS (first seed; 0 skips it)")
    group.add_argument("--ntk-n-train", type=int, default=defaults.ntk_n_train, help="Table 1 kernel points")
    group.add_argument("--ntk-adam-epochs", type=int, default=defaults.ntk_adam_epochs, help="Table 1 training")
    group.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    group.add_argument("--output", default="reproduction", help="report folder")
    rep.set_defaults(func=run_reproduce)


def run_reproduce(args: argparse.Namespace) -> int:
    """
    Run the ``reproduce`` subcommand.

    :param args: Parsed arguments.
    :return: Exit status.
    """
    from art_malleability.paper.reproduce import ReproductionConfig, run_reproduction

    if args.classes is not None:
        raise ValueError("--classes does not apply to reproduce: Table 3 picks the paper's binary classes")
    config = ReproductionConfig(
        dataset=args.dataset, data_root=args.data_root, n_train=args.n_train, n_test=args.n_test,
        models=tuple(args.models), width=args.width, widths=tuple(args.widths), seeds=tuple(args.seeds),
        epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, adv_epochs=args.adv_epochs, eps=args.eps,
        eps_grid=tuple(args.eps_grid), n_queries=args.n_queries, lds_models=args.lds_models,
        ntk_n_train=args.ntk_n_train,
        ntk_adam_epochs=args.ntk_adam_epochs, tables=tuple(args.tables), device=args.device, verbose=not args.quiet,
    )
    start = time.perf_counter()
    if "open_choices" in config.tables:
        from art_malleability.paper.open_choices import run_open_choices

        study = run_open_choices(config, Path(args.output) / "open_choices")
        print(study.tables["open_choices"])
        config.tables = tuple(t for t in config.tables if t != "open_choices")
    if not config.tables:
        return 0
    result = run_reproduction(config, args.output)
    if args.quiet:
        print(result.to_markdown())
    print(f"\nreproduction written to {args.output}/ in {time.perf_counter() - start:.0f} s")
    return 0


def _add_validate(sub: argparse._SubParsersAction) -> None:
    from art_malleability.validation import OUTCOMES

    val = sub.add_parser(
        "validate",
        help="measure how well each influence estimator predicts retraining (LDS, leave-one-out signs)",
        description="Influence fidelity against retraining. Trains the model on the whole training set (influence "
        "computed there), on --n-models random --alpha subsets (linear datamodeling score: Spearman correlation "
        "between the summed influence of each subset and the measured -loss or margin, mean over queries with a "
        "bootstrap interval) and without each of the top --loo-top examples of --loo-queries queries with "
        "--loo-seeds seeds (leave-one-out sign agreement). Defaults (digits, 500 training examples, 100 queries, "
        "both reference models, M = 50, the audit's training settings) take about 10 minutes on 2 CPU cores.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_data_options(val, n_train=500, n_test=300)
    model = val.add_argument_group("model")
    model.add_argument(
        "--model",
        action="append",
        default=None,
        help="reference model name ('2l-relu', 'mlp-attn'), 'cnn' or 'package.module:factory' (as in audit); "
        "repeat for several; default: both reference models",
    )
    model.add_argument("--width", type=int, default=512, help="hidden width of the reference models")
    model.add_argument("--epochs", type=int, default=300, help="training epochs of every model (Adam)")
    model.add_argument("--batch-size", type=int, default=128, help="training batch size")
    model.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate")
    model.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty (Adam weight_decay)")
    model.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy",
                       help="training loss, also the measured loss of the outcomes")
    group = val.add_argument_group("validation")
    group.add_argument("--estimators", nargs="+", choices=INFLUENCE_NAMES, default=list(INFLUENCE_NAMES),
                       help="influence estimators to validate")
    group.add_argument(
        "--projection-dim",
        type=_projection_dim,
        nargs="+",
        default=[None, 512],
        help="NTK influence modes, one estimator each: 'none' (exact), an integer k (projected), 'auto'; "
        "default: exact and projected with k = 512",
    )
    group.add_argument("--ridge", type=float, default=1e-3, help="ridge lambda of the NTK influence")
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
    run = val.add_argument_group("run")
    run.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    run.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    run.add_argument("--output", default="malleability-validation", help="report folder")
    val.set_defaults(func=run_validate)


def run_validate(args: argparse.Namespace) -> int:
    """
    Run the ``validate`` subcommand: one report folder per model and a side-by-side ``summary.md``.

    :param args: Parsed arguments.
    :return: Exit status.
    """
    import numpy as np

    from art_malleability.datasets import load_dataset
    from art_malleability.influence import get_influence
    from art_malleability.report import slugify
    from art_malleability.training import train_model
    from art_malleability.validation import validate

    start = time.perf_counter()
    data = load_dataset(
        args.dataset, root=args.data_root, n_train=args.n_train, n_test=args.n_test, classes=args.classes,
        seed=args.seed,
    )
    if args.n_queries < 1:
        raise ValueError(f"--n-queries must be a positive integer, got {args.n_queries}")
    rows = np.sort(np.random.default_rng(args.seed).permutation(len(data.x_test))[: args.n_queries])
    x_query, y_query = data.x_test[rows], data.y_test[rows]
    estimators = []
    for name in args.estimators:
        if name == "ntk":
            estimators += [
                get_influence("ntk", ridge=args.ridge, projection_dim=k, projection_seed=args.seed, device=args.device)
                for k in dict.fromkeys(args.projection_dim)
            ]
        else:
            estimators.append(get_influence(name, loss=args.loss, device=args.device))
    print(f"data: {data.name}, {len(data.x_train)} train / {len(x_query)} queries, input {data.input_shape}, "
          f"{data.nb_classes} classes")
    out = Path(args.output)
    sections = []
    cleared = False
    for name in args.model or ["2l-relu", "mlp-attn"]:
        _build_model(name, data.input_shape, data.nb_classes, args.width, args.seed)  # fail early on a bad name

        def train_fn(x, y, seed, name=name):
            module = _build_model(name, data.input_shape, data.nb_classes, args.width, seed)
            return train_model(
                module, x, y, loss=args.loss, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                weight_decay=args.weight_decay, seed=seed, device=args.device, verbose=False,
            )

        began = time.perf_counter()
        report = validate(
            train_fn, data.x_train, data.y_train, x_query, y_query, estimators=estimators, n_models=args.n_models,
            alpha=args.alpha, outcome=args.outcome, loo_queries=args.loo_queries, loo_top=args.loo_top,
            loo_seeds=args.loo_seeds, seed=args.seed, loss=args.loss, n_bootstrap=args.n_bootstrap,
            device=args.device, model_name=name, dataset=data.name, verbose=not args.quiet,
        )
        if not cleared:
            _clear_owned(out, "validation.json")
            cleared = True
        folder = report.save(out / slugify(name))
        print(f"\n{name}: validated in {time.perf_counter() - began:.1f} s -> {folder}")
        print(report.summary())
        sections.append(f"## {name}\n\n{report.summary()}\n\n{report.differences_table()}\n")
    atomic_write(out / "summary.md", f"# Influence fidelity on {data.name}\n\n" + "\n".join(sections))
    print(f"\nreports in {out}/ ({time.perf_counter() - start:.0f} s in all)")
    return 0


def _build_model(name: str, input_shape: tuple[int, ...], nb_classes: int, width: int, seed: int) -> torch.nn.Module:
    from art_malleability.architectures import build_architecture
    from art_malleability.models import build_reference_model

    factory = _model_factory(name)
    if factory == "reference":
        return build_reference_model(name, input_shape, nb_classes, width=width, seed=seed)
    if factory == "architecture":
        return build_architecture(name, input_shape, nb_classes, seed=seed)
    accepted = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("input_shape", input_shape), ("nb_classes", nb_classes)) if k in accepted}
    model = factory(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model {name!r} must return a torch.nn.Module, got {type(model).__name__}")
    from art_malleability.models import is_transductive

    if is_transductive(model):  # its forward needs the training context, set when it is trained
        return model
    was_training = model.training
    dtype = next(model.parameters(), torch.zeros(())).dtype
    try:  # before any training: the model must take the data's inputs and give one logit per class
        with torch.no_grad():
            out = model.eval()(torch.zeros((2, *input_shape), dtype=dtype))
    except Exception as err:  # noqa: BLE001 - the user's module: any failure is a mismatch to name
        raise ValueError(
            f"--model {name!r} builds a model that cannot take the data's inputs of shape {tuple(input_shape)} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); build it for that shape"
        ) from err
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.shape != (2, nb_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"--model {name!r} returns {shape} for 2 inputs; expected logits of shape (2, {nb_classes}) for the "
            "data's classes"
        )
    return model


def _load_weights(module: torch.nn.Module, path: str, name: str) -> None:
    """Load ``--weights`` (a ``state_dict``) into the built model, with a message that says what to change."""
    import pickle
    import zipfile

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(
            f"--weights {path!r} is not a state_dict saved with torch.save(model.state_dict(), path) (a whole pickled "
            "model or another file cannot be loaded safely); save the model's state_dict and pass that file"
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"--weights {path!r} holds a {type(state).__name__}, not a state_dict")
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).splitlines()[1:2] or [str(err)]
        raise ValueError(
            f"--weights {path!r} does not fit --model {name} as built here ({first[0].strip()}); check --model, "
            "--width and the data's number of classes (--dataset, --classes) against the saved model"
        ) from err


def _model_factory(name: str) -> object:
    """``"reference"``, ``"architecture"`` or the imported factory of ``--model name``."""
    from art_malleability.architectures import ARCHITECTURES
    from art_malleability.models import REFERENCE_MODELS

    if name in REFERENCE_MODELS:
        return "reference"
    if name in ARCHITECTURES:
        return "architecture"
    if ":" not in name:
        raise ValueError(
            f"--model must be one of {REFERENCE_MODELS + ARCHITECTURES} or 'package.module:factory', got {name!r}"
        )
    return _import_factory(name)


def _import_factory(name: str) -> object:
    """The factory of ``--model package.module:factory``; the working folder is on the import path, as with
    ``python -m``."""
    module_name, _, attr = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {name!r}: cannot import {attr!r} from {module_name!r} ({err})") from err
    if isinstance(factory, torch.nn.Module) or not callable(factory):
        raise TypeError(
            f"--model {name!r} must name a function or class that builds a torch.nn.Module, got an instance of "
            f"{type(factory).__name__}"
        )
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    """
    Entry point of the ``art-malleability`` command.

    :param argv: Arguments (default: ``sys.argv[1:]``).
    :return: Exit status: 0 on success, 2 for an option the command cannot use (as argparse), 1 for a failure
        while running (data, weights, training, another process), 130 when interrupted.
    """
    args = build_parser().parse_args(argv)
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # a handler, if the process has none
    package = logging.getLogger("art_malleability")
    previous = package.level
    package.setLevel(level)  # the package's own messages only; restored when the command returns
    try:
        return _run(args)
    finally:
        package.setLevel(previous)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; errors become one line on stderr and an exit status."""
    # under torchrun, name the process in every error (the launcher shows each worker's output)
    where = f" (rank {os.environ['RANK']})" if launched_by_torchrun() else ""
    prefix = f"art-malleability {args.command}{where}: error:"
    try:
        _preflight(args)
        return args.func(args)
    except KeyboardInterrupt:
        print(f"art-malleability {args.command}{where}: interrupted", file=sys.stderr)
        return 130
    except UsageError as err:
        _explain(prefix, err, args.verbose)
        return 2
    except dist.DistBackendError as err:
        _explain(prefix, f"another process failed or stopped answering ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})", args.verbose, err)
        return 1
    except Exception as err:  # noqa: BLE001 - one line for the user, the traceback with --verbose
        _explain(prefix, err, args.verbose)
        return 1


def _preflight(args: argparse.Namespace) -> None:
    """
    Check the options every subcommand shares, before any data is read or model trained: the data source, the
    output folder, the seed, the model names (factories imported), the audit's budget and top set, and a
    validation folder. A problem is a :class:`UsageError` (exit status 2).
    """
    from art_malleability.datasets import resolve_source
    from art_malleability.metrics import top_k_count

    try:
        if getattr(args, "dataset", None) is not None:
            resolve_source(args.dataset, args.data_root)
        if getattr(args, "seed", 0) < 0:
            raise ValueError(f"--seed must be a non-negative integer, got {args.seed}")
        if any(s < 0 for s in getattr(args, "seeds", None) or []):
            raise ValueError(f"--seeds must be non-negative integers, got {args.seeds}")
        if getattr(args, "output", None) is not None:
            _check_output(Path(args.output))
        names = getattr(args, "model", None) or []
        for name in names:
            _model_factory(name)
        if getattr(args, "eps", 1.0) is not None and not getattr(args, "eps", 1.0) > 0:
            raise ValueError(f"--eps must be > 0, got {args.eps}")
        fraction = getattr(args, "top_fraction", None)
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"--top-fraction (top_fraction) must lie in (0, 1], got {fraction}")
            if args.n_train is not None and top_k_count(args.n_train, fraction) < 1:
                raise ValueError(
                    f"--n-train {args.n_train} with --top-fraction {fraction} leaves an empty influential set; "
                    f"pass --n-train of at least {math.ceil(1 / fraction - 1e-9)}"
                )
        if getattr(args, "command", None) == "validate":
            if not 0 < args.alpha < 1:
                raise ValueError(f"--alpha (alpha) must lie strictly between 0 and 1, got {args.alpha}")
            if args.n_models < 2:
                raise ValueError(f"--n-models (n_models) must be at least 2, got {args.n_models}")
        if getattr(args, "n_queries", 1) < 1:
            raise ValueError(f"--n-queries must be a positive integer, got {args.n_queries}")
        for name in names if getattr(args, "validation", None) is not None else []:
            _validation_for(args.validation, name)
    except (ValueError, TypeError, OSError) as err:
        raise UsageError(str(err)) from err


def _clear_owned(folder: Path, marker: str) -> None:
    """
    Before a command writes its first report into ``--output``: remove what an earlier run of it left there, so no
    stale model folder or figure sits beside the new results. Owned are ``summary.md`` and the subfolders holding
    a ``marker`` file (``report.json``, ``validation.json``); nothing else in the folder is touched.
    """
    import shutil

    if not folder.is_dir():
        return
    for child in folder.iterdir():
        if child.is_dir() and (child / marker).is_file():
            shutil.rmtree(child)
    (folder / "summary.md").unlink(missing_ok=True)


def _check_output(folder: Path) -> None:
    """The report folder must be a folder (or not exist yet) somewhere this process may write."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--output {str(folder)!r} is an existing file; pass a folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output {str(folder)!r} cannot be written: {str(existing)!r} is not writable")


class UsageError(ValueError):
    """A command-line option with a value the command cannot use (exit status 2, like argparse's own errors)."""


def _explain(prefix: str, err: BaseException | str, verbose: int, cause: BaseException | None = None) -> None:
    """One line on stderr; the traceback too with ``--verbose``."""
    import traceback

    if verbose and isinstance(cause or err, BaseException):
        traceback.print_exception(cause or err, file=sys.stderr)
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, (TypeError, OSError)):
        message += f" ({type(err).__name__})"
    print(f"{prefix} {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
