"""End to end on real data: the MNIST test split from the shared data folder, through the CLI."""

import json

from art_malleability.audit.report import MalleabilityReport
from art_malleability.cli import main


def test_audit_on_real_mnist(shared_data, tmp_path, capsys):
    out = tmp_path / "mnist-audit"
    args = [
        "audit", "--dataset", "mnist", "--data-root", str(shared_data / "mnist"), "--n-train", "500",
        "--n-test", "100", "--width", "256", "--epochs", "60", "--n-queries", "50", "--n-bootstrap", "200",
        "--output", str(out),
    ]
    assert main(args) == 0
    assert "mnist" in capsys.readouterr().out
    for model, min_accuracy in (("2l-relu", 0.8), ("mlp-attn", 0.3)):
        report = MalleabilityReport.load(out / model)
        assert report.dataset == "mnist" and report.n_train == 500 and report.top_k == 50
        assert report.clean_accuracy > min_accuracy, (model, report.clean_accuracy)
        assert [r.attack for r in report.results] == ["fgsm", "pgd", "mim"]
        for r in report.results:
            assert 0.0 <= r.flip_rate <= 1.0 and r.n_perturbed == 50
            assert r.max_perturbation <= 0.3 + 1e-6 and r.attack_success > 0.5
            assert -1.0 <= r.spearman <= 1.0
        json.loads((out / model / "report.json").read_text())
