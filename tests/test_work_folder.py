"""The work folder of finished stages: kept, reused, never trusted when it does not match, and resumed after a kill."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from art_malleability._utils.work_folder import MARKER_NAME, WorkFolder, module_digest, value_digest

KEY = {"model": "abc", "seed": 3, "eps": 0.3}


@pytest.fixture(scope="module")
def digits_classifier():
    from helpers import digits, trained_classifier

    data = digits()
    return trained_classifier("2l-relu", epochs=50), data.x_train, data.y_train


def test_a_stage_is_kept_and_read_back(tmp_path):
    folder = WorkFolder(tmp_path / "work")
    assert folder.load("attack", KEY) is None
    arrays = {"x_adv": np.arange(12.0).reshape(3, 4), "changed": np.array(2)}
    folder.save("attack", KEY, arrays)
    again = WorkFolder(tmp_path / "work").load("attack", dict(reversed(KEY.items())))  # key order does not matter
    assert set(again) == {"x_adv", "changed"}
    assert np.array_equal(again["x_adv"], arrays["x_adv"]) and int(again["changed"]) == 2
    assert [s["stage"] for s in WorkFolder(tmp_path / "work").stages()] == ["attack"]
    assert not list((tmp_path / "work").glob("*.tmp"))


def test_a_stage_of_another_key_is_not_used(tmp_path):
    folder = WorkFolder(tmp_path)
    folder.save("attack", KEY, {"x": np.zeros(3)})
    assert folder.load("attack", {**KEY, "eps": 0.1}) is None
    assert folder.load("control", KEY) is None


@pytest.mark.parametrize("damage", ["truncated", "altered", "record", "foreign record"])
def test_a_damaged_stage_is_detected_said_once_and_computed_again(tmp_path, caplog, damage):
    folder = WorkFolder(tmp_path)
    folder.save("attack", KEY, {"x": np.arange(1000.0)})
    arrays = next(tmp_path.glob("attack-*.npz"))
    record = arrays.with_suffix(".json")
    if damage == "truncated":
        arrays.write_bytes(arrays.read_bytes()[:300])
    elif damage == "altered":
        data = bytearray(arrays.read_bytes())
        data[-200] ^= 0xFF
        arrays.write_bytes(bytes(data))
    elif damage == "record":
        record.write_text("{not json")
    else:
        record.write_text(json.dumps({"format": "something else", "stage": "attack"}))
    with caplog.at_level(logging.WARNING, logger="art_malleability._utils.work_folder"):
        assert folder.load("attack", KEY) is None
        assert folder.load("attack", KEY) is None
    assert len(caplog.records) == 1 and "computed again" in caplog.text
    (values,), reused = folder.cached("attack", KEY, lambda: (np.ones(2),), ("x",))
    assert not reused and np.array_equal(values, np.ones(2))
    assert np.array_equal(folder.load("attack", KEY)["x"], np.ones(2))  # written anew, trusted again


def test_a_folder_the_package_did_not_create_is_refused_and_left_alone(tmp_path):
    (tmp_path / "theirs.txt").write_text("keep me")
    with pytest.raises(ValueError, match="work_dir must be a new or empty folder"):
        WorkFolder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.txt"]
    other = tmp_path / "other"
    other.mkdir()
    (other / MARKER_NAME).write_text("not ours")
    with pytest.raises(ValueError, match="did not write"):
        WorkFolder(other)
    with pytest.raises(ValueError, match="must be a folder"):
        WorkFolder(tmp_path / "theirs.txt")
    with pytest.raises(ValueError, match="stage must be"):
        WorkFolder(tmp_path / "new").save("../escape", KEY, {})


def test_digests_tell_apart_what_a_stage_depends_on():
    a = np.arange(6, dtype=np.float32)
    assert value_digest(a) != value_digest(a.astype(np.float64))
    assert value_digest(a) != value_digest(a.reshape(2, 3))
    assert value_digest({"a": 1}) != value_digest({"a": 1.5}) and value_digest([1, 2]) != value_digest([2, 1])
    assert value_digest(torch.from_numpy(a)) == value_digest(a)
    with pytest.raises(TypeError, match="value must be"):
        value_digest(object())
    model = torch.nn.Linear(3, 2)
    before = module_digest(model)
    with torch.no_grad():
        model.weight[0, 0] += 1e-6
    assert module_digest(model) != before


def test_the_estimator_reuses_finished_attacks_and_passes_and_reports_the_same(tmp_path, monkeypatch,
                                                                               digits_classifier):
    from art_malleability.audit import _run
    from art_malleability.audit.estimator import MalleabilityEstimator
    from art_malleability.influence import NTKInfluence

    clf, x, y = digits_classifier
    calls, refits = [], []
    real, refit = _run.perturb_training_set, NTKInfluence.refit
    monkeypatch.setattr(_run, "perturb_training_set", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(NTKInfluence, "refit", lambda *a, **k: refits.append(1) or refit(*a, **k))
    params = {"attacks": ("fgsm", "pgd"), "attack_max_iter": 3, "n_bootstrap": 50, "verbose": False,
              "control_draws": 2, "n_queries": 15, "device": "cpu", "work_dir": tmp_path / "work"}
    first = MalleabilityEstimator(clf, **params).evaluate(x, y)
    assert len(calls) == 2 and len(refits) == 4  # two attacks, two control draws
    second = MalleabilityEstimator(clf, **params).evaluate(x, y)
    assert len(calls) == 2 and len(refits) == 4  # nothing attacked or refitted again
    folder = second.execution["work_folder"]
    assert folder["reused"] == {"passes": 4} and folder["to_compute"] == []
    assert folder["finished_before"] == ["control eps=0.3 draw 1", "control eps=0.3 draw 2", "fgsm", "pgd"]
    assert not any("work folder" in w for w in second.warnings)
    assert [r.examples for r in second.results] == [r.examples for r in first.results]  # kept beside the passes
    assert all(r.examples for r in first.results)
    for stage in (tmp_path / "work").glob("pass-*.npz"):  # altered on disk: detected, recomputed, said in the report
        data = bytearray(stage.read_bytes())
        data[len(data) // 2] ^= 0xFF
        stage.write_bytes(bytes(data))
    third = MalleabilityEstimator(clf, **params).evaluate(x, y)
    # every pass refitted; the attacks' inputs are still the kept ones
    assert len(refits) == 8 and len(calls) == 2
    assert third.execution["work_folder"]["reused"] == {"attack chunks": 2}
    said = [w for w in third.warnings if "work folder" in w]
    assert len(said) == 1 and "'pass' stage" in said[0] and "truncated or altered" in said[0], third.warnings
    for stage in (tmp_path / "work").glob("attack-*.npz"):
        stage.write_bytes(stage.read_bytes()[:-10])
    WorkFolder(tmp_path / "work").remove(["pass"])
    fourth = MalleabilityEstimator(clf, **params).evaluate(x, y)
    assert len(calls) == 4 and len(refits) == 12 and fourth.execution["work_folder"]["reused"] == {"attack chunks": 0}
    said = [w for w in fourth.warnings if "work folder" in w]
    assert len(said) == 1 and "'attack' stage" in said[0], fourth.warnings
    plain = MalleabilityEstimator(clf, **{**params, "work_dir": None}).evaluate(x, y)

    def numbers(report):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in report.to_dict()["results"]]

    assert numbers(first) == numbers(second) == numbers(third) == numbers(fourth) == numbers(plain)


def test_a_pass_of_other_parameters_is_not_reused(tmp_path, digits_classifier):
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, x, y = digits_classifier
    params = {"attacks": ("fgsm",), "n_bootstrap": 50, "verbose": False, "control_draws": 1, "n_queries": 15,
              "device": "cpu", "work_dir": tmp_path / "work"}
    MalleabilityEstimator(clf, **params).evaluate(x, y)
    for change in ({"confidence": 0.9}, {"ridge": 1e-2}, {"top_fraction": 0.2}, {"n_queries": 16}, {"seed": 1}):
        again = MalleabilityEstimator(clf, **{**params, **change}).evaluate(x, y)
        assert again.execution["work_folder"]["reused"].get("passes", 0) == 0, change
    # the attack's own parameters do not change the control's pass, only the attack's
    again = MalleabilityEstimator(clf, **{**params, "eps": 0.2}).evaluate(x, y)
    assert again.execution["work_folder"]["reused"].get("passes", 0) == 0  # another budget: another control too
    again = MalleabilityEstimator(clf, **{**params, "attacks": ("fgsm", "pgd"), "attack_max_iter": 3}).evaluate(x, y)
    assert again.execution["work_folder"]["reused"]["passes"] == 2  # the control and FGSM


def test_work_dir_is_checked_and_a_refusal_changes_nothing(digits_classifier):
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, _, _ = digits_classifier
    est = MalleabilityEstimator(clf, verbose=False)
    with pytest.raises(InvalidParameterError, match="work_dir must be a folder path"):
        est.set_params(work_dir=3, seed=5)
    assert est.work_dir is None and est.seed == 0


def _report_numbers(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {"results": [{k: v for k, v in r.items() if k != "seconds"} for r in data["results"]],
            "top": data.get("top_indices"), "accuracy": data.get("clean_accuracy")}


COMMAND = [sys.executable, "-m", "art_malleability.cli", "audit", "--n-train", "300", "--n-test", "80", "--model",
           "2l-relu", "--epochs", "3", "--attack-max-iter", "5", "--n-bootstrap", "50", "--control-draws", "2",
           "--quiet"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The report of the command run once without a work folder."""
    where = tmp_path_factory.mktemp("whole")
    env = {**os.environ, "HOME": str(where), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*COMMAND, "--output", "whole", "--no-work-dir"], cwd=where, env=env, timeout=600,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return _report_numbers(where / "whole" / "2l-relu" / "report.json")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_audit_resumes_to_the_same_report(tmp_path, uninterrupted, sig):
    # the command is killed as soon as its first attack's perturbed inputs are kept (SIGKILL: nothing of Python runs;
    # SIGTERM: it exits with 143 through its cleanup); the same command rerun reuses the weights and that attack,
    # computes the rest, and its report equals an uninterrupted run's
    env = {**os.environ, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    work = tmp_path / "killed.work" / "2l-relu"
    proc = subprocess.Popen([*COMMAND, "--output", "killed"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not list(work.glob("attack-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143), "not killed while it ran"
    assert not (tmp_path / "killed" / "2l-relu" / "report.json").exists()
    kept = {s["stage"] for s in WorkFolder(work).stages()}
    assert kept == {"weights", "pass", "attack"}  # the controls' passes ran before the attacks
    resumed = subprocess.run([*COMMAND, "--output", "killed"], cwd=tmp_path, env=env, timeout=600,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((tmp_path / "killed" / "2l-relu" / "report.json").read_text())
    reused = report["execution"]["work_folder"]["reused"]
    # the control's draws at least, and the first attack's inputs or its whole pass
    assert reused["passes"] >= 2 and (reused.get("attack chunks", 0) >= 1 or reused["passes"] >= 3), reused
    assert _report_numbers(tmp_path / "killed" / "2l-relu" / "report.json") == uninterrupted


def test_an_audit_that_failed_in_one_attack_reuses_the_finished_ones(tmp_path, monkeypatch, digits_classifier):
    from art.attacks.evasion import FastGradientMethod

    from art_malleability.audit import _run
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, x, y = digits_classifier

    class Failing(FastGradientMethod):
        def generate(self, x, y=None, **kwargs):
            raise RuntimeError("out of memory, say")

    params = {"attack_max_iter": 3, "n_bootstrap": 50, "verbose": False, "control_draws": 2, "n_queries": 15,
              "device": "cpu", "work_dir": tmp_path / "work"}
    with pytest.raises(RuntimeError, match="out of memory"):
        MalleabilityEstimator(clf, attacks=("fgsm", Failing(clf, eps=0.3)), **params).evaluate(x, y)
    calls = []
    real = _run.perturb_training_set
    monkeypatch.setattr(_run, "perturb_training_set", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    again = MalleabilityEstimator(clf, attacks=("fgsm", "pgd"), **params).evaluate(x, y)
    assert [type(a).__name__ for a in calls] == ["ProjectedGradientDescent"]  # FGSM's pass was kept
    assert again.execution["work_folder"]["reused"] == {"passes": 3, "attack chunks": 0}  # FGSM and the controls


def test_the_command_refuses_a_work_dir_it_did_not_create_before_reading_data(tmp_path, capsys, monkeypatch):
    import art_malleability.cli.audit as cli_audit
    from art_malleability.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the data was read before the work folder was checked")

    monkeypatch.setattr(cli_audit, "load_data", never)
    theirs = tmp_path / "theirs"
    (theirs / "2l-relu").mkdir(parents=True)
    (theirs / "2l-relu" / "notes.txt").write_text("keep me")
    code = main(["audit", "--output", str(tmp_path / "out"), "--model", "2l-relu", "--work-dir", str(theirs)])
    err = capsys.readouterr().err
    assert code == 2 and "error: --work-dir must be a new or empty folder" in err, err
    assert [p.name for p in (theirs / "2l-relu").iterdir()] == ["notes.txt"]


def test_the_default_work_folder_is_beside_the_output_folder(tmp_path, monkeypatch):
    from art_malleability.cli import build_parser
    from art_malleability.cli.audit import work_dir

    monkeypatch.chdir(tmp_path)
    parse = build_parser().parse_args
    assert work_dir(parse(["audit", "--output", "out"]), "2l-relu") == tmp_path / "out.work" / "2l-relu"
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert work_dir(parse(["audit", "--output", "."]), "cnn") == tmp_path / "here.work" / "cnn"
    assert work_dir(parse(["audit", "--work-dir", "w"]), "cnn") == Path("w") / "cnn"
    assert work_dir(parse(["audit", "--no-work-dir"]), "cnn") is None


def test_prune_removes_the_oldest_stages_it_can_prove_it_wrote(tmp_path):
    folder = WorkFolder(tmp_path)
    for i in range(4):
        folder.save("attack", {"i": i}, {"x": np.zeros(1000) + i})
        time.sleep(0.01)
    files = [r["file"] for r in folder.stages()]  # oldest first
    size = folder.stages()[0]["bytes"]
    (tmp_path / files[0]).write_bytes(b"changed by someone")  # not provably ours any more: left alone
    removed = folder.prune(2.5 * size)
    assert removed == files[1:3] and (tmp_path / files[0]).exists()
    assert [folder.load("attack", {"i": i}) is None for i in (1, 2, 3)] == [True, True, False]
    assert folder.prune(1e12) == []


def test_the_work_folders_size_cap_is_checked_before_any_work(tmp_path, capsys):
    from art_malleability.cli import main

    code = main(["audit", "--output", str(tmp_path / "out"), "--work-dir-max-gb", "0"])
    assert code == 2 and "--work-dir-max-gb must" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


def test_an_attack_on_another_model_is_not_taken_for_one_on_the_audited_model(tmp_path, monkeypatch,
                                                                               digits_classifier):
    from art.attacks.evasion import FastGradientMethod
    from helpers import trained_classifier

    from art_malleability.audit import _run
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, x, y = digits_classifier
    surrogate = trained_classifier("2l-relu", epochs=5)
    calls = []
    real = _run.perturb_training_set
    monkeypatch.setattr(_run, "perturb_training_set", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = {"n_bootstrap": 50, "verbose": False, "control_draws": 2, "n_queries": 15, "device": "cpu",
              "controls": False, "work_dir": tmp_path / "work"}
    MalleabilityEstimator(clf, attacks=(FastGradientMethod(clf, eps=0.3),), **params).evaluate(x, y)
    MalleabilityEstimator(clf, attacks=(FastGradientMethod(surrogate, eps=0.3),), **params).evaluate(x, y)
    assert len(calls) == 2  # a transfer attack from the surrogate is computed, not read from the direct one's stage
    MalleabilityEstimator(clf, attacks=(FastGradientMethod(surrogate, eps=0.3),), **params).evaluate(x, y)
    assert len(calls) == 2


def test_the_work_command_lists_and_removes_only_what_the_package_wrote(tmp_path, capsys):
    from art_malleability.cli import main

    parent = tmp_path / "out.work"
    one, two = WorkFolder(parent / "2l-relu"), WorkFolder(parent / "mlp-attn")
    for i in range(3):
        one.save("attack", {**KEY, "seed": i}, {"x_adv": np.zeros(100)})
    one.save("pass", KEY, {"aggregates": np.ones(50)})
    one.save("examples", KEY, {"index": np.arange(3)})
    two.save("weights", KEY, {"w": np.ones(10)})
    (parent / "mine.txt").write_text("not the package's")
    assert main(["work", str(parent)]) == 0
    out = capsys.readouterr().out
    assert "6 stage(s)" in out and "in 2 work folder(s)" in out
    assert [line.split()[1:3] for line in out.splitlines()[2:6]] == [
        ["attack", "3"], ["pass", "1"], ["examples", "1"], ["weights", "1"]]
    altered = next((parent / "2l-relu").glob("attack-*.npz"))
    altered.write_bytes(altered.read_bytes() + b"x")
    assert main(["work", str(parent / "2l-relu"), "--remove", "--stage", "attack"]) == 0
    assert "removed 2 stage(s); 1 left" in capsys.readouterr().out
    assert [s["stage"] for s in WorkFolder(parent / "2l-relu").stages()] == ["attack", "pass", "examples"]
    assert altered.exists()
    assert main(["work", str(parent), "--remove"]) == 0
    assert not (parent / "mlp-attn").exists()  # nothing else was in it: gone with its marker
    assert sorted(p.name for p in (parent / "2l-relu").iterdir()) == sorted(
        [MARKER_NAME, altered.name, altered.with_suffix(".json").name])
    assert (parent / "mine.txt").read_text() == "not the package's"


def test_the_work_command_refuses_a_folder_that_is_not_a_work_folder_and_creates_nothing(tmp_path, capsys):
    from art_malleability.cli import main

    assert main(["work", str(tmp_path / "missing")]) == 2
    assert "FOLDER must be a work folder this package created" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    (tmp_path / "plain").mkdir()
    assert main(["work", str(tmp_path / "plain"), "--remove"]) == 2
    assert list((tmp_path / "plain").iterdir()) == []


def test_a_rerun_without_the_kept_examples_says_they_are_not_known(tmp_path, digits_classifier):
    from art_malleability.audit.estimator import MalleabilityEstimator

    clf, x, y = digits_classifier
    params = {"attacks": ("fgsm",), "n_bootstrap": 50, "verbose": False, "control_draws": 1, "n_queries": 15,
              "device": "cpu", "work_dir": tmp_path / "work"}
    first = MalleabilityEstimator(clf, **params).evaluate(x, y)
    assert first.results[0].examples
    WorkFolder(tmp_path / "work").remove(["examples"])
    again = MalleabilityEstimator(clf, **params).evaluate(x, y)
    assert again.execution["work_folder"]["reused"] == {"passes": 2} and again.results[0].examples is None
    assert "Not known: this run reused the attack's finished pass without its examples." in again.to_html()
