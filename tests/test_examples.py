"""The scale examples run end to end on small sizes (``--quick``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )


def test_cifar10_resnet_example_on_any_npz(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "cifar.npz", x=rng.integers(0, 256, (300, 32, 32, 3), dtype=np.uint8), y=np.arange(300) % 10)
    done = _run("audit_cifar10_resnet.py", "--data", str(tmp_path / "cifar.npz"), "--quick", "--output", "out",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"] == "resnet20" and report["execution"]["mode"] == "projected"
    assert [r["attack"] for r in report["results"]] == ["fgsm", "pgd", "mim"]
    assert "peak memory" in done.stdout and "NTK influence phases" in done.stdout


def test_torchvision_example_runs_the_default_audit(tmp_path):
    # a torchvision architecture as a user would take it, audited with the defaults: the plan printed before the
    # audit, the kernel method chosen by counted work recorded in the report
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "cifar.npz", x=rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8), y=np.arange(200) % 10)
    done = _run("audit_torchvision.py", "--data", str(tmp_path / "cifar.npz"), "--arch", "mobilenet_v3_small",
                "--quick", "--output", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"] == "mobilenet_v3_small" and report["n_train"] == 96
    method = report["execution"]["kernel_method"]
    assert method["method"] in ("structured", "batched", "jacobian") and set(method["seconds"]) == {
        "structured", "batched", "jacobian"}
    assert "audit plan:" in done.stdout and "against an estimate of" in done.stdout


def test_mnist_cnn_example_streams_a_dataset(tmp_path, shared_data):
    done = _run("audit_mnist_cnn.py", "--data-root", str(shared_data / "mnist"), "--quick", "--output", "out",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["n_train"] == 1200 and report["execution"]["mode"] == "exact"
    assert report["clean_accuracy"] > 0.5


def test_robustness_evaluation_example_beside_art_metrics(tmp_path):
    done = _run("robustness_evaluation.py", "--quick", "--output", "eval.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((tmp_path / "eval.json").read_text())
    row = saved["robustness"]
    assert 0 <= row["pgd_accuracy"] <= row["clean_accuracy"] <= 1 and row["empirical_robustness_fgsm"] > 0
    assert {"flip_rate_fgsm", "excess_flip_rate_pgd"} <= set(row) and saved["malleability"]["results"]


def test_read_report_example_reads_a_saved_audit(tmp_path):
    from art_malleability.cli import main

    assert main(["audit", "--model", "2l-relu", "--n-train", "100", "--n-test", "30", "--epochs", "40", "--width",
                 "32", "--attacks", "fgsm", "--n-queries", "10", "--n-bootstrap", "20", "--quiet", "--output",
                 str(tmp_path / "audit")]) == 0
    done = _run("read_report.py", str(tmp_path / "audit" / "2l-relu"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fgsm:" in done.stdout and "influential examples flipped" in done.stdout
