"""Sharded audits on torch.distributed: two gloo processes launched by torchrun on localhost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from art_malleability._utils.work_folder import WorkFolder
from art_malleability.distributed import ONE_PROCESS, Shard, current_shard

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_TIMEOUT = 240


def _torchrun(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env, cwd=cwd)


def _read(folder: Path) -> tuple[dict, np.ndarray]:
    return json.loads((folder / "report.json").read_text()), np.load(folder / "scores.npy")


def _close(a, b, tol=1e-8) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / np.abs(b).max()) < tol


# projected: primal solve (n > k) and dual solve (n <= k); exact: tiles dealt out over the processes, both losses
@pytest.mark.parametrize("mode", ["ok", "dual", "exact", "exact-ce"])
def test_two_gloo_processes_give_the_single_process_report(tmp_path, mode):
    sys.path.insert(0, str(WORKER.parent))
    try:
        from dist_worker import run
    finally:
        sys.path.pop(0)
    run(str(tmp_path / "one"), mode)
    done = _torchrun(str(WORKER), str(tmp_path / "two"), mode)
    assert done.returncode == 0, done.stderr[-3000:]
    one, scores_one = _read(tmp_path / "one")
    two, scores_two = _read(tmp_path / "two")
    assert _close(scores_two, scores_one)
    assert _close(np.load(tmp_path / "two" / "refitted.npy"), np.load(tmp_path / "one" / "refitted.npy"))
    assert _close(np.load(tmp_path / "two" / "self.npy"), np.load(tmp_path / "one" / "self.npy"))
    assert two["top_indices"] == one["top_indices"]
    assert _close(two["scores_before"], one["scores_before"])
    for a, b in zip(two["results"], one["results"], strict=True):
        assert a["flip_rate"] == b["flip_rate"] and a["attack_success"] == b["attack_success"]
        assert a["top_k_jaccard"] == b["top_k_jaccard"]
        assert _close(a["scores_after"], b["scores_after"])
        assert a["max_perturbation"] == pytest.approx(b["max_perturbation"], abs=1e-7)
    assert two["execution"]["world_size"] == 2 and two["execution"]["backend"] == "gloo"
    expected = "exact" if mode.startswith("exact") else "projected"
    assert one["execution"]["world_size"] == 1 and one["execution"]["mode"] == expected
    assert two["execution"]["mode"] == expected  # "auto" picks the same estimator in one process and in two
    if mode.startswith("exact"):
        tiles_one, tiles_two = np.load(tmp_path / "one" / "tiles.npz"), np.load(tmp_path / "two" / "tiles.npz")
        for name in tiles_one.files:
            if name.endswith("_left"):
                assert int(tiles_two[name]) == 0 and int(tiles_one[name]) == 0  # the tiles' folders are removed
            elif name.endswith("_asked"):  # a row update's kernel columns: all in one process, a share in two
                assert int(tiles_one[name]) == 45 and int(tiles_two[name]) < 30
            else:
                assert _close(tiles_two[name], tiles_one[name], 1e-10), name


def test_a_sharded_audit_killed_in_one_process_resumes_every_process_from_the_work_folder(tmp_path):
    # rank 1 dies in the second attack's refit; rerun, each process reuses its own attacked rows and rank 0 the
    # finished passes, and the report is the one of an uninterrupted two-process run
    died = _torchrun(str(WORKER), str(tmp_path), "work-die")
    assert died.returncode != 0 and not (tmp_path / "report.json").exists()
    stages = [s["stage"] for s in WorkFolder(tmp_path / "work").stages()]
    assert stages.count("pass") == 3  # two control draws and FGSM's
    assert stages.count("attack") == 4  # FGSM's and PGD's rows, each process its own
    done = _torchrun(str(WORKER), str(tmp_path), "work")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads((tmp_path / "report.json").read_text())
    # rank 0's: the passes of the controls and FGSM (not attacked again), PGD's attacked rows
    assert resumed["execution"]["work_folder"]["reused"] == {"passes": 3, "attack chunks": 1}
    whole = tmp_path / "whole"
    whole.mkdir()
    done = _torchrun(str(WORKER), str(whole), "work-none")
    assert done.returncode == 0, done.stderr[-3000:]
    uninterrupted = json.loads((whole / "report.json").read_text())

    def numbers(report):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in report["results"]]

    assert numbers(resumed) == numbers(uninterrupted)
    assert resumed["scores_before"] == uninterrupted["scores_before"]


def test_a_dying_process_ends_the_job_with_its_error(tmp_path):
    start = time.perf_counter()
    done = _torchrun(str(WORKER), str(tmp_path), "die")
    assert done.returncode != 0
    assert time.perf_counter() - start < 120
    assert "exitcode  : 7" in done.stderr and "FAILED" in done.stderr


def test_a_process_that_stops_answering_times_out(tmp_path):
    start = time.perf_counter()
    done = _torchrun(str(WORKER), str(tmp_path), "hang")
    assert done.returncode != 0
    assert time.perf_counter() - start < 150
    assert "timed out" in done.stderr.lower() or "timeout" in done.stderr.lower()


def test_a_rank_that_stops_answering_gets_the_documented_message_from_the_cli(tmp_path):
    """gloo's own timeout is a plain RuntimeError ("Timed out waiting 5000ms ..."): the CLI names it."""
    start = time.perf_counter()
    done = _torchrun(
        "-m", "art_malleability.cli", "audit", "--model", "cli_factory:hangs_on_rank_1", "--n-train", "60",
        "--n-test", "20", "--epochs", "2", "--n-queries", "5", "--attacks", "fgsm", "--dist-timeout", "5", "--quiet",
        "--output", str(tmp_path / "o"), cwd=WORKER.parent,
    )
    assert done.returncode != 0 and time.perf_counter() - start < 150
    expected = ("art-malleability audit (rank 0): error: another process failed or stopped answering within "
                "--dist-timeout (5 s) (RuntimeError: Timed out waiting 5000ms for")
    assert expected in done.stderr, done.stderr[-3000:]
    assert "unbound_buffer.cc" not in done.stderr and not (tmp_path / "o").exists()


def test_an_influence_estimator_that_does_not_shard_is_refused(tmp_path):
    done = _torchrun(str(WORKER), str(tmp_path), "userinf")
    assert done.returncode != 0
    assert "did not shard over the process group" in done.stderr


def test_more_processes_than_training_examples_is_refused(tmp_path):
    done = _torchrun(str(WORKER), str(tmp_path), "tiny")
    assert done.returncode != 0
    assert "x must hold at least one example per process, got 1 examples for the 2 processes" in done.stderr


def test_cli_under_torchrun_writes_the_single_process_report(tmp_path):
    args = [
        "audit", "--model", "cnn", "--n-train", "150", "--n-test", "40", "--epochs", "5", "--n-queries", "10",
        "--n-bootstrap", "30", "--attack-max-iter", "4", "--projection-dim", "64",
    ]
    single = subprocess.run(
        [sys.executable, "-m", "art_malleability.cli", *args, "--output", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert single.returncode == 0, single.stderr[-3000:]
    done = _torchrun("-m", "art_malleability.cli", *args, "--output", str(tmp_path / "two"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("reports in") == 1  # rank 0 alone prints and writes
    one = json.loads((tmp_path / "one" / "cnn" / "report.json").read_text())
    two = json.loads((tmp_path / "two" / "cnn" / "report.json").read_text())
    assert _close(two["scores_before"], one["scores_before"])
    assert [r["flip_rate"] for r in two["results"]] == [r["flip_rate"] for r in one["results"]]
    assert two["execution"]["world_size"] == 2


def test_shard_bounds_cover_the_training_set_and_single_process_is_not_sharded():
    for world in (1, 2, 3, 7):
        blocks = [Shard(rank, world, "gloo").bounds(20) for rank in range(world)]
        assert blocks[0][0] == 0 and blocks[-1][1] == 20
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert max(b - a for a, b in blocks) - min(b - a for a, b in blocks) <= 1
    assert current_shard("auto") == ONE_PROCESS and current_shard(False) == ONE_PROCESS
    assert (ONE_PROCESS.rank, ONE_PROCESS.world_size, ONE_PROCESS.bounds(20)) == (0, 1, (0, 20))
    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        current_shard(True)
    with pytest.raises(ValueError, match="distributed must be"):
        current_shard("yes")


def test_the_group_of_one_process_has_identity_collectives():
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    assert ONE_PROCESS.all_reduce(t) is t and ONE_PROCESS.all_reduce(t, "max") is t
    assert ONE_PROCESS.all_gather_rows(t) is t and ONE_PROCESS.all_gather_columns(t) is t
    assert ONE_PROCESS.broadcast(t, (2, 3), torch.float64, 0) is t
    payload = {"a": [1, 2]}
    assert ONE_PROCESS.broadcast_object(payload) is payload
    ONE_PROCESS.agree(object(), "anything")  # nothing to disagree with
    ONE_PROCESS.raise_if_any(None)
    with pytest.raises(KeyError, match="own"):
        ONE_PROCESS.raise_if_any(KeyError("own"))
    assert torch.equal(t, torch.arange(6, dtype=torch.float64).reshape(2, 3))


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for "
                      "recv operation to complete"), "Timed out waiting 5000ms for recv operation to complete"),
        (RuntimeError("[../gloo/transport/tcp/pair.h:311] Connect timeout [none]"), "Connect timeout [none]"),
        (RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer"), "Read error [127.0.0.1]:5: Connection "
         "reset by peer"),
        (RuntimeError("wait timeout after 5000ms, keys: /default_pg/0//cpu//0/1"), "wait timeout after 5000ms, keys: "
         "/default_pg/0//cpu//0/1"),
        (RuntimeError("CUDA out of memory"), None),
        (ValueError("Timed out waiting 5000ms"), None),
    ],
)
def test_what_gloo_and_the_store_say_of_a_lost_peer_is_recognised(error, expected):
    from art_malleability.distributed import peer_failure

    assert peer_failure(error) == expected
    wrapped = ValueError("while auditing")
    wrapped.__cause__ = error
    assert peer_failure(wrapped) == expected
