"""
The steps of one audit once its inputs are checked
(:meth:`~art_malleability.audit.estimator.MalleabilityEstimator.evaluate`): the clean influence and its
projection noise, the random-sign controls, and each attack with the influence after it.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.utils import compute_success_array

from art_malleability._utils.checks import near_chance_warnings, one_hot
from art_malleability._utils.io import progress_bar
from art_malleability._utils.provenance import library_versions
from art_malleability._utils.torch_utils import numpy_dtype, release_freed_memory, resolve_device
from art_malleability._utils.work_folder import WorkFolder, module_digest, value_digest
from art_malleability.audit._classifier import AuditInputs, PerturbedRows
from art_malleability.audit.attacks import (
    CONTROL_LABEL,
    attack_config,
    attack_label,
    perturb_training_set,
    random_sign_perturbation,
)
from art_malleability.audit.params import PROJECTION_SEEDS, control_budgets
from art_malleability.audit.report import AttackResult, MalleabilityReport, control_summary, undecided_warning
from art_malleability.data.input_pipeline import with_input_pipeline
from art_malleability.data.streaming import ExampleSource
from art_malleability.distributed import Shard
from art_malleability.influence import InfluenceEstimator, NTKInfluence
from art_malleability.metrics import (
    ControlMetrics,
    MalleabilityMetrics,
    aggregate_jaccard,
    combine_controls,
    pass_metrics,
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
        self.seconds: dict[str, float] = {}
        self.steps = progress_bar(total=1 + 2 * len(est._attacks) + len(set(self.controls.values())),
                                  desc="malleability", verbose=est.verbose)
        self.noise: tuple[float, float] | None = None
        self.undecided: dict[str, float] = {}
        self.plan = metrics_plan(len(self.x_q), self.n, 0, est.n_bootstrap, self.self_pairs is not None)
        self.metrics_device = resolve_device(est.device)
        self.work_folder = None if est.work_dir is None else WorkFolder(est.work_dir)
        self.reused: dict[str, int] = {}

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

    def _metrics_of(self, blocks: Iterator[np.ndarray], control: ControlMetrics | None = None,
                    timing: dict[str, float] | None = None) -> tuple[MalleabilityMetrics, np.ndarray]:
        """
        The metrics of a perturbed pass against the clean one (with their replicates, as a control's draw needs), and
        its aggregate scores (on every process).

        :param timing: Where to add the seconds of the influence (``influence``) and of the metrics (``metrics``).
        """
        est, result = self.est, None
        start = time.perf_counter()
        perturbed = PerturbedScores(self.clean) if self.shard.rank == 0 else None
        accumulating = self._consume(blocks, None if perturbed is None else perturbed.add)
        influence_s = time.perf_counter() - start - accumulating
        result = self.shard.run_everywhere(lambda: None if perturbed is None else (
            pass_metrics(perturbed, est.confidence, self.noise, control, keep_draws=True), perturbed.aggregates()))
        result = self.shard.broadcast_object(result)
        if timing is not None:
            timing["influence"] = timing.get("influence", 0.0) + influence_s
            timing["metrics"] = timing.get("metrics", 0.0) + time.perf_counter() - start - influence_s
        return result

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
                    x_ctrl = self.shard.run_everywhere(self._control_rows, perturbed, eps, draw)
                    scores = self._perturbed_scores(x_ctrl, perturbed.rows, perturbed.whole)
                    draws.append(self._metrics_of(scores)[0])
                control_metrics[eps] = combine_controls(draws, self.est.confidence)  # every process has the draws
            self.steps.update()
        return control_metrics

    def run_attack(self, attack: EvasionAttack, control_metrics: dict[float, ControlMetrics],
                   perturbed: PerturbedRows) -> AttackResult:
        """
        :param perturbed: The rows to perturb (:meth:`score_clean`).
        :return: The result of one attack: the influence after it, against the clean one and the control.
        """
        label, timing = attack_label(attack), {}
        self.steps.set_postfix_str(f"attack {label}", refresh=False)
        with timed(timing, "attack"):
            x_adv, changed, linf = self.shard.run_everywhere(self._attack_rows, attack, perturbed)
            success, linf = _combine_attack_stats(changed, linf, len(self.perturbed), self.shard)
        self.steps.update()
        self.steps.set_postfix_str(f"influence ({label})", refresh=False)
        eps = self.controls.get(attack)
        control = control_metrics.get(eps)
        start = time.perf_counter()
        scores = self._perturbed_scores(x_adv, perturbed.rows, perturbed.whole)  # the refit on the perturbed rows
        timing["influence"] = time.perf_counter() - start
        metrics, scores_after = self._metrics_of(scores, control, timing)
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
        )
        logger.info("%s: flip rate %.3f", label, metrics.flip_rate.value)
        if metrics.undecided_share > UNDECIDED_WARNING:
            # one warning for all of them (warnings), with each one's noise-aware interval
            rate = metrics.noise_aware_flip_rate
            self.undecided[label] = (metrics.undecided_share, (rate.low, rate.high))
        return result

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
        bar = progress_bar(total=len(x), desc=f"attack {attack_label(attack)}", unit="ex", leave=False,
                           verbose=est.verbose and len(x) > chunk)
        dtype = numpy_dtype(est.classifier.model)  # predictions in the model's dtype (a float64 model's included)
        found, base = 0, None  # base: what every chunk's stage depends on (with a work folder)
        if self.work_folder is not None:
            model = module_digest(est.classifier.model)
            # an attack given ready-made may run on another model than the audited one: its own is in the key too
            attacked = getattr(getattr(attack, "estimator", None), "model", None)
            if isinstance(attacked, torch.nn.Module) and attacked is not est.classifier.model:
                model = value_digest([model, module_digest(attacked)])
            clip = est.classifier.clip_values
            base = {"versions": library_versions(), "model": model, "attack": type(attack).__name__,
                    "params": attack_config(attack), "dtype": str(dtype), "batch_size": est.batch_size,
                    "clip_values": None if clip is None else np.asarray(clip, dtype=np.float64),
                    "device": est.classifier.device.type}

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
                        attack_label(attack), found, chunks, chunks - found)
        return x_adv, changed, linf

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
        missing = [attack_label(a) for a in self.est._attacks if a not in self.controls]
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
            "(bivariate normal, covariance of the two means from the per-query scores; selection of the set by the "
            "clean aggregates corrected), posterior share of sign changes",
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
            details["work_folder"] = {"path": str(self.work_folder.path), "reused": dict(self.reused)}
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
