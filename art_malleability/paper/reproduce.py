"""
Reproduction of the paper's comparisons (Miñoza, Medina & Ibañez, 2026), side by side with its numbers.

:func:`run_reproduction` regenerates, on any data set of the package:

* **Table 1**: NTK distance of each model at widths 16, 1024, 4096 (and the full sweep), through
  :class:`~art_malleability.ntk.convergence.NTKConvergenceChecker`. The paper's "NTK distance"
  ``‖f_m − f_NTK‖`` is read as the checker's ``output_distance`` under the paper's Adam protocol;
  its static kernel error and the distance to the linearised network under gradient descent are
  shown beside it.
* **Table 2**: flip rates (FGSM / PGD / MIM, ε = 0.3) of every model, all classes, cross-entropy.
* **Table 3**: binary tasks, MSE loss: digits 3 vs 8 on MNIST-like data, automobile vs airplane on
  CIFAR-10-like data (three colour channels).
* **Table 4**: PGD flip rate after PGD adversarial training through ART's
  :class:`~art.defences.trainer.AdversarialTrainer` (ratio 1: every batch replaced by its PGD
  counterpart), against standard training.
* **ε ablation** (0.1, 0.2, 0.3, 0.5) on the Table 2 models, their **loss landscape** (top Hessian eigenvalue and
  filter-normalised loss profiles: the paper's flatter-minima claim, :mod:`art_malleability.paper.landscape`), and the
  **spectral numbers**.

Every flip rate is the mean over training seeds with a Student-t interval over the seeds
(:func:`~art_malleability.metrics.seed_interval`: each seed's estimate carries its query noise, counted once);
Tables 2–3 add the raw rate's expectation by query noise alone, the noise-aware flip rate, the random-sign control,
the excess flip rate (attack minus control) and the difference between MLP-Attn's and 2L-ReLU's excess flip rates
(paired over seeds), next to the paper's value and the ratio MLP-Attn / 2L-ReLU. Table 1's NTK distances keep a
Student-t interval over seeds. The clean test
accuracy of every trained model is reported, and a model that closes less than a quarter of the gap
between chance and perfect accuracy is flagged (its flip rates are kept, marked, and left out of no
table).

Training follows the paper's protocol by default (Adam, lr 1e-3, batch 128, L2 1e-3, 500 epochs);
the paper's numbers come from summaries of the paper, not its tables, and are targets to test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from art_malleability._utils.checks import one_hot
from art_malleability._utils.io import figure_png, json_ready
from art_malleability._utils.output_folder import OutputFolder, staged_output
from art_malleability._utils.params import (
    DEVICE,
    DISTINCT,
    N_QUERIES,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_INT,
    POSITIVE_INTS,
    SIZE,
    TOP_FRACTION,
    WORK_DIR,
    Rule,
    RuleTable,
    check_values,
    each_one_of,
    is_int,
)
from art_malleability._utils.report_base import SavedReport, markdown_table
from art_malleability._utils.state import preserved_rng
from art_malleability.data.datasets import Dataset, load_dataset, subsample
from art_malleability.models.reference import CONTEXT, REFERENCE_MODELS, is_transductive
from art_malleability.models.training import make_classifier
from art_malleability.paper.common import (
    ATTACKS,
    audit,
    build_module,
    flip_rows,
    fmt_ci,
    held_out_accuracy,
    mean_ci,
    pooled,
    progress,
    train,
    train_module,
)
from art_malleability.paper.numbers import BINARY_CLASSES, BINARY_NAMES, PAPER
from art_malleability.paper.tables import (
    RATE_COLUMNS,
    ablation_figure,
    accuracy_cell,
    direction,
    flip_table,
    mean_of,
    rate_cells,
)

logger = logging.getLogger(__name__)

TABLES = ("table1", "table2", "table3", "table4", "ablation", "landscape", "spectral")
#: Runs on request only (``tables=("open_choices",)``): the sensitivity study of
#: :mod:`art_malleability.paper.open_choices`.
STUDIES = ("open_choices",)

TABLE1_FOLDER = "table1_ntk"

#: The models of Tables 1-2: at least one (the message shows none) ...
ONE_MODEL = Rule(f"name at least one of the reference models {REFERENCE_MODELS}", lambda vs: len(vs) >= 1,
                 show=lambda vs: "none")
#: ... each a reference model (the message shows the first that is not).
REFERENCE_NAMES = each_one_of(REFERENCE_MODELS, f"name reference models {REFERENCE_MODELS}")
#: The seeds: at least one.
ONE_SEED = Rule("hold at least one seed", lambda vs: len(vs) >= 1)
#: The retrained models of the LDS: none, or enough to correlate over.
LDS_MODELS = Rule("be 0 (no LDS) or at least 2 (the LDS correlates over the retrained models)",
                  lambda v: is_int(v) and (v == 0 or v >= 2), int)

#: Every setting of :class:`ReproductionConfig` with a rule, in the manner of scikit-learn's
#: ``_parameter_constraints``: the config and the command line's ``reproduce`` check through it.
REPRODUCTION_RULES: RuleTable = {
    "n_train": SIZE,
    "n_test": SIZE,
    "models": (ONE_MODEL, REFERENCE_NAMES, DISTINCT),
    "width": POSITIVE_INT,
    "attention_context": CONTEXT,
    "seeds": (ONE_SEED, DISTINCT),
    "epochs": POSITIVE_INT,
    "lr": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "batch_size": POSITIVE_INT,
    "adv_epochs": POSITIVE_INT,
    "adv_max_iter": POSITIVE_INT,
    "eps": POSITIVE,
    "attack_max_iter": POSITIVE_INT,
    "n_queries": N_QUERIES,
    "n_bootstrap": POSITIVE_INT,
    "lds_models": LDS_MODELS,
    "top_fraction": TOP_FRACTION,
    "widths": (POSITIVE_INTS, DISTINCT),
    "ntk_n_train": POSITIVE_INT,
    "ntk_n_test": POSITIVE_INT,
    "ntk_adam_epochs": POSITIVE_INT,
    "ntk_gd_steps": POSITIVE_INT,
    "tables": each_one_of(TABLES + STUDIES),
    "device": DEVICE,
    "work_dir": WORK_DIR,
}


@dataclass
class ReproductionConfig:
    """
    Settings of a reproduction run. Defaults: the paper's training protocol on the embedded digits,
    five seeds, sizes that finish on two CPU cores in under 15 minutes.

    :param dataset: Data set name or ``.npz`` path (see :func:`~art_malleability.data.datasets.load_dataset`).
    :param data_root: Local torchvision root.
    :param n_train: Training examples of the flip-rate tables.
    :param n_test: Test examples (queries are drawn from them).
    :param models: Models of Tables 1–2 (Tables 3–4 use the first two): reference model names
                   (:data:`~art_malleability.models.reference.REFERENCE_MODELS`), at least one.
    :param width: Hidden width of the flip-rate tables.
    :param attention_context: The attention context of MLP-Attn and MLP-Attn-QKV: ``"centred"`` (default) or
                              ``"gram"``, the paper's literal form (:class:`~art_malleability.models.MLPAttn`).
    :param seeds: Seeds (training initialisation, data order, queries).
    :param epochs: Training epochs (paper: 500).
    :param lr: Adam learning rate (paper: 1e-3).
    :param weight_decay: Adam L2 (paper: 1e-3).
    :param batch_size: Batch size (paper: 128).
    :param adv_epochs: Epochs of PGD adversarial training.
    :param adv_max_iter: PGD steps inside adversarial training.
    :param eps: Attack budget of Tables 2–4.
    :param eps_grid: Budgets of the ablation.
    :param attack_max_iter: Steps of PGD and MIM in the audits.
    :param n_queries: Query points per audit.
    :param n_bootstrap: Bootstrap resamples inside each audit.
    :param lds_models: Models retrained on random halves of the training set to measure the linear datamodeling
                       score of the influence estimator of Tables 2 and 3 (first seed, each model, the
                       table's loss; see
                       :func:`art_malleability.validation.validate`); 0 skips it.
    :param top_fraction: Share of training data in the influential set.
    :param widths: Width sweep of Table 1.
    :param ntk_n_train: Training points of Table 1's kernels.
    :param ntk_n_test: Test points of Table 1's output distances.
    :param ntk_adam_epochs: Adam epochs of Table 1's dynamic level.
    :param ntk_gd_steps: Gradient-descent steps of Table 1's dynamic level.
    :param tables: Which tables to run.
    :param device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    :param verbose: Progress bars.
    :param work_dir: A work folder (:class:`~art_malleability._utils.work_folder.WorkFolder`) for every trained
                     model's weights and every audit's finished stages: a rerun, after an interruption or with more
                     seeds, tables or models, trains and audits only what is not there; ``None`` keeps nothing.
    """

    dataset: str = "digits"
    data_root: str | None = None
    n_train: int = 1000
    n_test: int = 300
    models: tuple[str, ...] = ("2l-relu", "mlp-attn", "mlp-attn-qkv")
    width: int = 512
    attention_context: str = "centred"
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    epochs: int = 500
    lr: float = 1e-3
    weight_decay: float = 1e-3
    batch_size: int = 128
    adv_epochs: int = 50
    adv_max_iter: int = 10
    eps: float = 0.3
    eps_grid: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5)
    attack_max_iter: int = 20
    n_queries: int = 100
    n_bootstrap: int = 200
    lds_models: int = 20
    top_fraction: float = 0.1
    widths: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    ntk_n_train: int = 300
    ntk_n_test: int = 100
    ntk_adam_epochs: int = 20
    ntk_gd_steps: int = 200
    tables: tuple[str, ...] = TABLES
    device: str = "auto"
    verbose: bool = True
    work_dir: str | None = None

    def __post_init__(self) -> None:
        check_values(REPRODUCTION_RULES, {name: getattr(self, name) for name in REPRODUCTION_RULES})
        for w in (16, 1024, 4096):
            if "table1" in self.tables and w not in self.widths:
                logger.info("Table 1 reports widths 16/1024/4096; width %d is not in the sweep", w)


@dataclass
class Reproduction(SavedReport):
    """
    Every measurement of a run (``rows``) and its summaries (``tables``), with the paper's numbers. :meth:`save`
    writes ``reproduction.json``, ``reproduction.md`` and the files in ``files`` (the ablation figure, the
    open-choices table).

    :param config: The run's settings.
    :param family: ``"mnist"`` or ``"cifar10"``: which of the paper's numbers the data is compared with.
    :param rows: One dict per trained model and audit.
    :param tables: Markdown of each table.
    :param seconds: Time of each table.
    :param files: Further files of the report folder by name (PNG bytes or text), kept in memory and not in the JSON.
    """

    config: dict[str, Any]
    family: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    tables: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    files: dict[str, str | bytes] = field(default_factory=dict, repr=False, compare=False)

    json_name: ClassVar[str] = "reproduction.json"
    markdown_name: ClassVar[str] = "reproduction.md"
    json_indent: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        """:return: A JSON-ready dict: the settings, rows, tables and times."""
        return json_ready({"config": self.config, "family": self.family, "rows": self.rows, "tables": self.tables,
                           "seconds": self.seconds})

    def to_markdown(self) -> str:
        """:return: Every table as Markdown, with the settings."""
        lines = [f"# Reproduction on {self.config['dataset']} (compared with the paper's {self.family} numbers)", ""]
        for text in self.tables.values():
            lines += [text, ""]
        lines += ["## Settings", ""] + [f"- `{k}`: `{v}`" for k, v in self.config.items()]
        lines += ["", "## Time (seconds)", ""] + [f"- {k}: {v:.0f}" for k, v in self.seconds.items()]
        return "\n".join(lines) + "\n"

    def _side_files(self) -> dict[str, str | bytes]:
        return dict(self.files)


def run_reproduction(config: ReproductionConfig, output: str | Path | OutputFolder) -> Reproduction:
    """
    Run the chosen tables and write ``reproduction.json``, ``reproduction.md`` and figures to ``output``.

    :param config: Settings.
    :param output: Output folder, or an open :class:`~art_malleability._utils.output_folder.OutputFolder` to stage in
        (the files appear when its run succeeds; a failed run leaves the folder as it was).
    :return: The :class:`Reproduction`.
    """
    with staged_output(output, writer="reproduce") as out:
        data = load_dataset(
            config.dataset, root=config.data_root, n_train=config.n_train, n_test=config.n_test, seed=0
        )
        family = "cifar10" if data.input_shape[0] == 3 else "mnist"
        result = Reproduction(json_ready(asdict(config)), family)
        trained: dict[tuple[str, int], Any] = {}
        steps = {
            "table1": lambda: _table1(config, data, family, result, out),
            "table2": lambda: _table2(config, data, family, result, trained),
            "table3": lambda: _table3(config, family, result),
            "table4": lambda: _table4(config, data, family, result, trained),
            "ablation": lambda: _ablation(config, data, result, trained),
            "landscape": lambda: _landscape(config, data, result, trained),
            "spectral": lambda: _spectral(config, family, result),
        }
        with preserved_rng():
            for name in TABLES:
                if name not in config.tables:
                    continue
                start = time.perf_counter()
                steps[name]()
                result.seconds[name] = time.perf_counter() - start
                if config.verbose:
                    print(result.tables.get(name, ""), flush=True)
        result.stage(out)
    return result


# ------------------------------------------------------------------------------------------------- tables


def _table1(config, data: Dataset, family: str, result: Reproduction, out: OutputFolder) -> None:
    from art_malleability.ntk.convergence import NTKConvergenceChecker

    tr, te = _ntk_points(config, data)
    n_tr, n_te = len(tr), len(te)
    models = [m for m in config.models if m != "mlp-attn-qkv"]  # no analytic limit for trained attention
    checker = NTKConvergenceChecker(
        models=models, attention_context=config.attention_context, widths=config.widths,
        seeds=config.seeds if len(config.seeds) > 1 else (0, 1),
        protocols=("adam", "gd"), adam_epochs=config.ntk_adam_epochs, gd_steps=config.ntk_gd_steps,
        device=config.device, verbose=config.verbose,
    )
    report = checker.run(data.x_train[tr], data.y_train[tr], data.x_test[te], data.y_test[te], dataset=data.name)
    report.stage(out, TABLE1_FOLDER)
    shown = [w for w in (16, 1024, 4096) if w in config.widths]
    lines = [
        "## Table 1: NTK distance ‖f_m − f_NTK‖ (Adam protocol) at widths " + " / ".join(map(str, shown)),
        "",
        f"{n_tr} training / {n_te} test points; mean over seeds [95% t-interval]. Paper: {family}. "
        "Static = ‖K_m − K_∞‖/‖K_∞‖ at init; GD-lin = relative distance to the linearised network under GD.",
        "",
    ]
    header = ["model", *[f"m={w}" for w in shown], "paper", "direction (measured / paper)",
              "static m=" + "/".join(map(str, shown)), "GD-lin m=" + "/".join(map(str, shown))]
    table = []
    for model in models:
        cells, means = [], []
        for w in shown:
            values = [r["output_distance"] for r in report.kept(model=model, width=w, protocol="adam")]
            mean, low, high = mean_ci(values)
            means.append(mean)
            cells.append(fmt_ci(mean, low, high, 1, (0.0, float("inf"))))
            result.rows.append({"table": "table1", "model": model, "width": w, "ntk_distance": mean,
                                "ci": [low, high], "seeds": len(values)})
        paper = PAPER["table1"][family].get(model)
        static = "/".join(f"{mean_of(report, model, w, 'static', 'kernel_error'):.3f}" for w in shown)
        lin = "/".join(f"{mean_of(report, model, w, 'dynamic', 'linearised_distance', 'gd'):.3f}" for w in shown)
        table.append([model, *cells, " / ".join(map(str, paper)) if paper else "n/a",
                      f"{direction(means)} / {direction(paper) if paper else 'n/a'}", static, lin])
    if "mlp-attn-qkv" in config.models:
        table.append(["mlp-attn-qkv", *["n/a" for _ in shown], "—", "—", "n/a", "n/a"])
    lines.append(markdown_table(header, table))
    if "mlp-attn-qkv" in config.models:
        lines += ["", "MLP-Attn-QKV has no NTK distance: its query/key/value maps are trained and not width-scaled, so "
                  "their share of the empirical NTK does not vanish and there is no infinite-width kernel f_NTK to "
                  "compare with (the paper does not say which limit it used for this row)."]
    if note := report.diverged_note():
        lines += ["", note]
    lines += ["", "Full sweep: `table1_ntk/convergence.md` (every metric, width exponents, verdicts) and figures."]
    result.tables["table1"] = "\n".join(lines)


def _table2(config, data: Dataset, family: str, result: Reproduction, trained: dict) -> None:
    rows = []
    for model in config.models:
        for seed in progress(config, config.seeds, f"table 2 {model}"):
            clf, acc = _standard_model(config, model, data, seed, trained)
            report = audit(config, clf, data, ATTACKS, config.eps, seed)
            rows += flip_rows("table2", model, seed, acc, report, data, extra={"eps": config.eps})
    result.rows += rows
    result.tables["table2"] = flip_table(
        f"## Table 2: flip rates (%), {data.nb_classes} classes, ε = {config.eps}", rows, config.models,
        PAPER["table2"][family], family,
    )
    if config.lds_models > 0:
        result.tables["table2"] += "\n\n" + _lds(config, data, result, "table2", "cross_entropy")


def _lds(config, data: Dataset, result: Reproduction, table: str, loss: str) -> str:
    """The linear datamodeling score of the audits' influence estimator on each paper model of the first seed."""
    from art_malleability.validation import validate

    seed = config.seeds[0]
    rows = np.sort(np.random.default_rng(seed).choice(len(data.x_test), min(config.n_queries, len(data.x_test)),
                                                      replace=False))  # the audit's queries
    cells = []
    for model in _paper_models(config):  # the trained-attention variant costs five times as much to retrain
        def train_fn(x, y, s, model=model):
            return train_module(config, model, x, y, s, loss, data.input_shape, data.nb_classes)

        try:
            report = validate(train_fn, data.x_train, data.y_train, data.x_test[rows], data.y_test[rows],
                              estimators=("ntk",), n_models=config.lds_models, loo_queries=0, seed=seed, loss=loss,
                              device=config.device, model_name=model, dataset=data.name, verbose=False)
        except ValueError as err:  # e.g. a model at chance: no fidelity to measure
            logger.warning("LDS of %s not measured: %s", model, err)
            cells.append(f"{model} n/a ({err})")
            continue
        ((name, fidelity),) = report.results.items()
        result.rows.append({"table": "lds", "of_table": table, "loss": loss, "model": model, "seed": seed,
                            "estimator": name, "lds": fidelity.lds,
                            "lds_ci": fidelity.lds_ci, "n_models": config.lds_models, "alpha": 0.5})
        low, high = fidelity.lds_ci
        cells.append(f"{model} {fmt_ci(fidelity.lds, low, high, 2, (-1.0, 1.0))} ({name})")
    return (f"Fidelity of the influence estimator against retraining (LDS, seed {seed}, {config.lds_models} models "
            f"retrained on random halves of the training set, query {loss} loss; 1 = perfect rank agreement, "
            "0 = none): "
            + "; ".join(cells))


def _table3(config, family: str, result: Reproduction) -> None:
    classes = BINARY_CLASSES[family]
    n_train, n_test = _binary_sizes(config, classes)
    data = load_dataset(config.dataset, root=config.data_root, n_train=n_train, n_test=n_test, classes=classes,
                        seed=0)
    rows = []
    models = _paper_models(config)
    for model in models:
        for seed in progress(config, config.seeds, f"table 3 {model}"):
            clf, acc = train(config, model, data, seed, "mse")
            report = audit(config, clf, data, ATTACKS, config.eps, seed)
            rows += flip_rows("table3", model, seed, acc, report, data, extra={"classes": classes})
    result.rows += rows
    title = (
        f"## Table 3: binary task, {BINARY_NAMES[family]} (MSE loss), flip rates (%), ε = {config.eps}"
    )
    result.tables["table3"] = flip_table(title, rows, models, PAPER["table3"][family], family)
    if config.lds_models > 0:
        result.tables["table3"] += "\n\n" + _lds(config, data, result, "table3", "mse")


def _binary_sizes(config, classes: list[int]) -> tuple[int, int]:
    """The requested sizes, scaled down in proportion when the two classes hold fewer examples (digits: 357)."""
    pool = load_dataset(config.dataset, root=config.data_root, classes=classes, seed=0)
    total = len(pool.x_train) + len(pool.x_test)
    n_train, n_test = config.n_train, config.n_test
    if n_train + n_test > total:
        n_train = int(total * n_train / (n_train + n_test))
        n_test = total - n_train
        logger.info("Table 3: %d examples of classes %s; using %d train / %d test", total, classes, n_train, n_test)
    return n_train, n_test


def _table4(config, data: Dataset, family: str, result: Reproduction, trained: dict) -> None:
    from art.attacks.evasion import ProjectedGradientDescent
    from art.defences.trainer import AdversarialTrainer

    models = _paper_models(config)
    rows = []
    for model in models:
        for seed in progress(config, config.seeds, f"table 4 {model}"):
            standard, base_acc = _standard_model(config, model, data, seed, trained)
            report = audit(config, standard, data, ("pgd",), config.eps, seed)
            rows += flip_rows("table4", model, seed, base_acc, report, data, extra={"training": "standard"})
            # adversarial training starts from a fresh initialisation, with the same optimiser settings
            module = build_module(config, model, data.input_shape, data.nb_classes, seed)
            if is_transductive(module):
                module.set_context(data.x_train)
            params = [p for p in module.parameters() if p.requires_grad]
            clf = make_classifier(
                module, data.input_shape, data.nb_classes, clip_values=data.clip_values, device=config.device,
                optimizer=torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay),
            )
            pgd = ProjectedGradientDescent(clf, eps=float(config.eps), eps_step=2.5 * config.eps / config.adv_max_iter,
                                           max_iter=config.adv_max_iter, num_random_init=0, verbose=False)
            np.random.seed(seed)
            with _trainer_progress(config.verbose):
                AdversarialTrainer(clf, pgd, ratio=1.0).fit(data.x_train, one_hot(data.y_train, data.nb_classes),
                                                            batch_size=config.batch_size, nb_epochs=config.adv_epochs)
            module.eval()
            report = audit(config, clf, data, ("pgd",), config.eps, seed)
            rows += flip_rows("table4", model, seed, held_out_accuracy(clf, data), report, data,
                               extra={"training": "pgd-adversarial"})
    result.rows += rows
    lines = [f"## Table 4: PGD flip rate (%) after PGD adversarial training (ART AdversarialTrainer, ratio 1, "
             f"{config.adv_max_iter} steps, {config.adv_epochs} epochs), ε = {config.eps}", "",
             "Columns as in Table 2: mean over the seeds [95% Student-t interval]; *by noise*, *noise-aware*, "
             "*control* and *excess* (pts) as there.", ""]
    table = []
    for model in models:
        paper = PAPER["table4"][family].get(model)
        for step, training in enumerate(("standard", "pgd-adversarial")):
            sel = [r for r in rows if r["model"] == model and r["training"] == training]
            table.append([model, training, accuracy_cell(sel), *rate_cells(sel)[1],
                          "—" if paper is None else paper[step]])
    lines.append(markdown_table(["model", "training", "clean acc.", *RATE_COLUMNS, "paper"], table))
    result.tables["table4"] = "\n".join(lines)


@contextmanager
def _trainer_progress(verbose: bool) -> Iterator[None]:
    """ART's ``AdversarialTrainer.fit`` always draws its progress bars; with ``verbose=False`` they are switched off
    for the call (its module's ``tqdm``/``trange`` names, restored afterwards)."""
    from art.defences.trainer import adversarial_trainer

    if verbose:
        yield
        return
    saved = adversarial_trainer.tqdm, adversarial_trainer.trange
    adversarial_trainer.tqdm = partial(saved[0], disable=True)
    adversarial_trainer.trange = partial(saved[1], disable=True)
    try:
        yield
    finally:
        adversarial_trainer.tqdm, adversarial_trainer.trange = saved


def _ablation(config, data: Dataset, result: Reproduction, trained: dict) -> None:
    models = _paper_models(config)
    rows = []
    for model in models:
        for seed in progress(config, config.seeds, f"ε ablation {model}"):
            clf, acc = _standard_model(config, model, data, seed, trained)
            for eps in config.eps_grid:
                report = audit(config, clf, data, ATTACKS, eps, seed)
                rows += flip_rows("ablation", model, seed, acc, report, data, extra={"eps": eps})
    result.rows += rows
    table = [[model, attack, *[fmt_ci(*pooled([r for r in rows if r["model"] == model and r["attack"] == attack
                                                 and r["eps"] == e], "flip_rate"), 1) for e in config.eps_grid]]
             for model in models for attack in ATTACKS]
    lines = ["## ε ablation: flip rates (%) by attack budget", "",
             markdown_table(["model", "attack", *[f"ε={e}" for e in config.eps_grid]], table),
             "", "![ε ablation](ablation.png)"]
    result.tables["ablation"] = "\n".join(lines)
    result.files["ablation.png"] = figure_png(ablation_figure(rows, models, config.eps_grid))


def _landscape(config, data: Dataset, result: Reproduction, trained: dict) -> None:
    from art_malleability.paper.landscape import landscape_table

    rows, markdown, png = landscape_table(config, data, _paper_models(config),
                                          lambda model, seed: _standard_model(config, model, data, seed, trained))
    result.rows += rows
    result.tables["landscape"] = markdown
    result.files["landscape.png"] = png


def _spectral(config, family: str, result: Reproduction) -> None:
    from art_malleability.ntk.spectral import spectral_analysis_of_dataset

    report = spectral_analysis_of_dataset(config.dataset, root=config.data_root, n=config.n_train, seed=0)
    paper = PAPER["spectral"][family]
    result.rows.append({"table": "spectral", **{k: v for k, v in report.to_dict().items() if k != "eigenvalues"}})
    result.tables["spectral"] = "\n".join([
        f"## Spectral numbers (n = {report.n}, unit-normalised inputs)", "",
        markdown_table(["quantity", "measured", "paper"], [
            ["κ(G)", f"{report.kappa:.4g}", "—"],
            [f"κ_d ({report.kappa_d_rule})", f"{report.kappa_d:.4g}", f"{paper['kappa']:.3g}"],
            ["log10 κ_d(G³) = 3 log10 κ_d", f"{report.log10_kappa_d_g3:.2f}", f"{3 * np.log10(paper['kappa']):.2f}"],
            ["log10 required width, v1 (κ⁶)", f"{report.log10_width_v1:.1f}", "—"],
            ["log10 required width, v2 (κ_d⁶ n ln n)", f"{report.log10_width_v2:.1f}", f"≫ {paper['log10_width']:.0f}"],
        ]),
    ] + [f"\n{flag}" for flag in report.flags])


# ------------------------------------------------------------------------------------------------ helpers


def _ntk_points(config, data: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """
    Indices of Table 1's training and test points: seeded, stratified subsets of the splits. Not prefixes:
    the splits keep their source's order, and a class-sorted source (such as an ``.npz`` of CIFAR-10) would
    give prefixes of one or two classes.
    """
    n_tr, n_te = min(config.ntk_n_train, len(data.x_train)), min(config.ntk_n_test, len(data.x_test))
    return subsample(data.y_train, n_tr, 0, "Table 1 training"), subsample(data.y_test, n_te, 0, "Table 1 test")


def _standard_model(config, model: str, data: Dataset, seed: int, trained: dict):
    """The Table 2 model of (model, seed) and its accuracy, trained once for Tables 2, 4 and the ablation."""
    if (model, seed) not in trained:
        trained[(model, seed)] = train(config, model, data, seed, "cross_entropy")
    return trained[(model, seed)]


def _paper_models(config) -> list[str]:
    """The models of Tables 3-4 and the ablation: the paper's two reference models, when asked for."""
    return [m for m in config.models if m in ("2l-relu", "mlp-attn")]


__all__ = ["PAPER", "Reproduction", "ReproductionConfig", "run_reproduction"]
