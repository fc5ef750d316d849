"""
Planning table: what the exact NTK influence audit is expected to cost on one and several GPUs.

Not a measurement on a GPU (none was available where the numbers in docs/scale.md were made): the table combines

- ``D``, the elements of one example's Jacobian factors (the multiply-adds of one kernel entry), **measured** here for
  each model with the package's own kernel engine (``JacobianGram.factor_elements``, compressed, as ``"auto"`` counts
  it);
- the exact solve's memory per device from the package's own plan (``exact_plan``: dense, tiles in device memory
  dealt out over the devices, or tiles on disk), with 80 % of the device memory as the budget;
- the device's fp64 GEMM rate: measured with ``torch.mm`` when the script runs on a CUDA device, otherwise the
  vendor's peak fp64 tensor-core rate given with ``--tflops`` (stated in the output);
- the efficiencies the package assumes (``KERNEL_EFFICIENCY`` for the kernel, measured 7-48 % of fp64 GEMM on the
  CPU; ``SOLVE_EFFICIENCY`` for the factorisations, measured 45-59 %).

The audit's work: the kernel (``2 n² D``) plus the kernel columns of the changed rows of every attack and control
draw (``8 × 2 m n D`` with ``m = n / 10``: 3 attacks and 5 draws), two factorisations with their inverses
(``4 n³ / 3``) and eight Schur updates (``8 × 2 (n − m)² m``).

    python benchmarks/plan_exact_gpu.py                                  # vendor peak rates, this machine's D
    python benchmarks/plan_exact_gpu.py --devices 1 8 --memory-gb 80 141 --tflops 67
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from art_malleability.architectures import build_architecture
from art_malleability.influence._ntk_memory import (
    KERNEL_EFFICIENCY,
    SOLVE_EFFICIENCY,
    exact_plan,
    gemm_rate,
)
from art_malleability.models import TwoLayerReLU
from art_malleability.ntk.empirical import JacobianGram

UPDATES = 8  # 3 attacks and 5 control draws
MODELS = {  # name: (builder, input shape, training examples of the whole training set)
    "2L-ReLU (w512), MNIST": (lambda: TwoLayerReLU(784, 512, 10), (784,), 60_000),
    "SmallCNN, MNIST": (lambda: build_architecture("cnn", (1, 28, 28), 10), (1, 28, 28), 60_000),
    "ResNet-20, CIFAR-10": (lambda: build_architecture("resnet20", (3, 32, 32), 10), (3, 32, 32), 50_000),
    "ResNet-18 (torchvision), CIFAR-10": (lambda: _resnet18(), (3, 32, 32), 50_000),
}


def _resnet18() -> torch.nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=10)


def factor_elements(builder, shape: tuple[int, ...]) -> int:
    model = builder().double().eval()
    probe = np.random.default_rng(0).normal(size=(2, *shape))
    return int(JacobianGram(model).factor_elements(probe))


def audit_seconds(n: int, d: int, rate: float, devices: int) -> tuple[float, float]:
    """``(kernel seconds, solve seconds)`` of the whole audit on ``devices`` devices of ``rate`` flop/s each."""
    m = n // 10
    kernel = (2.0 * n * n * d + UPDATES * 2.0 * m * n * d) / KERNEL_EFFICIENCY
    solve = (4.0 * n**3 / 3.0 + UPDATES * 2.0 * (n - m) ** 2 * m) / SOLVE_EFFICIENCY
    return kernel / rate / devices, solve / rate / devices


def largest_n(budget: int, devices: int) -> int:
    """The largest ``n`` (to 1,000) whose tiles stay in device memory."""
    low, high = 1000, 10_000_000
    while high - low > 1000:
        mid = (low + high) // 2
        plan = exact_plan(mid, budget, torch.device("cuda"), devices)
        low, high = (mid, high) if plan is not None and not plan[1] else (low, mid)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--memory-gb", type=float, nargs="+", default=[80.0, 141.0])
    parser.add_argument("--tflops", type=float, default=67.0,
                        help="fp64 GEMM rate per device when no CUDA device is here (vendor peak; default: H100/H200)")
    args = parser.parse_args()
    if torch.cuda.is_available():
        rate, source = gemm_rate(torch.device("cuda")), f"measured here on {torch.cuda.get_device_name()}"
    else:
        rate, source = args.tflops * 1e12, f"vendor peak fp64, {args.tflops:g} TFLOP/s (no CUDA device here)"
    print(f"fp64 GEMM rate per device: {rate / 1e12:.1f} TFLOP/s ({source}); kernel at {KERNEL_EFFICIENCY:.0%}, "
          f"solve at {SOLVE_EFFICIENCY:.0%} of it\n")
    print("| model | n | D (measured) | memory per device | devices | plan per device | kernel | solve | audit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (builder, shape, n) in MODELS.items():
        d = factor_elements(builder, shape)
        for memory in args.memory_gb:
            budget = int(0.8 * memory * 2**30)
            for devices in args.devices:
                plan = exact_plan(n, budget, torch.device("cuda"), devices)
                where = ("does not fit" if plan is None else "dense" if plan[0] is None
                         else f"tiles of {plan[0]:,} {'on disk' if plan[1] else 'in memory'}")
                kernel, solve = audit_seconds(n, d, rate, devices)
                print(f"| {name} | {n:,} | {d:,} | {memory:g} GB | {devices} | {where} | {kernel / 60:.1f} min | "
                      f"{solve / 60:.1f} min | {(kernel + solve) / 60:.1f} min |")
    print("\nLargest n with the tiles in device memory (80 % of it):")
    for memory in args.memory_gb:
        for devices in args.devices:
            print(f"- {memory:g} GB × {devices}: n ≈ {largest_n(int(0.8 * memory * 2**30), devices):,}")


if __name__ == "__main__":
    main()
