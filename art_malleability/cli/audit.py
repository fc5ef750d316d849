"""``art-malleability audit``: its options and its run, sharded over the processes of a ``torchrun`` launch."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from art_malleability.audit.attacks import ATTACK_NAMES, STRATEGIES
from art_malleability.cli.checks import (
    as_typed,
    build_model,
    load_data,
    load_weights,
    model_names,
    note_replaced,
    open_work_folder,
    validation_for,
)
from art_malleability.cli.options import (
    Runner,
    Typed,
    add_command,
    add_data_options,
    add_model_options,
    add_run_options,
    add_work_dir_options,
    estimator_params,
    projection_dim,
    ridge_value,
    say,
    work_root,
)
from art_malleability.influence import INFLUENCE_NAMES
from art_malleability.metrics import RANK_BY

if TYPE_CHECKING:
    import torch

    from art_malleability.audit.report import MalleabilityReport
    from art_malleability.data.datasets import Dataset
    from art_malleability.distributed import Shard


def add_audit(sub: argparse._SubParsersAction, run: Runner) -> None:
    """The ``audit`` subcommand and its options, run by ``run`` (:func:`run_audit`)."""
    audit = add_command(
        sub, "audit", run,
        "train or load models, attack their training data, report influence flip rates",
        description="Audit influence malleability. With no arguments: both reference models on the "
        "embedded scikit-learn digits, FGSM/PGD/MIM at eps 0.3.",
    )
    add_data_options(audit, n_train=1000, n_test=300)
    model = add_model_options(audit, batch_help="training and attack batch size", loss_help="training loss")
    model.add_argument(
        "--weights",
        default=None,
        help="state_dict file loaded with torch.load(weights_only=True) instead of training (one model only)",
    )
    group = audit.add_argument_group("audit")
    group.add_argument("--attacks", nargs="+", choices=ATTACK_NAMES, default=list(ATTACK_NAMES))
    group.add_argument(
        "--eps", type=float, nargs="+", default=0.3,
        help="l-inf attack budget on [0, 1] inputs; several (--eps 0.1 0.2 0.3) run each attack at each budget after "
        "one clean fit, and the report shows the flip rate against eps",
    )
    group.add_argument("--attack-max-iter", type=int, default=20, action=Typed, help="steps of PGD and MIM")
    group.add_argument("--influence", choices=INFLUENCE_NAMES, default="ntk", help="influence estimator")
    group.add_argument(
        "--ridge", type=ridge_value, default=1e-3, action=Typed,
        help="ridge lambda of the NTK influence, or 'loo' / 'gcv' to choose it on the clean training set",
    )
    group.add_argument(
        "--projection-dim",
        type=projection_dim,
        default="auto",
        action=Typed,
        help="NTK influence mode: 'auto' (the exact n x n solve when it fits --memory-limit-gb, in memory or in tiles "
        "on disk, and the NTK influence's estimated time for the whole audit is under --time-budget; else projected "
        "with k = 4096, after a warning naming the options), 'none' (always exact) or the projection dimension k "
        "(always projected)",
    )
    group.add_argument(
        "--time-budget", type=float, default=1800.0, action=Typed, metavar="SECONDS",
        help="longest estimated time of the NTK influence's work in the audit (the fit, a refit per attack and "
        "control draw, the queries' scores after each) for --projection-dim auto to run the exact mode; estimated "
        "from counted operations at a nominal rate of this machine's device and threads, never timed (default 1800)",
    )
    group.add_argument(
        "--memory-limit-gb", type=float, default=None, action=Typed, metavar="GIB",
        help="memory the NTK influence's large matrices and the metrics may take (default: 80%% of the total "
        "memory); the mode is chosen within it, and a run whose choice does not fit the memory available now stops "
        "and says so",
    )
    group.add_argument("--top-fraction", type=float, default=0.1, help="share of training data in the top set")
    group.add_argument("--strategy", choices=STRATEGIES, default="top", help="perturb the top set or all")
    group.add_argument("--rank-by", choices=RANK_BY, default="abs", help="rank the top set by absolute or signed score")
    group.add_argument(
        "--n-queries", type=int, default=None,
        help="query points drawn from the test set (default: every test point, up to 10,000); more queries decide more "
        "signs, and the metrics' time and memory grow linearly with them (a number that would not fit is refused "
        "before training)",
    )
    group.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples for intervals")
    group.add_argument(
        "--no-controls", action="store_true",
        help="skip the random-sign control of each attack (same examples, random signs at +-eps) and the excess "
        "flip rate",
    )
    group.add_argument(
        "--control-draws", type=int, default=5, action=Typed,
        help="independent draws of each control's random signs (their mean is the control; their spread enters the "
        "excess flip rate's interval)",
    )
    group.add_argument(
        "--validation", default=None,
        help="output folder of 'art-malleability validate' for the same data and training settings: each report "
        "then states its estimator's LDS against retraining (from <folder>/<model>/validation.json)",
    )
    group.add_argument(
        "--mlflow", action="store_true",
        help="also log every model's report to MLflow (needs the [mlflow] extra): metrics with their intervals, the "
        "settings, and the JSON, Markdown, HTML and figures as artifacts, in one run (the active one, MLFLOW_RUN_ID's, "
        "or a new one; MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME choose where)",
    )
    add_run_options(audit, "malleability-audit")
    work = add_work_dir_options(audit, "each model's trained weights, each attack's perturbed inputs and each finished "
                                "refit")
    work.add_argument(
        "--work-dir-max-gb", type=float, default=None, metavar="GB",
        help="the most each model's work folder keeps: after its audit the oldest stages are removed until its "
        "stages fit (default: no limit)",
    )
    _add_distributed_options(audit)


def _open_work_dirs(args: argparse.Namespace) -> None:
    """Every model's work folder opened (created where missing) before any data is read: one the package did not
    create is refused, naming ``--work-dir``."""
    for name in model_names(args):
        folder = work_dir(args, name)
        if folder is not None:
            open_work_folder(folder)


def work_dir(args: argparse.Namespace, name: str) -> Path | None:
    """:return: The work folder of model ``name`` (``--work-dir`` or ``<output>.work``, one subfolder per model), or
    ``None`` with ``--no-work-dir``."""
    from art_malleability._utils.report_base import slugify

    root = work_root(args)
    return None if root is None else root / slugify(name)


#: How the audit plan's line says to change it (the options that set what it estimates).
def plan_options(args: argparse.Namespace) -> str:
    """The options the plan line names as changing it: only those that have an effect with the others given (the
    time budget decides the NTK influence's mode only under ``--projection-dim auto``; the projection dimension is the
    NTK influence's)."""
    ntk = args.influence == "ntk"
    options = (["--time-budget"] if ntk and args.projection_dim == "auto" else []) + ["--memory-limit-gb"]
    options += (["--projection-dim"] if ntk else []) + ["--n-queries"]
    return ", ".join(options[:-1]) + " or " + options[-1]


def _add_distributed_options(audit: argparse.ArgumentParser) -> None:
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


def run_audit(args: argparse.Namespace) -> int:
    """Run ``art-malleability audit`` with the parsed ``args``, sharded over the processes of a ``torchrun`` launch;
    return the exit status. The lead process stages its reports in ``args.out`` (the open ``--output`` folder)."""
    from art_malleability.audit.report import comparison_table
    from art_malleability.distributed import init_from_env

    shard = init_from_env(args.dist_backend, args.dist_timeout)
    lead = shard.rank == 0
    note_replaced(args)
    if lead:
        _open_work_dirs(args)
    start = time.perf_counter()
    data = load_data(args)
    if lead:
        say(args, f"data: {data.name}, {len(data.x_train)} train / {len(data.x_test)} test, input {data.input_shape}, "
                  f"{data.nb_classes} classes ({time.perf_counter() - start:.1f} s)"
                  + (f"; {shard.world_size} processes ({shard.backend})" if shard.world_size > 1 else ""))
    _check_queries(args, data)
    planned = [_planned(args, name, data, shard) for name in model_names(args)]  # every plan kept, before training
    reports = [_audit_model(args, name, data, shard, *parts) for name, parts in zip(model_names(args), planned,
                                                                                      strict=True)]
    if lead:
        table = comparison_table(reports)
        args.out.write("summary.md", f"# Influence malleability on {data.name}\n\n{table}\n")
        say(args, f"\n{table}\n\nreports in {args.output}/")
        if args.mlflow:
            return _log_to_mlflow(args, reports)
    return 0


def _log_to_mlflow(args: argparse.Namespace, reports: list[MalleabilityReport]) -> int:
    """
    ``--mlflow``: every model's report in one MLflow run (the active one, ``MLFLOW_RUN_ID``'s, or a new one in
    ``MLFLOW_EXPERIMENT_NAME``'s experiment), metrics and parameters prefixed with the model. A failure to log is one
    line and status 1; the reports are written to ``--output`` either way.
    """
    import sys

    import mlflow

    from art_malleability._utils.report_base import slugify
    from art_malleability.audit.report_mlflow import log_to_mlflow

    try:
        with mlflow.start_run(run_name="art-malleability audit", nested=mlflow.active_run() is not None) as run:
            for name, report in zip(model_names(args), reports, strict=True):
                log_to_mlflow(report, run, prefix=f"{slugify(name)}.")
    except Exception as err:  # noqa: BLE001 - the reports stay; the failure is said and the status is 1
        print(f"art-malleability audit: error: logging to MLflow ({mlflow.get_tracking_uri()}) failed: "
              f"{type(err).__name__}: {err}; the reports are in {args.output}/", file=sys.stderr)
        return 1
    say(args, f"logged to MLflow: run {run.info.run_id} of experiment {run.info.experiment_id} "
              f"({mlflow.get_tracking_uri()})")
    return 0


def _check_queries(args: argparse.Namespace, data: Dataset) -> None:
    """``--n-queries`` must fit the memory: checked once the data's sizes are known, before any training."""
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability._utils.torch_utils import resolve_device
    from art_malleability.audit.params import check_query_budget, default_queries
    from art_malleability.cli.checks import option_error
    from art_malleability.metrics import top_k_count

    n_query = min(len(data.x_test), default_queries(args.n_queries))
    try:
        check_query_budget(n_query, len(data.x_train), top_k_count(len(data.x_train), args.top_fraction),
                           args.n_bootstrap, False, args.memory_limit_gb, resolve_device(args.device))
    except InvalidParameterError as err:
        usage = option_error(err)
        if usage is None:
            raise
        raise usage from err


def _planned(args: argparse.Namespace, name: str, data: Dataset, shard: Shard) -> tuple:
    """
    One model built (untrained), its audit and the audit's plan, printed; a ``--memory-limit-gb`` that the plan's
    peak exceeds is refused here, before any model is trained (a limit is kept or the command does not start).

    :return: ``(module, audit, plan)``.
    :raises UsageError: Naming ``--memory-limit-gb`` and the size that would hold the plan.
    """
    import math

    from art_malleability.audit.estimator import MalleabilityEstimator
    from art_malleability.cli.checks import UsageError
    from art_malleability.models.training import make_classifier

    lead = shard.rank == 0
    module = build_model(name, data.input_shape, data.nb_classes, args.width, args.seed, args.attention_context)
    classifier = make_classifier(
        module, data.input_shape, data.nb_classes, loss=args.loss, clip_values=data.clip_values, device=args.device
    )
    audit = MalleabilityEstimator(classifier, **estimator_params(args), verbose=lead and not args.quiet,
                                  model_name=name, work_dir=work_dir(args, name))
    plan = audit.estimate(data.x_train, data.x_test)  # before the long work (training included), in every process
    if lead:
        say(args, f"{name}: {plan.summary(plan_options(args))}")
    limit = args.memory_limit_gb
    if limit is not None and plan.peak_bytes > limit * 2**30:
        need = math.ceil(plan.peak_bytes / 2**30 * 10) / 10
        raise UsageError(
            f"--memory-limit-gb must hold the audit's planned peak memory, got {as_typed(limit)} (GiB), where the "
            f"plan of {name} needs about {plan.peak_bytes / 2**30:.1f} GiB; raise it to at least {need:.1f}, or "
            "lower --n-train or --n-queries"
        )
    return module, audit, plan


def _audit_model(args: argparse.Namespace, name: str, data: Dataset, shard: Shard, module: torch.nn.Module,
                 audit: Any, plan: Any) -> MalleabilityReport:
    """Train (or load) one planned model (:func:`_planned`), audit it, and on the lead process stage and print its
    report."""
    from art_malleability._utils.report_base import slugify

    lead = shard.rank == 0
    start = time.perf_counter()
    what = _train_or_load(args, name, module, data, shard, lead)
    trained = time.perf_counter() - start
    start = time.perf_counter()
    report = audit.evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name,
                            validation=validation_for(args.validation, name))
    report.config["estimate"] = plan.to_dict()
    report.seconds["train"] = trained
    report.config["model"] = _model_settings(args, name)
    report.execution["command"] = shlex.join(["art-malleability", *getattr(args, "argv", [])])  # to run it again
    folder = work_dir(args, name)
    if lead and folder is not None and args.work_dir_max_gb is not None:
        from art_malleability._utils.work_folder import WorkFolder

        WorkFolder(folder).prune(args.work_dir_max_gb * 1e9)
    if lead:
        report.stage(args.out, slugify(name))
        kept = report.execution.get("work_folder", {}).get("reused", {})
        parts = [f"{kept[what]} {what}" for what in ("passes", "attack chunks") if kept.get(what)]
        reused = f" (reused from the work folder: {', '.join(parts)})" if parts else ""
        say(args, f"\n{name}: {what} in {trained:.1f} s, audited in {time.perf_counter() - start:.1f} s{reused} -> "
                  f"{Path(args.output) / slugify(name)}", report.summary())
    return report


def _model_settings(args: argparse.Namespace, name: str) -> dict[str, object]:
    """
    What the report states of the audited model: its name, the width and attention context of a reference model
    (those that take them), and the ``--weights`` file or the training settings; the loss of the classifier either way.
    """
    from art_malleability.models.reference import REFERENCE_MODELS

    settings: dict[str, object] = {"name": name}
    if name in REFERENCE_MODELS:
        settings["width"] = args.width
        if name != "2l-relu":
            settings["attention_context"] = args.attention_context
    settings["weights"] = args.weights
    if args.weights is None:
        settings.update(epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size)
    settings["loss"] = args.loss
    return settings


def _train_or_load(
    args: argparse.Namespace, name: str, module: torch.nn.Module, data: Dataset, shard: Shard, lead: bool
) -> str:
    """Load ``--weights`` into the model of ``--model name``, or train it on rank 0 (in place); :return: what was
    done."""
    from art_malleability.models.training import train_model

    if args.weights is not None:
        load_weights(module, args.weights, name)
        return f"loaded {args.weights}"
    def train() -> None:
        train_model(
            module, data.x_train, data.y_train, loss=args.loss, epochs=args.epochs, batch_size=args.batch_size,
            lr=args.lr, weight_decay=args.weight_decay, seed=args.seed, device=args.device, verbose=not args.quiet,
        )

    done = f"trained {args.epochs} epochs"
    folder = work_dir(args, name)
    if lead and folder is None:  # in place
        train()
    elif lead:  # the trained weights are a stage, keyed by the untrained model, the data and the training settings
        from art_malleability._utils.work_folder import kept_training, value_digest

        settings = {"data": value_digest([data.x_train, data.y_train]), "settings": _model_settings(args, name),
                    "seed": args.seed, "device": str(args.device)}
        if kept_training(folder, module, settings, train):
            done = f"reused its weights of {args.epochs} epochs' training from the work folder {folder}"
    if shard.world_size > 1:  # every process audits rank 0's weights
        module.load_state_dict(shard.broadcast_object({k: v.cpu() for k, v in module.state_dict().items()}))
    return done
