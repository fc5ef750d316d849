"""
Results of a malleability audit: text table, JSON and Markdown writers, figures.

Undefined values (an interval from a single query, a flip rate of an empty set) are stored as
``None``, so a report survives a JSON round trip unchanged: ``MalleabilityReport.load(path) ==
report``. The JSON says why each ``null`` is one (``null_reasons``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, ClassVar

import numpy as np

from art_malleability._utils.io import json_ready
from art_malleability._utils.report_base import (
    SavedReport,
    format_number_ci,
    format_percent,
    format_percent_ci,
    markdown_table,
    nan_if_none,
    slugify,
    text_table,
    value_ci,
)
from art_malleability.audit._reading import (
    UNDECIDED_SHARE_LIMIT,
    UNDECIDED_WIDTH,
    axes,
    noise_aware_text,
    points_ci,
    undecided,
    wide_interval,
)
from art_malleability.audit._report_nulls import null_reasons
from art_malleability.audit.eps_sweep import FIGURE_NAME as EPS_FIGURE
from art_malleability.audit.eps_sweep import eps_series, eps_table, plot_flip_rate_against_eps
from art_malleability.audit.report_html import HTML_NAME, render_html
from art_malleability.metrics import ControlMetrics, MalleabilityMetrics

logger = logging.getLogger(__name__)

PERCENT_METRICS = ("flip_rate", "per_query_flip_rate", "top_k_jaccard", "attack_success")


def undecided_warning(shares: dict[str, tuple[float, tuple[float, float] | None]]) -> str:
    """
    The report's one warning on undecidable signs, for attacks whose set has more than ``UNDECIDED_WARNING`` of them
    (more than :data:`UNDECIDED_SHARE_LIMIT`, so their noise-aware rate reads undecided): it says why for each, an
    interval that is wide, or one whose low end this many undecidable signs make unreliable (its upper end is read).

    :param shares: The attacks it concerns, each with its ``undecided_share`` (a share of the influential set) and its
        noise-aware flip rate's interval (``None`` or NaN bounds where there is none).
    :return: One sentence naming them, with their shares.
    """
    which = ", ".join(f"{attack} {100 * share:.0f}%" for attack, (share, _) in shares.items())
    wide, narrow = [], []
    for attack, (_, interval) in shares.items():
        low, high = interval if interval is not None else (float("nan"), float("nan"))
        if not (math.isfinite(low) and math.isfinite(high)) or wide_interval([low, high]):
            wide.append(attack)
        else:
            narrow.append(f"{attack} [{100 * low:.1f}, {100 * high:.1f}]%")
    parts = []
    if wide:
        parts.append(f"its interval is wide or absent ({', '.join(wide)})")
    if narrow:
        parts.append(f"with this many undecidable signs its low end can stand above the truth, so only its upper "
                     f"end is read ({', '.join(narrow)})")
    return (
        f"a large share of the influential set has a perturbed aggregate within one standard error of zero ({which}), "
        "where the sign of the population aggregate can hardly be decided from these queries; the noise-aware flip "
        f"rate reads undecided there: {'; '.join(parts)} (docs/metrics.md); the raw flip rate is mostly noise "
        "(compare it with its 'by noise' value); the signed retention, a mean over the set, is the decided reading "
        "where it is reported; "
        "more queries (n_queries) decide more signs"
    )


@dataclass
class AttackResult:
    """
    Malleability of one attack, as ``report.json`` holds it (:meth:`from_metrics` builds it from the attack's
    :class:`~art_malleability.metrics.MalleabilityMetrics`).

    Influence scores are aggregated per training example (mean over queries), positive = helpful.

    :param attack: Attack label (``"fgsm"``, ``"pgd"``, ``"mim"`` or an attack class name).
    :param params: The attack's parameters.
    :param n_perturbed: Number of training examples perturbed.
    :param attack_success: Share of perturbed examples whose prediction changed (ART's ``compute_success``).
    :param max_perturbation: Largest ℓ∞ change of any perturbed example.
    :param flip_rate: The raw flip rate (the paper's): share of the clean top set whose measured aggregate influence
        changed sign. Query noise alone flips signs of aggregates near zero: read it against ``flip_rate_null``.
    :param flip_rate_ci: Normal interval with the bootstrap standard error over queries; estimand: the raw flip
        rate's expected value at this number of queries.
    :param per_query_flip_rate: Mean over queries of the flip rate within each query's own top set.
    :param per_query_flip_rate_ci: Student-t interval over queries (estimand: its population mean).
    :param spearman: Rank correlation of all scores before and after.
    :param spearman_ci: Delete-a-group jackknife interval over queries.
    :param top_k_jaccard: Jaccard overlap of the clean and perturbed top sets.
    :param top_k_jaccard_ci: Normal interval with the bootstrap standard error (estimand as the flip rate's).
    :param scores_after: Aggregate influence of each training example after the perturbation.
    :param seconds: Time of each step.
    :param flip_rate_above_floor: The noise-aware flip rate (key kept from earlier versions): the estimated share
        of the top set whose *population* aggregate (mean over infinitely many queries) changes sign, by
        empirical-Bayes deconvolution of the paired clean and perturbed aggregates
        (:func:`~art_malleability.metrics.noise_aware_flip_rate`).
    :param flip_rate_above_floor_ci: Its interval (profile likelihood of the prior's flip mass; includes 0 when the
        likelihood-ratio test of no flips does not reject).
    :param counted_flips: Members of the top set whose posterior probability of a sign change is at least 1/2.
    :param undecided_members: Members of the top set whose perturbed aggregate lies within one standard error of
        zero (those ``undecided_share`` counts).
    :param control: The random-perturbation control of the same examples at the same ℓ∞ budget (random signs at
        ``±eps``, clipped; ``draws`` independent sign draws, averaged): its ``eps``, ``draws``, ``flip_rate``,
        ``flip_rate_null``, ``flip_rate_above_floor``, ``spearman``, ``top_k_jaccard`` with intervals; ``None``
        without a control.
    :param excess_flip_rate: ``flip_rate`` minus the control's mean flip rate.
    :param excess_flip_rate_ci: Normal interval: the paired bootstrap variance over queries (the same resamples for
        both) plus the spread between the control's draws over their number.
    :param flip_rate_null: The raw flip rate expected by query noise alone (no population aggregate changing sign,
        magnitudes as the data show them).
    :param no_flip_statistic: Likelihood-ratio statistic of "no member of the top set flips" (``χ²₁`` scale).
    :param undecided_share: Share of the top set whose perturbed aggregate lies within one standard error of zero:
        their population sign is hard to decide from these queries, and the noise-aware rate's bias grows with it.
    :param signed_retention: How much of the top set's clean influence the perturbed influence keeps, on balance:
        ``Σ s_j μ_a,j / Σ s_j μ_b,j`` over the set, ``μ_b``/``μ_a`` the clean/perturbed population aggregates and
        ``s`` the measured clean signs (1: unchanged, 0: wiped out, below 0: reversed), estimated with the set's
        selection corrected (docs/metrics.md); a mean over the set, decided where single signs are not.
    :param signed_retention_ci: Its interval: the bootstrap variance over queries plus the empirical-Bayes error
        (docs/metrics.md states the estimand and the measured coverage).
    :param excess_retention: ``signed_retention`` minus the control's (below 0: the attack wipes out more influence
        than random signs of its size).
    :param excess_retention_ci: Normal interval, paired as the excess flip rate's.
    :param examples: The training examples behind the result (:mod:`~art_malleability.audit.examples`): the most
        influential members that flipped and that kept their sign, with their labels, clean and perturbed aggregate
        influence and clean and attacked inputs (small PNGs of image inputs, the values otherwise); ``None`` where not
        known (a rerun that reused the attack's pass without its examples).
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
    flip_rate_above_floor: float | None = None
    flip_rate_above_floor_ci: list[float | None] = field(default_factory=lambda: [None, None])
    counted_flips: list[int] = field(default_factory=list)
    undecided_members: list[int] = field(default_factory=list)
    control: dict[str, Any] | None = None
    excess_flip_rate: float | None = None
    excess_flip_rate_ci: list[float | None] = field(default_factory=lambda: [None, None])
    flip_rate_null: float | None = None
    no_flip_statistic: float | None = None
    undecided_share: float | None = None
    signed_retention: float | None = None
    signed_retention_ci: list[float | None] = field(default_factory=lambda: [None, None])
    excess_retention: float | None = None
    excess_retention_ci: list[float | None] = field(default_factory=lambda: [None, None])
    examples: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, json_ready(getattr(self, f.name)))

    @classmethod
    def from_metrics(cls, metrics: MalleabilityMetrics, control: dict[str, Any] | None = None,
                     **details: Any) -> AttackResult:
        """
        The result of one attack from its metrics.

        :param metrics: The attack's metrics against the clean influence (and its control, for the excesses).
        :param control: The control's summary (:func:`control_summary`), or ``None`` without a control.
        :param details: The fields that do not come from the metrics: ``attack``, ``params``, ``n_perturbed``,
            ``attack_success``, ``max_perturbation``, ``scores_after``, ``seconds``.
        :return: The result, its statistics under the keys of :meth:`MalleabilityMetrics.to_dict
            <art_malleability.metrics.MalleabilityMetrics.to_dict>`.
        """
        return cls(**details, control=control, **metrics.to_dict(replicates=False))


#: The control's statistics reported beside an attack, each with its interval (``<name>_ci``).
CONTROL_STATISTICS = ("flip_rate", "flip_rate_above_floor", "spearman", "top_k_jaccard", "signed_retention")


def control_summary(control: ControlMetrics, eps: float | None, perturbation: str) -> dict[str, Any]:
    """
    The random-sign control as :attr:`AttackResult.control` reports it.

    :param control: The control combined over its draws.
    :param eps: Its ℓ∞ budget.
    :param perturbation: What perturbed the examples (the control's label).
    :return: ``perturbation``, ``eps``, ``draws`` (their number), ``flip_rate_null`` and each of
        :data:`CONTROL_STATISTICS` with its interval.
    """
    statistics = control.to_dict(replicates=False)
    summary: dict[str, Any] = {"perturbation": perturbation, "eps": eps, "draws": control.n_draws,
                               "flip_rate_null": control.flip_rate_null}
    for name in CONTROL_STATISTICS:
        summary[name], summary[name + "_ci"] = statistics[name], statistics[name + "_ci"]
    return summary


@dataclass
class MalleabilityReport(SavedReport):
    """
    The result of :meth:`art_malleability.MalleabilityEstimator.evaluate`. :meth:`save` writes ``report.json``,
    ``report.md``, ``report.html`` (one self-contained page: :meth:`to_html`), ``flip_rates.png`` and one
    ``scatter_<attack>.png`` per attack; :meth:`load` reads it back.

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
    :param noise_model: How the noise-aware flip rate modelled the noise: the method and, for a projected
                        influence, the projection's noise ``sd = intercept + slope · |score|``, the seeds compared
                        and their agreement (``seed_agreement``: Spearman of the two seeds' clean aggregate scores
                        over all training examples and the Jaccard overlap of their top sets, shown in the title
                        line above every table).
    :param fidelity: When a validation of this model was given: the estimator's linear datamodeling score
                     against retraining (``lds``, ``lds_ci``), its leave-one-out sign agreement and the validation's
                     settings (see :mod:`art_malleability.validation`); ``None`` otherwise.
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
    noise_model: dict[str, Any] = field(default_factory=dict)
    fidelity: dict[str, Any] | None = None

    json_name: ClassVar[str] = "report.json"
    markdown_name: ClassVar[str] = "report.md"

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
        raise KeyError(f"attack must be one of {[r.attack for r in self.results]}, got {attack!r}")

    def to_dict(self) -> dict[str, Any]:
        """
        :return: A JSON-ready dict of the whole report (bootstrap replicates left out), with ``null_reasons``: the
            path of every ``null`` in it (``"results[0].flip_rate_ci[1]"``) to the reason it is ``null``.
        """
        data = asdict(self)
        data["null_reasons"] = null_reasons(data)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MalleabilityReport:
        """
        :param data: A dict written by :meth:`to_dict` (its ``null_reasons`` are derived, not stored).
        :return: The report.
        """
        return cls(**{k: v for k, v in data.items() if k != "null_reasons"})

    def summary(self) -> str:
        """
        :return: A plain-text table: attack; first what a mean over the influential set decides at any number of
                 queries, the signed retention [CI] with the random control's and the excess [CI]; then the paper's
                 raw flip rate [CI] with its expectation by query noise alone, the noise-aware flip rate [CI]
                 ("undecided [CI]" when its interval is wider than ``UNDECIDED_WIDTH``), the control's flip rate and
                 the excess flip rate [CI]; Spearman, top-k overlap, attack success.
        """
        lines = [self._title(), *text_table(self._header(), [_row(r) for r in self.results])]
        if self.fidelity is not None:
            lines.append(self._fidelity_line())
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _fidelity_line(self) -> str:
        f = self.fidelity or {}
        loo = f.get("loo_sign_agreement")
        lds = format_number_ci(f.get("lds"), f.get("lds_ci", [None, None]))
        return (
            f"influence fidelity ({f.get('estimator')}): LDS {lds} "
            f"against {f.get('n_models')} models retrained on {f.get('alpha')} of the data ({f.get('outcome')})"
            + ("" if loo is None else f"; leave-one-out sign agreement {format_percent(loo)}")
        )

    def to_markdown(self) -> str:
        """
        :return: The report's headline as Markdown: the title line, the warnings, one table row per attack (the
            budget sweep's table where eps is a list, the fidelity where known), and links to the sections of the
            self-contained page ``report.html`` (:meth:`to_html`), which holds the rest: figures, training examples,
            controls, noise model, settings, execution, time, versions and how to run it again.
        """
        sections = ", ".join(f"[{name}]({HTML_NAME}#{anchor})" for name, anchor in (
            ("figures", "figures"), ("training examples", "examples"), ("controls", "controls"),
            ("noise model", "noise-model"), ("plan and execution", "plan"), ("reproduce", "reproduce")))
        lines = [
            f"# Influence malleability: {self.model}",
            "",
            self._title(),
            "",
            *[f"> **Warning:** {w}\n" for w in self.warnings],
            f"The whole report is the page [{HTML_NAME}]({HTML_NAME}): {sections}. Influence scores: positive = "
            "helpful. *Retention*: how much of the clean top set's aggregate influence the perturbed influence keeps "
            "(1 unchanged, 0 wiped out, below 0 reversed); *flip rate*: the share of the set whose measured aggregate "
            "changes sign, *by noise* what query noise alone gives; *noise-aware*: the share whose population "
            f"aggregate changes sign, *undecided* where its interval is wider than {100 * UNDECIDED_WIDTH:.0f} "
            f"percentage points or the set has more than {100 * UNDECIDED_SHARE_LIMIT:.0f} % undecidable signs; "
            "*control*: random signs at the same budget, *excess*: attack minus control (docs/metrics.md: each "
            "estimand and its measured coverage).",
            "",
            markdown_table(self._header(), [_row(r) for r in self.results]),
        ]
        series = eps_series(self.results)
        if series:
            lines += ["", "## Flip rate against eps", "", eps_table(series, self.config.get("confidence", 0.95)),
                      "", f"![flip rate against eps]({EPS_FIGURE})"]
        if self.fidelity is not None:
            lines += ["", "## Influence fidelity", "", self._fidelity_line() + "."]
        return "\n".join(lines) + "\n"

    def _header(self) -> list[str]:
        conf = int(round(100 * self.config.get("confidence", 0.95)))
        return ["attack", f"retention [{conf}% CI]", "control", "excess [CI]", "flip rate [CI]", "by noise",
                "noise-aware [CI]", "control", "excess [CI]", "Spearman", "top-k Jaccard", "success"]

    def log_to_mlflow(self, run: Any = None) -> str:
        """
        Log the report to MLflow (the ``[mlflow]`` extra; :mod:`~art_malleability.audit.report_mlflow`): each attack's
        statistics with their intervals as metrics, the settings as parameters, a JSON summary table, and the JSON,
        Markdown, HTML and figures as artifacts.

        :param run: An MLflow run or its id; ``None``: the active run, or a new one when none is active.
        :return: The run's id.
        """
        from art_malleability.audit.report_mlflow import log_to_mlflow

        return log_to_mlflow(self, run)

    def to_html(self) -> str:
        """:return: The report as one self-contained HTML page (:mod:`~art_malleability.audit.report_html`)."""
        return render_html(self)

    def _side_files(self) -> dict[str, str | bytes]:
        """The figures as PNG, and the HTML page (``report.html``) with the same figures inline."""
        files = super()._side_files()
        files[HTML_NAME] = render_html(self, {name: png for name, png in files.items() if name.endswith(".png")})
        return files

    def _figures(self) -> dict[str, Any]:
        figures = {"flip_rates.png": self.plot_flip_rates}
        if eps_series(self.results):
            figures[EPS_FIGURE] = partial(plot_flip_rate_against_eps, self)
        figures.update({f"scatter_{slugify(r.attack)}.png": partial(self.plot_influence_scatter, r.attack)
                        for r in self.results})
        return figures

    def plot_flip_rates(self, ax: Any = None) -> Any:
        """
        Bar chart per attack: the raw flip rate (with a tick at its expectation by query noise alone), the
        noise-aware flip rate and the random-sign control's flip rate, each with its interval; a noise-aware rate the
        table reads as undecided has no bar, only its interval (hatched).

        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        ax = axes(ax, (1.4 + 1.6 * len(self.results), 3.4))
        labels = [r.attack for r in self.results]
        series = [
            ("flip rate", "tab:red", [(r.flip_rate, r.flip_rate_ci) for r in self.results]),
            ("noise-aware", "tab:orange", [(r.flip_rate_above_floor, r.flip_rate_above_floor_ci)
                                           for r in self.results]),
            ("random-sign control", "0.55", [
                (None, [None, None]) if r.control is None else (r.control["flip_rate"], r.control["flip_rate_ci"])
                for r in self.results
            ]),
        ]
        positions = np.arange(len(labels))
        width = 0.27
        top = 5.0
        for j, (name, color, values) in enumerate(series):
            x = positions + (j - 1) * width
            point = np.array([nan_if_none(v) for v, _ in values]) * 100
            low = np.array([nan_if_none(ci[0]) for _, ci in values]) * 100
            high = np.array([nan_if_none(ci[1]) for _, ci in values]) * 100
            # an undecided noise-aware rate (as the table reads it) gets no bar: its interval alone, hatched
            open_ = np.array([j == 1 and undecided(v, ci, r.undecided_share)
                              for (v, ci), r in zip(values, self.results, strict=True)], dtype=bool)
            if not open_.all():  # an empty call would still put the series in the legend, in a colour of its own
                ax.bar(x[~open_], np.nan_to_num(point[~open_]), width, color=color, alpha=0.85, label=name)
            if open_.any():
                ax.bar(x[open_], (high - low)[open_], width, bottom=low[open_], fill=False, hatch="//",
                       edgecolor=color, label=f"{name}: undecided (its interval)")
            ax.vlines(x, low, high, color="k", lw=1.0)
            if j == 0:
                null = np.array([nan_if_none(r.flip_rate_null) for r in self.results]) * 100
                ax.hlines(null, x - width / 2, x + width / 2, color="k", lw=2.0, linestyles=":",
                          label="flip rate by noise alone")
            finite = np.append(high[np.isfinite(high)], point[np.isfinite(point)])
            top = max(top, float(finite.max()) * 1.15 if finite.size else top)
        ax.set_xticks(positions, labels)
        ax.set_ylabel("influence flip rate (%)")
        ax.set_title(f"{self.model}: top {self.top_k} examples")
        ax.set_ylim(0, top)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return ax.figure

    def plot_influence_scatter(self, attack: str, ax: Any = None) -> Any:
        """
        Aggregate influence of each training example before vs after one attack; the clean top set coloured by what
        the audit decides of each member: a flip (red cross: posterior probability of a population sign change at
        least 1/2), undecided (gold: its perturbed aggregate within one standard error of zero), or a decided keep
        (blue); open circles mark the measured sign changes that query noise explains better.

        :param attack: Attack label.
        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        r = self.result(attack)
        ax = axes(ax, (4.2, 4.0))
        before = np.array([nan_if_none(v) for v in self.scores_before])
        after = np.array([nan_if_none(v) for v in r.scores_after])
        top = np.array(self.top_indices, dtype=int)
        flipped = top[np.sign(before[top]) * np.sign(after[top]) < 0]
        counted = np.array(r.counted_flips, dtype=int)
        open_ = np.setdiff1d(np.array(r.undecided_members, dtype=int), counted)
        kept = np.setdiff1d(top, np.union1d(counted, open_))
        within = np.setdiff1d(flipped, counted)
        ax.scatter(before, after, s=6, color="0.65", label="all training examples")
        ax.scatter(before[kept], after[kept], s=14, color="tab:blue", label=f"top set: decided keep ({len(kept)})")
        ax.scatter(before[open_], after[open_], s=14, color="goldenrod",
                   label=f"top set: undecided, within 1 SE of 0 ({len(open_)})")
        ax.scatter(before[counted], after[counted], s=22, color="tab:red", marker="x",
                   label=f"top set: decided flip ({len(counted)})")
        ax.scatter(before[within], after[within], s=30, facecolors="none", edgecolors="tab:orange",
                   label=f"measured flips noise explains ({len(within)})")
        ax.axhline(0, color="k", lw=0.6)
        ax.axvline(0, color="k", lw=0.6)
        ax.ticklabel_format(style="sci", scilimits=(-2, 3))
        ax.set_xlabel("influence before (positive = helpful)")
        ax.set_ylabel(f"influence after {attack}")
        ax.set_title(f"{self.model}, {attack}")
        ax.legend(fontsize=7, loc="best")
        _scale_in_labels(ax)
        return ax.figure

    def _title(self) -> str:
        acc = format_percent(self.clean_accuracy)
        return (
            f"model {self.model}"
            + (f" on {self.dataset}" if self.dataset else "")
            + f"; influence {self.config.get('influence')}{self._ridge()}, {self.n_train} training examples, "
            f"{self.n_queries} queries ({self.query_source}), top {self.top_k}, eps {self.config.get('eps')}, "
            f"strategy {self.config.get('strategy')}; clean accuracy {acc}"
            + self._seed_agreement()
        )

    def _ridge(self) -> str:
        """The NTK's ridge, with the rule that chose it (empty for other estimators)."""
        used, asked = self.execution.get("ridge"), self.config.get("ridge")
        if used is None:
            return ""
        return f" (ridge {used:.3g}" + (f", chosen by {asked})" if isinstance(asked, str) else ")")

    def _seed_agreement(self) -> str:
        """How far a projected estimator's clean ranking is its own random draw (empty when deterministic)."""
        agreement = (self.noise_model or {}).get("seed_agreement")
        if not agreement:
            return ""
        return (
            f"; PROJECTED influence: two projection seeds agree with Spearman {agreement['spearman']:.2f} and top-set "
            f"Jaccard {agreement['top_k_jaccard']:.2f} (1 = the ranking is the model's, 0 = it is the projection's)"
        )


def comparison_table(reports: list[MalleabilityReport]) -> str:
    """
    Several audited models side by side, one row per model: for each attack the signed retention (decided at any
    number of queries), then the flip rate, each with its excess over the random-sign control where one ran.

    :param reports: Reports of the same attacks on different models.
    :return: Markdown table.
    """
    attacks = [r.attack for r in reports[0].results] if reports else []
    return markdown_table(
        ["model", "clean acc.", *[f"{a} retention" for a in attacks], *[f"{a} flip rate" for a in attacks]],
        [[rep.model, format_percent(rep.clean_accuracy),
          *[_retention_and_excess(rep.result(a)) for a in attacks],
          *[_flip_and_excess(rep.result(a)) for a in attacks]] for rep in reports],
    )


def _retention_and_excess(r: AttackResult) -> str:
    text = format_number_ci(r.signed_retention, r.signed_retention_ci)
    if r.excess_retention is None:
        return text
    return f"{text}; excess {value_ci(r.excess_retention, r.excess_retention_ci, 1.0, '+.3f', '')}"


def _row(r: AttackResult) -> list[str]:
    return [
        r.attack,
        format_number_ci(r.signed_retention, r.signed_retention_ci),
        "n/a" if r.control is None else _number(r.control.get("signed_retention")),
        value_ci(r.excess_retention, r.excess_retention_ci, 1.0, "+.3f", ""),
        format_percent_ci(r.flip_rate, r.flip_rate_ci),
        format_percent(r.flip_rate_null),
        noise_aware_text(r.flip_rate_above_floor, r.flip_rate_above_floor_ci, r.undecided_share),
        "n/a" if r.control is None else format_percent(r.control["flip_rate"]),
        points_ci(r.excess_flip_rate, r.excess_flip_rate_ci),
        format_number_ci(r.spearman, r.spearman_ci),
        format_number_ci(r.top_k_jaccard, r.top_k_jaccard_ci),
        format_percent(r.attack_success),
    ]


def _number(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _flip_and_excess(r: AttackResult) -> str:
    text = format_percent_ci(r.flip_rate, r.flip_rate_ci)
    if r.excess_flip_rate is None:
        return text
    return f"{text}; excess {points_ci(r.excess_flip_rate, r.excess_flip_rate_ci)}"


def _scale_in_labels(ax: Any) -> None:
    """Each axis's scale (matplotlib's offset text, such as ``1e-5``, drawn where the x label is) moved into its
    label, so that the two never overlap."""
    ax.figure.canvas.draw()
    for axis in (ax.xaxis, ax.yaxis):
        offset = axis.get_offset_text()
        text = offset.get_text()
        if text:
            offset.set_visible(False)
            axis.set_label_text(f"{axis.get_label_text()} (× {text.replace('×', '').strip()})")
