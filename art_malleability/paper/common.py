"""
Steps shared by the paper's reproduction and the open-choices study: training a reference model under the
run's protocol, auditing it, turning a report into table rows, and pooling those rows over seeds.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from art_malleability._utils.checks import near_chance_warnings
from art_malleability._utils.io import progress_bar
from art_malleability._utils.work_folder import kept_training, value_digest
from art_malleability.audit.estimator import MalleabilityEstimator
from art_malleability.data.datasets import Dataset
from art_malleability.metrics import seed_interval, z_value
from art_malleability.models.reference import build_reference_model
from art_malleability.models.training import make_classifier, train_model

ATTACKS = ("fgsm", "pgd", "mim")


def build_module(config, model: str, input_shape, nb_classes: int, seed: int, width: int | None = None):
    """A fresh reference model of the run: ``config.width`` unless ``width``, its attention context for MLP-Attn."""
    context = None if model == "2l-relu" else config.attention_context
    return build_reference_model(model, input_shape, nb_classes, width=width or config.width, seed=seed,
                                 context=context)


def train_module(
    config, model: str, x: np.ndarray, y: np.ndarray, seed: int, loss: str, input_shape, nb_classes, transform=None
) -> torch.nn.Module:
    """
    A reference model trained under the run's protocol; with the run's ``work_dir``, trained weights are kept there and
    a rerun of the same training (model, initial weights, data, settings, seed, device) loads them instead.
    """
    module = build_module(config, model, input_shape, nb_classes, seed)
    if transform is not None:
        module = transform(module)
    settings = {"loss": loss, "epochs": config.epochs, "batch_size": config.batch_size, "lr": config.lr,
                "weight_decay": config.weight_decay}

    def fit() -> None:
        train_model(module, x, y, **settings, seed=seed, device=config.device, verbose=False)

    folder = getattr(config, "work_dir", None)
    if folder is None:
        fit()
    else:
        kept_training(folder, module, {"data": value_digest([x, y]), "training": settings, "seed": seed,
                                       "device": str(config.device)}, fit)
    return module


def train(config, model: str, data: Dataset, seed: int, loss: str, transform=None):
    module = train_module(
        config, model, data.x_train, data.y_train, seed, loss, data.input_shape, data.nb_classes, transform
    )
    clf = make_classifier(
        module, data.input_shape, data.nb_classes, loss=loss, clip_values=data.clip_values, device=config.device
    )
    return clf, held_out_accuracy(clf, data)


def held_out_accuracy(clf, data: Dataset) -> float:
    return float(np.mean(clf.predict(data.x_test).argmax(axis=1) == data.y_test))


def audit(config, clf, data: Dataset, attacks, eps: float, seed: int, **overrides):
    params = {
        "top_fraction": config.top_fraction,
        "n_queries": config.n_queries,
        "n_bootstrap": config.n_bootstrap,
        "attack_max_iter": config.attack_max_iter,
        "device": config.device,
        **overrides,
    }
    params.setdefault("work_dir", getattr(config, "work_dir", None))  # its passes kept beside the run's weights
    estimator = MalleabilityEstimator(clf, attacks=attacks, eps=eps, seed=seed, verbose=False, **params)
    return estimator.evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)


#: Statistics of an attack result that the tables pool over seeds, and where each one's interval is.
POOLED = {
    "flip_rate": "flip_rate_ci",
    "flip_rate_null": None,
    "flip_rate_above_floor": "flip_rate_above_floor_ci",
    "excess_flip_rate": "excess_flip_rate_ci",
    "per_query_flip_rate": "per_query_flip_rate_ci",
    "spearman": "spearman_ci",
    "top_k_jaccard": "top_k_jaccard_ci",
}


def flip_rows(table: str, model: str, seed: int, accuracy: float, report, data: Dataset, extra: dict) -> list[dict]:
    """:return: One table row per attack of a report: every pooled statistic with its own interval."""
    flagged = bool(near_chance_warnings(accuracy, data.y_test, "test"))
    rows = []
    for r in report.results:
        row = {"table": table, "model": model, "seed": seed, "attack": r.attack}
        for stat, ci in POOLED.items():
            row[stat] = getattr(r, stat)
            if ci is not None:
                row[ci] = getattr(r, ci)
        control = r.control or {}
        row["control_flip_rate"], row["control_flip_rate_ci"] = control.get("flip_rate"), control.get("flip_rate_ci")
        rows.append({**row, "attack_success": r.attack_success, "clean_accuracy": accuracy, "near_chance": flagged,
                     **extra})
    return rows


def pooled(rows: list[dict], stat: str) -> tuple[float, float, float]:
    """
    Mean over the rows' seeds of a statistic, in percent, with a Student-t interval over the seeds
    (:func:`~art_malleability.metrics.seed_interval`: each seed's estimate carries its own query noise, counted
    once); a single seed keeps its own interval over queries.
    """
    rows = [r for r in rows if r.get(stat) is not None]
    if not rows:
        return float("nan"), float("nan"), float("nan")
    if len(rows) == 1:
        low, high = rows[0].get(stat + "_ci") or (None, None)
        as_float = [float("nan") if v is None else 100 * float(v) for v in (low, high)]
        return 100 * float(rows[0][stat]), as_float[0], as_float[1]
    bounds = (-1.0, 1.0) if stat in ("excess_flip_rate", "spearman") else (0.0, 1.0)
    points = np.array([r[stat] for r in rows], dtype=np.float64)
    mean, (low, high) = seed_interval(points, 0.95, bounds, within=[_own_error(r, stat) for r in rows])
    return 100 * mean, 100 * low, 100 * high


def _own_error(row: dict, stat: str) -> float:
    """A seed's own standard error over its queries, from its 95 % interval: the wider side (the other may be clipped
    at the statistic's range) over ``z``; ``NaN`` without one."""
    interval = row.get(stat + "_ci") or (None, None)
    if any(v is None for v in interval):
        return float("nan")
    low, high = (float(v) for v in interval)
    return max(high - float(row[stat]), float(row[stat]) - low) / z_value(0.95)


def paired_gap(first: list[dict], second: list[dict], stat: str) -> tuple[float, float, float]:
    """
    Difference of a statistic between two models trained with the same seeds, in points, with a Student-t
    interval over the seeds' paired differences.
    """
    by_seed = {r["seed"]: r[stat] for r in second if r.get(stat) is not None}
    gaps = [r[stat] - by_seed[r["seed"]] for r in first if r.get(stat) is not None and r["seed"] in by_seed]
    if not gaps:
        return float("nan"), float("nan"), float("nan")
    mean, (low, high) = seed_interval(np.array(gaps, dtype=np.float64), 0.95, (-2.0, 2.0))
    return 100 * mean, 100 * low, 100 * high


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    values = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(values.mean())
    if values.size < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, values.size - 1) * values.std(ddof=1) / np.sqrt(values.size))
    return mean, mean - half, mean + half


#: How an interval that fills its statistic's whole range reads: nothing is decided (two seeds' t has 1 freedom).
WHOLE_RANGE = "undecided: the whole range"


def whole_range(low: float, high: float, bounds: tuple[float, float]) -> bool:
    """Whether ``[low, high]`` covers the statistic's whole range ``bounds``."""
    return bool(np.isfinite(low) and low <= bounds[0] and high >= bounds[1])


def fmt_ci(mean: float, low: float, high: float, digits: int, bounds: tuple[float, float] = (0.0, 100.0)) -> str:
    """Mean [interval]; the t-interval is clipped to the metric's range (a share cannot leave 0–100 %)."""
    if not np.isfinite(mean):
        return "n/a"
    if not np.isfinite(low):
        return f"{mean:.{digits}f}"
    low, high = max(low, bounds[0]), min(high, bounds[1])
    if whole_range(low, high, bounds):
        return f"{mean:.{digits}f} [{WHOLE_RANGE}]"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def progress(config, items, desc: str):
    return progress_bar(items, desc=desc, verbose=config.verbose, leave=False)


__all__ = [
    "ATTACKS",
    "POOLED",
    "paired_gap",
    "audit",
    "flip_rows",
    "fmt_ci",
    "whole_range",
    "WHOLE_RANGE",
    "held_out_accuracy",
    "mean_ci",
    "pooled",
    "progress",
    "train",
    "train_module",
]
