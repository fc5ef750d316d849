"""The result of :func:`art_malleability.validation.validate`: per-estimator fidelity, Markdown, JSON and figures."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from itertools import combinations
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
)
from art_malleability.metrics import t_interval

logger = logging.getLogger(__name__)


@dataclass
class EstimatorFidelity:
    """
    Fidelity of one influence estimator against retraining.

    :param estimator: Name in the report (e.g. ``"ntk-exact"``, ``"ntk-projected-k512"``, ``"gradient"``).
    :param params: The estimator's parameters (and, for the NTK, the mode that ran).
    :param lds: Mean LDS over queries (higher = better; ``None`` when undefined).
    :param lds_ci: Bootstrap interval of ``lds`` over queries.
    :param lds_per_query: LDS of each query (``None`` where undefined).
    :param n_queries_defined: Queries with a defined LDS.
    :param loo_sign_agreement: Share of leave-one-out pairs with the predicted sign.
    :param loo_sign_agreement_ci: Clopper–Pearson interval of that share.
    :param n_loo_pairs: Pairs counted.
    :param n_loo_agree: Pairs that agree.
    :param loo_pairs: Each pair: ``query`` (index into the queries), ``train_index``, ``predicted``
        (influence), ``measured`` (mean loss change on removal over the seeds), ``measured_sd`` (its
        standard deviation over the seeds).
    :param example_predicted: ``Σ_{i∈S_m} τ(q, i)`` for the report's example query, one per subset.
    :param seconds: Time to fit the estimator and score the queries.
    """

    estimator: str
    params: dict[str, Any]
    lds: float | None
    lds_ci: list[float | None]
    lds_per_query: list[float | None]
    n_queries_defined: int
    loo_sign_agreement: float | None
    loo_sign_agreement_ci: list[float | None]
    n_loo_pairs: int
    n_loo_agree: int
    loo_pairs: list[dict[str, Any]]
    example_predicted: list[float | None]
    seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, json_ready(getattr(self, f.name)))


@dataclass
class ValidationReport(SavedReport):
    """
    The result of :func:`validate`. :meth:`save` writes ``validation.json``, ``validation.md``, ``lds.png`` (LDS per
    estimator with intervals) and ``scatter.png`` (predicted vs measured for the example query); :meth:`load`
    reads it back.

    :param model: Name of the validated model.
    :param dataset: Name of the data set, where known.
    :param model_digest: SHA-256 of the weights of the full-data model whose influence was validated
        (``weights_digest`` of the package's report provenance).
    :param config: The run's settings (``n_models``, ``alpha``, ``outcome``, ``loss``, LOO sizes, ``seed``, …).
    :param results: Per estimator name, an :class:`EstimatorFidelity`.
    :param n_train: Training examples.
    :param n_queries: Queries.
    :param accuracy: Accuracy of the full-data model on its training set (``"train"``) and on the queries.
    :param subsets: Training indices of each subset model (sorted).
    :param subset_seeds: Seed passed to ``train_fn`` for each subset model.
    :param outcomes: Measured outcome (loss or margin, as ``config["outcome"]``) of each subset model on
        each query, ``(n_models, n_queries)``.
    :param loo_queries: Indices of the leave-one-out queries.
    :param loo_removed: Training indices retrained without (the union over estimators).
    :param loo_seeds: Seeds of the leave-one-out retraining (the first is ``seed``: the full-data model).
    :param example_query: Index of the query shown in the scatter figure.
    :param seconds: Time of each phase.
    :param versions: Library versions.
    :param warnings: Things a reader must know before trusting the numbers.
    """

    model: str
    dataset: str | None
    model_digest: str
    config: dict[str, Any]
    results: dict[str, EstimatorFidelity]
    n_train: int
    n_queries: int
    accuracy: dict[str, float | None]
    subsets: list[list[int]]
    subset_seeds: list[int]
    outcomes: list[list[float | None]]
    loo_queries: list[int]
    loo_removed: list[int]
    loo_seeds: list[int]
    example_query: int
    seconds: dict[str, float] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    json_name: ClassVar[str] = "validation.json"
    markdown_name: ClassVar[str] = "validation.md"
    json_indent: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self.results = {
            name: r if isinstance(r, EstimatorFidelity) else EstimatorFidelity(**r) for name, r in self.results.items()
        }
        for f in fields(self):
            if f.name != "results":
                setattr(self, f.name, json_ready(getattr(self, f.name)))

    # ------------------------------------------------------------------ access
    def fidelity(self, estimator_name: str) -> dict[str, Any] | None:
        """
        The headline fidelity of one estimator, small enough to quote in an audit report.

        :param estimator_name: A name in :attr:`results` (``"ntk-exact"``, ``"gradient"``, …), or a base
            name (``"ntk"``) when exactly one result carries it.
        :return: ``{"estimator", "lds", "lds_ci", "loo_sign_agreement", "n_models", "alpha", "outcome"}``, or
            ``None`` when the estimator was not validated.
        """
        result = self.results.get(estimator_name)
        if result is None:
            matches = [r for name, r in self.results.items() if name.split("-")[0] == estimator_name]
            result = matches[0] if len(matches) == 1 else None
        if result is None:
            return None
        return {
            "estimator": result.estimator,
            "lds": result.lds,
            "lds_ci": list(result.lds_ci),
            "loo_sign_agreement": result.loo_sign_agreement,
            "n_models": self.config["n_models"],
            "alpha": self.config["alpha"],
            "outcome": self.config["outcome"],
        }

    def lds_difference(
        self, first: str, second: str, confidence: float = 0.95
    ) -> tuple[float | None, list[float | None]]:
        """
        Paired difference of the mean LDS of two estimators over the same queries, with a Student-t interval over
        the queries' paired differences. It is conditional on the subset models, which both estimators share: it
        says whether one estimator predicts these retrainings better than the other, not how much either LDS would
        move with other subsets (the LDS's own interval resamples the models too).

        :param first: Estimator name.
        :param second: Estimator name.
        :param confidence: Coverage of the interval.
        :return: ``(mean LDS of first − mean LDS of second, [low, high])`` over queries where both are defined.
        """
        a = np.array([np.nan if v is None else v for v in self.results[first].lds_per_query], dtype=np.float64)
        b = np.array([np.nan if v is None else v for v in self.results[second].lds_per_query], dtype=np.float64)
        diff = (a - b)[np.isfinite(a) & np.isfinite(b)]
        if diff.size == 0:
            return None, [None, None]
        return float(diff.mean()), json_ready(list(t_interval(diff, confidence)))

    # ------------------------------------------------------------------ text
    def to_dict(self) -> dict[str, Any]:
        """:return: A JSON-ready dict."""
        return json_ready(asdict(self))

    def table(self) -> str:
        """:return: Markdown table: estimator, LDS [CI], LOO sign agreement [CI], pairs, queries."""
        return markdown_table(
            ["estimator", "LDS [95% CI]", "LOO sign agreement [95% CI]", "LOO pairs", "queries (LDS defined)"],
            [[r.estimator, format_number_ci(r.lds, r.lds_ci),
              format_percent_ci(r.loo_sign_agreement, r.loo_sign_agreement_ci), r.n_loo_pairs, r.n_queries_defined]
             for r in self.results.values()],
        )

    def differences_table(self) -> str:
        """:return: Markdown table of the paired LDS differences between every two estimators."""
        differences = [(a, b, *self.lds_difference(a, b))
                       for a, b in combinations(self.results, 2)]
        return markdown_table(["estimators", "LDS difference [95% CI]"],
                              [[f"{a} − {b}", format_number_ci(mean, ci)] for a, b, mean, ci in differences])

    def summary(self) -> str:
        """:return: A short text summary (title line and the table)."""
        return f"{self._title()}\n\n{self.table()}"

    def to_markdown(self) -> str:
        """:return: The report as Markdown."""
        c = self.config
        lines = [f"# Influence fidelity against retraining: {self.model}", "", self._title(), ""]
        if self.warnings:
            lines += ["## Warnings", ""] + [f"- {w}" for w in self.warnings] + [""]
        lines += ["## Results", "", self.table(), ""]
        if len(self.results) > 1:
            lines += ["Paired differences over the same queries:", "", self.differences_table(), ""]
        lines += [
            "LDS: mean over queries of the Spearman correlation, across the subset models, between the summed "
            f"influence of each subset and the measured {'−loss' if c['outcome'] == 'loss' else 'margin'} "
            "(higher = better; positive = helpful). LOO: share of (query, top example) pairs where the mean loss "
            "change on removal has the predicted sign (Clopper–Pearson interval; pairs are not independent).",
            "",
            "## Settings",
            "",
        ]
        lines += [f"- {k}: {v}" for k, v in c.items()]
        lines += [f"- model digest: {self.model_digest}", "", "## Seconds", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in self.seconds.items()]
        lines += ["", "## Versions", ""] + [f"- {k} {v}" for k, v in self.versions.items()]
        lines += ["", "![LDS per estimator](lds.png)", "", "![predicted vs measured](scatter.png)", ""]
        return "\n".join(lines)

    def _title(self) -> str:
        c = self.config
        train_acc = self.accuracy.get("train")
        query_acc = self.accuracy.get("queries")
        return (
            f"model {self.model}" + (f" on {self.dataset}" if self.dataset else "")
            + f"; {self.n_train} training examples, {self.n_queries} queries; {c['n_models']} models on "
            f"alpha = {c['alpha']} subsets, outcome {c['outcome']}; LOO: {c['loo_queries']} queries x top "
            f"{c['loo_top']} x {c['loo_seeds']} seeds; full-data model accuracy {format_percent(train_acc)} (train), "
            f"{format_percent(query_acc)} (queries)"
        )

    # ------------------------------------------------------------------ files
    def _figures(self) -> dict[str, Any]:
        return {"lds.png": self.plot_lds, "scatter.png": self.plot_scatter}

    # ------------------------------------------------------------------ figures
    def plot_lds(self) -> Any:
        """
        LDS per estimator with its bootstrap interval, beside the LOO sign agreement with its interval.

        :return: The matplotlib figure.
        """
        import matplotlib.pyplot as plt

        names = list(self.results)
        figure, (ax_lds, ax_loo) = plt.subplots(1, 2, figsize=(2.0 + 2.2 * len(names), 3.4))
        positions = np.arange(len(names))
        for ax, value, ci, label, ref in (
            (ax_lds, "lds", "lds_ci", "LDS (Spearman, higher = better)", 0.0),
            (ax_loo, "loo_sign_agreement", "loo_sign_agreement_ci", "LOO sign agreement", 0.5),
        ):
            values = np.array([nan_if_none(getattr(self.results[n], value)) for n in names])
            low = np.array([nan_if_none(getattr(self.results[n], ci)[0]) for n in names])
            high = np.array([nan_if_none(getattr(self.results[n], ci)[1]) for n in names])
            ax.bar(positions, np.nan_to_num(values), color="tab:blue", alpha=0.75)
            ax.vlines(positions, low, high, color="k", lw=1.2)
            ax.scatter(np.r_[positions, positions], np.r_[low, high], marker="_", s=80, color="k")
            ax.axhline(ref, color="0.4", lw=0.8, ls="--")
            ax.set_xticks(positions, names, rotation=20, ha="right", fontsize=8)
            ax.set_ylabel(label)
        ax_loo.set_ylim(0, 1)
        ax_lds.set_title(f"{self.model}: {self.config['n_models']} models, alpha {self.config['alpha']}")
        ax_loo.set_title(f"top {self.config['loo_top']} of {self.config['loo_queries']} queries")
        figure.tight_layout()
        return figure

    def plot_scatter(self) -> Any:
        """
        For the example query: the measured outcome of each subset model against each estimator's
        prediction ``Σ_{i∈S} τ(q, i)``.

        :return: The matplotlib figure.
        """
        import matplotlib.pyplot as plt

        names = list(self.results)
        figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
        q = self.example_query
        measured = np.array([nan_if_none(row[q]) for row in self.outcomes])
        utility = -measured if self.config["outcome"] == "loss" else measured
        for ax, name in zip(axes[0], names, strict=True):
            r = self.results[name]
            predicted = np.array([nan_if_none(v) for v in r.example_predicted])
            ax.scatter(predicted, utility, s=12, color="tab:blue")
            ax.ticklabel_format(style="sci", scilimits=(-2, 3))
            ax.set_xlabel("summed influence of the subset", fontsize=8)
            rho = r.lds_per_query[q]
            ax.set_title(f"{name}, query {q}: LDS {nan_if_none(rho):.2f}", fontsize=9)
        axes[0][0].set_ylabel(f"measured {'−loss' if self.config['outcome'] == 'loss' else 'margin'}")
        figure.tight_layout()
        return figure


