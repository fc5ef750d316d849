"""
Benchmark: the exact NTK influence's kernel (``JacobianGram.gram`` of the whole training set, float64) against the
machine's GEMM rate measured in the same run.

For each model the script builds the kernel engine the way the exact NTK influence does within a memory budget
(``--memory-limit-gb``: the chunk budget is a third of what the two ``n × n`` matrices leave, as in
``NTKInfluence._engine``), times the ``n × n`` kernel of ``n`` random MNIST- or CIFAR-shaped inputs, and prints

- the kernel's work as the plan counts it (``2 n² D``, ``D`` the elements of one example's Jacobian factors), its
  rate, and that rate as a share of the fp64 and fp32 GEMM rates (``torch.mm`` of two 4096² matrices, best of three,
  measured in the same run);
- how many examples' factors were computed (``n`` when they are all kept; otherwise ``n`` plus the streamed blocks,
  once per panel of kept rows) and the panel's size (at most, from the compressed ``D``);
- the peak resident memory of the call (sampled every 10 ms, above the level before it).

    python benchmarks/bench_exact_kernel.py                       # SmallCNN, n = 10,000, budget 6 GB
    python benchmarks/bench_exact_kernel.py --models cnn 2l-relu resnet20 --n 2000
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil
import torch

from art_malleability.architectures import build_architecture
from art_malleability.influence._ntk_memory import exact_bytes
from art_malleability.models import TwoLayerReLU
from art_malleability.ntk._memory import DEFAULT_CHUNK_MB
from art_malleability.ntk.empirical import JacobianGram

MODELS = {
    "2l-relu": (lambda: TwoLayerReLU(784, 512, 10), (784,)),
    "cnn": (lambda: build_architecture("cnn", (1, 28, 28), 10), (1, 28, 28)),
    "resnet20": (lambda: build_architecture("resnet20", (3, 32, 32), 10), (3, 32, 32)),
}


def gemm_rate(dtype: torch.dtype, size: int = 4096) -> float:
    a = torch.randn((size, size), dtype=dtype)
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, a, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


class PeakRSS:
    """Peak resident set size above the level at the start, sampled every 10 ms."""

    def __enter__(self) -> PeakRSS:
        self._process, self._stop = psutil.Process(), threading.Event()
        self.start = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def added(self) -> int:
        return self.peak - self.start


def _count_features(engine: JacobianGram) -> list[int]:
    """Wrap ``engine.features`` so that the returned list receives the size of every batch it computes."""
    counted: list[int] = []
    features = engine.features

    def counting(x: torch.Tensor, y: torch.Tensor | None = None):
        counted.append(len(x))
        return features(x, y)

    engine.features = counting
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["cnn"])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--memory-limit-gb", type=float, default=6.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    fp64, fp32 = gemm_rate(torch.float64), gemm_rate(torch.float32)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}: fp64 GEMM {fp64 / 1e9:.1f} GFLOP/s, "
          f"fp32 {fp32 / 1e9:.1f} GFLOP/s (measured in this run)\n")
    print("| model | n | D | budget | panel (rows) | factors computed | seconds | GFLOP/s | % of fp64 GEMM "
          "| % of fp32 GEMM | peak RSS added |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    n, budget = args.n, int(args.memory_limit_gb * 2**30)
    for name in args.models:
        builder, shape = MODELS[name]
        model = builder().double().eval()
        x = torch.rand((n, *shape), dtype=torch.float64)
        spare = max(budget - exact_bytes(n), 0)
        engine = JacobianGram(model, chunk_mb=max(DEFAULT_CHUNK_MB, min(spare / 3, 8 * 2**30) / 2**20))
        d = engine.factor_elements(x)
        counted = _count_features(engine)
        with PeakRSS() as memory:
            start = time.perf_counter()
            engine.gram(x)
            seconds = time.perf_counter() - start
        panel = "all" if sum(counted) == n else f"{engine.panel_rows():,}"
        rate = 2.0 * n * n * d / seconds
        print(f"| {name} | {n:,} | {d:,} | {args.memory_limit_gb:g} GB | {panel} | {sum(counted):,} | {seconds:.1f} | "
              f"{rate / 1e9:.1f} | {rate / fp64:.0%} | {rate / fp32:.0%} | {memory.added / 1e9:.2f} GB |", flush=True)


if __name__ == "__main__":
    main()
