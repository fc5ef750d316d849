"""Issue 35, the sweep's other cases: non-finite inputs, report folders on failure and SIGTERM, single-class data,
the report's undecided cells and warning, progress bars in logs."""

import io
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers import TINY_AUDIT as TINY
from helpers import folder_snapshot as snapshot
from torch import nn

from art_malleability._utils.output_folder import LOCK_NAME, STAGING_PREFIX, OutputFolder
from art_malleability.cli import main
from art_malleability.influence import get_influence


def leftovers(folder):
    """The lock and the staging folders in a folder."""
    return [p.name for p in folder.iterdir() if p.name == LOCK_NAME or p.name.startswith(STAGING_PREFIX)]


# ---------------------------------------------------------------------------------------------- 1. non-finite inputs


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(n=12, n_query=5):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n),
            rng.normal(size=(n_query, 4)).astype(np.float32), rng.integers(0, 3, n_query))


def _model_state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, model.training,
            [p.requires_grad for p in model.parameters()])


def _same_state(model, state):
    weights, training, flags = state
    return (all(torch.equal(weights[k], v) for k, v in model.state_dict().items()) and model.training == training
            and [p.requires_grad for p in model.parameters()] == flags)


@pytest.mark.parametrize("name", ["gradient", "ntk", "captum"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_queries_are_refused_naming_the_argument_and_the_index(name, bad):
    model = _mlp()
    x, y, xq, yq = _data()
    estimator = get_influence(name, device="cpu").fit(model, x, y)
    state = _model_state(model)
    xq[3, 1] = bad
    given = xq.copy()
    calls = [("influence", lambda: estimator.influence(xq, yq)),
             ("influence k", lambda: estimator.influence(xq, yq, k=2)),
             ("scores", lambda: estimator.scores(xq, yq)),
             ("torch scores", lambda: estimator.scores(torch.from_numpy(xq), yq))]
    if name != "ntk":  # the self-influence of other examples is the gradient estimators'
        calls.append(("self_influence", lambda: estimator.self_influence(xq, yq)))
    else:
        calls += [("predict", lambda: estimator.predict(xq)), ("loo", lambda: estimator.loo_predictions(xq))]
    for what, call in calls:
        with pytest.raises(ValueError, match=r"x_query must hold finite values, got a NaN or infinite value at "
                                             r"index 3"):
            call()
        assert np.array_equal(xq, given, equal_nan=True), what
    assert _same_state(model, state)


@pytest.mark.parametrize("name", ["gradient", "ntk", "captum"])
def test_non_finite_training_inputs_are_refused_and_nothing_changes(name):
    model = _mlp()
    model.train()
    x, y, _, _ = _data()
    x[7, 2] = np.nan
    given = x.copy()
    state = _model_state(model)
    with pytest.raises(ValueError, match=r"x_train must hold finite values, got a NaN or infinite value at index 7"):
        get_influence(name, device="cpu").fit(model, x, y)
    assert np.array_equal(x, given, equal_nan=True) and _same_state(model, state)


def test_the_finiteness_check_is_one_pass_and_keeps_integer_and_large_inputs():
    from art_malleability.influence.base import check_data

    y = np.zeros(3, dtype=np.int64)
    x = np.full((3, 2), np.finfo(np.float64).max)  # the sum overflows; every value is finite
    assert check_data(x, y, "x", "y")[0] is x  # not copied
    assert check_data(np.ones((3, 2), dtype=np.int32), y, "x", "y")[0].dtype == np.int32
    with pytest.raises(TypeError, match="x must hold real numbers"):
        check_data(np.array([["a"], ["b"], ["c"]]), y, "x", "y")


# ---------------------------------------------------------------------------------------------- 2. a failed save


def _report():
    from test_report import _report as report

    return report()


def test_a_save_refused_for_a_file_of_the_users_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "report.md").write_text("my own notes")
    before = snapshot(folder)
    with pytest.raises(FileExistsError, match="report.md"):
        _report().save(folder)
    assert snapshot(folder) == before and leftovers(folder) == []
    (folder / "report.md").unlink()
    _report().save(folder)
    assert leftovers(folder) == [] and (folder / "report.json").is_file()


# ---------------------------------------------------------------------------------------------- 3. SIGTERM


def _terminated_run(out, args):
    child = subprocess.Popen([sys.executable, "-m", "art_malleability.cli", *args, "--output", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (out.is_dir() and any(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())):
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the run never opened its output folder"
            time.sleep(0.05)
        time.sleep(0.5)  # into the work
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    return child.returncode, err


def test_sigterm_is_handled_like_sigint_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "audit"
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(out)]) == 0
    good = snapshot(out)
    many_epochs = [*TINY[:4], "--epochs", "1000000", *TINY[6:]]
    code, err = _terminated_run(out, ["audit", *many_epochs, "--model", "2l-relu", "--seed", "1"])
    assert code == 143, err
    assert leftovers(out) == [] and snapshot(out) == good
    assert main(["audit", *TINY, "--model", "2l-relu", "--seed", "2", "--output", str(out)]) == 0
    assert leftovers(out) == []


def test_sigterm_landing_where_python_ignores_exceptions_still_ends_the_run(tmp_path):
    # The signal's SystemExit raised inside a __del__ (or a weak reference's callback, as in an import) is ignored
    # by Python; the run must still end, through its clean-up.
    import textwrap

    out = tmp_path / "saved"
    script = textwrap.dedent(f"""
        import signal, time
        from art_malleability._utils.output_folder import OutputFolder
        class Doomed:
            def __del__(self):
                signal.raise_signal(signal.SIGTERM)
        with OutputFolder({str(out)!r}, writer="w") as folder:
            folder.write("a.txt", "staged")
            Doomed()
            for _ in range(600):
                time.sleep(0.1)
        print("not ended", flush=True)
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 143, child.stderr
    assert "Exception ignored" in child.stderr and "not ended" not in child.stdout
    assert not out.exists()


def test_the_folder_restores_the_unraisable_hook(tmp_path):
    before, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    with OutputFolder(tmp_path / "f", writer="w") as folder:
        folder.write("a.txt", "x")
        assert (sys.unraisablehook is not before) == (handler is signal.SIG_DFL)
    assert sys.unraisablehook is before and signal.getsignal(signal.SIGTERM) is handler


def test_sigterm_during_a_save_leaves_nothing_behind(tmp_path):
    import textwrap

    out = tmp_path / "saved"
    script = textwrap.dedent(f"""
        import time
        from art_malleability._utils.output_folder import OutputFolder
        with OutputFolder({str(out)!r}, writer="w") as folder:
            folder.write("a.txt", "staged")
            print("ready", flush=True)
            time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 143
    finally:
        child.kill()
    assert not out.exists()  # the folder the run created, removed with everything in it


# ---------------------------------------------------------------------------------------------- 4. one class


def test_a_single_class_npz_is_refused_at_load_time(tmp_path):
    from art_malleability.data import load_dataset

    x = np.random.default_rng(0).random((20, 4)).astype(np.float32)
    np.savez(tmp_path / "single.npz", x=x, y=np.full(20, 3))
    with pytest.raises(ValueError, match=r"name_or_path must hold labels of at least two classes in y, got a "
                                         r"single class \(3\)"):
        load_dataset(tmp_path / "single.npz", n_train=10, n_test=10)


@pytest.mark.parametrize(("arrays", "words"), [
    ({"y": np.full(40, 3)}, "single class (3)"),
    ({}, "--dataset must hold arrays 'x' and 'y', got ['x']"),
    ({"y": np.arange(40) % 3, "nan": True}, "--dataset must hold finite values in x, got 1 NaN or infinite"),
])
def test_the_command_line_refuses_a_dataset_it_cannot_use_with_status_2(tmp_path, capsys, arrays, words):
    # documented: a --dataset that cannot be used is status 2; a new user got 1 for each of these
    x = np.random.default_rng(0).random((40, 4)).astype(np.float32)
    if arrays.pop("nan", False):
        x[0, 0] = np.nan
    np.savez(tmp_path / "data.npz", x=x, **arrays)
    out = tmp_path / "audit"
    code = main(["audit", *TINY, "--model", "2l-relu", "--dataset", str(tmp_path / "data.npz"), "--n-train", "20",
                 "--n-test", "10", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or leftovers(out) == []


def test_a_weights_file_that_is_no_state_dict_and_a_one_example_spectrum_are_status_2(tmp_path, capsys):
    import torch

    torch.save({"a": 1}, tmp_path / "w.pt")
    code = main(["audit", *TINY, "--model", "2l-relu", "--weights", str(tmp_path / "w.pt"),
                 "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--weights must hold a state_dict (parameter names to tensors)" in err
    assert "'a' is of type int" in err and not (tmp_path / "o").exists()
    code = main(["spectrum", "--n-train", "1", "--output", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2 and "--n-train must be at least 2" in err and not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------- 5. the report


def test_the_undecided_warning_is_said_once_naming_the_attacks(monkeypatch):
    from helpers import digits, trained_classifier

    import art_malleability.audit._run as run
    from art_malleability import MalleabilityEstimator

    monkeypatch.setattr(run, "UNDECIDED_WARNING", -1.0)  # every attack above the threshold
    clf, data = trained_classifier("2l-relu", epochs=20), digits(60, 20)
    report = MalleabilityEstimator(clf, attacks=["fgsm", "pgd"], n_queries=10, n_bootstrap=10, verbose=False,
                                   controls=False).evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    undecided = [w for w in report.warnings if "standard error of zero" in w]
    assert len(undecided) == 1, report.warnings
    assert "fgsm" in undecided[0] and "pgd" in undecided[0]
    for r in report.results:
        assert f"{r.attack} {100 * r.undecided_share:.0f}%" in undecided[0]
    assert report.to_markdown().count("standard error of zero") == 1


def test_the_undecided_warning_calls_an_interval_wide_only_where_it_is():
    # a new user's SmallCNN: the warning said "its interval is wide" of [0.0, 2.9] %; the table and the warning now
    # share one rule, and a narrow interval with many undecidable signs is read at its upper end
    from art_malleability.audit.report import UNDECIDED_WIDTH, undecided, undecided_warning

    text = undecided_warning({"fgsm": (0.6, (0.0, 0.029)), "pgd": (0.7, (0.0, UNDECIDED_WIDTH + 0.1)),
                              "mim": (0.5, (float("nan"), float("nan")))})
    assert "fgsm 60%, pgd 70%, mim 50%" in text
    assert "its interval is wide or absent (pgd, mim)" in text
    assert "its low end can stand above the truth, so only its upper end is read (fgsm [0.0, 2.9]%)" in text
    only_narrow = undecided_warning({"fgsm": (0.6, (0.0, 0.029))})
    assert "wide" not in only_narrow and "fgsm [0.0, 2.9]%" in only_narrow
    assert undecided(0.01, [0.0, 0.029], 0.6) and not undecided(0.01, [0.0, 0.029], 0.1)
    assert not undecided(0.01, [0.0, 0.029]) and undecided(0.1, [0.0, UNDECIDED_WIDTH + 0.01], 0.0)


def test_the_figure_draws_no_bar_for_a_noise_aware_rate_the_table_reads_undecided():
    # a new user's flip_rates.png drew noise-aware bars of 19 %, 7 % and 17 % where the table said "undecided"
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.colors import to_rgba

    report = _report()
    wide, narrow = report.results
    wide.flip_rate_above_floor, wide.flip_rate_above_floor_ci = 0.19, [0.0, 0.5]
    narrow.flip_rate_above_floor, narrow.flip_rate_above_floor_ci = 0.05, [0.02, 0.08]
    ax = report.plot_flip_rates().axes[0]
    orange = to_rgba("tab:orange")
    filled = [p for p in ax.patches if p.get_fill() and p.get_facecolor()[:3] == orange[:3]]
    hatched = [p for p in ax.patches if not p.get_fill() and p.get_hatch()]
    assert [round(p.get_height(), 6) for p in filled] == [5.0]  # the decided one only
    assert len(hatched) == 1 and hatched[0].get_y() == 0.0 and round(hatched[0].get_height(), 6) == 50.0
    assert "undecided [0.0, 50.0]" in report.to_markdown()
    # every noise-aware rate undecided: the legend names the hatched intervals only, not an empty series of bars
    narrow.flip_rate_above_floor_ci = [0.0, 0.5]
    labels = report.plot_flip_rates().axes[0].get_legend_handles_labels()[1]
    assert "noise-aware: undecided (its interval)" in labels and "noise-aware" not in labels


def test_the_scatters_scale_sits_in_its_labels_not_over_them():
    # a new user's scatter: the x label overlapped the axis's offset text ("1e-5")
    import matplotlib

    matplotlib.use("Agg")
    report = _report()
    report.scores_before = [1e-5 * v for v in report.scores_before]
    report.results[0].scores_after = [1e-5 * v for v in report.results[0].scores_after]
    ax = report.plot_influence_scatter("fgsm").axes[0]
    for axis in (ax.xaxis, ax.yaxis):
        assert not axis.get_offset_text().get_visible() and "1e" in axis.get_label_text(), axis.get_label_text()
    plain = _report().plot_influence_scatter("fgsm").axes[0]  # unit scores: no scale, labels as they are
    assert plain.xaxis.get_label_text() == "influence before (positive = helpful)"


def test_a_narrow_noise_aware_interval_over_many_undecidable_signs_reads_undecided():
    import matplotlib

    matplotlib.use("Agg")
    from art_malleability.audit.report import UNDECIDED_SHARE_LIMIT

    report = _report()
    many, few = report.results
    many.flip_rate_above_floor, many.flip_rate_above_floor_ci = 0.08, [0.04, 0.12]
    many.undecided_share = UNDECIDED_SHARE_LIMIT + 0.05
    few.flip_rate_above_floor, few.flip_rate_above_floor_ci = 0.08, [0.04, 0.12]
    few.undecided_share = UNDECIDED_SHARE_LIMIT - 0.05
    markdown = report.to_markdown()
    assert markdown.count("undecided [4.0, 12.0]") == 1 and "8.0% [4.0, 12.0]" in markdown
    assert f"more than {100 * UNDECIDED_SHARE_LIMIT:.0f} % undecidable signs" in markdown  # the legend's rule
    ax = report.plot_flip_rates().axes[0]
    assert len([p for p in ax.patches if not p.get_fill() and p.get_hatch()]) == 1


def test_a_noise_aware_cell_with_a_wide_interval_reads_undecided():
    from art_malleability.audit.report import UNDECIDED_WIDTH

    report = _report()
    wide, narrow = report.results
    wide.flip_rate_above_floor, wide.flip_rate_above_floor_ci = 0.003, [0.0, 0.5]
    narrow.flip_rate_above_floor, narrow.flip_rate_above_floor_ci = 0.05, [0.0, UNDECIDED_WIDTH]
    markdown, summary = report.to_markdown(), report.summary()
    for text in (markdown, summary):
        assert "undecided [0.0, 50.0]" in text and "0.3% [0.0, 50.0]" not in text
        assert f"5.0% [0.0, {100 * UNDECIDED_WIDTH:.1f}]" in text  # at the width itself: a number
    assert f"wider than {100 * UNDECIDED_WIDTH:.0f} percentage points" in markdown  # the legend states the rule


# ---------------------------------------------------------------------------------------------- 6. progress bars


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _lines(text):
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


@pytest.mark.parametrize("refresh", ["update", "postfix"])
def test_a_progress_bar_off_a_terminal_writes_a_line_now_and_then(monkeypatch, refresh):
    from art_malleability._utils.io import progress_bar

    monkeypatch.setattr(sys, "stderr", _Terminal())  # the bar's own stream decides, not stderr
    log = io.StringIO()
    bar = progress_bar(total=2000, desc="training", file=log)
    for i in range(2000):
        if refresh == "postfix":
            bar.set_postfix_str(f"step {i}")  # a forced redraw, as ntk-check's
        bar.update()
        time.sleep(0.0002)
    bar.close()
    lines = _lines(log.getvalue())
    assert 1 <= len(lines) <= 3, lines  # the start and the end
    assert "2000/2000" in lines[-1]


def test_a_progress_bar_that_is_off_writes_nothing_whatever_it_is_asked():
    from art_malleability._utils.io import progress_bar

    log = io.StringIO()
    bar = progress_bar(total=3, verbose=False, file=log)
    bar.set_postfix_str("step")
    bar.update()
    bar.close()
    assert log.getvalue() == ""


def test_a_progress_bar_on_a_terminal_redraws_as_before():
    from art_malleability._utils.io import progress_bar

    screen = _Terminal()
    bar = progress_bar(total=300, desc="training", file=screen)
    assert bar.mininterval == 0.1
    for i in range(300):
        bar.set_postfix_str(f"step {i}")
        bar.update()
    bar.close()
    assert len(_lines(screen.getvalue())) > 100
