"""
The studies of the paper on the command line: ``art-malleability ntk-check`` (NTK convergence), ``spectrum``
(condition numbers of the Gram matrix) and ``reproduce`` (the paper's tables); their options and their runs.
"""

from __future__ import annotations

import argparse
import time

from art_malleability.cli.checks import load_data, open_work_folder
from art_malleability.cli.options import (
    DEFAULT_MODELS,
    Runner,
    add_command,
    add_data_options,
    add_run_options,
    add_work_dir_options,
    say,
    work_root,
)
from art_malleability.models.reference import CONTEXTS
from art_malleability.ntk.convergence import PROTOCOLS


def add_ntk_check(sub: argparse._SubParsersAction, run: Runner) -> None:
    """The ``ntk-check`` subcommand and its options, run by ``run`` (:func:`run_ntk_check`)."""
    check = add_command(
        sub, "ntk-check", run,
        "measure how close the reference models come to their infinite-width NTK at growing widths",
        description="NTK-convergence check at three levels reported separately (static kernel distance at "
        "initialisation, spectrum and kernel predictor, training dynamics), each with a fitted width "
        "exponent, a bootstrap interval over seeds and its own verdict.",
    )
    add_data_options(check, n_train=500, n_test=100)
    group = check.add_argument_group("check")
    group.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="reference models")
    group.add_argument("--attention-context", choices=CONTEXTS, default="centred",
                       help="MLP-Attn's attention context (gram: the paper's literal X^T X)")
    group.add_argument("--widths", type=int, nargs="+", default=[16, 64, 256, 1024, 4096], help="widths m")
    group.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="initialisation seeds")
    group.add_argument("--protocols", nargs="*", choices=PROTOCOLS, default=list(PROTOCOLS),
                       help="training protocols of the dynamic level (none: skip training)")
    group.add_argument("--gd-steps", type=int, default=200, help="full-batch gradient-descent steps")
    group.add_argument("--gd-lr-scale", type=float, default=1.0, help="GD step times 1/lambda_max of the limit")
    group.add_argument("--adam-epochs", type=int, default=20, help="epochs of the Adam protocol (paper: 500)")
    group.add_argument("--ridge", type=float, default=1e-3, help="ridge lambda of the kernel predictors")
    group.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="kernel precision")
    add_run_options(check, "ntk-check", seed_help="seed of the data subsets")


def run_ntk_check(args: argparse.Namespace) -> int:
    """Run ``art-malleability ntk-check`` with the parsed ``args``; return the exit status."""
    import torch

    from art_malleability.ntk.convergence import NTKConvergenceChecker

    data = load_data(args)
    checker = NTKConvergenceChecker(
        models=args.models, attention_context=args.attention_context, widths=args.widths, seeds=list(args.seeds),
        protocols=args.protocols,
        ridge=args.ridge, gd_steps=args.gd_steps, gd_lr_scale=args.gd_lr_scale, adam_epochs=args.adam_epochs,
        device=args.device, dtype=getattr(torch, args.dtype), verbose=not args.quiet,
    )
    start = time.perf_counter()
    report = checker.run(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)
    report.stage(args.out)
    say(args, report.summary(), f"\n{len(data.x_train)} training / {len(data.x_test)} test points of {data.name}; "
                                f"{time.perf_counter() - start:.1f} s; report in {args.output}/")
    return 0


def add_spectrum(sub: argparse._SubParsersAction, run: Runner) -> None:
    """The ``spectrum`` subcommand and its options, run by ``run`` (:func:`run_spectrum`)."""
    spectrum = add_command(
        sub, "spectrum", run, "condition numbers of G = XX^T and the widths the kernel regime would need",
        description="Spectrum of the Gram matrix G = XX^T of unit-normalised inputs: kappa(G), kappa(G^3) = "
        "kappa(G)^3, kappa_d of the rank-min(n, d) truncation, and the required widths of the paper's v1 "
        "and v2 bounds (as log10).",
    )
    add_data_options(spectrum, n_train=1000, n_test=None)
    spectrum.add_argument("--features", choices=("inputs", "mlp-attn"), default="inputs",
                          help="analyse the raw inputs (the paper's G) or MLP-Attn's attention-mapped features")
    add_run_options(spectrum, "spectrum", seed_help="seed of the subset", device=False)


def run_spectrum(args: argparse.Namespace) -> int:
    """Run ``art-malleability spectrum`` with the parsed ``args``; return the exit status."""
    from art_malleability.ntk.spectral import spectral_analysis_of_dataset

    report = spectral_analysis_of_dataset(
        args.dataset, root=args.data_root, n=args.n_train, seed=args.seed, classes=args.classes,
        model="2l-relu" if args.features == "inputs" else "mlp-attn",
    )
    report.stage(args.out)
    say(args, report.summary(), f"\nreport in {args.output}/")
    return 0


def add_reproduce(sub: argparse._SubParsersAction, run: Runner) -> None:
    """The ``reproduce`` subcommand and its options, run by ``run`` (:func:`run_reproduce`)."""
    from art_malleability.paper.reproduce import STUDIES, TABLES, ReproductionConfig

    defaults = ReproductionConfig()
    rep = add_command(
        sub, "reproduce", run,
        "regenerate the paper's Tables 1-4, the eps ablation, loss landscape and spectral numbers next to its values",
        description="Reproduce the paper's comparisons with the paper's training protocol by default "
        "(Adam, lr 1e-3, batch 128, L2 1e-3, 500 epochs). Every flip rate: mean over seeds with a 95% "
        "Student-t interval over the seeds, beside its expectation by query noise, the noise-aware flip rate, the "
        "random-sign control, the excess flip rate, "
        "the paper's value and the ratio MLP-Attn / 2L-ReLU; Table 2 adds the LDS of its influence estimator.",
    )
    add_data_options(rep, n_train=defaults.n_train, n_test=defaults.n_test)
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
    group.add_argument("--attention-context", choices=CONTEXTS, default=defaults.attention_context,
                       help="context of the attention models (gram: the paper's literal X^T X)")
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
    add_work_dir_options(rep, "every trained model's weights, every audit's attacked inputs and refits")
    add_run_options(rep, "reproduction", seed_help=None)


def _work_dir(args: argparse.Namespace) -> str | None:
    """``reproduce``'s work folder: ``--work-dir``, or ``<output>.work`` beside the report folder; ``None`` with
    ``--no-work-dir``."""
    folder = work_root(args)
    if folder is None:
        return None
    open_work_folder(folder)  # created, or checked to be the package's, before any work
    return str(folder)


def run_reproduce(args: argparse.Namespace) -> int:
    """Run ``art-malleability reproduce`` with the parsed ``args``; return the exit status."""
    from art_malleability.paper.reproduce import ReproductionConfig, run_reproduction

    config = ReproductionConfig(
        dataset=args.dataset, data_root=args.data_root, n_train=args.n_train, n_test=args.n_test,
        models=tuple(args.models), width=args.width, attention_context=args.attention_context,
        widths=tuple(args.widths), seeds=tuple(args.seeds),
        epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, adv_epochs=args.adv_epochs, eps=args.eps,
        eps_grid=tuple(args.eps_grid), n_queries=args.n_queries, lds_models=args.lds_models,
        ntk_n_train=args.ntk_n_train, ntk_adam_epochs=args.ntk_adam_epochs, tables=tuple(args.tables),
        device=args.device, verbose=not args.quiet, work_dir=_work_dir(args),
    )
    start = time.perf_counter()
    if "open_choices" in config.tables:
        from art_malleability.paper.open_choices import run_open_choices

        study = run_open_choices(config, args.out, folder="open_choices")
        say(args, study.tables["open_choices"])
        config.tables = tuple(t for t in config.tables if t != "open_choices")
    if config.tables:
        run_reproduction(config, args.out)
    say(args, f"\nreproduction written to {args.output}/ in {time.perf_counter() - start:.0f} s")
    return 0
