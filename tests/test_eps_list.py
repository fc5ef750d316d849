"""An audit at several budgets (``eps`` a list): one clean fit, one refit per attack and budget, each result the one of
an audit at that budget alone, and the report's flip rate against eps."""

import numpy as np
import pytest

PARAMS = {"attack_max_iter": 3, "n_bootstrap": 50, "verbose": False, "control_draws": 2, "n_queries": 40,
          "device": "cpu"}


@pytest.fixture(scope="module")
def digits_classifier():
    from helpers import digits, trained_classifier

    data = digits()
    return trained_classifier("2l-relu", epochs=50), data.x_train, data.y_train


@pytest.fixture(scope="module")
def eps_list_audit(digits_classifier):
    """An audit of FGSM and PGD at three budgets, with its counts of clean fits and refits."""
    from art_malleability.influence import NTKInfluence

    clf, x, y = digits_classifier
    counts = {"fit": 0, "refit": 0}
    fit, refit = NTKInfluence.fit, NTKInfluence.refit

    def counted_fit(self, *args, warm_start=False, **kwargs):
        counts["refit" if warm_start else "fit"] += 1
        return fit(self, *args, warm_start=warm_start, **kwargs)

    def counted_refit(self, *args, **kwargs):
        counts["refit"] += 1
        return refit(self, *args, **kwargs)

    from art_malleability.audit.estimator import MalleabilityEstimator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NTKInfluence, "fit", counted_fit)
        patch.setattr(NTKInfluence, "refit", counted_refit)
        report = MalleabilityEstimator(clf, attacks=("fgsm", "pgd"), eps=[0.1, 0.2, 0.3], **PARAMS).evaluate(x, y)
    return report, counts


def test_an_eps_list_fits_once_and_refits_once_per_attack_and_budget(eps_list_audit):
    report, counts = eps_list_audit
    assert [r.attack for r in report.results] == [f"{a} eps={e}" for a in ("fgsm", "pgd") for e in (0.1, 0.2, 0.3)]
    assert [r.params["eps"] for r in report.results] == [0.1, 0.2, 0.3] * 2
    assert report.execution["mode"] == "exact"  # one fit: no twin of another projection seed
    # one clean fit; one refit per attack and budget, and control_draws per budget's control
    assert counts == {"fit": 1, "refit": 6 + 3 * PARAMS["control_draws"]}
    assert report.config["eps"] == [0.1, 0.2, 0.3] and report.config["attacks"] == ["fgsm", "pgd"]
    assert [r.control["eps"] for r in report.results] == [0.1, 0.2, 0.3] * 2


def test_each_budget_of_an_eps_list_reports_what_an_audit_at_that_budget_alone_reports(eps_list_audit,
                                                                                       digits_classifier):
    from art_malleability.audit.estimator import MalleabilityEstimator

    report, _ = eps_list_audit
    clf, x, y = digits_classifier
    alone = MalleabilityEstimator(clf, attacks=("pgd",), eps=0.2, **PARAMS).evaluate(x, y)
    assert alone.results[0].attack == "pgd"  # one budget: the plain label

    def numbers(result):
        return {k: v for k, v in result.__dict__.items() if k not in ("seconds", "attack")}

    assert numbers(report.result("pgd eps=0.2")) == numbers(alone.results[0])
    assert report.top_indices == alone.top_indices and report.scores_before == alone.scores_before


def test_the_report_of_an_eps_list_shows_the_flip_rate_against_eps(eps_list_audit, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from art_malleability.audit._reading import noise_aware_text
    from art_malleability.audit.eps_sweep import FIGURE_NAME, eps_series, plot_flip_rate_against_eps

    report, _ = eps_list_audit
    series = eps_series(report.results)
    assert list(series) == ["fgsm", "pgd"] and [e for e, _ in series["pgd"]] == [0.1, 0.2, 0.3]
    report.save(tmp_path / "out")
    assert (tmp_path / "out" / FIGURE_NAME).stat().st_size > 1000
    markdown = (tmp_path / "out" / "report.md").read_text()
    section = markdown.split("## Flip rate against eps")[1]
    for eps, r in series["fgsm"]:  # each row's noise-aware rate reads as the main table reads it
        row = next(line for line in section.splitlines() if line.startswith(f"| fgsm | {eps:g} |"))
        assert noise_aware_text(r.flip_rate_above_floor, r.flip_rate_above_floor_ci, r.undecided_share) in row
    figure = plot_flip_rate_against_eps(report)
    lines = {line.get_label(): line for line in figure.axes[0].get_lines()}
    raw = lines["pgd: flip rate"]
    assert np.allclose(raw.get_xdata(), [0.1, 0.2, 0.3])
    assert np.allclose(raw.get_ydata(), [100 * r.flip_rate for _, r in series["pgd"]])
    control = lines["random-sign control"]
    assert np.allclose(control.get_ydata(), [100 * r.control["flip_rate"] for _, r in series["pgd"]])
    # a rate the table reads as undecided has no point on the noise-aware line
    from art_malleability.audit._reading import undecided

    aware = lines["fgsm: noise-aware"].get_ydata()
    for (_, r), y in zip(series["fgsm"], aware, strict=True):
        if undecided(r.flip_rate_above_floor, r.flip_rate_above_floor_ci, r.undecided_share):
            assert np.isnan(y)
        else:
            assert y == pytest.approx(100 * r.flip_rate_above_floor)


def test_one_budget_has_no_eps_figure(digits_classifier):
    from art_malleability.audit.eps_sweep import eps_series, plot_flip_rate_against_eps
    from art_malleability.audit.report import AttackResult

    fields = {"params": {"eps": 0.3}, "n_perturbed": 3, "attack_success": 1.0, "max_perturbation": 0.3,
              "flip_rate": 0.1, "flip_rate_ci": [0.0, 0.2], "per_query_flip_rate": 0.1,
              "per_query_flip_rate_ci": [0.0, 0.2], "spearman": 0.9, "spearman_ci": [0.8, 1.0],
              "top_k_jaccard": 0.5, "top_k_jaccard_ci": [0.4, 0.6], "scores_after": [0.0]}
    assert eps_series([AttackResult(attack="fgsm", **fields), AttackResult(attack="pgd", **fields)]) == {}

    class OneBudget:
        results = [AttackResult(attack="fgsm", **fields)]

    with pytest.raises(ValueError, match="report must hold an audit at two or more budgets"):
        plot_flip_rate_against_eps(OneBudget())


@pytest.mark.parametrize(("eps", "message"), [
    ([], r"eps must name at least one budget, got \[\]"),
    ([0.1, 0.1], "eps must hold distinct budgets"),
    ([0.1, -0.2], "eps must be a positive finite number, got -0.2"),
    ([0.1, "0.2"], "eps must be a positive number, got str .0.2."),
    ([0.1, 1.5], "eps must be smaller than the classifier's whole input range"),
])
def test_a_bad_eps_list_is_refused_naming_eps_and_changes_nothing(digits_classifier, eps, message):
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, _, _ = digits_classifier
    est = MalleabilityEstimator(clf, eps=[0.1, 0.3], verbose=False)
    attacks = list(est._attacks)
    with pytest.raises(InvalidParameterError, match=message):
        est.set_params(eps=eps, seed=4)
    assert est.eps == (0.1, 0.3) and est.seed == 0 and est._attacks == attacks
    assert MalleabilityEstimator(clf, eps=[0.2], verbose=False).eps == 0.2  # one budget given as a list


def test_ready_made_attacks_of_one_kind_are_told_apart_by_their_budgets(digits_classifier):
    from art.attacks.evasion import FastGradientMethod

    from art_malleability.audit.attacks import attack_labels
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, _, _ = digits_classifier
    two = (FastGradientMethod(clf, eps=0.1), FastGradientMethod(clf, eps=0.2))
    assert attack_labels(two) == ["fgsm eps=0.1", "fgsm eps=0.2"]
    est = MalleabilityEstimator(clf, attacks=(*two, "pgd"), verbose=False)
    assert attack_labels(est._attacks) == ["fgsm eps=0.1", "fgsm eps=0.2", "pgd"]
    with pytest.raises(ValueError, match="attacks must be distinct"):
        MalleabilityEstimator(clf, attacks=(FastGradientMethod(clf, eps=0.1), FastGradientMethod(clf, eps=0.1)))


@pytest.mark.parametrize(("values", "message"), [
    (["0.1", "0.1"], "--eps (eps) must hold distinct budgets (each one once), got [0.1, 0.1]"),
    (["0.1", "3"], "--eps must lie in (0, 1): an l-inf budget on inputs scaled to [0, 1] (every --dataset is), got 3"),
])
def test_the_command_line_takes_an_eps_list_and_refuses_a_bad_one_before_reading_data(tmp_path, capsys, monkeypatch,
                                                                                     values, message):
    import art_malleability.cli.audit as cli_audit
    from art_malleability.cli import build_parser, main

    assert build_parser().parse_args(["audit", "--eps", "0.1", "0.2"]).eps == [0.1, 0.2]
    monkeypatch.setattr(cli_audit, "load_data", lambda *a, **k: pytest.fail("the data was read before the check"))
    assert main(["audit", "--output", str(tmp_path / "out"), "--eps", *values]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_estimate_of_an_eps_list_counts_every_attack_and_refit(digits_classifier):
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, x, _ = digits_classifier
    params = {**PARAMS, "attacks": ("fgsm", "pgd")}
    one = MalleabilityEstimator(clf, eps=0.3, **params).estimate(x)
    three = MalleabilityEstimator(clf, eps=[0.1, 0.2, 0.3], **params).estimate(x)
    assert one.refits == 2 + PARAMS["control_draws"] and three.refits == 6 + 3 * PARAMS["control_draws"]
    assert three.seconds["attacks"] == pytest.approx(3 * one.seconds["attacks"])
