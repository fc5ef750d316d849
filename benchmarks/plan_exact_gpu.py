"""
Planning table: what the exact NTK influence audit is expected to cost on one and several GPUs.

With ``--measure`` (the default on a CUDA device) the efficiencies are measured on this device in the same run;
otherwise the table is a plan, not a measurement. It combines

- ``D``, the elements of one example's Jacobian factors (the multiply-adds of one kernel entry), **measured** here for
  each model with the package's own kernel engine (``JacobianGram.factor_elements``, compressed) with ``--method``
  (default ``"batched"``, what ``"auto"`` runs on a CUDA device);
- the exact solve's memory per device from the package's own plan (``exact_plan``: dense, tiles in device memory
  dealt out over the devices, or tiles on disk), with 80 % of the device memory as the budget;
- the device's fp64 GEMM rate: measured with ``torch.mm`` when the script runs on a CUDA device, otherwise the
  vendor's peak fp64 tensor-core rate given with ``--tflops`` (stated in the output);
- the share of that rate the kernel and the solve reach: with ``--measure``, timed here (each model's kernel of
  ``n`` random inputs by ``JacobianGram.gram`` in float64; a dense ``DualRidge`` fit and a Schur update of a tenth
  of the rows of a random kernel), counted as the planned work divided by the time, so that they enter the plan as
  they are; otherwise the efficiencies the package assumes (``KERNEL_EFFICIENCY`` for the kernel, measured 66-75 %
  of fp64 GEMM on the CPU for the SmallCNN and the 2L-ReLU at 10,000 examples, 0.2-0.8 % on an H200;
  ``SOLVE_EFFICIENCY`` for the factorisations, measured 45-59 % on the CPU, 33-34 % on an H200).

The audit's work: the kernel (``2 n² D``) plus the kernel columns of the changed rows of every attack and control
draw (``8 × 2 m n D`` with ``m = n / 10``: 3 attacks and 5 draws), two factorisations with their inverses
(``4 n³ / 3``) and eight Schur updates (``8 × 2 (n − m)² m``).

    python benchmarks/plan_exact_gpu.py                                  # vendor peak rates, this machine's D
    python benchmarks/plan_exact_gpu.py --devices 1 8 --memory-gb 80 141 --tflops 67
    python benchmarks/plan_exact_gpu.py --measure --scale 0.1                   # measured, smaller sizes (CPU)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from art_malleability.influence.ntk_memory import (
    KERNEL_EFFICIENCY,
    SOLVE_EFFICIENCY,
    exact_bytes,
    exact_plan,
    gemm_rate,
)
from art_malleability.linalg.ridge import DualRidge
from art_malleability.models import TwoLayerReLU, build_architecture
from art_malleability.ntk.empirical import JacobianGram

UPDATES = 8  # 3 attacks and 5 control draws
MODELS = {  # name: (builder, input shape, training examples of the whole training set, kernel size measured)
    "2L-ReLU (w512), MNIST": (lambda: TwoLayerReLU(784, 512, 10), (784,), 60_000, 8192),
    "SmallCNN, MNIST": (lambda: build_architecture("cnn", (1, 28, 28), 10), (1, 28, 28), 60_000, 4096),
    "ResNet-20, CIFAR-10": (lambda: build_architecture("resnet20", (3, 32, 32), 10), (3, 32, 32), 50_000, 1024),
    "ResNet-18 (torchvision), CIFAR-10": (lambda: _resnet18(), (3, 32, 32), 50_000, 64),
}
SOLVE_N = 32_768  # the measured dense solve's size (scaled with --scale)


def _resnet18() -> torch.nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=10)


def factor_elements(builder, shape: tuple[int, ...], method: str) -> int:
    model = builder().double().eval()
    probe = np.random.default_rng(0).normal(size=(2, *shape))
    return int(JacobianGram(model, method=method).factor_elements(probe))


def _seconds(work, device: torch.device) -> float:
    """Seconds of ``work()`` on ``device`` (synchronised), after one untimed call of ``work`` as a warm-up."""
    for timed in (False, True):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if timed:
            return time.perf_counter() - start
    raise AssertionError  # pragma: no cover


def measured_rate(device: torch.device, size: int) -> float:
    """fp64 ``torch.mm`` rate of two ``size × size`` matrices on ``device`` (flop/s)."""
    a = torch.randn((size, size), dtype=torch.float64, device=device)
    out = torch.empty_like(a)
    return 2.0 * size**3 / _seconds(lambda: torch.mm(a, a, out=out), device)


def kernel_efficiency(builder, shape: tuple[int, ...], n: int, d: int, rate: float, device: torch.device,
                      method: str) -> float:
    """Planned kernel work ``2 n² D`` over the measured time of ``JacobianGram.gram`` of ``n`` inputs, over ``rate``."""
    model = builder().double().to(device).eval()
    x = torch.randn((n, *shape), dtype=torch.float64, device=device)
    engine = JacobianGram(model, method=method)
    engine.gram(x[: min(n, 8)])  # plans the layers before the timed calls
    return 2.0 * n * n * d / _seconds(lambda: engine.gram(x), device) / rate


def solve_efficiency(n: int, rate: float, device: torch.device) -> tuple[float, float, int]:
    """
    ``(fit, update, peak bytes)``: the dense exact solve's planned work over its measured time, over ``rate``, for a
    fit (``2 n³ / 3``, the factorisation with its inverse) and a Schur update of ``m = n / 10`` rows
    (``2 (n − m)² m``), on a random positive definite kernel; peak device memory of the fit on CUDA (0 on the CPU).
    """
    g = torch.Generator(device=device).manual_seed(0)
    features = torch.randn((n, 256), dtype=torch.float64, device=device, generator=g)
    targets = torch.randn((n, 10), dtype=torch.float64, device=device, generator=g)
    m = n // 10
    changed = np.arange(0, n, 10)[:m]
    moved = features.clone()
    moved[changed] += 0.1
    rows = moved[changed] @ moved.T
    solver = DualRidge(1e-3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fit = _seconds(lambda: solver.fit(features @ features.T, targets), device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    update = _seconds(lambda: solver.update(changed, rows), device)
    return 2.0 * n**3 / 3.0 / fit / rate, 2.0 * (n - m) ** 2 * m / update / rate, peak


def audit_seconds(n: int, d: int, rate: float, devices: int, kernel_eff: float = KERNEL_EFFICIENCY,
                  solve_eff: tuple[float, float] = (SOLVE_EFFICIENCY, SOLVE_EFFICIENCY)) -> tuple[float, float]:
    """``(kernel seconds, solve seconds)`` of the whole audit on ``devices`` devices of ``rate`` flop/s each."""
    m = n // 10
    kernel = (2.0 * n * n * d + UPDATES * 2.0 * m * n * d) / kernel_eff
    solve = 4.0 * n**3 / 3.0 / solve_eff[0] + UPDATES * 2.0 * (n - m) ** 2 * m / solve_eff[1]
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
    parser.add_argument("--measure", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available(),
                        help="time the kernel and the solve on this machine's device (default: on a CUDA device)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the measured sizes (kernels, solve)")
    parser.add_argument("--method", default="batched", choices=["auto", "structured", "batched", "jacobian"],
                        help="the kernel engine's method whose D and rate enter the plan (default: what 'auto' runs "
                             "on a CUDA device)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.measure:
        rate = measured_rate(device, max(256, int(8192 * min(args.scale, 1.0))))
        source = f"measured here on {torch.cuda.get_device_name() if device.type == 'cuda' else 'the CPU'}"
    elif device.type == "cuda":
        rate, source = gemm_rate(device), f"measured here on {torch.cuda.get_device_name()}"
    else:
        rate, source = args.tflops * 1e12, f"vendor peak fp64, {args.tflops:g} TFLOP/s (no CUDA device here)"
    solve_eff = (SOLVE_EFFICIENCY, SOLVE_EFFICIENCY)
    print(f"fp64 GEMM rate per device: {rate / 1e12:.2f} TFLOP/s ({source})", flush=True)
    if args.measure:
        n_solve = max(512, int(SOLVE_N * args.scale))
        fit, update, peak = solve_efficiency(n_solve, rate, device)
        solve_eff = (fit, update)
        print(f"dense solve, n = {n_solve:,}: fit at {fit:.0%}, Schur update of n/10 rows at {update:.0%} of it "
              f"(measured); peak {peak / 2**30:.1f} GiB on the device, plan {exact_bytes(n_solve, device) / 2**30:.1f}",
              flush=True)
    else:
        print(f"kernel at {KERNEL_EFFICIENCY:.0%}, solve at {SOLVE_EFFICIENCY:.0%} of it (assumed)")
    print("\nLargest n with the tiles in device memory (80 % of it):")
    for memory in args.memory_gb:
        for devices in args.devices:
            print(f"- {memory:g} GB × {devices}: n ≈ {largest_n(int(0.8 * memory * 2**30), devices):,}")
    print("\n| model | n | D (measured) | kernel share of GEMM | memory per device | devices | plan per device "
          "| kernel | solve | audit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (builder, shape, n, n_kernel) in MODELS.items():
        d = factor_elements(builder, shape, args.method)
        kernel_eff, how = KERNEL_EFFICIENCY, "assumed"
        if args.measure:
            size = max(16, int(n_kernel * args.scale))
            kernel_eff = kernel_efficiency(builder, shape, size, d, rate, device, args.method)
            how = f"measured, n = {size:,}"
        for memory in args.memory_gb:
            budget = int(0.8 * memory * 2**30)
            for devices in args.devices:
                plan = exact_plan(n, budget, torch.device("cuda"), devices)
                where = ("does not fit" if plan is None else "dense" if plan[0] is None
                         else f"tiles of {plan[0]:,} {'on disk' if plan[1] else 'in memory'}")
                kernel, solve = audit_seconds(n, d, rate, devices, kernel_eff, solve_eff)
                print(f"| {name} | {n:,} | {d:,} | {kernel_eff:.1%} ({how}) | {memory:g} GB | {devices} | {where} | "
                      f"{kernel / 60:.1f} min | {solve / 60:.1f} min | {(kernel + solve) / 60:.1f} min |", flush=True)


if __name__ == "__main__":
    main()
