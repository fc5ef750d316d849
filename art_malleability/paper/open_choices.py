"""
The details the paper leaves open, tested rather than guessed.

For each open choice, :func:`run_open_choices` runs the alternatives on the same data and seeds and
reports the flip rates of 2L-ReLU and MLP-Attn (FGSM / PGD / MIM) and the ratio MLP-Attn / 2L-ReLU.
The *default* of each choice is the reading most faithful to the paper's text; the alternative whose
ratio comes closest to the paper's is marked separately — the two are not the same thing.

Choices and alternatives (default first):

* **influence**: ``ntk`` (kernel ridge leave-one-out on the empirical NTK, squared loss of the kernel
  predictor: the paper names an NTK leave-one-out estimate with (K + λI)⁻¹, which is kernel ridge
  regression); ``ntk-ce`` (the same predictor scored with cross-entropy); ``gradient`` (TracIn at the
  final weights, a different family).
* **top set**: ``abs`` (the most influential by magnitude: "most influential"); ``signed`` (most helpful).
* **ranking**: ``aggregate`` (mean over queries, then the top set); ``per-query`` (top set within each query).
  Both come from the same audits.
* **perturbed set**: ``top`` ("perturb training data" of the influential set, whose sign is then
  compared); ``all`` (every training example).
* **test-point attention** (MLP-Attn only): ``train`` (test points attend over the training set:
  x ↦ C_train x); ``train+test`` (the test points join the attention context, as a transductive model
  evaluated on its test batch would).
* **attack steps** (PGD/MIM): 20 (default), 10, 40 steps of 2.5·ε/steps.
* **init scale**: ``ntk`` (W ~ N(0, 1), the NTK parametrisation the paper analyses); ``pytorch``
  (W rescaled to PyTorch's default ``nn.Linear`` variance 1/(3d)).
* **input centring**: ``none`` (inputs as given); ``centred`` (the training-set mean image is subtracted
  before normalisation and attention, which removes the shared direction that dominates XᵀX).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from art_malleability._utils.output_folder import OutputFolder, staged_output
from art_malleability._utils.report_base import markdown_table
from art_malleability._utils.state import preserved_rng
from art_malleability.data.datasets import Dataset, load_dataset
from art_malleability.influence import NTKInfluence
from art_malleability.models.reference import is_transductive
from art_malleability.paper.common import ATTACKS, audit, flip_rows, fmt_ci, pooled, progress, train
from art_malleability.paper.reproduce import PAPER, Reproduction, ReproductionConfig

logger = logging.getLogger(__name__)

MODELS = ("2l-relu", "mlp-attn")


class _Wrapped(nn.Module):
    """A model with one fixed array beside it, kept as the float32 buffer ``array`` (it moves with the model)."""

    def __init__(self, inner: nn.Module, array: np.ndarray) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("array", torch.as_tensor(array, dtype=torch.float32))

    def _array_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.array.to(device=x.device, dtype=x.dtype)


class _Centred(_Wrapped):
    """A model applied to inputs minus a fixed mean image (its context, if any, is centred the same way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x - self._array_like(x))

    def set_context(self, x_train) -> None:
        if is_transductive(self.inner):
            x = torch.as_tensor(x_train)
            self.inner.set_context(x - self._array_like(x))


class _TestPointsInContext(_Wrapped):
    """A transductive model whose attention context always includes a fixed set of test points."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def set_context(self, x_train) -> None:
        x = torch.as_tensor(x_train)
        self.inner.set_context(torch.cat([x, self._array_like(x)]))


def _pytorch_init(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        d = module.hidden.weight.shape[1]
        module.hidden.weight.mul_((3.0 * d) ** -0.5)
    return module


def _choices(data: Dataset) -> list[tuple[str, str, bool, dict[str, Any]]]:
    """(choice, alternative, is_default, settings): settings hold estimator overrides and/or a model transform."""
    mean = data.x_train.mean(axis=0, keepdims=True)
    queries = data.x_test
    return [
        ("influence", "ntk (squared loss)", True, {}),
        ("influence", "ntk (cross-entropy)", False, {"audit": {"influence": NTKInfluence(loss="cross_entropy")}}),
        ("influence", "gradient (TracIn)", False, {"audit": {"influence": "gradient"}}),
        ("top set", "|score|", True, {}),
        ("top set", "signed", False, {"audit": {"rank_by": "signed"}}),
        ("ranking", "aggregate", True, {}),
        ("ranking", "per-query", False, {"metric": "per_query_flip_rate"}),
        ("perturbed set", "top set", True, {}),
        ("perturbed set", "all data", False, {"audit": {"strategy": "all"}}),
        ("attack steps", "20", True, {}),
        ("attack steps", "10", False, {"audit": {"attack_max_iter": 10}}),
        ("attack steps", "40", False, {"audit": {"attack_max_iter": 40}}),
        ("test-point attention", "training context", True, {}),
        ("test-point attention", "training + test context", False,
         {"transform": lambda m: _TestPointsInContext(m, queries), "models": ("mlp-attn",)}),
        ("init scale", "NTK N(0, 1)", True, {}),
        ("init scale", "PyTorch default variance", False, {"transform": _pytorch_init}),
        ("input centring", "none", True, {}),
        ("input centring", "training mean removed", False, {"transform": lambda m: _Centred(m, mean)}),
    ]


def run_open_choices(
    config: ReproductionConfig, output: str | Path | OutputFolder, folder: str = ""
) -> Reproduction:
    """
    Run every alternative of every open choice and write ``open_choices.md`` beside the study's
    ``reproduction.json`` and ``reproduction.md``.

    :param config: Settings (data, sizes, seeds, training protocol) shared with the reproduction.
    :param output: Output folder, or an open :class:`~art_malleability._utils.output_folder.OutputFolder` to stage in.
    :param folder: Subfolder of ``output`` for the study's files (``""``: ``output`` itself).
    :return: A :class:`~art_malleability.paper.reproduce.Reproduction` holding the rows and the table.
    """
    with staged_output(output, writer="reproduce") as out:
        result = _study(config)
        result.stage(out, folder)
    return result


def _study(config: ReproductionConfig) -> Reproduction:
    """Every alternative of every open choice, for both models and every seed: the rows and the table."""
    data = load_dataset(config.dataset, root=config.data_root, n_train=config.n_train, n_test=config.n_test, seed=0)
    family = "cifar10" if data.input_shape[0] == 3 else "mnist"
    result = Reproduction(asdict(config), family)
    rows: list[dict[str, Any]] = []
    baseline: dict[tuple[str, int], Any] = {}
    default_reports: dict[tuple[str, int], Any] = {}  # an audit is deterministic given its seed: run it once
    start = time.perf_counter()
    with preserved_rng():
        for choice, alternative, is_default, settings in _choices(data):
            for model in MODELS:
                for seed in progress(config, config.seeds, f"{choice}: {alternative} ({model})"):
                    transformed = "transform" in settings and model in settings.get("models", MODELS)
                    if transformed:
                        clf, acc = train(config, model, data, seed, "cross_entropy", settings["transform"])
                    else:
                        if (model, seed) not in baseline:
                            baseline[(model, seed)] = train(config, model, data, seed, "cross_entropy")
                        clf, acc = baseline[(model, seed)]
                    if transformed or settings.get("audit"):
                        report = audit(config, clf, data, ATTACKS, config.eps, seed, **settings.get("audit", {}))
                    else:
                        if (model, seed) not in default_reports:
                            default_reports[(model, seed)] = audit(config, clf, data, ATTACKS, config.eps, seed)
                        report = default_reports[(model, seed)]
                    metric = settings.get("metric", "flip_rate")
                    for row in flip_rows("open_choices", model, seed, acc, report, data, {}):
                        row.update(choice=choice, alternative=alternative, default=is_default,
                                   flip_rate=row[metric], flip_rate_ci=row.get(metric + "_ci"), metric=metric)
                        rows.append(row)
    result.rows = rows
    result.seconds["open_choices"] = time.perf_counter() - start
    result.tables["open_choices"] = _table(rows, PAPER["table2"][family], family, data, config)
    result.files["open_choices.md"] = result.tables["open_choices"] + "\n"
    return result


def _table(rows: list[dict], paper: dict, family: str, data: Dataset, config: ReproductionConfig) -> str:
    paper_ratio = {a: paper["mlp-attn"][a] / paper["2l-relu"][a] for a in ATTACKS}
    lines = [
        f"## Open choices: flip rates (%) on {data.name}, ε = {config.eps}, seeds {list(config.seeds)}", "",
        "Mean over seeds [95% Student-t interval over the seeds]. **default** = the reading "
        "most faithful to the paper's text; "
        "*closest* = the alternative whose mean MLP-Attn / 2L-ReLU ratio is nearest the paper's "
        f"({family}: " + ", ".join(f"{a} {paper_ratio[a]:.1f}" for a in ATTACKS) + ") on a log scale.", "",
    ]
    table = []
    choices = list(dict.fromkeys(r["choice"] for r in rows))
    for choice in choices:
        alternatives = list(dict.fromkeys(r["alternative"] for r in rows if r["choice"] == choice))
        distance = {}
        cells_by_alt = {}
        for alt in alternatives:
            sel = [r for r in rows if r["choice"] == choice and r["alternative"] == alt]
            cells, means = [], {}
            for model in MODELS:
                parts = []
                for attack in ATTACKS:
                    mean, low, high = pooled([r for r in sel if r["model"] == model and r["attack"] == attack],
                                                 "flip_rate")
                    means[(model, attack)] = mean
                    parts.append(fmt_ci(mean, low, high, 1))
                cells.append(" / ".join(parts))
            ratios = [means[("mlp-attn", a)] / means[("2l-relu", a)] if means[("2l-relu", a)] else float("nan")
                      for a in ATTACKS]
            finite = [abs(np.log(r / paper_ratio[a])) for r, a in zip(ratios, ATTACKS, strict=True)
                      if np.isfinite(r) and r > 0]
            distance[alt] = float(np.mean(finite)) if finite else float("inf")
            acc = [np.mean([r["clean_accuracy"] for r in sel if r["model"] == m]) for m in MODELS]
            cells_by_alt[alt] = (cells, " / ".join("n/a" if not np.isfinite(r) else f"{r:.2f}" for r in ratios),
                                 " / ".join(f"{100 * a:.1f}%" for a in acc), sel[0]["default"])
        closest = min(distance, key=distance.get) if distance else None
        for alt in alternatives:
            cells, ratio, acc, is_default = cells_by_alt[alt]
            label = alt.replace("|", "\\|")  # a pipe would end the Markdown cell
            label += (" **default**" if is_default else "") + (" *closest*" if alt == closest else "")
            table.append([choice, label, cells[0], cells[1], ratio, acc])
    header = ["choice", "alternative", "2L-ReLU fgsm / pgd / mim", "MLP-Attn fgsm / pgd / mim",
              "ratio fgsm / pgd / mim", "clean acc. 2L / Attn"]
    return "\n".join([*lines, markdown_table(header, table)])


__all__ = ["run_open_choices"]
