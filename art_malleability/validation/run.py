"""The retraining behind :func:`validate`: the full-data model, the subset models and the leave-one-out models."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from art_malleability._utils.checks import near_chance_warnings
from art_malleability._utils.io import progress_bar
from art_malleability._utils.params import (
    ALPHA,
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    LOSS,
    N_MODELS,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    SEED,
    RuleTable,
    check_values,
    is_int,
)
from art_malleability._utils.provenance import library_versions, weights_digest
from art_malleability._utils.state import preserved_rng
from art_malleability._utils.torch_utils import eval_mode, model_device_dtype
from art_malleability.influence import InfluenceEstimator, get_influence, per_example_loss
from art_malleability.influence.base import check_data
from art_malleability.influence.ridge_choice import DEFAULT_RIDGE
from art_malleability.validation.lds import OUTCOME, TrainFn, linear_datamodeling_score, sign_agreement, subset_sums
from art_malleability.validation.report import EstimatorFidelity, ValidationReport

logger = logging.getLogger(__name__)

#: The rules of :func:`validate`'s settings, checked before any training; the command line's ``validate`` checks its
#: options through the same rules (:data:`~art_malleability.cli.options.VALIDATE_OPTIONS`).
VALIDATE_RULES: RuleTable = {
    "n_models": N_MODELS,
    "alpha": ALPHA,
    "outcome": OUTCOME,
    "loo_queries": NON_NEGATIVE_INT,
    "loo_top": POSITIVE_INT,
    "loo_seeds": POSITIVE_INT,
    "seed": SEED,
    "loss": LOSS,
    "n_bootstrap": BOOTSTRAP_RESAMPLES,
    "confidence": CONFIDENCE,
}


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
    training subset as context (:func:`art_malleability.models.training.train_model` sets it). It gets private
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
    :raises InvalidParameterError: Naming the first setting its rule (:data:`VALIDATE_RULES`) refuses, before any
        training (a ``ValueError``).
    :raises ValueError: On a subset missing a class, or an untrained model.
    :raises TypeError: When ``train_fn`` returns something that is not an ``nn.Module``.
    :raises RuntimeError: When ``train_fn`` fails (the cause is chained).
    """
    _check_settings(train_fn, {
        "n_models": n_models, "alpha": alpha, "outcome": outcome, "loo_queries": loo_queries, "loo_top": loo_top,
        "loo_seeds": loo_seeds, "seed": seed, "loss": loss, "n_bootstrap": n_bootstrap, "confidence": confidence,
    })
    x, y, x_query, y_query = _check_arrays(x, y, x_query, y_query)
    named = [_named_estimator(e, projection_dim, seed, device) for e in estimators]
    if not named:
        raise ValueError("estimators must name at least one influence estimator, got none")
    with preserved_rng():
        return _Run(train_fn, x, y, x_query, y_query, outcome, loss, seed, verbose).execute(
            named, n_models, alpha, loo_queries, loo_top, loo_seeds, n_bootstrap, confidence, model_name, dataset
        )


def _check_settings(train_fn: object, settings: dict[str, Any]) -> None:
    """
    Check ``train_fn`` and the ``settings`` against :data:`VALIDATE_RULES`.

    :param train_fn: The training function.
    :param settings: :func:`validate`'s settings by name.
    :raises TypeError: When ``train_fn`` is not callable.
    :raises InvalidParameterError: Naming the first setting refused (a ``ValueError``).
    """
    if not callable(train_fn):
        raise TypeError(
            f"train_fn must be callable as train_fn(x_subset, y_subset, seed), got {type(train_fn).__name__}"
        )
    check_values(VALIDATE_RULES, settings)


def _check_arrays(
    x: np.ndarray, y: np.ndarray, x_query: np.ndarray, y_query: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:return: Checked private copies of the training and query data (float32 inputs, index labels)."""
    x, y = check_data(x, y, "x", "y")
    x_query, y_query = check_data(x_query, y_query, "x_query", "y_query")
    if x_query.shape[1:] != x.shape[1:]:
        raise ValueError(f"x_query must have input shape {x.shape[1:]} like x, got {x_query.shape[1:]}")
    return np.array(x, dtype=np.float32, copy=True), y, np.array(x_query, dtype=np.float32, copy=True), y_query


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
    ridge = getattr(estimator, "ridge", DEFAULT_RIDGE)
    suffix = "" if ridge == DEFAULT_RIDGE else f"-ridge-{ridge:g}" if not isinstance(ridge, str) else f"-ridge-{ridge}"
    if mode == "projected":
        requested = estimator.projection_dim
        return f"{name}-projected-k{requested if is_int(requested) else estimator.projection_dim_}{suffix}"
    if mode is not None:
        return f"{name}-{mode}{suffix}"
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
    if getattr(estimator, "ridge_", None) is not None:
        params["ridge_used"] = float(estimator.ridge_)
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
            raise RuntimeError(f"train_fn must train {what} (seed {seed}), got {type(err).__name__}: {err}") from err
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"train_fn must return the trained torch.nn.Module, got {type(model).__name__} for {what}"
            )
        x, y = (self.x, self.y) if index is None else (self.x[index], self.y[index])  # train_fn may change its copies
        logits = self.forward(model, x)
        if logits.ndim != 2 or logits.shape[1] <= int(max(self.y.max(), self.y_query.max())):
            raise ValueError(
                f"train_fn must return a model with logits of shape (n, C) with C > every label, got shape "
                f"{tuple(logits.shape)} for labels up to {int(max(self.y.max(), self.y_query.max()))}"
            )
        accuracy = float((logits.argmax(1).numpy() == y).mean())
        if near_chance_warnings(accuracy, y, "training"):
            raise ValueError(
                f"train_fn must return a trained model, got one that has not learnt its training data: {what} "
                f"(seed {seed}) has accuracy {100 * accuracy:.1f}% on its own {len(y)} training examples, close to "
                "chance; train it "
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
                f"alpha must give subsets of 1 <= round(alpha * n) < n of the {n} training examples, got {alpha}, "
                f"which gives {size}"
            )
        masks = np.zeros((n_models, n), dtype=bool)
        classes = np.unique(self.y)
        for m in range(n_models):
            masks[m, self.rng.choice(n, size=size, replace=False)] = True
            missing = np.setdiff1d(classes, self.y[masks[m]])
            if missing.size:
                count = int((self.y == missing[0]).sum())
                raise ValueError(
                    f"alpha must give subsets that hold every class, got {alpha}: subset {m} of {n_models} ({size} "
                    f"of {n} examples) holds no example of class {int(missing[0])} ({count} in y), so a model trained "
                    "on it cannot predict that class; use a larger alpha or more training examples of each class"
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
                    f"y must hold two or more examples of each class for the leave-one-out check, got one of class "
                    f"{int(self.y[i])} (training example {int(i)}); use more training examples of each class (or "
                    "loo_queries=0)"
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

