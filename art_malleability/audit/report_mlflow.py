"""
An audit's report logged to MLflow (the optional extra ``[mlflow]``), where a robustness evaluation's other results
are tracked: each attack's statistics with their intervals as metrics, the settings and what ran as parameters, a JSON
summary in MLflow's table layout, and the report's files (``report.json``, ``report.md``, ``report.html``, the
figures) as artifacts, in the active run, a given one, or a new one.

Metric names: ``<prefix><attack>.<statistic>`` with ``.low`` and ``.high`` for its interval (``fgsm.flip_rate``,
``fgsm.flip_rate.low``; an attack's label is written with ``_`` for characters MLflow does not take). A statistic
without a value (``null`` in the JSON) is not logged. Parameters: the audit's settings and ``model``, ``dataset``,
``n_train``, ``n_queries``, ``top_k``, ``mode`` and ``world_size`` (each value as text, cut to MLflow's 6,000
characters).
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from pathlib import Path
from typing import Any

#: What an attack's result is logged with: the statistic, and the key of its interval in the JSON (or ``None``).
METRICS: tuple[tuple[str, str | None], ...] = (
    ("flip_rate", "flip_rate_ci"),
    ("flip_rate_null", None),
    ("flip_rate_above_floor", "flip_rate_above_floor_ci"),
    ("undecided_share", None),
    ("signed_retention", "signed_retention_ci"),
    ("excess_retention", "excess_retention_ci"),
    ("excess_flip_rate", "excess_flip_rate_ci"),
    ("per_query_flip_rate", "per_query_flip_rate_ci"),
    ("spearman", "spearman_ci"),
    ("top_k_jaccard", "top_k_jaccard_ci"),
    ("attack_success", None),
    ("max_perturbation", None),
)
#: The longest parameter value MLflow keeps.
PARAM_CHARS = 6000
#: Where a run keeps a report's files among its artifacts.
ARTIFACT_FOLDER = "malleability"


def metric_name(text: str) -> str:
    """:return: ``text`` with every character MLflow does not take in a metric's name written ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-. /:]", "_", text)


def report_metrics(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """
    :param data: The report's JSON (:meth:`~art_malleability.audit.report.MalleabilityReport.to_dict`).
    :param prefix: Put before every name.
    :return: The metrics to log, by name (only numbers; a statistic without one is left out).
    """
    found: dict[str, float] = {}
    for result in data["results"]:
        base = metric_name(f"{prefix}{result['attack']}")
        for name, interval in METRICS:
            values = {name: result.get(name)}
            if interval is not None:
                low, high = result.get(interval) or [None, None]
                values.update({f"{name}.low": low, f"{name}.high": high})
            control = result.get("control") or {}
            if name in ("flip_rate", "signed_retention", "flip_rate_above_floor"):
                values[f"control.{name}"] = control.get(name)
            found.update({f"{base}.{key}": float(v) for key, v in values.items()
                          if isinstance(v, (int, float)) and math.isfinite(v)})
    return found


def summary_table(data: dict[str, Any]) -> dict[str, list]:
    """:return: One row per attack of the headline numbers, in MLflow's table layout (``columns`` and ``data``)."""
    columns = ["attack", *(name for name, _ in METRICS)]
    return {"columns": columns, "data": [[r["attack"], *(r.get(name) for name, _ in METRICS)] for r in data["results"]]}


def log_to_mlflow(report: Any, run: Any = None, prefix: str = "") -> str:
    """
    Log a report to MLflow.

    :param report: A :class:`~art_malleability.audit.report.MalleabilityReport`.
    :param run: An MLflow run or its id; ``None``: the active run, or a new one in the current experiment when none is
        active (ended before this returns).
    :param prefix: Put before every metric's name (the command line puts ``<model>.``).
    :return: The run's id.
    """
    import mlflow

    run_id = getattr(getattr(run, "info", None), "run_id", run)
    if run_id is None and mlflow.active_run() is not None:
        run_id = mlflow.active_run().info.run_id
    if run_id is None:
        with mlflow.start_run() as started:
            _log(mlflow.MlflowClient(), started.info.run_id, report, prefix)
            return started.info.run_id
    _log(mlflow.MlflowClient(), str(run_id), report, prefix)
    return str(run_id)


def _log(client: Any, run_id: str, report: Any, prefix: str) -> None:
    from mlflow.entities import Metric, Param

    from art_malleability._utils.report_base import setting_text, slugify

    data = report.to_dict()
    now = int(time.time() * 1000)
    metrics = [Metric(name, value, now, 0) for name, value in report_metrics(data, prefix).items()]
    params = {f"{prefix}{k}": v for k, v in data["config"].items() if k != "estimate"}
    params.update({f"{prefix}{k}": data.get(k) for k in ("model", "dataset", "n_train", "n_queries", "top_k")})
    params.update({f"{prefix}{k}": data["execution"].get(k) for k in ("mode", "world_size")})
    shown = [Param(name, setting_text(value)[:PARAM_CHARS]) for name, value in params.items()]
    for start in range(0, max(len(metrics), len(shown)), 100):  # MLflow takes at most 100 params in a batch
        client.log_batch(run_id, metrics=metrics[start : start + 100], params=shown[start : start + 100])
    folder = f"{ARTIFACT_FOLDER}/{slugify(report.model)}"
    client.log_dict(run_id, summary_table(data), f"{folder}/summary.json")
    with tempfile.TemporaryDirectory(prefix="art-malleability-mlflow-") as tmp:
        for name, content in report.rendered_files().items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(Path(tmp) / name, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as handle:
                handle.write(content)
        client.log_artifacts(run_id, tmp, folder)
