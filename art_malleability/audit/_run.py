"""
The steps of one audit once its inputs are checked
(:meth:`~art_malleability.audit.estimator.MalleabilityEstimator.evaluate`): the clean influence and its
projection noise, the random-sign controls, and each attack with the influence after it.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.utils import compute_success_array

from art_malleability._utils.checks import near_chance_warnings, one_hot
from art_malleability._utils.io import duration_text, progress_bar
from art_malleability._utils.provenance import library_versions
from art_malleability._utils.torch_utils import numpy_dtype, release_freed_memory, resolve_device
from art_malleability._utils.work_folder import WorkFolder, module_digest, value_digest
from art_malleability.audit._classifier import AuditInputs, PerturbedRows
from art_malleability.audit._estimate import estimate_audit
from art_malleability.audit.attacks import (
    CONTROL_LABEL,
    attack_config,
    attack_labels,
    perturb_training_set,
    random_sign_perturbation,
)
from art_malleability.audit.examples import choose_examples, describe_examples
from art_malleability.audit.params import PROJECTION_SEEDS, audit_refits, control_budgets
from art_malleability.audit.report import AttackResult, MalleabilityReport, control_summary, undecided_warning
from art_malleability.data.input_pipeline import with_input_pipeline
from art_malleability.data.streaming import ExampleSource
from art_malleability.distributed import Shard
from art_malleability.influence import InfluenceEstimator, NTKInfluence
from art_malleability.metrics import (
    ControlMetrics,
    MalleabilityMetrics,
    PassStatistics,
    aggregate_jaccard,
    combine_controls,
    projection_noise,
    spearman,
)
from art_malleability.metrics.accumulators import (
    STORE_MEMORY_BYTES,
    CleanScores,
    ColumnSums,
    PerturbedScores,
    QueryResampling,
    metrics_plan,
)
from art_malleability.models.reference import is_transductive

logger = logging.getLogger(__name__)

#: Share of the influential set with undecidable perturbed signs above which the report warns.
UNDECIDED_WARNING = 0.25
#: The audit's parameters a perturbed pass does not depend on (given its perturbed inputs): those of the attacks and
#: controls, and how the audit shows its progress and keeps its work.
PASS_FREE_PARAMS = ("attacks", "eps", "attack_max_iter", "batch_size", "controls", "control_draws", "work_dir",
                    "verbose")
#: The NTK influence's parameters that say how much work the audit plans (one refit per attack and control draw): they
#: choose the mode of ``projection_dim="auto"``, which the pass's key holds itself.
PLANNING_PARAMS = ("planned_refits", "planned_queries")
#: What the report's ``execution`` says the influence ran, in a pass's key (the reasons, which count the planned work,
#: left out).
RAN = ("influence", "mode", "ridge", "projection_dim", "projection_seed", "projection_groups", "world_size", "backend")
#: Draw ``d`` of a random-sign control is seeded with ``seed + CONTROL_SEED_STRIDE * d``.
CONTROL_SEED_STRIDE = 1000


@contextmanager
def timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Store the wall time of the block in ``seconds[key]``."""
    start = time.perf_counter()
    yield
    seconds[key] = time.perf_counter() - start


def run_audit(est: Any, given: AuditInputs, dataset: str | None) -> MalleabilityReport:
    """
    The audit proper, on checked inputs: accuracy, clean influence, controls, attacks, then the report.

    :param est: The :class:`~art_malleability.audit.estimator.MalleabilityEstimator` (its parameters and classifier).
    :param given: What is audited (:func:`~art_malleability.audit._classifier.audit_inputs`).
    :param dataset: Name of the data set for the report.
    :return: The report; the caller adds the warnings on the inputs.
    """
    run = AuditRun(est, given)
    query_source = "test" if given.self_pairs is None else "train"
    with timed(run.seconds, "accuracy"):
        accuracy = clean_accuracy(est.classifier, given.queries, given.shard, est.batch_size)
        y_acc = given.y if given.queries is given.source else given.queries.labels(est.batch_size * 8)
        warnings = near_chance_warnings(accuracy, y_acc, query_source)
    perturbed = run.score_clean(given)
    run.plan_passes(given, perturbed)
    control_metrics = run.run_controls(perturbed)
    results = [run.run_attack(attack, control_metrics, perturbed) for attack in est._attacks]
    run.steps.close()
    config = est.get_params()
    if config.get("work_dir") is not None:
        config["work_dir"] = os.fspath(config["work_dir"])
    return MalleabilityReport(
        model=est.model_name, config=config, n_train=run.n, n_queries=len(run.x_q),
        query_source=query_source, top_k=given.k, top_indices=run.top, clean_accuracy=accuracy,
        scores_before=run.agg_before, results=results, seconds=run.seconds, versions=library_versions(),
        dataset=dataset, warnings=warnings + run.warnings(), execution=run.execution(), noise_model=run.noise_model(),
    )


def clean_accuracy(classifier: Any, data: ExampleSource, shard: Shard, batch_size: int) -> float:
    """:return: Clean accuracy on a source (each process its shard)."""
    start, stop = shard.bounds(data.n)
    correct = 0
    dtype = numpy_dtype(classifier.model)  # a float64 model predicts on float64 inputs
    for _, xb, yb in data.batches(batch_size * 8, start, stop):
        xb = xb.astype(dtype, copy=False)
        correct += int(np.sum(classifier.predict(xb, batch_size=batch_size).argmax(axis=1) == yb))
    correct = int(shard.all_reduce(torch.tensor([correct], dtype=torch.int64))[0])
    return correct / data.n


class AuditRun:
    """
    One audit of an estimator's classifier: the working copy of the model the influence sees, the queries, and what
    the steps find. It keeps no training inputs: :meth:`score_clean` is given the checked inputs and returns the rows
    that the controls and the attacks are given.

    :param est: The :class:`~art_malleability.audit.estimator.MalleabilityEstimator` (its parameters and classifier).
    :param given: What is audited (:func:`~art_malleability.audit._classifier.audit_inputs`).
    """

    def __init__(self, est: Any, given: AuditInputs) -> None:
        self.est, self.shard, self.n = est, given.shard, given.source.n
        self.x_q, self.y_q, self.self_pairs = given.x_q, given.y_q, given.self_pairs
        self.influence: InfluenceEstimator = est._influence
        self.work, self.transductive = _working_model(est.classifier, self.influence)
        if self.shard.world_size > 1 and not isinstance(self.influence, NTKInfluence):
            raise ValueError(
                "influence must be the NTK influence (influence='ntk') in a sharded audit, got "
                f"{type(self.influence).__name__}, which runs in one process"
            )
        self.controls = control_budgets(est)
        self.labels = dict(zip(est._attacks, attack_labels(est._attacks), strict=True))
        self.seconds: dict[str, float] = {}
        self.steps = progress_bar(total=1 + 2 * len(est._attacks) + len(set(self.controls.values())),
                                  desc="malleability", verbose=est.verbose)
        self.noise: tuple[float, float] | None = None
        self.undecided: dict[str, float] = {}
        self.plan = metrics_plan(len(self.x_q), self.n, 0, est.n_bootstrap, self.self_pairs is not None)
        self.metrics_device = resolve_device(est.device)
        self.work_folder = None if est.work_dir is None else WorkFolder(est.work_dir)
        self.reused: dict[str, int] = {}
        self.pass_keys: dict[Any, dict | None] = {}  # each pass's key in the work folder (plan_passes)
        self.resume: dict[str, Any] = {}

    # ------------------------------------------------------------------ influence
    def _score_blocks(self, estimator: InfluenceEstimator) -> Iterator[np.ndarray]:
        """
        The influence of the training set on the queries, one block of queries at a time (every process takes part
        in each block; each block's self-pairs are excluded): no ``(n_query, n_train)`` matrix is ever whole.
        """
        rows = self.plan["block_rows"]
        for s in range(0, len(self.x_q), rows):
            block = estimator.scores(self.x_q[s : s + rows], self.y_q[s : s + rows])
            if self.self_pairs is not None:
                block[np.arange(len(block)), self.self_pairs[s : s + rows]] = np.nan
            yield block
            del block  # taken in by the metrics: it and its temporaries are free, and handed back
            release_freed_memory()

    def _aggregate(self, estimator: InfluenceEstimator) -> np.ndarray:
        """The aggregate score of every training example (its mean over the queries), rank 0's on every process."""
        sums = ColumnSums(self.n, torch.device("cpu"))
        for block in self._score_blocks(estimator):
            sums.add(0, torch.as_tensor(block))  # no resampling weights: the rows' position does not matter
        return self.shard.broadcast_object(sums.means().numpy())

    def _fit_on(self, estimator: InfluenceEstimator, x_train: Any, y_train: np.ndarray | None,
                warm_start: bool = False) -> None:
        """Fit ``estimator`` on the working model and ``x_train`` (labels ``y_train``; ``None`` for a dataset)."""
        if self.transductive:
            self.work.set_context(x_train)
        estimator.fit(self.work, x_train, y_train, warm_start=warm_start)
        if getattr(estimator, "shard_", self.shard) != self.shard:
            raise ValueError(
                f"distributed of the influence estimator must be 'auto' or True in a sharded audit, got "
                f"{getattr(estimator, 'distributed', None)!r}; it did not shard over the process group"
            )

    def _perturbed_scores(self, x_new: np.ndarray, rows: np.ndarray,
                          whole: tuple[np.ndarray, np.ndarray] | None) -> Iterator[np.ndarray]:
        """
        Influence with this process's perturbed training rows ``rows`` replaced by ``x_new``, in query blocks (a
        transductive model is fitted again on ``whole``, the training set, with every process's rows replaced).
        """
        influence = self.influence
        # what the previous pass's metrics and the attack freed is handed back before the refit's own temporaries
        # (without this the two stacked: 8.1 GB resident at a 60,000-example audit's refit, 4.7 GB of it live)
        release_freed_memory()
        if self.transductive:
            x_all, y_all = whole
            rows_all = self.shard.all_gather_rows(torch.as_tensor(rows)).numpy()
            new_all = self.shard.all_gather_rows(torch.as_tensor(x_new)).numpy()
            x_full = x_all.copy()
            x_full[rows_all] = new_all
            self._fit_on(influence, x_full, y_all, warm_start=True)  # the same random projection as the clean fit
        else:
            influence.refit(rows, x_new)
        release_freed_memory()
        return self._score_blocks(influence)

    def _other_seed_scores(self, x_train: Any, y_train: np.ndarray | None) -> list[np.ndarray]:
        """
        Clean aggregate scores of twin estimators with the next projection seeds (none when the influence does not
        run projected): with the clean fit's, they give the projection's noise model.
        """
        influence, found = self.influence, []
        for offset in range(1, PROJECTION_SEEDS):
            params = {**influence.get_params(), "projection_seed": influence.projection_seed + offset}
            if params.get("projection_dim") == "auto":  # the twin runs the projection "auto" chose (or will):
                params["projection_dim"] = influence._dim()  # the same k, and its choice is not warned of again
            twin = type(influence)(**params)
            self._fit_on(twin, x_train, y_train)
            if getattr(twin, "mode_", None) != "projected" or twin.projector_.is_exact:
                return []
            found.append(self._aggregate(twin))
            del twin
            # A process's first fit can leave cyclic garbage that reaches the fit's frames (a lazy import inside
            # torch catches an exception under the planning probe), which would keep the twin's features alive
            # into the clean fit that the memory plan counts without them.
            gc.collect()
            release_freed_memory()
        return found

    def score_clean(self, given: AuditInputs) -> PerturbedRows:
        """
        The clean influence (``before``, its aggregate ``agg_before``), the projection's noise model (``noise``)
        and the ``k`` most influential examples (``top``), with the rows to perturb (``perturbed``).

        :param given: What is audited.
        :return: This process's rows to perturb, read from the training source.
        """
        influence, twins, k = self.influence, [], given.k
        twin_first = self._projection_planned(given.probe)
        if twin_first:  # large runs: before the clean fit, so that two fitted estimators never share the memory
            self.steps.set_postfix_str("influence (other projection seeds)", refresh=False)
            with timed(self.seconds, "influence_other_seeds"):
                twins = self._other_seed_scores(given.train, given.train_labels)
        self.steps.set_postfix_str("influence (clean)", refresh=False)
        with timed(self.seconds, "influence_clean"):
            self._fit_on(influence, given.train, given.train_labels)
            self.clean = self._clean_pass(self._score_blocks(influence), k)
            self.top, self.agg_before = self.shard.broadcast_object(
                None if self.clean is None else (self.clean.top, self.clean.aggregates)
            )  # rank 0's set everywhere
        self.steps.update()
        self.projected = getattr(influence, "mode_", None) == "projected" and not influence.projector_.is_exact
        if self.projected:
            if not twin_first:
                with timed(self.seconds, "influence_other_seeds"):
                    twins = self._other_seed_scores(given.train, given.train_labels)
            if twins:
                self.noise = projection_noise(np.stack([self.agg_before, *twins]))
        self.seed_agreement = None
        if self.projected and twins:  # how much of the ranking is the projection's own draw
            self.seed_agreement = {
                "spearman": spearman(self.agg_before[None, :], twins[0][None, :]),
                "top_k_jaccard": aggregate_jaccard(twins[0], self.top, k, self.est.rank_by),
            }
        self.perturbed = self.top if self.est.strategy == "top" else np.arange(self.n)
        lo, hi = self.shard.bounds(self.n)
        rows = np.sort(self.perturbed[(self.perturbed >= lo) & (self.perturbed < hi)])
        x_rows, y_rows = given.source.take(rows, max(self.est.batch_size * 8, 1))
        whole = (given.train, given.y) if self.transductive else None
        return PerturbedRows(rows, x_rows, one_hot(y_rows, int(self.est.classifier.nb_classes)), whole)

    def _projection_planned(self, probe: np.ndarray) -> bool:
        """
        Whether the NTK influence will run projected (then its second seed is fitted before the clean fit, so that
        two fitted estimators never share the memory): given, or the plan of ``"auto"`` on the first training inputs
        ``probe`` says so (the same decision as the fit's, from fixed facts; a transductive model's plan would need
        its context first, so it is not asked).
        """
        influence, n = self.influence, self.n
        if not isinstance(influence, NTKInfluence) or influence.projection_dim is None:
            return False
        if influence.projection_dim != "auto" or (influence.max_exact_n is not None and n > influence.max_exact_n):
            return True
        if self.transductive:
            return False
        return influence.plan(self.work, probe, n)["mode"] == "projected"

    def _clean_pass(self, blocks: Iterator[np.ndarray], k: int) -> CleanScores | None:
        """
        The clean scores' pass of the metrics (rank 0 keeps it; the other processes only take part in the blocks):
        the aggregates, the set of the ``k`` largest, each query's own top set, the correlation's pairs.
        """
        est = self.est

        def start() -> CleanScores | None:
            if self.shard.rank != 0:
                return None
            resampling = QueryResampling(len(self.x_q), est.n_bootstrap, est.seed, self.metrics_device)
            return CleanScores(resampling, self.n, est.top_fraction, est.rank_by, STORE_MEMORY_BYTES,
                               folder=getattr(self.influence, "tile_folder", None))

        def finish() -> None:
            if clean is not None:
                clean.finish()
                if clean.k != k:
                    raise ValueError(f"the influential set must hold {k} examples, got {clean.k}")

        clean = self.shard.run_everywhere(start)
        self._consume(blocks, None if clean is None else clean.add)
        self.shard.run_everywhere(finish)
        return clean

    def _consume(self, blocks: Iterator[np.ndarray], add: Callable[[np.ndarray], None] | None) -> float:
        """
        Hand every block to ``add`` (rank 0's accumulator; ``None`` elsewhere). Every process computes every block
        (the scores are collective), even after ``add`` failed on one of them; the failure is then raised everywhere.

        :return: Seconds spent in ``add``.
        """
        error, seconds = None, 0.0
        for block in blocks:
            if add is not None and error is None:
                start = time.perf_counter()
                try:
                    add(block)
                except Exception as failure:  # noqa: BLE001 - raised on every process below
                    error = failure
                seconds += time.perf_counter() - start
            del block  # not held while the next block is computed: the blocks hand their memory back in between
        self.shard.raise_if_any(error)
        return seconds

    def _kept(self, key: dict | None) -> dict[str, np.ndarray] | bool:
        """
        A finished pass of this key in the work folder (collective): its arrays on the first process, ``True`` on the
        others; ``False`` everywhere where there is none (or no work folder).
        """
        found = None
        if key is not None and self.shard.rank == 0:
            found = self.work_folder.load("pass", key)
        if not self.shard.broadcast_object(found is not None):
            return False
        self.reused["passes"] = self.reused.get("passes", 0) + 1
        return True if found is None else found

    def _pass(self, x_new: np.ndarray | None, rows: np.ndarray, whole: tuple | None, key: dict | None,
              control: ControlMetrics | None = None, timing: dict[str, float] | None = None,
              kept: dict[str, np.ndarray] | bool = False,
              extra: dict[str, float] | None = None) -> tuple[MalleabilityMetrics, np.ndarray]:
        """
        One perturbed pass: the influence refitted with this process's perturbed rows replaced by ``x_new``, its
        metrics against the clean pass (with their replicates, as a control's draw needs) and its aggregate scores (on
        every process). A pass kept in the work folder (``kept``: :meth:`_kept`) is read back instead; a pass computed
        with a work folder (``key``) is kept, with the numbers of ``extra``.

        :param timing: Where to add the seconds of the influence (``influence``) and of the metrics (``metrics``).
        """
        est, shard = self.est, self.shard
        start = time.perf_counter()
        if kept is not False:
            influence_s = 0.0
            statistics = (None if kept is True
                          else PassStatistics.from_arrays(kept, self.clean.resampling.identity))
        else:
            blocks = self._perturbed_scores(x_new, rows, whole)
            scores = PerturbedScores(self.clean) if shard.rank == 0 else None
            accumulating = self._consume(blocks, None if scores is None else scores.add)
            influence_s = time.perf_counter() - start - accumulating
            statistics = shard.run_everywhere(
                lambda: None if scores is None else PassStatistics.of(scores, est.confidence, self.noise))
            if key is not None:
                numbers = {f"extra.{name}": np.float64(value) for name, value in (extra or {}).items()}
                shard.run_everywhere(lambda: None if statistics is None else self.work_folder.save(
                    "pass", key, {**statistics.to_arrays(), **numbers}))
        result = shard.run_everywhere(lambda: None if statistics is None else (
            statistics.metrics(est.confidence, control, keep_draws=True), statistics.aggregates))
        result = shard.broadcast_object(result)
        if timing is not None:
            timing["influence"] = timing.get("influence", 0.0) + influence_s
            timing["metrics"] = timing.get("metrics", 0.0) + time.perf_counter() - start - influence_s
        return result

    def plan_passes(self, given: AuditInputs, perturbed: PerturbedRows) -> None:
        """
        With a work folder, the key of every pass the audit will run (each random-sign control draw, each attack:
        what it perturbs, by what, and the clean pass's key), which of them a run before finished, and one line in
        the log (and in the report's ``execution``) that names the passes reused and those left, with the estimate
        of the rest. Collective.
        """
        if self.work_folder is None:
            return
        est, clip = self.est, self.est.classifier.clip_values
        local = np.frombuffer(bytes.fromhex(value_digest([perturbed.rows, perturbed.x, perturbed.y_onehot])),
                              dtype=np.int64).copy()
        rows = value_digest(self.shard.all_gather_rows(torch.as_tensor(local)[None]))  # every process's rows
        base = {**self._clean_key, "rows": rows}
        names = {}
        for eps in sorted(set(self.controls.values())):
            for draw in range(est.control_draws):
                self.pass_keys[(eps, draw)] = {**base, "perturbation": {
                    "control": eps, "seed": est.seed + CONTROL_SEED_STRIDE * draw,
                    "clip_values": None if clip is None else np.asarray(clip, dtype=np.float64)}}
                names[(eps, draw)] = f"control eps={eps:g} draw {draw + 1}"
        for attack in est._attacks:
            self.pass_keys[attack] = {**base, "perturbation": self._attack_identity(attack)}
            names[attack] = self.labels[attack]
        finished = self.shard.broadcast_object(  # the first process reads the records, as it keeps the passes
            [self.work_folder.has("pass", key) for key in self.pass_keys.values()] if self.shard.rank == 0 else None)
        done = [names[p] for p, f in zip(self.pass_keys, finished, strict=True) if f]
        left = [p for p, f in zip(self.pass_keys, finished, strict=True) if not f]
        self.resume = {"finished_before": done, "to_compute": [names[p] for p in left]}
        if not done:
            return
        plan = estimate_audit(est, self.n, len(self.x_q), audit_refits(est), given.probe)
        attacks_left = sum(1 for p in left if p in est._attacks)
        seconds = plan.seconds
        rest = ((seconds["influence"] or 0.0) * len(left) / (len(self.pass_keys) + 1)
                + seconds["attacks"] * attacks_left / max(len(est._attacks), 1)
                + seconds["metrics"] * len(left) / max(len(self.pass_keys), 1))
        self.resume["estimated_rest_s"] = rest
        line = (f"work folder {self.work_folder.path}: {len(done)} of {len(self.pass_keys)} passes finished before "
                f"and reused ({', '.join(done)}); {len(left)} to compute"
                + (f" ({', '.join(self.resume['to_compute'])}), about {duration_text(rest)}" if left else ""))
        logger.info("%s", line)
        if not self.steps.disable:  # beside the progress bar, where the audit shows its progress
            self.steps.write(line, file=sys.stderr)

    @cached_property
    def _clean_key(self) -> dict:
        """
        What every perturbed pass shares (once the clean pass is done): the versions, the model's architecture and
        weights, the process count, the audit's parameters but those of the attacks and controls, what the influence
        ran (its parameters, mode and ridge), the queries, and the clean pass's result (the aggregates, the influential
        set and the noise model).
        """
        est = self.est
        params = {name: value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
                  for name, value in est.get_params().items() if name not in PASS_FREE_PARAMS}
        ran = self.execution()
        execution = {name: ran[name] for name in RAN if name in ran}
        execution["params"] = {name: value for name, value in ran["params"].items()
                               if name not in PLANNING_PARAMS}  # what ran is in the mode, which stays
        execution["kernel_method"] = (ran.get("kernel_method") or {}).get("method")
        return {
            "versions": library_versions(), "model": self._model_digest, "world_size": self.shard.world_size,
            "params": params, "execution": value_digest(json.loads(json.dumps(execution, default=str))),
            "queries": value_digest([self.x_q, self.y_q, self.self_pairs]),
            "clean": value_digest([self.agg_before, self.top]),
            "noise": None if self.noise is None else [float(v) for v in self.noise],
        }

    @cached_property
    def _model_digest(self) -> str:
        """The audited model's digest (:func:`~art_malleability._utils.work_folder.module_digest`), computed once."""
        return module_digest(self.est.classifier.model)

    # ------------------------------------------------------------------ controls and attacks
    def run_controls(self, perturbed: PerturbedRows) -> dict[float, ControlMetrics]:
        """
        :param perturbed: The rows to perturb (:meth:`score_clean`).
        :return: The random-sign control of every distinct budget, by budget: ``control_draws`` independent draws
            of the signs, combined (:func:`~art_malleability.metrics.combine_controls`).
        """
        control_metrics: dict[float, ControlMetrics] = {}
        for eps in sorted(set(self.controls.values())):
            with timed(self.seconds, f"control_eps_{eps:g}"):
                draws = []
                for draw in range(self.est.control_draws):
                    self.steps.set_postfix_str(f"control eps={eps:g} draw {draw + 1}", refresh=False)
                    key = self.pass_keys.get((eps, draw))
                    kept = self._kept(key)
                    x_ctrl = None if kept is not False else self.shard.run_everywhere(
                        self._control_rows, perturbed, eps, draw)
                    draws.append(self._pass(x_ctrl, perturbed.rows, perturbed.whole, key, kept=kept)[0])
                control_metrics[eps] = combine_controls(draws, self.est.confidence)  # every process has the draws
            self.steps.update()
        return control_metrics

    def run_attack(self, attack: EvasionAttack, control_metrics: dict[float, ControlMetrics],
                   perturbed: PerturbedRows) -> AttackResult:
        """
        :param perturbed: The rows to perturb (:meth:`score_clean`).
        :return: The result of one attack: the influence after it, against the clean one and the control.
        """
        label, timing = self.labels[attack], {}
        self.steps.set_postfix_str(f"attack {label}", refresh=False)
        key = self.pass_keys.get(attack)
        kept = self._kept(key)
        with timed(timing, "attack"):
            if kept is False:
                x_adv, changed, linf = self.shard.run_everywhere(self._attack_rows, attack, perturbed)
                success, linf = _combine_attack_stats(changed, linf, len(self.perturbed), self.shard)
            else:  # its pass was kept with the attack's numbers: the attack is not run again
                x_adv = None
                success, linf = self.shard.broadcast_object(
                    None if kept is True else (float(kept["extra.attack_success"]),
                                               float(kept["extra.max_perturbation"])))
        self.steps.update()
        self.steps.set_postfix_str(f"influence ({label})", refresh=False)
        eps = self.controls.get(attack)
        control = control_metrics.get(eps)
        metrics, scores_after = self._pass(  # the refit on the perturbed rows
            x_adv, perturbed.rows, perturbed.whole, key, control, timing, kept,
            {"attack_success": success, "max_perturbation": linf})
        examples = self._examples(key, kept, perturbed, x_adv, metrics, scores_after)
        self.steps.update()
        result = AttackResult.from_metrics(
            metrics,
            control=None if control is None else control_summary(control, eps, CONTROL_LABEL),
            attack=label,
            params=attack_config(attack),
            n_perturbed=len(self.perturbed),
            attack_success=success,
            max_perturbation=linf,
            scores_after=scores_after,
            seconds=timing,
            examples=examples,
        )
        logger.info("%s: flip rate %.3f", label, metrics.flip_rate.value)
        if metrics.undecided_share > UNDECIDED_WARNING:
            # one warning for all of them (warnings), with each one's noise-aware interval
            rate = metrics.noise_aware_flip_rate
            self.undecided[label] = (metrics.undecided_share, (rate.low, rate.high))
        return result

    def _examples(self, key: dict | None, kept: dict | bool, perturbed: PerturbedRows, x_adv: np.ndarray | None,
                  metrics: MalleabilityMetrics, after: np.ndarray) -> list[dict[str, Any]] | None:
        """
        The training examples behind an attack's result (:mod:`~art_malleability.audit.examples`), on the first
        process (``None`` elsewhere): every process hands over its rows among them. With a work folder they are kept
        beside the attack's pass (an ``examples`` stage of the same key), so that a rerun that does not attack again
        shows them too; ``None`` where such a stage is missing.
        """
        shard = self.shard
        flipped, held = choose_examples(self.top, self.agg_before, after, metrics.counted_flips)
        names = ("index", "label", "clean", "attacked")
        if kept is not False:  # the attack did not run again: its examples were kept with its pass
            found = self.work_folder.load("examples", key) if shard.rank == 0 else None
            arrays = None if found is None or set(found) != set(names) else [found[n] for n in names]
        else:
            here = np.isin(perturbed.rows, np.concatenate([flipped, held]))
            mine = (perturbed.rows[here], perturbed.y_onehot[here].argmax(axis=1), perturbed.x[here], x_adv[here])
            arrays = list(mine) if shard.world_size == 1 else [
                shard.all_gather_rows(torch.as_tensor(np.ascontiguousarray(a))).numpy() for a in mine]
            if key is not None:
                shard.run_everywhere(lambda: None if shard.rank != 0 else self.work_folder.save(
                    "examples", key, dict(zip(names, arrays, strict=True))))
        if shard.rank != 0 or arrays is None:
            return None
        index, labels, clean, attacked = arrays
        position = {int(i): n for n, i in enumerate(index)}
        clip = self.est.classifier.clip_values
        found = []
        for kind, chosen in (("flipped", flipped), ("kept", held)):
            at = [position[int(i)] for i in chosen if int(i) in position]
            found += describe_examples(kind, index[at], labels[at], clean[at], attacked[at], self.agg_before, after,
                                       clip)
        return found

    def _attack_rows(self, attack: EvasionAttack, perturbed: PerturbedRows) -> tuple[np.ndarray, int, float]:
        """
        Run the attack on this process's perturbed training rows, in chunks. numpy's global generator is seeded with
        ``seed`` plus the chunk's offset for every chunk: attacks with random starts (not the named ones, which are
        deterministic) therefore depend on the chunking, and a sharded run differs from a single-process one for them.

        :return: ``(x_adv rows, number whose prediction changed, largest ℓ∞ change)``.
        """
        est, x, labels = self.est, perturbed.x, perturbed.y_onehot
        x_adv = np.empty_like(x)
        changed, linf = 0, 0.0
        chunk = max(est.batch_size * 8, 1)
        bar = progress_bar(total=len(x), desc=f"attack {self.labels[attack]}", unit="ex", leave=False,
                           verbose=est.verbose and len(x) > chunk)
        dtype = numpy_dtype(est.classifier.model)  # predictions in the model's dtype (a float64 model's included)
        found = 0
        base = None if self.work_folder is None else self._attack_identity(attack)  # what every chunk depends on

        def chunk_rows(xb: np.ndarray, yb: np.ndarray, seed: int) -> tuple[np.ndarray, int]:
            adv = perturb_training_set(attack, xb, yb, np.arange(len(xb)), seed=seed)
            success = compute_success_array(est.classifier, xb.astype(dtype, copy=False), yb,
                                            adv.astype(dtype, copy=False), batch_size=est.batch_size)
            return adv, int(np.sum(success))

        for s in range(0, len(x), chunk):
            xb, yb = x[s : s + chunk], labels[s : s + chunk]
            if base is None:
                adv, hits = chunk_rows(xb, yb, est.seed + s)
            else:  # a finished chunk is kept, keyed by all it depends on
                key = {**base, "seed": est.seed + s, "rows": value_digest([xb, yb])}
                (adv, hits), reused = self.work_folder.cached(
                    "attack", key, lambda xb=xb, yb=yb, s=s: chunk_rows(xb, yb, est.seed + s), ("x_adv", "changed"))
                hits = int(hits)
                found += int(reused)
            x_adv[s : s + len(xb)] = adv
            changed += hits
            linf = max(linf, float(np.max(np.abs(adv - xb))) if len(xb) else 0.0)
            bar.update(len(xb))
        bar.close()
        if self.work_folder is not None:
            chunks = -(-len(x) // chunk)
            self.reused["attack chunks"] = self.reused.get("attack chunks", 0) + found
            logger.info("%s: %d of %d chunks of perturbed inputs reused from the work folder, %d computed",
                        self.labels[attack], found, chunks, chunks - found)
        return x_adv, changed, linf

    def _attack_identity(self, attack: EvasionAttack) -> dict:
        """
        What an attack's perturbed inputs depend on besides the rows and the seed: the versions, the model (and the
        one the attack runs on, where a ready-made attack was given on another), the attack and every parameter, the
        dtype, the batch size, the clip values and the device kind.
        """
        est = self.est
        model = self._model_digest
        # an attack given ready-made may run on another model than the audited one: its own is in the key too
        attacked = getattr(getattr(attack, "estimator", None), "model", None)
        if isinstance(attacked, torch.nn.Module) and attacked is not est.classifier.model:
            model = value_digest([model, module_digest(attacked)])
        clip = est.classifier.clip_values
        return {"versions": library_versions(), "model": model, "attack": type(attack).__name__,
                "params": attack_config(attack), "dtype": str(numpy_dtype(est.classifier.model)),
                "batch_size": est.batch_size, "device": est.classifier.device.type,
                "clip_values": None if clip is None else np.asarray(clip, dtype=np.float64)}

    def _control_rows(self, perturbed: PerturbedRows, eps: float, draw: int) -> np.ndarray:
        """
        Draw ``draw`` of the random-sign control of this process's perturbed training rows, in chunks; the signs of
        draw ``d`` are seeded with ``seed + 1000 d``.
        """
        est, x, rows = self.est, perturbed.x, perturbed.rows
        x_ctrl = np.empty_like(x)
        chunk = max(est.batch_size * 8, 1)
        for s in range(0, len(x), chunk):
            x_ctrl[s : s + chunk] = random_sign_perturbation(
                x[s : s + chunk], rows[s : s + chunk], eps, est.classifier.clip_values,
                seed=est.seed + CONTROL_SEED_STRIDE * draw,
            )
        return x_ctrl

    # ------------------------------------------------------------------ what the report states
    def warnings(self) -> list[str]:
        """:return: Warnings on the run: undecidable signs, attacks without a control, and a projected influence."""
        found = [undecided_warning(self.undecided)] if self.undecided else []
        if self.work_folder is not None:
            found.extend(self.work_folder.distrusted)
        missing = [self.labels[a] for a in self.est._attacks if a not in self.controls]
        if self.est.controls and missing:
            found.append(
                f"no random-perturbation control for {missing}: a control needs an l-inf attack with one scalar eps"
            )
        if self.projected and getattr(self.influence, "auto_note_", None):
            found.append(self.influence.auto_note_)
        asked = getattr(self.influence, "projection_dim", None)
        if self.projected and isinstance(asked, int) and self.influence.projection_dim_ < asked:
            found.append(
                f"projection_dim={asked} gave {self.influence.projection_dim_} dimensions: each layer's share is "
                "split into a product of an output and an input side (k_out x k_in), which can fall short of it; "
                f"pass a larger projection_dim for at least {asked}"
            )
        if self.projected:
            found.append(
                f"influence from a {self.influence.projection_dim_}-dimensional random projection of the NTK "
                "features: at small ridges its scores agree only loosely with the exact NTK influence, and two "
                "projection seeds can disagree (measured in docs/scale.md); compare seeds before trusting these "
                "flip rates"
            )
        return found

    def noise_model(self) -> dict[str, Any]:
        """How the noise-aware flip rate modelled the noise of the aggregate scores."""
        seed, noise = self.est.seed, self.noise
        return {
            "method": "empirical-Bayes deconvolution of the influential set's paired clean and perturbed aggregates "
            "(bivariate Student-t, covariance of the two means from the per-query scores, degrees of freedom from "
            "their kurtosis; selection of the set by the clean aggregates corrected), posterior share of sign changes",
            "projection_sd": None if noise is None else {"intercept": noise[0], "slope": noise[1]},
            "projection_seeds": None if noise is None else [int(seed) + i for i in range(PROJECTION_SEEDS)],
            "seed_agreement": getattr(self, "seed_agreement", None),
        }

    def execution(self) -> dict[str, Any]:
        """What ran: the influence estimator's parameters and mode, and the process group."""
        influence, shard = self.influence, self.shard
        params = {
            key: value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
            for key, value in influence.get_params().items()
            if key != "verbose"  # how it shows its progress, not what ran
        }
        details: dict[str, Any] = {"influence": type(influence).__name__, "params": params}
        if hasattr(influence, "mode_"):
            details["mode"] = influence.mode_
        if getattr(influence, "mode_reason_", None):
            details["mode_reason"] = influence.mode_reason_
        if getattr(influence, "ridge_", None) is not None:
            details["ridge"] = float(influence.ridge_)
        if getattr(influence, "kernel_method_", None) is not None:
            details["kernel_method"] = influence.kernel_method_
        if getattr(influence, "projector_", None) is not None:
            details["projection_dim"] = influence.projection_dim_
            details["projection_seed"] = influence.projection_seed
            details["projection_groups"] = influence.projector_.describe()
        details["world_size"], details["backend"] = shard.world_size, shard.backend
        if self.work_folder is not None:
            details["work_folder"] = {"path": str(self.work_folder.path), "reused": dict(self.reused), **self.resume}
        return details


def _working_model(classifier: Any, influence: InfluenceEstimator) -> tuple[torch.nn.Module, bool]:
    """
    :return: A copy of the classifier's model as the influence sees it (behind the classifier's input pipeline), and
        whether it is transductive.
    """
    work = copy.deepcopy(classifier.model)
    transductive = is_transductive(work)
    dtype = getattr(influence, "dtype", None)
    if transductive and isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        # the context is computed, and stored, in the influence's dtype (a float64 kernel of a float32
        # model must not see a context rounded to float32)
        work = work.to(dtype=dtype)
    return with_input_pipeline(work, classifier), transductive  # what classifier.predict feeds the model


def _combine_attack_stats(changed: int, linf: float, total: int, shard: Shard) -> tuple[float, float]:
    """Attack success (share of perturbed examples whose prediction changed) and ℓ∞ over all processes."""
    changed = int(shard.all_reduce(torch.tensor([changed], dtype=torch.int64))[0])
    linf = float(shard.all_reduce(torch.tensor([linf], dtype=torch.float64), "max")[0])
    return changed / total, linf
