"""
Benchmark: an audit killed at random moments and resumed from its work folder.

The command line's audit of one model on ``--n-train`` MNIST images (the test split, written once into an ``.npz``)
with the default queries (every held-out point of ``--n-test``) runs three ways in the same run:

1. uninterrupted without a work folder (``--no-work-dir``): the reference report and time;
2. uninterrupted with a fresh work folder: its time (the folder's own cost) and when each stage was written, the
   timeline of the stages;
3. ``--kills`` times: with a fresh work folder, killed (SIGKILL) at a uniformly random moment of that time, then the
   same command rerun to the end.

For each kill it prints the moment, the stages kept, the resumed run's time, the *unfinished work* (the uninterrupted
run's time after the last stage the killed run had kept, by the timeline of 2.), their ratio (the issue's target:
at most 1.1), and whether the resumed report equals the uninterrupted one number for number (every result and the
clean scores; the timings and the work folder's own record aside). The clean influence fit is not kept: a resumed run
fits it again, which the ratio counts against it.

    python benchmarks/bench_resume.py                         # 2,000 images, 10 kills: about 20 min on 2 cores
    python benchmarks/bench_resume.py --n-train 500 --kills 3 # a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import REPO_ROOT, table, thread_env

MNIST = REPO_ROOT.parent / "shared" / "data" / "mnist"


def mnist_npz(folder: Path, root: Path) -> Path:
    """The MNIST test split as an ``.npz`` of ``x`` (uint8, n × 28 × 28) and ``y``."""
    import gzip

    with gzip.open(root / "t10k-images-idx3-ubyte.gz") as images, gzip.open(root / "t10k-labels-idx1-ubyte.gz") as lab:
        x = np.frombuffer(images.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
        y = np.frombuffer(lab.read(), dtype=np.uint8, offset=8).astype(np.int64)
    path = folder / "mnist.npz"
    np.savez(path, x=x, y=y)
    return path


def run(command: list[str], where: Path, env: dict, kill_after: float | None = None) -> tuple[float, int]:
    """Run ``command`` in ``where``; with ``kill_after``, SIGKILL it then. :return: (seconds, exit status)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=where, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    seconds = time.perf_counter() - start
    if kill_after is None and proc.returncode != 0:
        raise RuntimeError(f"the audit failed ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
    return seconds, proc.returncode


def numbers(report: Path) -> dict:
    """What a resumed report must repeat: every result but its timings, the clean scores and the influential set."""
    data = json.loads(report.read_text())
    return {"results": [{k: v for k, v in r.items() if k != "seconds"} for r in data["results"]],
            "scores_before": data["scores_before"], "top": data["top_indices"], "accuracy": data["clean_accuracy"]}


def stages(work: Path) -> list[dict]:
    """The stage records of a work folder, with their file names."""
    found = []
    for record in work.rglob("*.json"):
        data = json.loads(record.read_text())
        if data.get("format") == "art-malleability stage":
            found.append({"stage": data["stage"], "file": record.name, "written": data["written"]})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--model", default="2l-relu")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mnist", type=Path, default=MNIST, help="folder of the gzipped MNIST test split")
    args = parser.parse_args()
    env = {**os.environ, **thread_env(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env["HOME"] = str(tmp)
        data = mnist_npz(tmp, args.mnist)
        base = [sys.executable, "-m", "art_malleability.cli", "audit", "--dataset", str(data), "--n-train",
                str(args.n_train), "--model", args.model, "--quiet"]
        plain, _ = run([*base, "--output", "plain", "--no-work-dir"], tmp, env)
        reference = numbers(tmp / "plain" / args.model / "report.json")
        start = time.time()
        kept_run, _ = run([*base, "--output", "kept", "--work-dir", "kept.work"], tmp, env)
        timeline = {s["file"]: s["written"] - start for s in stages(tmp / "kept.work")}
        same_kept = numbers(tmp / "kept" / args.model / "report.json") == reference
        print(f"uninterrupted: {plain:.1f} s without a work folder, {kept_run:.1f} s with one "
              f"({len(timeline)} stages; report the same: {same_kept})", flush=True)
        rng = np.random.default_rng(args.seed)
        rows = []
        for trial in range(args.kills):
            out, work = f"killed{trial}", f"killed{trial}.work"
            moment = float(rng.uniform(0.02, 0.98) * kept_run)
            _, status = run([*base, "--output", out, "--work-dir", work], tmp, env, kill_after=moment)
            kept = stages(tmp / work) if (tmp / work).exists() else []
            done = max((timeline.get(s["file"], 0.0) for s in kept), default=0.0)
            unfinished = kept_run - done
            resumed, _ = run([*base, "--output", out, "--work-dir", work], tmp, env)
            same = numbers(tmp / out / args.model / "report.json") == reference
            counts = {k: sum(s["stage"] == k for s in kept) for k in ("weights", "attack", "pass")}
            rows.append([trial, f"{moment:.1f}", "killed" if status == -signal.SIGKILL else f"ended ({status})",
                         f"{counts['weights']}/{counts['attack']}/{counts['pass']}", f"{resumed:.1f}",
                         f"{unfinished:.1f}", f"{resumed / unfinished:.2f}", same])
            print(rows[-1], flush=True)
        print(table(["kill", "at (s)", "status", "kept weights/attack/pass", "resumed (s)", "unfinished (s)", "ratio",
                     "same report"], rows))
        ratios = [float(r[6]) for r in rows]
        print(f"resumed / unfinished: median {np.median(ratios):.2f}, max {max(ratios):.2f} (target <= 1.1); "
              f"every report the same: {all(r[7] for r in rows)}")


if __name__ == "__main__":
    main()
