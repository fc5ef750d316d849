"""
The parameters of :class:`~art_malleability.audit.estimator.MalleabilityEstimator`: their names, their validation, and
the attacks and the influence estimator built from them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from art.attacks import EvasionAttack

from art_malleability._utils.checks import SignatureParams, loss_name
from art_malleability._utils.params import (
    BOOL,
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    DEVICE,
    DISTRIBUTED,
    MEMORY_LIMIT_GB,
    N_QUERIES,
    NTK_MODE,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    RANK_BY,
    SEED,
    TOP_FRACTION,
    WORK_DIR,
    InvalidParameterError,
    Rule,
    RuleTable,
    check_value,
    check_values,
    invalid,
    one_of,
)
from art_malleability._utils.torch_utils import total_memory
from art_malleability.audit.attacks import (
    ATTACK,
    ATTACK_NAMES,
    STRATEGIES,
    attack_label,
    attack_labels,
    control_eps,
    make_attack,
)
from art_malleability.influence import INFLUENCE, InfluenceEstimator, NTKInfluence, get_influence
from art_malleability.influence.ntk import MEMORY_SHARE
from art_malleability.influence.ridge_choice import RIDGE
from art_malleability.metrics.accumulators import metrics_plan

logger = logging.getLogger(__name__)

#: The most queries the default (``n_queries=None``) takes: the whole test split of MNIST, Fashion-MNIST and CIFAR-10.
#: Beyond it the aggregates' standard errors shrink only as one over the root of the queries while every statistic's
#: cost keeps growing linearly (docs/metrics.md measures the undecided share against the number of queries).
DEFAULT_MAX_QUERIES = 10_000


#: Projection seeds of a projected influence (the audit's and the next ones): their spread is the projection's noise.
#: Two cost one extra clean fit; the noise model is a regression over every training example, so two seeds suffice.
PROJECTION_SEEDS = 2


def default_queries(n_queries: int | None) -> int:
    """:return: The most queries an audit takes: ``n_queries``, or :data:`DEFAULT_MAX_QUERIES` for ``None``."""
    return DEFAULT_MAX_QUERIES if n_queries is None else int(n_queries)


#: Constructor arguments of :class:`~art_malleability.audit.estimator.MalleabilityEstimator` that build its classifier;
#: every other one is a parameter of the audit (its ``estimator_params``, read from the signature).
CLASSIFIER_ARGS = ("classifier", "input_shape", "nb_classes", "loss", "clip_values", "model_name")

#: The audit's parameters that only configure the NTK influence it builds from the name ``"ntk"``, by the
#: :class:`~art_malleability.influence.NTKInfluence` parameter they set. Given a configured ``NTKInfluence`` instead,
#: the audit reads them from it (so that :meth:`get_params` describes what runs).
NTK_PASS_THROUGH = {"ridge": "ridge", "projection_dim": "projection_dim", "time_budget_s": "exact_budget_s"}


def _check_attacks(attacks: object, name: str) -> tuple[str | EvasionAttack, ...]:
    """The rule of ``attacks``: a non-empty tuple of attack names and ART ``EvasionAttack`` instances."""
    if isinstance(attacks, (str, EvasionAttack)):
        attacks = (attacks,)
    if not isinstance(attacks, (list, tuple)):
        raise invalid(name, "be an attack name, an ART EvasionAttack or a sequence of them", type(attacks).__name__,
                      type_error=True)
    if not attacks:
        raise invalid(name, "name at least one attack", "an empty sequence")
    for a in attacks:
        if not isinstance(a, (str, EvasionAttack)):
            raise invalid(name, f"hold names {ATTACK_NAMES} or ART EvasionAttack instances", type(a).__name__,
                          type_error=True)
        if isinstance(a, str):
            ATTACK(a, name)
    return tuple(attacks)


_check_attacks.must = (  # type: ignore[attr-defined] - the rule's words (the page of parameter rules reads them)
    f"be an attack name of {ATTACK_NAMES}, an ART EvasionAttack or a non-empty sequence of them"
)


def _check_eps(eps: object, name: str) -> float | tuple[float, ...]:
    """The rule of ``eps``: a positive finite number (a float), or a non-empty sequence of distinct ones (a tuple)."""
    if isinstance(eps, (list, tuple)):
        if not eps:
            raise invalid(name, "name at least one budget", list(eps))
        budgets = tuple(check_value(POSITIVE_NUMBER, e, name) for e in eps)
        if len(set(budgets)) != len(budgets):
            raise invalid(name, "hold distinct budgets (each one once)", list(eps))
        return budgets[0] if len(budgets) == 1 else budgets
    return check_value(POSITIVE_NUMBER, eps, name)


_check_eps.must = (  # type: ignore[attr-defined] - the rule's words (the page of parameter rules reads them)
    "be a positive number, or a non-empty sequence of distinct positive numbers (an audit at each budget)"
)


#: The influence: the influence package's rule (:data:`~art_malleability.influence.INFLUENCE`), in its words, after a
#: type check that makes a value neither a name nor an estimator a ``TypeError`` too.
_INFLUENCE = (
    Rule(INFLUENCE.must, lambda v: isinstance(v, (str, InfluenceEstimator)), type_error=True),
    INFLUENCE,
)

#: Every parameter's rule, in the manner of scikit-learn's ``_parameter_constraints``: the constructor, ``set_params``
#: and the command line's ``audit`` check through it. The attacks become a tuple, the numbers floats or ints.
PARAMETER_RULES: RuleTable = {
    "attacks": _check_attacks,
    "eps": _check_eps,
    "influence": _INFLUENCE,
    "top_fraction": TOP_FRACTION,
    "strategy": one_of(STRATEGIES),
    "ridge": RIDGE,
    "rank_by": RANK_BY,
    "n_bootstrap": BOOTSTRAP_RESAMPLES,
    "attack_max_iter": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "control_draws": POSITIVE_INT,
    "n_queries": N_QUERIES,
    "confidence": CONFIDENCE,
    "seed": SEED,
    "device": DEVICE,
    "projection_dim": NTK_MODE,
    "distributed": DISTRIBUTED,
    "controls": BOOL,
    "memory_limit_gb": MEMORY_LIMIT_GB,
    "time_budget_s": POSITIVE_NUMBER,
    "work_dir": WORK_DIR,
}


def check_params(est: Any) -> None:
    """
    Validate the parameters of an estimator against :data:`PARAMETER_RULES` and keep their normalised values
    (``attacks`` a tuple, ``eps`` a float or a tuple of them, ...).

    :param est: A :class:`~art_malleability.audit.estimator.MalleabilityEstimator` being configured.
    :raises InvalidParameterError: Naming the first invalid parameter (a ``ValueError``; also a ``TypeError`` for a
        value of the wrong type).
    """
    checked = check_values(PARAMETER_RULES, {name: getattr(est, name) for name in PARAMETER_RULES})
    check_eps_range(est.classifier, checked["attacks"], checked["eps"])
    for name, value in checked.items():
        object.__setattr__(est, name, value)
    if isinstance(est.influence, NTKInfluence):
        adopt_influence_params(est, est.influence)


def check_eps_range(classifier: Any, attacks: tuple, eps: float | tuple[float, ...]) -> None:
    """
    An ℓ∞ budget that covers the whole valid input range is a unit mistake (8 meant as 8/255), not an audit: refused
    where the parameters are checked (construction, ``set_params``), so that an invalid ``eps`` changes nothing.

    :raises InvalidParameterError: Naming ``eps``.
    """
    clip = classifier.clip_values
    named = any(isinstance(a, str) for a in attacks)
    if clip is None or not named:
        return
    whole = float(np.max(np.asarray(clip[1]) - np.asarray(clip[0])))
    for budget in eps if isinstance(eps, tuple) else (eps,):
        if budget >= whole:
            raise InvalidParameterError(
                "eps", f"be smaller than the classifier's whole input range clip_values={tuple(map(float, clip))}",
                f"{budget:g}", "; give eps in the input's units (e.g. 8/255, not 8)")


def adopt_influence_params(est: Any, influence: NTKInfluence) -> None:
    """
    With a configured :class:`~art_malleability.influence.NTKInfluence`, its settings are the audit's: the audit's
    pass-through parameters (:data:`NTK_PASS_THROUGH`) take the influence's values, with a warning where a value other
    than the default was given and differs.
    """
    import inspect

    defaults = inspect.signature(type(est).__init__).parameters
    for name, own in NTK_PASS_THROUGH.items():
        value, theirs = getattr(est, name), getattr(influence, own)
        if value != theirs and value != defaults[name].default:
            logger.warning("%s=%r is replaced by the given influence's %s=%r (the influence's settings apply)",
                           name, value, own, theirs)
        object.__setattr__(est, name, theirs)


class AuditParams:
    """
    ART's parameter contract of :class:`~art_malleability.audit.estimator.MalleabilityEstimator`: ``estimator_params``
    read from the constructor's signature, ``set_params`` / ``get_params``, assignment as ``set_params``, and the
    attacks and influence estimator rebuilt from the parameters after every change.
    """

    #: The audit's parameters, read from the constructor's signature (all but what builds the classifier).
    estimator_params = SignatureParams(leave_out=CLASSIFIER_ARGS)

    def __setattr__(self, name: str, value: Any) -> None:
        # after construction, assigning a parameter is set_params: validated, and what depends on it rebuilt; a new
        # public name is refused, as set_params refuses it (a typo such as ``epsilon`` would otherwise do nothing)
        configured = self.__dict__.get("_configured", False)
        if name in self.estimator_params and configured:
            self.set_params(**{name: value})
        elif configured and not name.startswith("_") and name not in self.__dict__ and not hasattr(type(self), name):
            import difflib

            close = difflib.get_close_matches(name, self.estimator_params, n=1)
            raise AttributeError(
                f"{type(self).__name__} attribute must be one of its parameters {self.estimator_params}, got the "
                f"unknown name {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
            )
        else:
            object.__setattr__(self, name, value)

    def set_params(self, **kwargs: Any) -> None:
        """
        Set parameters, ART's way: the values are checked against their rules (:data:`PARAMETER_RULES`) and the
        attacks and the influence estimator rebuilt, so that ``evaluate`` runs what :meth:`get_params` describes.
        Assigning an attribute (``estimator.eps = 0.1``) does the same. On an invalid value nothing changes.

        :param kwargs: Parameters named in :attr:`estimator_params`.
        :raises ValueError: On an unknown name or an invalid value (an
            :class:`~art_malleability._utils.params.InvalidParameterError` naming it; also a ``TypeError`` for a value
            of the wrong type).
        """
        unknown = sorted(set(kwargs) - set(self.estimator_params))
        if unknown:
            raise ValueError(
                f"set_params arguments must be among {self.estimator_params}, got unknown parameter(s) {unknown}"
            )
        saved = dict(self.__dict__)
        try:
            for name, value in kwargs.items():
                object.__setattr__(self, name, value)
            self._configure()
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def get_params(self) -> dict[str, Any]:
        """:return: The estimator's parameters as JSON-ready values (attacks and influence by name)."""
        params = {name: getattr(self, name) for name in self.estimator_params}
        params["attacks"] = [a if isinstance(a, str) else attack_label(a) for a in self.attacks]
        params["influence"] = getattr(self._influence, "name", type(self._influence).__name__)
        return params

    def _configure(self) -> None:
        """Check the parameters (:meth:`_check_params`), then build the attacks and the influence estimator."""
        object.__setattr__(self, "_configured", False)
        self._check_params()
        self._attacks = build_attacks(self)
        self._influence = build_influence(self)
        object.__setattr__(self, "_configured", True)

    def _check_params(self) -> None:
        """ART's parameter check: :func:`check_params`."""
        check_params(self)


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
    :raises InvalidParameterError: Naming ``n_queries`` when it does not fit, or ``memory_limit_gb`` when no number of
        queries would fit the limit.
    """
    plan = metrics_plan(n_query, n_train, k, n_bootstrap, excluded_pairs)
    budget = float(memory_limit_gb) * 2**30 if memory_limit_gb is not None else MEMORY_SHARE * total_memory(device)
    if plan["memory_bytes"] > budget:
        fixed = metrics_plan(0, n_train, k, n_bootstrap, excluded_pairs)["memory_bytes"]
        per_query = max((plan["memory_bytes"] - fixed) / max(n_query, 1), 1.0)
        fits = int(max(budget - fixed, 0) // per_query)
        two = metrics_plan(2, n_train, k, n_bootstrap, excluded_pairs)["memory_bytes"]
        if two > budget and memory_limit_gb is not None:  # no number of queries would do: the limit is what to change
            raise InvalidParameterError(
                "memory_limit_gb", "leave room for the metrics of at least two queries (every interval resamples "
                "them)", f"{float(memory_limit_gb):g}", f": their fixed part alone needs {fixed / 2**30:.2f} GiB and "
                f"each query {per_query / 2**30:.3g} GiB (n_train {n_train}, n_bootstrap {n_bootstrap}); raise it to "
                f"at least {math.ceil(two / 2**30 * 100) / 100:.2f} GiB")  # rounded up: it fits
        raise InvalidParameterError(
            "n_queries", f"leave the audit's metrics within the memory budget of {budget / 2**30:.1f} GiB",
            f"{n_query} queries", f", whose metrics need {plan['memory_bytes'] / 2**30:.1f} GiB (n_train {n_train}, "
            f"n_bootstrap {n_bootstrap}); pass at most about {fits} queries, or fewer bootstrap resamples",
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
    """
    :return: The ART attacks of an estimator's ``attacks``, distinct: a named one built on its classifier at each of
        its budgets ``eps`` (one attack per name and budget, in the order of the names), a given one as it is.
    """
    budgets = est.eps if isinstance(est.eps, tuple) else (est.eps,)
    attacks = [
        made
        for a in est.attacks
        for made in ([a] if isinstance(a, EvasionAttack) else
                     [make_attack(a, est.classifier, e, est.attack_max_iter, est.batch_size) for e in budgets])
    ]
    labels = attack_labels(attacks)
    if len(set(labels)) != len(labels):
        raise ValueError(f"attacks must be distinct (one result per attack), got {labels}")
    return attacks


def build_influence(est: Any) -> InfluenceEstimator:
    """:return: The influence estimator of an estimator's ``influence`` (a name is built from its parameters)."""
    if isinstance(est.influence, InfluenceEstimator):
        return est.influence
    if est.influence == "ntk":
        passed = {own: getattr(est, name) for name, own in NTK_PASS_THROUGH.items()}
        if not isinstance(passed["ridge"], str):
            passed["ridge"] = float(passed["ridge"])
        return get_influence(
            "ntk", **passed, device=est.device, projection_seed=int(est.seed), distributed=est.distributed,
            verbose=est.verbose, memory_limit_gb=est.memory_limit_gb,
        )
    return get_influence(est.influence, loss=loss_name(est.classifier), device=est.device)
