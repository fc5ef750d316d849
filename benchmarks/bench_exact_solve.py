"""
Benchmark: the exact NTK influence's dual solve in its three forms against the in-memory dense solve, on the CPU.

The solve of the exact mode (:class:`art_malleability.linalg.ridge.DualRidge`) on one kernel: the base fit
(factor and inverse of ``A = K + λI``), one update of ``m = n / 10`` changed rows (the audit's top set: a second
factor, of ``A_QQ``, and the Schur complement), and the leave-one-out parts of 100 queries. Cases, each in its own
process so that its peak resident set size (``ru_maxrss``, reported by the process itself) is its own:

- ``dense``: two ``n × n`` float64 matrices, LAPACK in place (one process, ``--threads`` threads);
- ``tiles-memory``: lower tiles in memory (one process);
- ``tiles-disk``: the same tiles in files of a temporary folder (one process);
- ``sharded``: tiles in memory dealt out over ``--ranks`` ``gloo`` processes launched by ``torchrun``, one thread
  each (the same cores as the other cases); several counts (``--ranks 2 4``) show how the peak per process falls.

The tiled cases hand the update its changed rows as a function of the kernel columns, as the audit does, so each
process computes and holds only the blocks of its own tile rows; the dense case gets the ``m × n`` rows whole.

The kernel is ``K = Φ Φᵀ / r`` with seeded Gaussian ``Φ`` (``n × r``, ``r = 256``) plus the ridge ``1e-3``: the
solve does not depend on where the kernel comes from (its time is ``O(n³)`` whatever the model), and a kernel
computed from features keeps the benchmark about the solve. Each case reports its wall time per step, its peak
RSS, its rate against fp64 GEMM (``torch.mm``, 4096², best of three, measured in the same run with the same
threads per process, times the processes: ``n³/3`` for a Cholesky and ``n³/3`` for a triangular inverse,
twice, divided by their time) and the
largest difference of ``α`` and of the query factors ``b`` from the dense case relative to their largest
entry (target 1e-8).

    python benchmarks/bench_exact_solve.py --n 8000              # about 10 minutes on 2 cores
    python benchmarks/bench_exact_solve.py --n 2000 --cases dense sharded
    python benchmarks/bench_exact_solve.py --n 16000 --cases tiles-memory sharded --ranks 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import gemm_rate, peak_rss_bytes

CASES = ("dense", "tiles-memory", "tiles-disk", "sharded")
RANK = 256
RIDGE = 1e-3


def problem(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor, torch.Tensor]:
    """``(Φ, targets, changed, new rows of Φ, query features)``, seeded."""
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn((n, RANK), generator=gen, dtype=torch.float64) / RANK**0.5
    targets = torch.nn.functional.one_hot(torch.randint(0, 10, (n,), generator=gen), 10).to(torch.float64)
    changed = np.sort(np.random.default_rng(seed).choice(n, size=max(1, n // 10), replace=False))
    new_rows = phi[torch.as_tensor(changed)] + 0.1 * torch.randn((len(changed), RANK), generator=gen,
                                                                  dtype=torch.float64) / RANK**0.5
    queries = torch.randn((100, RANK), generator=gen, dtype=torch.float64) / RANK**0.5
    return phi, targets, changed, new_rows, queries


def run_case(case: str, n: int, out: Path, block: int | None) -> None:
    """One case in this process (every rank of the sharded case calls it); rank 0 writes ``out/<case>.json``."""
    from art_malleability.distributed import ONE_PROCESS, init_from_env
    from art_malleability.linalg.ridge import DualRidge

    shard = init_from_env("gloo") if case == "sharded" else ONE_PROCESS
    world = shard.world_size
    phi, targets, changed, new_rows, queries = problem(n)
    new_phi = phi.clone()
    new_phi[torch.as_tensor(changed)] = new_rows

    def rows(cols: np.ndarray) -> torch.Tensor:
        return new_rows @ new_phi[torch.as_tensor(cols)].T

    if case == "dense":
        solver, kernel = DualRidge(RIDGE), phi @ phi.T
        rows = rows(np.arange(n))
    else:
        size = block or min(2048, -(-n // (4 * world)))
        folder = tempfile.mkdtemp(prefix="bench-exact-") if case == "tiles-disk" else None
        solver = DualRidge(RIDGE, block=size, folder=folder, group=shard)

        def kernel(r: np.ndarray, c: np.ndarray) -> torch.Tensor:
            return phi[torch.as_tensor(r)] @ phi[torch.as_tensor(c)].T

    seconds = {}
    start = time.perf_counter()
    solver.fit(kernel, targets)
    seconds["fit"] = time.perf_counter() - start
    start = time.perf_counter()
    solver.update(changed, rows)
    seconds["update"] = time.perf_counter() - start
    start = time.perf_counter()
    _, b, _ = solver.loo_parts(queries @ new_phi.T)
    seconds["queries"] = time.perf_counter() - start
    alpha = solver.alpha_.numpy()
    solver.close()
    if case == "tiles-disk":
        os.rmdir(folder)  # the solver removed its own subfolder
    peak = torch.tensor([peak_rss_bytes()], dtype=torch.int64)
    peaks = shard.all_gather_rows(peak).tolist()
    if shard.rank == 0:
        name = case if case != "sharded" else f"{case}-{world}"
        np.savez(out / f"{name}.npz", alpha=alpha, b=b.numpy())
        record = {"case": case, "world": world, "seconds": seconds, "peak_rss": peaks, "gemm": gemm_rate(torch.float64)}
        (out / f"{name}.json").write_text(json.dumps(record))
    if shard.world_size > 1:  # leave the group together: a rank that exits alone aborts in gloo's threads
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(case: str, n: int, out: Path, threads: int, ranks: int, block: int | None) -> None:
    spec = json.dumps({"case": case, "n": n, "out": str(out), "block": block})
    env = {**os.environ, "OMP_NUM_THREADS": str(1 if case == "sharded" else threads), "BENCH_EXACT_SOLVE": spec}
    args = [__file__]
    if case == "sharded":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    else:
        command = [sys.executable, *args]
    subprocess.run(command, check=True, env=env, timeout=6 * 3600)


def report(n: int, out: Path, cases: list[str]) -> None:
    flops = 2 * 2 * n**3 / 3  # two factorisations (base and A_QQ), each a Cholesky and a triangular inverse
    reference = np.load(out / "dense.npz") if (out / "dense.npz").exists() else None
    print(f"\nExact dual solve, n = {n:,} (fit, update of {n // 10:,} rows, 100 queries)\n")
    print("| case | processes | fit s | update s | queries s | total s | vs dense | share of fp64 GEMM | "
          "peak RSS per process (GB) | max diff α / b |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    dense_total = None
    for case in cases:
        record = json.loads((out / f"{case}.json").read_text())
        case = record["case"]
        sec = record["seconds"]
        total = sum(sec.values())
        dense_total = total if case == "dense" else dense_total
        share = flops / (sec["fit"] + sec["update"]) / 1e9 / (record["gemm"] * record["world"])
        diff = "–"
        if reference is not None and case != "dense":
            found = np.load(out / f"{case if record['world'] == 1 else case + '-' + str(record['world'])}.npz")
            diff = " / ".join(
                f"{np.abs(found[k] - reference[k]).max() / np.abs(reference[k]).max():.1e}" for k in ("alpha", "b")
            )
        ratio = f"{total / dense_total:.2f}×" if dense_total else "–"
        rss = " / ".join(f"{p / 1e9:.2f}" for p in record["peak_rss"])
        print(f"| {case} | {record['world']} | {sec['fit']:.1f} | {sec['update']:.1f} | {sec['queries']:.2f} | "
              f"{total:.1f} | {ratio} | {share:.0%} | {rss} | {diff} |")
    print(f"\nfp64 GEMM (4096², best of 3): {json.loads((out / f'{cases[0]}.json').read_text())['gemm']:.1f} GFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8000)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2], help="processes of the sharded case")
    parser.add_argument("--block", type=int, default=None, help="tile size (default: n / (4 ranks), at most 2048)")
    if "BENCH_EXACT_SOLVE" in os.environ:  # a case's process (its settings in the environment)
        spec = json.loads(os.environ["BENCH_EXACT_SOLVE"])
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        run_case(spec["case"], spec["n"], Path(spec["out"]), spec["block"])
        return
    args = parser.parse_args()
    cases = sorted(args.cases, key=CASES.index)
    names = []
    with tempfile.TemporaryDirectory(prefix="bench-exact-solve-") as out:
        for case in cases:
            for ranks in args.ranks if case == "sharded" else [1]:
                print(f"running {case} ({ranks} process{'es' if ranks > 1 else ''}) ...", flush=True)
                launch(case, args.n, Path(out), args.threads, ranks, args.block)
                names.append(case if case != "sharded" else f"{case}-{ranks}")
        report(args.n, Path(out), names)


if __name__ == "__main__":
    main()
