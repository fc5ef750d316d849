"""
Influence estimators behind one interface: ``fit(model, x_train, y_train)`` then
``scores(x_query, y_query)`` -> ``(n_query, n_train)`` float64 matrix, **positive = helpful**
(removing the training example would raise the query's loss); in Captum's terms also
``influence(x_query, y_query, k=None, proponents=True)`` (all scores, or the ``k`` most influential
training examples per query) and ``self_influence()``.

- ``"ntk"`` (:class:`NTKInfluence`): exact leave-one-out of kernel ridge regression on the
  empirical NTK (the paper's estimator);
- ``"gradient"`` (:class:`GradientInfluence`): TracIn-CP gradient similarity with per-layer
  factorisation;
- ``"captum"`` (:class:`CaptumInfluence`): adapter over ``captum.influence.TracInCP``.
"""

from __future__ import annotations

import logging

from art_malleability._utils.params import Rule
from art_malleability.influence.base import (
    LOSS_NAMES,
    InfluenceEstimator,
    KMostInfluential,
    k_most_influential,
    labels_to_indices,
    per_example_loss,
)
from art_malleability.influence.captum_tracin import CaptumInfluence
from art_malleability.influence.gradient import GradientInfluence
from art_malleability.influence.ntk import NTKInfluence

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[InfluenceEstimator]] = {
    "ntk": NTKInfluence,
    "gradient": GradientInfluence,
    "captum": CaptumInfluence,
}

INFLUENCE_NAMES: tuple[str, ...] = tuple(_REGISTRY)

#: The rule of an influence estimator: one of :data:`INFLUENCE_NAMES` or an :class:`InfluenceEstimator` instance.
INFLUENCE = Rule(
    f"be one of {', '.join(map(repr, INFLUENCE_NAMES))} or an InfluenceEstimator instance",
    lambda v: isinstance(v, InfluenceEstimator) or (isinstance(v, str) and v in _REGISTRY),
)


def get_influence(name_or_obj: str | InfluenceEstimator, **kwargs: object) -> InfluenceEstimator:
    """
    Influence estimator by name, or an estimator instance passed through unchanged.

    :param name_or_obj: ``"ntk"``, ``"gradient"``, ``"captum"`` or an :class:`InfluenceEstimator`.
    :param kwargs: Constructor arguments for the named estimator (ignored for an instance).
    :return: The estimator.
    :raises InvalidParameterError: For any other value (the rule :data:`INFLUENCE`, naming ``influence``; a
        ``ValueError``).
    """
    INFLUENCE(name_or_obj, "influence")
    if isinstance(name_or_obj, InfluenceEstimator):
        if kwargs:
            logger.debug("get_influence: ignoring %s for an estimator instance", sorted(kwargs))
        return name_or_obj
    return _REGISTRY[name_or_obj](**kwargs)


__all__ = [
    "INFLUENCE",
    "INFLUENCE_NAMES",
    "LOSS_NAMES",
    "CaptumInfluence",
    "GradientInfluence",
    "InfluenceEstimator",
    "KMostInfluential",
    "NTKInfluence",
    "get_influence",
    "k_most_influential",
    "labels_to_indices",
    "per_example_loss",
]
