"""Report folders: the tool writes only what it staged, replaces only what it wrote, and never two runs at once."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import TINY_AUDIT as TINY
from helpers import folder_snapshot as snapshot

from art_malleability._utils.output_folder import (
    LOCK_NAME,
    MANIFEST_NAME,
    OutputFolder,
    OutputFolderBusy,
    OutputFolderConflict,
    is_ours,
)
from art_malleability.cli import main

# ---------------------------------------------------------------------------------------------- the CLI's --output


def test_a_folder_holding_a_report_json_that_is_not_ours_is_left_alone(tmp_path, monkeypatch):
    """Issue: any subfolder holding a report.json was removed, with the user's source files."""
    project = tmp_path / "proj"
    (project / "webapp" / "src").mkdir(parents=True)
    (project / "webapp" / "src" / "main.py").write_text("1\n")
    (project / "webapp" / "report.json").write_text("{}")
    before = snapshot(project)
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(project)]) == 0
    after = snapshot(project)
    assert {k: v for k, v in after.items() if k in before} == before
    assert (project / "2l-relu" / "report.json").is_file() and (project / "summary.md").is_file()
    # the working folder as --output: the same
    monkeypatch.chdir(project / "webapp")
    before = snapshot(".")
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", "."]) == 0
    assert {k: v for k, v in snapshot(".").items() if k in before} == before


def test_a_failed_rerun_leaves_the_previous_report_exactly_as_it_was(tmp_path):
    out = tmp_path / "audit"
    assert main(["audit", *TINY, "--output", str(out)]) == 0  # both reference models
    good = snapshot(out)
    assert {"summary.md", "2l-relu/report.json", "mlp-attn/report.json"} <= set(good)
    code = main(["audit", *TINY, "--model", "2l-relu", "--model", "cli_factory:broken", "--output", str(out)])
    assert code == 1
    assert snapshot(out) == good  # no staging folder, no lock, nothing replaced or removed


def test_an_interrupted_run_leaves_the_previous_report(tmp_path, monkeypatch):
    import art_malleability.audit.report as report

    out = tmp_path / "audit"
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(out)]) == 0
    good = snapshot(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "comparison_table", interrupted)  # after the models are audited and staged
    assert main(["audit", *TINY, "--model", "2l-relu", "--seed", "1", "--output", str(out)]) == 130
    assert snapshot(out) == good


def test_a_rerun_removes_what_the_last_run_wrote_and_only_that(tmp_path):
    out = tmp_path / "audit"
    assert main(["audit", *TINY, "--output", str(out)]) == 0
    (out / "notes.md").write_text("mine")
    (out / "mlp-attn" / "my-plot.png").write_bytes(b"mine")  # a file of the user's in a folder the run made
    (out / "mlp-attn" / "report.md").write_text("edited by hand")  # a file the run wrote, changed since
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(out)]) == 0
    files = snapshot(out)
    assert files["notes.md"] == b"mine" and files["mlp-attn/my-plot.png"] == b"mine"
    assert files["mlp-attn/report.md"] == b"edited by hand"
    assert "mlp-attn/report.json" not in files and "mlp-attn/flip_rates.png" not in files
    assert "| 2l-relu |" in files["summary.md"].decode() and "mlp-attn" not in files["summary.md"].decode()
    manifest = json.loads(files[MANIFEST_NAME])
    assert "mlp-attn/report.md" not in manifest["files"] and "2l-relu/report.json" in manifest["files"]


def test_a_file_of_a_report_name_that_is_not_ours_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import art_malleability.cli.audit as cli_audit

    def never(args):
        raise AssertionError("data read although the output folder cannot be used")

    monkeypatch.setattr(cli_audit, "load_data", never)
    out = tmp_path / "audit"
    out.mkdir()
    (out / "summary.md").write_text("my own summary")
    assert main(["audit", *TINY, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--output must not hold files of the same name that this package did not write" in err
    assert "summary.md" in err and len(err.strip().splitlines()) == 1
    assert snapshot(out) == {"summary.md": b"my own summary"}


def _hold_lock(folder, ready, release):
    with OutputFolder(folder, writer="audit", description="art-malleability audit"):
        ready.set()
        release.wait(60)


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, capsys):
    out = tmp_path / "audit"
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(out, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        assert main(["audit", *TINY, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--output must not be a folder another run is writing to" in err
        assert f"process {holder.pid}" in err and "art-malleability audit" in err
    finally:
        release.set()
        holder.join(30)
    assert holder.exitcode == 0
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(out)]) == 0  # released: runs
    assert not (out / LOCK_NAME).exists()


def test_a_stale_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    out = tmp_path / "audit"
    script = textwrap.dedent(f"""
        import time
        from art_malleability._utils.output_folder import OutputFolder
        folder = OutputFolder({str(out)!r}, writer="audit")
        folder.open()
        folder.write("summary.md", "half-done")
        print("ready", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)  # no cleanup at all: the lock file and the staging folder stay
        child.wait(30)
    finally:
        child.kill()
    assert (out / LOCK_NAME).exists() and any(p.name.startswith(".art-malleability-staging-") for p in out.iterdir())
    assert main(["audit", *TINY, "--model", "2l-relu", "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "2l-relu", "summary.md"]
    assert "half-done" not in (out / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------- the folder itself


def test_nothing_is_visible_before_the_run_succeeds(tmp_path):
    with OutputFolder(tmp_path / "o", writer="w") as out:
        out.write("a/b.txt", "x")
        assert not (tmp_path / "o" / "a").exists()
    assert (tmp_path / "o" / "a" / "b.txt").read_text() == "x"
    with pytest.raises(ValueError, match="relpath must be a relative path inside"):
        with OutputFolder(tmp_path / "o", writer="w") as out:
            out.write("../escape.txt", "x")
    assert not (tmp_path / "escape.txt").exists()
    assert (tmp_path / "o" / "a" / "b.txt").read_text() == "x"  # the failed run changed nothing


def test_a_folder_the_run_created_is_removed_when_the_run_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with OutputFolder(tmp_path / "new" / "deeper", writer="w") as out:
            out.write("x.txt", "x")
            raise RuntimeError("fails")
    assert not (tmp_path / "new" / "deeper").exists()


def test_a_conflict_at_commit_keeps_the_staged_files_and_changes_nothing(tmp_path):
    out = OutputFolder(tmp_path, writer="w")
    out.open()
    out.write("result.txt", "new")
    (tmp_path / "result.txt").write_text("the user's")  # appears while the run works
    with pytest.raises(OutputFolderConflict, match="this run's files are kept in"):
        out.close(success=True)
    assert (tmp_path / "result.txt").read_text() == "the user's"
    staged = [p for p in tmp_path.iterdir() if p.name.startswith(".art-malleability-staging-")]
    assert len(staged) == 1 and (staged[0] / "result.txt").read_text() == "new"
    assert not (tmp_path / LOCK_NAME).exists()


def test_an_interrupted_commit_never_costs_a_file_that_is_not_ours(tmp_path, monkeypatch):
    import art_malleability._utils.output_folder as module

    with OutputFolder(tmp_path, writer="w") as out:
        out.write_all({"a.txt": "a1", "b.txt": "b1"})
    (tmp_path / "mine.txt").write_text("mine")
    real = module.os.replace
    count = {"n": 0}

    def stop_after_two(src, dst):  # the journal, then one file: stop in the middle of the commit
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(module.os, "replace", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        with OutputFolder(tmp_path, writer="w") as out:
            out.write_all({"a.txt": "a2", "c.txt": "c2"})
    monkeypatch.setattr(module.os, "replace", real)
    assert (tmp_path / "a.txt").read_text() == "a2" and is_ours(tmp_path / "a.txt")  # journalled before the rename
    with OutputFolder(tmp_path, writer="w") as out:  # the next run finishes the job
        out.write("d.txt", "d3")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["d.txt", "mine.txt"]


def test_other_writers_files_stay_and_ancestors_manifests_count(tmp_path):
    with OutputFolder(tmp_path, writer="audit") as out:
        out.write("m/report.json", "{}")
    with OutputFolder(tmp_path, writer="validate") as out:
        out.write("v/validation.json", "{}")
    assert (tmp_path / "m" / "report.json").exists()  # another writer's file is not stale for validate
    assert is_ours(tmp_path / "m" / "report.json")
    with OutputFolder(tmp_path / "m", writer="MalleabilityReport") as out:  # a save into a subfolder of a run
        out.write("report.json", '{"new": 1}')
    assert (tmp_path / "m" / "report.json").read_text() == '{"new": 1}'


def test_a_corrupt_manifest_is_refused_not_overwritten(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("not json")
    with pytest.raises(OutputFolderConflict, match="must hold a manifest this package can read"):
        with OutputFolder(tmp_path, writer="w") as out:
            out.write("a.txt", "a")
    assert (tmp_path / MANIFEST_NAME).read_text() == "not json" and not (tmp_path / "a.txt").exists()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_same_process_cannot_open_a_folder_twice(tmp_path):
    with OutputFolder(tmp_path, writer="w"):
        with pytest.raises(OutputFolderBusy, match=f"process {os.getpid()}"):
            OutputFolder(tmp_path, writer="w").open()


def test_an_interrupt_during_the_commit_waits_for_it(tmp_path, monkeypatch):
    import art_malleability._utils.output_folder as module

    real = module.os.replace

    def interrupting(src, dst):
        os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the renames
        time.sleep(0.01)
        return real(src, dst)

    monkeypatch.setattr(module.os, "replace", interrupting)
    # Python's own SIGINT handler, also where the test runner was started with SIGINT ignored (a background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with OutputFolder(tmp_path, writer="w") as out:
                out.write_all({"a.txt": "a", "b.txt": "b"})
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.setattr(module.os, "replace", real)
    assert (tmp_path / "a.txt").read_text() == "a" and (tmp_path / "b.txt").read_text() == "b"  # all of it
    assert is_ours(tmp_path / "a.txt") and is_ours(tmp_path / "b.txt")


def test_a_link_to_another_folder_is_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "2l-relu").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OutputFolderConflict, match="2l-relu"):
        with OutputFolder(out, writer="audit") as folder:
            folder.claim(["2l-relu"])
    with pytest.raises(OutputFolderConflict, match="this run's files are kept in"):
        with OutputFolder(out, writer="audit") as folder:
            folder.write("2l-relu/report.json", "{}")
    assert list(elsewhere.iterdir()) == []
