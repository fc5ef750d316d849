"""
Benchmark: influence estimators and the whole malleability audit on MNIST, on the CPU.

Four parts; each prints a Markdown table whose ratios are taken between numbers measured in the same run, and
every heavy case runs in its own subprocess (``python bench_influence.py _case SPEC.json``) so that its peak
resident set size (``ru_maxrss`` of that process, reported by the process itself) is measured separately.

``compare``
    One trained model on one data set (``--compare-n`` MNIST training images, default 1,000, and ``--n-queries``
    held-out query images, default 100), for the 2L-ReLU (width 512, Adam, 100 epochs, lr 3e-2, no weight decay)
    and the SmallCNN (Adam, ``--cnn-epochs``, lr 1e-3): wall time, peak RSS and agreement of

    (a) ``ntk-exact``: exact NTK influence (``NTKInfluence(projection_dim=None)``: the n × n eNTK, dual solve);
    (b) ``ntk-proj``: projected NTK influence (``projection_dim=--projection-dim``, default 4096);
    (c) ``captum-hand``: Captum's ``TracInCP`` used by hand as a Captum user would: the final weights saved to a
        checkpoint file and loaded by Captum's default loader, ``nn.CrossEntropyLoss(reduction="none")`` (the
        per-example loss its default ``sample_wise_grads_per_batch=False`` needs), ``influence((x_q, y_q))`` in
        its influence-score mode (``k=None``); in float64 (the reference of the gradient-type estimators) and,
        as ``captum-hand-f32``, in float32;
    (d) ``captum-adapter`` (this package's ``CaptumInfluence``) and ``gradient`` (``GradientInfluence``, TracIn
        at the final weights with per-layer factorisation), both float64, and ``captum-adapter-f32``, the adapter
        in float32 (to set beside ``captum-hand-f32``);
    (e) ``dattri-trak`` and ``dattri-tracin``: dattri 0.3's ``TRAKAttributor`` (``cache`` then ``attribute``) and
        ``TracInAttributor`` (``attribute``) on an ``AttributionTask`` with the final weights, float32 as a
        dattri user would run it, random projection to ``--projection-dim`` dimensions (dattri's CPU projector).
        TRAK's output function is the margin ``z_y − logsumexp_{c≠y} z_c`` (TRAK's ``log p/(1−p)`` written
        stably: the textbook form gives ``log 0`` for examples fitted to probability 1 in float32) and its
        correct-class probability ``p = exp(−CE)``. With ``n_train < k`` the k × k matrix ``ΦᵀΦ`` that TRAK
        inverts is singular, so ``regularization`` is set to ``1e-3 ×`` the mean squared norm of TRAK's scaled
        per-example gradients (a relative ridge like the NTK influence's); dattri's default 0 is singular here.

    Conventions: this package and Captum return ``(n_query, n_train)`` with **positive = helpful** (Captum's
    proponents); dattri returns ``(n_train, n_test)``, also positive = helpful (TracIn: ``lr · g_i · g_q``; TRAK:
    the query's margin rises with the training example's weight), so its scores are transposed; no sign changes.
    Agreement is the Spearman correlation of all ``n_query × n_train`` scores (and the mean per-query Spearman)
    against the exact NTK scores for the kernel-type estimators (projected NTK, TRAK) and against Captum's
    float64 ``TracInCP`` for the gradient-type ones, plus ``max |s − s_ref| / max |s_ref|`` for the latter.
    The NTK influence (kernel ridge leave-one-out, squared loss) and TracIn (cross-entropy gradient products)
    are different estimators: the cross-family correlations are shown for information only.

``scale``
    The whole audit (``MalleabilityEstimator``: FGSM, PGD and MIM at ε = 0.3, ``--n-queries`` queries,
    strategy "top", ``projection_dim="auto"``, NTK influence) at ``--sizes`` (default 1k, 4k, 16k, 60k training
    examples, MNIST-shaped) for the 2L-ReLU (width 512) and the SmallCNN. Real MNIST images are used up to the
    number available (only the 10,000-image test split here): a training set larger than that repeats the
    images cyclically, so it holds exact duplicates, whose leave-one-out influence is degenerate (removing one
    copy barely changes a kernel regression that keeps the other): fine for timing, meaningless as an audit.
    Queries are held-out images when ``n + n_queries`` images exist; otherwise they are drawn from the training
    pool by the audit itself (``x_test=None``: each query's score on itself is excluded). Models are trained on
    the distinct images only (at most 10,000: a repeated set is the same data for more epochs), with the same
    settings as in ``compare``; training time is reported but is not part of the audit time. Reported per size:
    the NTK mode and ``k`` the audit picked, the wall time in total and per phase (clean accuracy, clean
    influence, and per attack: attack / influence / metrics), the NTK influence's ``seconds_`` per stage
    (features, solve, communication, scores), peak RSS, and each attack's influence time relative to the clean
    influence (the update touches only the perturbed 10 % of the rows). Targets at 60k: whole audit < 10 min
    (2L-ReLU) and < 30 min (CNN), peak RSS < 8 GB (10⁹ bytes).
    ``--scale-projection-dim none --memory-limit-gb 6`` runs the exact mode instead (dense, or in tiles in memory
    or on disk within the budget: the issue's 40,000-image target is
    ``scale --models 2l-relu --sizes 40000 --scale-projection-dim none --memory-limit-gb 6``).

``gemm``
    Share of this machine's fp32 GEMM rate (``torch.mm`` on 4096 × 4096 float32 matrices with ``--threads``
    threads, best of three, measured in the same process) reached by the projected NTK influence's feature and
    solve phases on the 2L-ReLU (width 512, n = ``--gemm-n`` = 16k MNIST-shaped examples, k = 4096). The
    floating-point operations of each phase are counted analytically (matrix products only, elementwise work
    ignored; one multiply-add = 2 flops):

    - features, per example (d = 784 inputs, m = 512 hidden units, C = 10 classes, k = k_out · k_in):
      forward ``2dm + 2mC``; C backward passes to the hidden layer's output, ``C · 2Cm``; projection of the
      output-side factor ``C · 2m · k_out`` (class block by class block); of the input-side factor ``2d · k_in``;
      their outer product ``2 k_out k_in``;
    - solve (primal, n > k): ``ΦᵀΦ`` ``2nk²`` (a full GEMM, as computed), ``ΦᵀY`` ``2nkC``, Cholesky ``k³/3``,
      triangular inverse ``k³/3``, weights ``4k²C``, hat diagonal ``2nk² + 2nk`` (``‖L⁻¹φ_i‖²``), residuals
      ``2nkC``.

    GFLOP/s = flops / the phase's ``seconds_``; the target is ≥ 30 % of the fp32 GEMM rate. The float64 GEMM rate
    is reported as well: the features are computed in float64 (the estimator's default dtype) and the solve is
    always float64. The fit is repeated with ``dtype=torch.float32`` (float32 features, float64 solve) for the
    feature phase's rate in float32.

``shard``
    Sharding efficiency of the projected NTK influence (2L-ReLU width 512, n = ``--shard-n`` = 16k, k = 4096,
    fit then scores of ``--n-queries`` queries): one process with one thread (``OMP_NUM_THREADS=1``,
    ``torch.set_num_threads(1)``) against two gloo processes with one thread each, launched with
    ``python -m torch.distributed.run --standalone --nproc-per-node 2``; each calls
    ``art_malleability.distributed.init_from_env("gloo")`` and fits the same ``NTKInfluence`` on the same
    arrays (the library shards the rows itself). Reported per rank: ``seconds_`` phases and wall time; the
    speed-up of the feature phase (target ≥ 1.6×) and the share of the run spent in all-reduce and gathers
    (``seconds_["communication"]`` over the rank's wall time of fit + scores; target < 10 %).

Usage (from the repository root; MNIST IDX files under ``--mnist-root``, default ``../shared/data/mnist``
relative to the repository root)::

    python benchmarks/bench_influence.py compare                 # about 15 min on 2 CPU cores
    python benchmarks/bench_influence.py scale                   # about 1.5 h (the 60k cases dominate)
    python benchmarks/bench_influence.py gemm shard              # a few minutes
    python benchmarks/bench_influence.py all --output bench.json
    python benchmarks/bench_influence.py all --quick             # tiny sizes: checks the script in about a minute

Scratch files (data-independent: trained weights, scores, logs of every case) go to ``--workdir`` (default
``$TMPDIR/bench_influence``). Every subprocess has a timeout (``--timeout``); a case that fails or times out is
reported with its error and the others still run.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
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

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MNIST_ROOT = REPO_ROOT.parent / "shared" / "data" / "mnist"
INPUT_SHAPE = (1, 28, 28)
NB_CLASSES = 10
MODELS = ("2l-relu", "cnn")
ESTIMATORS = (
    "ntk-exact",
    "ntk-proj",
    "captum-hand",
    "captum-hand-f32",
    "captum-adapter",
    "captum-adapter-f32",
    "gradient",
    "dattri-trak",
    "dattri-tracin",
)
KERNEL_TYPE = ("ntk-exact", "ntk-proj", "dattri-trak")
ATTACKS = ("fgsm", "pgd", "mim")
TARGET_AUDIT_S = {"2l-relu": 600.0, "cnn": 1800.0}
TARGET_RSS_BYTES = 8e9
TARGET_GEMM_SHARE = 0.30
TARGET_SHARD_SPEEDUP = 1.6
TARGET_COMM_SHARE = 0.10
_MIB = 2**20


# ================================================================================================ helpers
def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ``ru_maxrss`` in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(int(threads))


def thread_env(threads: int) -> dict[str, str]:
    """Environment of a subprocess limited to ``threads`` threads in every BLAS / OpenMP pool."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: numbers rounded, ``None`` and NaN as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            return "–"
        if value != 0 and abs(value) < 10 ** (-digits):
            return f"{value:.1e}"
        return f"{value:,.{digits}f}"
    return str(value)


def mib(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else n_bytes / _MIB


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("PASS" if ok else "MISS")


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


def library_state() -> dict[str, Any]:
    """
    Git commit of the checkout and a digest of the package's source as it is now (the library may be edited
    while a long benchmark runs: each case records the source it ran).
    """
    import hashlib

    digest = hashlib.sha1()
    for path in sorted((REPO_ROOT / "art_malleability").rglob("*.py")):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        head = None
    return {"git_head": head, "source_digest": digest.hexdigest()[:12]}


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
    """A fresh 2L-ReLU (``build_reference_model``) or SmallCNN."""
    from art_malleability.models import SmallCNN, build_reference_model

    if name == "2l-relu":
        return build_reference_model("2l-relu", INPUT_SHAPE, NB_CLASSES, width=width, seed=seed)
    if name == "cnn":
        return SmallCNN(INPUT_SHAPE, NB_CLASSES, seed=seed)
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def load_model(spec: dict[str, Any]) -> Any:
    import torch

    model = build_model(spec["model"], spec["width"], spec["seed"])
    model.load_state_dict(torch.load(spec["model_path"], map_location="cpu"))
    return model.eval()


def accuracy(model: Any, x: np.ndarray | None, y: np.ndarray | None) -> float | None:
    import torch

    if x is None or y is None:
        return None
    with torch.no_grad():
        pred = torch.cat([model(torch.as_tensor(x[s : s + 1024])).argmax(1) for s in range(0, len(x), 1024)])
    return float((pred.numpy() == y).mean())


# ================================================================================================ subprocess cases
def run_subprocess(
    spec: dict[str, Any], workdir: Path, timeout: float, threads: int, torchrun_nproc: int = 0,
    wait_idle: float = 0.0,
) -> list[dict[str, Any]]:
    """
    Run ``_case`` for ``spec`` in a new process group (killed as a whole on timeout) and collect the result
    file(s) the case writes (one per rank under torchrun). With ``wait_idle > 0`` it first waits up to that many
    seconds for the machine to be idle; the CPU load of other processes during the case is recorded in every
    result as ``background_cores`` (a timing taken beside a busy core is not representative).
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
    if torchrun_nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(torchrun_nproc), str(Path(__file__).resolve()), "_case", str(spec_path)]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "_case", str(spec_path)]
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


# ------------------------------------------------------------------------------------------------ compare
def _dattri_functions(model: Any) -> tuple[Callable, Callable, Callable]:
    """Per-example loss, TRAK margin and correct-class probability in dattri's ``f(params, (x, y))`` form."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call

    def logits(params: dict, image: Any) -> Any:
        return functional_call(model, params, (image.unsqueeze(0),))[0]

    def loss(params: dict, data: tuple) -> Any:
        image, label = data
        return F.cross_entropy(logits(params, image).unsqueeze(0), label.unsqueeze(0))

    def margin(params: dict, data: tuple) -> Any:
        image, label = data
        z = logits(params, image)
        mask = torch.arange(z.shape[0]) == label
        correct = (z * mask).sum()
        return correct - torch.logsumexp(z.masked_fill(mask, float("-inf")), dim=0)

    def probability(params: dict, data: tuple) -> Any:
        return torch.exp(-loss(params, data))

    return loss, margin, probability


def run_estimator(
    name: str, model: Any, x: np.ndarray, y: np.ndarray, xq: np.ndarray, yq: np.ndarray, spec: dict[str, Any]
) -> tuple[np.ndarray, float, float, dict[str, Any]]:
    """
    Run one estimator; return ``(scores (n_query, n_train), positive = helpful; fit seconds; scores seconds;
    details)``.
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from art_malleability.influence import CaptumInfluence, GradientInfluence, NTKInfluence

    details: dict[str, Any] = {}
    k = int(spec["projection_dim"])
    if name in ("ntk-exact", "ntk-proj", "captum-adapter", "captum-adapter-f32", "gradient"):
        if name == "ntk-exact":
            est = NTKInfluence(projection_dim=None, device="cpu")
        elif name == "ntk-proj":
            est = NTKInfluence(projection_dim=k, device="cpu")
        elif name.startswith("captum-adapter"):
            import captum.influence  # noqa: F401  (imported before the clock starts, as in the by-hand cases)

            dtype = torch.float32 if name.endswith("f32") else torch.float64
            est = CaptumInfluence(device="cpu", dtype=dtype)
        else:
            est = GradientInfluence(device="cpu")
        scores, fit_s, scores_s = timed_fit_scores(est, model, x, y, xq, yq)
        if isinstance(est, NTKInfluence):
            details = {"mode": est.mode_, "k": est.projection_dim_, "solver": type(est.solver_).__name__,
                       "seconds_": dict(est.seconds_),
                       "groups": est.projector_.describe() if est.projector_ is not None else None}
        return scores, fit_s, scores_s, details
    if name in ("captum-hand", "captum-hand-f32"):
        from captum.influence import TracInCP

        dtype = torch.float64 if name == "captum-hand" else torch.float32
        start = time.perf_counter()
        net = copy.deepcopy(model).to(dtype).eval()
        checkpoint = Path(spec["scratch"]) / f"{spec['name']}.ckpt.pt"
        torch.save(net.state_dict(), checkpoint)  # a Captum user's checkpoint file of the final weights
        train = TensorDataset(torch.as_tensor(x, dtype=dtype), torch.as_tensor(y))
        tracin = TracInCP(net, train, checkpoints=[str(checkpoint)],
                          loss_fn=nn.CrossEntropyLoss(reduction="none"), batch_size=64)
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        out = tracin.influence((torch.as_tensor(xq, dtype=dtype), torch.as_tensor(yq)))  # (n_query, n_train)
        scores_s = time.perf_counter() - start
        return out.detach().to(torch.float64).numpy(), fit_s, scores_s, {"dtype": str(dtype)}
    if name in ("dattri-trak", "dattri-tracin"):
        from dattri.algorithm import TracInAttributor, TRAKAttributor
        from dattri.task import AttributionTask
        from torch.func import grad, vmap

        net = copy.deepcopy(model).float().eval()
        loss, margin, probability = _dattri_functions(net)
        train = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=spec["dattri_batch"])
        test = DataLoader(TensorDataset(torch.as_tensor(xq), torch.as_tensor(yq)), batch_size=spec["dattri_batch"])
        projector = {"proj_dim": k, "proj_max_batch_size": 32, "proj_seed": 0, "device": "cpu"}
        start = time.perf_counter()
        if name == "dattri-trak":
            params = {n: p.detach() for n, p in net.named_parameters()}
            n_params = sum(p.numel() for p in params.values())
            probe = (torch.as_tensor(x[:64]), torch.as_tensor(y[:64]))
            g = vmap(grad(margin), in_dims=(None, 0))(params, probe)
            sq = sum(v.flatten(1).pow(2).sum(1) for v in g.values())
            reg = float(spec["trak_relative_ridge"] * sq.mean() / n_params)
            task = AttributionTask(loss_func=margin, model=net, checkpoints=net.state_dict())
            attributor = TRAKAttributor(task=task, correct_probability_func=probability, device="cpu",
                                        projector_kwargs=projector, regularization=reg)
            attributor.cache(train)
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            out = attributor.attribute(test)  # (n_train, n_test)
            details = {"regularization": reg}
        else:
            task = AttributionTask(loss_func=loss, model=net, checkpoints=net.state_dict())
            attributor = TracInAttributor(task=task, weight_list=torch.ones(1), normalized_grad=False,
                                          projector_kwargs=projector, device="cpu")
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            out = attributor.attribute(train, test)  # (n_train, n_test)
        scores_s = time.perf_counter() - start
        details["batch_size"] = spec["dattri_batch"]
        return out.detach().to(torch.float64).numpy().T, fit_s, scores_s, details
    raise ValueError(f"unknown estimator {name!r}")


def case_estimator(spec: dict[str, Any]) -> None:
    set_threads(spec["threads"])
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    if data.x_query is None or data.y_query is None:
        raise RuntimeError("compare needs held-out queries: lower --compare-n")
    model = load_model(spec)
    base = rss_bytes()
    scores, fit_s, scores_s, details = run_estimator(spec["estimator"], model, data.x, data.y, data.x_query,
                                                     data.y_query, spec)
    np.save(spec["scores_path"], scores)
    write_result(spec, {"fit_s": fit_s, "scores_s": scores_s, "total_s": fit_s + scores_s, "base_rss": base,
                        "shape": list(scores.shape), "finite": bool(np.isfinite(scores).all()), **details})


def agreement(scores: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Spearman of all pairs, mean per-query Spearman, largest difference relative to the reference's scale."""
    from scipy.stats import spearmanr

    ok = np.isfinite(scores) & np.isfinite(reference)
    rho = float(spearmanr(scores[ok], reference[ok]).statistic) if ok.sum() > 2 else float("nan")
    per_query = [float(spearmanr(a, b).statistic) for a, b in zip(scores, reference, strict=True)
                 if np.ptp(a) > 0 and np.ptp(b) > 0]
    scale = float(np.max(np.abs(reference[ok]))) if ok.any() else float("nan")
    diff = float(np.max(np.abs(scores[ok] - reference[ok]))) / scale if scale > 0 else float("nan")
    return {"spearman": rho, "spearman_per_query": float(np.mean(per_query)) if per_query else float("nan"),
            "max_rel_diff": diff}


# ------------------------------------------------------------------------------------------------ scale
def _timed_ntk_class() -> type:
    from art_malleability.influence import NTKInfluence

    class StageTimedNTK(NTKInfluence):
        """``NTKInfluence`` that snapshots its cumulative ``seconds_`` after each ``scores`` call (one per stage)."""

        def fit(self, *args: Any, **kwargs: Any) -> Any:
            self.stage_seconds: list[dict[str, float]] = []
            return super().fit(*args, **kwargs)

        def scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
            out = super().scores(x_query, y_query)
            self.stage_seconds.append(dict(self.seconds_))
            return out

    return StageTimedNTK


def case_audit(spec: dict[str, Any]) -> None:
    from art_malleability import MalleabilityEstimator
    from art_malleability.models import make_classifier

    set_threads(spec["threads"])
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    model = load_model(spec)
    classifier = make_classifier(model, INPUT_SHAPE, NB_CLASSES, device="cpu")
    ntk = _timed_ntk_class()(ridge=1e-3, device="cpu", projection_dim=spec.get("projection_dim", "auto"),
                             projection_seed=spec["seed"], max_exact_n=spec["max_exact_n"],
                             memory_limit_gb=spec.get("memory_limit_gb"))
    audit = MalleabilityEstimator(classifier, attacks=ATTACKS, eps=0.3, influence=ntk, strategy="top",
                                  n_queries=spec["n_queries"], verbose=False, device="cpu", seed=spec["seed"])
    base = rss_bytes()
    start = time.perf_counter()
    report = audit.evaluate(data.x, data.y, data.x_query, data.y_query)
    total = time.perf_counter() - start
    stages, prev = [], dict.fromkeys(ntk.stage_seconds[0], 0.0)
    for snap in ntk.stage_seconds:
        stages.append({key: snap[key] - prev[key] for key in snap})
        prev = snap
    write_result(spec, {
        "total_s": total, "base_rss": base, "n_unique": data.n_unique, "query_source": report.query_source,
        "mode": report.execution.get("mode"), "k": report.execution.get("projection_dim"),
        "solver": type(ntk.solver_).__name__ + ("" if getattr(ntk.solver_, "block", None) is None
                                                     else f" tiles {ntk.solver_.block}"
                                                     + (" on disk" if ntk.solver_.folder else "")),
        "seconds": dict(report.seconds),
        "attacks": [{"attack": r.attack, "seconds": dict(r.seconds), "flip_rate": r.flip_rate,
                     "flip_rate_ci": r.flip_rate_ci, "flip_rate_null": r.flip_rate_null,
                     "noise_aware": r.flip_rate_above_floor, "noise_aware_ci": r.flip_rate_above_floor_ci,
                     "control": None if r.control is None else r.control["flip_rate"],
                     "excess": r.excess_flip_rate, "excess_ci": r.excess_flip_rate_ci,
                     "undecided_share": r.undecided_share, "attack_success": r.attack_success,
                     "n_perturbed": r.n_perturbed} for r in report.results],
        "ntk_stages": stages, "clean_accuracy": report.clean_accuracy,
    })


def _pct_ci(value: float | None, ci: list[float | None] | None = None) -> str:
    """A share in percent with its interval, ``n/a`` when undefined."""
    if value is None:
        return "n/a"
    text = f"{100 * value:.1f}"
    if ci and ci[0] is not None and ci[1] is not None:
        text += f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"
    return text


# ------------------------------------------------------------------------------------------------ gemm
def gemm_rate(dtype: Any, size: int = 4096, repeats: int = 3) -> float:
    """Best GFLOP/s of ``torch.mm`` on two square ``size × size`` matrices."""
    import torch

    gen = torch.Generator().manual_seed(0)
    a = torch.randn((size, size), generator=gen, dtype=dtype)
    b = torch.randn((size, size), generator=gen, dtype=dtype)
    out = torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e9


def feature_flops_2l(n: int, d: int, m: int, c: int, k_out: int, k_in: int) -> dict[str, float]:
    """Matrix-product flops of the projected features of the 2L-ReLU (see the module docstring)."""
    parts = {
        "forward": 2.0 * d * m + 2.0 * m * c,
        "backward (C passes)": c * 2.0 * c * m,
        "output-side projection": c * 2.0 * m * k_out,
        "input-side projection": 2.0 * d * k_in,
        "outer product": 2.0 * k_out * k_in,
    }
    return {key: n * value for key, value in parts.items()}


def solve_flops_primal(n: int, k: int, c: int) -> dict[str, float]:
    """Flops of the primal solve (see the module docstring)."""
    return {
        "PhiT Phi": 2.0 * n * k * k,
        "PhiT Y": 2.0 * n * k * c,
        "Cholesky": k**3 / 3.0,
        "triangular inverse": k**3 / 3.0,
        "weights": 4.0 * k * k * c,
        "hat diagonal": 2.0 * n * k * k + 2.0 * n * k,
        "residuals": 2.0 * n * k * c,
    }


def case_gemm(spec: dict[str, Any]) -> None:
    import torch

    from art_malleability.influence import NTKInfluence

    set_threads(spec["threads"])
    rates = {"float32": gemm_rate(torch.float32), "float64": gemm_rate(torch.float64)}
    data = load_mnist(spec["root"], spec["n"], 0, spec["seed"], spec["pool_limit"], spec["cache"])
    x, y = data.x, data.y
    model = load_model(spec)
    base = rss_bytes()
    est = NTKInfluence(projection_dim=spec["k"], device="cpu")
    start = time.perf_counter()
    est.fit(model, x, y)
    fit_s = time.perf_counter() - start
    if type(est.solver_).__name__ != "PrimalRidge":
        raise RuntimeError(f"expected the primal solve (n > k), got {type(est.solver_).__name__}")
    groups = est.projector_.describe()
    if len(groups) != 1 or groups[0]["kind"] != "linear":
        raise RuntimeError(f"expected one factorised linear layer, got {groups}")
    d, m = int(np.prod(INPUT_SHAPE)), spec["width"]
    feat = feature_flops_2l(len(x), d, m, NB_CLASSES, groups[0]["dim_out"], groups[0]["dim_in"])
    solve = solve_flops_primal(len(x), est.projection_dim_, NB_CLASSES)
    # the same fit with float32 features (the solve stays float64): the feature phase's rate in fp32
    est32 = NTKInfluence(projection_dim=spec["k"], device="cpu", dtype=torch.float32).fit(model, x, y)
    write_result(spec, {"gemm_gflops": rates, "fit_s": fit_s, "seconds_": dict(est.seconds_), "base_rss": base,
                        "k": est.projection_dim_, "groups": groups, "n": len(x),
                        "feature_flops": feat, "solve_flops": solve,
                        "seconds_float32_features": dict(est32.seconds_)})


# ------------------------------------------------------------------------------------------------ shard
def case_shard(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from art_malleability.distributed import init_from_env
    from art_malleability.influence import NTKInfluence

    shard = init_from_env("gloo", timeout_s=spec["collective_timeout"]) if spec["distributed"] else None
    set_threads(1)
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    x, y = data.x, data.y
    xq, yq = data.x_query, data.y_query
    if xq is None or yq is None:  # no held-out images left: queries from the pool
        xq, yq = x[: spec["n_queries"]], y[: spec["n_queries"]]
    model = load_model(spec)
    if shard is not None:
        dist.barrier()
    base = rss_bytes()
    est = NTKInfluence(projection_dim=spec["k"], device="cpu")
    scores, fit_s, scores_s = timed_fit_scores(est, model, x, y, xq, yq)
    rank = 0 if shard is None else shard.rank
    bounds = [0, len(x)] if shard is None else list(shard.bounds(len(x)))
    write_result(spec, {"rank": rank, "world_size": 1 if shard is None else shard.world_size, "bounds": bounds,
                        "fit_s": fit_s, "scores_s": scores_s, "seconds_": dict(est.seconds_), "base_rss": base,
                        "k": est.projection_dim_, "solver": type(est.solver_).__name__,
                        "scores_shape": list(scores.shape), "scores_sum": float(np.nansum(scores))}, rank=rank)
    if shard is not None:
        dist.barrier()
        dist.destroy_process_group()


CASES: dict[str, Callable[[dict[str, Any]], None]] = {
    "prep": case_prep,
    "estimator": case_estimator,
    "audit": case_audit,
    "gemm": case_gemm,
    "shard": case_shard,
}


def run_case_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    CASES[spec["kind"]](spec)


# ================================================================================================ the parts
class Bench:
    """Runs the parts in subprocesses and prints their tables."""

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
        return {"root": str(a.mnist_root), "seed": a.seed, "width": a.width, "model": model,
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
        epochs = a.relu_epochs if model == "2l-relu" else a.cnn_epochs
        lr = a.relu_lr if model == "2l-relu" else a.cnn_lr
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

    # ---------------------------------------------------------------- compare
    def compare(self) -> None:
        a = self.args
        n, q, k = a.compare_n, a.n_queries, a.projection_dim
        out: dict[str, Any] = {"n_train": n, "n_queries": q, "projection_dim": k, "models": {}}
        print(f"\n## compare: n_train = {n:,}, {q} held-out queries, projection dimension {k}\n", flush=True)
        for model in a.models:
            info = self.prep(model, n, q)
            cases: dict[str, dict[str, Any]] = {}
            for est in a.estimators:
                name = f"compare-{model}-{est}"
                spec = {**self.common(model), "kind": "estimator", "name": name, "estimator": est, "n": n,
                        "n_queries": q, "projection_dim": k, "model_path": info["model_path"],
                        "scores_path": str(self.workdir / f"{name}.npy"), "scratch": str(self.workdir),
                        "dattri_batch": a.dattri_batch, "trak_relative_ridge": 1e-3}
                print(f"  {model} / {est} ...", flush=True)
                res = self.run(spec, a.timeout, a.threads)[0]
                if res["ok"]:
                    res["scores"] = np.load(spec["scores_path"])
                    print(f"    {res['total_s']:.2f} s, peak RSS {mib(res['peak_rss']):.0f} MiB", flush=True)
                cases[est] = res
            ref_ntk = cases.get("ntk-exact", {}).get("scores")
            ref_captum = cases.get("captum-hand", {}).get("scores")
            t_ntk = cases.get("ntk-exact", {}).get("total_s")
            t_captum = cases.get("captum-hand", {}).get("total_s")
            t_captum32 = cases.get("captum-hand-f32", {}).get("total_s")
            rows, matches = [], []
            for est, res in cases.items():
                if not res["ok"]:
                    rows.append([est, f"FAILED: {res['error']}"] + [None] * 14)
                    continue
                s = res.pop("scores")
                vs_ntk = agreement(s, ref_ntk) if ref_ntk is not None else {}
                vs_captum = agreement(s, ref_captum) if ref_captum is not None else {}
                res["vs_exact_ntk"], res["vs_captum"] = vs_ntk, vs_captum
                designated = vs_ntk if est in KERNEL_TYPE else vs_captum
                res["reference"] = "exact NTK" if est in KERNEL_TYPE else "Captum TracInCP (float64)"
                note = res.get("mode", "") + (f", k={res['k']}" if res.get("k") else "")
                if est == "dattri-trak":
                    note = f"float32, ridge {res['regularization']:.2e}"
                elif est in ("dattri-tracin", "captum-adapter-f32"):
                    note = "float32"
                elif est.startswith("captum-hand"):
                    note = res["dtype"].replace("torch.", "")
                elif not note:
                    note = "float64"
                if est in ("captum-adapter", "gradient") and vs_captum:
                    matches.append((est, vs_captum["max_rel_diff"]))
                rows.append([
                    est, note, res["fit_s"], res["scores_s"], res["total_s"],
                    res["total_s"] / t_captum if t_captum else None,
                    res["total_s"] / t_captum32 if t_captum32 else None, res["total_s"] / t_ntk if t_ntk else None,
                    mib(res["peak_rss"]), mib(res["peak_rss"] - res["base_rss"]),
                    designated.get("spearman"), designated.get("spearman_per_query"),
                    vs_ntk.get("spearman"), vs_captum.get("spearman"),
                    None if est in KERNEL_TYPE else vs_captum.get("max_rel_diff"), res["background_cores"],
                ])
            print(f"\n### {model} (trained {info['epochs']} epochs in {info['train_s']:.1f} s; held-out accuracy "
                  f"{fmt(info['query_accuracy'], 3)})\n")
            print(table(["estimator", "notes", "fit s", "scores s", "total s", "× Captum f64", "× Captum f32",
                         "× exact NTK", "peak RSS MiB", "Δ RSS MiB", "ρ vs ref", "ρ per query vs ref",
                         "ρ vs exact NTK", "ρ vs Captum f64", "max rel diff vs Captum f64", "other load (cores)"],
                        rows))
            print("\nref = exact NTK for ntk-*/dattri-trak, Captum TracInCP float64 for the gradient-type estimators; "
                  "× = time ratio (total s) measured in this run; Δ RSS = peak minus RSS after loading data and "
                  "model; max rel diff = max |s − s_ref| / max |s_ref|.")
            for est, diff in matches:
                print(f"{est} matches Captum TracInCP (float64) to {diff:.1e} of its scale: "
                      f"{verdict(diff <= 1e-10)} (≤ 1e-10)")
            sys.stdout.flush()
            out["models"][model] = {"training": _clean(info), "cases": cases}
        self.results["compare"] = out

    # ---------------------------------------------------------------- scale
    def scale(self) -> None:
        a = self.args
        out: dict[str, Any] = {"sizes": a.sizes, "models": {}}
        print(f"\n## scale: the whole audit ({', '.join(ATTACKS)}, eps 0.3, {a.n_queries} queries, strategy top, "
              f"projection_dim {a.scale_projection_dim}, memory limit {a.memory_limit_gb} GiB)\n", flush=True)
        for model in a.models:
            rows, phase_rows, cases = [], [], {}
            for n in a.sizes:
                info = self.prep(model, n, a.n_queries)
                name = f"scale-{model}-n{n}"
                spec = {**self.common(model), "kind": "audit", "name": name, "n": n, "n_queries": a.n_queries,
                        "model_path": info["model_path"], "max_exact_n": a.max_exact_n,
                        "projection_dim": a.scale_projection_dim, "memory_limit_gb": a.memory_limit_gb}
                print(f"  audit {model} n={n:,} ...", flush=True)
                res = self.run(spec, a.audit_timeout, a.threads)[0]
                res["training"] = _clean(info)
                cases[n] = res
                if not res["ok"]:
                    rows.append([n, f"FAILED: {res['error']}"] + [None] * 14)
                    continue
                print(f"    {res['total_s']:.1f} s ({res['mode']}), peak RSS {mib(res['peak_rss']):.0f} MiB",
                      flush=True)
                clean = res["seconds"]["influence_clean"]
                per_attack = [r["seconds"] for r in res["attacks"]]
                rel = [r["influence"] / clean for r in per_attack]
                res["influence_relative_to_clean"] = rel
                target_t = TARGET_AUDIT_S[model] if n >= 60000 else None
                ok_t = None if target_t is None else res["total_s"] < target_t
                ok_m = None if target_t is None else res["peak_rss"] < TARGET_RSS_BYTES
                res["targets"] = {"time_s": target_t, "time_ok": ok_t, "rss_ok": ok_m}
                rows.append([
                    n, f"{res['mode']}" + (f" k={res['k']}" if res["k"] else ""), res["solver"],
                    res["n_unique"], res["query_source"], info["train_s"], res["total_s"],
                    res["seconds"]["accuracy"], clean,
                    sum(p["attack"] for p in per_attack), sum(p["influence"] for p in per_attack),
                    sum(p["metrics"] for p in per_attack), " / ".join(f"{r:.2f}" for r in rel),
                    mib(res["peak_rss"]),
                    f"{verdict(ok_t)} {verdict(ok_m)}" if target_t else "–", res["background_cores"],
                ])
                for stage, (label, secs) in enumerate(
                    [("clean", {"attack": None, "influence": clean, "metrics": None})]
                    + [(r["attack"], r["seconds"]) for r in res["attacks"]]
                ):
                    ntk = res["ntk_stages"][stage] if stage < len(res["ntk_stages"]) else {}
                    phase_rows.append([n, label, secs["attack"], secs["influence"], secs["metrics"],
                                       ntk.get("features"), ntk.get("solve"), ntk.get("communication"),
                                       ntk.get("scores")])
            print(f"\n### {model}\n")
            print(table(["n_train", "NTK mode", "solver", "distinct images", "queries", "train s (not in audit)",
                         "audit s", "accuracy s", "clean influence s", "attacks s (3)", "attack influence s (3)",
                         "metrics s (3)", "influence per attack / clean", "peak RSS MiB",
                         f"target: time < {TARGET_AUDIT_S[model] / 60:.0f} min, RSS < 8 GB", "other load (cores)"],
                        rows))
            stat_rows = [[n, r["attack"], _pct_ci(r["flip_rate"], r["flip_rate_ci"]), _pct_ci(r["flip_rate_null"]),
                          _pct_ci(r["noise_aware"], r["noise_aware_ci"]), _pct_ci(r["control"]),
                          _pct_ci(r["excess"], r["excess_ci"]), _pct_ci(r["undecided_share"])]
                         for n, res in cases.items() if res.get("ok") for r in res["attacks"]]
            print(f"\n#### {model}: what the audits found (percent; intervals 95 %)\n")
            print(table(["n_train", "attack", "flip rate", "by noise", "noise-aware", "control", "excess (pts)",
                         "undecided"], stat_rows))
            print(f"\n#### {model}: phases per stage (s); NTK columns are the influence's seconds_ of the stage\n")
            print(table(["n_train", "stage", "attack", "influence", "metrics", "NTK features", "NTK solve",
                         "NTK communication", "NTK scores"], phase_rows), flush=True)
            out["models"][model] = cases
        self.results["scale"] = out

    # ---------------------------------------------------------------- gemm
    def gemm(self) -> None:
        a = self.args
        n, k = a.gemm_n, a.gemm_k
        info = self.prep("2l-relu", n, 0)
        spec = {**self.common("2l-relu"), "kind": "gemm", "name": f"gemm-n{n}-k{k}", "n": n, "k": k,
                "model_path": info["model_path"]}
        print(f"\n## gemm: projected NTK influence, 2L-ReLU width {a.width}, n = {n:,}, k = {k}, {a.threads} "
              f"threads\n", flush=True)
        res = self.run(spec, a.timeout, a.threads)[0]
        self.results["gemm"] = res
        if not res["ok"]:
            print(f"FAILED: {res['error']}")
            return
        f32, f64 = res["gemm_gflops"]["float32"], res["gemm_gflops"]["float64"]
        rows = []
        for phase, label, flops, seconds in (
            ("features", "features (float64, the default)", res["feature_flops"], res["seconds_"]),
            ("features_float32", "features (dtype=torch.float32)", res["feature_flops"],
             {"features_float32": res["seconds_float32_features"]["features"]}),
            ("solve", "solve (float64)", res["solve_flops"], res["seconds_"]),
        ):
            total = sum(flops.values())
            secs = seconds[phase]
            rate = total / secs / 1e9
            ok = rate / f32 >= TARGET_GEMM_SHARE
            res[f"{phase}_gflops"] = rate
            res[f"{phase}_share_f32"] = rate / f32
            rows.append([label, total / 1e9, secs, rate, 100 * rate / f32, 100 * rate / f64,
                         f"{verdict(ok)} (≥ {100 * TARGET_GEMM_SHARE:.0f} % of fp32)"])
        print(f"torch.mm 4096²: float32 {f32:.1f} GFLOP/s, float64 {f64:.1f} GFLOP/s "
              f"(groups: {res['groups']}; other processes' load {res['background_cores']:.2f} cores)\n")
        print(table(["phase", "GFLOP (analytic)", "seconds_", "GFLOP/s", "% of fp32 GEMM", "% of fp64 GEMM",
                     "target"], rows))
        print("\nflops per term (GFLOP): " + "; ".join(
            f"{key} {value / 1e9:.2f}" for flops in (res["feature_flops"], res["solve_flops"])
            for key, value in flops.items()), flush=True)

    # ---------------------------------------------------------------- shard
    def shard(self) -> None:
        a = self.args
        n, k = a.shard_n, a.shard_k
        info = self.prep("2l-relu", n, a.n_queries)
        base = {**self.common("2l-relu"), "kind": "shard", "n": n, "k": k, "n_queries": a.n_queries,
                "model_path": info["model_path"], "collective_timeout": a.timeout}
        print(f"\n## shard: projected NTK influence, 2L-ReLU width {a.width}, n = {n:,}, k = {k}: 1 process × 1 "
              "thread vs 2 gloo processes × 1 thread\n", flush=True)
        single = self.run({**base, "name": f"shard-single-n{n}", "distributed": False}, a.timeout, 1)[0]
        ranks = self.run({**base, "name": f"shard-gloo2-n{n}", "distributed": True}, a.timeout, 1, torchrun_nproc=2)
        out: dict[str, Any] = {"single": single, "ranks": ranks}
        self.results["shard"] = out
        if not single["ok"] or not all(r["ok"] for r in ranks):
            print("FAILED: " + "; ".join(r["error"] for r in [single, *ranks] if not r["ok"]))
            return
        rows = []
        for label, r in [("1 process", single)] + [(f"rank {r['rank']} of 2", r) for r in ranks]:
            wall = r["fit_s"] + r["scores_s"]
            s = r["seconds_"]
            rows.append([label, f"{r['bounds'][0]:,}–{r['bounds'][1]:,}", s["features"], s["solve"],
                         s["communication"], s["scores"], r["fit_s"], r["scores_s"],
                         100 * s["communication"] / wall, mib(r["peak_rss"]), r["background_cores"]])
        feat_speedup = single["seconds_"]["features"] / max(r["seconds_"]["features"] for r in ranks)
        fit_speedup = single["fit_s"] / max(r["fit_s"] for r in ranks)
        run_speedup = (single["fit_s"] + single["scores_s"]) / max(r["fit_s"] + r["scores_s"] for r in ranks)
        comm_share = max(r["seconds_"]["communication"] / (r["fit_s"] + r["scores_s"]) for r in ranks)
        out.update({"feature_speedup": feat_speedup, "fit_speedup": fit_speedup, "run_speedup": run_speedup,
                    "communication_share": comm_share,
                    "feature_speedup_ok": feat_speedup >= TARGET_SHARD_SPEEDUP,
                    "communication_ok": comm_share < TARGET_COMM_SHARE})
        print(table(["process", "rows", "features s", "solve s", "communication s", "scores s", "fit wall s",
                     "scores wall s", "communication % of run", "peak RSS MiB", "other load (cores)"], rows))
        print()
        print(table(["metric", "value", "target"], [
            ["feature-phase speed-up", f"{feat_speedup:.2f}×",
             f"{verdict(feat_speedup >= TARGET_SHARD_SPEEDUP)} (≥ {TARGET_SHARD_SPEEDUP}×)"],
            ["fit speed-up (features + solve + communication)", f"{fit_speedup:.2f}×", "–"],
            ["fit + scores speed-up", f"{run_speedup:.2f}×", "–"],
            ["all-reduce + gather share of the run (worst rank)", f"{100 * comm_share:.1f} %",
             f"{verdict(comm_share < TARGET_COMM_SHARE)} (< {100 * TARGET_COMM_SHARE:.0f} %)"],
        ]), flush=True)


def _clean(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in ("scores",)}


# ================================================================================================ command line
PARTS = ("compare", "scale", "gemm", "shard")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="+", choices=(*PARTS, "all"), help="parts to run, in this order")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script in about a minute")
    p.add_argument("--output", help="write every number to this JSON file")
    p.add_argument("--mnist-root", default=str(DEFAULT_MNIST_ROOT),
                   help="MNIST folder (IDX files); default ../shared/data/mnist beside the repository")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "bench_influence"),
                   help="scratch folder (weights, scores, logs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every case but shard's")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per subprocess (not audits)")
    p.add_argument("--audit-timeout", type=float, default=7200.0, help="seconds per audit subprocess")
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="before each case wait up to this many seconds for other processes to leave the CPUs idle")
    p.add_argument("--n-queries", type=int, default=100)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--width", type=int, default=512, help="2L-ReLU width")
    p.add_argument("--relu-epochs", type=int, default=100)
    p.add_argument("--relu-lr", type=float, default=3e-2)
    p.add_argument("--cnn-epochs", type=int, default=20)
    p.add_argument("--cnn-lr", type=float, default=1e-3)
    p.add_argument("--pool-limit", type=int, default=None,
                   help="use at most this many distinct real images (to exercise repetition)")
    p.add_argument("--compare-n", type=int, default=1000)
    p.add_argument("--projection-dim", type=int, default=4096, help="k of ntk-proj and dattri (compare)")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS))
    p.add_argument("--dattri-batch", type=int, default=128, help="batch size of dattri's data loaders")
    p.add_argument("--sizes", nargs="+", type=int, default=[1000, 4000, 16000, 60000])
    p.add_argument("--max-exact-n", type=int, default=None,
                   help="NTKInfluence max_exact_n in the audits (default: the library's)")
    p.add_argument("--scale-projection-dim", type=lambda v: None if v.lower() == "none" else v, default="auto",
                   help="projection_dim of the scale audits: 'auto' (default) or 'none' (exact, in memory or out of "
                   "core)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="NTKInfluence memory_limit_gb in the scale audits (default: 80 %% of the available memory)")
    p.add_argument("--gemm-n", type=int, default=16000)
    p.add_argument("--gemm-k", type=int, default=4096)
    p.add_argument("--shard-n", type=int, default=16000)
    p.add_argument("--shard-k", type=int, default=4096)
    args = p.parse_args(argv)
    if args.quick:
        args.compare_n, args.n_queries, args.projection_dim = 60, 5, 128
        args.relu_epochs, args.cnn_epochs = 5, 1
        args.sizes, args.pool_limit, args.max_exact_n = [100, 600], 500, 300
        args.gemm_n, args.gemm_k, args.shard_n, args.shard_k = 600, 128, 600, 128
        args.dattri_batch = 32
        args.timeout = min(args.timeout, 600.0)
        args.audit_timeout = min(args.audit_timeout, 600.0)
    if args.max_exact_n is None:
        from art_malleability.influence.ntk import DEFAULT_MAX_EXACT_N

        args.max_exact_n = DEFAULT_MAX_EXACT_N
    args.parts = list(PARTS) if "all" in args.parts else list(dict.fromkeys(args.parts))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_case":
        run_case_main(argv[1])
        return
    args = parse_args(argv)
    if not Path(args.mnist_root).is_dir():
        raise SystemExit(f"--mnist-root {args.mnist_root!r} is not a folder")
    bench = Bench(args)
    start = time.perf_counter()
    import platform

    import torch

    bench.results["machine"] = {"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                                "python": platform.python_version(), "platform": platform.platform()}
    bench.results["library_at_start"] = library_state()
    lib = bench.results["library_at_start"]
    print(f"# influence benchmark ({', '.join(args.parts)}){' --quick' if args.quick else ''}: {os.cpu_count()} "
          f"CPUs, torch {torch.__version__}, library {lib['git_head']} (source {lib['source_digest']}), scratch "
          f"{args.workdir}", flush=True)
    for part in args.parts:
        getattr(bench, part)()
        if args.output:
            Path(args.output).write_text(json.dumps(bench.results, indent=1, default=_json_default))
    bench.results["wall_s"] = time.perf_counter() - start
    print(f"\nall parts in {bench.results['wall_s']:.0f} s")
    if args.output:
        Path(args.output).write_text(json.dumps(bench.results, indent=1, default=_json_default))
        print(f"numbers in {args.output}")


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


if __name__ == "__main__":
    main()
