"""
The whole audit's pre-flight estimate (issue 35, item 2): printed before the long work on the command line, decided
from fixed facts (the same inputs always get the same estimate), the mode of "auto" chosen on the audit's own work
within ``--time-budget`` / ``time_budget_s``, and ``--memory-limit-gb`` / ``memory_limit_gb`` in both.
"""

import json

import numpy as np
import pytest
import torch
from helpers import digits, trained_classifier

from art_malleability import MalleabilityEstimator
from art_malleability.cli import main

SMALL = ["--model", "2l-relu", "--width", "16", "--epochs", "2", "--n-train", "60", "--n-test", "20",
         "--n-queries", "5", "--n-bootstrap", "10", "--attacks", "fgsm", "--no-controls"]


def test_the_command_line_prints_the_audit_plan_before_training_and_records_it(tmp_path, capsys):
    out = tmp_path / "audit"
    assert main(["audit", *SMALL, "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = [i for i, line in enumerate(lines) if "audit plan:" in line]
    trained = [i for i, line in enumerate(lines) if "trained 2 epochs" in line]
    assert len(plan) == 1 and trained and plan[0] < trained[0], lines
    assert lines[plan[0]].startswith("2l-relu: audit plan: exact NTK influence on 60 training examples, 5 queries, "
                                     "1 refits; about ")
    assert "change with --time-budget, --memory-limit-gb, --projection-dim or --n-queries" in lines[plan[0]]
    report = json.loads((out / "2l-relu" / "report.json").read_text())
    assert report["config"]["estimate"]["mode"] == report["execution"]["mode"] == "exact"
    assert report["config"]["time_budget_s"] == 1800.0 and report["config"]["memory_limit_gb"] is None


def test_the_time_budget_decides_the_mode_on_the_audits_work(tmp_path, capsys):
    out = tmp_path / "audit"
    # over the budget, but the projected mode would take longer on 60 examples: the exact one runs, and says why (a
    # new user's --time-budget 0.01 had switched to a projected mode estimated 16 times longer, warning thrice)
    assert main(["audit", *SMALL, "--time-budget", "1e-9", "--memory-limit-gb", "2", "--output", str(out)]) == 0
    assert "audit plan: exact NTK influence" in capsys.readouterr().out
    report = json.loads((out / "2l-relu" / "report.json").read_text())
    execution = report["execution"]
    assert execution["mode"] == "exact" and "over exact_budget_s=1e-09 s" in execution["mode_reason"]
    assert "the projected mode would take longer" in execution["mode_reason"]
    assert not any("not affordable" in w for w in report["warnings"])
    assert execution["params"]["memory_limit_gb"] == 2.0


@pytest.mark.parametrize("args, words", [
    (["--time-budget", "0"], "--time-budget must be a positive finite number, got 0"),
    (["--memory-limit-gb", "-1"], "--memory-limit-gb must be a positive finite number, got -1"),
    (["--time-budget", "60", "--influence", "gradient"], "--time-budget has no effect with --influence gradient"),
    (["--time-budget", "60", "--projection-dim", "64"], "--time-budget has no effect with --projection-dim 64"),
])
def test_budget_options_that_cannot_work_are_refused_before_any_data_is_read(tmp_path, capsys, args, words):
    assert main(["audit", *args, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", [[], ["--influence", "gradient"], ["--projection-dim", "64"],
                                   ["--influence", "gradient", "--memory-limit-gb", "3"]])
def test_every_option_the_plan_line_names_is_one_that_works_with_the_others(given):
    # a new user: the plan of --influence gradient said "change with --time-budget, ...", then refused --time-budget
    from art_malleability.cli import build_parser
    from art_malleability.cli.audit import plan_options
    from art_malleability.cli.checks import preflight

    values = {"--time-budget": "60", "--memory-limit-gb": "2", "--projection-dim": "32", "--n-queries": "7"}
    named = plan_options(build_parser().parse_args(["audit", *given])).replace(" or ", ", ").split(", ")
    assert set(named) <= set(values) and "--n-queries" in named and "--memory-limit-gb" in named
    assert ("--time-budget" in named) == (given == [])
    assert ("--projection-dim" in named) == ("gradient" not in given)
    for option in named:
        preflight(build_parser().parse_args(["audit", *given, option, values[option]]))  # not refused
    for option in set(values) - set(named):
        with pytest.raises(Exception, match=f"{option} has no effect"):
            preflight(build_parser().parse_args(["audit", *given, option, values[option]]))


@pytest.fixture(scope="module")
def relu():
    return trained_classifier("2l-relu", epochs=5), digits(200, 40)


def test_the_estimate_is_the_same_every_time_changes_nothing_and_names_the_mode_evaluate_runs(relu):
    clf, data = relu
    before = {k: v.clone() for k, v in clf.model.state_dict().items()}
    audit = MalleabilityEstimator(clf, n_queries=30, n_bootstrap=50, verbose=False, device="cpu")
    first, again = audit.estimate(data.x_train, data.x_test), audit.estimate(data.x_train, data.x_test)
    assert first.to_dict() == again.to_dict()
    assert (first.n_train, first.n_queries, first.refits) == (200, 30, 8)  # three attacks, five control draws
    assert all(v > 0 for v in first.seconds.values())
    assert first.seconds["total"] == pytest.approx(sum(v for k, v in first.seconds.items() if k != "total"))
    assert all(torch.equal(v, clf.model.state_dict()[k]) for k, v in before.items())
    assert not hasattr(audit._influence, "mode_")  # the influence was not fitted by the estimate
    report = audit.evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    assert report.execution["mode"] == first.mode == "exact"
    squeezed = MalleabilityEstimator(clf, n_queries=30, n_bootstrap=50, verbose=False, device="cpu",
                                     time_budget_s=first.seconds["influence"] / 2)
    over = squeezed.estimate(data.x_train, data.x_test)  # over the budget; the projected mode is longer still
    assert over.mode == "exact" and "the projected mode would take longer" in over.reason


@pytest.mark.parametrize("influence", ["gradient", "captum"])
def test_tracin_influences_are_estimated_from_their_counted_work(relu, influence):
    # the TracIn estimators' scores are estimated too (the training set's gradients with every query block, their dot
    # products), from counted operations: positive, the same every time, growing with the work
    clf, data = relu
    audit = MalleabilityEstimator(clf, influence=influence, n_queries=30, n_bootstrap=50, verbose=False, device="cpu")
    first = audit.estimate(data.x_train, data.x_test)
    assert first.mode is None and first.seconds["influence"] > 0
    assert first.to_dict() == audit.estimate(data.x_train, data.x_test).to_dict()
    assert "not estimated" not in first.summary()
    larger = MalleabilityEstimator(clf, influence=influence, n_queries=30, n_bootstrap=50, verbose=False,
                                   device="cpu").estimate(np.concatenate([data.x_train] * 4), data.x_test)
    assert larger.seconds["influence"] > 2 * first.seconds["influence"]


def test_budget_parameters_are_checked():
    clf = trained_classifier("2l-relu", epochs=1)
    for name, bad in (("time_budget_s", 0.0), ("time_budget_s", np.inf), ("memory_limit_gb", -1.0)):
        with pytest.raises(ValueError, match=name):
            MalleabilityEstimator(clf, **{name: bad})


def test_a_transductive_model_is_estimated_with_its_training_set_as_context_and_left_without_one():
    """MLP-Attn attends over its training set: the estimate gives a copy that context (the CLI estimates the model
    before training, when it has none) and leaves the model as it was."""
    from art_malleability.models import build_reference_model, make_classifier

    data = digits(120, 20)
    model = build_reference_model("mlp-attn", (1, 8, 8), 10, width=16, seed=0)
    audit = MalleabilityEstimator(make_classifier(model, (1, 8, 8), 10, device="cpu"), n_queries=10, verbose=False,
                                  device="cpu")
    plan = audit.estimate(data.x_train, data.x_test)
    assert plan.mode == "exact" and plan.seconds["total"] > 0
    with pytest.raises(RuntimeError, match="no context"):
        model(torch.as_tensor(data.x_test[:2]))


def test_a_planned_projection_fits_its_second_seed_before_the_clean_fit(relu, caplog):
    """When "auto" will project (decided from fixed facts, so known before the fit), the noise model's second
    projection seed is fitted first and dropped before the clean fit: two fitted estimators never share the memory."""
    clf, data = relu
    from art_malleability.influence import NTKInfluence

    influence = NTKInfluence(device="cpu", max_exact_n=len(data.x_train) - 1)  # "auto" projects, known beforehand
    audit = MalleabilityEstimator(clf, attacks=["fgsm"], n_queries=20, n_bootstrap=50, control_draws=1,
                                  verbose=False, device="cpu", influence=influence)
    with caplog.at_level("WARNING", logger="art_malleability"):
        report = audit.evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    assert report.execution["mode"] == "projected" and "exceed max_exact_n" in report.execution["mode_reason"]
    # why it projects is said once in the log (the second seed's twin runs the projection chosen, unwarned) and once
    # in the report (a new user's --time-budget 0.01 had warned three times)
    assert caplog.text.count("the exact NTK influence is not affordable here") == 1
    assert sum("not affordable here" in w for w in report.warnings) == 1
    order = list(report.seconds)
    assert order.index("influence_other_seeds") < order.index("influence_clean"), order


def test_a_projected_audit_is_estimated_with_its_other_seeds_fit(relu, monkeypatch):
    """The projected mode's estimate adds the twin of the next projection seed (its fit and the queries scored once,
    as ``_other_seed_scores`` runs it) to the influence's planned work, and nothing in the exact mode."""
    import art_malleability.audit._estimate as estimate

    clf, data = relu
    audit = MalleabilityEstimator(clf, n_queries=20, n_bootstrap=50, verbose=False, device="cpu", projection_dim=64)
    plan = audit._influence.plan(clf.model, data.x_train[:64], len(data.x_train))  # the influence's own planned work
    assert plan["mode"] == "projected" and 0 < plan["fit_seconds"] < plan["seconds"]["projected"]
    seen = {}
    real = estimate.NTKInfluence.plan

    def planned(self, *args):
        seen.update(real(self, *args))
        return dict(seen)

    monkeypatch.setattr(estimate.NTKInfluence, "plan", planned)
    first = audit.estimate(data.x_train, data.x_test)
    assert first.mode == "projected"
    assert first.seconds["influence"] == pytest.approx(seen["seconds"]["projected"] + seen["fit_seconds"])
    exact = MalleabilityEstimator(clf, n_queries=20, n_bootstrap=50, verbose=False, device="cpu", projection_dim=None)
    seen.clear()
    assert exact.estimate(data.x_train, data.x_test).seconds["influence"] == pytest.approx(seen["seconds"]["exact"])


def test_the_peak_estimate_counts_what_is_kept_of_the_queries_between_passes(relu, monkeypatch):
    """The exact mode keeps the queries' solves on the unchanged rows and their rows on the set (each up to
    QUERY_CACHE_BYTES) and their factors (up to a quarter of what the budget leaves): the plan counts them, and the
    audit's peak estimate with them."""
    from art_malleability._utils import cache
    from art_malleability.influence import NTKInfluence

    clf, data = relu
    n, q = len(data.x_train), 30
    ntk = NTKInfluence(projection_dim=None, planned_queries=q, device="cpu")
    plan = ntk.plan(clf.model, data.x_train, n)
    assert plan["mode"] == "exact" and plan["cache_bytes"] > 2 * 8 * q * n  # solves, rows and the queries' factors
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 1000)
    small = ntk.plan(clf.model, data.x_train, n)["cache_bytes"]
    twice = NTKInfluence(projection_dim=None, planned_queries=2 * q, device="cpu").plan(clf.model, data.x_train, n)
    per_query = (twice["cache_bytes"] - small) / q  # the factors: one query's each, all kept
    assert per_query > 0 and small == 2000 + q * per_query
    audit = MalleabilityEstimator(clf, influence=ntk, n_queries=q, verbose=False, device="cpu")
    capped = audit.estimate(data.x_train, data.x_test).peak_bytes
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 2**30)
    assert audit.estimate(data.x_train, data.x_test).peak_bytes - capped == plan["cache_bytes"] - small
    assert plan["bytes"] > plan["cache_bytes"]  # the need the memory check asks for counts them too


def test_a_memory_limit_no_query_count_fits_is_what_the_refusal_names():
    # a new user's --memory-limit-gb 0.1 was told "pass at most about 0 queries", and blamed --n-queries
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.audit.params import check_query_budget
    from art_malleability.metrics.accumulators import metrics_plan

    cpu = torch.device("cpu")
    fixed = metrics_plan(0, 20_000, 2_000, 1000, False)["memory_bytes"] / 2**30
    with pytest.raises(InvalidParameterError) as tiny:
        check_query_budget(300, 20_000, 2_000, 1000, False, fixed / 2, cpu)
    assert tiny.value.param == "memory_limit_gb" and "raise it to at least" in str(tiny.value)
    need = float(str(tiny.value).split("raise it to at least ")[1].split(" GiB")[0])
    assert check_query_budget(2, 20_000, 2_000, 1000, False, need * 1.01, cpu)["memory_bytes"] <= need * 1.01 * 2**30
    whole = metrics_plan(300, 20_000, 2_000, 1000, False)["memory_bytes"] / 2**30
    with pytest.raises(InvalidParameterError) as some:  # room for some queries: the count is what to change
        check_query_budget(300, 20_000, 2_000, 1000, False, (fixed + whole) / 2, cpu)
    assert some.value.param == "n_queries" and "pass at most about" in str(some.value)


def test_a_memory_limit_below_the_plans_peak_is_refused_before_training(tmp_path, capsys):
    # a new user's 40,000-image audit with --memory-limit-gb 6 planned 8.0 GB and ran (past 50 minutes)
    out = tmp_path / "audit"
    code = main(["audit", *SMALL, "--memory-limit-gb", "0.3", "--output", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "audit plan:" in captured.out and "trained" not in captured.out
    words = "--memory-limit-gb must hold the audit's planned peak memory, got 0.3 (GiB), where the plan of 2l-relu"
    assert words in captured.err and "raise it to at least" in captured.err and not out.exists()
    need = float(captured.err.split("raise it to at least ")[1].split(",")[0])
    assert main(["audit", *SMALL, "--memory-limit-gb", str(need), "--output", str(out)]) == 0  # the size it names
