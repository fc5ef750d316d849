"""
The typed results of the metrics: an audit's JSON built from them is key for key and value for value the one written
from the metrics dicts of earlier versions (reproduced here as they were), their compatibility key access, and the
dataclasses themselves.
"""

import hashlib
import json
import pickle
import warnings
from dataclasses import FrozenInstanceError, asdict, replace

import numpy as np
import pytest

from art_malleability import metrics as M
from art_malleability._utils.io import json_ready
from art_malleability.audit.report import AttackResult, control_summary
from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics.accumulators import CleanScores, PerturbedScores

CONFIDENCE, N_BOOTSTRAP, SEED, NOISE = 0.9, 30, 7, (0.01, 0.1)
KINDS = {"flip_rate": "bootstrap", "top_k_jaccard": "bootstrap", "spearman": "jackknife",
         "signed_retention": "bootstrap"}
LOADINGS = "signed_retention_eb_loadings"

#: The keys of one attack's result in report.json and of its control, in their order (as written before the types).
RESULT_KEYS = [
    "attack", "params", "n_perturbed", "attack_success", "max_perturbation", "flip_rate", "flip_rate_ci",
    "per_query_flip_rate", "per_query_flip_rate_ci", "spearman", "spearman_ci", "top_k_jaccard", "top_k_jaccard_ci",
    "scores_after", "seconds", "flip_rate_above_floor", "flip_rate_above_floor_ci", "counted_flips",
    "undecided_members", "control", "excess_flip_rate", "excess_flip_rate_ci", "flip_rate_null", "no_flip_statistic",
    "undecided_share", "signed_retention", "signed_retention_ci", "excess_retention", "excess_retention_ci", "examples",
]
CONTROL_KEYS = [
    "perturbation", "eps", "draws", "flip_rate_null", "flip_rate", "flip_rate_ci", "flip_rate_above_floor",
    "flip_rate_above_floor_ci", "spearman", "spearman_ci", "top_k_jaccard", "top_k_jaccard_ci", "signed_retention",
    "signed_retention_ci",
]


# ---------------------------------------------------------------- the dicts of earlier versions, as they were built
def _old_eb_variance(name, draws):
    if name != "signed_retention" or LOADINGS not in draws:
        return 0.0
    loadings = np.asarray(draws[LOADINGS], dtype=np.float64)
    return float(np.sum(loadings**2)) if np.isfinite(loadings).all() else float("nan")


def _old_interval(name, point, replicates, extra):
    if KINDS[name] == "jackknife":
        return M.jackknife_interval(point, replicates, CONFIDENCE, M.BOUNDS[name], extra)
    return M.normal_interval(point, replicates, CONFIDENCE, M.BOUNDS[name], extra_variance=extra,
                             variance_factor=M.VARIANCE_FACTOR.get(name, 1.0))


def _old_pass(perturbed, control=None):
    clean = perturbed.clean
    result, draws = M.replicated(perturbed)
    for name in KINDS:
        result[name + "_ci"] = _old_interval(name, result[name], draws[name], _old_eb_variance(name, draws))
    per_query = perturbed.per_query.numpy()
    result["per_query_flip_rate"] = float(per_query[np.isfinite(per_query)].mean())
    result["per_query_flip_rate_ci"] = M.t_interval(per_query, CONFIDENCE, M.BOUNDS["per_query_flip_rate"])
    posterior = FlipPosterior(perturbed.paired_sums(), clean.threshold(True), clean.rank_by, NOISE)
    result.update({
        "flip_rate_above_floor": posterior.estimate(), "flip_rate_above_floor_ci": posterior.interval(CONFIDENCE),
        "flip_rate_null": posterior.null_raw_flip_rate(), "no_flip_statistic": posterior.no_flip_statistic(),
        "undecided_share": posterior.undecided_share(),
        "counted_flips": clean.top[np.nan_to_num(posterior.flip_probabilities()) >= 0.5].tolist(),
        "undecided_members": clean.top[posterior.undecided_members()].tolist(),
    })
    if control is not None:
        for excess, name in (("excess_flip_rate", "flip_rate"), ("excess_retention", "signed_retention")):
            result[excess] = result[name] - control[name]
            between = control["draw_variance"][name] / control["n_draws"]
            difference = {key: draws[key] - control["draws"][key] for key in (name, LOADINGS)}
            result[excess + "_ci"] = M.normal_interval(result[excess], difference[name], CONFIDENCE, M.BOUNDS[excess],
                                                       extra_variance=between + _old_eb_variance(name, difference))
    rows = M.resample_rows(clean.n_query, N_BOOTSTRAP, SEED).astype(np.int64)
    result["draws"] = draws
    result["resamples"] = {"seed": SEED, "n_bootstrap": N_BOOTSTRAP,
                           "digest": hashlib.sha256(rows.tobytes()).hexdigest()}
    return result


def _old_combine(draws):
    n = len(draws)
    combined = {"n_draws": n, "resamples": draws[0]["resamples"], "draws": {}, "draw_variance": {}}
    for name in ("flip_rate", "flip_rate_null", "flip_rate_above_floor", "per_query_flip_rate", *KINDS):
        values = np.array([d[name] for d in draws], dtype=np.float64)
        combined[name] = float(np.nanmean(values))
        combined["draw_variance"][name] = float(np.nanvar(values, ddof=1))
    combined["draws"][LOADINGS] = np.mean([d["draws"][LOADINGS] for d in draws], axis=0)
    for name in KINDS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_draws = np.nanmean(np.stack([d["draws"][name] for d in draws]), axis=0)
        combined["draws"][name] = mean_draws
        extra = combined["draw_variance"][name] / n + _old_eb_variance(name, combined["draws"])
        combined[name + "_ci"] = _old_interval(name, combined[name], mean_draws, extra)
    lows = [d["flip_rate_above_floor_ci"][0] for d in draws]
    highs = [d["flip_rate_above_floor_ci"][1] for d in draws]
    combined["flip_rate_above_floor_ci"] = (float(np.min(lows)), float(np.max(highs)))
    combined["per_query_flip_rate_ci"] = (float("nan"), float("nan"))
    return combined


def _old_control_summary(control, eps):
    summary = {"perturbation": "random-sign", "eps": eps, "draws": control["n_draws"],
               "flip_rate_null": control["flip_rate_null"]}
    for name in ("flip_rate", "flip_rate_above_floor", "spearman", "top_k_jaccard", "signed_retention"):
        summary[name], summary[name + "_ci"] = control[name], control[name + "_ci"]
    return summary


# ---------------------------------------------------------------- the fixed problem
def _assert_same(old, new, path="metrics"):
    """Key for key, value for value (floats bit for bit, NaN equal to NaN), tuples and lists as they were."""
    if isinstance(old, dict):
        assert isinstance(new, dict) and set(old) == set(new), (path, set(old) ^ set(new))
        for key in old:
            _assert_same(old[key], new[key], f"{path}.{key}")
    elif isinstance(old, (list, tuple)):
        assert type(old) is type(new) and len(old) == len(new), (path, old, new)
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(old, np.ndarray):
        np.testing.assert_array_equal(old, new, err_msg=path)
    elif isinstance(old, str):
        assert old == new, path
    else:
        assert float(old) == float(new) or (np.isnan(old) and np.isnan(new)), (path, old, new)


@pytest.fixture(scope="module")
def passes():
    """One clean pass, two control draws and an attack against it, as an audit runs them."""
    rng = np.random.default_rng(3)
    n_query, n_train = 24, 70
    before = rng.normal(size=(n_query, n_train)) + rng.normal(size=n_train)
    before[2, 9] = np.nan  # a self-pair
    clean = CleanScores(M.QueryResampling(n_query, N_BOOTSTRAP, SEED), n_train, 0.1, "abs")
    clean.add(before)
    clean.finish()
    out = []
    for factor, scale in ((0.7, 0.6), (0.7, 0.8), (-0.5, 1.0)):  # two control draws, an attack that flips signs
        perturbed = PerturbedScores(clean)
        perturbed.add(factor * before + scale * rng.normal(size=before.shape))
        out.append(perturbed)
    return out


def test_the_metrics_hold_the_values_of_the_earlier_dicts(passes):
    *control_passes, attack_pass = passes
    draws = [M.pass_metrics(p, CONFIDENCE, NOISE, keep_draws=True) for p in control_passes]
    old_draws = [_old_pass(p) for p in control_passes]
    for new, old in zip(draws, old_draws, strict=True):
        _assert_same(old, new.to_dict())
    control, old_control = M.combine_controls(draws, CONFIDENCE), _old_combine(old_draws)
    _assert_same(old_control, control.to_dict())
    attack = M.pass_metrics(attack_pass, CONFIDENCE, NOISE, control, keep_draws=True)
    _assert_same(_old_pass(attack_pass, old_control), attack.to_dict())
    assert np.isfinite(attack.excess_retention.value) and attack.counted_flips  # the fixture exercises every key


def test_an_attack_result_from_the_metrics_writes_the_earlier_json(passes):
    """The result's JSON, key for key (in order) and value for value, as run_attack wrote it from the dicts."""
    *control_passes, attack_pass = passes
    draws = [M.pass_metrics(p, CONFIDENCE, NOISE, keep_draws=True) for p in control_passes]
    control = M.combine_controls(draws, CONFIDENCE)
    metrics = M.pass_metrics(attack_pass, CONFIDENCE, NOISE, control, keep_draws=True)
    details = dict(attack="pgd", params={"eps": np.float32(0.3)}, n_perturbed=7, attack_success=0.5,
                   max_perturbation=0.3, scores_after=attack_pass.aggregates(), seconds={"attack": 1.5})
    new = AttackResult.from_metrics(metrics, control_summary(control, 0.3, "random-sign"), **details)

    old_metrics = _old_pass(attack_pass, _old_combine([_old_pass(p) for p in control_passes]))
    for internal in ("draws", "resamples"):
        old_metrics.pop(internal)
    old_control = _old_control_summary(_old_combine([_old_pass(p) for p in control_passes]), 0.3)
    old = AttackResult(**details, control=old_control, **old_metrics)

    assert json.dumps(asdict(new)) == json.dumps(asdict(old))
    assert list(asdict(new)) == RESULT_KEYS and list(new.control) == CONTROL_KEYS
    assert new == AttackResult(**json.loads(json.dumps(asdict(new))))  # what MalleabilityReport.load reads


def test_a_result_without_a_control_leaves_the_excesses_undefined(passes):
    metrics = M.pass_metrics(passes[0], CONFIDENCE)
    result = AttackResult.from_metrics(metrics, None, attack="fgsm", params={}, n_perturbed=1, attack_success=None,
                                       max_perturbation=0.1, scores_after=[0.0], seconds={})
    assert result.control is None and result.excess_flip_rate is None and result.excess_retention_ci == [None, None]
    assert result.flip_rate == metrics.flip_rate.value and result.flip_rate_ci == list(metrics.flip_rate.interval)
    assert result.flip_rate_above_floor == json_ready(metrics.noise_aware_flip_rate.value)


def test_the_compatibility_key_access_reads_to_dict(passes):
    kept = M.pass_metrics(passes[0], CONFIDENCE, keep_draws=True)
    plain = M.pass_metrics(passes[0], CONFIDENCE)
    assert plain["flip_rate"] == plain.flip_rate.value and plain["flip_rate_ci"] == plain.flip_rate.interval
    assert plain["flip_rate_above_floor"] == plain.noise_aware_flip_rate.value
    assert plain["counted_flips"] == list(plain.counted_flips)
    assert "draws" not in plain.to_dict() and "excess_flip_rate" not in plain.to_dict()
    np.testing.assert_array_equal(kept["draws"]["flip_rate"], kept.replicates.flip_rate)
    assert kept["resamples"] == asdict(kept.replicates.resamples) == {
        "seed": SEED, "n_bootstrap": N_BOOTSTRAP, "digest": kept.replicates.resamples.digest}
    assert set(kept.to_dict(replicates=False)) == set(plain.to_dict())
    with pytest.raises(KeyError, match="key must be one of .*got 'flip rate'"):
        plain["flip rate"]
    control = M.combine_controls([kept])
    assert control["n_draws"] == 1 and control["draw_variance"] == control.draw_variance


def test_the_results_are_frozen_compare_by_value_and_pickle(passes):
    """An audit broadcasts them between processes (pickled); equal replicates compare equal, NaN included."""
    first = M.pass_metrics(passes[1], CONFIDENCE, NOISE, keep_draws=True)
    second = M.pass_metrics(passes[1], CONFIDENCE, NOISE, keep_draws=True)
    assert first == second and pickle.loads(pickle.dumps(first)) == first
    control = M.combine_controls([first, second], CONFIDENCE)
    _assert_same(control.to_dict(), pickle.loads(pickle.dumps(control)).to_dict())  # its per-query interval is NaN
    with pytest.raises(FrozenInstanceError):
        first.flip_rate = M.Estimate(0.0, 0.0, 0.0)
    with pytest.raises(FrozenInstanceError):
        first.flip_rate.value = 0.0
    other = replace(first.replicates, flip_rate=first.replicates.flip_rate + 1.0)
    assert other != first.replicates and replace(first, replicates=other) != first
    nan = M.Replicates(first.replicates.resamples, np.array([np.nan]), np.array([1.0]), np.array([2.0]))
    assert nan == M.Replicates.from_draws(nan.draws(), nan.resamples) and nan.n_resamples == 1
    assert set(nan.draws()) == {"flip_rate", "top_k_jaccard", "signed_retention"}


def test_an_estimate_holds_python_floats():
    estimate = M.Estimate.of(np.float64(0.25), (np.float64(0.1), 0.4))
    assert estimate == M.Estimate(0.25, 0.1, 0.4) and estimate.interval == (0.1, 0.4)
    assert all(type(v) is float for v in asdict(estimate).values())
    assert all(np.isnan(v) for v in asdict(M.Estimate.undefined()).values())
