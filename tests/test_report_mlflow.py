"""The report logged to a real MLflow tracking store (sqlite, in a temporary folder) and read back with its client."""

from __future__ import annotations

import json
import math

import pytest

mlflow = pytest.importorskip("mlflow", reason="the [mlflow] extra is not installed")  # the [test] extra installs it

SMALL = ["--n-train", "200", "--n-test", "60", "--model", "2l-relu", "--epochs", "3", "--attacks", "fgsm", "pgd",
         "--attack-max-iter", "3", "--n-bootstrap", "50", "--control-draws", "2", "--no-work-dir", "--quiet"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A tracking store of this test's own, and an experiment whose artifacts stay in the temporary folder."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("audit", artifact_location=(tmp_path / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", experiment)
    mlflow.set_experiment(experiment_id=experiment)
    yield mlflow.MlflowClient(uri)
    while mlflow.active_run() is not None:
        mlflow.end_run()


@pytest.fixture(scope="module")
def report():
    from helpers import digits, trained_classifier

    from art_malleability.audit.estimator import MalleabilityEstimator

    data = digits()
    clf = trained_classifier("2l-relu", epochs=50)
    return MalleabilityEstimator(clf, attacks=("fgsm", "pgd"), attack_max_iter=3, n_bootstrap=50, control_draws=2,
                                 n_queries=40, verbose=False, device="cpu").evaluate(data.x_train, data.y_train)


def test_a_report_is_logged_to_a_new_run_and_read_back(store, report, tmp_path):
    from art_malleability.audit.report_mlflow import report_metrics

    run_id = report.log_to_mlflow()
    assert mlflow.active_run() is None  # the run it started has ended
    run = store.get_run(run_id)
    assert run.info.status == "FINISHED"
    data = report.to_dict()
    expected = report_metrics(data)
    assert run.data.metrics == pytest.approx(expected, rel=0, abs=0)
    for i, result in enumerate(report.results):
        assert run.data.metrics[f"{result.attack}.flip_rate"] == result.flip_rate
        low, high = result.flip_rate_ci
        assert (run.data.metrics[f"{result.attack}.flip_rate.low"], run.data.metrics[f"{result.attack}.flip_rate.high"]
                ) == (low, high)
        for name, value in data["results"][i].items():
            if name in ("flip_rate_above_floor", "signed_retention") and value is None:
                assert f"{result.attack}.{name}" not in run.data.metrics  # null in the JSON: not logged
    assert run.data.params["n_train"] == str(report.n_train) and run.data.params["model"] == report.model
    assert run.data.params["attacks"] == json.dumps(["fgsm", "pgd"])
    folder = f"malleability/{report.model}"
    logged = {a.path.rsplit("/", 1)[1] for a in store.list_artifacts(run_id, folder)}
    assert {"report.json", "report.md", "report.html", "flip_rates.png", "scatter_fgsm.png", "summary.json"} <= logged
    local = store.download_artifacts(run_id, f"{folder}/report.json", str(tmp_path))
    with open(local) as handle:
        assert json.load(handle) == json.loads(json.dumps(data))
    summary = json.loads(open(store.download_artifacts(run_id, f"{folder}/summary.json", str(tmp_path))).read())
    assert [row[0] for row in summary["data"]] == ["fgsm", "pgd"] and summary["columns"][1] == "flip_rate"


def test_a_report_is_logged_to_the_active_run_and_to_a_given_one(store, report):
    with mlflow.start_run() as active:
        assert report.log_to_mlflow() == active.info.run_id
    assert store.get_run(active.info.run_id).data.metrics["fgsm.flip_rate"] == report.results[0].flip_rate
    other = store.create_run(active.info.experiment_id)
    assert report.log_to_mlflow(other.info.run_id) == other.info.run_id
    assert store.get_run(other.info.run_id).data.metrics["pgd.flip_rate"] == report.results[1].flip_rate


def test_metric_names_are_ones_mlflow_takes_and_nothing_non_finite_is_logged():
    from art_malleability.audit.report_mlflow import metric_name, report_metrics

    assert metric_name("Failing(eps=0.3)") == "Failing_eps_0.3_"
    data = {"results": [{"attack": "fgsm eps=0.1", "flip_rate": 0.2, "flip_rate_ci": [0.1, None], "spearman": math.nan,
                         "control": None}]}
    assert report_metrics(data, "m.") == {"m.fgsm eps_0.1.flip_rate": 0.2, "m.fgsm eps_0.1.flip_rate.low": 0.1}


def test_the_command_logs_every_models_report_to_one_run(store, tmp_path):
    import os

    from art_malleability.cli import main

    assert main(["audit", *SMALL, "--output", str(tmp_path / "out"), "--mlflow"]) == 0
    (run,) = store.search_runs([os.environ["MLFLOW_EXPERIMENT_ID"]])
    assert run.info.run_name == "art-malleability audit" and run.info.status == "FINISHED"
    report = json.loads((tmp_path / "out" / "2l-relu" / "report.json").read_text())
    assert run.data.metrics["2l-relu.fgsm.flip_rate"] == report["results"][0]["flip_rate"]
    assert run.data.params["2l-relu.eps"] == "0.3"
    assert (tmp_path / "out" / "2l-relu" / "report.html").exists()


def test_the_command_refuses_mlflow_without_mlflow_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    from art_malleability.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert main(["audit", *SMALL, "--output", str(tmp_path / "out"), "--mlflow"]) == 2
    assert "--mlflow needs MLflow, which is not installed" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
