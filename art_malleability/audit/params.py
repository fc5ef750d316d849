"""
The parameters of :class:`~art_malleability.audit.estimator.MalleabilityEstimator`: their names, their validation, and
the attacks and the influence estimator built from them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack

from art_malleability._utils.checks import check_positive_int, loss_name
from art_malleability._utils.torch_utils import resolve_device, total_memory
from art_malleability.audit.attacks import ATTACK_NAMES, STRATEGIES, attack_label, control_eps, make_attack
from art_malleability.influence import INFLUENCE_NAMES, InfluenceEstimator, get_influence
from art_malleability.influence.ntk import MEMORY_SHARE
from art_malleability.influence.ridge_choice import check_ridge
from art_malleability.metrics import RANK_BY, check_confidence
from art_malleability.metrics.accumulators import metrics_plan
from art_malleability.ntk.projection import check_projection_dim

logger = logging.getLogger(__name__)

#: The most queries the default (``n_queries=None``) takes: the whole test split of MNIST, Fashion-MNIST and CIFAR-10.
#: Beyond it the aggregates' standard errors shrink only as one over the root of the queries while every statistic's
#: cost keeps growing linearly (docs/metrics.md measures the undecided share against the number of queries).
DEFAULT_MAX_QUERIES = 10_000


def default_queries(n_queries: int | None) -> int:
    """:return: The most queries an audit takes: ``n_queries``, or :data:`DEFAULT_MAX_QUERIES` for ``None``."""
    return DEFAULT_MAX_QUERIES if n_queries is None else int(n_queries)

#: Constructor arguments of :class:`~art_malleability.audit.estimator.MalleabilityEstimator` that build its classifier;
#: every other one is a parameter of the audit (its ``estimator_params``, read from the signature).
CLASSIFIER_ARGS = ("classifier", "input_shape", "nb_classes", "loss", "clip_values", "model_name")


def check_params(est: Any) -> None:
    """
    Validate the parameters of an estimator; ``attacks`` becomes a tuple and ``eps`` a float.

    :param est: A :class:`~art_malleability.audit.estimator.MalleabilityEstimator` being configured.
    :raises ValueError: On an invalid value (``TypeError`` for a value of the wrong type).
    """
    est.attacks = _check_attacks(est.attacks)
    est.eps = _positive_number("eps", est.eps)
    if not isinstance(est.influence, (str, InfluenceEstimator)):
        raise TypeError(f"influence must be one of {INFLUENCE_NAMES} or an InfluenceEstimator, got {est.influence!r}")
    if isinstance(est.top_fraction, bool) or not 0.0 < float(est.top_fraction) <= 1.0:
        raise ValueError(f"top_fraction must lie in (0, 1], got {est.top_fraction!r}")
    if est.strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {est.strategy!r}")
    check_ridge(est.ridge)
    if est.rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {est.rank_by!r}")
    for name in ("n_bootstrap", "attack_max_iter", "batch_size", "control_draws"):
        check_positive_int(getattr(est, name), name)
    if est.n_queries is not None:
        check_positive_int(est.n_queries, "n_queries")
    if est.n_queries is not None and est.n_queries < 2:
        raise ValueError(
            f"n_queries must be at least 2, got {est.n_queries!r}; every interval resamples the queries and needs two "
            "or more"
        )
    check_confidence(est.confidence)
    if isinstance(est.seed, bool) or not isinstance(est.seed, (int, np.integer)):
        raise TypeError(f"seed must be a non-negative integer, got {est.seed!r}")
    if est.seed < 0:
        raise ValueError(f"seed must be a non-negative integer (numpy's seeds are), got {est.seed!r}")
    resolve_device(est.device)
    if est.projection_dim is not None and est.projection_dim != "auto":
        check_projection_dim(est.projection_dim)
    if est.distributed not in ("auto", True, False):
        raise ValueError(f"distributed must be 'auto', True or False, got {est.distributed!r}")
    if not isinstance(est.controls, bool):
        raise TypeError(f"controls must be True or False, got {est.controls!r}")
    if est.memory_limit_gb is not None:
        est.memory_limit_gb = _positive_number("memory_limit_gb", est.memory_limit_gb)
    est.time_budget_s = _positive_number("time_budget_s", est.time_budget_s)


def check_query_budget(
    n_query: int, n_train: int, k: int, n_bootstrap: int, excluded_pairs: bool, memory_limit_gb: float | None,
    device: torch.device,
) -> dict[str, Any]:
    """
    The metrics of ``n_query`` queries must fit the memory; their plan depends on the sizes alone
    (:func:`~art_malleability.metrics.accumulators.metrics_plan`). The budget is ``memory_limit_gb`` when set, else
    :data:`~art_malleability.influence.ntk.MEMORY_SHARE` of the device's total memory: a fixed fact of the machine, not
    what other processes leave free at the moment, so that the same command is refused or run the same way anywhere
    on the same machine.

    :param n_query: Queries.
    :param n_train: Training examples.
    :param k: Size of the influential set.
    :param n_bootstrap: Bootstrap resamples.
    :param excluded_pairs: Whether the queries come from the training set (their self-pairs are excluded).
    :param memory_limit_gb: The influence's memory limit (GiB), or ``None``.
    :param device: The device of the metrics.
    :return: The plan.
    :raises ValueError: Naming ``n_queries`` when it does not fit.
    """
    plan = metrics_plan(n_query, n_train, k, n_bootstrap, excluded_pairs)
    budget = float(memory_limit_gb) * 2**30 if memory_limit_gb is not None else MEMORY_SHARE * total_memory(device)
    if plan["memory_bytes"] > budget:
        fixed = metrics_plan(0, n_train, k, n_bootstrap, excluded_pairs)["memory_bytes"]
        per_query = max((plan["memory_bytes"] - fixed) / max(n_query, 1), 1.0)
        fits = int(max(budget - fixed, 0) // per_query)
        raise ValueError(
            f"n_queries must leave the audit's metrics within the memory budget of {budget / 2**30:.1f} GiB, got "
            f"{n_query} queries, whose metrics need {plan['memory_bytes'] / 2**30:.1f} GiB (n_train {n_train}, "
            f"n_bootstrap {n_bootstrap}); pass at most about {fits} queries, or fewer bootstrap resamples"
        )
    logger.info("metrics of %d queries: %.2f GiB in memory, %.2f GiB on disk, blocks of %d queries", n_query,
                plan["memory_bytes"] / 2**30, plan["disk_bytes"] / 2**30, plan["block_rows"])
    return plan


def control_budgets(est: Any) -> dict[EvasionAttack, float]:
    """The random-sign control's budget of each attack that has one (a scalar ℓ∞ budget), none without controls."""
    if not est.controls:
        return {}
    return {a: eps for a in est._attacks if (eps := control_eps(a)) is not None}


def audit_refits(est: Any) -> int:
    """Refits of the influence an audit runs: one per attack and ``control_draws`` per distinct control budget."""
    return len(est._attacks) + len(set(control_budgets(est).values())) * int(est.control_draws)


@contextmanager
def planned_work(influence: InfluenceEstimator, refits: int, queries: int) -> Iterator[None]:
    """
    Within the block, an NTK influence plans (``exact_budget_s``'s estimate, hence the mode of
    ``projection_dim="auto"``) for the audit's work: ``refits`` refits and ``queries`` queries scored after each. Its
    own ``planned_refits`` and ``planned_queries`` are restored afterwards (an estimator the user gave keeps its
    parameters).
    """
    from art_malleability.influence import NTKInfluence

    if not isinstance(influence, NTKInfluence):
        yield
        return
    saved = {"planned_refits": influence.planned_refits, "planned_queries": influence.planned_queries}
    influence.planned_refits, influence.planned_queries = int(refits), int(queries)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(influence, name, value)


def build_attacks(est: Any) -> list[EvasionAttack]:
    """:return: The ART attacks of an estimator's ``attacks`` (named ones built on its classifier), distinct."""
    attacks = [
        a
        if isinstance(a, EvasionAttack)
        else make_attack(a, est.classifier, est.eps, est.attack_max_iter, est.batch_size)
        for a in est.attacks
    ]
    labels = [attack_label(a) for a in attacks]
    if len(set(labels)) != len(labels):
        raise ValueError(f"attacks must be distinct (one result per attack), got {labels}")
    return attacks


def build_influence(est: Any) -> InfluenceEstimator:
    """:return: The influence estimator of an estimator's ``influence`` (a name is built from its parameters)."""
    if isinstance(est.influence, InfluenceEstimator):
        return est.influence
    if est.influence == "ntk":
        return get_influence(
            "ntk",
            ridge=est.ridge if isinstance(est.ridge, str) else float(est.ridge),
            device=est.device,
            projection_dim=est.projection_dim,
            projection_seed=int(est.seed),
            distributed=est.distributed,
            verbose=est.verbose,
            memory_limit_gb=est.memory_limit_gb,
            exact_budget_s=est.time_budget_s,
        )
    return get_influence(est.influence, loss=loss_name(est.classifier), device=est.device)


def _check_attacks(attacks: object) -> tuple[str | EvasionAttack, ...]:
    """:return: ``attacks`` as a non-empty tuple of attack names and ART ``EvasionAttack`` instances."""
    if isinstance(attacks, (str, EvasionAttack)):
        attacks = (attacks,)
    if not isinstance(attacks, (list, tuple)):
        raise TypeError(
            f"attacks must be an attack name, an ART EvasionAttack or a sequence of them, got {type(attacks).__name__}"
        )
    if not attacks:
        raise ValueError("attacks must name at least one attack, got an empty sequence")
    for a in attacks:
        if not isinstance(a, (str, EvasionAttack)):
            raise TypeError(
                f"attacks must hold names {ATTACK_NAMES} or ART EvasionAttack instances, got {type(a).__name__}"
            )
        if isinstance(a, str) and a not in ATTACK_NAMES:
            raise ValueError(f"attacks must name one of {ATTACK_NAMES}, got {a!r}")
    return tuple(attacks)


def _positive_number(name: str, value: object) -> float:
    """:return: ``value`` as a float, once checked to be a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be a positive number, got {type(value).__name__} {value!r}")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)
