"""
The report of :class:`art_malleability.ntk.convergence.NTKConvergenceChecker`: the width exponent and verdict of every
metric (:class:`WidthFit`) and the per-seed records, as text, Markdown, JSON and one log-log figure per level.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, ClassVar

import numpy as np

from art_malleability._utils.io import json_ready
from art_malleability._utils.report_base import SavedReport, markdown_table, text_table

LEVELS = ("static", "spectral", "dynamic")
PRIMARY = {"static": "kernel_error", "spectral": "lambda_min_error", "dynamic": "kernel_movement"}


def kept_records(records: list[dict[str, Any]], **where: Any) -> list[dict[str, Any]]:
    """
    The records that the fits and per-width means use: those matching every ``key=value`` of ``where`` whose training
    run did not diverge (a diverged run is not in the kernel regime whatever its distances).

    :param records: Records of :class:`ConvergenceReport`.
    :param where: Required values, e.g. ``model="2l-relu", protocol="gd"`` (a missing key reads as ``None``).
    :return: The matching records, in order.
    """
    return [r for r in records if not r.get("diverged") and all(r.get(k) == v for k, v in where.items())]


@dataclass
class WidthFit:
    """
    Width exponent of one metric for one model (and protocol, for dynamic metrics).

    :param model: Model name.
    :param level: ``"static"``, ``"spectral"`` or ``"dynamic"``.
    :param metric: Metric name.
    :param protocol: Training protocol for dynamic metrics, else ``None``.
    :param exponent: Least-squares slope of log(mean metric over seeds) against log(width).
    :param interval: Percentile bootstrap interval of the slope over seeds.
    :param verdict: ``"converges"`` or ``"no convergence over the tested widths"``.
    :param means: Mean of the metric over seeds at each width.
    """

    model: str
    level: str
    metric: str
    protocol: str | None
    exponent: float | None
    interval: list[float | None]
    verdict: str
    means: list[float | None]

    def __post_init__(self) -> None:
        self.exponent = json_ready(self.exponent)
        self.interval = json_ready(self.interval)
        self.means = json_ready(self.means)


@dataclass
class ConvergenceReport(SavedReport):
    """
    Result of :meth:`~art_malleability.ntk.convergence.NTKConvergenceChecker.run`: one record per (model, width,
    seed[, protocol]) and one :class:`WidthFit` per metric. :meth:`save` writes ``convergence.json``,
    ``convergence.md`` and one log-log figure per level that has results (``static.png``, ``spectral.png``,
    ``dynamic.png``); :meth:`load` reads it back.

    :param widths: Widths tested.
    :param seeds: Seeds tested.
    :param config: Checker settings.
    :param records: Rows with ``model``, ``width``, ``seed``, ``level``, ``protocol`` and metric values.
    :param fits: Width exponents and verdicts.
    :param seconds: Time per model.
    :param dataset: Name of the data, where known.
    """

    widths: list[int]
    seeds: list[int]
    config: dict[str, Any]
    records: list[dict[str, Any]]
    fits: list[WidthFit]
    seconds: dict[str, float] = field(default_factory=dict)
    dataset: str | None = None

    json_name: ClassVar[str] = "convergence.json"
    markdown_name: ClassVar[str] = "convergence.md"
    json_indent: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self.fits = [f if isinstance(f, WidthFit) else WidthFit(**f) for f in self.fits]
        self.records = json_ready(self.records)
        self.config = json_ready(self.config)
        self.seconds = json_ready(self.seconds)

    @property
    def models(self) -> list[str]:
        """:return: Model names, in order of appearance."""
        return list(dict.fromkeys(r["model"] for r in self.records))

    def level_verdicts(self) -> list[dict[str, Any]]:
        """:return: One row per (model, level[, protocol]) with the primary metric's exponent and verdict."""
        rows = []
        for f in self.fits:
            if f.metric == PRIMARY[f.level]:
                rows.append(
                    {
                        "model": f.model,
                        "level": f.level,
                        "protocol": f.protocol,
                        "metric": f.metric,
                        "exponent": f.exponent,
                        "interval": f.interval,
                        "verdict": f.verdict,
                    }
                )
        return rows

    def kept(self, **where: Any) -> list[dict[str, Any]]:
        """:return: The records matching ``where``, diverged runs left out (:func:`kept_records`)."""
        return kept_records(self.records, **where)

    def diverged_runs(self) -> list[dict[str, Any]]:
        """:return: The training runs whose loss ended above its start or non-finite, left out of the exponents."""
        return [{k: r.get(k) for k in ("model", "protocol", "width", "seed", "train_loss_start", "train_loss_end")}
                for r in self.records if r.get("diverged")]

    def diverged_note(self) -> str:
        """:return: One sentence naming the diverged runs, or ``""`` when none diverged."""
        runs = self.diverged_runs()
        if not runs:
            return ""
        groups: dict[tuple, list] = {}
        for r in runs:
            groups.setdefault((r["model"], r["protocol"], r["width"]), []).append(r["seed"])
        listed = "; ".join(f"{m} {p} m={w}: seeds {seeds}" for (m, p, w), seeds in groups.items())
        return (f"Diverged training runs (loss ended above its start or non-finite), left out of the dynamic "
                f"exponents: {listed}.")

    def summary(self) -> str:
        """:return: Plain-text table of every metric's width exponent, interval and verdict."""
        title = f"NTK convergence over widths {self.widths}, seeds {self.seeds}" + (
            f" on {self.dataset}" if self.dataset else ""
        )
        header = ["model", "level", "protocol", "metric", "exponent [CI]", "verdict"]
        rows = [[f.model, f.level, f.protocol or "-", f.metric, _slope(f), f.verdict] for f in self.fits]
        note = self.diverged_note()
        return "\n".join([title, *text_table(header, rows), *([note] if note else [])])

    def to_markdown(self) -> str:
        """:return: Markdown: verdict per level, all exponents, mean metric per width, settings."""
        header = ["model", "level", "protocol", "metric"]
        note = self.diverged_note()
        lines = [
            f"# NTK convergence check{' on ' + self.dataset if self.dataset else ''}",
            "",
            f"Widths {self.widths}; seeds {self.seeds}. Exponent: slope of log(metric) against log(width); "
            "interval: percentile bootstrap over seeds. Verdicts are per level, never merged.",
            "",
            "## Verdict per level (primary metric)",
            "",
            markdown_table(
                [*header, "exponent [CI]", "verdict"],
                [
                    [f.model, f.level, f.protocol or "-", f.metric, _slope(f), f.verdict]
                    for f in self.fits
                    if f.metric == PRIMARY[f.level]
                ],
            ),
            *(["", note] if note else []),
            "",
            "## Every metric",
            "",
            markdown_table(
                [*header, *[f"m={w}" for w in self.widths], "exponent [CI]", "verdict"],
                [
                    [
                        f.model,
                        f.level,
                        f.protocol or "-",
                        f.metric,
                        *["n/a" if v is None else f"{v:.4g}" for v in f.means],
                        _slope(f),
                        f.verdict,
                    ]
                    for f in self.fits
                ],
            ),
        ]
        lines += ["", "## Settings", ""] + [f"- `{k}`: `{v}`" for k, v in self.config.items()]
        lines += ["", "## Time (seconds)", ""] + [f"- {k}: {v:.1f}" for k, v in self.seconds.items()]
        for level in self._levels():
            lines += ["", f"![{level}]({level}.png)"]
        return "\n".join([*lines, ""])

    def to_dict(self) -> dict[str, Any]:
        """:return: JSON-ready dict."""
        return asdict(self)

    def _levels(self) -> list[str]:
        """:return: The levels with at least one fit, in the order of :data:`LEVELS`: one figure each."""
        return [level for level in LEVELS if any(f.level == level for f in self.fits)]

    def _figures(self) -> dict[str, Any]:
        return {f"{level}.png": partial(self.plot, level) for level in self._levels()}

    def plot(self, level: str) -> Any:
        """
        Log-log plot of each metric of one level against width: one line per model (and protocol),
        mean over seeds with the seeds' range as a band.

        :param level: ``"static"``, ``"spectral"`` or ``"dynamic"``.
        :return: The matplotlib figure.
        """
        import matplotlib.pyplot as plt

        metrics = list(dict.fromkeys(f.metric for f in self.fits if f.level == level))
        if not metrics:
            figure, _ = plt.subplots(figsize=(3, 2))
            return figure
        figure, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3.0), squeeze=False)
        labels = list(
            dict.fromkeys(f.model + (f" ({f.protocol})" if f.protocol else "") for f in self.fits if f.level == level)
        )
        colours = {label: f"C{i}" for i, label in enumerate(labels)}  # one colour per line in every panel
        for ax, metric in zip(axes[0], metrics, strict=True):
            for f in self.fits:
                if f.level != level or f.metric != metric:
                    continue
                rows = [
                    r
                    for r in self.records
                    if r["model"] == f.model and r["level"] == level and r.get("protocol") == f.protocol
                ]
                lows, highs = [], []
                for w in self.widths:
                    vals = [r[metric] for r in rows if r["width"] == w and r.get(metric) is not None]
                    lows.append(min(vals) if vals else np.nan)
                    highs.append(max(vals) if vals else np.nan)
                label = f.model + (f" ({f.protocol})" if f.protocol else "")
                means = [np.nan if v is None else v for v in f.means]
                ax.plot(self.widths, means, marker="o", label=label, color=colours[label])
                ax.fill_between(self.widths, lows, highs, color=colours[label], alpha=0.15)
            ax.set_xscale("log", base=2)
            if metric not in ("lambda_min_ratio", "test_accuracy"):
                ax.set_yscale("log")
            ax.set_xlabel("width m")
            ax.set_title(metric, fontsize=9)
            ax.legend(fontsize=6)
        figure.suptitle(f"{level} level", fontsize=10)
        figure.tight_layout()
        return figure


def _slope(f: WidthFit) -> str:
    if f.exponent is None:
        return "n/a"
    if f.interval[0] is None or f.interval[1] is None:
        return f"{f.exponent:+.2f}"
    return f"{f.exponent:+.2f} [{f.interval[0]:+.2f}, {f.interval[1]:+.2f}]"
