"""
Fidelity of influence estimators against retraining: the linear datamodeling score (LDS) and
leave-one-out sign agreement.

Influence scores claim to predict what retraining would do. :func:`validate` measures how well they
do, for any model that comes with a training function:

- **Linear datamodeling score** (Park et al., 2023, "TRAK"): ``n_models`` models are trained on
  random subsets ``S_1 … S_M`` of ``round(alpha · n)`` training examples (uniform, without
  replacement, each with its own seeded training run), and each query's outcome is measured on every
  one of them. With the package's convention (**positive = helpful**: removing the example would raise
  the query's loss), a linear datamodel predicts ``loss_q(S) ≈ c_q − Σ_{i∈S} τ(q, i)``, so the LDS of a
  query is the Spearman correlation, across the ``M`` subsets, between ``Σ_{i∈S_m} τ(q, i)`` and the
  measured ``−loss_q(S_m)`` (``outcome="loss"``) or the measured margin (``outcome="margin"``, where
  higher is better too). **Higher LDS = better** (1: the estimator ranks the subsets exactly as
  retraining does; 0: no better than chance). The reported LDS is the mean over queries, with a
  percentile bootstrap interval over queries.
- **Leave-one-out sign agreement**: for ``loo_queries`` queries and, per estimator, each query's
  ``loo_top`` training examples of largest ``|τ(q, i)|``, the model is retrained without the example
  with ``loo_seeds`` seeds, and the measured loss change ``mean_s [loss_q(without i, s) − loss_q(all, s)]``
  is compared with the predicted sign (``τ > 0`` predicts a rise). Reported: the share of pairs whose
  signs agree, with a Clopper–Pearson interval (pairs share queries and retrained models, so the
  interval is optimistic).

The influence being validated is computed on the model trained on the whole set with ``seed``; its
weights' digest is kept in the report (``model_digest``) so that an audit can state the fidelity of
exactly the model it audited.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.stats import binomtest, rankdata
from torch import nn

from art_malleability._io import atomic_write_files, json_ready, progress_bar
from art_malleability._state import preserved_rng
from art_malleability._torch_utils import eval_mode, model_device_dtype
from art_malleability._validation import check_loss
from art_malleability.estimator import library_versions, near_chance_warnings, weights_digest
from art_malleability.influence import InfluenceEstimator, get_influence, per_example_loss
from art_malleability.influence.base import check_data
from art_malleability.metrics import bootstrap_interval
from art_malleability.report import format_number_ci, format_percent, format_percent_ci, nan_if_none

logger = logging.getLogger(__name__)

#: Measured outcome of the retrained models: the query's loss or its margin.
OUTCOMES = ("loss", "margin")

#: ``train_fn(x_subset, y_subset, seed) -> trained model``; see :func:`validate`.
TrainFn = Callable[[np.ndarray, np.ndarray, int], nn.Module]


# ---------------------------------------------------------------------------------------------- LDS


@dataclass
class LDSResult:
    """
    Linear datamodeling score of one influence matrix.

    :param per_query: LDS of each query (``NaN`` where undefined: constant predictions or outcomes).
    :param mean: Mean over the queries where it is defined (``NaN`` when none is).
    :param ci: Percentile bootstrap interval of the mean over queries.
    :param n_defined: Number of queries with a defined LDS.
    """

    per_query: np.ndarray
    mean: float
    ci: tuple[float, float]
    n_defined: int


def subset_sums(scores: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """
    Influence summed over each subset: the linear datamodel's prediction (up to a constant).

    :param scores: Influence ``(n_query, n_train)``, positive = helpful.
    :param masks: Subset membership ``(n_models, n_train)``, boolean.
    :return: ``(n_models, n_query)`` array of ``Σ_{i∈S_m} τ(q, i)``.
    """
    return masks.astype(np.float64) @ np.asarray(scores, dtype=np.float64).T


def _column_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman correlation of each column of ``a`` with the same column of ``b`` (``NaN`` if one is constant)."""
    ra = rankdata(a, axis=0)
    rb = rankdata(b, axis=0)
    ra -= ra.mean(axis=0)
    rb -= rb.mean(axis=0)
    denom = np.sqrt((ra * ra).sum(axis=0) * (rb * rb).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = (ra * rb).sum(axis=0) / denom
    rho[denom == 0] = np.nan
    return np.clip(rho, -1.0, 1.0)


def linear_datamodeling_score(
    scores: np.ndarray,
    masks: np.ndarray,
    outcomes: np.ndarray,
    *,
    outcome: str = "loss",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> LDSResult:
    """
    Linear datamodeling score (TRAK's LDS) of an influence matrix against measured retraining outcomes.

    For each query ``q``: the Spearman correlation across the ``M`` subsets between the predicted
    ``Σ_{i∈S_m} τ(q, i)`` and the measured utility, ``−outcomes[m, q]`` for ``outcome="loss"`` (a
    helpful set lowers the loss) or ``outcomes[m, q]`` for ``outcome="margin"``. Higher is better. With
    ``outcome="loss"`` this equals dattri's ``dattri.metric.lds(scores.T, (−outcomes, subset_indices))``.

    :param scores: Influence ``(n_query, n_train)``, **positive = helpful** (removing the example would
        raise the query's loss).
    :param masks: Boolean subset membership ``(n_models, n_train)``, ``n_models >= 2``.
    :param outcomes: Measured outcomes ``(n_models, n_query)`` of the model trained on each subset.
    :param outcome: ``"loss"`` (lower is better) or ``"margin"`` (higher is better).
    :param n_bootstrap: Bootstrap resamples of the queries for the interval.
    :param confidence: Coverage of the interval.
    :param seed: Seed of the bootstrap.
    :return: Per-query LDS, their mean and its bootstrap interval.
    :raises ValueError: On mismatched shapes or an unknown ``outcome``.
    """
    scores = np.asarray(scores, dtype=np.float64)
    masks = np.asarray(masks)
    outcomes = np.asarray(outcomes, dtype=np.float64)
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    if scores.ndim != 2:
        raise ValueError(f"scores must have shape (n_query, n_train), got {scores.shape}")
    if masks.ndim != 2 or masks.dtype != bool or masks.shape[1] != scores.shape[1]:
        raise ValueError(
            f"masks must be a boolean array of shape (n_models, {scores.shape[1]}), got {masks.dtype} {masks.shape}"
        )
    if masks.shape[0] < 2:
        raise ValueError(f"masks must describe at least 2 subsets (n_models >= 2), got {masks.shape[0]}")
    if outcomes.shape != (masks.shape[0], scores.shape[0]):
        raise ValueError(
            f"outcomes must have shape (n_models, n_query) = {(masks.shape[0], scores.shape[0])}, got {outcomes.shape}"
        )
    utility = -outcomes if outcome == "loss" else outcomes
    per_query = _column_spearman(subset_sums(scores, masks), utility)
    defined = per_query[np.isfinite(per_query)]
    mean = float(defined.mean()) if defined.size else float("nan")
    ci = bootstrap_interval(
        lambda rows: float(defined[rows].mean()), defined.size, n_bootstrap=n_bootstrap, confidence=confidence,
        seed=seed,
    )
    return LDSResult(per_query=per_query, mean=mean, ci=(float(ci[0]), float(ci[1])), n_defined=int(defined.size))


def sign_agreement(predicted: np.ndarray, measured: np.ndarray, confidence: float = 0.95) -> dict[str, Any]:
    """
    Share of pairs whose measured change has the predicted sign, with a Clopper–Pearson interval.

    :param predicted: Predicted influence per pair (positive: removing the example raises the loss).
    :param measured: Measured loss change on removal per pair.
    :param confidence: Coverage of the interval.
    :return: ``{"rate", "ci", "n_agree", "n_pairs"}``; pairs where either value is exactly 0 are left out.
    """
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    keep = (predicted != 0) & (measured != 0) & np.isfinite(predicted) & np.isfinite(measured)
    n_pairs = int(keep.sum())
    n_agree = int((np.sign(predicted[keep]) == np.sign(measured[keep])).sum())
    if n_pairs == 0:
        return {"rate": None, "ci": [None, None], "n_agree": 0, "n_pairs": 0}
    interval = binomtest(n_agree, n_pairs).proportion_ci(confidence_level=confidence, method="exact")
    return {"rate": n_agree / n_pairs, "ci": [interval.low, interval.high], "n_agree": n_agree, "n_pairs": n_pairs}


# ------------------------------------------------------------------------------------------ report


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
class ValidationReport:
    """
    The result of :func:`validate`.

    :param model: Name of the validated model.
    :param dataset: Name of the data set, where known.
    :param model_digest: SHA-256 of the weights of the full-data model whose influence was validated
        (:func:`art_malleability.estimator.weights_digest`).
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
        self, first: str, second: str, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0
    ) -> tuple[float | None, list[float | None]]:
        """
        Paired difference of the mean LDS of two estimators over the same queries, with a bootstrap
        interval over queries (the estimators share subsets and outcomes, so the paired interval is
        narrower than comparing the two intervals).

        :param first: Estimator name.
        :param second: Estimator name.
        :param n_bootstrap: Bootstrap resamples.
        :param confidence: Coverage of the interval.
        :param seed: Seed of the bootstrap.
        :return: ``(mean LDS of first − mean LDS of second, [low, high])`` over queries where both are defined.
        """
        a = np.array([np.nan if v is None else v for v in self.results[first].lds_per_query], dtype=np.float64)
        b = np.array([np.nan if v is None else v for v in self.results[second].lds_per_query], dtype=np.float64)
        diff = (a - b)[np.isfinite(a) & np.isfinite(b)]
        if diff.size == 0:
            return None, [None, None]
        ci = bootstrap_interval(
            lambda rows: float(diff[rows].mean()), diff.size, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed
        )
        return float(diff.mean()), json_ready(list(ci))

    # ------------------------------------------------------------------ text
    def to_dict(self) -> dict[str, Any]:
        """:return: A JSON-ready dict."""
        return json_ready(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationReport:
        """:return: The report from :meth:`to_dict`'s output."""
        return cls(**data)

    def table(self) -> str:
        """:return: Markdown table: estimator, LDS [CI], LOO sign agreement [CI], pairs, queries."""
        lines = [
            "| estimator | LDS [95% CI] | LOO sign agreement [95% CI] | LOO pairs | queries (LDS defined) |",
            "|---|---|---|---|---|",
        ]
        for r in self.results.values():
            lines.append(
                f"| {r.estimator} | {format_number_ci(r.lds, r.lds_ci)} | "
                f"{format_percent_ci(r.loo_sign_agreement, r.loo_sign_agreement_ci)} | {r.n_loo_pairs} | "
                f"{r.n_queries_defined} |"
            )
        return "\n".join(lines)

    def differences_table(self) -> str:
        """:return: Markdown table of the paired LDS differences between every two estimators."""
        lines = ["| estimators | LDS difference [95% CI] |", "|---|---|"]
        for a, b in combinations(self.results, 2):
            mean, ci = self.lds_difference(a, b, seed=self.config.get("seed", 0))
            lines.append(f"| {a} − {b} | {format_number_ci(mean, ci)} |")
        return "\n".join(lines)

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
    def save(self, directory: str | os.PathLike) -> Path:
        """
        Write ``validation.json``, ``validation.md``, ``lds.png`` (LDS per estimator with intervals) and
        ``scatter.png`` (predicted vs measured for the example query) into a folder, atomically
        (``validation.json`` last).

        :param directory: Output folder (created if missing).
        :return: The folder.
        """
        import matplotlib.pyplot as plt

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        files: dict[str, str | bytes] = {"validation.md": self.to_markdown()}
        for name, draw in (("lds.png", self.plot_lds), ("scatter.png", self.plot_scatter)):
            figure = draw()
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
            plt.close(figure)
            files[name] = buffer.getvalue()
        files["validation.json"] = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        atomic_write_files(out, files)
        logger.info("Validation report written to %s", out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> ValidationReport:
        """
        :param path: A ``validation.json`` file or the folder holding it.
        :return: The report.
        """
        path = Path(path)
        if path.is_dir():
            path = path / "validation.json"
        if not path.is_file():
            raise FileNotFoundError(f"path {str(path)!r} holds no validation.json")
        return cls.from_dict(json.loads(path.read_text()))

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


# ---------------------------------------------------------------------------------------- validate


def validate(
    train_fn: TrainFn,
    x: np.ndarray,
    y: np.ndarray,
    x_query: np.ndarray,
    y_query: np.ndarray,
    estimators: Sequence[str | InfluenceEstimator] = ("ntk", "gradient", "captum"),
    n_models: int = 50,
    alpha: float = 0.5,
    outcome: str = "loss",
    loo_queries: int = 3,
    loo_top: int = 5,
    loo_seeds: int = 3,
    seed: int = 0,
    *,
    loss: str = "cross_entropy",
    projection_dim: int | str | None = "auto",
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    device: str | torch.device = "auto",
    model_name: str = "model",
    dataset: str | None = None,
    verbose: bool = True,
) -> ValidationReport:
    """
    Measure how well influence estimators predict retraining: the linear datamodeling score (LDS) and
    leave-one-out sign agreement (see the module docstring for the definitions and the sign convention).

    **The training function.** ``train_fn(x_subset, y_subset, seed)`` must build a *fresh* model, train it
    on the arrays it is given (float32 inputs ``(n, *input_shape)``, ``int64`` class indices) and return the
    trained :class:`torch.nn.Module` mapping inputs to ``(n, C)`` logits; the same ``seed`` must give the same
    model (initialisation and data order). A transductive model (with ``set_context``) must carry its
    training subset as context (:func:`art_malleability.training.train_model` sets it). It gets private
    copies of the arrays; the global random state is restored after the run. It is called
    ``1 + n_models + (loo_seeds − 1) + loo_seeds · |removed|`` times (``|removed|`` ≤ ``loo_queries · loo_top
    · len(estimators)``, the union of the estimators' top examples).

    The influence is computed on the model ``train_fn(x, y, seed)``; its queries' outcomes are measured
    with ``loss`` (``outcome="loss"``) or as the margin ``f_y − logsumexp_{c≠y} f_c`` (``outcome="margin"``,
    TRAK's model output). Subsets hold ``round(alpha · n)`` examples drawn uniformly without replacement;
    each subset model has its own seed.

    :param train_fn: ``train_fn(x_subset, y_subset, seed) -> trained nn.Module`` (see above).
    :param x: Training inputs ``(n, *input_shape)``.
    :param y: Training labels, class indices ``(n,)`` or one-hot.
    :param x_query: Query inputs ``(n_query, *input_shape)``, typically held-out points.
    :param y_query: Query labels.
    :param estimators: Influence estimators: names (``"ntk"``, ``"gradient"``, ``"captum"``) or
        :class:`~art_malleability.influence.InfluenceEstimator` instances (copied before fitting). Named in
        the report by their name, the NTK by its mode (``"ntk-exact"``, ``"ntk-projected-k512"``).
    :param n_models: Subset models of the LDS (>= 2; TRAK's protocol uses many more than 2).
    :param alpha: Share of the training set in each subset, in (0, 1).
    :param outcome: ``"loss"`` or ``"margin"``.
    :param loo_queries: Queries of the leave-one-out check (0 skips it).
    :param loo_top: Training examples per query and estimator, by largest ``|influence|``.
    :param loo_seeds: Training seeds averaged per removal (the first is ``seed``).
    :param seed: Seed of every random choice (subsets, their training seeds, LOO queries and seeds, bootstrap).
    :param loss: Loss of the ``"loss"`` outcome and of the LOO check, ``"cross_entropy"`` or ``"mse"``.
    :param projection_dim: ``projection_dim`` of an ``"ntk"`` given by name (its projection seed is ``seed``).
    :param n_bootstrap: Bootstrap resamples of the LDS interval.
    :param confidence: Coverage of the intervals.
    :param device: Device of the estimators given by name.
    :param model_name: Name of the model in the report.
    :param dataset: Name of the data set in the report.
    :param verbose: Show progress bars.
    :return: The :class:`ValidationReport`.
    :raises ValueError: On bad settings, a subset missing a class, or an untrained model.
    :raises TypeError: When ``train_fn`` returns something that is not an ``nn.Module``.
    :raises RuntimeError: When ``train_fn`` fails (the cause is chained).
    """
    _check_settings(train_fn, n_models, alpha, outcome, loo_queries, loo_top, loo_seeds, seed, loss)
    x, y = check_data(x, y, "x", "y")
    x_query, y_query = check_data(x_query, y_query, "x_query", "y_query")
    if x_query.shape[1:] != x.shape[1:]:
        raise ValueError(f"x_query must have input shape {x.shape[1:]} like x, got {x_query.shape[1:]}")
    x = np.array(x, dtype=np.float32, copy=True)
    x_query = np.array(x_query, dtype=np.float32, copy=True)
    named = [_named_estimator(e, projection_dim, seed, device) for e in estimators]
    if not named:
        raise ValueError("estimators must name at least one influence estimator")
    with preserved_rng():
        run = _Run(train_fn, x, y, x_query, y_query, outcome, loss, seed, verbose)
        return run.execute(
            named, n_models, alpha, loo_queries, loo_top, loo_seeds, n_bootstrap, confidence, model_name, dataset
        )


def _check_settings(
    train_fn: object, n_models: object, alpha: object, outcome: str, loo_queries: object, loo_top: object,
    loo_seeds: object, seed: object, loss: str,
) -> None:
    if not callable(train_fn):
        raise TypeError(
            f"train_fn must be callable as train_fn(x_subset, y_subset, seed), got {type(train_fn).__name__}"
        )
    if not _is_int(n_models) or n_models < 2:
        raise ValueError(
            f"n_models must be an integer >= 2 (the LDS correlates over the subset models), got {n_models!r}"
        )
    ok = isinstance(alpha, (int, float, np.integer, np.floating)) and not isinstance(alpha, bool)
    if not ok or not math.isfinite(float(alpha)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must lie strictly between 0 and 1 (the share of each subset), got {alpha!r}")
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    for name, value, minimum in (("loo_queries", loo_queries, 0), ("loo_top", loo_top, 1), ("loo_seeds", loo_seeds, 1)):
        if not _is_int(value) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not _is_int(seed):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    check_loss(loss)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _named_estimator(
    spec: str | InfluenceEstimator, projection_dim: int | str | None, seed: int, device: str | torch.device
) -> InfluenceEstimator:
    """A fresh estimator: by name, or a copy of the instance (the caller's is never fitted)."""
    if isinstance(spec, InfluenceEstimator):
        return type(spec)(**spec.get_params())
    if spec == "ntk":
        return get_influence("ntk", projection_dim=projection_dim, projection_seed=int(seed), device=device)
    return get_influence(spec, device=device)


def estimator_label(estimator: InfluenceEstimator) -> str:
    """
    Name of a fitted estimator in a validation report: its ``name``, the NTK with the mode that ran
    (``"ntk-exact"`` or ``"ntk-projected-k<dim>"``, with the requested projection dimension; the realised one,
    which can be a little smaller, is in the result's ``params``).

    :param estimator: A fitted influence estimator.
    :return: The label.
    """
    name = estimator.name or type(estimator).__name__
    mode = getattr(estimator, "mode_", None)
    if mode == "projected":
        requested = estimator.projection_dim
        return f"{name}-projected-k{requested if _is_int(requested) else estimator.projection_dim_}"
    if mode is not None:
        return f"{name}-{mode}"
    return name


def _params(estimator: InfluenceEstimator) -> dict[str, Any]:
    params = {
        k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
        for k, v in estimator.get_params().items()
    }
    params["class"] = type(estimator).__name__
    if getattr(estimator, "mode_", None) is not None:
        params["mode"] = estimator.mode_
        params["projection_dim_realised"] = getattr(estimator, "projection_dim_", None)
    return params


class _Run:
    """One validation run: the full-data model, its influence, the retrained models and the metrics."""

    def __init__(
        self, train_fn: TrainFn, x: np.ndarray, y: np.ndarray, x_query: np.ndarray, y_query: np.ndarray,
        outcome: str, loss: str, seed: int, verbose: bool,
    ) -> None:
        self.train_fn = train_fn
        self.x, self.y = x, y
        self.x_query, self.y_query = x_query, y_query
        self.outcome, self.loss, self.seed, self.verbose = outcome, loss, int(seed), verbose
        self.rng = np.random.default_rng(self.seed)
        self.seconds: dict[str, float] = {}

    # ------------------------------------------------------------------ training and measuring
    def train(self, index: np.ndarray | None, seed: int, what: str) -> nn.Module:
        """Train on the rows ``index`` (all when ``None``) and check that the result learnt something."""
        x = np.array(self.x if index is None else self.x[index], copy=True)
        y = np.array(self.y if index is None else self.y[index], copy=True)
        try:
            model = self.train_fn(x, y, int(seed))
        except Exception as err:
            raise RuntimeError(f"train_fn failed while training {what} (seed {seed}): {err}") from err
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"train_fn must return the trained torch.nn.Module, got {type(model).__name__} for {what}"
            )
        x, y = (self.x, self.y) if index is None else (self.x[index], self.y[index])  # train_fn may change its copies
        logits = self.forward(model, x)
        if logits.ndim != 2 or logits.shape[1] <= int(max(self.y.max(), self.y_query.max())):
            raise ValueError(
                f"the model from train_fn must return logits of shape (n, C) with C > every label, got shape "
                f"{tuple(logits.shape)} for labels up to {int(max(self.y.max(), self.y_query.max()))}"
            )
        accuracy = float((logits.argmax(1).numpy() == y).mean())
        if near_chance_warnings(accuracy, y, "training"):
            raise ValueError(
                f"train_fn returned a model that has not learnt its training data: {what} (seed {seed}) has "
                f"accuracy {100 * accuracy:.1f}% on its own {len(y)} training examples, close to chance; train it "
                "longer or with a larger learning rate (or check that train_fn returns the trained model)"
            )
        return model

    def forward(self, model: nn.Module, x: np.ndarray) -> torch.Tensor:
        device, dtype = model_device_dtype(model)
        with torch.no_grad(), eval_mode(model):
            outputs = [
                model(torch.as_tensor(x[s : s + 1024], device=device).to(dtype)).detach().cpu()
                for s in range(0, len(x), 1024)
            ]
        return torch.cat(outputs).to(torch.float64)

    def measure(self, model: nn.Module, rows: np.ndarray | None = None, kind: str | None = None) -> np.ndarray:
        """Outcome (``kind``: ``"loss"`` or ``"margin"``) of each query (or of the queries ``rows``)."""
        rows = np.arange(len(self.x_query)) if rows is None else rows
        logits = self.forward(model, self.x_query[rows])
        y = torch.as_tensor(self.y_query[rows])
        if (kind or self.outcome) == "loss":
            return per_example_loss(logits, y, self.loss).numpy()
        true = logits.gather(1, y[:, None]).squeeze(1)
        others = logits.scatter(1, y[:, None], float("-inf"))
        return (true - torch.logsumexp(others, dim=1)).numpy()

    # ------------------------------------------------------------------ the run
    def execute(
        self, estimators: list[InfluenceEstimator], n_models: int, alpha: float, loo_queries: int, loo_top: int,
        loo_seeds: int, n_bootstrap: int, confidence: float, model_name: str, dataset: str | None,
    ) -> ValidationReport:
        n = len(self.x)
        masks = self.draw_subsets(n_models, float(alpha))
        subset_seeds = self.rng.integers(0, 2**31 - 1, size=n_models)
        loo_rows = np.sort(self.rng.choice(len(self.x_query), size=min(loo_queries, len(self.x_query)), replace=False))
        seeds = [self.seed, *self.rng.integers(0, 2**31 - 1, size=loo_seeds - 1).tolist()]

        start = time.perf_counter()
        full = self.train(None, self.seed, "the full-data model")
        self.seconds["train_full"] = time.perf_counter() - start
        digest = weights_digest(full)
        accuracy = {
            "train": float((self.forward(full, self.x).argmax(1).numpy() == self.y).mean()),
            "queries": float((self.forward(full, self.x_query).argmax(1).numpy() == self.y_query).mean()),
        }
        warnings = []
        if near_chance_warnings(accuracy["queries"], self.y_query, "query"):
            warnings.append(
                f"the full-data model's accuracy on the queries ({100 * accuracy['queries']:.1f}%) is close to "
                "chance: the influence being validated describes a model that has learnt little"
            )
        scores, timings = self.influence(full, estimators)

        outcomes = self.retrain_subsets(masks, subset_seeds)
        removed, deltas, spread = self.leave_one_out(scores, loo_rows, loo_top, seeds, full)

        results = {}
        lds_by_name = {}
        for name, s in scores.items():
            lds_by_name[name] = linear_datamodeling_score(
                s, masks, outcomes, outcome=self.outcome, n_bootstrap=n_bootstrap, confidence=confidence,
                seed=self.seed,
            )
        example = _median_query(next(iter(lds_by_name.values())).per_query)
        for estimator, (name, s) in zip(estimators, scores.items(), strict=True):
            pairs = self.loo_pairs(s, loo_rows, loo_top, removed, deltas, spread)
            agreement = sign_agreement(
                [p["predicted"] for p in pairs], [p["measured"] for p in pairs], confidence=confidence
            )
            lds = lds_by_name[name]
            results[name] = EstimatorFidelity(
                estimator=name, params=_params(estimator), lds=lds.mean, lds_ci=list(lds.ci),
                lds_per_query=lds.per_query, n_queries_defined=lds.n_defined,
                loo_sign_agreement=agreement["rate"], loo_sign_agreement_ci=agreement["ci"],
                n_loo_pairs=agreement["n_pairs"], n_loo_agree=agreement["n_agree"], loo_pairs=pairs,
                example_predicted=subset_sums(s[example : example + 1], masks)[:, 0], seconds=timings[name],
            )
        if all(r.lds is None or r.lds < 0.2 for r in results.values()):
            warnings.append(
                "every estimator's LDS is below 0.2: none predicts the retrained models' outcomes well here "
                "(training noise or a non-linear response to the subsets dominates)"
            )
        config = {
            "n_models": int(n_models), "alpha": float(alpha), "subset_size": int(masks[0].sum()),
            "outcome": self.outcome, "loss": self.loss, "loo_queries": int(len(loo_rows)), "loo_top": int(loo_top),
            "loo_seeds": int(loo_seeds), "seed": self.seed, "n_bootstrap": int(n_bootstrap),
            "confidence": float(confidence),
        }
        return ValidationReport(
            model=model_name, dataset=dataset, model_digest=digest, config=config, results=results, n_train=n,
            n_queries=len(self.x_query), accuracy=accuracy,
            subsets=[np.flatnonzero(m).tolist() for m in masks], subset_seeds=subset_seeds.tolist(),
            outcomes=outcomes, loo_queries=loo_rows.tolist(), loo_removed=removed.tolist(), loo_seeds=seeds,
            example_query=example, seconds=self.seconds, versions=library_versions(), warnings=warnings,
        )

    def draw_subsets(self, n_models: int, alpha: float) -> np.ndarray:
        """``n_models`` uniform subsets of ``round(alpha · n)`` rows; each must hold every class of ``y``."""
        n = len(self.x)
        size = int(round(alpha * n))
        if not 1 <= size < n:
            raise ValueError(
                f"alpha = {alpha} gives subsets of {size} of the {n} training examples; choose alpha so that "
                "1 <= round(alpha * n) < n"
            )
        masks = np.zeros((n_models, n), dtype=bool)
        classes = np.unique(self.y)
        for m in range(n_models):
            masks[m, self.rng.choice(n, size=size, replace=False)] = True
            missing = np.setdiff1d(classes, self.y[masks[m]])
            if missing.size:
                count = int((self.y == missing[0]).sum())
                raise ValueError(
                    f"subset {m} of {n_models} (alpha = {alpha}, {size} of {n} examples) holds no example of "
                    f"class {int(missing[0])} ({count} in y); a model trained on it cannot predict that class. "
                    "Use a larger alpha or more training examples of each class"
                )
        return masks

    def influence(
        self, full: nn.Module, estimators: list[InfluenceEstimator]
    ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
        """Fit each estimator on the full-data model and score the queries."""
        scores: dict[str, np.ndarray] = {}
        timings: dict[str, dict[str, float]] = {}
        for estimator in progress_bar(estimators, desc="Influence", verbose=self.verbose):
            start = time.perf_counter()
            estimator.fit(full, self.x, self.y)
            fitted = time.perf_counter()
            s = estimator.scores(self.x_query, self.y_query)
            name = estimator_label(estimator)
            base, k = name, 2
            while name in scores:
                name, k = f"{base}-{k}", k + 1
            scores[name] = s
            timings[name] = {"fit": fitted - start, "scores": time.perf_counter() - fitted}
            logger.info("%s: influence in %.1f s", name, time.perf_counter() - start)
        return scores, timings

    def retrain_subsets(self, masks: np.ndarray, subset_seeds: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        outcomes = np.empty((len(masks), len(self.x_query)))
        for m in progress_bar(range(len(masks)), desc="LDS retraining", verbose=self.verbose):
            model = self.train(np.flatnonzero(masks[m]), int(subset_seeds[m]), f"subset model {m}")
            outcomes[m] = self.measure(model)
        self.seconds["retrain_lds"] = time.perf_counter() - start
        return outcomes

    def leave_one_out(
        self, scores: dict[str, np.ndarray], loo_rows: np.ndarray, loo_top: int, seeds: list[int], full: nn.Module
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """
        Retrain without each example in the union of the estimators' top sets, with every seed.

        :return: ``(removed, deltas, spread)``: removed training indices, the mean loss change on
            removal ``(len(removed), len(loo_rows))`` and its standard deviation over seeds.
        """
        start = time.perf_counter()
        if not len(loo_rows):
            self.seconds["retrain_loo"] = 0.0
            return np.zeros(0, dtype=np.int64), np.zeros((0, 0)), np.zeros((0, 0))
        removed = np.unique(np.concatenate([_top(s[q], loo_top) for s in scores.values() for q in loo_rows]))
        self._check_loo_classes(removed)
        baseline = np.empty((len(seeds), len(loo_rows)))
        for s, seed in enumerate(seeds):
            model = full if s == 0 else self.train(None, seed, "the full-data model for leave-one-out")
            baseline[s] = self.measure(model, loo_rows, "loss")
        changes = np.empty((len(removed), len(seeds), len(loo_rows)))
        jobs = [(j, s) for s in range(len(seeds)) for j in range(len(removed))]
        for j, s in progress_bar(jobs, desc="LOO retraining", verbose=self.verbose):
            keep = np.delete(np.arange(len(self.x)), removed[j])
            model = self.train(keep, seeds[s], f"the model without training example {removed[j]}")
            changes[j, s] = self.measure(model, loo_rows, "loss") - baseline[s]
        self.seconds["retrain_loo"] = time.perf_counter() - start
        spread = changes.std(axis=1, ddof=1) if len(seeds) > 1 else np.full(changes[:, 0].shape, np.nan)
        return removed, changes.mean(axis=1), spread

    def _check_loo_classes(self, removed: np.ndarray) -> None:
        counts = np.bincount(self.y)
        for i in removed:
            if counts[self.y[i]] == 1:
                raise ValueError(
                    f"training example {int(i)} is the only example of class {int(self.y[i])}; leaving it out "
                    "leaves a class without examples. Use more training examples of each class (or loo_queries=0)"
                )

    @staticmethod
    def loo_pairs(
        scores: np.ndarray, loo_rows: np.ndarray, loo_top: int, removed: np.ndarray, deltas: np.ndarray,
        spread: np.ndarray,
    ) -> list[dict[str, Any]]:
        position = {int(i): j for j, i in enumerate(removed)}
        pairs = []
        for k, q in enumerate(loo_rows):
            for i in _top(scores[q], loo_top):
                j = position[int(i)]
                pairs.append({
                    "query": int(q), "train_index": int(i), "predicted": float(scores[q, i]),
                    "measured": float(deltas[j, k]), "measured_sd": float(spread[j, k]),
                })
        return pairs


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``|row|`` (ties to the lower index)."""
    return np.argsort(-np.abs(row), kind="stable")[: min(k, len(row))]


def _median_query(per_query: np.ndarray) -> int:
    """Index of the query whose LDS is the (lower) median of the defined ones (0 when none is)."""
    finite = np.flatnonzero(np.isfinite(per_query))
    if finite.size == 0:
        return 0
    order = finite[np.argsort(per_query[finite], kind="stable")]
    return int(order[(len(order) - 1) // 2])


__all__ = [
    "OUTCOMES",
    "EstimatorFidelity",
    "LDSResult",
    "ValidationReport",
    "estimator_label",
    "linear_datamodeling_score",
    "sign_agreement",
    "subset_sums",
    "validate",
]
