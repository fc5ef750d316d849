"""
Why a value of an audit report is ``null``: every ``null`` in ``report.json`` comes with a reason under
``null_reasons`` (its path, as ``results[0].flip_rate_ci[1]``, to one sentence), so a reader never has to guess
whether a missing number means "not run", "not defined" or "not measurable".
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from art_malleability.audit.params import DEFAULT_MAX_QUERIES
from art_malleability.metrics import MIN_INTERVAL_QUERIES

#: Reasons of the fields that are ``null`` by what the run was given or how it ran.
_FIELDS = {
    "dataset": "no data set name was given to evaluate (dataset=...)",
    "fidelity": "no validation of these weights was given (evaluate(validation=...), audit --validation); a "
    "validation that did not match them is named in the warnings",
    "clean_accuracy": "no query point had a label to score the predictions against",
    "execution.backend": "one process: no torch.distributed process group ran the audit",
    "execution.params.memory_limit_gb": "no memory limit was set: the estimator plans within 80 % of the device's "
    "total memory",
    "config.memory_limit_gb": "no memory limit was set: the audit plans within 80 % of the device's total memory",
    "config.work_dir": "no work folder was set (work_dir=None, --no-work-dir): no finished stage was kept for a rerun",
    "config.n_queries": f"n_queries=None, the default: every test point is a query (at most {DEFAULT_MAX_QUERIES:,}, "
    "drawn with the seed beyond), or as many training examples when no test set was given; n_queries at the top "
    "level is the number taken",
    "config.model.weights": "no weights file was given (--weights): the command trained the model with the settings "
    "beside it",
    "execution.params.max_exact_n": "no cap on the exact mode's training set size was set: its estimated time "
    "(exact_budget_s) decides",
    "execution.params.tile_folder": "no tile folder was set: an out-of-core exact solve would use the system's "
    "temporary folder",
    "noise_model.projection_seeds": "the influence estimator is deterministic in this run (not a random "
    "projection): no other projection seed was compared",
    "noise_model.seed_agreement": "the influence estimator is deterministic in this run (not a random projection): "
    "there is no projection seed to agree with",
    "noise_model.projection_sd": "the influence estimator is deterministic in this run (not a random projection): "
    "its scores carry query noise only",
}

#: Why the noise-aware rate and what its deconvolution gives beside it are null.
_NOISE_AWARE = (f"the influential set is empty, fewer than {MIN_INTERVAL_QUERIES} queries (the deconvolution of the "
                "members' covariances would under-cover), or no member has finite scores before and after")

#: Reasons of a ``null`` statistic, by name (the value itself; its interval has its own reasons).
_STATISTICS = {
    "flip_rate": "the influential set is empty, or no member has a finite score before and after",
    "flip_rate_above_floor": _NOISE_AWARE,
    "flip_rate_null": _NOISE_AWARE,
    "undecided_share": _NOISE_AWARE,
    "no_flip_statistic": _NOISE_AWARE,
    "per_query_flip_rate": "no query has a non-empty influential set with finite scores",
    "spearman": "fewer than two finite score pairs, or the scores on one side are constant",
    "top_k_jaccard": "both influential sets are empty",
    "attack_success": "no training example was perturbed, so no prediction could change",
    "excess_flip_rate": "the attack's or the control's flip rate is undefined",
    "signed_retention": "not a share of influence kept here: the influential set's clean influence (corrected for "
    "its selection) is not positive, not distinguishable from zero at the report's confidence (the ratio's interval "
    "would be unbounded), or under a tenth of its perturbed influence (|retention| over 10: queries drawn from a "
    "training set the model fits have clean scores near zero); docs/metrics.md",
    "excess_retention": "the attack's or the control's signed retention is undefined",
}


def null_reasons(data: dict[str, Any]) -> dict[str, str]:
    """
    :param data: An audit report's ``to_dict()`` (without ``null_reasons``).
    :return: The path of every ``null`` in it, to the reason it is ``null``.
    """
    reasons = {}
    for path in _null_paths(data, ""):
        reasons[path] = _reason(path, data)
    return reasons


def _null_paths(value: Any, path: str) -> Iterator[str]:
    if value is None:
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _null_paths(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _null_paths(item, f"{path}[{i}]")


def _reason(path: str, data: dict[str, Any]) -> str:
    if path in _FIELDS:
        return _FIELDS[path]
    if re.fullmatch(r"scores_(before|after)\[\d+\]|results\[\d+\]\.scores_after\[\d+\]", path):
        return "no query gave this example a finite score (a query's score on itself is excluded)"
    match = re.fullmatch(r"results\[(\d+)\]\.(.+)", path)
    if match is None:
        return "not recorded by this run"
    result = data["results"][int(match.group(1))]
    rest = match.group(2)
    if rest.startswith("params."):
        return f"the attack's parameter {rest[len('params.'):]!r} is None: ART's default for it"
    if rest == "control":
        if not data.get("config", {}).get("controls", True):
            return "controls=False (audit --no-controls): no random-sign control was run"
        return "the attack has no l-inf budget to match, so no random-sign control was run beside it"
    if rest.startswith("excess_") and result.get("control") is None:
        return "no random-sign control was run beside this attack, so there is no excess over it"
    control = re.fullmatch(r"control\.(.+)", rest)
    if control is not None:
        rest, result = control.group(1), result["control"]
    interval = re.fullmatch(r"(\w+)_ci\[[01]\]", rest)
    if interval is not None:
        return _interval_reason(interval.group(1), result, data)
    if rest in ("signed_retention", "excess_retention") and not data.get("top_k"):
        return "the influential set is empty, so it has no influence to keep"
    return _STATISTICS.get(rest, "not recorded by this run")


def _interval_reason(statistic: str, result: dict[str, Any], data: dict[str, Any]) -> str:
    n = data.get("n_queries", MIN_INTERVAL_QUERIES)
    if n < MIN_INTERVAL_QUERIES:
        return (f"{'a single query point' if n == 1 else f'{n} queries'}: the interval resamples the queries and "
                f"needs at least {MIN_INTERVAL_QUERIES} (fewer would under-cover)")
    if result.get(statistic) is None:
        return "the statistic itself is undefined (see its own reason), so it has no interval"
    return "fewer than two bootstrap resamples (or jackknife groups) of the queries gave the statistic a finite value"
