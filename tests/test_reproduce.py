"""Smoke test of the paper reproduction (every table, tiny sizes) and its helpers."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from art_malleability.paper.common import mean_ci
from art_malleability.paper.reproduce import PAPER, ReproductionConfig, run_reproduction

ROOT = Path(__file__).resolve().parents[1]


def test_every_table_runs_on_tiny_sizes(tmp_path):
    config = ReproductionConfig(
        models=("2l-relu", "mlp-attn"), n_train=60, n_test=30, width=16, widths=(16, 64), seeds=(0, 1), epochs=2,
        adv_epochs=1, adv_max_iter=2, eps_grid=(0.1, 0.3), attack_max_iter=3, n_queries=8, n_bootstrap=10,
        ntk_n_train=20, ntk_n_test=10, ntk_adam_epochs=1, ntk_gd_steps=3, device="cpu", verbose=False,
    )
    result = run_reproduction(config, tmp_path)
    assert set(result.tables) == {"table1", "table2", "table3", "table4", "ablation", "landscape", "spectral"}
    markdown = (tmp_path / "reproduction.md").read_text()
    for needle in ("Table 1", "Table 2", "Table 3", "Table 4", "ε ablation", "Spectral numbers", "34.6", "43.4",
                   "Ratio MLP-Attn / 2L-ReLU"):
        assert needle in markdown, needle
    data = json.loads((tmp_path / "reproduction.json").read_text())
    tables = {r["table"] for r in data["rows"]}
    assert tables == {"table1", "table2", "table3", "table4", "ablation", "landscape", "spectral"}
    adversarial = [r for r in data["rows"] if r.get("training") == "pgd-adversarial"]
    assert len(adversarial) == 2 * 2 and all(r["attack"] == "pgd" for r in adversarial)
    assert "| mlp-attn | pgd-adversarial |" in result.tables["table4"] and "noise-aware" in result.tables["table4"]
    assert all("clean_accuracy" in r and "near_chance" in r for r in data["rows"] if r["table"] == "table2")
    assert (tmp_path / "ablation.png").exists() and (tmp_path / "table1_ntk" / "convergence.json").exists()
    assert (tmp_path / "landscape.png").exists() and "Loss landscape" in markdown
    landscape = {(r["model"], r["seed"]): r for r in data["rows"] if r["table"] == "landscape"}
    assert set(landscape) == {(m, s) for m in ("2l-relu", "mlp-attn") for s in (0, 1)}
    assert all(r["lambda_max"] > 0 and r["curvature"] > 0 and r["rise_1.0"] > r["rise_0.5"] > 0
               for r in landscape.values())
    assert "MLP-Attn − 2L-ReLU (paired)" in result.tables["landscape"]
    table2 = [r for r in data["rows"] if r["table"] == "table2"]
    assert all("excess_flip_rate_ci" in r and "control_flip_rate" in r and "flip_rate_null" in r for r in table2)
    assert "MLP-Attn minus 2L-ReLU, excess flip rates" in result.tables["table2"]
    assert "Student-t interval over the seeds" in result.tables["table2"]
    assert "| 2l-relu | fgsm |" in result.tables["table2"]
    for table, loss in (("table2", "cross_entropy"), ("table3", "mse")):  # LDS line, n/a for untrained models
        assert "Fidelity of the influence estimator against retraining (LDS, seed 0, 20 models" in result.tables[
            table] and f"query {loss} loss" in result.tables[table]


def test_pooling_over_seeds_is_a_t_interval_and_one_seed_keeps_its_own():
    from scipy import stats

    from art_malleability.paper.common import paired_gap, pooled

    rows = [{"seed": s, "flip_rate": p, "flip_rate_ci": [p - 0.1, p + 0.1]} for s, p in enumerate((0.1, 0.3, 0.5))]
    mean, low, high = pooled(rows, "flip_rate")
    half = 100 * stats.t.ppf(0.975, 2) * np.std([0.1, 0.3, 0.5], ddof=1) / np.sqrt(3)
    assert mean == pytest.approx(30.0) and (low, high) == pytest.approx((max(30 - half, 0.0), 30 + half))
    assert pooled(rows[:1], "flip_rate") == pytest.approx((10.0, 0.0, 20.0))  # one seed: its interval over queries
    other = [{"seed": r["seed"], "flip_rate": r["flip_rate"] - 0.05 + 0.01 * r["seed"]} for r in rows]
    gap, low, high = paired_gap(rows, other, "flip_rate")
    assert gap == pytest.approx(4.0) and low < 4.0 < high and high - low < 10  # paired by seed: narrow


def test_two_seeds_that_agree_by_chance_keep_their_own_query_noise():
    # a new user's `reproduce` over 2 seeds pooled a noise-aware rate of 0 in both into "0.0 [0.0, 0.0]"
    from scipy import stats

    from art_malleability.metrics import z_value
    from art_malleability.paper.common import fmt_ci, pooled

    rows = [{"seed": s, "flip_rate_above_floor": 0.0, "flip_rate_above_floor_ci": [0.0, 0.15]} for s in (0, 1)]
    mean, low, high = pooled(rows, "flip_rate_above_floor")
    own = 0.15 / z_value(0.95)  # each seed's standard error over its queries (the unclipped side)
    assert mean == 0.0 and low == 0.0 and high == pytest.approx(100 * stats.t.ppf(0.975, 1) * own / np.sqrt(2))
    # seeds that differ more than their query noise keep the spread between them
    apart = [{"seed": 0, "flip_rate": 0.2, "flip_rate_ci": [0.19, 0.21]},
             {"seed": 1, "flip_rate": 0.4, "flip_rate_ci": [0.39, 0.41]}]
    half = 100 * stats.t.ppf(0.975, 1) * np.std([0.2, 0.4], ddof=1) / np.sqrt(2)
    assert pooled(apart, "flip_rate") == pytest.approx((30.0, max(30 - half, 0.0), min(30 + half, 100.0)))
    # an interval that fills the statistic's whole range decides nothing and says so
    assert fmt_ci(1.0, -250.0, 250.0, 1, (-200.0, 200.0)) == "1.0 [undecided: the whole range]"
    assert fmt_ci(1.0, -5.0, 7.0, 1, (-200.0, 200.0)) == "1.0 [-5.0, 7.0]"


def test_mean_ci_and_paper_numbers():
    mean, low, high = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and low == pytest.approx(2.0 - 2.4841377, rel=1e-6) and high == pytest.approx(4.4841377)
    assert mean_ci([5.0])[0] == 5.0
    assert PAPER["table2"]["mnist"]["mlp-attn"]["pgd"] == 28.9
    with pytest.raises(ValueError, match="tables"):
        ReproductionConfig(tables=("table9",))


def test_example_script_help():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "reproduce_paper.py"), "--help"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "--tables" in done.stdout and "--epochs" in done.stdout


def test_open_choices_study_on_tiny_sizes(tmp_path):
    from art_malleability.paper.open_choices import run_open_choices

    config = ReproductionConfig(
        n_train=60, n_test=30, width=16, seeds=(0, 1), epochs=2, attack_max_iter=2, n_queries=8, n_bootstrap=10,
        device="cpu", verbose=False,
    )
    result = run_open_choices(config, tmp_path)
    table = (tmp_path / "open_choices.md").read_text()
    for choice in ("influence", "top set", "ranking", "perturbed set", "test-point attention", "attack steps",
                   "init scale", "input centring"):
        assert f"| {choice} |" in table, choice
    rows = [line for line in table.splitlines() if line.startswith("| ") and "alternative" not in line]
    assert sum("**default**" in line for line in rows) == 8 and sum("*closest*" in line for line in rows) == 8
    assert all(line.replace("\\|", "").count("|") == 7 for line in rows)  # six cells, none split by a pipe
    defaults = {r["alternative"] for r in result.rows if r["default"]}
    assert "ntk (squared loss)" in defaults and "gradient (TracIn)" not in defaults


def test_table1_points_cover_every_class_of_a_class_sorted_source(tmp_path):
    from art_malleability.data import load_dataset
    from art_malleability.paper.reproduce import _ntk_points

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(10), 40)  # sorted by class, like the CIFAR-10 test-split .npz
    np.savez(tmp_path / "sorted.npz", x=rng.integers(0, 256, size=(400, 4, 4, 3), dtype=np.uint8), y=y)
    data = load_dataset(tmp_path / "sorted.npz", n_train=200, n_test=100, seed=0)
    assert set(data.y_train[:20]) == {0}  # the trap: a prefix holds one class
    tr, te = _ntk_points(ReproductionConfig(ntk_n_train=30, ntk_n_test=20), data)
    assert len(tr) == 30 and len(te) == 20 and len(set(tr)) == 30
    assert np.bincount(data.y_train[tr], minlength=10).tolist() == [3] * 10
    assert np.bincount(data.y_test[te], minlength=10).tolist() == [2] * 10


def test_a_rerun_without_table1_removes_the_stale_sweep_and_nothing_else(tmp_path):
    from art_malleability._utils.output_folder import OutputFolder

    sweep = tmp_path / "table1_ntk"
    with OutputFolder(tmp_path, writer="reproduce") as out:  # what an earlier run with Table 1 left
        for name in ("convergence.json", "convergence.md", "static.png", "dynamic.png"):
            out.write(f"table1_ntk/{name}", "old")
        out.write("ablation.png", b"old")
    (sweep / "notes.txt").write_text("mine")
    (sweep / "static.png").write_text("edited since")  # the run's file, changed by hand: it stays
    (tmp_path / "mine.png").write_bytes(b"mine")
    config = ReproductionConfig(n_train=60, n_test=30, tables=("spectral",), device="cpu", verbose=False)
    run_reproduction(config, tmp_path)
    assert sorted(p.name for p in sweep.iterdir()) == ["notes.txt", "static.png"]
    assert {p.name for p in tmp_path.iterdir() if not p.name.startswith(".")} == {
        "reproduction.json", "reproduction.md", "table1_ntk", "mine.png"
    }
    (sweep / "notes.txt").unlink()
    (sweep / "static.png").unlink()
    run_reproduction(config, tmp_path)
    assert not sweep.exists()  # a folder a run created goes once it is empty


def test_quiet_runs_switch_off_arts_trainer_bars_and_restore_them():
    from art.defences.trainer import adversarial_trainer

    from art_malleability.paper.reproduce import _trainer_progress

    before = adversarial_trainer.tqdm, adversarial_trainer.trange
    with _trainer_progress(False):
        assert adversarial_trainer.trange(2).disable and adversarial_trainer.tqdm([1]).disable
    assert (adversarial_trainer.tqdm, adversarial_trainer.trange) == before
    with pytest.raises(RuntimeError), _trainer_progress(False):
        raise RuntimeError("fails inside")
    assert (adversarial_trainer.tqdm, adversarial_trainer.trange) == before
    with _trainer_progress(True):
        assert adversarial_trainer.trange is before[1]


def test_the_config_refuses_through_its_rule_table_naming_the_setting():
    from art_malleability._utils.params import InvalidParameterError
    from art_malleability.paper.reproduce import REPRODUCTION_RULES

    for name, bad in (("lds_models", 1), ("widths", (16, 0)), ("seeds", (1, 1)), ("epochs", 0), ("lr", 0.0),
                      ("weight_decay", -1.0), ("adv_epochs", 0), ("ntk_n_train", 0), ("ntk_adam_epochs", 2.5),
                      ("n_queries", 1), ("top_fraction", 0.0), ("n_train", 0), ("attention_context", "trace")):
        with pytest.raises(InvalidParameterError) as refused:
            ReproductionConfig(**{name: bad})
        assert refused.value.param == name and name in REPRODUCTION_RULES
    assert ReproductionConfig(lds_models=0, n_train=None).lds_models == 0


def test_a_rerun_with_a_work_folder_trains_and_refits_nothing_again(tmp_path, monkeypatch):
    from art_malleability.influence import NTKInfluence
    from art_malleability.paper import common

    config = ReproductionConfig(
        models=("2l-relu",), n_train=60, n_test=30, width=16, seeds=(0, 1), epochs=2, attack_max_iter=3, n_queries=8,
        n_bootstrap=10, lds_models=0, tables=("table2",), device="cpu", verbose=False, work_dir=str(tmp_path / "work"),
    )
    trained, refits = [], []
    real_train, real_refit = common.train_model, NTKInfluence.refit
    monkeypatch.setattr(common, "train_model", lambda *a, **k: trained.append(1) or real_train(*a, **k))
    monkeypatch.setattr(NTKInfluence, "refit", lambda *a, **k: refits.append(1) or real_refit(*a, **k))
    first = run_reproduction(config, tmp_path / "one")
    assert len(trained) == 2 and refits  # one model per seed
    done = len(refits)
    second = run_reproduction(config, tmp_path / "two")
    assert len(trained) == 2 and len(refits) == done  # every model's weights and every audit's passes were kept
    assert first.rows == second.rows and first.tables == second.tables
    more = ReproductionConfig(**{**config.__dict__, "seeds": (0, 1, 2)})
    run_reproduction(more, tmp_path / "three")
    assert len(trained) == 3  # a seed added: only its model trained
