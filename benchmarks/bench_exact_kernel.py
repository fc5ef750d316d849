"""
Benchmark: the exact NTK influence's kernel (``JacobianGram.gram`` of the whole training set, float64) against the
machine's GEMM rate measured in the same run.

For each model the script builds the kernel engine the way the exact NTK influence does within a memory budget
(``--memory-limit-gb``: the chunk budget of ``engine_chunk_mb``, as in ``NTKInfluence._engine``), times the
``n × n`` kernel of ``n`` random MNIST- or CIFAR-shaped inputs, and prints

- the kernel's work as the plan counts it (``2 n² D``, ``D`` the elements of one example's Jacobian factors), its
  rate, and that rate as a share of the fp64 and fp32 GEMM rates (``torch.mm`` of two 4096² matrices, best of three,
  measured in the same run);
- how many examples' factors were computed (``n`` when they are all kept; otherwise ``n`` plus the streamed blocks,
  once per panel of kept rows) and the panel's size (at most, from the compressed ``D``);
- the peak resident memory of the call (sampled every millisecond, above the level before it).

    python benchmarks/bench_exact_kernel.py                       # SmallCNN, n = 10,000, budget 6 GB
    python benchmarks/bench_exact_kernel.py --models cnn 2l-relu resnet20 --n 2000
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import PeakMemory, gemm_rate

from art_malleability.influence.ntk_memory import engine_chunk_mb
from art_malleability.models import TwoLayerReLU, build_architecture
from art_malleability.ntk.empirical import JacobianGram

MODELS = {
    "2l-relu": (lambda: TwoLayerReLU(784, 512, 10), (784,)),
    "cnn": (lambda: build_architecture("cnn", (1, 28, 28), 10), (1, 28, 28)),
    "resnet20": (lambda: build_architecture("resnet20", (3, 32, 32), 10), (3, 32, 32)),
}


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
    fp64, fp32 = gemm_rate(torch.float64) * 1e9, gemm_rate(torch.float32) * 1e9
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
        engine = JacobianGram(model, chunk_mb=engine_chunk_mb(n, budget))
        d = engine.factor_elements(x)
        counted = _count_features(engine)
        with PeakMemory(torch.device("cpu")) as memory:
            start = time.perf_counter()
            engine.gram(x)
            seconds = time.perf_counter() - start
        panel = "all" if sum(counted) == n else f"{engine.panel_rows():,}"
        rate, peak_gb = 2.0 * n * n * d / seconds, memory.peak_mib * 2**20 / 1e9
        print(f"| {name} | {n:,} | {d:,} | {args.memory_limit_gb:g} GB | {panel} | {sum(counted):,} | {seconds:.1f} | "
              f"{rate / 1e9:.1f} | {rate / fp64:.0%} | {rate / fp32:.0%} | {peak_gb:.2f} GB |", flush=True)


if __name__ == "__main__":
    main()
