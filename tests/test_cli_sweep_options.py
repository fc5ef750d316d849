"""The command line's option checks (issue 35, the sweep's other cases): every option it cannot use is refused
before any data is read, in the option's own words; the report states the audited model's settings; a report that
a run replaces is named."""

import json
import logging

import pytest

import art_malleability.cli as cli
from art_malleability.cli import main

COMMANDS = ("audit", "validate", "ntk-check", "spectrum", "reproduce")
RUNNERS = {"audit": "run_audit", "validate": "run_validate", "ntk-check": "run_ntk_check",
           "spectrum": "run_spectrum", "reproduce": "run_reproduce"}


@pytest.fixture
def no_work(monkeypatch):
    """Every subcommand's run and data loader fail the test when called: a refusal must come before them."""
    import art_malleability.cli.audit as cli_audit
    import art_malleability.cli.studies as cli_studies
    import art_malleability.cli.validate as cli_validate

    def never(*args, **kwargs):
        raise AssertionError("the command ran (and read its data) before its options were checked")

    for name in RUNNERS.values():
        monkeypatch.setattr(cli, name, never)
    for module in (cli_audit, cli_studies, cli_validate):
        monkeypatch.setattr(module, "load_data", never)


@pytest.fixture
def ran(monkeypatch):
    """Every subcommand's run replaced by one that records its arguments and succeeds, reading no data."""
    calls = []

    def record(args):
        calls.append(args)
        return 0

    for name in RUNNERS.values():
        monkeypatch.setattr(cli, name, record)
    return calls


def _refused(tmp_path, capsys, command, args):
    code = main([command, *args, "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    return err


# ------------------------------------------------------------------------------ 1. options that have no effect


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("audit", ["--no-controls", "--control-draws", "3"], "--control-draws has no effect with --no-controls"),
        ("audit", ["--control-draws", "3", "--no-controls"], "--control-draws has no effect with --no-controls"),
        ("audit", ["--influence", "gradient", "--ridge", "loo"], "--ridge has no effect with --influence gradient"),
        ("audit", ["--influence", "captum", "--ridge", "1e-3"], "--ridge has no effect with --influence captum"),
        ("audit", ["--influence", "gradient", "--projection-dim", "64"],
         "--projection-dim has no effect with --influence gradient"),
        ("audit", ["--attacks", "fgsm", "--attack-max-iter", "5"],
         "--attack-max-iter has no effect with --attacks fgsm"),
        ("validate", ["--estimators", "gradient", "captum", "--ridge", "gcv"],
         "--ridge has no effect with --estimators gradient captum"),
        ("validate", ["--estimators", "gradient", "--projection-dim", "none"],
         "--projection-dim has no effect with --estimators gradient"),
    ],
)
def test_an_option_that_would_have_no_effect_is_refused(tmp_path, capsys, no_work, command, args, message):
    err = _refused(tmp_path, capsys, command, args)
    assert err.startswith(f"art-malleability {command}: error: {message}"), err


@pytest.mark.parametrize(
    ("command", "args"),
    [
        ("audit", ["--no-controls"]),  # the default --control-draws is not the user's
        ("audit", ["--influence", "gradient"]),
        ("audit", ["--attacks", "fgsm"]),
        ("audit", ["--attacks", "fgsm", "pgd", "--attack-max-iter", "5"]),
        ("audit", ["--ridge", "loo", "--control-draws", "3", "--projection-dim", "none"]),
        ("validate", ["--estimators", "gradient"]),
        ("validate", ["--estimators", "gradient", "ntk", "--ridge", "1e-2"]),
    ],
)
def test_options_that_take_effect_are_accepted(tmp_path, ran, command, args):
    assert main([command, *args, "--output", str(tmp_path / "out")]) == 0
    assert len(ran) == 1


# ------------------------------------------------------------------------------ 2. the model's settings in the report


def test_the_report_states_the_settings_of_the_audited_model(tmp_path):
    out = tmp_path / "audit"
    args = ["audit", "--model", "mlp-attn", "--attention-context", "gram", "--width", "16", "--epochs", "2",
            "--lr", "0.02", "--weight-decay", "0.001", "--loss", "mse", "--batch-size", "64", "--n-train", "60",
            "--n-test", "20", "--n-queries", "5", "--n-bootstrap", "10", "--attacks", "fgsm", "--no-controls",
            "--quiet", "--output", str(out)]
    assert main(args) == 0
    report = json.loads((out / "mlp-attn" / "report.json").read_text())
    model = report["config"]["model"]
    assert model == {"name": "mlp-attn", "width": 16, "attention_context": "gram", "weights": None,
                     "epochs": 2, "lr": 0.02, "weight_decay": 0.001, "loss": "mse", "batch_size": 64}
    page = (out / "mlp-attn" / "report.html").read_text()  # the settings are on the page
    assert "&#34;attention_context&#34;: &#34;gram&#34;" in page and "&#34;epochs&#34;: 2" in page


def test_the_report_of_loaded_weights_states_the_file_and_no_training(tmp_path):
    import torch

    from art_malleability.models import build_reference_model

    weights = tmp_path / "w.pt"
    torch.save(build_reference_model("2l-relu", (1, 8, 8), 10, width=16, seed=0).state_dict(), weights)
    out = tmp_path / "audit"
    assert main(["audit", "--model", "2l-relu", "--width", "16", "--weights", str(weights), "--n-train", "60",
                 "--n-test", "20", "--n-queries", "5", "--n-bootstrap", "10", "--attacks", "fgsm", "--no-controls",
                 "--quiet", "--output", str(out)]) == 0
    model = json.loads((out / "2l-relu" / "report.json").read_text())["config"]["model"]
    assert model == {"name": "2l-relu", "width": 16, "weights": str(weights), "loss": "cross_entropy"}


# ------------------------------------------------------------------------------ 3. options that clash


@pytest.mark.parametrize("command", ["audit", "validate"])
@pytest.mark.parametrize("rule", ["loo", "gcv"])
def test_a_ridge_rule_with_a_projection_below_the_training_set_is_refused_before_training(tmp_path, capsys, no_work,
                                                                                          command, rule):
    err = _refused(tmp_path, capsys, command, ["--ridge", rule, "--projection-dim", "64", "--n-train", "200"])
    assert err.startswith(f"art-malleability {command}: error: --ridge {rule} ")
    assert "--projection-dim 64" in err and "--n-train 200" in err
    assert "projection_dim" not in err and "None" not in err


def test_a_ridge_rule_with_a_projection_that_holds_the_training_set_is_accepted(tmp_path, ran):
    assert main(["audit", "--ridge", "loo", "--projection-dim", "64", "--n-train", "64",
                 "--output", str(tmp_path / "out")]) == 0
    assert main(["validate", "--ridge", "loo", "--projection-dim", "none", "64", "--n-train", "60",
                 "--output", str(tmp_path / "out")]) == 0


def test_the_library_refuses_that_ridge_rule_only_after_training(tmp_path):
    """The clash the CLI now refuses up front is the library's own refusal, which comes after training."""
    import numpy as np

    from art_malleability.influence import get_influence
    from art_malleability.models import build_reference_model

    model = build_reference_model("2l-relu", (1, 8, 8), 10, width=16, seed=0)
    x = np.random.default_rng(0).random((80, 1, 8, 8), dtype=np.float32)
    y = np.arange(80) % 10
    with pytest.raises(ValueError, match="ridge must be a number for the projected mode"):
        get_influence("ntk", ridge="loo", projection_dim=64, device="cpu").fit(model, x, y)


# ------------------------------------------------------------------------------ 4. numbers and choices, up front


@pytest.mark.parametrize(
    ("command", "args", "option", "internal"),
    [
        ("ntk-check", ["--seeds", "0"], "--seeds", None),
        ("ntk-check", ["--seeds", "0", "0"], "--seeds", None),
        ("ntk-check", ["--widths", "16"], "--widths", None),
        ("ntk-check", ["--widths", "16", "0"], "--widths", None),
        ("ntk-check", ["--ridge", "-1"], "--ridge", None),
        ("ntk-check", ["--ridge", "nan"], "--ridge", None),
        ("ntk-check", ["--gd-steps", "0"], "--gd-steps", "gd_steps"),
        ("ntk-check", ["--gd-lr-scale", "2"], "--gd-lr-scale", "gd_lr_scale"),
        ("ntk-check", ["--adam-epochs", "0"], "--adam-epochs", "adam_epochs"),
        ("ntk-check", ["--models", "foo"], "--models", None),
        ("ntk-check", ["--models", "mlp-attn-qkv"], "--models", None),
        ("ntk-check", ["--n-train", "0"], "--n-train", "n_train"),
        ("reproduce", ["--widths", "0"], "--widths", None),
        ("reproduce", ["--tables", "table1", "--widths", "16"], "--widths", None),
        ("reproduce", ["--tables", "landscape", "--models", "foo"], "--models", None),
        ("reproduce", ["--seeds", "1", "1"], "--seeds", None),
        ("reproduce", ["--epochs", "0"], "--epochs", None),
        ("reproduce", ["--lds-models", "1"], "--lds-models", "lds_models"),
        ("reproduce", ["--ntk-adam-epochs", "0"], "--ntk-adam-epochs", "ntk_adam_epochs"),
        ("validate", ["--loo-top", "-3"], "--loo-top", "loo_top"),
        ("validate", ["--loo-queries", "-1"], "--loo-queries", "loo_queries"),
        ("validate", ["--loo-seeds", "0"], "--loo-seeds", "loo_seeds"),
        ("validate", ["--n-bootstrap", "0"], "--n-bootstrap", "n_bootstrap"),
        ("validate", ["--weight-decay", "-1"], "--weight-decay", "weight_decay"),
        ("validate", ["--n-test", "0"], "--n-test", "n_test"),
        ("audit", ["--epochs", "0"], "--epochs", None),
        ("audit", ["--lr", "0"], "--lr", None),
        ("audit", ["--width", "0"], "--width", None),
        ("spectrum", ["--n-train", "0"], "--n-train", "n_train"),
        ("ntk-check", ["--device", "tpu9"], "--device", None),
        ("validate", ["--device", "tpu9"], "--device", None),
    ],
)
def test_a_number_or_choice_out_of_range_is_refused_before_any_data_is_read(tmp_path, capsys, no_work, command,
                                                                             args, option, internal):
    err = _refused(tmp_path, capsys, command, args)
    assert err.startswith(f"art-malleability {command}: error: {option} must "), err
    if internal is not None:
        assert internal not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_the_defaults_pass_the_checks(tmp_path, ran, command):
    assert main([command, "--output", str(tmp_path / "out")]) == 0
    assert len(ran) == 1


# ------------------------------------------------------------------------------ 5. reproduce's models


def test_the_reproduction_config_refuses_unknown_models():
    from art_malleability.paper.reproduce import ReproductionConfig

    with pytest.raises(ValueError, match=r"^models must name reference models .*got 'foo'"):
        ReproductionConfig(models=("2l-relu", "foo"), tables=("landscape",))
    with pytest.raises(ValueError, match=r"^models must name at least one"):
        ReproductionConfig(models=())
    assert ReproductionConfig(models=("mlp-attn",)).models == ("mlp-attn",)


# ------------------------------------------------------------------------------ 6. a report that a run replaces


def test_auditing_another_model_names_the_report_it_replaces(tmp_path, caplog):
    out = tmp_path / "audit"
    tiny = ["audit", "--width", "16", "--epochs", "2", "--n-train", "60", "--n-test", "20", "--n-queries", "5",
            "--n-bootstrap", "10", "--attacks", "fgsm", "--no-controls", "--output", str(out)]
    with caplog.at_level(logging.WARNING, logger="art_malleability"):
        assert main([*tiny, "--quiet", "--model", "2l-relu"]) == 0
        assert not [r for r in caplog.records if "replace" in r.getMessage()]
        caplog.clear()
        assert main([*tiny, "--model", "mlp-attn"]) == 0
    notes = [r.getMessage() for r in caplog.records if "replace" in r.getMessage()]
    assert len(notes) == 1 and len(notes[0].splitlines()) == 1, notes
    assert "2l-relu" in notes[0] and str(out) in notes[0]
    assert not (out / "2l-relu").exists() and (out / "mlp-attn" / "report.json").is_file()
