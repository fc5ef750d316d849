"""
Results of a malleability audit: text table, JSON and Markdown writers, figures.

Undefined values (an interval from a single query, a flip rate of an empty set) are stored as
``None``, so a report survives a JSON round trip unchanged: ``MalleabilityReport.load(path) ==
report``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from art_malleability._io import atomic_write_files, json_ready

logger = logging.getLogger(__name__)

PERCENT_METRICS = ("flip_rate", "per_query_flip_rate", "top_k_jaccard", "attack_success")


@dataclass
class AttackResult:
    """
    Malleability of one attack.

    Influence scores are aggregated per training example (mean over queries), positive = helpful.

    :param attack: Attack label (``"fgsm"``, ``"pgd"``, ``"mim"`` or an attack class name).
    :param params: The attack's parameters.
    :param n_perturbed: Number of training examples perturbed.
    :param attack_success: Share of perturbed examples whose prediction changed (ART's ``compute_success``).
    :param max_perturbation: Largest ℓ∞ change of any perturbed example.
    :param flip_rate: Share of the clean top set whose aggregate influence changed sign.
    :param flip_rate_ci: Bootstrap interval over queries.
    :param per_query_flip_rate: Mean over queries of the flip rate within each query's own top set.
    :param per_query_flip_rate_ci: Bootstrap interval over queries.
    :param spearman: Rank correlation of all scores before and after.
    :param spearman_ci: Bootstrap interval over queries.
    :param top_k_jaccard: Jaccard overlap of the clean and perturbed top sets.
    :param top_k_jaccard_ci: Bootstrap interval over queries.
    :param scores_after: Aggregate influence of each training example after the perturbation.
    :param seconds: Time of each step.
    """

    attack: str
    params: dict[str, Any]
    n_perturbed: int
    attack_success: float | None
    max_perturbation: float
    flip_rate: float | None
    flip_rate_ci: list[float | None]
    per_query_flip_rate: float | None
    per_query_flip_rate_ci: list[float | None]
    spearman: float | None
    spearman_ci: list[float | None]
    top_k_jaccard: float | None
    top_k_jaccard_ci: list[float | None]
    scores_after: list[float | None]
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, json_ready(getattr(self, f.name)))


@dataclass
class MalleabilityReport:
    """
    The result of :meth:`art_malleability.MalleabilityEstimator.evaluate`.

    :param model: Name of the audited model.
    :param config: The estimator's parameters.
    :param n_train: Number of audited training examples.
    :param n_queries: Number of query points.
    :param query_source: ``"test"`` (the given test points) or ``"train"`` (a sample of the training
                         set, self-pairs excluded).
    :param top_k: Size of the influential set.
    :param top_indices: Training indices of the clean influential set, most influential first.
    :param clean_accuracy: Accuracy of the classifier on the query points' source set.
    :param scores_before: Clean aggregate influence of each training example (positive = helpful).
    :param results: One :class:`AttackResult` per attack.
    :param seconds: Time of the shared steps.
    :param versions: Library versions.
    :param dataset: Name of the data set, where known.
    :param warnings: Things a reader must know before trusting the numbers (e.g. a model near chance).
    :param execution: What ran: the influence estimator's parameters and mode (``"exact"`` or
                      ``"projected"``, with the projection dimension, seed and per-layer dimensions), and
                      the process group (``world_size``, ``backend``).
    """

    model: str
    config: dict[str, Any]
    n_train: int
    n_queries: int
    query_source: str
    top_k: int
    top_indices: list[int]
    clean_accuracy: float | None
    scores_before: list[float | None]
    results: list[AttackResult]
    seconds: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    dataset: str | None = None
    warnings: list[str] = field(default_factory=list)
    execution: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [r if isinstance(r, AttackResult) else AttackResult(**r) for r in self.results]
        for f in fields(self):
            if f.name != "results":
                setattr(self, f.name, json_ready(getattr(self, f.name)))

    def result(self, attack: str) -> AttackResult:
        """
        The result of one attack.

        :param attack: Attack label.
        :return: The matching :class:`AttackResult`.
        """
        for r in self.results:
            if r.attack == attack:
                return r
        raise KeyError(f"attack {attack!r} not in this report; it holds {[r.attack for r in self.results]}")

    def to_dict(self) -> dict[str, Any]:
        """:return: A JSON-ready dict of the whole report."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MalleabilityReport:
        """
        :param data: A dict written by :meth:`to_dict`.
        :return: The report.
        """
        return cls(**data)

    def summary(self) -> str:
        """:return: A plain-text table: attack, flip rate [95 % CI], Spearman, top-k overlap, attack success."""
        conf = int(round(100 * self.config.get("confidence", 0.95)))
        header = ["attack", f"flip rate [{conf}% CI]", "per-query flip", "Spearman", "top-k Jaccard", "success"]
        rows = [header] + [_row(r) for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [self._title()]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """:return: The report as Markdown: settings, the table, timings and versions."""
        conf = int(round(100 * self.config.get("confidence", 0.95)))
        header = ["attack", f"flip rate [{conf}% CI]", "per-query flip", "Spearman", "top-k Jaccard", "success"]
        lines = [
            f"# Influence malleability: {self.model}",
            "",
            self._title(),
            "",
            *[f"> **Warning:** {w}\n" for w in self.warnings],
            "Influence scores have shape (n_query, n_train); positive = helpful (removing the training "
            "example would raise the query's loss). The flip rate is the share of the clean top set whose "
            "aggregate influence changes sign after the attack.",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        lines += ["| " + " | ".join(_row(r)) + " |" for r in self.results]
        lines += ["", "## Settings", ""]
        lines += [f"- `{k}`: `{v}`" for k, v in self.config.items()]
        lines += ["", "## Time (seconds)", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in self.seconds.items()]
        for r in self.results:
            lines += [f"- {r.attack} {k}: {v:.2f}" for k, v in r.seconds.items()]
        lines += ["", "## Versions", ""]
        lines += [f"- {k} {v}" for k, v in self.versions.items()]
        lines += ["", "![flip rates](flip_rates.png)", ""]
        lines += [f"![{r.attack}](scatter_{slugify(r.attack)}.png)" for r in self.results]
        return "\n".join(lines) + "\n"

    def save(self, directory: str | os.PathLike) -> Path:
        """
        Write ``report.json``, ``report.md`` and the figures into a folder. Everything is rendered
        and written to temporary files first, then renamed into place (``report.json`` last), so a
        save interrupted while rendering or writing leaves the previous report in the folder intact.

        :param directory: Output folder (created if missing).
        :return: The folder.
        """
        import io

        import matplotlib.pyplot as plt

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        files: dict[str, str | bytes] = {"report.md": self.to_markdown()}
        figures = [("flip_rates.png", self.plot_flip_rates)]
        figures += [
            (f"scatter_{slugify(r.attack)}.png", partial(self.plot_influence_scatter, r.attack)) for r in self.results
        ]
        for name, draw in figures:
            figure = draw()
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
            plt.close(figure)
            files[name] = buffer.getvalue()
        files["report.json"] = json.dumps(self.to_dict(), indent=2, allow_nan=False)  # renamed last
        atomic_write_files(out, files)
        logger.info("Report written to %s", out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> MalleabilityReport:
        """
        :param path: A ``report.json`` file or the folder holding it.
        :return: The report.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "report.json"
        if not path.is_file():
            raise FileNotFoundError(f"path {str(path)!r} holds no report.json")
        return cls.from_dict(json.loads(path.read_text()))

    def plot_flip_rates(self, ax: Any = None) -> Any:
        """
        Bar chart of the flip rate per attack with its interval.

        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        ax = _axes(ax, (1.2 + 1.1 * len(self.results), 3.2))
        labels = [r.attack for r in self.results]
        values = np.array([_nan(r.flip_rate) for r in self.results]) * 100
        low = np.array([_nan(r.flip_rate_ci[0]) for r in self.results]) * 100
        high = np.array([_nan(r.flip_rate_ci[1]) for r in self.results]) * 100
        positions = np.arange(len(labels))
        ax.bar(positions, np.nan_to_num(values), color="tab:red", alpha=0.8, tick_label=labels)
        # percentile intervals need not contain the estimate, so draw them as segments, not +- errors
        ax.vlines(positions, low, high, color="k", lw=1.2)
        ax.scatter(np.r_[positions, positions], np.r_[low, high], marker="_", s=80, color="k")
        ax.set_ylabel("influence flip rate (%)")
        ax.set_title(f"{self.model}: top {self.top_k} examples")
        ax.set_ylim(0, max(5.0, float(np.nanmax(np.append(high, values))) * 1.15 if values.size else 5.0))
        return ax.figure

    def plot_influence_scatter(self, attack: str, ax: Any = None) -> Any:
        """
        Aggregate influence of each training example before vs after one attack; the clean top set is
        highlighted and sign flips are marked.

        :param attack: Attack label.
        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        r = self.result(attack)
        ax = _axes(ax, (4.2, 4.0))
        before = np.array([_nan(v) for v in self.scores_before])
        after = np.array([_nan(v) for v in r.scores_after])
        top = np.array(self.top_indices, dtype=int)
        flipped = top[np.sign(before[top]) * np.sign(after[top]) < 0]
        ax.scatter(before, after, s=6, color="0.65", label="all training examples")
        ax.scatter(before[top], after[top], s=14, color="tab:blue", label=f"top {len(top)}")
        ax.scatter(before[flipped], after[flipped], s=22, color="tab:red", marker="x", label="sign flipped")
        ax.axhline(0, color="k", lw=0.6)
        ax.axvline(0, color="k", lw=0.6)
        ax.ticklabel_format(style="sci", scilimits=(-2, 3))
        ax.set_xlabel("influence before (positive = helpful)")
        ax.set_ylabel(f"influence after {attack}")
        ax.set_title(f"{self.model}, {attack}")
        ax.legend(fontsize=7, loc="best")
        return ax.figure

    def _title(self) -> str:
        acc = "n/a" if self.clean_accuracy is None else f"{100 * self.clean_accuracy:.1f}%"
        return (
            f"model {self.model}"
            + (f" on {self.dataset}" if self.dataset else "")
            + f"; influence {self.config.get('influence')}, {self.n_train} training examples, "
            f"{self.n_queries} queries ({self.query_source}), top {self.top_k}, eps {self.config.get('eps')}, "
            f"strategy {self.config.get('strategy')}; clean accuracy {acc}"
        )


def comparison_table(reports: list[MalleabilityReport]) -> str:
    """
    Flip rates of several audited models side by side, one row per model, one column per attack.

    :param reports: Reports of the same attacks on different models.
    :return: Markdown table.
    """
    attacks = [r.attack for r in reports[0].results] if reports else []
    lines = ["| model | clean acc. | " + " | ".join(f"{a} flip rate" for a in attacks) + " |"]
    lines.append("|---|---|" + "---|" * len(attacks))
    for rep in reports:
        acc = "n/a" if rep.clean_accuracy is None else f"{100 * rep.clean_accuracy:.1f}%"
        cells = [_percent_ci(rep.result(a).flip_rate, rep.result(a).flip_rate_ci) for a in attacks]
        lines.append(f"| {rep.model} | {acc} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(r: AttackResult) -> list[str]:
    return [
        r.attack,
        _percent_ci(r.flip_rate, r.flip_rate_ci),
        _percent(r.per_query_flip_rate),
        _number_ci(r.spearman, r.spearman_ci),
        _number_ci(r.top_k_jaccard, r.top_k_jaccard_ci),
        _percent(r.attack_success),
    ]


def _percent(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


def _percent_ci(v: float | None, ci: list[float | None]) -> str:
    if v is None:
        return "n/a"
    if ci[0] is None or ci[1] is None:
        return f"{100 * v:.1f}%"
    return f"{100 * v:.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def _number_ci(v: float | None, ci: list[float | None]) -> str:
    if v is None:
        return "n/a"
    if ci[0] is None or ci[1] is None:
        return f"{v:.3f}"
    return f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def _nan(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def slugify(name: str) -> str:
    """:return: ``name`` with every character outside letters, digits, ``-`` and ``_`` replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _axes(ax: Any, size: tuple[float, float]) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=size)
    return ax
