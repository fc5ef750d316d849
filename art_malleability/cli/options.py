"""Option groups that several ``art-malleability`` subcommands share: data, model training, run and output."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: What runs a subcommand: parsed arguments in, exit status out.
Runner = Callable[[argparse.Namespace], int]

#: Reference models a subcommand trains when no ``--model`` is given.
DEFAULT_MODELS = ("2l-relu", "mlp-attn")

_MODEL_HELP = (
    "reference model name ('2l-relu', 'mlp-attn'), architecture ('cnn', 'resnet20': see "
    "art_malleability.models.architectures) or 'package.module:factory' returning an nn.Module (called with "
    "input_shape= and nb_classes= when it takes them, or num_classes= as torchvision's builders: "
    "'torchvision.models:resnet18'); repeat for several; default: both reference models"
)


def add_command(
    sub: argparse._SubParsersAction, name: str, run: Runner, summary: str,
    description: str,
) -> argparse.ArgumentParser:
    """
    Add a subcommand whose help shows its options' defaults.

    :param sub: The subparsers of the ``art-malleability`` parser.
    :param name: The subcommand.
    :param run: What runs it, with the parsed arguments, returning the exit status.
    :param summary: One line in the command's help.
    :param description: The subcommand's own help.
    :return: Its parser.
    """
    parser = sub.add_parser(
        name, help=summary, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.set_defaults(func=run)
    return parser


class Typed(argparse.Action):
    """
    Store an option's value (as ``store`` does) and note in ``args.typed`` that it was given on the command line,
    even when its value is the default: an option that another option makes pointless is refused when typed
    (:func:`~art_malleability.cli.checks.preflight`), never when it only holds its default.
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.typed = {*getattr(namespace, "typed", ()), self.dest}


def typed(args: argparse.Namespace, dest: str) -> bool:
    """:return: Whether the option of ``dest`` (declared with ``action=Typed``) was given on the command line."""
    return dest in getattr(args, "typed", ())


def add_data_options(parser: argparse.ArgumentParser, n_train: int, n_test: int | None) -> None:
    """``--dataset``, ``--data-root``, ``--classes``, ``--n-train`` and (unless ``n_test`` is None) ``--n-test``."""
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


def add_model_options(
    parser: argparse.ArgumentParser, *, batch_help: str, loss_help: str
) -> argparse._ArgumentGroup:
    """
    The ``model`` group: ``--model`` (repeatable) and the training settings of the models a subcommand trains.

    :return: The group, for options of one subcommand only.
    """
    model = parser.add_argument_group("model")
    model.add_argument("--model", action="append", default=None, help=_MODEL_HELP)
    model.add_argument("--width", type=int, default=512, help="hidden width of the reference models")
    model.add_argument(
        "--attention-context", choices=("centred", "gram"), default="centred",
        help="context of the attention models: the centred training tokens (default) or the paper's literal "
        "Gram matrix X^T X, which leaves MLP-Attn's features of all classes nearly parallel (docs/reproduction.md)",
    )
    model.add_argument("--epochs", type=int, default=300, help="training epochs of every model (Adam)")
    model.add_argument("--batch-size", type=int, default=128, help=batch_help)
    model.add_argument(
        "--lr",
        type=float,
        default=3e-2,
        help="Adam learning rate (with the paper's 1e-3 and L2 1e-3 both reference models underfit digits: "
        "docs/reproduction.md)",
    )
    model.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty (Adam weight_decay; paper 1e-3)")
    model.add_argument("--loss", choices=("cross_entropy", "mse"), default="cross_entropy", help=loss_help)
    return model


def add_run_options(
    parser: argparse.ArgumentParser, output: str, *, seed_help: str | None = "seed of every random choice",
    device: bool = True,
) -> None:
    """The ``run`` group: ``--seed`` (unless ``seed_help`` is None), ``--device`` and the report folder ``--output``."""
    run = parser.add_argument_group("run")
    if seed_help is not None:
        run.add_argument("--seed", type=int, default=0, help=seed_help)
    if device:
        run.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    run.add_argument("--output", default=output, help="report folder")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The ``output`` group of every subcommand: ``-q`` and ``-v``."""
    group = parser.add_argument_group("output")
    group.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars or tables while running; log errors only"
    )
    group.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="log progress (-vv: debug) and show the traceback of an error",
    )


def add_work_dir_options(parser: argparse.ArgumentParser, kept: str) -> argparse._ArgumentGroup:
    """
    The ``work folder`` group of a command that keeps its finished stages: ``--work-dir`` and ``--no-work-dir``.

    :param kept: What the command keeps there, in the help.
    :return: The group (a command adds its own options to it).
    """
    work = parser.add_argument_group("work folder")
    work.add_argument(
        "--work-dir", default=None, metavar="DIR",
        help=f"folder of finished stages ({kept}), so that a rerun of the command, after an interruption or with "
        "more to do, redoes only what is not there; default: <output>.work beside the report folder",
    )
    work.add_argument("--no-work-dir", action="store_true", help="keep no finished stages")
    return work


def work_root(args: argparse.Namespace) -> Path | None:
    """:return: ``--work-dir``, or ``<output>.work`` beside the report folder (also for ``--output .``: the folder's own
    name); ``None`` with ``--no-work-dir``."""
    if args.no_work_dir:
        return None
    out = Path(args.output).resolve()
    return Path(args.work_dir) if args.work_dir is not None else out.parent / f"{out.name}.work"


def say(args: argparse.Namespace, *lines: str) -> None:
    """Print ``lines`` on stdout, one per line, unless the command runs with ``-q`` (then it prints nothing)."""
    if not getattr(args, "quiet", False):
        print(*lines, sep="\n", flush=True)


def ridge_value(text: str) -> float | str:
    """
    Parse a ``--ridge`` value.

    :param text: A positive number, ``loo`` or ``gcv`` (see :mod:`art_malleability.influence.ridge_choice`).
    :return: The float or the rule's name.
    """
    from art_malleability.influence.ridge_choice import RIDGE_RULES, check_ridge

    key = text.strip().lower()
    try:
        value = key if key in RIDGE_RULES else float(key)
        check_ridge(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, 'loo' or 'gcv', got {text!r}") from None
    return value


def projection_dim(text: str) -> int | str | None:
    """
    Parse a ``--projection-dim`` value.

    :param text: ``auto``, ``none`` or a positive integer.
    :return: ``"auto"``, ``None`` or the integer.
    """
    key = text.strip().lower()
    if key in ("auto", "none"):
        return "auto" if key == "auto" else None
    try:
        value = int(key)
    except ValueError:
        value = 0
    if value < 1:
        # argparse prefixes the option: "argument --projection-dim: must be ..."
        raise argparse.ArgumentTypeError(f"must be 'auto', 'none' or a positive integer, got {text!r}")
    return value


#: The :class:`~art_malleability.audit.MalleabilityEstimator` parameters that ``audit``'s options set, by the option
#: that sets each: how an error that names a parameter (``InvalidParameterError.param``) names its option.
AUDIT_OPTIONS = {
    "attacks": "--attacks", "eps": "--eps", "influence": "--influence", "top_fraction": "--top-fraction",
    "strategy": "--strategy", "ridge": "--ridge", "n_queries": "--n-queries", "rank_by": "--rank-by",
    "n_bootstrap": "--n-bootstrap", "attack_max_iter": "--attack-max-iter", "batch_size": "--batch-size",
    "seed": "--seed", "device": "--device", "projection_dim": "--projection-dim", "controls": "--no-controls",
    "control_draws": "--control-draws", "time_budget_s": "--time-budget", "memory_limit_gb": "--memory-limit-gb",
}


#: The :func:`~art_malleability.validation.validate` settings that ``validate``'s own options set, by the option that
#: sets each: those options are checked through the library's rules of the settings
#: (:data:`~art_malleability.validation.run.VALIDATE_RULES`); ``--seed`` is every subcommand's, checked by the same
#: rule.
VALIDATE_OPTIONS = {
    "n_models": "--n-models", "alpha": "--alpha", "loo_queries": "--loo-queries", "loo_top": "--loo-top",
    "loo_seeds": "--loo-seeds", "n_bootstrap": "--n-bootstrap",
}


#: The :class:`~art_malleability.ntk.convergence.NTKConvergenceChecker` settings that ``ntk-check``'s options set, by
#: the option that sets each: those options are checked through the checker's rules
#: (:data:`~art_malleability.ntk.convergence.CHECKER_RULES`), the value shown as typed.
NTK_CHECK_OPTIONS = {
    "models": "--models", "widths": "--widths", "seeds": "--seeds", "ridge": "--ridge", "gd_steps": "--gd-steps",
    "gd_lr_scale": "--gd-lr-scale", "adam_epochs": "--adam-epochs",
}


#: The :class:`~art_malleability.paper.reproduce.ReproductionConfig` settings that ``reproduce``'s own options set, by
#: the option that sets each: those options are checked through the config's rules
#: (:data:`~art_malleability.paper.reproduce.REPRODUCTION_RULES`), the value shown as typed.
REPRODUCE_OPTIONS = {
    "models": "--models", "width": "--width", "widths": "--widths", "seeds": "--seeds", "epochs": "--epochs",
    "lr": "--lr", "weight_decay": "--weight-decay", "adv_epochs": "--adv-epochs", "lds_models": "--lds-models",
    "ntk_n_train": "--ntk-n-train", "ntk_adam_epochs": "--ntk-adam-epochs",
}


#: The :func:`~art_malleability.data.load_dataset` parameters that the data options (:func:`add_data_options`) set,
#: by the option that sets each: how an error of the data that names a parameter (``InvalidParameterError.param``)
#: names its option. ``"n_train and n_test"`` labels the error that refuses the two sizes together.
DATA_OPTIONS = {
    "name_or_path": "--dataset", "root": "--data-root", "classes": "--classes", "n_train": "--n-train",
    "n_test": "--n-test", "n_train and n_test": "--n-train and --n-test",
}


def dest(option: str) -> str:
    """:return: The ``args`` attribute of an option (``--n-queries`` → ``n_queries``)."""
    return option[2:].replace("-", "_")


def estimator_params(args: argparse.Namespace) -> dict[str, Any]:
    """:return: The :class:`~art_malleability.audit.MalleabilityEstimator` parameters the audit options set."""
    params = {name: getattr(args, dest(option)) for name, option in AUDIT_OPTIONS.items()}
    params["controls"] = not args.no_controls
    return params
