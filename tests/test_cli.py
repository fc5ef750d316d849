"""The art-malleability command line, on tiny settings."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from art_malleability.cli import main
from art_malleability.models import build_reference_model

TINY = [
    "--n-train", "100", "--n-test", "30", "--epochs", "3", "--width", "32", "--n-queries", "10",
    "--n-bootstrap", "20", "--quiet",
]
LOUD = [a for a in TINY if a != "--quiet"]


def test_audit_both_reference_models(tmp_path, capsys):
    out = tmp_path / "audit"
    assert main(["audit", *LOUD, "--attacks", "fgsm", "mim", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2l-relu" in printed and "mlp-attn" in printed and "flip rate" in printed
    for model in ("2l-relu", "mlp-attn"):
        data = json.loads((out / model / "report.json").read_text())
        assert [r["attack"] for r in data["results"]] == ["fgsm", "mim"]
        assert data["dataset"] == "digits" and "train" in data["seconds"]
        assert (out / model / "flip_rates.png").exists() and (out / model / "report.md").exists()
    assert "| mlp-attn |" in (out / "summary.md").read_text()


def test_audit_custom_factory_with_weights(tmp_path, capsys):
    model = build_reference_model("2l-relu", (1, 8, 8), 10, width=16, seed=3)
    weights = tmp_path / "w.pt"
    torch.save(model.state_dict(), weights)
    code = main(
        ["audit", *TINY, "--attacks", "fgsm", "--output", str(tmp_path / "o"), "--weights", str(weights),
         "--model", "cli_factory:make"]
    )
    assert code == 0
    assert (tmp_path / "o" / "cli_factory_make" / "report.json").exists()


def test_audit_npz_dataset(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(120, 6, 6), dtype=np.uint8)
    y = (x.reshape(120, -1).mean(axis=1) > 127).astype(np.int64)
    np.savez(tmp_path / "toy.npz", x=x, y=y)
    args = ["audit", *TINY, "--n-train", "80", "--n-test", "20", "--attacks", "fgsm", "--model", "2l-relu"]
    assert main([*args, "--dataset", str(tmp_path / "toy.npz"), "--output", str(tmp_path / "o")]) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "/nonexistent/data.npz"], "does not exist"),
        (["--dataset", "imagenet"], "dataset"),
        (["--model", "resnet"], "--model"),
        (["--model", "no_such_module:f"], "cannot import"),
        (["--eps", "0"], "eps"),
        (["--top-fraction", "2"], "top_fraction"),
        # the estimator's own parameter check, before any training
        (["--eps", "inf"], "--eps must lie in (0, 1)"),
        (["--eps", "5"], "--eps must lie in (0, 1): an l-inf budget on inputs scaled to [0, 1]"),
        (["--n-bootstrap", "1"], "--n-bootstrap (n_bootstrap) must be an integer of at least 10"),
        (["--projection-dim", "3000000000"], "--projection-dim (projection_dim) must be a positive integer below"),
    ],
)
def test_audit_bad_input_exits_2(tmp_path, capsys, args, message):
    assert main(["audit", *TINY, "--output", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_wrong_npz_arrays_are_a_data_error(tmp_path, capsys):
    np.savez(tmp_path / "bad.npz", images=np.zeros((4, 2, 2)))
    assert main(["audit", *TINY, "--dataset", str(tmp_path / "bad.npz"), "--output", str(tmp_path)]) == 2  # unusable: 2
    err = capsys.readouterr().err
    assert "x" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--output", "FILE"], "is an existing file"),
        (["--seed", "-1"], "--seed must be a non-negative integer"),
        (["--n-train", "5", "--top-fraction", "0.1"], "pass --n-train of at least 10"),
        (["--dataset", "FOLDER"], "is a folder"),
        (["--model", "cli_instance_module:net"], "must name a function or class that builds"),
    ],
)
def test_options_are_checked_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    (tmp_path / "file").write_text("")
    (tmp_path / "cli_instance_module.py").write_text("import torch\nnet = torch.nn.Linear(64, 10)\n")
    monkeypatch.chdir(tmp_path)  # a module in the working folder imports, as with python -m
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    args = [str(tmp_path / "file") if a == "FILE" else str(tmp_path) if a == "FOLDER" else a for a in args]
    args = ["--output", str(tmp_path / "out"), *args] if "--output" not in args else args
    assert main(["audit", *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_bad_ridge_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["audit", *TINY, "--output", str(tmp_path / "out"), "--ridge", "0"])
    assert done.value.code == 2
    assert "argument --ridge: must be a positive number, 'loo' or 'gcv', got '0'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_version_and_verbose_traceback(tmp_path, capsys):
    from art_malleability import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and __version__ in capsys.readouterr().out
    np.savez(tmp_path / "bad.npz", images=np.zeros((4, 2, 2)))
    assert main(["audit", "-v", "--dataset", str(tmp_path / "bad.npz"), "--output", str(tmp_path / "o")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    import art_malleability.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_spectrum", interrupted)
    assert cli.main(["spectrum", "--output", "unused-folder"]) == 130
    assert capsys.readouterr().err.strip() == "art-malleability spectrum: interrupted"


def test_help_runs_as_console_module():
    done = subprocess.run(
        [sys.executable, "-m", "art_malleability.cli", "audit", "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    for option in ("--dataset", "--model", "--weights", "--attacks", "--eps", "--influence", "--seed", "--device"):
        assert option in done.stdout


def test_audit_states_the_fidelity_of_a_validate_run_and_skips_controls(tmp_path, capsys):
    """validate, then audit the same model (same data and training settings): the audit quotes its estimator's LDS."""
    same = ["--n-train", "100", "--n-test", "30", "--epochs", "40", "--width", "32", "--model", "2l-relu", "--quiet"]
    validated = tmp_path / "val"
    assert main(["validate", *same, "--estimators", "ntk", "--projection-dim", "none", "--n-models", "3",
                 "--n-queries", "8", "--loo-queries", "0", "--n-bootstrap", "20", "--output", str(validated)]) == 0
    out = tmp_path / "audit"
    loud = [a for a in same if a != "--quiet"]
    assert main(["audit", *loud, "--attacks", "fgsm", "--n-queries", "10", "--n-bootstrap", "20", "--no-controls",
                 "--validation", str(validated), "--output", str(out)]) == 0
    report = json.loads((out / "2l-relu" / "report.json").read_text())
    lds = json.loads((validated / "2l-relu" / "validation.json").read_text())["results"]["ntk-exact"]["lds"]
    assert report["fidelity"]["estimator"] == "ntk-exact" and report["fidelity"]["lds"] == lds
    assert report["results"][0]["control"] is None and report["config"]["controls"] is False
    assert "influence fidelity (ntk-exact): LDS" in capsys.readouterr().out
    # a folder without the model's validation fails before any training
    assert main(["audit", *same, "--validation", str(tmp_path / "nothing"), "--output", str(out)]) == 2
    assert "holds no validation.json" in capsys.readouterr().err
    # also for the default models (no --model): the first of them lacks a validation here
    defaults = [a for a in same if a not in ("--model", "2l-relu")]
    assert main(["audit", *defaults, "--validation", str(validated), "--output", str(tmp_path / "d")]) == 2
    assert "holds no validation.json" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_weights_and_data_files_that_cannot_be_used_are_one_line_each(tmp_path, capsys):
    import torch

    from art_malleability.models import build_reference_model

    small = ["--n-train", "100", "--n-test", "30", "--attacks", "fgsm", "--n-queries", "5", "--quiet"]
    torch.save(build_reference_model("2l-relu", (1, 8, 8), 10, width=16).state_dict(), tmp_path / "w16.pt")
    torch.save(build_reference_model("2l-relu", (1, 8, 8), 10, width=16), tmp_path / "whole.pt")
    (tmp_path / "text.npz").write_text("not an archive")
    np.save(tmp_path / "one.npy", np.zeros(3))
    cases = [
        (["--model", "2l-relu", "--width", "32", "--weights", str(tmp_path / "w16.pt")], "check --model, --width"),
        (["--model", "2l-relu", "--weights", str(tmp_path / "whole.pt")], "is not a state_dict saved with"),
        (["--dataset", str(tmp_path / "text.npz")], "is not a readable .npz archive"),
        (["--dataset", str(tmp_path / "one.npy")], "holds a single array"),
    ]
    for args, message in cases:
        assert main(["audit", *small, *args, "--output", str(tmp_path / "out")]) in (1, 2)
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert "weights_only=False" not in err and "allow_pickle" not in err


def test_report_files_share_one_mode_and_bars_are_sparse_in_logs(tmp_path):
    import os
    import stat

    from art_malleability._utils.io import progress_bar
    from art_malleability._utils.output_folder import OutputFolder

    def write(name):
        with OutputFolder(tmp_path, writer="test") as out:
            out.write(name, "{}")

    write("a.json")
    (tmp_path / "b.png").write_bytes(b"")
    mode = stat.S_IMODE((tmp_path / "a.json").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "b.png").stat().st_mode)
    previous = os.umask(0o077)  # the umask in force when the file is written applies, not the one at import
    try:
        write("c.json")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "c.json").stat().st_mode) == 0o600
    bar = progress_bar(range(3), verbose=True)  # pytest's stderr is not a terminal
    assert bar.mininterval == 30.0
    bar.close()


def test_a_rerun_replaces_what_the_last_run_wrote_and_nothing_else(tmp_path):
    out = tmp_path / "audit"
    both = ["--n-train", "100", "--n-test", "30", "--epochs", "20", "--width", "16", "--n-queries", "5",
            "--n-bootstrap", "10", "--no-controls", "--quiet", "--output", str(out)]
    assert main(["audit", *both, "--attacks", "fgsm", "pgd"]) == 0
    (out / "my-notes.txt").write_text("mine")
    assert (out / "mlp-attn" / "scatter_pgd.png").exists()
    assert main(["audit", *both, "--attacks", "fgsm", "--model", "2l-relu"]) == 0
    assert not (out / "mlp-attn").exists() and not (out / "2l-relu" / "scatter_pgd.png").exists()
    assert (out / "2l-relu" / "scatter_fgsm.png").exists() and (out / "my-notes.txt").read_text() == "mine"
    assert "mlp-attn" not in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    ("factory", "message"),
    [("wrong_input", "cannot take the data's inputs of shape (1, 8, 8)"),
     ("wrong_classes", "must return logits of shape (2, 10)")],
)
def test_a_factory_model_that_does_not_fit_the_data_fails_before_training(tmp_path, capsys, monkeypatch, factory,
                                                                          message):
    (tmp_path / "cli_mismatch_module.py").write_text(
        "import torch\n"
        "def wrong_input():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))\n"
        "def wrong_classes():\n    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["audit", *TINY, "--model", f"cli_mismatch_module:{factory}", "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Training" not in captured.err and not (tmp_path / "out").exists()


def _data_folders(tmp_path):
    """Folders a new user might pass as --data-root or --dataset, each wrong in its own way."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (tmp_path / "a-file").write_text("")
    kaggle = tmp_path / "kaggle" / "MNIST" / "raw"  # the IDX files under other names
    kaggle.mkdir(parents=True)
    for name in ("train-images.idx3-ubyte", "train-labels.idx1-ubyte"):
        (kaggle / name).write_bytes(b"")
    broken = tmp_path / "broken"  # the right names, not IDX files
    broken.mkdir()
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (broken / name).write_text("not an IDX file")
    damaged = tmp_path / "damaged" / "cifar-10-batches-py"  # the right names, failing their checksums
    damaged.mkdir(parents=True)
    for name in ("batches.meta", "test_batch"):
        (damaged / name).write_text("not a batch")
    return {name: str(tmp_path / name) for name in ("empty", "images", "a-file", "kaggle", "broken", "damaged")}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dataset", "mnist"], "--data-root must be the local data folder of 'mnist'"),
        (["--dataset", "mnist", "--data-root", "nowhere"], "--data-root must be an existing folder, got 'nowhere'"),
        (["--dataset", "mnist", "--data-root", "a-file"], "which is a file"),
        (["--dataset", "fashion-mnist", "--data-root", "empty"], "--data-root must hold the fashion-mnist IDX files"),
        (["--dataset", "cifar10", "--data-root", "images"], "--data-root must hold CIFAR-10's cifar-10-batches-py/"),
        (["--dataset", "mnist", "--data-root", "kaggle"], "(found 'train-images.idx3-ubyte'"),
        (["--dataset", "images"], "--dataset must be a dataset name or an .npz file"),
        (["--dataset", "images/cat.png"], "--dataset must be an .npz archive"),
        (["--dataset", "mnist-test"], "--dataset must be one of"),
    ],
)
def test_a_data_folder_that_cannot_be_used_fails_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    folders = _data_folders(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = [folders.get(a, a) for a in args]
    for command in ("audit", "validate", "ntk-check", "spectrum", "reproduce"):
        assert main([command, *args, "--output", str(tmp_path / "out")]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"art-malleability {command}: error: --") and message in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("command", "dataset", "folder", "message"),
    [
        ("audit", "mnist", "broken", "--data-root must hold readable IDX files, got '"),
        ("spectrum", "mnist", "broken", "t10k-images-idx3-ubyte', which cannot be read"),
        ("audit", "cifar10", "damaged", "--data-root must hold intact CIFAR-10 batches"),
    ],
)
def test_unreadable_data_files_are_one_line_naming_the_option(tmp_path, capsys, command, dataset, folder, message):
    root = _data_folders(tmp_path)[folder]
    assert main([command, "--dataset", dataset, "--data-root", root, "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["audit", "--weights", "w.pt"], "--weights must come with exactly one --model, got no --model"),
        (["reproduce", "--classes", "3", "8"], "--classes must not be given to reproduce"),
    ],
)
def test_options_that_do_not_go_together_exit_2(tmp_path, capsys, args, message):
    assert main([*args, "--output", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_quiet_prints_nothing_on_success(tmp_path):
    """-q: no data line, no tables, no progress, no warnings (a model near chance is only in the report)."""
    done = subprocess.run(
        [sys.executable, "-m", "art_malleability.cli", "audit", *TINY, "--attacks", "fgsm", "--output",
         str(tmp_path / "o")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    assert (tmp_path / "o" / "summary.md").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "2l-relu", "--weights", "missing.pt"], "--weights must be a state_dict file, got 'missing.pt', "
         "which is not an existing file"),
        (["--eps", "5"], "--eps must lie in (0, 1)"),
        (["--dist-timeout", "0"], "--dist-timeout must be a positive number of seconds, got 0"),
        (["--model", "os:system"], "--model must name a function or class that builds a torch.nn.Module from "
         "input_shape= and nb_classes= (or from no arguments), got 'os:system', which needs 'command'"),
        (["--model", "collections:OrderedDict"], "a class that is not a torch.nn.Module"),
        (["--n-queries", "1"], "--n-queries must be at least 2"),
        # the package's shared rules, the value shown as typed (0, not 0.0)
        (["--lr", "0"], "--lr must be a positive finite number, got 0\n"),
        (["--weight-decay", "-0.5"], "--weight-decay must be a non-negative finite number, got -0.5\n"),
        (["--n-train", "0"], "--n-train must be a positive integer, got 0\n"),
        (["--epochs", "0"], "--epochs must be a positive integer, got 0\n"),
        (["--output", "/proc/art-malleability-cannot-write-here"], "--output must be a folder this process can write"),
        (["--output", "FILE/below"], "--output must be a folder this process can write"),
    ],
)
def test_what_the_options_tell_is_checked_before_any_data_is_read(tmp_path, capsys, monkeypatch, args, message):
    import art_malleability.cli.audit as cli_audit

    def never(args):
        raise AssertionError("the data was read before the options were checked")

    if "/proc/" in " ".join(args) and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    monkeypatch.setattr(cli_audit, "load_data", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / "FILE" / "below") if a == "FILE/below" else a for a in args]
    output = [] if "--output" in args else ["--output", str(tmp_path / "out")]
    assert main(["audit", *TINY, *output, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "timeout_s" not in err and "(eps)" not in err


def test_weights_that_are_not_finite_are_named_with_their_file(tmp_path, capsys):
    model = build_reference_model("2l-relu", (1, 8, 8), 10, width=32, seed=0)
    state = model.state_dict()
    next(iter(state.values()))[0, 0] = float("nan")
    torch.save(state, tmp_path / "diverged.pt")
    code = main(["audit", *TINY, "--model", "2l-relu", "--weights", str(tmp_path / "diverged.pt"), "--output",
                 str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--weights must hold finite values, got {str(tmp_path / 'diverged.pt')!r}" in err
    assert "1 NaN or infinite value(s)" in err and "K + ridge" not in err


def test_an_interrupt_while_the_interpreter_exits_is_one_line_and_status_130(tmp_path):
    """A SIGINT after the command has finished (here: while a non-daemon thread is joined at exit)."""
    script = textwrap.dedent(f"""
        import sys, threading, time
        import art_malleability.cli as cli

        def finished(args):
            threading.Thread(target=time.sleep, args=(20,)).start()  # joined while the interpreter exits
            print("done", flush=True)
            return 0

        cli.run_spectrum = finished
        sys.argv = ["art-malleability", "spectrum", "--output", {str(tmp_path / "o")!r}]
        cli.console_main()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        time.sleep(1.5)  # main() has returned: the interpreter waits for the thread
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 130
    assert err.strip() == "art-malleability: interrupted while exiting after the command had ended with status 0"


def test_queries_whose_metrics_do_not_fit_are_refused_after_the_data_and_before_training(tmp_path, capsys,
                                                                                            monkeypatch):
    """The data's sizes are needed for the plan; no model is trained (or loaded) before the refusal."""
    import art_malleability.cli.audit as cli_audit

    def never(*args, **kwargs):
        raise AssertionError("a model was trained before the queries were checked")

    monkeypatch.setattr(cli_audit, "_train_or_load", never)
    code = main(["audit", *TINY, "--attacks", "fgsm", "--n-bootstrap", "1000000000", "--output", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--n-queries (n_queries) must leave the audit's metrics within the memory budget" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the reproduction config's rule, in its words (the command line said "name models of" before)
        (["reproduce", "--tables", "table2", "--models", "2l-relu", "foo"],
         "--models must name reference models ('2l-relu', 'mlp-attn', 'mlp-attn-qkv'), got 2l-relu foo\n"),
        # the checker's rules: duplicates are refused up front (the checker refused them only once it was built)
        (["ntk-check", "--seeds", "0", "1", "0"], "--seeds must hold distinct values (each one once), got 0 1 0\n"),
        (["ntk-check", "--widths", "16", "64", "64"],
         "--widths must hold distinct values (each one once), got 16 64 64\n"),
    ],
)
def test_the_studies_options_are_checked_through_the_librarys_rules(tmp_path, capsys, monkeypatch, args, message):
    import art_malleability.cli.studies as studies

    def never(args):
        raise AssertionError("the data was read before the options were checked")

    monkeypatch.setattr(studies, "load_data", never)
    assert main([*args, "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.endswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_a_torchvision_builder_is_a_model_factory():
    # torchvision's builders take the classes as num_classes (through **kwargs): --model torchvision.models:resnet18
    from art_malleability.cli.checks import build_model

    model = build_model("torchvision.models:resnet18", (3, 32, 32), 10, width=16, seed=0)
    with torch.no_grad():
        assert model.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="cannot take the data's inputs"):  # a ViT built for 224 x 224 inputs
        build_model("torchvision.models:vit_b_16", (3, 32, 32), 10, width=16, seed=0)
