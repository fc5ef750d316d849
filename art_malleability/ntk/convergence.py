"""
NTK-convergence checker: is a model family in the kernel (lazy) regime at the widths one can afford?

For every width ``m`` and seed, a model is built, its empirical NTK ``K_m`` (traced over the logits,
float64) is compared with the analytic infinite-width kernel ``K_∞`` on the training points, and the
model is trained with each protocol. Three levels are reported separately, each metric with a
fitted width exponent (slope of ``log metric`` against ``log m``, least squares on the per-width means
over seeds) and a percentile bootstrap interval over seeds:

* **static** (at initialisation): ``kernel_error = ‖K_m − K_∞‖_F / ‖K_∞‖_F`` and the kernel alignment
  distance ``1 − ⟨K_m, K_∞⟩_F / (‖K_m‖_F ‖K_∞‖_F)``. Both fall like ``m^(-1/2)`` for any two-layer
  net: the empirical NTK at initialisation is an average of ``m`` i.i.d. terms whose mean is the limit.
* **spectral** (at initialisation): ``lambda_min_error = |1 − λ_min(K_m)/λ_min(K_∞)|``, the relative
  error of the top eigenvalue, the condition numbers, and the relative error of the kernel ridge
  predictor on the test points, ``K(x, X)(K + λI)⁻¹Y``. These see the small eigenvalues that the
  Frobenius distance hides.
* **dynamic** (after training): ``output_distance = ‖f_m − f_NTK‖_F`` on the test points, with
  ``f_NTK`` the kernel ridge regression on ``K_∞`` with the same one-hot targets and ridge (and its
  relative form), ``kernel_movement = ‖K_T − K_0‖_F / ‖K_0‖_F``, ``weight_movement = ‖W_T − W_0‖/‖W_0‖``;
  for gradient descent also ``linearised_distance``: the relative distance to the prediction of the
  linearised network trained by the same gradient descent from the same initial function,
  ``f_0(x) + K_∞(x, X) K_∞⁻¹ (I − (I − ηK_∞)^T)(Y − f_0(X))`` (per-output kernel). Unlike the kernel
  ridge predictor, this comparison accounts for the initial function, which does not vanish with width.

Protocols: ``"gd"``, full-batch gradient descent on ``½ Σ‖f(x) − onehot(y)‖²`` with learning rate
``η = lr_scale / λ_max(K_∞ / C)`` (the per-output limit kernel, so the linearised dynamics are stable
and every width uses the same step); ``"adam"``, the paper's protocol (Adam, lr 1e-3, batch 128,
L2 1e-3, cross-entropy), through :func:`art_malleability.models.training.train_model`.

Verdict per metric and per level (from the level's primary metric: ``kernel_error``,
``lambda_min_error``, ``kernel_movement`` per protocol): ``"converges"`` when the whole interval of the
width exponent lies below -0.1 (the distance falls at least like ``m^(-0.1)`` over the tested widths),
else ``"no convergence over the tested widths"``; ``lambda_min_ratio``, ``cond_empirical`` and
``test_accuracy`` are descriptive and get no verdict. There is never one merged verdict.

A training run whose objective (without its L2 term) ends above its value at initialisation, or non-finite, is
recorded as ``diverged``: it is listed in the report and logged, and its dynamic metrics are left out of the width
exponents (a diverging network is not in the kernel regime, and its distances, up to 1e84 for a 16-unit net under
a step sized for the limit kernel, would otherwise make the exponent, and the verdict, whatever they happen to be).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from art_malleability._utils.checks import labels_to_indices
from art_malleability._utils.io import json_ready, progress_bar
from art_malleability._utils.params import (
    CONFIDENCE,
    DEVICE,
    DISTINCT,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INTS,
    Rule,
    RuleTable,
    check_values,
    each_one_of,
    is_number,
    one_of,
)
from art_malleability._utils.torch_utils import no_tf32, resolve_device
from art_malleability.linalg.ridge import kernel_ridge_predict
from art_malleability.metrics import percentile_interval
from art_malleability.models.reference import CONTEXT, build_reference_model, is_transductive
from art_malleability.ntk.analytic import analytic_ntk
from art_malleability.ntk.convergence_report import LEVELS as LEVELS  # public path
from art_malleability.ntk.convergence_report import PRIMARY as PRIMARY  # public path
from art_malleability.ntk.convergence_report import ConvergenceReport, WidthFit, kept_records
from art_malleability.ntk.empirical import empirical_ntk

logger = logging.getLogger(__name__)

PROTOCOLS = ("gd", "adam")
STATIC_METRICS = ("kernel_error", "alignment_distance")
SPECTRAL_METRICS = ("lambda_min_error", "lambda_min_ratio", "lambda_max_error", "cond_empirical", "predictor_error")
DYNAMIC_METRICS = (
    "output_distance",
    "relative_output_distance",
    "linearised_distance",
    "kernel_movement",
    "weight_movement",
    "test_accuracy",
)
CONVERGES = "converges"
NO_CONVERGENCE = "no convergence over the tested widths"
DESCRIPTIVE = "descriptive"
# metrics that describe rather than measure a distance to the limit: no verdict
DESCRIPTIVE_METRICS = ("lambda_min_ratio", "cond_empirical", "test_accuracy")
# a metric converges when the whole interval of its width exponent lies below this
CONVERGENCE_EXPONENT = -0.1

ModelFactory = Callable[[int, int], nn.Module]

#: Models whose infinite-width NTK the checker knows (MLP-Attn-QKV's trained attention has none).
NTK_MODELS = ("2l-relu", "mlp-attn")
_ntk_names = each_one_of(NTK_MODELS)
#: The models: reference models the checker builds by name, each of :data:`NTK_MODELS` (or a mapping of names to
#: factories).
NTK_MODEL_NAMES = Rule(
    f"name models of {NTK_MODELS} (MLP-Attn-QKV's trained attention has no infinite-width kernel here)",
    lambda vs: isinstance(vs, Mapping) or _ntk_names.test(vs), show=_ntk_names.show,
)
#: The widths: the width exponent is fitted over them.
TWO_WIDTHS = Rule("hold at least two distinct widths (the width exponent is fitted over them)",
                  lambda vs: len(set(vs)) >= 2)
#: The seeds: the intervals are over them.
TWO_SEEDS = Rule("hold at least two distinct seeds (the intervals are over them)", lambda vs: len(set(vs)) >= 2)
#: The gradient-descent step as a multiple of ``1 / λ_max``: the linearised dynamics are stable below 2.
GD_LR_SCALE = Rule("lie in (0, 2), where the linearised gradient descent is stable",
                   lambda v: is_number(v) and 0 < v < 2, float)

#: Every setting of :class:`NTKConvergenceChecker` and its rule, in the manner of scikit-learn's
#: ``_parameter_constraints``: the constructor and the command line's ``ntk-check`` check through it.
CHECKER_RULES: RuleTable = {
    "models": (NTK_MODEL_NAMES, DISTINCT),
    "attention_context": CONTEXT,
    "widths": (POSITIVE_INTS, TWO_WIDTHS, DISTINCT),
    "seeds": (TWO_SEEDS, DISTINCT),
    "protocols": each_one_of(PROTOCOLS),
    "ridge": POSITIVE,
    "gd_steps": POSITIVE_INT,
    "gd_lr_scale": GD_LR_SCALE,
    "adam_epochs": POSITIVE_INT,
    "adam_lr": POSITIVE,
    "adam_weight_decay": NON_NEGATIVE,
    "adam_batch_size": POSITIVE_INT,
    "n_bootstrap": POSITIVE_INT,
    "confidence": CONFIDENCE,
    "device": DEVICE,
    "dtype": one_of((torch.float32, torch.float64), "be torch.float32 or torch.float64"),
}


class NTKConvergenceChecker:
    """
    Measure how close models of growing width come to their infinite-width NTK limit, at three levels
    reported separately (see the module documentation for every metric and the verdict rule).

    :param models: Mapping of a model name to a factory ``(width, seed) -> nn.Module``, or reference model
           names (``"2l-relu"``, ``"mlp-attn"``) built for the data's shape.
    :param attention_context: The attention context of MLP-Attn when ``models`` names it: ``"centred"`` (the
           model's default) or ``"gram"`` (the paper's literal :math:`C = X^\\top X`). The paper's non-convergence
           belongs to the Gram form; the centred form converges like the 2L-ReLU (docs/ntk.md).
    :param widths: Widths to test (at least two).
    :param seeds: Initialisation seeds (at least two, for the intervals).
    :param protocols: Training protocols of the dynamic level: ``"gd"`` and/or ``"adam"``; empty skips training.
    :param ridge: Ridge λ of the kernel predictors.
    :param gd_steps: Steps of full-batch gradient descent.
    :param gd_lr_scale: Gradient-descent step as a multiple of ``1 / λ_max`` of the per-output limit kernel (< 2).
    :param adam_epochs: Epochs of the Adam protocol (paper: 500).
    :param adam_lr: Adam learning rate (paper: 1e-3).
    :param adam_weight_decay: Adam L2 (paper: 1e-3).
    :param adam_batch_size: Adam batch size (paper: 128).
    :param analytic: Function ``(model, x1, x2) -> K_∞`` (default: :func:`~art_malleability.ntk.analytic.analytic_ntk`).
    :param n_bootstrap: Bootstrap resamples over seeds.
    :param confidence: Coverage of the intervals.
    :param device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    :param dtype: Dtype of models and kernels (float64 default; TF32 is disabled on CUDA).
    :param verbose: Progress bar over models × widths × seeds.
    """

    def __init__(
        self,
        models: Mapping[str, ModelFactory] | Sequence[str] = ("2l-relu", "mlp-attn"),
        attention_context: str = "centred",
        widths: Sequence[int] = (16, 64, 256, 1024, 4096),
        seeds: Sequence[int] = (0, 1, 2, 3, 4),
        protocols: Sequence[str] = ("gd", "adam"),
        ridge: float = 1e-3,
        gd_steps: int = 200,
        gd_lr_scale: float = 1.0,
        adam_epochs: int = 20,
        adam_lr: float = 1e-3,
        adam_weight_decay: float = 1e-3,
        adam_batch_size: int = 128,
        analytic: Callable[..., torch.Tensor] | None = None,
        n_bootstrap: int = 1000,
        confidence: float = 0.95,
        device: str = "auto",
        dtype: torch.dtype = torch.float64,
        verbose: bool = True,
    ) -> None:
        self.models = models
        self.attention_context = attention_context
        self.widths = list(widths)
        self.seeds = list(seeds)
        self.protocols = tuple(protocols)
        self.ridge = ridge
        self.gd_steps = gd_steps
        self.gd_lr_scale = gd_lr_scale
        self.adam_epochs = adam_epochs
        self.adam_lr = adam_lr
        self.adam_weight_decay = adam_weight_decay
        self.adam_batch_size = adam_batch_size
        self.analytic = analytic or analytic_ntk
        self.n_bootstrap = n_bootstrap
        self.confidence = confidence
        self.device = device
        self.dtype = dtype
        self.verbose = verbose
        self._check_params()

    def _check_params(self) -> None:
        """Every setting through its rule (:data:`CHECKER_RULES`); the widths and seeds become lists of ints."""
        checked = check_values(CHECKER_RULES, {name: getattr(self, name) for name in CHECKER_RULES})
        self.widths, self.seeds = [int(w) for w in checked["widths"]], [int(s) for s in checked["seeds"]]

    def get_params(self) -> dict[str, Any]:
        """:return: The checker's settings, JSON-ready."""
        names = list(self.models) if not isinstance(self.models, Mapping) else list(self.models.keys())
        return {
            "models": names, "attention_context": self.attention_context, "widths": self.widths, "seeds": self.seeds,
            "protocols": list(self.protocols),
            "ridge": self.ridge, "gd_steps": self.gd_steps, "gd_lr_scale": self.gd_lr_scale,
            "adam_epochs": self.adam_epochs, "adam_lr": self.adam_lr, "adam_weight_decay": self.adam_weight_decay,
            "adam_batch_size": self.adam_batch_size, "n_bootstrap": self.n_bootstrap,
            "confidence": self.confidence, "device": str(resolve_device(self.device)),
            "dtype": str(self.dtype).replace("torch.", ""),
        }

    def run(
        self,
        x_train: np.ndarray,
        y_train: np.ndarray,
        x_test: np.ndarray,
        y_test: np.ndarray,
        dataset: str | None = None,
    ) -> ConvergenceReport:
        """
        Run every model at every width and seed.

        :param x_train: Training inputs ``(n, *input_shape)``; the kernels are compared on them.
        :param y_train: Training labels (indices or one-hot).
        :param x_test: Test inputs for the predictors and output distances.
        :param y_test: Test labels.
        :param dataset: Optional name of the data for the report.
        :return: A :class:`~art_malleability.ntk.convergence_report.ConvergenceReport`.
        """
        for name, x in (("x_train", x_train), ("x_test", x_test)):
            if not isinstance(x, np.ndarray) or x.ndim < 2 or len(x) == 0 or not np.all(np.isfinite(x)):
                got = type(x).__name__ if not isinstance(x, np.ndarray) else (
                    "NaN or infinite values" if x.ndim >= 2 and len(x) else f"shape {x.shape}"
                )
                raise ValueError(f"{name} must be a non-empty finite numpy array of shape (n, *input_shape), got {got}")
        y_train = labels_to_indices(y_train, "y_train")
        y_test = labels_to_indices(y_test, "y_test")
        if len(y_train) != len(x_train) or len(y_test) != len(x_test):
            raise ValueError(
                "y_train and y_test must have one label per row of x_train and x_test, got "
                f"{len(y_train)} and {len(y_test)} labels for {len(x_train)} and {len(x_test)} rows"
            )
        device = resolve_device(self.device)
        factories = self._factories(x_train.shape[1:], int(max(y_train.max(), y_test.max())) + 1)
        x_tr = torch.as_tensor(np.asarray(x_train, dtype=np.float64), device=device).to(self.dtype)
        x_te = torch.as_tensor(np.asarray(x_test, dtype=np.float64), device=device).to(self.dtype)
        records: list[dict[str, Any]] = []
        seconds: dict[str, float] = {}
        total = len(factories) * len(self.widths) * len(self.seeds)
        progress = progress_bar(total=total, desc="ntk-check", verbose=self.verbose)
        rng_state = torch.get_rng_state()
        try:
            with no_tf32(device):
                for name, factory in factories.items():
                    start = time.perf_counter()
                    limit = None
                    for width in self.widths:
                        for seed in self.seeds:
                            progress.set_postfix_str(f"{name} m={width} seed={seed}")
                            model = factory(width, seed).to(device=device, dtype=self.dtype).eval()
                            if is_transductive(model):
                                model.set_context(x_tr)
                            if limit is None:
                                limit = _Limit(self.analytic, model, x_tr, x_te, y_train, self.ridge)
                            records += self._measure(name, model, width, seed, limit, x_tr, x_te, y_train, y_test)
                            progress.update()
                    seconds[name] = time.perf_counter() - start
        finally:
            torch.set_rng_state(rng_state)
            progress.close()
        fits = self._fits(records, list(factories))
        report = ConvergenceReport(self.widths, self.seeds, self.get_params(), records, fits, seconds, dataset)
        if note := report.diverged_note():
            logger.warning(note)
        return report

    # ------------------------------------------------------------------------------------------ internals

    def _factories(self, input_shape: tuple[int, ...], nb_classes: int) -> dict[str, ModelFactory]:
        if isinstance(self.models, Mapping):
            return dict(self.models)
        return {
            name: partial(self._reference_model, name, input_shape, nb_classes) for name in self.models
        }

    def _reference_model(self, name: str, input_shape, nb_classes: int, width: int, seed: int) -> nn.Module:
        context = None if name == "2l-relu" else self.attention_context
        return build_reference_model(name, input_shape, nb_classes, width=width, seed=seed, context=context)

    def _measure(self, name, model, width, seed, limit, x_tr, x_te, y_train, y_test) -> list[dict[str, Any]]:
        base = {"model": name, "width": width, "seed": seed}
        k0 = empirical_ntk(model, x_tr).to(torch.float64)
        static = {**base, "level": "static", "protocol": None,
                  "kernel_error": _rel(k0 - limit.k_train, limit.k_train),
                  "alignment_distance": 1.0 - float((k0 * limit.k_train).sum() / (k0.norm() * limit.k_train.norm()))}
        eig0 = torch.linalg.eigvalsh(k0)
        k0_test = empirical_ntk(model, x_te, x_tr).to(torch.float64)
        pred0 = kernel_ridge_predict(k0, k0_test, limit.targets, self.ridge)
        ratio = float(eig0[0] / limit.eig[0])
        spectral = {**base, "level": "spectral", "protocol": None,
                    "lambda_min_error": abs(1.0 - ratio), "lambda_min_ratio": ratio,
                    "lambda_max_error": abs(1.0 - float(eig0[-1] / limit.eig[-1])),
                    "cond_empirical": float(eig0[-1] / eig0[0]) if eig0[0] > 0 else float("inf"),
                    "cond_limit": limit.cond, "predictor_error": _rel(pred0 - limit.krr_test, limit.krr_test)}
        rows = [static, spectral]
        for protocol in self.protocols:
            rows.append({**base, "level": "dynamic", "protocol": protocol,
                         **self._train_and_measure(protocol, model, seed, limit, k0, x_tr, x_te, y_train, y_test)})
        return rows

    def _train_and_measure(self, protocol, model, seed, limit, k0, x_tr, x_te, y_train, y_test) -> dict[str, Any]:
        trained = copy.deepcopy(model)
        params0 = [p.detach().clone() for p in trained.parameters() if p.requires_grad]
        with torch.no_grad():
            f0_train, f0_test = trained(x_tr).to(torch.float64), trained(x_te).to(torch.float64)
        loss_start = _training_loss(protocol, f0_train, limit.targets)
        if protocol == "gd":
            eta = self.gd_lr_scale / limit.lambda_max_per_output
            params = [p for p in trained.parameters() if p.requires_grad]
            optimizer = torch.optim.SGD(params, lr=eta)
            targets = limit.targets.to(x_tr.dtype)
            for _ in range(self.gd_steps):
                optimizer.zero_grad(set_to_none=True)
                loss = 0.5 * (trained(x_tr) - targets).pow(2).sum()
                loss.backward()
                optimizer.step()
            trained.eval()
        else:
            from art_malleability.models.training import train_model

            x_np = x_tr.detach().cpu().numpy()
            trained = train_model(trained, x_np, y_train, loss="cross_entropy", epochs=self.adam_epochs,
                                  batch_size=self.adam_batch_size, lr=self.adam_lr,
                                  weight_decay=self.adam_weight_decay, seed=seed, device=str(x_tr.device),
                                  verbose=False)
        with torch.no_grad():
            f_test = trained(x_te).to(torch.float64)
            loss_end = _training_loss(protocol, trained(x_tr).to(torch.float64), limit.targets)
        k_t = empirical_ntk(trained, x_tr).to(torch.float64)
        params_t = [p.detach() for p in trained.parameters() if p.requires_grad]
        moved = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(params_t, params0, strict=True)))
        size = math.sqrt(sum(float(b.pow(2).sum()) for b in params0))
        y_te = torch.as_tensor(y_test, device=f_test.device)
        out = {
            "output_distance": float((f_test - limit.krr_test).norm()),
            "relative_output_distance": _rel(f_test - limit.krr_test, limit.krr_test),
            "linearised_distance": None,
            "kernel_movement": _rel(k_t - k0, k0),
            "weight_movement": moved / size if size > 0 else None,
            "test_accuracy": float((f_test.argmax(1) == y_te).double().mean()),
            "train_loss_start": loss_start,
            "train_loss_end": loss_end,
            "diverged": not math.isfinite(loss_end) or loss_end > loss_start,
        }
        if protocol == "gd":
            f_lin = limit.linearised_gd(f0_train, f0_test, self.gd_lr_scale, self.gd_steps)
            out["linearised_distance"] = _rel(f_test - f_lin, f_lin)
        return out

    def _fits(self, records: list[dict[str, Any]], names: list[str]) -> list[WidthFit]:
        fits = []
        groups = [("static", None, STATIC_METRICS), ("spectral", None, SPECTRAL_METRICS)]
        groups += [("dynamic", p, DYNAMIC_METRICS) for p in self.protocols]
        for name in names:
            for level, protocol, metrics in groups:
                rows = kept_records(records, model=name, level=level, protocol=protocol)
                for metric in metrics:
                    table = np.full((len(self.widths), len(self.seeds)), np.nan)
                    for r in rows:
                        value = r.get(metric)
                        if value is not None:
                            table[self.widths.index(r["width"]), self.seeds.index(r["seed"])] = value
                    if np.all(np.isnan(table)):
                        continue
                    fits.append(self._fit(name, level, protocol, metric, table))
        return fits

    def _fit(self, name, level, protocol, metric, table: np.ndarray) -> WidthFit:
        log_w = np.log(np.asarray(self.widths, dtype=np.float64))
        slope = _log_slope(log_w, table)
        rng = np.random.default_rng(0)
        draws = []
        rows = np.arange(table.shape[0])[:, None]
        for _ in range(self.n_bootstrap):
            # widths are independent draws (seed s at two widths shares nothing), so resample each row alone
            cols = rng.integers(0, table.shape[1], table.shape)
            draws.append(_log_slope(log_w, table[rows, cols]))
        low, high = percentile_interval(np.asarray(draws), self.confidence)
        if metric in DESCRIPTIVE_METRICS:
            verdict = DESCRIPTIVE
        else:
            verdict = CONVERGES if np.isfinite(high) and high < CONVERGENCE_EXPONENT else NO_CONVERGENCE
        means = _nanmean_rows(np.where(np.isfinite(table), table, np.nan))
        return WidthFit(name, level, metric, protocol, slope, [low, high], verdict, json_ready(means))


class _Limit:
    """The infinite-width side of every comparison, computed once per model family."""

    def __init__(self, analytic, model, x_tr, x_te, y_train, ridge) -> None:
        with torch.no_grad():
            self.k_train = analytic(model, x_tr).to(torch.float64)
            self.k_test = analytic(model, x_te, x_tr).to(torch.float64)
            n_outputs = model(x_tr[:1]).shape[-1]
        self.n_outputs = n_outputs
        self.targets = torch.nn.functional.one_hot(torch.as_tensor(y_train, device=self.k_train.device),
                                                   n_outputs).to(torch.float64)
        self.eig = torch.linalg.eigvalsh(self.k_train)
        self.cond = float(self.eig[-1] / self.eig[0]) if self.eig[0] > 0 else float("inf")
        self.krr_test = kernel_ridge_predict(self.k_train, self.k_test, self.targets, ridge)
        # per-output kernel: the traced kernel's expectation splits equally over the outputs
        self.lambda_max_per_output = float(self.eig[-1]) / n_outputs
        self._eigh = None

    def linearised_gd(self, f0_train, f0_test, lr_scale, steps) -> torch.Tensor:
        """Test predictions of the linearised network after ``steps`` of gradient descent from ``f0``."""
        if self._eigh is None:
            self._eigh = torch.linalg.eigh(self.k_train / self.n_outputs)
        lam, q = self._eigh
        eta = lr_scale / self.lambda_max_per_output
        lam = lam.clamp_min(0.0)
        # K⁻¹(I − (I − ηK)^T) in the eigenbasis; its limit ηT as λ → 0 keeps it finite
        factor = torch.where(lam > 1e-300, (1 - (1 - eta * lam) ** steps) / lam.clamp_min(1e-300),
                             torch.full_like(lam, eta * steps))
        residual = self.targets - f0_train
        return f0_test + (self.k_test / self.n_outputs) @ (q @ (factor[:, None] * (q.T @ residual)))


def _nanmean_rows(table: np.ndarray) -> np.ndarray:
    counts = np.isfinite(table).sum(axis=1)
    sums = np.where(np.isfinite(table), table, 0.0).sum(axis=1)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _log_slope(log_w: np.ndarray, table: np.ndarray) -> float:
    with np.errstate(invalid="ignore", divide="ignore"):
        means = _nanmean_rows(np.where(table > 0, table, np.nan))
    keep = np.isfinite(means) & (means > 0)
    if keep.sum() < 2:
        return float("nan")
    return float(np.polyfit(log_w[keep], np.log(means[keep]), 1)[0])


def _training_loss(protocol: str, outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The protocol's training objective without its L2 term: ``½ Σ‖f − y‖²`` for GD, mean cross-entropy for Adam."""
    if protocol == "gd":
        return float(0.5 * (outputs - targets).pow(2).sum())
    return float(torch.nn.functional.cross_entropy(outputs, targets.argmax(1)))


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.norm())
    return float(diff.norm()) / denom if denom > 0 else float("nan")
