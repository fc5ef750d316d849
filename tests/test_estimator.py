"""MalleabilityEstimator end to end: results against an explicit recomputation, no mutation, bad input."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from art.attacks.evasion import FastGradientMethod
from art.estimators.classification import PyTorchClassifier
from art.exceptions import EstimatorError
from helpers import digits, trained_classifier
from scipy.stats import spearmanr

from art_malleability import MalleabilityEstimator, influence_flip_rate
from art_malleability.audit.attacks import random_sign_perturbation
from art_malleability.influence import InfluenceEstimator, NTKInfluence
from art_malleability.metrics import (
    aggregate_scores,
    flip_rate,
    noise_aware_flip_rate,
    spearman,
    top_indices,
)
from art_malleability.metrics._flip_posterior import projection_noise

FAST = {"n_queries": 15, "n_bootstrap": 50, "verbose": False, "device": "cpu"}


@pytest.fixture(scope="module")
def relu_clf():
    return trained_classifier("2l-relu")


@pytest.fixture(scope="module")
def attn_clf():
    return trained_classifier("mlp-attn")


@pytest.mark.parametrize("name", ["2l-relu", "mlp-attn"])
def test_fgsm_flip_rate_equals_explicit_recomputation(name, relu_clf, attn_clf):
    """The orchestration (top set, perturbation, context refresh, metrics) matches a by-hand pipeline."""
    clf = relu_clf if name == "2l-relu" else attn_clf
    data = digits()
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:15], data.y_test[:15]
    report = MalleabilityEstimator(clf, attacks=["fgsm"], **FAST).evaluate(x, y, xq, yq)

    model = copy.deepcopy(clf.model).double()  # a transductive model's context is computed in float64
    if name == "mlp-attn":
        model.set_context(x)
    before = NTKInfluence(ridge=1e-3, device="cpu").fit(model, x, y).scores(xq, yq)
    top = top_indices(aggregate_scores(before), 20)
    x_adv = x.copy()
    y_onehot = np.eye(10, dtype=np.float32)[y]
    x_adv[top] = FastGradientMethod(clf, eps=0.3).generate(x[top], y_onehot[top])
    if name == "mlp-attn":
        model.set_context(x_adv)
    after = NTKInfluence(ridge=1e-3, device="cpu").fit(model, x_adv, y).scores(xq, yq)

    result = report.result("fgsm")
    assert report.top_indices == top.tolist()
    assert result.flip_rate == pytest.approx(flip_rate(before, after, 0.1))
    assert result.spearman == pytest.approx(spearman(before, after))
    assert result.n_perturbed == 20
    assert result.max_perturbation <= 0.3 + 1e-6
    np.testing.assert_allclose(report.scores_before, aggregate_scores(before), rtol=1e-10)
    # the noise-aware rate of an exact estimator: query noise alone, the set selected from the clean scores
    assert report.noise_model["projection_sd"] is None
    aware = noise_aware_flip_rate(before, after, top=top)
    assert result.flip_rate_above_floor == pytest.approx(aware["estimate"], abs=1e-12)
    assert result.flip_rate_above_floor_ci == pytest.approx(list(aware["ci"]), abs=1e-12)
    assert result.flip_rate_null == pytest.approx(aware["null_raw_flip_rate"], abs=1e-12)
    assert result.counted_flips == top[aware["flip_probabilities"] >= 0.5].tolist()

    # the control: the same rows moved by seeded random signs at the same budget, influence recomputed; five
    # draws of the signs (seeds 0, 1000, ...), averaged
    rates, rhos = [], []
    for draw in range(5):
        x_ctrl = x.copy()
        x_ctrl[top] = random_sign_perturbation(x[top], top, 0.3, (0.0, 1.0), seed=1000 * draw)
        if name == "mlp-attn":
            model.set_context(x_ctrl)
        control = NTKInfluence(ridge=1e-3, device="cpu").fit(model, x_ctrl, y).scores(xq, yq)
        rates.append(flip_rate(before, control, 0.1))
        rhos.append(spearman(before, control))
    assert result.control["eps"] == 0.3 and result.control["perturbation"] == "random-sign"
    assert result.control["draws"] == 5
    assert result.control["flip_rate"] == pytest.approx(np.mean(rates))
    assert result.control["spearman"] == pytest.approx(np.mean(rhos))
    assert result.excess_flip_rate == pytest.approx(flip_rate(before, after, 0.1) - np.mean(rates))


def test_random_sign_control_perturbation():
    x = np.random.default_rng(0).random((6, 1, 3, 3)).astype(np.float32)
    rows = np.array([4, 9, 11, 20, 21, 30])
    out = random_sign_perturbation(x, rows, 0.3, (0.0, 1.0), seed=5)
    moved = np.clip(np.stack([x - 0.3, x + 0.3]), 0, 1)
    assert np.all(np.isclose(out, moved[0]) | np.isclose(out, moved[1]))
    assert out.dtype == np.float32 and np.abs(out - x).max() <= 0.3 + 1e-6
    # a row's signs depend on its training index and the seed only, not on its batch
    np.testing.assert_array_equal(random_sign_perturbation(x[2:4], rows[2:4], 0.3, (0.0, 1.0), seed=5), out[2:4])
    assert not np.array_equal(random_sign_perturbation(x, rows, 0.3, (0.0, 1.0), seed=6), out)
    unclipped = random_sign_perturbation(x, rows, 0.3, None, seed=5)
    np.testing.assert_allclose(np.abs(unclipped - x), 0.3, rtol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        random_sign_perturbation(x, rows[:2], 0.3, None)


def test_controls_switch_off_and_non_linf_attacks_get_none(relu_clf):
    data = digits()
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:15], data.y_test[:15]
    off = MalleabilityEstimator(relu_clf, attacks=["fgsm"], controls=False, **FAST).evaluate(x, y, xq, yq)
    assert off.result("fgsm").control is None and off.result("fgsm").excess_flip_rate is None
    assert off.config["controls"] is False and not any("control" in k for k in off.seconds)
    l2 = FastGradientMethod(relu_clf, norm=2, eps=1.0)
    report = MalleabilityEstimator(relu_clf, attacks=[l2, "pgd"], **FAST).evaluate(x, y, xq, yq)
    assert report.result("fgsm").control is None and report.result("pgd").control is not None
    assert any("no random-perturbation control for ['fgsm']" in w for w in report.warnings)
    with pytest.raises(TypeError, match="controls"):
        MalleabilityEstimator(relu_clf, controls="yes")


def test_three_attacks_report_is_sane(attn_clf):
    data = digits()
    report = MalleabilityEstimator(attn_clf, **FAST).evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    assert [r.attack for r in report.results] == ["fgsm", "pgd", "mim"]
    assert report.query_source == "test" and report.n_queries == 15 and report.top_k == 20
    assert 0.5 < report.clean_accuracy <= 1.0
    for r in report.results:
        assert 0.0 <= r.flip_rate <= 1.0
        assert -1.0 <= r.spearman <= 1.0
        assert 0.0 <= r.attack_success <= 1.0
        assert r.max_perturbation <= 0.3 + 1e-6
        assert r.params["eps"] == 0.3
    assert report.result("pgd").params["max_iter"] == 20
    # what ART ran: MIM's momentum decay lives on its inner attack; PGD has none
    assert report.result("mim").params["decay"] == 1.0
    assert report.result("pgd").params["decay"] is None
    assert "fgsm" in report.summary() and "flip rate" in report.summary()


def test_strategy_all_and_queries_from_training(relu_clf):
    data = digits()
    report = MalleabilityEstimator(relu_clf, attacks="pgd", strategy="all", **FAST).evaluate(
        data.x_train, data.y_train
    )
    assert report.query_source == "train"
    assert report.result("pgd").n_perturbed == len(data.x_train)
    assert all(v is not None for v in report.scores_before)


class _Recorder(InfluenceEstimator):
    """Records what the estimator hands to the influence engine; scores are a fixed function of x."""

    name = "recorder"

    def __init__(self, fail_on_call: int | None = None):
        super().__init__(device="cpu")
        self.contexts, self.context_dtypes, self.calls, self.fail_on_call = [], [], 0, fail_on_call

    def _fit(self, model, x_train, y_train):
        self.calls += 1
        if self.fail_on_call == self.calls:
            raise RuntimeError("planned failure")
        self.contexts.append(None if not hasattr(model, "attention") else model.attention.context.clone().float())
        if hasattr(model, "attention"):
            self.context_dtypes.append(model.attention.context.dtype)
        self.features = x_train.reshape(len(x_train), -1).astype(np.float64)

    def _scores(self, x_query, y_query):
        return x_query.reshape(len(x_query), -1).astype(np.float64) @ self.features.T - 5.0


def test_transductive_context_refreshed_on_a_copy_only(attn_clf):
    data = digits()
    context = attn_clf.model.attention.context.clone()
    recorder = _Recorder()
    report = MalleabilityEstimator(attn_clf, attacks=["fgsm"], influence=recorder, **FAST).evaluate(
        data.x_train, data.y_train
    )
    clean, *controls, perturbed = recorder.contexts  # clean, five random-sign control draws, attack
    assert len(controls) == 5
    assert torch.equal(clean, context)  # the model was trained with this training set as context
    assert recorder.context_dtypes == [torch.float64] * 7  # computed in the influence's dtype
    assert not torch.allclose(clean, perturbed) and not any(torch.allclose(clean, c) for c in controls)
    assert not any(torch.allclose(c, perturbed) for c in controls)
    assert not torch.allclose(controls[0], controls[1])  # each draw its own signs
    assert torch.equal(attn_clf.model.attention.context, context)
    assert report.config["influence"] == "recorder"


def _snapshot(clf: PyTorchClassifier):
    module = clf.model
    return {
        "state": {k: v.clone() for k, v in module.state_dict().items()},
        "modes": [m.training for m in module.modules()],
        "flags": [p.requires_grad for p in module.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "reduction": clf._loss.reduction,
        "np": np.random.get_state()[1].copy(),
        "torch": torch.get_rng_state().clone(),
        "random": random.getstate(),
    }


def _assert_same(a, b):
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    assert a["modes"] == b["modes"] and a["flags"] == b["flags"] and a["reduction"] == b["reduction"]
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(a["grads"], b["grads"], strict=True))
    assert np.array_equal(a["np"], b["np"]) and torch.equal(a["torch"], b["torch"]) and a["random"] == b["random"]


@pytest.mark.parametrize("fail_on_call", [None, 2])
def test_evaluate_changes_nothing_on_success_and_failure(fail_on_call):
    clf = trained_classifier("mlp-attn", epochs=2)
    module = clf.model
    module.train()  # unusual but legal user state: train mode, a stale gradient
    module.hidden.weight.grad = torch.full_like(module.hidden.weight, 0.5)
    data = digits()
    x, y = data.x_train.copy(), np.eye(10, dtype=np.float32)[data.y_train]
    x_keep, y_keep = x.copy(), y.copy()
    before = _snapshot(clf)
    influence = _Recorder(fail_on_call) if fail_on_call else "ntk"
    estimator = MalleabilityEstimator(clf, attacks=["fgsm", "pgd"], influence=influence, **FAST)
    if fail_on_call:
        with pytest.raises(RuntimeError, match="planned failure"):
            estimator.evaluate(x, y)
    else:
        estimator.evaluate(x, y)
    _assert_same(before, _snapshot(clf))
    np.testing.assert_array_equal(x, x_keep)
    np.testing.assert_array_equal(y, y_keep)


def test_same_seed_same_report(relu_clf):
    data = digits()

    def run(seed):
        report = MalleabilityEstimator(relu_clf, attacks=["pgd"], seed=seed, **FAST).evaluate(
            data.x_train, data.y_train
        )
        out = report.to_dict()
        out.pop("seconds")
        for r in out["results"]:
            r.pop("seconds")
        return out

    first = run(0)
    assert first == run(0)
    assert first != run(1)  # another seed draws other queries


def test_raw_module_and_ready_attack_and_function_form(relu_clf):
    data = digits()
    module = copy.deepcopy(relu_clf.model)
    estimator = MalleabilityEstimator(module, input_shape=data.input_shape, nb_classes=10, attacks="fgsm", **FAST)
    assert isinstance(estimator.classifier, PyTorchClassifier)
    ready = FastGradientMethod(relu_clf, eps=0.1)
    report = MalleabilityEstimator(relu_clf, attacks=[ready], **FAST).evaluate(data.x_train, data.y_train)
    assert report.results[0].attack == "fgsm" and report.results[0].params["eps"] == pytest.approx(0.1)
    rate = influence_flip_rate(relu_clf, data.x_train, data.y_train, "fgsm", eps=0.1, n_queries=15, device="cpu")
    assert rate == pytest.approx(report.results[0].flip_rate)


def test_what_the_audit_takes_short_of_what_was_asked_is_said(relu_clf):
    # a new user's --n-queries 100000 on 300 test points, and projection_dim=512 run with 496, said nowhere but in
    # the numbers
    data = digits()
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **{**FAST, "n_queries": 1000, "projection_dim": 50},
                                   controls=False).evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    assert report.n_queries == len(data.x_test) and report.config["n_queries"] == 1000
    held = f"n_queries=1000 asked for more queries than the test set holds: its {len(data.x_test)} points"
    assert sum(held in w for w in report.warnings) == 1
    assert report.execution["projection_dim"] == 49
    assert sum(w.startswith("projection_dim=50 gave 49 dimensions") for w in report.warnings) == 1
    reasons = report.to_dict()["null_reasons"]
    assert "config.n_queries" not in reasons  # given, so not null
    default = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **{**FAST, "n_queries": None}, controls=False)
    reasons = default.evaluate(data.x_train[:100], data.y_train[:100], data.x_test[:20],
                               data.y_test[:20]).to_dict()["null_reasons"]
    assert reasons["config.n_queries"].startswith("n_queries=None, the default: every test point is a query")


def test_gradient_influence_through_the_estimator(relu_clf):
    data = digits()
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], influence="gradient", **FAST).evaluate(
        data.x_train, data.y_train, data.x_test, data.y_test
    )
    assert report.config["influence"] == "gradient"
    assert 0.0 <= report.results[0].flip_rate <= 1.0


# ---------------------------------------------------------------- bad input: each names its argument


def test_bad_classifier_and_parameters(relu_clf):
    with pytest.raises(EstimatorError, match="MalleabilityEstimator requires an estimator derived from"):
        MalleabilityEstimator(object())
    with pytest.raises(ValueError, match="input_shape and nb_classes"):
        MalleabilityEstimator(torch.nn.Linear(3, 2))
    cases = [
        ({"attacks": ["cw"]}, ValueError, "attacks"),
        ({"attacks": []}, ValueError, "attacks"),
        ({"attacks": [3]}, TypeError, "attacks"),
        ({"attacks": ["fgsm", "fgsm"]}, ValueError, "distinct"),
        ({"influence": "shapley"}, ValueError, "influence"),
        ({"influence": 3}, TypeError, "influence"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": -0.1}, ValueError, "eps"),
        ({"eps": "0.3"}, TypeError, "eps"),
        ({"top_fraction": 0.0}, ValueError, "top_fraction"),
        ({"top_fraction": 1.5}, ValueError, "top_fraction"),
        ({"strategy": "random"}, ValueError, "strategy"),
        ({"ridge": 0.0}, ValueError, "ridge"),
        ({"rank_by": "size"}, ValueError, "rank_by"),
        ({"n_queries": 0}, ValueError, "n_queries"),
        ({"confidence": 1.0}, ValueError, "confidence"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"device": 3}, TypeError, "device"),
        ({"projection_dim": 0}, ValueError, "projection_dim"),
        ({"projection_dim": 2**40, "influence": "gradient"}, ValueError, "projection_dim"),
        ({"projection_dim": "large"}, ValueError, "projection_dim"),
        ({"distributed": "yes"}, ValueError, "distributed"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            MalleabilityEstimator(relu_clf, **kwargs)


def test_missing_clip_values_for_named_attack(relu_clf):
    clf = PyTorchClassifier(
        copy.deepcopy(relu_clf.model), torch.nn.CrossEntropyLoss(), (1, 8, 8), 10, clip_values=None
    )
    with pytest.raises(ValueError, match="clip_values"):
        MalleabilityEstimator(clf, attacks=["pgd"])


def test_bad_data(relu_clf):
    data = digits()
    x, y = data.x_train, data.y_train
    estimator = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **FAST)
    nan_x = x.copy()
    nan_x[0, 0, 0, 0] = np.nan
    cases = [
        ((x[:10].tolist(), y[:10]), TypeError, "x must be a numpy array"),
        ((x, y[:-1]), ValueError, "y must have 200 rows"),
        ((x.reshape(200, 64), y), ValueError, r"x must have shape \(n, 1, 8, 8\)"),
        ((x, y + 5), ValueError, r"class indices in \[0, 9\]"),
        ((x, y - 1), ValueError, "class indices"),
        ((x, y.astype(str)), TypeError, "y must hold integer"),
        ((x, y + 0.5), ValueError, "non-integer"),
        ((x, np.ones((200, 10))), ValueError, "not one-hot"),
        ((nan_x, y), ValueError, "x must hold finite values, got 1 NaN"),
        ((x[:0], y[:0]), ValueError, "x must hold at least one example"),
        ((x[:9], y[:9]), ValueError, "x must hold at least 10 examples for top_fraction"),
        ((x, y, data.x_test), ValueError, "x_test and y_test"),
        ((x, y, data.x_test[:, :, :4], data.y_test), ValueError, "x_test must have shape"),
    ]
    for args, error, match in cases:
        keep = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        with pytest.raises(error, match=match):
            estimator.evaluate(*args)
        for a, k in zip(args, keep, strict=True):
            if isinstance(a, np.ndarray):
                np.testing.assert_array_equal(a, k)


def test_model_near_chance_is_flagged(relu_clf):
    data = digits()
    weak = trained_classifier("mlp-attn", epochs=1)
    args = (data.x_train, data.y_train, data.x_test, data.y_test)
    report = MalleabilityEstimator(weak, attacks=["fgsm"], **FAST).evaluate(*args)
    assert report.warnings and "close to chance" in report.warnings[0]
    assert "WARNING: clean accuracy" in report.summary() and "**Warning:**" in report.to_markdown()
    assert not any("close to chance" in w for w in MalleabilityEstimator(relu_clf, attacks=["fgsm"], **FAST).evaluate(
        *args).warnings)


def test_any_pytorch_classifier_with_mixed_flags_is_left_as_it_was():
    """A plain nn.Sequential (bias frozen, dropout, train mode) through all three attacks and "gradient"."""
    data = digits()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 10)
    )
    net[4].bias.requires_grad_(False)
    net.train()
    clf = PyTorchClassifier(net, torch.nn.CrossEntropyLoss(reduction="sum"), (1, 8, 8), 10, clip_values=(0.0, 1.0))
    before = _snapshot(clf)
    x, y = data.x_train.copy(), data.y_train.copy()
    for influence in ("ntk", "gradient"):
        report = MalleabilityEstimator(clf, influence=influence, **FAST).evaluate(x, y, data.x_test, data.y_test)
        assert len(report.results) == 3
        _assert_same(before, _snapshot(clf))
    assert before["reduction"] == "sum" and before["flags"] == [True, True, True, False]
    np.testing.assert_array_equal(x, data.x_train)


def test_a_float64_classifier_is_audited_as_it_is():
    """A float64 model (ART's attacks cast their inputs to float32): audited, nothing of it changed, its kernel in its
    own dtype, and the kernel method and its reason recorded."""
    data = digits()
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    net = net.double()
    clf = PyTorchClassifier(net, torch.nn.CrossEntropyLoss(), (1, 8, 8), 10, clip_values=(0.0, 1.0))
    before = _snapshot(clf)
    x = data.x_train[:120].astype(np.float64)
    report = MalleabilityEstimator(clf, **FAST).evaluate(x, data.y_train[:120], data.x_test.astype(np.float64),
                                                         data.y_test)
    assert [r.attack for r in report.results] == ["fgsm", "pgd", "mim"]
    assert all(r.attack_success > 0 for r in report.results)  # the attacks reached the float64 model
    _assert_same(before, _snapshot(clf))
    assert next(net.parameters()).dtype == torch.float64
    method = report.execution["kernel_method"]
    assert method["method"] in ("structured", "batched", "jacobian") and method["reason"]


def test_projected_mode_equals_a_by_hand_pipeline_and_is_recorded(relu_clf):
    """Projected influence with the update of the attacked rows equals fits from scratch on the perturbed set."""
    data = digits()
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:15], data.y_test[:15]
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], projection_dim=64, seed=3, **FAST).evaluate(
        x, y, xq, yq
    )
    model = copy.deepcopy(relu_clf.model)
    before = NTKInfluence(projection_dim=64, projection_seed=3, device="cpu").fit(model, x, y).scores(xq, yq)
    top = top_indices(aggregate_scores(before), 20)
    x_adv = x.copy()
    x_adv[top] = FastGradientMethod(relu_clf, eps=0.3).generate(x[top], np.eye(10, dtype=np.float32)[y[top]])
    after = NTKInfluence(projection_dim=64, projection_seed=3, device="cpu").fit(model, x_adv, y).scores(xq, yq)
    result = report.result("fgsm")
    assert report.top_indices == top.tolist()
    np.testing.assert_allclose(result.scores_after, aggregate_scores(after), rtol=1e-8, atol=1e-12)
    assert result.flip_rate == pytest.approx(flip_rate(before, after, 0.1))
    run = report.execution
    assert run["mode"] == "projected" and run["projection_dim"] == 64 and run["projection_seed"] == 3
    assert run["world_size"] == 1 and run["backend"] is None and run["params"]["ridge"] == 1e-3
    assert {g["kind"] for g in run["projection_groups"]} == {"linear"}
    assert any("random projection" in w for w in report.warnings)
    # the projection's noise model: the spread of the clean aggregate scores between projection seeds 3 and 4
    twins = [NTKInfluence(projection_dim=64, projection_seed=s, device="cpu").fit(model, x, y).scores(xq, yq)
             for s in (4,)]
    noise = projection_noise(np.stack([aggregate_scores(s) for s in (before, *twins)]))
    assert report.noise_model["projection_seeds"] == [3, 4]
    assert [report.noise_model["projection_sd"][k] for k in ("intercept", "slope")] == pytest.approx(list(noise))
    # the two seeds' agreement, beside every table
    agg_twin = aggregate_scores(twins[0])
    top_twin = top_indices(agg_twin, 20)
    agreement = report.noise_model["seed_agreement"]
    assert agreement["spearman"] == pytest.approx(spearmanr(aggregate_scores(before), agg_twin)[0], abs=1e-12)
    assert agreement["top_k_jaccard"] == pytest.approx(
        len(set(top) & set(top_twin)) / len(set(top) | set(top_twin)))
    assert f"agree with Spearman {agreement['spearman']:.2f}" in report.summary()
    aware = noise_aware_flip_rate(before, after, top=top, noise=noise)
    assert result.flip_rate_above_floor == pytest.approx(aware["estimate"], abs=1e-9)
    exact = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **FAST).evaluate(x, y, xq, yq)
    assert exact.execution["mode"] == "exact" and "projection_dim" not in exact.execution
    assert exact.noise_model["seed_agreement"] is None and "PROJECTED" not in exact.summary()
    assert not any("random projection" in w for w in exact.warnings)


def test_datasets_give_the_array_report(relu_clf):
    from torch.utils.data import DataLoader, TensorDataset

    data = digits()
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:15], data.y_test[:15]
    kwargs = dict(attacks=["pgd"], projection_dim=64, **FAST)
    ref = MalleabilityEstimator(relu_clf, **kwargs).evaluate(x, y, xq, yq)
    train = TensorDataset(torch.tensor(x), torch.tensor(y))
    test = DataLoader(TensorDataset(torch.tensor(xq), torch.tensor(yq)), batch_size=4)
    got = MalleabilityEstimator(relu_clf, **kwargs).evaluate(train, x_test=test)
    assert got.top_indices == ref.top_indices and got.clean_accuracy == ref.clean_accuracy
    np.testing.assert_allclose(got.scores_before, ref.scores_before, rtol=1e-12)
    assert got.result("pgd").flip_rate == ref.result("pgd").flip_rate
    np.testing.assert_allclose(got.result("pgd").scores_after, ref.result("pgd").scores_after, rtol=1e-12)
    # queries drawn from a training dataset
    got = MalleabilityEstimator(relu_clf, **kwargs).evaluate(train)
    ref = MalleabilityEstimator(relu_clf, **kwargs).evaluate(x, y)
    assert got.query_source == "train" and got.top_indices == ref.top_indices
    with pytest.raises(ValueError, match=r"x .*must yield inputs .*got inputs of shape \(32,\)"):
        MalleabilityEstimator(relu_clf, **kwargs).evaluate(TensorDataset(torch.zeros(30, 32), torch.zeros(30)))
    with pytest.raises(ValueError, match="y must be None"):
        MalleabilityEstimator(relu_clf, **kwargs).evaluate(train, y)


def _validation(digest: str, names=("ntk-exact", "gradient")):
    from art_malleability.validation import EstimatorFidelity, ValidationReport

    results = {
        name: EstimatorFidelity(
            estimator=name, params={}, lds=0.4 + i / 10, lds_ci=[0.3, 0.6], lds_per_query=[0.4], n_queries_defined=1,
            loo_sign_agreement=0.75, loo_sign_agreement_ci=[0.5, 0.9], n_loo_pairs=4, n_loo_agree=3, loo_pairs=[],
            example_predicted=[0.0, 1.0],
        )
        for i, name in enumerate(names)
    }
    return ValidationReport(
        model="2l-relu", dataset="digits", model_digest=digest,
        config={"n_models": 50, "alpha": 0.5, "outcome": "loss", "loo_queries": 1, "loo_top": 1, "loo_seeds": 1},
        results=results, n_train=200, n_queries=1, accuracy={"train": 1.0}, subsets=[[0, 1], [2, 3]],
        subset_seeds=[1, 2], outcomes=[[0.1], [0.2]], loo_queries=[0], loo_removed=[1], loo_seeds=[0], example_query=0,
    )


def test_audit_states_the_validated_fidelity_of_its_estimator(relu_clf, tmp_path):
    from art_malleability._utils.provenance import weights_digest
    from art_malleability.audit.report import MalleabilityReport

    data = digits()
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:15], data.y_test[:15]
    validation = _validation(weights_digest(relu_clf.model))
    estimator = MalleabilityEstimator(relu_clf, attacks=["fgsm"], controls=False, **FAST)
    report = estimator.evaluate(x, y, xq, yq, validation=validation.save(tmp_path / "validation"))
    assert report.fidelity["estimator"] == "ntk-exact" and report.fidelity["lds"] == 0.4
    assert "LDS 0.400 [0.300, 0.600] against 50 models" in report.summary()
    assert "## Influence fidelity" in report.to_markdown()
    assert MalleabilityReport.load(report.save(tmp_path / "audit")).fidelity == report.fidelity
    gradient = MalleabilityEstimator(relu_clf, attacks=["fgsm"], influence="gradient", controls=False, **FAST)
    assert gradient.evaluate(x, y, xq, yq, validation=validation).fidelity["lds"] == 0.5
    other = estimator.evaluate(x, y, xq, yq, validation=_validation("0" * 64))
    assert other.fidelity is None and any("other weights" in w for w in other.warnings)
    missing = estimator.evaluate(x, y, xq, yq, validation=_validation(weights_digest(relu_clf.model), ["captum"]))
    assert missing.fidelity is None and any("no result for the estimator that ran (ntk-exact)" in w
                                            for w in missing.warnings)


# ------------------------------------------------------------------------------------ parameter contract

CHANGES = [  # (parameter, new value, what the report must show)
    ("eps", 0.1, lambda r: r.result("fgsm").params["eps"] == 0.1 and r.result("fgsm").max_perturbation <= 0.1 + 1e-6),
    ("attacks", ["pgd"], lambda r: [a.attack for a in r.results] == ["pgd"]),
    ("batch_size", 7, lambda r: r.result("fgsm").params["batch_size"] == 7),
    ("ridge", 0.5, lambda r: r.execution["params"]["ridge"] == 0.5),
    ("influence", "gradient", lambda r: r.execution["influence"] == "GradientInfluence"),
    ("projection_dim", 16, lambda r: r.execution["mode"] == "projected" and r.execution["projection_dim"] == 16),
    ("verbose", True, lambda r: "verbose" not in r.execution["params"]),  # the NTK influence's bar: checked below
    ("top_fraction", 0.05, lambda r: r.top_k == 5),
    ("n_queries", 9, lambda r: r.n_queries == 9),
    ("controls", False, lambda r: r.result("fgsm").control is None),
    # the seed's effect on the queries and resamples: test_the_seed_draws_the_queries_and_the_resamples
    ("seed", 3, lambda r: r.config["seed"] == 3 and r.execution["mode"] == "exact"),
]


def test_the_seed_draws_the_queries_and_the_resamples(relu_clf):
    # the seed case above had held whenever the run was exact, whatever the seed did
    data = digits(100, 20)

    def run(seed):
        estimator = MalleabilityEstimator(relu_clf, attacks=["fgsm"], controls=False, seed=seed,
                                          **{**FAST, "n_bootstrap": 20})  # 15 of the 20 test points
        return estimator.evaluate(data.x_train, data.y_train, data.x_test, data.y_test).to_dict()

    first, again, other = run(3), run(3), run(4)
    for report in (first, again, other):
        report.pop("seconds")
        for result in report["results"]:
            result.pop("seconds")
    assert first == again  # the same seed, the same report
    assert first["scores_before"] != other["scores_before"]  # other queries drawn
    assert first["results"][0]["flip_rate_ci"] != other["results"][0]["flip_rate_ci"]  # other resamples


@pytest.mark.parametrize("how", ["assign", "set_params"])
@pytest.mark.parametrize(("name", "value", "shows"), CHANGES, ids=[c[0] for c in CHANGES])
def test_a_parameter_changed_after_construction_is_what_runs_and_what_the_report_says(relu_clf, name, value, shows,
                                                                                      how):
    data = digits(100, 20)
    estimator = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **{**FAST, "n_bootstrap": 10})
    if how == "assign":
        setattr(estimator, name, value)
    else:
        estimator.set_params(**{name: value})
    report = estimator.evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    assert report.config[name] == value == estimator.get_params()[name]
    assert report.config["influence"] == estimator.get_params()["influence"]
    assert shows(report) and getattr(estimator._influence, "verbose", False) is (name == "verbose")


def test_steps_changed_after_construction_reach_the_iterative_attack(relu_clf):
    estimator = MalleabilityEstimator(relu_clf, attacks=["pgd"], **FAST)
    estimator.attack_max_iter = 3
    assert estimator._attacks[0].max_iter == 3 and estimator.get_params()["attack_max_iter"] == 3


@pytest.mark.parametrize(
    ("change", "match"),
    [({"eps": -1.0}, "eps"), ({"ridge": "0.1"}, "ridge"), ({"attacks": ["cw"]}, "attacks"),
     ({"nonsense": 1}, "nonsense"), ({"eps": 0.2, "top_fraction": 2.0}, "top_fraction"),
     # refused when set, not when the audit runs: a budget covering the whole input range, intervals from 1 resample
     ({"eps": 5}, r"eps must be smaller than the classifier's whole input range .*got 5;"),
     ({"n_bootstrap": 1}, r"n_bootstrap must be an integer of at least 10 .*got 1")],
)
def test_an_invalid_change_is_named_and_changes_nothing(relu_clf, change, match):
    estimator = MalleabilityEstimator(relu_clf, **FAST)
    before, attacks, influence = estimator.get_params(), estimator._attacks, estimator._influence
    with pytest.raises((ValueError, TypeError), match=match):
        estimator.set_params(**change)
    if len(change) == 1 and "nonsense" not in change:
        ((name, value),) = change.items()
        with pytest.raises((ValueError, TypeError), match=match):
            setattr(estimator, name, value)
    assert estimator.get_params() == before and estimator._attacks is attacks and estimator._influence is influence


def test_a_string_ridge_other_than_a_rule_is_refused_at_construction(relu_clf):
    with pytest.raises(ValueError, match=r"ridge must be a positive float or one of \('loo', 'gcv'\), got '0.1'"):
        MalleabilityEstimator(relu_clf, ridge="0.1", **FAST)


# ------------------------------------------------------------------ bad input a new user tries


class TupleNet(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x), x


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("pixels 0-255", ValueError, r"x must lie in the classifier's clip_values \(0, 1\), got values in \[0, 255\]"),
        ("centred", ValueError, "must lie in the classifier's clip_values"),
        ("eps in pixel units", ValueError, r"eps must be smaller than the classifier's whole input range .*got 8;"),
        ("eps the whole range", ValueError, r"eps must be smaller .*got 1;"),
        ("nb_classes", ValueError, r"classifier.model must return outputs of shape \(n, 5\) .*got \(1, 10\)"),
        ("tuple output", TypeError, "must return one tensor of logits"),
        ("attacks= in the one-off", TypeError, "attacks must not be given to influence_flip_rate"),
    ],
)
def test_what_a_new_user_gets_wrong_is_named_and_changes_nothing(relu_clf, case, error, match):
    data = digits(100, 20)
    x, y = data.x_train.copy(), data.y_train.copy()
    clf, kwargs, run = relu_clf, {}, None
    if case == "pixels 0-255":
        x = np.round(x * 255)
    elif case == "centred":
        x = x - x.mean()
    elif case == "eps in pixel units":
        kwargs = {"eps": 8}
    elif case == "eps the whole range":
        kwargs = {"eps": 1.0}
    elif case == "nb_classes":
        x, y = x[y < 5], y[y < 5]
        clf = PyTorchClassifier(relu_clf.model, torch.nn.CrossEntropyLoss(), (1, 8, 8), 5, clip_values=(0.0, 1.0))
    elif case == "tuple output":
        clf = PyTorchClassifier(TupleNet(relu_clf.model), torch.nn.CrossEntropyLoss(), (1, 8, 8), 10,
                                clip_values=(0.0, 1.0))
    elif case == "attacks= in the one-off":
        run = lambda: influence_flip_rate(relu_clf, x, y, attacks=["pgd"])  # noqa: E731
    state = {k: v.clone() for k, v in relu_clf.model.state_dict().items()}
    x_before = x.copy()
    with pytest.raises(error, match=match):
        if run is not None:
            run()
        else:
            MalleabilityEstimator(clf, **{**FAST, **kwargs}).evaluate(x, y)
    assert np.array_equal(x, x_before) and all(torch.equal(state[k], v) for k, v in relu_clf.model.state_dict().items())


def test_a_single_class_is_a_warning_in_the_log_and_the_report(relu_clf, caplog):
    caplog.set_level("WARNING", logger="art_malleability")
    data = digits(100, 20)
    keep = data.y_train == 3
    x, y = data.x_train[keep], data.y_train[keep]
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **{**FAST, "n_queries": 5, "controls": False},
                                   top_fraction=0.5).evaluate(x, y)
    assert any("single class (3)" in w for w in report.warnings)
    assert "single class (3)" in caplog.text


@pytest.mark.parametrize("wrap", ["dataset", "loader"])
def test_a_dataset_of_pixels_in_0_255_is_refused_like_an_array(relu_clf, wrap):
    from torch.utils.data import DataLoader, TensorDataset

    data = digits(100, 20)
    dataset = TensorDataset(torch.tensor(np.round(data.x_train * 255)), torch.tensor(data.y_train))
    source = dataset if wrap == "dataset" else DataLoader(dataset, batch_size=16)
    state = {k: v.clone() for k, v in relu_clf.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"x \(examples 0\.\.\d+\) must lie in the classifier's clip_values \(0, 1\), "
                                         r"got values in \[0, 255\]"):
        MalleabilityEstimator(relu_clf, **FAST).evaluate(source)
    assert all(torch.equal(state[k], v) for k, v in relu_clf.model.state_dict().items())


def test_weights_that_are_not_finite_are_named(relu_clf):
    model = copy.deepcopy(relu_clf.model)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    clf = PyTorchClassifier(model, torch.nn.CrossEntropyLoss(), (1, 8, 8), 10, clip_values=(0.0, 1.0))
    data = digits(100, 20)
    with pytest.raises(ValueError, match=r"classifier.model must have finite weights, got 1 NaN or infinite value\(s\) "
                                         r"in '.*weight'"):
        MalleabilityEstimator(clf, **FAST).evaluate(data.x_train, data.y_train)


@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        ({"n_queries": 1}, ValueError, "n_queries must be at least 2, got 1; every interval resamples the queries"),
        ({"seed": -1}, ValueError, r"seed must be a non-negative integer \(numpy's seeds are\), got -1"),
        ({"seed": 1.5}, TypeError, "seed must be a non-negative integer, got 1.5"),
    ],
)
def test_values_that_would_fail_later_are_refused_by_the_constructor_and_set_params(relu_clf, params, error, match):
    with pytest.raises(error, match=match):
        MalleabilityEstimator(relu_clf, **{**FAST, **params})
    estimator = MalleabilityEstimator(relu_clf, **FAST)
    before = estimator.get_params()
    with pytest.raises(error, match=match):
        estimator.set_params(**params)
    ((name, value),) = params.items()
    with pytest.raises(error, match=match):
        setattr(estimator, name, value)
    assert estimator.get_params() == before


def test_a_misspelt_parameter_is_refused_not_ignored(relu_clf):
    estimator = MalleabilityEstimator(relu_clf, **FAST)
    with pytest.raises(AttributeError, match=r"got the unknown name 'epsilon'; did you mean 'eps'\?"):
        estimator.epsilon = 0.05
    assert "epsilon" not in vars(estimator) and estimator.eps == 0.3
    estimator.model_name = "renamed"  # an existing attribute may be set
    estimator._private = 1  # and private ones
    assert estimator.model_name == "renamed"


@pytest.mark.parametrize("points", [1, 2, 9])
def test_too_few_test_points_for_an_interval_are_said_in_the_report(relu_clf, caplog, points):
    # a new user's 2 queries printed a noise-aware "34.0 % [34.0, 34.0]", not marked undecided
    caplog.set_level("WARNING", logger="art_malleability")
    data = digits(100, 20)
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], **{**FAST, "controls": False}).evaluate(
        data.x_train, data.y_train, data.x_test[:points], data.y_test[:points]
    )
    result = report.results[0]
    assert report.n_queries == points and result.flip_rate is not None and result.flip_rate_ci == [None, None]
    assert result.flip_rate_above_floor is None and result.flip_rate_above_floor_ci == [None, None]
    said = f"quer{'y' if points == 1 else 'ies'}: the intervals that resample the queries and the noise-aware"
    assert sum(said in w for w in report.warnings) == 1 and said in caplog.text
    reasons = report.to_dict()["null_reasons"]
    lead = "a single query point" if points == 1 else f"{points} queries"
    assert reasons["results[0].flip_rate_ci[0]"].startswith(f"{lead}: the interval resamples the queries and needs "
                                                             "at least 10")


def test_queries_whose_metrics_do_not_fit_the_memory_are_refused_before_any_work(relu_clf, monkeypatch):
    """The metrics' plan is checked from the sizes alone, before any attack or influence pass; nothing is changed."""
    data = digits()
    x, y = data.x_train[:120].copy(), data.y_train[:120].copy()
    xq, yq = data.x_test[:40].copy(), data.y_test[:40].copy()
    copies = [a.copy() for a in (x, y, xq, yq)]
    weights = [p.detach().clone() for p in relu_clf.model.parameters()]
    calls = []
    tight = NTKInfluence(ridge=1e-3, device="cpu", memory_limit_gb=0.05)
    monkeypatch.setattr(NTKInfluence, "fit", lambda *a, **k: calls.append(1))
    audit = MalleabilityEstimator(relu_clf, attacks=["fgsm"], influence=tight, n_queries=None, n_bootstrap=50,
                                  verbose=False, device="cpu")
    # a limit below the metrics' fixed part: no number of queries would fit, so the limit is what is named
    with pytest.raises(ValueError, match=r"memory_limit_gb must leave room for the metrics of at least two queries "
                                         r".*got 0\.05: their fixed part alone needs"):
        audit.evaluate(x, y, xq, yq)
    assert not calls  # no influence was fitted
    for before, after in zip(copies, (x, y, xq, yq), strict=True):
        np.testing.assert_array_equal(before, after)
    for before, after in zip(weights, relu_clf.model.parameters(), strict=True):
        assert torch.equal(before, after)
    monkeypatch.undo()
    # a budget that holds them runs
    roomy = NTKInfluence(ridge=1e-3, device="cpu", memory_limit_gb=2.0)
    report = MalleabilityEstimator(relu_clf, attacks=["fgsm"], influence=roomy, n_queries=None, n_bootstrap=50,
                                   verbose=False, device="cpu", controls=False).evaluate(x, y, xq, yq)
    assert report.n_queries == 40


@pytest.mark.parametrize("make", [
    lambda: NTKInfluence(ridge=0.01, verbose=True, projection_dim=64, planned_queries=7, device="cpu"),
    lambda: __import__("art_malleability.influence", fromlist=["x"]).GradientInfluence(loss="mse", batch_size=7),
    lambda: __import__("art_malleability.influence", fromlist=["x"]).CaptumInfluence(batch_size=5),
])
def test_get_params_rebuilds_an_equal_estimator_from_the_whole_signature(make):
    """The parameters are read from the constructor's signature: no hand-kept list leaves one out (``verbose``)."""
    import inspect

    est = make()
    params = est.get_params()
    assert set(params) == set(inspect.signature(type(est).__init__).parameters) - {"self"}
    assert type(est)(**params).get_params() == params


def test_the_audits_get_params_rebuild_an_equal_audit(relu_clf):
    import inspect

    from art_malleability.audit.params import CLASSIFIER_ARGS

    audit = MalleabilityEstimator(relu_clf, eps=0.1, attacks=("fgsm",), verbose=False, n_queries=7, time_budget_s=5.0)
    params = audit.get_params()
    assert set(params) | set(CLASSIFIER_ARGS) == set(inspect.signature(MalleabilityEstimator.__init__).parameters) - {
        "self"}
    assert MalleabilityEstimator(relu_clf, **params).get_params() == params
