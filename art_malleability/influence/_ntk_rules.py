"""
The rules of :class:`~art_malleability.influence.NTKInfluence`'s parameters, declared once
(:mod:`art_malleability._utils.params`): its ``_parameter_rules`` is :data:`NTK_RULES`, which the constructor,
:meth:`~art_malleability.influence.NTKInfluence.plan` and the audit's own ``ridge``, ``projection_dim``,
``memory_limit_gb`` and ``distributed`` check through (the audit's table uses the same rule objects).
"""

from __future__ import annotations

import math
import os

from art_malleability._utils.params import (
    DISTRIBUTED,
    MEMORY_LIMIT_GB,
    NON_NEGATIVE_INT,
    NTK_MODE,
    Rule,
    RuleTable,
    is_int,
    is_number,
    optional,
)
from art_malleability.influence.base import InfluenceEstimator
from art_malleability.influence.ridge_choice import RIDGE
from art_malleability.ntk.empirical import METHOD

#: Seconds of estimated work: a non-negative finite number (``0``: never the exact mode under ``"auto"``).
NON_NEGATIVE_SECONDS = Rule("be a non-negative number of seconds",
                            lambda v: is_number(v) and math.isfinite(float(v)) and v >= 0)

#: Every parameter of :class:`~art_malleability.influence.NTKInfluence` and its rule (its base's included).
NTK_RULES: RuleTable = {
    **InfluenceEstimator._parameter_rules,
    "ridge": RIDGE,
    "method": METHOD,
    "projection_dim": NTK_MODE,
    "projection_seed": Rule("be an integer", is_int),
    "max_exact_n": optional(NON_NEGATIVE_INT),
    "memory_limit_gb": MEMORY_LIMIT_GB,
    "exact_budget_s": NON_NEGATIVE_SECONDS,
    "planned_refits": NON_NEGATIVE_INT,
    "planned_queries": NON_NEGATIVE_INT,
    "distributed": DISTRIBUTED,
    "tile_folder": optional(Rule("be an existing folder or None", os.path.isdir, show=lambda v: repr(str(v)))),
}
