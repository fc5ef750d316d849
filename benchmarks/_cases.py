"""
What the MNIST influence benchmarks (``bench_estimators.py``, ``bench_audit_scale.py``, ``bench_throughput.py``)
share: the MNIST-shaped training sets and their models, the load of other processes during a case, and the command
line and driver of a benchmark made of parts.

Every heavy case runs in its own subprocess (``python benchmarks/_cases.py SPEC.json`` runs the case the spec
names), so that its peak resident set size (``ru_maxrss`` of that process, reported by the process itself) is
measured separately; ratios are taken between numbers measured in the same run. Scratch files (trained weights,
scores, logs of every case) go to ``--workdir`` (default ``$TMPDIR/bench_influence``); every subprocess has a
timeout (``--timeout``); a case that fails or times out is reported with its error and the others still run. MNIST
IDX files are read from ``--mnist-root`` (default ``../shared/data/mnist`` relative to the repository root).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import REPO_ROOT, accuracy, fmt, library_state, peak_rss_bytes, set_threads, thread_env, to_json

DEFAULT_MNIST_ROOT = REPO_ROOT.parent / "shared" / "data" / "mnist"
INPUT_SHAPE = (1, 28, 28)
NB_CLASSES = 10
MODELS = ("2l-relu", "cnn")
#: Models a benchmark may offer beside ``MODELS`` (``common_parser(models=...)``): the attention reference model.
ATTENTION_MODEL = "mlp-attn"


# ================================================================================================ other processes' load
def cpu_seconds_of_others(exclude: set[int] | None = None) -> dict[int, float]:
    """CPU seconds (user + system) used so far by every process but this one and ``exclude``."""
    import psutil

    skip = {os.getpid(), *(exclude or ())}
    out = {}
    for proc in psutil.process_iter(["pid", "cpu_times"]):
        times = proc.info["cpu_times"]
        if proc.info["pid"] not in skip and times is not None:
            out[proc.info["pid"]] = times.user + times.system
    return out


def background_cores(before: dict[int, float], after: dict[int, float], seconds: float) -> float:
    """Average number of cores other processes kept busy between two snapshots."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items()) / max(seconds, 1e-9)


class LoadTracker:
    """
    CPU time of the processes outside a case (not this process, not the case's process tree), sampled every
    few seconds while the case runs, so that short-lived neighbours are counted too.
    """

    def __init__(self, root: int) -> None:
        self.root = root
        self.excluded: set[int] = {root}
        self.last = cpu_seconds_of_others(self.excluded)
        self.total = 0.0

    def sample(self) -> None:
        import psutil

        try:
            self.excluded.update(c.pid for c in psutil.Process(self.root).children(recursive=True))
        except psutil.Error:
            pass
        now = cpu_seconds_of_others(self.excluded)
        self.total += sum(max(t - self.last.get(pid, 0.0), 0.0) for pid, t in now.items())
        self.last = now


def wait_for_idle(max_wait: float, threshold: float = 0.15, window: float = 3.0) -> float:
    """
    Wait (at most ``max_wait`` seconds) until other processes use less than ``threshold`` cores over a
    ``window``-second sample; return the last sampled background load.
    """
    deadline = time.monotonic() + max_wait
    warned = False
    while True:
        before = cpu_seconds_of_others()
        time.sleep(window)
        load = background_cores(before, cpu_seconds_of_others(), window)
        if load < threshold or time.monotonic() >= deadline:
            return load
        if not warned:
            print(f"  (waiting for the machine to be idle: other processes use {load:.2f} cores)", flush=True)
            warned = True


# ================================================================================================ data and models
@dataclass
class MnistSet:
    """A training set, its queries (``None``: drawn from the training pool) and the images behind it."""

    x: np.ndarray
    y: np.ndarray
    x_query: np.ndarray | None
    y_query: np.ndarray | None
    n_unique: int  # the first ``n_unique`` rows of ``x`` are the distinct images
    available: int  # distinct real images available in all


def load_mnist(
    root: str, n: int, n_queries: int, seed: int, pool_limit: int | None, cache: str | None = None
) -> MnistSet:
    """
    MNIST-shaped training set of ``n`` examples and its queries.

    All available real images (the test split alone here: 10,000) are read with ``load_dataset`` and put in a
    seeded random order (``pool_limit`` keeps only the first ones, to exercise repetition in quick runs). When
    ``n + n_queries`` images exist the training set is the first ``n`` and the queries the next ``n_queries``
    (held out); otherwise the training set repeats the images cyclically and the queries are ``None`` (drawn
    from the training pool by the audit). Either way the distinct images are the first ``min(n, available)``.
    ``cache`` is an ``.npz`` file that keeps the decoded images between the cases of a run.
    """
    if cache is not None and Path(cache).exists():
        with np.load(cache) as archive:
            x_all, y_all = archive["x"], archive["y"]
    else:
        from art_malleability.data import load_dataset

        data = load_dataset("mnist", root=root, seed=seed)
        x_all = np.concatenate([data.x_train, data.x_test])
        y_all = np.concatenate([data.y_train, data.y_test])
        if cache is not None:
            tmp = f"{cache}.{os.getpid()}.tmp.npz"
            np.savez(tmp, x=x_all, y=y_all)
            os.replace(tmp, cache)  # atomic: the ranks of a sharded case may write it at once
    order = np.random.default_rng(seed).permutation(len(x_all))
    if pool_limit is not None:
        order = order[:pool_limit]
    if n + n_queries <= len(order):
        train, query = order[:n], order[n : n + n_queries]
        return MnistSet(x_all[train], y_all[train], x_all[query], y_all[query], n, len(order))
    rows = order[np.arange(n) % len(order)]
    return MnistSet(x_all[rows], y_all[rows], None, None, min(n, len(order)), len(order))


def build_model(name: str, width: int, seed: int) -> Any:
    """A fresh 2L-ReLU or MLP-Attn (``build_reference_model``, centred context) or SmallCNN."""
    from art_malleability.models import SmallCNN, build_reference_model

    if name in ("2l-relu", ATTENTION_MODEL):
        return build_reference_model(name, INPUT_SHAPE, NB_CLASSES, width=width, seed=seed)
    if name == "cnn":
        return SmallCNN(INPUT_SHAPE, NB_CLASSES, seed=seed)
    raise ValueError(f"unknown model {name!r}; expected one of {(*MODELS, ATTENTION_MODEL)}")


def load_model(spec: dict[str, Any]) -> Any:
    import torch

    model = build_model(spec["model"], spec["width"], spec["seed"])
    model.load_state_dict(torch.load(spec["model_path"], map_location="cpu"))
    return model.eval()


# ================================================================================================ subprocess cases
def run_subprocess(
    spec: dict[str, Any], workdir: Path, timeout: float, threads: int, torchrun_nproc: int = 0,
    wait_idle: float = 0.0,
) -> list[dict[str, Any]]:
    """
    Run the case ``spec`` names (``case_<kind>`` of the benchmark module ``spec["module"]``) in a new process group
    (killed as a whole on timeout) and collect the result file(s) the case writes (one per rank under torchrun).
    With ``wait_idle > 0`` it first waits up to that many seconds for the machine to be idle; the CPU load of other
    processes during the case is recorded in every result as ``background_cores`` (a timing taken beside a busy core
    is not representative).
    """
    idle_before = wait_for_idle(wait_idle) if wait_idle > 0 else None
    library = library_state()
    name = spec["name"]
    spec_path = workdir / f"{name}.spec.json"
    log_path = workdir / f"{name}.log"
    outs = [workdir / f"{name}.rank{r}.json" for r in range(max(1, torchrun_nproc))]
    for out in outs:
        out.unlink(missing_ok=True)
    spec = {**spec, "out_pattern": str(workdir / f"{name}.rank{{rank}}.json"), "threads": threads}
    spec_path.write_text(json.dumps(spec))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(torchrun_nproc)]
                if torchrun_nproc else [sys.executable])
    cmd = [*launcher, str(Path(__file__).resolve()), str(spec_path)]
    start = time.perf_counter()
    error = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=thread_env(threads),
                                cwd=REPO_ROOT, start_new_session=True)
        tracker = LoadTracker(proc.pid)
        while True:
            try:
                rc = proc.wait(timeout=5.0)
                break
            except subprocess.TimeoutExpired:
                tracker.sample()
                if time.perf_counter() - start > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (torchrun and its workers)
                    proc.wait()
                    rc, error = None, f"timed out after {timeout:.0f} s"
                    break
        tracker.sample()
    wall = time.perf_counter() - start
    load = tracker.total / max(wall, 1e-9)
    extra = {"process_wall_s": wall, "background_cores": load, "background_cores_before": idle_before,
             "library": library}
    if load > 0.1:
        print(f"  !! other processes kept {load:.2f} cores busy during case {name}: its timings are disturbed",
              flush=True)
    results = []
    for out in outs:
        if out.exists():
            results.append({**json.loads(out.read_text()), **extra})
    if rc != 0 or len(results) != len(outs):
        tail = log_path.read_text()[-3000:] if log_path.exists() else ""
        error = error or f"exit status {rc}"
        if rc is not None and rc < 0:
            error += f" (killed by signal {signal.Signals(-rc).name})"
        print(f"  !! case {name} failed ({error}); log {log_path}:\n{tail}", flush=True)
        return [{"ok": False, "error": error, "log": str(log_path), **extra}]
    return results


def timed_fit_scores(est: Any, model: Any, x: np.ndarray, y: np.ndarray, xq: np.ndarray,
                     yq: np.ndarray) -> tuple[np.ndarray, float, float]:
    """``est.fit(model, x, y)`` then ``est.scores(xq, yq)``: the scores and the seconds of each call."""
    start = time.perf_counter()
    est.fit(model, x, y)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = est.scores(xq, yq)
    return scores, fit_s, time.perf_counter() - start


def write_result(spec: dict[str, Any], result: dict[str, Any], rank: int = 0) -> None:
    result = {"ok": True, **result, "peak_rss": peak_rss_bytes()}
    Path(spec["out_pattern"].format(rank=rank)).write_text(json.dumps(result, default=float))


def case_prep(spec: dict[str, Any]) -> None:
    """Train a model on the distinct images of a training set and save its weights."""
    import torch

    from art_malleability.models import train_model

    set_threads(spec["threads"])
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    u = data.n_unique
    model = build_model(spec["model"], spec["width"], spec["seed"])
    start = time.perf_counter()
    train_model(model, data.x[:u], data.y[:u], epochs=spec["epochs"], lr=spec["lr"], weight_decay=0.0,
                seed=spec["seed"], verbose=False, device="cpu")
    seconds = time.perf_counter() - start
    torch.save(model.state_dict(), spec["model_path"])
    write_result(spec, {
        "train_s": seconds, "n_unique": u, "available": data.available, "epochs": spec["epochs"], "lr": spec["lr"],
        "train_accuracy": accuracy(model, data.x[:u], data.y[:u]),
        "query_accuracy": accuracy(model, data.x_query, data.y_query),
    })


# ================================================================================================ the driver
class Bench:
    """Runs a benchmark's parts in subprocesses and prints their tables (each part a method of a subclass)."""

    #: The benchmark module whose ``case_<kind>`` functions the subprocesses run.
    module = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(args.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "func"}}
        self.prepared: dict[str, dict[str, Any]] = {}
        self.available: int | None = None  # distinct real images (known after the first training)
        (self.workdir / f"mnist-seed{args.seed}.npz").unlink(missing_ok=True)  # the image cache of this run

    # ---------------------------------------------------------------- shared
    def run(self, spec: dict[str, Any], timeout: float, threads: int, torchrun_nproc: int = 0) -> list[dict[str, Any]]:
        return run_subprocess(spec, self.workdir, timeout, threads, torchrun_nproc, wait_idle=self.args.wait_idle)

    def common(self, model: str) -> dict[str, Any]:
        a = self.args
        return {"module": self.module, "root": str(a.mnist_root), "seed": a.seed, "width": a.width, "model": model,
                "pool_limit": a.pool_limit, "cache": str(self.workdir / f"mnist-seed{a.seed}.npz")}

    def prep(self, model: str, n: int, n_queries: int) -> dict[str, Any]:
        """
        Train ``model`` on the distinct images of the training set of size ``n``: the first ``min(n, T)`` of the
        seeded order of the ``T`` available images, so one training serves every size with the same count.
        """
        a = self.args
        key = f"{model}-u{n if self.available is None else min(n, self.available)}"
        if key in self.prepared:
            return self.prepared[key]
        epochs, lr = training_settings(a, model)
        spec = {**self.common(model), "kind": "prep", "name": f"prep-{model}-n{n}", "n": n,
                "n_queries": n_queries, "epochs": epochs, "lr": lr,
                "model_path": str(self.workdir / f"model-{model}-n{n}.pt")}
        print(f"  training {model} for n={n:,} ({epochs} epochs, lr {lr:g}) ...", flush=True)
        res = self.run(spec, a.timeout, a.threads)[0]
        if not res["ok"]:
            raise RuntimeError(f"training {model} failed: {res['error']}")
        self.available = res["available"]
        info = {**res, "model": model, "model_path": spec["model_path"]}
        self.prepared[f"{model}-u{res['n_unique']}"] = info
        print(f"    trained in {res['train_s']:.1f} s on {res['n_unique']:,} distinct images: train accuracy "
              f"{fmt(res['train_accuracy'], 3)}, held-out accuracy {fmt(res['query_accuracy'], 3)}", flush=True)
        return info


def training_settings(args: argparse.Namespace, model: str) -> tuple[int, float]:
    """:return: ``(epochs, lr)`` of ``model`` from the command line's options."""
    if model == "2l-relu":
        return args.relu_epochs, args.relu_lr
    if model == ATTENTION_MODEL:
        return args.attn_epochs, args.attn_lr
    return args.cnn_epochs, args.cnn_lr


def attack_findings(result: Any) -> dict[str, Any]:
    """
    What the audit benchmarks record of one attack's result (an ``AttackResult``): its flip rates, the noise-aware
    rate, the undecided share, the signed retention with its control and excess, and its phases' seconds.
    """
    control = result.control
    return {
        "attack": result.attack, "seconds": dict(result.seconds), "flip_rate": result.flip_rate,
        "flip_rate_ci": result.flip_rate_ci, "flip_rate_null": result.flip_rate_null,
        "noise_aware": result.flip_rate_above_floor, "noise_aware_ci": result.flip_rate_above_floor_ci,
        "undecided_share": result.undecided_share, "retention": result.signed_retention,
        "retention_ci": result.signed_retention_ci,
        "control_retention": None if control is None else control.get("signed_retention"),
        "excess_retention": result.excess_retention, "excess_retention_ci": result.excess_retention_ci,
    }


def clean(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in ("scores",)}


# ================================================================================================ command line
def common_parser(description: str, parts: Sequence[str], models: Sequence[str] = MODELS) -> argparse.ArgumentParser:
    """
    The options every MNIST influence benchmark shares; ``parts`` are its parts (``all`` runs them in order) and
    ``models`` the models it offers (``MODELS`` by default, which ``--models`` also defaults to).
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if len(parts) > 1:
        p.add_argument("parts", nargs="+", choices=(*parts, "all"), help="parts to run, in this order")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script in about a minute")
    p.add_argument("--output", help="write every number to this JSON file")
    p.add_argument("--mnist-root", default=str(DEFAULT_MNIST_ROOT),
                   help="MNIST folder (IDX files); default ../shared/data/mnist beside the repository")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "bench_influence"),
                   help="scratch folder (weights, scores, logs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every case but shard's")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess")
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="before each case wait up to this many seconds for other processes to leave the CPUs idle")
    p.add_argument("--n-queries", type=int, default=100)
    p.add_argument("--models", nargs="+", choices=list(models), default=list(MODELS))
    p.add_argument("--width", type=int, default=512, help="width of the reference models")
    p.add_argument("--relu-epochs", type=int, default=100)
    p.add_argument("--relu-lr", type=float, default=3e-2)
    if ATTENTION_MODEL in models:
        p.add_argument("--attn-epochs", type=int, default=100, help="MLP-Attn's epochs")
        p.add_argument("--attn-lr", type=float, default=3e-2, help="MLP-Attn's learning rate")
    p.add_argument("--cnn-epochs", type=int, default=20)
    p.add_argument("--cnn-lr", type=float, default=1e-3)
    p.add_argument("--pool-limit", type=int, default=None,
                   help="use at most this many distinct real images (to exercise repetition)")
    return p


def quick_common(args: argparse.Namespace) -> None:
    """The ``--quick`` sizes of the shared options."""
    args.n_queries, args.relu_epochs, args.cnn_epochs, args.pool_limit = 5, 5, 1, 500
    if hasattr(args, "attn_epochs"):
        args.attn_epochs = 5
    args.timeout = min(args.timeout, 600.0)


def run_parts(bench: Bench, parts: Sequence[str], title: str) -> None:
    """Run ``parts`` (methods of ``bench``) in order, print their tables and write the JSON after each part."""
    import torch

    args, start = bench.args, time.perf_counter()
    if not Path(args.mnist_root).is_dir():
        raise SystemExit(f"--mnist-root {args.mnist_root!r} is not a folder")
    bench.results["machine"] = {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                                "python": platform.python_version(), "platform": platform.platform()}
    lib = bench.results["library_at_start"] = library_state()
    print(f"# {title} ({', '.join(parts)}){' --quick' if args.quick else ''}: {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, library {lib['commit'][:12]}{' (modified)' if lib['modified'] else ''}, scratch "
          f"{args.workdir}", flush=True)
    for part in parts:
        getattr(bench, part)()
        if args.output:
            Path(args.output).write_text(json.dumps(to_json(bench.results), indent=1, default=str))
    bench.results["wall_s"] = time.perf_counter() - start
    print(f"\nall parts in {bench.results['wall_s']:.0f} s")
    if args.output:
        Path(args.output).write_text(json.dumps(to_json(bench.results), indent=1, default=str))
        print(f"numbers in {args.output}")


def run_case(spec_path: str) -> None:
    """Run the case a spec file names: ``case_<kind>`` of the benchmark module ``module``."""
    spec = json.loads(Path(spec_path).read_text())
    cases: dict[str, Callable[[dict[str, Any]], None]] = {"prep": case_prep}
    if spec["kind"] not in cases:
        cases[spec["kind"]] = getattr(importlib.import_module(spec["module"]), f"case_{spec['kind']}")
    cases[spec["kind"]](spec)


if __name__ == "__main__":
    run_case(sys.argv[1])
