"""
Steps shared by the paper's reproduction and the open-choices study: training a reference model under the
run's protocol, auditing it, turning a report into table rows, and pooling those rows over seeds.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from art_malleability._io import progress_bar
from art_malleability.datasets import Dataset
from art_malleability.estimator import MalleabilityEstimator, near_chance_warnings
from art_malleability.metrics import hierarchical_interval, hierarchical_replicates, shifted_percentile_interval
from art_malleability.models import build_reference_model
from art_malleability.training import make_classifier, train_model

ATTACKS = ("fgsm", "pgd", "mim")
#: Key of a row's in-memory bootstrap replicates (pooled over seeds in the tables, never saved).
REPLICATES = "_replicates"


def train_module(
    config, model: str, x: np.ndarray, y: np.ndarray, seed: int, loss: str, input_shape, nb_classes, transform=None
) -> torch.nn.Module:
    module = build_reference_model(model, input_shape, nb_classes, width=config.width, seed=seed)
    if transform is not None:
        module = transform(module)
    return train_model(
        module,
        x,
        y,
        loss=loss,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        weight_decay=config.weight_decay,
        seed=seed,
        device=config.device,
        verbose=False,
    )


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
    estimator = MalleabilityEstimator(clf, attacks=attacks, eps=eps, seed=seed, verbose=False, **params)
    return estimator.evaluate(data.x_train, data.y_train, data.x_test, data.y_test, dataset=data.name)


def flip_rows(table: str, model: str, seed: int, accuracy: float, report, data: Dataset, extra: dict) -> list[dict]:
    flagged = bool(near_chance_warnings(accuracy, data.y_test, "test"))
    rows = []
    for r in report.results:
        replicates = dict(r.replicates or {})
        rows.append(
            {
                "table": table,
                "model": model,
                "seed": seed,
                "attack": r.attack,
                "flip_rate": r.flip_rate,
                "flip_rate_above_floor": r.flip_rate_above_floor,
                "control_flip_rate": None if r.control is None else r.control["flip_rate"],
                "excess_flip_rate": r.excess_flip_rate,
                "per_query_flip_rate": r.per_query_flip_rate,
                "spearman": r.spearman,
                "top_k_jaccard": r.top_k_jaccard,
                "attack_success": r.attack_success,
                "clean_accuracy": accuracy,
                "near_chance": flagged,
                **extra,
                REPLICATES: replicates,
            }
        )
    return rows


def pooled(rows: list[dict], stat: str, seed: int = 0) -> tuple[float, float, float, np.ndarray | None]:
    """
    Mean over the rows' seeds of a statistic with its two-level bootstrap interval (in percent), and the pooled
    replicates (for differences between models); rows without replicates give a mean without interval.
    """
    rows = [r for r in rows if r.get(stat) is not None]
    if not rows:
        return float("nan"), float("nan"), float("nan"), None
    points = np.array([r[stat] for r in rows], dtype=np.float64)
    draws = [r.get(REPLICATES, {}).get(stat) for r in rows]
    if any(d is None or len(d) == 0 for d in draws) or len({len(d) for d in draws}) != 1:
        return 100 * float(points.mean()), float("nan"), float("nan"), None
    stacked, bounds = np.stack(draws), (-1.0 if stat == "excess_flip_rate" else 0.0, 1.0)
    replicates = hierarchical_replicates(stacked, 2000, seed)
    if np.isfinite(points).all():  # the replicates hierarchical_interval would draw again
        mean = float(points.mean())
        low, high = shifted_percentile_interval(mean, replicates, 0.95, bounds)
    else:
        mean, (low, high) = hierarchical_interval(points, stacked, 2000, 0.95, seed, bounds)
    return 100 * mean, 100 * low, 100 * high, 100 * replicates


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    values = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=np.float64)
    if values.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(values.mean())
    if values.size < 2:
        return mean, float("nan"), float("nan")
    half = float(stats.t.ppf(0.975, values.size - 1) * values.std(ddof=1) / np.sqrt(values.size))
    return mean, mean - half, mean + half


def fmt_ci(mean: float, low: float, high: float, digits: int, bounds: tuple[float, float] = (0.0, 100.0)) -> str:
    """Mean [interval]; the t-interval is clipped to the metric's range (a share cannot leave 0–100 %)."""
    if not np.isfinite(mean):
        return "n/a"
    if not np.isfinite(low):
        return f"{mean:.{digits}f}"
    low, high = max(low, bounds[0]), min(high, bounds[1])
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def progress(config, items, desc: str):
    return progress_bar(items, desc=desc, verbose=config.verbose, leave=False)


__all__ = [
    "ATTACKS",
    "REPLICATES",
    "audit",
    "flip_rows",
    "fmt_ci",
    "held_out_accuracy",
    "mean_ci",
    "pooled",
    "progress",
    "train",
    "train_module",
]
