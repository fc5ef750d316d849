"""
The pre-flight estimate of a whole audit (training aside): the influence's fit, refits and query scores, the attacks
and the metrics, in time and peak memory, from the sizes, the options and fixed facts of the machine (operations
counted at a nominal rate of the device, :func:`~art_malleability.influence.ntk_memory.nominal_gemm_rate`; nothing
is timed), so that it can be printed before the long work and the same command always gets the same one. The NTK
influence decides its mode on the influence's part of it (``exact_budget_s``, the audit's ``time_budget_s``); the
attacks and the metrics cost the same in either mode.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from art_malleability._utils.io import duration_text
from art_malleability._utils.torch_utils import eval_mode, model_device_dtype, resolve_device
from art_malleability.audit.params import PROJECTION_SEEDS, planned_work
from art_malleability.influence import NTKInfluence
from art_malleability.influence.ntk_memory import FACTOR_EFFICIENCY, SOLVE_EFFICIENCY, nominal_gemm_rate
from art_malleability.metrics import SPEARMAN_PAIRS, top_k_count
from art_malleability.metrics.accumulators import metrics_plan
from art_malleability.models.reference import is_transductive
from art_malleability.ntk.cost import loss_step_cost

logger = logging.getLogger(__name__)

#: Operation-equivalents, at one thread's nominal rate, of one metrics pass's likelihood fits per member of the
#: influential set (the noise-aware rate's profile and the retention's empirical Bayes, small single-threaded steps
#: whose cost does not grow with the queries): measured 5 ms per member and pass on one CPU core (100 members: 0.5 s).
MEMBER_OPERATIONS = 5e8
#: Fixed operation-equivalents, at one thread's nominal rate, of one metrics pass's likelihood fits whatever the set's
#: size (the profile's grid of constrained EM fits over the atoms): measured 0.17 s a pass for a set of ten members on
#: 2 CPU cores (a torchvision-sized audit of 96 examples), 0.12 s beyond the members' share.
PASS_OPERATIONS = 7.5e9
#: Operation-equivalents, at one thread's nominal rate, of Spearman's correlation and its jackknife per sampled pair
#: and pass (:data:`~art_malleability.metrics._spearman.SPEARMAN_PAIRS` at most): measured 0.17 s per pass for
#: 262,144 pairs on one CPU core.
PAIR_OPERATIONS = 6e4
#: Bytes of the process before the audit's buffers: the interpreter with torch and ART loaded (measured 0.5-0.6 GB).
PROCESS_BYTES = 600 * 2**20


@dataclass
class AuditEstimate:
    """
    What an audit is estimated to take before it runs.

    :param n_train: Training examples.
    :param n_queries: Queries.
    :param refits: Influence refits (attacks and control draws).
    :param mode: The NTK influence's mode (``None`` for another influence).
    :param reason: Why that mode (``None`` for another influence).
    :param seconds: Estimated seconds by part: ``influence`` (``None`` when not estimated), ``attacks``,
        ``metrics``, ``total`` (of the estimated parts).
    :param peak_bytes: Estimated peak memory of the process (bytes).
    :param facts: The nominal rate and the facts it came from.
    """

    n_train: int
    n_queries: int
    refits: int
    mode: str | None
    reason: str | None
    seconds: dict[str, float | None] = field(default_factory=dict)
    peak_bytes: int = 0
    facts: str = ""

    def summary(self, how: str = "time_budget_s, memory_limit_gb, projection_dim or n_queries") -> str:
        """One line: the mode, the estimated time and peak memory, and how to change them."""
        parts = ", ".join(f"{name} {duration_text(value)}" for name, value in self.seconds.items()
                          if name != "total" and value is not None)
        influence = "influence" if self.mode is None else f"{self.mode} NTK influence"
        unknown = "" if self.seconds.get("influence") is not None else " (the influence's time not estimated)"
        return (f"audit plan: {influence} on {self.n_train} training examples, {self.n_queries} queries, "
                f"{self.refits} refits; about {duration_text(self.seconds['total'])}{unknown} ({parts}) and "
                f"{self.peak_bytes / 1e9:.1f} GB peak memory; change with {how}")

    def to_dict(self) -> dict[str, Any]:
        return {"n_train": self.n_train, "n_queries": self.n_queries, "refits": self.refits, "mode": self.mode,
                "reason": self.reason, "seconds": dict(self.seconds), "peak_bytes": self.peak_bytes,
                "facts": self.facts}


def estimate_audit(est: Any, n_train: int, n_query: int, refits: int, x_probe: np.ndarray) -> AuditEstimate:
    """
    :param est: The :class:`~art_malleability.audit.estimator.MalleabilityEstimator`.
    :param n_train: Training examples.
    :param n_query: Queries.
    :param refits: Influence refits (:func:`~art_malleability.audit.params.audit_refits`).
    :param x_probe: A few training inputs (all of them for a transductive model: its context).
    :return: The estimate.
    """
    k = top_k_count(n_train, est.top_fraction)
    changed = k if est.strategy == "top" else n_train
    rate, facts = nominal_gemm_rate(resolve_device(est.device))
    model = est.classifier.model
    if is_transductive(model):  # a copy with the training set as its context, as the audit's working copy has it
        model = copy.deepcopy(model)
        model.set_context(x_probe)
    influence, plan = est._influence, None
    passes = refits + 1
    influence_seconds = None
    if isinstance(influence, NTKInfluence):
        with planned_work(influence, refits, n_query):
            plan = influence.plan(model, x_probe, n_train)
        influence_seconds = float(plan["seconds"][plan["mode"]])
        if is_transductive(model):  # every perturbed pass fits anew (the context changes): passes fits, same mode
            with planned_work(influence, 0, n_query):
                fit = influence.plan(model, x_probe, n_train)
            influence_seconds = passes * float(fit["seconds"][plan["mode"]])
        if plan["mode"] == "projected":  # twins of the next projection seeds: the projection's noise model
            influence_seconds += (PROJECTION_SEEDS - 1) * float(plan["fit_seconds"])
    elif hasattr(influence, "score_seconds"):  # TracIn: the training set's gradients again with every query block
        y_probe = _predicted(model, x_probe)
        block = metrics_plan(n_query, n_train, k, est.n_bootstrap)["block_rows"]
        full, last = divmod(n_query, block)
        one = influence.score_seconds(model, x_probe, y_probe, n_train, block) if full else 0.0
        rest = influence.score_seconds(model, x_probe, y_probe, n_train, last) if last else 0.0
        influence_seconds = passes * (full * one + rest)
    budgets = len(est.eps) if isinstance(est.eps, tuple) else 1  # a named attack runs at each budget
    steps = sum((1 if a == "fgsm" else int(est.attack_max_iter)) * (budgets if isinstance(a, str) else 1)
                for a in est.attacks)
    attacks = changed * steps * _step_seconds(model, x_probe, est)
    one_thread, _ = nominal_gemm_rate(resolve_device(est.device), threads=1)
    pairs = min(SPEARMAN_PAIRS, n_query * n_train)
    metrics = ((refits * 2.0 * est.n_bootstrap * n_query * n_train / SOLVE_EFFICIENCY
                + passes * n_query * n_train * np.log2(max(k, 2)) / FACTOR_EFFICIENCY) / rate
               + refits * (PASS_OPERATIONS + k * MEMBER_OPERATIONS + pairs * PAIR_OPERATIONS) / one_thread)
    seconds: dict[str, float | None] = {"influence": influence_seconds, "attacks": float(attacks),
                                         "metrics": float(metrics)}
    seconds["total"] = sum(v for v in seconds.values() if v is not None)
    # the training inputs, the queries, and the perturbed rows twice (read once as they are, and perturbed)
    inputs = int(np.prod(x_probe.shape[1:])) * 4 * (n_train + n_query + 2 * changed)
    metric_bytes = metrics_plan(n_query, n_train, k, est.n_bootstrap)["memory_bytes"]
    peak = PROCESS_BYTES + inputs + metric_bytes + (0 if plan is None else plan["bytes"])
    return AuditEstimate(n_train, n_query, refits, None if plan is None else plan["mode"],
                         None if plan is None else plan["reason"], seconds, int(peak), facts)


def _predicted(model: torch.nn.Module, x_probe: np.ndarray) -> np.ndarray:
    """The model's own predictions for the probe (labels of the right range for counting a loss)."""
    device, dtype = model_device_dtype(model)
    with eval_mode(model), torch.no_grad():
        return model(torch.as_tensor(np.asarray(x_probe[:2]), device=device, dtype=dtype)).argmax(1).cpu().numpy()


def _step_seconds(model: torch.nn.Module, x_probe: np.ndarray, est: Any) -> float:
    """
    Seconds of one example's attack step: a forward and backward pass of its loss in the model's own dtype, counted
    (:func:`~art_malleability.ntk.cost.loss_step_cost`) at the device's nominal rate, in ART's batches.
    """
    device, dtype = model_device_dtype(model)
    x = torch.as_tensor(np.asarray(x_probe[:2]), device=device, dtype=dtype)
    y = torch.as_tensor(_predicted(model, x_probe), device=device)
    with eval_mode(model):
        cost = loss_step_cost(model, x, y, torch.nn.functional.cross_entropy)
    return cost.example_seconds(int(est.batch_size), device)
