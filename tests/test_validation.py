"""Influence fidelity against retraining: the LDS against oracles (brute force, dattri), a tiny end-to-end run,
bad input and no mutation."""

import json
import random

import numpy as np
import pytest
import torch
from dattri.metric import lds as dattri_lds
from helpers import digits
from scipy.stats import binomtest, spearmanr

from art_malleability._utils.provenance import weights_digest
from art_malleability.cli import main
from art_malleability.influence import GradientInfluence, NTKInfluence
from art_malleability.models import build_reference_model, train_model
from art_malleability.validation import (
    ValidationReport,
    linear_datamodeling_score,
    sign_agreement,
    subset_sums,
    validate,
)

TINY = {"n_models": 4, "alpha": 0.5, "loo_queries": 2, "loo_top": 2, "loo_seeds": 2, "n_bootstrap": 50}


def train_fn(x, y, seed):
    model = build_reference_model("2l-relu", (1, 8, 8), 10, width=32, seed=seed)
    return train_model(model, x, y, epochs=40, lr=3e-2, weight_decay=0.0, seed=seed, verbose=False, device="cpu")


def data():
    d = digits(100, 40)
    return d.x_train, d.y_train, d.x_test[:12], d.y_test[:12]


def random_problem(seed=0, n_query=6, n_train=30, n_models=12):
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(n_query, n_train))
    indices = np.stack([np.sort(rng.choice(n_train, n_train // 2, replace=False)) for _ in range(n_models)])
    masks = np.zeros((n_models, n_train), dtype=bool)
    np.put_along_axis(masks, indices, True, axis=1)
    outcomes = rng.normal(size=(n_models, n_query))
    return scores, masks, indices, outcomes


# ------------------------------------------------------------------------------------------- LDS oracles


@pytest.mark.parametrize("outcome", ["loss", "margin"])
def test_lds_matches_a_per_query_spearman_loop(outcome):
    scores, masks, _, outcomes = random_problem()
    outcomes[:, 0] = np.round(outcomes[:, 0])  # ties: average ranks, as scipy
    result = linear_datamodeling_score(scores, masks, outcomes, outcome=outcome, n_bootstrap=200)
    sign = -1.0 if outcome == "loss" else 1.0
    expected = [
        spearmanr([scores[q, m].sum() for m in masks], sign * outcomes[:, q]).statistic for q in range(len(scores))
    ]
    np.testing.assert_allclose(result.per_query, expected, atol=1e-12)
    assert result.mean == pytest.approx(np.mean(expected))
    assert result.n_defined == len(scores)


def test_the_lds_interval_resamples_subset_models_and_queries_together():
    """The two-way bootstrap by hand: draw models and queries, Spearman of each drawn query over the drawn models."""
    from art_malleability.validation.lds import lds_interval, subset_sums

    scores, masks, _, outcomes = random_problem(seed=5)
    predicted, utility = subset_sums(scores, masks), -outcomes
    rng = np.random.default_rng(11)
    draws = []
    for _ in range(200):
        models, queries = rng.integers(0, len(masks), len(masks)), rng.integers(0, len(scores), len(scores))
        rhos = [spearmanr(predicted[models, q], utility[models, q]).statistic for q in queries]
        draws.append(np.nanmean(rhos))
    expected = np.percentile(draws, [2.5, 97.5])
    assert lds_interval(predicted, utility, 200, 0.95, seed=11) == pytest.approx(tuple(expected), abs=1e-12)
    queries_only = linear_datamodeling_score(scores, masks, outcomes, n_bootstrap=200).per_query
    rng = np.random.default_rng(0)
    narrow = np.percentile([np.mean(queries_only[rng.integers(0, len(scores), len(scores))]) for _ in range(400)],
                           [2.5, 97.5])
    wide = lds_interval(predicted, utility, 400, 0.95, seed=0)
    assert wide[1] - wide[0] > narrow[1] - narrow[0]  # the models' own noise is in it

def test_lds_equals_dattri_on_the_same_subsets_and_outcomes():
    scores, masks, indices, losses = random_problem(seed=3)
    ours = linear_datamodeling_score(scores, masks, losses, outcome="loss")
    # dattri: scores (n_train, n_test); ground truth (target values (M, n_test), subset indices (M, size)),
    # correlating the summed score with the target: the target of a helpful set is -loss
    theirs, _ = dattri_lds(torch.tensor(scores.T), (torch.tensor(-losses), torch.tensor(indices)))
    np.testing.assert_allclose(ours.per_query, theirs.numpy(), atol=1e-12)


def test_lds_of_an_exact_linear_datamodel_is_one_and_undefined_queries_are_left_out():
    scores, masks, _, _ = random_problem(seed=1)
    losses = 2.0 - subset_sums(scores, masks)  # loss(S) = c - sum of helpful influence
    losses[:, 2] = 1.5  # a constant outcome: undefined
    result = linear_datamodeling_score(scores, masks, losses)
    assert np.isnan(result.per_query[2]) and result.n_defined == len(scores) - 1
    np.testing.assert_allclose(np.delete(result.per_query, 2), 1.0)
    assert result.mean == pytest.approx(1.0)


def test_lds_checks_its_arguments():
    scores, masks, _, outcomes = random_problem()
    with pytest.raises(ValueError, match="outcome"):
        linear_datamodeling_score(scores, masks, outcomes, outcome="accuracy")
    with pytest.raises(ValueError, match="masks"):
        linear_datamodeling_score(scores, masks.astype(int), outcomes)
    with pytest.raises(ValueError, match="n_models >= 2"):
        linear_datamodeling_score(scores, masks[:1], outcomes[:1])
    with pytest.raises(ValueError, match="outcomes"):
        linear_datamodeling_score(scores, masks, outcomes.T)


def test_sign_agreement_counts_and_clopper_pearson_interval():
    predicted = np.array([1.0, -2.0, 3.0, -1.0, 0.5, 0.0])
    measured = np.array([0.1, -0.3, -0.2, -0.5, 0.4, 1.0])  # the zero prediction is left out
    result = sign_agreement(predicted, measured)
    assert (result["n_agree"], result["n_pairs"]) == (4, 5)
    assert result["rate"] == pytest.approx(0.8)
    interval = binomtest(4, 5).proportion_ci(confidence_level=0.95, method="exact")
    assert result["ci"] == pytest.approx([interval.low, interval.high])
    assert sign_agreement([], [])["rate"] is None


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def report():
    x, y, xq, yq = data()
    return validate(train_fn, x, y, xq, yq, estimators=("ntk", "gradient", "captum"), verbose=False,
                    model_name="2l-relu", dataset="digits", **TINY)


def test_report_structure(report):
    x, y, xq, yq = data()
    assert list(report.results) == ["ntk-exact", "gradient", "captum"]
    assert report.model_digest == weights_digest(train_fn(x.copy(), y.copy(), 0))
    assert report.n_train == len(x) and report.n_queries == len(xq)
    assert len(report.subsets) == 4 and all(len(s) == 50 for s in report.subsets)
    assert np.array(report.outcomes).shape == (4, len(xq))
    assert len(report.loo_queries) == 2 and report.loo_seeds[0] == 0 and len(report.loo_seeds) == 2
    for r in report.results.values():
        assert len(r.lds_per_query) == len(xq) and len(r.example_predicted) == 4
        assert r.lds is None or -1.0 <= r.lds <= 1.0
        assert r.n_loo_pairs <= 4 and 0 <= r.n_loo_agree <= r.n_loo_pairs
        assert {p["train_index"] for p in r.loo_pairs} <= set(report.loo_removed)
        assert set(r.seconds) == {"fit", "scores"}
    assert set(report.seconds) == {"train_full", "retrain_lds", "retrain_loo"}
    # TracIn twice: the package's gradient estimator and Captum's give the same LDS
    assert report.results["gradient"].lds == pytest.approx(report.results["captum"].lds)
    small = report.fidelity("ntk")
    assert small == report.fidelity("ntk-exact")
    assert set(small) == {"estimator", "lds", "lds_ci", "loo_sign_agreement", "n_models", "alpha", "outcome"}
    assert small["estimator"] == "ntk-exact" and small["n_models"] == 4 and report.fidelity("trak") is None
    assert "ntk-exact" in report.summary() and "LDS" in report.summary()


def test_report_lds_equals_dattri_on_the_run_subsets_and_outcomes(report):
    x, y, xq, yq = data()
    full = train_fn(x.copy(), y.copy(), 0)
    scores = GradientInfluence(device="cpu").fit(full, x, y).scores(xq, yq)
    theirs, _ = dattri_lds(
        torch.tensor(scores.T), (-torch.tensor(report.outcomes, dtype=torch.float64), torch.tensor(report.subsets))
    )
    ours = np.array([np.nan if v is None else v for v in report.results["gradient"].lds_per_query])
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-10)


def test_same_seed_same_report_and_json_round_trip(report, tmp_path):
    x, y, xq, yq = data()
    again = validate(train_fn, x, y, xq, yq, estimators=("ntk", "gradient", "captum"), verbose=False,
                     model_name="2l-relu", dataset="digits", **TINY)
    strip = ("seconds", "results")
    assert {k: v for k, v in again.to_dict().items() if k not in strip} == {
        k: v for k, v in report.to_dict().items() if k not in strip
    }
    for name, r in report.results.items():
        assert again.results[name].lds_per_query == r.lds_per_query
        assert again.results[name].loo_pairs == r.loo_pairs
    folder = report.save(tmp_path / "v")
    assert {p.name for p in folder.iterdir() if not p.name.startswith(".")} == {
        "validation.json", "validation.md", "lds.png", "scatter.png"
    }
    assert ValidationReport.load(folder) == report
    assert json.loads((folder / "validation.json").read_text())["model_digest"] == report.model_digest
    assert "LDS" in (folder / "validation.md").read_text()


# ------------------------------------------------------------------------------------ bad input, no mutation


class Calls:
    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, x, y, seed):
        self.n += 1
        return self.fn(x, y, seed)


def snapshot(*arrays):
    return [a.copy() for a in arrays]


def rng_states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def assert_rng_equal(a, b):
    assert a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_nothing_of_the_callers_is_changed():
    x, y, xq, yq = data()
    before, states = snapshot(x, y, xq, yq), rng_states()
    estimator = NTKInfluence(projection_dim=16, device="cpu")

    def noisy_train_fn(x_s, y_s, seed):  # draws from the global generators and writes to its arrays
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        model = train_fn(x_s, y_s, seed)
        x_s[:] = 0.0
        return model

    result = validate(noisy_train_fn, x, y, xq, yq, estimators=[estimator, "gradient"], verbose=False,
                      **{**TINY, "loo_queries": 1, "loo_top": 1})
    assert list(result.results) == ["ntk-projected-k16", "gradient"]
    assert result.results["ntk-projected-k16"].params["mode"] == "projected"
    for a, b in zip(before, (x, y, xq, yq), strict=True):
        np.testing.assert_array_equal(a, b)
    assert_rng_equal(states, rng_states())
    assert not estimator.is_fitted


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"n_models": 1}, "n_models"),
        ({"outcome": "accuracy"}, "outcome"),
        ({"loo_seeds": 0}, "loo_seeds"),
    ],
)
def test_bad_settings_fail_before_any_training(settings, match):
    x, y, xq, yq = data()
    calls, states = Calls(train_fn), rng_states()
    with pytest.raises(ValueError, match=match):
        validate(calls, x, y, xq, yq, verbose=False, **{**TINY, **settings})
    assert calls.n == 0
    assert_rng_equal(states, rng_states())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"loo_queries": -1}, "loo_queries must be a non-negative integer, got -1"),
        ({"loo_top": 0}, "loo_top must be a positive integer, got 0"),
        ({"loo_seeds": 2.0}, "loo_seeds must be a positive integer, got 2.0"),
        ({"seed": -1}, "seed must be a non-negative integer (numpy's seeds are), got -1"),  # numpy's seeds: refused now
        ({"seed": 1.5}, "seed must be a non-negative integer, got 1.5"),
        ({"n_bootstrap": 1},
         "n_bootstrap must be an integer of at least 10 (the resamples an interval is built from), got 1"),
        ({"confidence": 1.0}, "confidence must lie in (0, 1), got 1.0"),
        ({"outcome": "accuracy"}, "outcome must be one of ('loss', 'margin'), got 'accuracy'"),
        ({"loss": "l1"}, "loss must be one of ('cross_entropy', 'mse'), got 'l1'"),
    ],
)
def test_each_setting_is_refused_by_its_declared_rule_before_any_training(settings, message):
    from art_malleability._utils.params import InvalidParameterError, check_values
    from art_malleability.validation.run import VALIDATE_RULES

    x, y, xq, yq = data()
    calls = Calls(train_fn)
    with pytest.raises(InvalidParameterError) as refused:
        validate(calls, x, y, xq, yq, verbose=False, **{**TINY, **settings})
    (name,) = settings
    assert calls.n == 0 and refused.value.param == name and str(refused.value) == message
    with pytest.raises(InvalidParameterError) as rule:  # the table's rule says the same
        check_values({name: VALIDATE_RULES[name]}, settings)
    assert str(rule.value) == message


def test_the_lds_and_validate_share_the_outcome_rule_and_the_cli_its_options_rules():
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.cli.checks import OPTION_RULES
    from art_malleability.cli.options import VALIDATE_OPTIONS
    from art_malleability.validation.run import VALIDATE_RULES

    with pytest.raises(InvalidParameterError) as refused:
        linear_datamodeling_score(np.zeros((2, 4)), np.ones((3, 4), bool), np.zeros((3, 2)), outcome="accuracy")
    assert str(refused.value) == "outcome must be one of ('loss', 'margin'), got 'accuracy'"
    assert set(VALIDATE_OPTIONS) <= set(VALIDATE_RULES)
    for param, option in VALIDATE_OPTIONS.items():
        rules = VALIDATE_RULES[param]
        assert OPTION_RULES["validate"][option] == (rules if isinstance(rules, tuple) else (rules,)), option


def test_a_subset_missing_a_class_names_the_class_and_the_way_out():
    x, y, xq, yq = data()
    y = y.copy()
    y[y == 9] = 8
    y[0] = 9  # class 9 now has one example
    calls = Calls(train_fn)
    with pytest.raises(ValueError, match=r"class 9 .*larger alpha or more training examples"):
        validate(calls, x, y, xq, yq, verbose=False, **{**TINY, "alpha": 0.2, "n_models": 20})
    assert calls.n == 0


def test_a_failing_train_fn_is_named_with_its_cause():
    x, y, xq, yq = data()

    def broken(x_s, y_s, seed):
        raise ArithmeticError("diverged")

    with pytest.raises(RuntimeError, match="train_fn must train") as info:
        validate(broken, x, y, xq, yq, verbose=False, **TINY)
    assert isinstance(info.value.__cause__, ArithmeticError)


def test_train_fn_must_return_a_trained_module():
    x, y, xq, yq = data()
    states = rng_states()
    with pytest.raises(TypeError, match="train_fn must return the trained torch.nn.Module"):
        validate(lambda x_s, y_s, seed: "model", x, y, xq, yq, verbose=False, **TINY)

    def untrained(x_s, y_s, seed):
        return build_reference_model("2l-relu", (1, 8, 8), 10, width=32, seed=seed)

    with pytest.raises(ValueError, match="has not learnt its training data"):
        validate(untrained, x, y, xq, yq, verbose=False, **TINY)
    assert_rng_equal(states, rng_states())


def test_cli_validate_tiny(tmp_path, capsys):
    out = tmp_path / "val"
    code = main([
        "validate", "--n-train", "100", "--n-test", "30", "--n-queries", "8", "--epochs", "40", "--width", "32",
        "--model", "2l-relu", "--estimators", "ntk", "gradient", "--projection-dim", "none", "16", "--n-models", "3",
        "--loo-queries", "1", "--loo-top", "1", "--loo-seeds", "2", "--n-bootstrap", "20",
        "--output", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ntk-exact" in printed and "ntk-projected-k16" in printed and "gradient" in printed
    saved = ValidationReport.load(out / "2l-relu")
    assert saved.config["n_models"] == 3 and saved.n_queries == 8
    assert "## 2l-relu" in (out / "summary.md").read_text()
    assert main(["validate", "--alpha", "1.5", "--output", str(tmp_path / "bad"), "--quiet"]) == 2
    assert "alpha" in capsys.readouterr().err
