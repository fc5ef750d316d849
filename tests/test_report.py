"""MalleabilityReport: round trip, files, tables, undefined values."""

import json
import re

import numpy as np
import pytest

from art_malleability.audit.report import AttackResult, MalleabilityReport, comparison_table


def _report(n_queries: int = 10) -> MalleabilityReport:
    rng = np.random.default_rng(0)
    before = rng.normal(size=50)
    results = []
    for name in ("fgsm", "pgd"):
        results.append(
            AttackResult(
                attack=name,
                params={"eps": np.float32(0.3), "norm": "inf"},
                n_perturbed=5,
                attack_success=0.4,
                max_perturbation=0.3,
                flip_rate=np.float64(0.2),
                flip_rate_ci=(0.0, 0.6),
                per_query_flip_rate=0.25,
                per_query_flip_rate_ci=(np.nan, np.nan) if n_queries == 1 else (0.1, 0.4),
                spearman=0.8,
                spearman_ci=(0.7, 0.9),
                top_k_jaccard=0.5,
                top_k_jaccard_ci=(0.3, 0.7),
                scores_after=before + rng.normal(size=50),
                seconds={"attack": 0.1},
                flip_rate_above_floor=0.1,
                flip_rate_above_floor_ci=(0.0, 0.4),
                counted_flips=[int(np.argmax(np.abs(before)))],
                control={"perturbation": "random-sign", "eps": 0.3, "draws": 5, "flip_rate_null": 0.04,
                         "flip_rate": 0.05, "flip_rate_ci": (0.0, 0.2),
                         "flip_rate_above_floor": 0.0, "flip_rate_above_floor_ci": (0.0, 0.1), "spearman": 0.9,
                         "spearman_ci": (0.85, 0.95), "top_k_jaccard": 0.8, "top_k_jaccard_ci": (0.6, 0.9),
                         "signed_retention": 0.6, "signed_retention_ci": (0.5, 0.7)},
                excess_flip_rate=0.15,
                excess_flip_rate_ci=(-0.05, 0.45),
                flip_rate_null=0.15,
                no_flip_statistic=2.5,
                undecided_share=0.1,
                signed_retention=0.25,
                signed_retention_ci=(0.125, 0.375),
                excess_retention=-0.35,
                excess_retention_ci=(-0.5, -0.2),
            )
        )
    return MalleabilityReport(
        model="2l-relu",
        config={"eps": 0.3, "influence": "ntk", "strategy": "top", "confidence": 0.95},
        n_train=50,
        n_queries=n_queries,
        query_source="test",
        top_k=5,
        top_indices=np.argsort(-np.abs(before))[:5],
        clean_accuracy=0.9,
        scores_before=before,
        results=results,
        seconds={"influence_clean": 1.0},
        versions={"torch": "x"},
        dataset="digits",
    )


def test_save_and_load_round_trip(tmp_path):
    report = _report()
    folder = report.save(tmp_path / "out")
    for name in ("report.json", "report.md", "flip_rates.png", "scatter_fgsm.png", "scatter_pgd.png"):
        assert (folder / name).stat().st_size > 0, name
    assert MalleabilityReport.load(folder) == report
    assert MalleabilityReport.load(folder / "report.json") == report
    assert not list(folder.glob(".*.tmp"))  # atomic write leaves no temporary file


def test_undefined_values_become_none_and_json_is_strict(tmp_path):
    report = _report(n_queries=1)
    assert report.results[0].per_query_flip_rate_ci == [None, None]
    text = (report.save(tmp_path) / "report.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert MalleabilityReport.load(tmp_path) == report
    assert "fgsm 25.0%" in report.to_html()  # the per-query flip rate, with its interval undefined


def test_summary_markdown_and_comparison():
    report = _report()
    summary = report.summary()
    assert "retention [95% CI]" in summary.splitlines()[1].split("flip rate")[0]  # what is decided comes first
    assert "0.250 [0.125, 0.375]" in summary and "-0.350 [-0.500, -0.200]" in summary and "0.600" in summary
    assert "flip rate [CI]" in summary and "20.0% [0.0, 60.0]" in summary
    assert "+15.0 pts [-5.0, +45.0]" in summary and "5.0%" in summary  # excess over the control, control
    markdown = report.to_markdown()
    assert ("| fgsm | 0.250 [0.125, 0.375] | 0.600 | -0.350 [-0.500, -0.200] | 20.0% [0.0, 60.0] | 15.0% | "
            "undecided [0.0, 40.0] | 5.0% | +15.0 pts") in markdown
    assert "positive = helpful" in markdown and "noise-aware" in markdown and "retention" in markdown
    assert "[report.html](report.html)" in markdown and "(report.html#controls)" in markdown
    page = report.to_html()  # the controls' table is on the page
    assert re.search(r'<th scope="row">fgsm</th><td class="number">0.3</td><td class="number">5</td>'
                     r'<td[^>]*>0.600 \[0.500, 0.700\]</td><td[^>]*>5.0% \[0.0, 20.0\]</td><td[^>]*>4.0%</td>', page)
    table = comparison_table([report, report])
    assert table.count("| 2l-relu |") == 2 and "pgd flip rate" in table and "excess +15.0 pts" in table
    assert table.index("fgsm retention") < table.index("fgsm flip rate")
    assert "0.250 [0.125, 0.375]; excess -0.350" in table


def test_lookup_and_missing_file(tmp_path):
    report = _report()
    assert report.result("pgd").attack == "pgd"
    with pytest.raises(KeyError, match="mim"):
        report.result("mim")
    with pytest.raises(FileNotFoundError, match="report.json"):
        MalleabilityReport.load(tmp_path)


def test_a_rerun_replaces_what_the_last_save_wrote_and_nothing_else(tmp_path):
    report = _report()
    report.save(tmp_path)
    for name in ("notes.txt", "scatter.png", "summary.md"):  # not written by a MalleabilityReport
        (tmp_path / name).write_text("kept")
    fewer = _report()
    fewer.results = fewer.results[:1]  # the pgd result is gone, and with it its figure
    fewer.save(tmp_path)
    assert _visible(tmp_path) == {
        "report.json", "report.md", "report.html", "flip_rates.png", "scatter_fgsm.png", "notes.txt", "scatter.png",
        "summary.md",
    }
    assert MalleabilityReport.load(tmp_path) == fewer


def test_a_reproduction_rerun_drops_its_stale_files(tmp_path):
    from art_malleability.paper.reproduce import Reproduction

    first = Reproduction({"dataset": "digits"}, "mnist", tables={"ablation": "| a |"}, files={"ablation.png": b"png"})
    first.save(tmp_path)
    (tmp_path / "notes.txt").write_text("kept")
    assert (tmp_path / "ablation.png").read_bytes() == b"png"
    Reproduction({"dataset": "digits"}, "mnist").save(tmp_path)
    assert _visible(tmp_path) == {"reproduction.json", "reproduction.md", "notes.txt"}
    assert Reproduction.load(tmp_path).tables == {}


def test_markdown_table():
    from art_malleability._utils.report_base import markdown_table

    assert markdown_table(["a", "b"], [[1, "x"], ["y", 2.5]]) == "| a | b |\n|---|---|\n| 1 | x |\n| y | 2.5 |"


def _visible(folder):
    """The names in a folder, less the package's own hidden manifest."""
    return {p.name for p in folder.iterdir() if not p.name.startswith(".art-malleability")}


def test_an_interrupted_save_leaves_the_old_report_intact(tmp_path, monkeypatch):
    import art_malleability._utils.output_folder as io_module

    report = _report()
    report.save(tmp_path)
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    changed = _report()
    changed.model = "another model"
    real_replace = io_module.os.replace
    calls = []

    def interrupted(src, dst):
        calls.append(dst)
        raise KeyboardInterrupt  # the first rename never happens: as if the process stopped while writing

    monkeypatch.setattr(io_module.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        changed.save(tmp_path)
    monkeypatch.setattr(io_module.os, "replace", real_replace)
    assert calls  # everything was rendered and staged before the first rename
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == old  # no temporary files left either
    assert MalleabilityReport.load(tmp_path).model == report.model


def test_every_null_in_a_real_report_says_why(tmp_path):
    """fidelity, projection seeds, backend, the control of a run without controls, intervals of one query..."""
    from helpers import digits, trained_classifier

    from art_malleability import MalleabilityEstimator

    clf, data = trained_classifier("2l-relu", epochs=50), digits(100, 20)
    for kwargs, test in (({"controls": False}, slice(0, 1)), ({}, slice(0, 20))):
        report = MalleabilityEstimator(clf, attacks=["fgsm"], n_queries=10, n_bootstrap=20, verbose=False,
                                       **kwargs).evaluate(data.x_train, data.y_train, data.x_test[test],
                                                          data.y_test[test])
        saved = json.loads((report.save(tmp_path / str(len(kwargs))) / "report.json").read_text())
        nulls = _null_paths(saved)
        assert {"fidelity", "dataset", "execution.backend", "noise_model.projection_seeds"} <= set(nulls)
        reasons = saved["null_reasons"]
        assert set(reasons) == set(nulls)
        assert all(reasons[p] and reasons[p] != "not recorded by this run" for p in nulls), reasons
        assert MalleabilityReport.load(tmp_path / str(len(kwargs))) == report
        if kwargs:
            assert reasons["results[0].control"].startswith("controls=False")
            assert reasons["results[0].flip_rate_ci[1]"].startswith("a single query point")


def _null_paths(value, path=""):
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() if k != "null_reasons"
                for p in _null_paths(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _null_paths(v, f"{path}[{i}]")]
    return []


@pytest.mark.parametrize("content", ["{not json", '{"model": "x"}', "\xff\xfe"])
def test_a_file_that_is_not_a_report_is_named(tmp_path, content):
    (tmp_path / "report.json").write_bytes(content.encode("latin-1"))
    with pytest.raises(ValueError, match=f"path must hold a .*got '{tmp_path / 'report.json'}'|got '{tmp_path}'"):
        MalleabilityReport.load(tmp_path)


def test_saving_into_an_existing_file_is_named(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(NotADirectoryError, match=f"directory must be a folder, got '{tmp_path / 'taken'}', which is "
                                                 "an existing file"):
        _report().save(tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "a file"


def test_a_trained_models_missing_weights_file_has_its_reason():
    from art_malleability.audit._report_nulls import null_reasons

    reasons = null_reasons({"config": {"n_queries": None, "model": {"name": "2l-relu", "weights": None}},
                            "results": []})
    assert reasons["config.model.weights"].startswith("no weights file was given (--weights)")
    assert "not recorded" not in " ".join(reasons.values())


def test_the_scatter_colours_each_member_by_what_the_audit_decides_of_it():
    import matplotlib

    matplotlib.use("Agg")
    report = _report()
    r = report.results[0]
    top = report.top_indices
    r.counted_flips, r.undecided_members = [top[0]], [top[0], top[1], top[2]]  # a flip can also sit near zero
    ax = report.plot_influence_scatter("fgsm").axes[0]
    shown = {c.get_label().split(" (")[0]: {tuple(p) for p in c.get_offsets()} for c in ax.collections}
    before, after = np.array(report.scores_before), np.array(r.scores_after)

    def points(ids):
        return {(before[i], after[i]) for i in ids}

    assert shown["top set: decided flip"] == points([top[0]])
    assert shown["top set: undecided, within 1 SE of 0"] == points([top[1], top[2]])
    assert shown["top set: decided keep"] == points(top[3:])


def test_the_undecided_members_are_those_the_undecided_share_counts():
    from art_malleability.metrics import malleability_metrics

    rng = np.random.default_rng(3)
    before = rng.normal(1.0, 1.0, size=(200, 40)) * np.where(np.arange(40) < 20, 1.0, 0.05)
    after = before + rng.normal(0, 1.0, size=before.shape) - np.where(np.arange(40) % 3 == 0, 1.0, 0.0)
    metrics = malleability_metrics(before, after, top_fraction=0.5, n_bootstrap=50)
    k = 20
    assert 0 < len(metrics.undecided_members) < k
    assert metrics.undecided_share == pytest.approx(len(metrics.undecided_members) / k)
    assert metrics.to_dict()["undecided_members"] == list(metrics.undecided_members)
