"""
What the ``art-malleability`` subcommands check and build before any work: the pre-flight checks of their options
(a problem is a :class:`UsageError`, exit status 2), the ``--model`` factories, ``--weights``, the data of
``--dataset`` and the report folders of ``--output`` and ``--validation``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from art_malleability._utils.params import (
    DEVICE,
    MEMORY_LIMIT_GB,
    N_QUERIES,
    POSITIVE_INT,
    POSITIVE_SECONDS,
    SEED,
    Check,
    DataContentError,
    InvalidParameterError,
    Rule,
    RuleTable,
    check_value,
    check_values,
    shown,
    words,
)
from art_malleability._utils.torch_utils import eval_mode, model_device_dtype
from art_malleability.audit.params import PARAMETER_RULES
from art_malleability.cli.options import (
    AUDIT_OPTIONS,
    DATA_OPTIONS,
    DEFAULT_MODELS,
    NTK_CHECK_OPTIONS,
    REPRODUCE_OPTIONS,
    VALIDATE_OPTIONS,
    dest,
    estimator_params,
    typed,
)
from art_malleability.data.datasets import DATA_RULES
from art_malleability.models.training import TRAINING_RULES
from art_malleability.ntk.convergence import CHECKER_RULES
from art_malleability.paper.reproduce import REPRODUCTION_RULES
from art_malleability.validation.run import VALIDATE_RULES

if TYPE_CHECKING:
    from art_malleability.data.datasets import Dataset

#: What the data's errors advise that the command line cannot do (it never downloads).
_DOWNLOAD = "pass download=True to let torchvision download them"
#: The arguments a ``--model package.module:factory`` is given, when it takes them.
_FACTORY_ARGUMENTS = ("input_shape", "nb_classes")

logger = logging.getLogger(__name__)


class UsageError(ValueError):
    """A command-line option with a value the command cannot use (exit status 2, like argparse's own errors)."""


def preflight(args: argparse.Namespace) -> None:
    """
    Check the options every subcommand shares, before any data is read or model trained: the data source, the
    seed, the model names (factories imported and their signatures read), the weights file (read, its values
    finite), every number and choice of the subcommand (:data:`OPTION_RULES`) and its device, the audit's budget
    and top set, the process group's timeout, the options that do not go together (:func:`_check_clashes`), and a
    validation folder. A problem is a :class:`UsageError` (exit status 2), whose line names the options as typed.
    The ``--output`` folder is checked when the command opens it, also before any data is read.
    """
    from art_malleability.data.datasets import resolve_source

    try:
        if getattr(args, "dataset", None) is not None:
            resolve_source(args.dataset, args.data_root)
        names = getattr(args, "model", None) or []
        for name in names:
            _model_factory(name)
        if getattr(args, "weights", None) is not None:
            if len(names) != 1:
                raise ValueError(f"--weights must come with exactly one --model, got {len(names) or 'no'} --model")
            read_weights(args.weights)
        if getattr(args, "mlflow", False):
            import importlib.util

            if importlib.util.find_spec("mlflow") is None:
                raise ValueError("--mlflow needs MLflow, which is not installed: "
                                 "pip install 'art-malleability[mlflow]'")
        _check_option_rules(args)
        _check_settings(args)
        _check_clashes(args)
        for name in model_names(args) if getattr(args, "validation", None) is not None else []:
            validation_for(args.validation, name)
    except (ValueError, TypeError, OSError) as err:
        raise UsageError(message_of(err)) from err


# ----------------------------------------------------------------------------------------------------
# The numbers and choices of each subcommand: one rule per option, declared once (checked by preflight).
# ----------------------------------------------------------------------------------------------------


def as_typed(value: object) -> str:
    """A parsed option value as it is typed on the command line (a list space-separated, a float as ``%g``)."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(as_typed, value))
    if value is None:
        return "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _rule(must: str, test: Callable[[Any], bool], note: str = "") -> Rule:
    """A rule of an option's parsed value, whose message shows the value as typed."""
    return Rule(must, test, note=note, show=as_typed)


def _steps(rules: Check | tuple[Check, ...]) -> tuple[Check, ...]:
    """:return: ``rules`` as the tuple of rules applied in order (a single rule: a tuple of one)."""
    return rules if isinstance(rules, tuple) else (rules,)


def _each(rules: Check | tuple[Check, ...]) -> Check:
    """The rule of a list option whose every value follows ``rules`` (the message shows the first that does not)."""

    def check(values: Any, name: str) -> Any:
        for value in values or []:
            check_value(rules, value, name)
        return values

    check.each_of, check.must = rules, f"hold values each of which must {words(rules)}"  # type: ignore[attr-defined]
    return check


def _through(table: RuleTable, options: Mapping[str, str]) -> dict[str, tuple[Check, ...]]:
    """
    :return: Each option of ``options`` (``{parameter: option}``) with its parameter's rules in ``table``, the value
        shown as typed.
    """
    return {option: _steps(shown(table[param], as_typed)) for param, option in options.items()}


#: The package's rule of a count, showing the value as typed.
_POSITIVE_INT = shown(POSITIVE_INT, as_typed)
#: An l-inf budget of the data, which every ``--dataset`` scales to [0, 1].
_EPS = _rule("lie in (0, 1): an l-inf budget on inputs scaled to [0, 1] (every --dataset is)",
             lambda v: v is None or 0 < v < 1, note=f"; give it in those units (8/255 = {8 / 255:.4f}, not 8)")

_EPS_LIST = _each(_EPS)


def _eps(value: Any, name: str) -> Any:
    """The rule of ``--eps``: one budget (``reproduce``), or each of a list (``audit``)."""
    return (_EPS_LIST if isinstance(value, list) else _EPS)(value, name)


_eps.must = _EPS.must  # type: ignore[attr-defined] - the rule's words

#: The options of every subcommand that has them: the library's rules of the same settings.
_SHARED_RULES: dict[str, Check | tuple[Check, ...]] = {
    "--seed": SEED, "--seeds": _each(SEED), "--n-queries": N_QUERIES, "--eps": _eps, "--eps-grid": _EPS_LIST,
    "--device": DEVICE,
    "--dist-timeout": shown(POSITIVE_SECONDS, as_typed),
}
#: The data's sizes: :func:`~art_malleability.data.load_dataset`'s rules of ``n_train`` and ``n_test``.
_DATA_RULES: dict[str, tuple[Check, ...]] = {"--n-train": (DATA_RULES["n_train"],), "--n-test": (DATA_RULES["n_test"],)}
#: The training's options: the model's width and :func:`~art_malleability.models.training.train_model`'s rules.
_TRAINING_RULES: dict[str, tuple[Check, ...]] = {
    "--width": (_POSITIVE_INT,),
    **_through(TRAINING_RULES, {"epochs": "--epochs", "batch_size": "--batch-size", "lr": "--lr",
                                "weight_decay": "--weight-decay"}),
}
#: The audit's budgets, checked first like the training's options: the estimator's rules, the value shown as typed.
_BUDGET_RULES = _through(PARAMETER_RULES, {p: AUDIT_OPTIONS[p] for p in ("time_budget_s", "memory_limit_gb")})
#: Every subcommand's own options and their rules (the audit's parameters are the estimator's, checked through its
#: rules: :func:`_check_estimator_params`; the options several subcommands share: ``_SHARED_RULES``). The options of
#: ``validate``, ``ntk-check`` and ``reproduce`` that set a library setting are checked through its rules, found by
#: the option tables (:data:`~art_malleability.cli.options.VALIDATE_OPTIONS`, ``NTK_CHECK_OPTIONS``,
#: ``REPRODUCE_OPTIONS``).
OPTION_RULES: dict[str, dict[str, tuple[Check, ...]]] = {
    "audit": {**_DATA_RULES, **_TRAINING_RULES, **_BUDGET_RULES, "--work-dir-max-gb": (MEMORY_LIMIT_GB,)},
    "validate": {
        **_DATA_RULES, **_TRAINING_RULES,
        **{option: _steps(VALIDATE_RULES[param]) for param, option in VALIDATE_OPTIONS.items()},  # validate()'s rules
    },
    "ntk-check": {**_DATA_RULES, **_through(CHECKER_RULES, NTK_CHECK_OPTIONS)},
    "spectrum": {"--n-train": (*_DATA_RULES["--n-train"],
                               _rule("be at least 2 (a spectrum of one example's kernel is one number)",
                                     lambda v: v is None or v >= 2))},
    "reproduce": {**_DATA_RULES, **_through(REPRODUCTION_RULES, REPRODUCE_OPTIONS)},
}


def _check_option_rules(args: argparse.Namespace) -> None:
    """The subcommand's options (those it has of ``_SHARED_RULES``, then its own :data:`OPTION_RULES`)."""
    command = getattr(args, "command", None)
    shared = {option: rules for option, rules in _SHARED_RULES.items() if hasattr(args, dest(option))}
    for table in (shared, OPTION_RULES.get(command, {})):
        for option, rules in table.items():
            check_value(rules, getattr(args, dest(option)), option)


def _check_clashes(args: argparse.Namespace) -> None:
    """
    Options that do not go together: one typed where another makes it pointless (it would be ignored while the
    report still listed it), and the settings the library would refuse together only after training.
    """
    command = getattr(args, "command", None)
    pointless: list[tuple[str, bool, str]] = []  # (option, whether it was typed where it has no effect, beside what)
    if command == "audit":
        ntk = args.influence == "ntk"
        pointless += [
            ("--control-draws", args.no_controls, "--no-controls"),
            ("--ridge", not ntk, f"--influence {args.influence} (it is the NTK influence's ridge)"),
            ("--projection-dim", not ntk, f"--influence {args.influence} (it is the NTK influence's mode)"),
            ("--time-budget", not ntk or args.projection_dim != "auto",
             f"--influence {args.influence}" if not ntk else
             f"--projection-dim {as_typed(args.projection_dim)} (it decides the mode of --projection-dim auto)"),
            ("--attack-max-iter", not {"pgd", "mim"} & set(args.attacks),
             f"--attacks {as_typed(args.attacks)} (it sets the steps of PGD and MIM)"),
        ]
        ridges, dims = [args.ridge], [args.projection_dim]
    elif command == "validate":
        ntk = "ntk" in args.estimators
        beside = f"--estimators {as_typed(args.estimators)}"
        pointless += [("--ridge", not ntk, f"{beside} (it is the NTK influence's ridge)"),
                      ("--projection-dim", not ntk, f"{beside} (it sets the NTK influence's modes)")]
        ridges, dims = args.ridge if ntk else [], args.projection_dim
    else:
        ridges, dims = [], []
    for option, no_effect, beside in pointless:
        if no_effect and typed(args, option[2:].replace("-", "_")):
            raise ValueError(f"{option} has no effect with {beside}; drop one of them")
    rule = next((r for r in ridges if isinstance(r, str)), None)
    small = next((k for k in dims if isinstance(k, int) and k < args.n_train), None)
    if rule is not None and small is not None:  # the NTK influence refuses it once the projection is planned
        raise ValueError(
            f"--ridge {rule} cannot go with --projection-dim {small} and --n-train {args.n_train}: the rule chooses "
            "the ridge on the n x n kernel, which the projected mode holds only for at most --projection-dim training "
            f"examples; pass --projection-dim none (exact), a --projection-dim of at least {args.n_train}, or a "
            "number for --ridge"
        )
    if command == "reproduce" and "table1" in args.tables and len(set(args.widths)) < 2:
        raise ValueError(f"--widths must hold at least two distinct widths for Table 1 (its width exponent is fitted "
                         f"over them), got {as_typed(args.widths)}; add a width or drop table1 from --tables")


def _check_settings(args: argparse.Namespace) -> None:
    """The audit's parameters through the estimator's rules, then the options that depend on each other."""
    from art_malleability.metrics import smallest_training_set, top_k_count

    if getattr(args, "command", None) == "audit":
        _check_estimator_params(args)
    fraction = getattr(args, "top_fraction", None)
    if fraction is not None and args.n_train is not None and top_k_count(args.n_train, fraction) < 1:
        raise ValueError(
            f"--n-train must leave a non-empty influential set with --top-fraction {fraction}, got {args.n_train}; "
            f"pass --n-train of at least {smallest_training_set(fraction)}"
        )
    if getattr(args, "command", None) == "reproduce" and args.classes is not None:
        raise ValueError(f"--classes must not be given to reproduce, got {args.classes}; Table 3 picks the paper's "
                         "binary classes")


def _check_estimator_params(args: argparse.Namespace) -> None:
    """
    The audit's options through the estimator's own rules (:data:`~art_malleability.audit.params.PARAMETER_RULES`),
    so that a value the estimator refuses fails here, before any training; the error names the option that sets the
    parameter (:data:`~art_malleability.cli.options.AUDIT_OPTIONS`) and the parameter.
    """
    try:
        check_values(PARAMETER_RULES, estimator_params(args))
    except InvalidParameterError as err:
        usage = option_error(err)
        if usage is None:
            raise
        raise usage from err


def option_error(err: InvalidParameterError) -> UsageError | None:
    """
    :param err: An audit parameter's refusal.
    :return: A usage error naming the option that sets the parameter and the parameter
        (:data:`~art_malleability.cli.options.AUDIT_OPTIONS`), or ``None`` for a parameter no option sets.
    """
    option = AUDIT_OPTIONS.get(err.param)
    return None if option is None else UsageError(err.message(f"{option} ({err.param})"))


def message_of(err: BaseException) -> str:
    """
    The first line of an error's message; an :class:`~art_malleability._utils.params.InvalidParameterError` of a
    parameter of :func:`~art_malleability.data.datasets.load_dataset` names the option that sets it instead
    (``root`` → ``--data-root``: :data:`~art_malleability.cli.options.DATA_OPTIONS`), and says what to do on the
    command line, where nothing is downloaded.
    """
    if isinstance(err, InvalidParameterError) and err.param in DATA_OPTIONS:
        message = err.message(DATA_OPTIONS[err.param])
        return message.replace(_DOWNLOAD, "place the files there first").splitlines()[0]
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def load_data(args: argparse.Namespace) -> Dataset:
    """:return: The :class:`~art_malleability.data.datasets.Dataset` of the data options."""
    from art_malleability.data.datasets import load_dataset

    try:
        return load_dataset(
            args.dataset, root=args.data_root, n_train=args.n_train, n_test=args.n_test, classes=args.classes,
            seed=args.seed,
        )
    except DataContentError as err:  # read, but what it holds cannot be used (one class, no labels, NaN): status 2
        raise UsageError(message_of(err)) from err


def model_names(args: argparse.Namespace) -> list[str]:
    """:return: The ``--model`` names, by default both reference models."""
    return args.model or list(DEFAULT_MODELS)


# ----------------------------------------------------------------------------------------------------
# Report folders.
# ----------------------------------------------------------------------------------------------------


def output_claims(args: argparse.Namespace) -> list[str]:
    """
    What a subcommand will write at the top of ``--output``, checked before any work
    (:meth:`~art_malleability._utils.output_folder.OutputFolder.claim`): ``summary.md`` and one folder per model for
    ``audit`` and ``validate``, the report's JSON and Markdown for the others.
    """
    from art_malleability._utils.report_base import slugify

    if args.command in ("audit", "validate"):
        return ["summary.md", *(slugify(name) for name in model_names(args))]
    from art_malleability.ntk.convergence_report import ConvergenceReport
    from art_malleability.ntk.spectral_report import SpectralReport
    from art_malleability.paper.reproduce import Reproduction

    report = {"ntk-check": ConvergenceReport, "spectrum": SpectralReport, "reproduce": Reproduction}[args.command]
    return [report.json_name, report.markdown_name]


def note_replaced(args: argparse.Namespace) -> None:
    """
    Before any work, one warning that names the reports an earlier run of the same command left in ``--output`` and
    that this run removes when it succeeds (the folder of a model it does not write now: see
    :meth:`~art_malleability._utils.output_folder.OutputFolder.commit`). Nothing on the processes that write nothing.
    """
    from art_malleability._utils.output_folder import file_digest, read_manifest

    if getattr(args, "out", None) is None:
        return
    root, kept = Path(args.output), set(output_claims(args))
    replaced = set()
    for rel, entry in read_manifest(root).get("files", {}).items():
        top, path = rel.split("/", 1)[0], root / rel
        if entry["writer"] != args.command or top in kept or not path.is_file() or path.is_symlink():
            continue
        if file_digest(path) == entry["sha256"]:  # a changed file stays (the commit leaves it)
            replaced.add(top + "/" if "/" in rel else top)
    if replaced:
        logger.warning(
            "--output %s holds the reports of an earlier %s in %s, which this run replaces: removed when it succeeds "
            "(pass another --output to keep them)", args.output, args.command, ", ".join(sorted(replaced))
        )


def validation_for(folder: str | None, name: str) -> Path | None:
    """The ``validation.json`` of one model in a ``validate`` output folder (``None`` without a folder)."""
    from art_malleability._utils.report_base import slugify

    if folder is None:
        return None
    for path in (Path(folder) / slugify(name) / "validation.json", Path(folder) / "validation.json"):
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"--validation must hold a validation.json for model {name!r}, got {folder!r}, which holds no validation.json "
        "for it"
    )


# ----------------------------------------------------------------------------------------------------
# Models: --model names and factories, --weights.
# ----------------------------------------------------------------------------------------------------


def build_model(
    name: str, input_shape: tuple[int, ...], nb_classes: int, width: int, seed: int, context: str = "centred"
) -> torch.nn.Module:
    """
    Build the model of ``--model name``: a reference model (the attention models with ``--attention-context``), an
    architecture or a factory's model, checked on two zero inputs against the data's input shape and number of
    classes (unless it is transductive).
    """
    from art_malleability.models.architectures import build_architecture
    from art_malleability.models.reference import build_reference_model, is_transductive

    factory = _model_factory(name)
    if factory == "reference":
        attention = name != "2l-relu"
        return build_reference_model(name, input_shape, nb_classes, width=width, seed=seed,
                                     context=context if attention else None)
    if factory == "architecture":
        return build_architecture(name, input_shape, nb_classes, seed=seed)
    try:
        accepted = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        accepted = {}
    kwargs = {k: v for k, v in zip(_FACTORY_ARGUMENTS, (input_shape, nb_classes), strict=True) if k in accepted}
    if _takes_num_classes(factory, accepted):  # torchvision's convention: --model torchvision.models:resnet18
        kwargs["num_classes"] = nb_classes
    model = factory(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--model must build a torch.nn.Module, got {type(model).__name__} from {name!r}")
    if not is_transductive(model):  # a transductive forward needs the training context, set when it is trained
        _probe(model, name, input_shape, nb_classes)
    return model


def _takes_num_classes(factory: object, accepted: Mapping[str, inspect.Parameter]) -> bool:
    """Whether a factory takes the classes as ``num_classes``: a parameter of that name, or a torchvision builder
    (whose ``**kwargs`` go to the model's class, which takes it)."""
    if "nb_classes" in accepted:
        return False
    if "num_classes" in accepted:
        return True
    keywords = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    return keywords and getattr(factory, "__module__", "").startswith("torchvision.")


def _probe(model: torch.nn.Module, name: str, input_shape: tuple[int, ...], nb_classes: int) -> None:
    """Before any training: the model must take the data's inputs and give one logit per class."""
    device, dtype = model_device_dtype(model)
    try:
        with torch.no_grad(), eval_mode(model):
            out = model(torch.zeros((2, *input_shape), dtype=dtype, device=device))
    except Exception as err:  # noqa: BLE001 - the user's module: any failure is a mismatch to name
        raise ValueError(
            f"--model must build a model for the data's inputs, got {name!r}, which cannot take the data's inputs of "
            f"shape {tuple(input_shape)} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "build it for that shape"
        ) from err
    if not isinstance(out, torch.Tensor) or out.shape != (2, nb_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"--model must return logits of shape (2, {nb_classes}) for 2 inputs (one per class of the data), got "
            f"{shape} from {name!r}"
        )


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """
    Read ``--weights``: a ``state_dict`` file, loaded with ``torch.load(..., weights_only=True)``, whose values are
    finite (a NaN weight would fail much later, inside the kernel solve).

    :param path: The file.
    :return: The state dict.
    :raises ValueError: With a message that names the option and says what to change.
    """
    import pickle
    import zipfile

    if not os.path.isfile(path):
        what = "a folder" if os.path.isdir(path) else "not an existing file"
        raise ValueError(f"--weights must be a state_dict file, got {path!r}, which is {what}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(
            f"--weights must be a state_dict file, got {path!r}, which is not a state_dict saved with "
            "torch.save(model.state_dict(), path) (a whole pickled model or another file cannot be loaded safely); "
            "save the model's state_dict and pass that file"
        ) from err
    if not isinstance(state, dict):
        raise ValueError(f"--weights must hold a state_dict, got a {type(state).__name__} in {path!r}")
    odd = next(((key, value) for key, value in state.items() if not isinstance(value, torch.Tensor)), None)
    if odd is not None:
        raise ValueError(f"--weights must hold a state_dict (parameter names to tensors), got {path!r}, whose "
                         f"{odd[0]!r} is of type {type(odd[1]).__name__}; save torch.save(model.state_dict(), path)")
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ValueError(
                f"--weights must hold finite values, got {path!r}, whose {key!r} has {bad} NaN or infinite "
                f"value(s) of {value.numel()}; the model it was saved from diverged"
            )
    return state


def load_weights(module: torch.nn.Module, path: str, name: str) -> None:
    """Load ``--weights`` (:func:`read_weights`) into the built model, with a message that says what to change."""
    state = read_weights(path)
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).splitlines()[1:2] or [str(err)]
        raise ValueError(
            f"--weights must fit --model {name} as built here, got {path!r} ({first[0].strip()}); check --model, "
            "--width, --attention-context (a centred attention model stores attention.mean) and the data's number of "
            "classes (--dataset, --classes) against the saved model"
        ) from err


def _model_factory(name: str) -> object:
    """``"reference"``, ``"architecture"`` or the imported factory of ``--model name``."""
    from art_malleability.models.architectures import ARCHITECTURES
    from art_malleability.models.reference import REFERENCE_MODELS

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
        raise ValueError(
            f"--model must name an importable factory, got {name!r}: cannot import {attr!r} from {module_name!r} "
            f"({err})"
        ) from err
    if isinstance(factory, torch.nn.Module) or not callable(factory):
        raise TypeError(
            f"--model must name a function or class that builds a torch.nn.Module, got {name!r}, an instance of "
            f"{type(factory).__name__}"
        )
    if inspect.isclass(factory) and not issubclass(factory, torch.nn.Module):
        raise TypeError(
            f"--model must name a function or class that builds a torch.nn.Module, got {name!r}, a class that is not "
            "a torch.nn.Module"
        )
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): it is called and its result checked
        return factory
    needed = [p.name for p in parameters if p.default is p.empty and p.name not in _FACTORY_ARGUMENTS
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise TypeError(
            f"--model must name a function or class that builds a torch.nn.Module from input_shape= and nb_classes= "
            f"(or from no arguments), got {name!r}, which needs {', '.join(map(repr, needed))}"
        )
    return factory


def open_work_folder(folder: Path) -> None:
    """Open (create where missing) a work folder before any work; one the package did not create is a usage error
    naming ``--work-dir``."""
    from art_malleability._utils.work_folder import WorkFolder

    try:
        WorkFolder(folder)
    except (ValueError, OSError) as err:
        raise UsageError(f"--work-dir {str(err).removeprefix('work_dir ')}") from None
