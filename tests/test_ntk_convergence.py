"""NTK-convergence checker: physics it must show, its linearised-dynamics oracle, report, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from art_malleability.cli import main
from art_malleability.data import load_dataset
from art_malleability.influence.ridge import kernel_ridge_predict
from art_malleability.models import build_reference_model
from art_malleability.ntk.analytic import analytic_ntk
from art_malleability.ntk.convergence import (
    CONVERGES,
    DESCRIPTIVE,
    NO_CONVERGENCE,
    ConvergenceReport,
    NTKConvergenceChecker,
    _Limit,
)
from art_malleability.ntk.convergence_report import kept_records
from art_malleability.ntk.empirical import empirical_ntk


@pytest.fixture(scope="module")
def small_digits():
    return load_dataset("digits", n_train=40, n_test=20, seed=0)


@pytest.fixture(scope="module")
def report(small_digits):
    d = small_digits
    checker = NTKConvergenceChecker(
        widths=[16, 128, 1024], seeds=[0, 1, 2], protocols=["gd", "adam"], gd_steps=30, adam_epochs=2,
        n_bootstrap=200, device="cpu", verbose=False,
    )
    return checker.run(d.x_train, d.y_train, d.x_test, d.y_test, dataset="digits")


def _fit(report, model, metric, protocol=None):
    return next(f for f in report.fits if (f.model, f.metric, f.protocol) == (model, metric, protocol))


def test_static_kernel_error_falls_like_inverse_sqrt_width_for_all_models(small_digits):
    d = small_digits
    shape, k = d.input_shape, d.nb_classes
    models = {
        "2l-relu": lambda w, s: build_reference_model("2l-relu", shape, k, width=w, seed=s),
        "gram": lambda w, s: build_reference_model("mlp-attn", shape, k, width=w, seed=s, context="gram"),
        "centred": lambda w, s: build_reference_model("mlp-attn", shape, k, width=w, seed=s, context="centred"),
    }
    rep = NTKConvergenceChecker(models=models, widths=[16, 256, 4096], seeds=list(range(10)), protocols=[],
                                n_bootstrap=300, device="cpu", verbose=False).run(d.x_train, d.y_train, d.x_test,
                                                                                  d.y_test)
    for model in models:
        fit = _fit(rep, model, "kernel_error")
        assert -0.7 < fit.exponent < -0.3, (model, fit.exponent)
        assert fit.verdict == CONVERGES, (model, fit.interval)
    # the spectral level separates the paper's literal MLP-Attn: its smallest eigenvalue stays far below its limit at
    # widths where 2L-ReLU's is already close (means over seeds at m = 16, 256, 4096)
    gram, relu = _fit(rep, "gram", "lambda_min_ratio"), _fit(rep, "2l-relu", "lambda_min_ratio")
    assert gram.verdict == DESCRIPTIVE
    assert gram.means[0] < 1e-3 and gram.means[1] < 1e-2 and relu.means[1] > 0.5 and relu.means[2] > 0.9
    # the centred context removes it: its smallest eigenvalue follows the 2L-ReLU's (measured 0.14, 0.84, 1.00)
    centred = _fit(rep, "centred", "lambda_min_ratio")
    assert centred.means[1] > 0.5 and centred.means[2] > 0.9


def test_records_levels_and_verdicts_are_separate(report):
    assert len(report.records) == 2 * 3 * 3 * 4  # models x widths x seeds x (static, spectral, gd, adam)
    verdicts = report.level_verdicts()
    assert {(v["model"], v["level"], v["protocol"]) for v in verdicts} == {
        (m, lvl, p) for m in ("2l-relu", "mlp-attn")
        for lvl, p in (("static", None), ("spectral", None), ("dynamic", "gd"), ("dynamic", "adam"))
    }
    assert all(v["verdict"] in (CONVERGES, NO_CONVERGENCE) for v in verdicts)
    gd = [r for r in report.records if r["protocol"] == "gd"]
    assert all(r["linearised_distance"] is not None and r["kernel_movement"] >= 0 for r in gd)
    assert all(r["linearised_distance"] is None for r in report.records if r["protocol"] == "adam")


def test_lazy_training_under_gd_shrinks_with_width(report):
    fit = _fit(report, "2l-relu", "kernel_movement", "gd")
    assert fit.exponent < -0.3 and fit.verdict == CONVERGES
    fit = _fit(report, "2l-relu", "linearised_distance", "gd")
    assert fit.exponent < -0.2


def test_report_round_trip_and_files(report, tmp_path):
    folder = report.save(tmp_path / "check")
    for name in ("convergence.json", "convergence.md", "static.png", "spectral.png", "dynamic.png"):
        assert (folder / name).stat().st_size > 0
    assert ConvergenceReport.load(folder) == report
    assert "kernel_error" in report.summary() and "| 2l-relu | static |" in report.to_markdown()


def test_a_rerun_with_fewer_levels_leaves_no_stale_figure(report, tmp_path):
    report.save(tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    static_only = dataclasses.replace(report, fits=[f for f in report.fits if f.level == "static"])
    static_only.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {
        "convergence.json", "convergence.md", "static.png", "notes.txt"
    }
    assert "dynamic.png" not in (tmp_path / "convergence.md").read_text()
    assert ConvergenceReport.load(tmp_path) == static_only


@pytest.fixture(scope="module")
def limit_problem(small_digits):
    """A width-64 2L-ReLU on the small digits, its inputs and its infinite-width limit (ridge 1e-3)."""
    d = small_digits
    model = build_reference_model("2l-relu", d.input_shape, 10, width=64, seed=0).double()
    x_tr = torch.as_tensor(d.x_train, dtype=torch.float64)
    x_te = torch.as_tensor(d.x_test, dtype=torch.float64)
    limit = _Limit(analytic_ntk, model, x_tr, x_te, d.y_train, 1e-3)
    return model, x_tr, x_te, limit


def test_limit_predictor_matches_a_plain_solve(limit_problem):
    model, x_tr, x_te, limit = limit_problem
    eye = torch.eye(len(x_tr), dtype=torch.float64)
    expected = limit.k_test @ torch.linalg.solve(limit.k_train + 1e-3 * eye, limit.targets)
    assert float((limit.krr_test - expected).abs().max() / expected.abs().max()) < 1e-10
    k0, k0_test = empirical_ntk(model, x_tr).double(), empirical_ntk(model, x_te, x_tr).double()
    expected = k0_test @ torch.linalg.solve(k0 + 1e-3 * eye, limit.targets)
    ours = kernel_ridge_predict(k0, k0_test, limit.targets, 1e-3)
    assert float((ours - expected).abs().max() / expected.abs().max()) < 1e-10


def test_linearised_gd_matches_explicit_linear_dynamics(limit_problem):
    model, x_tr, x_te, limit = limit_problem
    with torch.no_grad():
        f_tr, f_te = model(x_tr).double(), model(x_te).double()
    k, k_q = limit.k_train / 10, limit.k_test / 10
    eta, steps = 0.7 / limit.lambda_max_per_output, 25
    expected_test = f_te.clone()
    current = f_tr.clone()
    for _ in range(steps):
        residual = current - limit.targets
        expected_test -= eta * k_q @ residual
        current -= eta * k @ residual
    got = limit.linearised_gd(f_tr, f_te, 0.7, steps)
    torch.testing.assert_close(got, expected_test, rtol=1e-9, atol=1e-9)


def test_wide_network_under_gd_tracks_its_linearisation(small_digits):
    """At width 8192 full-batch GD of the NTK-parametrised net stays close to the linearised dynamics."""
    d = small_digits
    checker = NTKConvergenceChecker(
        models=["2l-relu"], widths=[256, 8192], seeds=[0, 1], protocols=["gd"], gd_steps=40, n_bootstrap=50,
        device="cpu", verbose=False,
    )
    rep = checker.run(d.x_train[:20], d.y_train[:20], d.x_test[:10], d.y_test[:10])
    distance = {w: np.mean([r["linearised_distance"] for r in rep.records if r["protocol"] == "gd"
                            and r["width"] == w]) for w in (256, 8192)}
    assert distance[8192] < 0.1 and distance[8192] < 0.5 * distance[256], distance
    wide = [r for r in rep.records if r["protocol"] == "gd" and r["width"] == 8192]
    assert all(r["kernel_movement"] < 0.05 for r in wide)


def test_checker_leaves_global_rng_and_accepts_factories(small_digits):
    d = small_digits
    state = torch.get_rng_state()
    factory = {"net": lambda width, seed: build_reference_model("2l-relu", (1, 8, 8), 10, width=width, seed=seed)}
    rep = NTKConvergenceChecker(factory, widths=[8, 32], seeds=[0, 1], protocols=[], n_bootstrap=20,
                                device="cpu", verbose=False).run(d.x_train[:10], d.y_train[:10],
                                                                 d.x_test[:5], d.y_test[:5])
    assert torch.equal(state, torch.get_rng_state())
    assert rep.models == ["net"] and {f.level for f in rep.fits} == {"static", "spectral"}
    k = empirical_ntk(factory["net"](32, 0).double(), torch.as_tensor(d.x_train[:10], dtype=torch.float64))
    first = next(r for r in rep.records if r["width"] == 32 and r["seed"] == 0 and r["level"] == "static")
    k_inf = analytic_ntk(factory["net"](32, 0).double(), torch.as_tensor(d.x_train[:10], dtype=torch.float64))
    assert first["kernel_error"] == pytest.approx(float((k - k_inf).norm() / k_inf.norm()), rel=1e-10)


def test_a_diverged_run_is_flagged_and_kept_out_of_the_exponents(small_digits, report):
    d = small_digits
    # a limit kernel ten times too small sizes the gradient-descent step ten times above the stable one
    too_small = lambda model, x1, x2=None: 0.1 * analytic_ntk(model, x1, x2)  # noqa: E731
    rep = NTKConvergenceChecker(models=["mlp-attn"], widths=[16, 64], seeds=[0, 1], protocols=["gd", "adam"],
                                gd_steps=30, adam_epochs=1, analytic=too_small, n_bootstrap=20, device="cpu",
                                verbose=False).run(d.x_train, d.y_train, d.x_test, d.y_test)
    gd = [r for r in rep.records if r["protocol"] == "gd"]
    assert all(r["diverged"] and r["train_loss_end"] > 1e10 for r in gd) and len(rep.diverged_runs()) == 4
    assert all(not r["diverged"] for r in rep.records if r["protocol"] == "adam")
    assert not [f for f in rep.fits if f.protocol == "gd"]  # every GD run diverged: no exponent, no verdict
    assert rep.kept(protocol="gd") == [] and rep.kept(protocol="adam") == [r for r in rep.records
                                                                            if r["protocol"] == "adam"]
    assert [f for f in rep.fits if f.protocol == "adam"]
    assert "mlp-attn gd m=16: seeds [0, 1]" in rep.diverged_note()
    assert "Diverged training runs" in rep.to_markdown() and "Diverged training runs" in rep.summary()
    # at the stable step sized for the limit kernel, the narrowest MLP-Attn's own kernel is too large for it: its GD
    # runs diverge (the real case); every other run's loss fell, and the exponents use those only
    flagged = {(r["model"], r["width"], r["protocol"]) for r in report.records if r.get("diverged")}
    assert flagged == {("mlp-attn", 16, "gd")}
    assert all(r["train_loss_end"] < r["train_loss_start"] for r in report.records
               if r["level"] == "dynamic" and not r["diverged"])
    fit = _fit(report, "mlp-attn", "kernel_movement", "gd")
    assert fit.means[0] is None and fit.means[1] is not None


def test_the_attention_context_reaches_the_named_mlp_attn():
    checker = NTKConvergenceChecker(models=["2l-relu", "mlp-attn"], attention_context="gram", verbose=False)
    factories = checker._factories((1, 8, 8), 10)
    assert factories["mlp-attn"](16, 0).attention.centred is False
    assert not hasattr(factories["2l-relu"](16, 0), "attention")
    assert checker.get_params()["attention_context"] == "gram"
    centred = NTKConvergenceChecker(verbose=False)._factories((1, 8, 8), 10)["mlp-attn"](16, 0)
    assert centred.attention.centred


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"widths": [16]}, "widths"),
        ({"widths": [16, 16]}, "widths"),
        ({"seeds": [0]}, "seeds"),
        ({"protocols": ["sgd"]}, "protocols"),
        ({"ridge": 0.0}, "ridge"),
        ({"gd_lr_scale": 2.5}, "gd_lr_scale"),
        ({"gd_steps": 0}, "gd_steps"),
        ({"dtype": torch.float16}, "dtype"),
        ({"models": ["resnet"]}, "models"),
        ({"attention_context": "trace"}, "attention_context"),
        ({"confidence": 1.0}, "confidence"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NTKConvergenceChecker(**kwargs)


def test_bad_data(small_digits):
    d = small_digits
    checker = NTKConvergenceChecker(widths=[8, 16], seeds=[0, 1], protocols=[], device="cpu", verbose=False)
    bad = d.x_train.copy()
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="x_train"):
        checker.run(bad, d.y_train, d.x_test, d.y_test)
    with pytest.raises(ValueError, match="one label per row"):
        checker.run(d.x_train, d.y_train[:-1], d.x_test, d.y_test)


def test_cli_ntk_check_tiny(tmp_path, capsys):
    code = main(["ntk-check", "--n-train", "20", "--n-test", "10", "--widths", "16", "64", "--seeds", "0", "1",
                 "--gd-steps", "5", "--adam-epochs", "1", "--output", str(tmp_path / "c")])
    assert code == 0
    out = capsys.readouterr().out
    assert "kernel_error" in out and "lambda_min_error" in out and "kernel_movement" in out
    assert (tmp_path / "c" / "convergence.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(small_digits):
    d = small_digits
    args = (d.x_train[:30], d.y_train[:30], d.x_test[:10], d.y_test[:10])
    kwargs = {"widths": [64, 512], "seeds": [0, 1], "protocols": ["gd"], "gd_steps": 10, "n_bootstrap": 20,
              "verbose": False}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    cpu = NTKConvergenceChecker(device="cpu", **kwargs).run(*args)
    gpu = NTKConvergenceChecker(device="cuda", **kwargs).run(*args)
    assert torch.backends.cuda.matmul.allow_tf32 == tf32
    for a, b in zip(cpu.records, gpu.records, strict=True):
        for key in ("kernel_error", "lambda_min_ratio", "kernel_movement", "linearised_distance"):
            if a.get(key) is not None:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_kept_records_leave_out_diverged_runs_and_match_every_key():
    records = [{"model": "a", "protocol": "gd", "diverged": True}, {"model": "a", "protocol": "gd", "diverged": False},
               {"model": "a", "protocol": None}, {"model": "b", "protocol": "gd"}]
    assert kept_records(records, model="a", protocol="gd") == [records[1]]
    assert kept_records(records, model="a", protocol=None) == [records[2]]  # a missing key reads as None
    assert kept_records(records) == records[1:]


def test_the_checkers_settings_go_through_its_rule_table():
    """Each setting is refused through :data:`CHECKER_RULES`, naming it (an ``InvalidParameterError``); a mapping of
    factories passes the models' rule; the widths and seeds become ints; a model without an analytic limit is refused
    before any work (it failed inside the limit kernel before)."""
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.ntk.convergence import CHECKER_RULES

    for name, bad in (("widths", [16, 16.5]), ("seeds", [3]), ("gd_lr_scale", 0), ("adam_batch_size", 0),
                      ("adam_lr", -1e-3), ("adam_weight_decay", float("nan")), ("n_bootstrap", 1.0),
                      ("models", ["mlp-attn-qkv"]), ("device", "tpu9")):
        with pytest.raises(InvalidParameterError) as refused:
            NTKConvergenceChecker(verbose=False, **{name: bad})
        assert refused.value.param == name and name in CHECKER_RULES
    factories = {"a": lambda width, seed: torch.nn.Linear(2, 2)}
    checker = NTKConvergenceChecker(models=factories, widths=(np.int64(8), 16), seeds=(np.int64(0), 1), verbose=False)
    assert checker.widths == [8, 16] and checker.seeds == [0, 1]
    assert all(type(v) is int for v in checker.widths + checker.seeds)
