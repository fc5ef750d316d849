"""
The memory and time of the NTK influence: what its large buffers take in each mode, the budget they may take, and
what its modes are estimated to cost on this machine.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from art_malleability._utils.torch_utils import available_memory
from art_malleability.distributed import ONE_PROCESS, Shard
from art_malleability.ntk.empirical import DEFAULT_CHUNK_MB, JacobianGram

#: Share of the available memory the large matrices may take when no ``memory_limit_gb`` is set.
MEMORY_SHARE = 0.8
_GIB = 2**30


def exact_bytes(n: int, device: torch.device | None = None) -> int:
    """
    Bytes of the exact mode's large buffers: two ``n × n`` float64 matrices on the CPU (five on
    other devices, where the factorisation needs temporaries) and the kernel engine's chunks.
    """
    matrices = 2 if device is None or device.type == "cpu" else 5
    return 8 * matrices * n * n + 3 * int(DEFAULT_CHUNK_MB * 2**20)


def engine_chunk_mb(n: int, budget: int, device: torch.device | None = None) -> float:
    """
    The exact kernel engine's chunk budget (MiB): a third of what the two ``n × n`` matrices leave of ``budget``
    (raw gradients, and kept factors or a panel with one more block, take three chunks), at most 8 GiB, at least
    the default.
    """
    spare = max(budget - exact_bytes(n, device), 0)
    return max(DEFAULT_CHUNK_MB, min(spare / 3, 8 * _GIB) / 2**20)


def tiled_block(
    n: int, budget: int, changed_share: float = 0.1, world: int = 1, device: torch.device | None = None
) -> int | None:
    """
    The tile size of the out-of-core exact mode (tiles on disk) within a memory budget per process, or ``None`` when
    even that does not fit. In memory at once: the tiles of one block row or column (``n × b``) twice over (a factor's
    panel and its inverse's column), and the blocks of an update of ``m = changed_share · n`` rows
    (:func:`update_bytes`).

    :param n: Training examples.
    :param budget: Bytes per process.
    :param changed_share: Share of rows an update changes (the audit's top set).
    :param world: Processes of the group.
    :param device: The compute device.
    :return: The tile size (rows), between 32 and 4,096.
    """
    spare = budget - update_bytes(n, changed_share, world, device)
    if spare <= 0:
        return None
    block = min(4096, n, spare // (2 * 8 * max(n, 1)))
    return int(block) if block >= min(32, n) else None


def update_bytes(n: int, changed_share: float = 0.1, world: int = 1, device: torch.device | None = None) -> int:
    """
    Bytes per process beside the tiles during an update of ``m = changed_share · n`` rows: two sets of
    ``(n − m) × m`` blocks dealt out over the ``world`` processes by tile row (the kernel columns ``A_QP`` or
    ``M A_QP``, then ``X``), five ``m × m`` matrices on the CPU (``A_PP``, the Gram matrix and its sum over the
    processes, the Schur complement, its factor; three more elsewhere, where the factorisation needs temporaries) and
    the kernel engine's chunks.
    """
    m = int(changed_share * n + 1)
    squares = 5 if device is None or device.type == "cpu" else 8
    return 8 * (2 * m * max(n - m, 0) // world + squares * m * m) + 3 * int(DEFAULT_CHUNK_MB * 2**20)


def exact_plan(
    n: int, budget: int, device: torch.device | None = None, world: int = 1
) -> tuple[int | None, bool] | None:
    """
    How the exact mode's dual solve runs within a memory budget per process, the cheapest way that fits:

    - ``(None, False)``: one ``n × n`` matrix pair in memory (:func:`exact_bytes`; one process only);
    - ``(block, False)``: lower tiles in memory, dealt out over the ``world`` processes (each holds about
      ``8 n² / (2 world)`` bytes, plus a block column of tiles and its share of the update's blocks);
    - ``(block, True)``: the same tiles in files of a temporary folder (:func:`tiled_block`);
    - ``None``: nothing fits.

    :param n: Training examples.
    :param budget: Bytes per process.
    :param device: The compute device.
    :param world: Processes of the group.
    :return: ``(block, on_disk)`` or ``None``.
    """
    if world == 1 and exact_bytes(n, device) <= budget:
        return None, False
    block = int(min(2048, max(1, -(-n // (4 * world)))))
    if 8 * (n * n // (2 * world) + 3 * n * block) + update_bytes(n, world=world, device=device) <= budget:
        return block, False
    block = tiled_block(n, budget, world=world, device=device)
    return None if block is None else (block, True)


def projected_bytes(n_local: int, n_total: int, k: int) -> int:
    """Bytes of the projected mode's large buffers (primal: ``Φ``, four ``k × k``; dual: two ``Φ``, two ``n × n``)."""
    if n_total <= k:
        return 16 * n_total * k + 16 * n_total * n_total + int(DEFAULT_CHUNK_MB * 2**20)
    return 8 * n_local * k + 32 * k * k + 8 * 8192 * k + int(DEFAULT_CHUNK_MB * 2**20)


def memory_budget(memory_limit_gb: float | None, device: torch.device, shard: Shard = ONE_PROCESS) -> int:
    """
    Bytes the large matrices may take: ``memory_limit_gb``, or 80 % of the memory available on
    the device when the fit starts. In a sharded run the processes of one machine share it
    (``LOCAL_WORLD_SIZE``, set by ``torchrun``), and every process uses the smallest budget of all.

    :param memory_limit_gb: The estimator's ``memory_limit_gb`` (GiB), or ``None``.
    :param device: The compute device.
    :param shard: The process group.
    :return: The budget in bytes.
    """
    if memory_limit_gb is not None:
        budget = int(float(memory_limit_gb) * _GIB)
    else:
        budget = int(MEMORY_SHARE * available_memory(device))
    if shard.world_size > 1:  # the processes of a machine share its memory
        budget //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return -int(shard.all_reduce(torch.tensor([-budget], dtype=torch.int64), "max")[0])


#: Share of the fp64 GEMM rate the exact kernel reaches as a whole, where the time of the Jacobian factors is not
#: measured (``benchmarks/plan_exact_gpu.py`` without a device). Measured on the CPU: 66-75 % for the SmallCNN and the
#: 2L-ReLU at 10,000 examples, 9 % for ResNet-20 at 400 (``benchmarks/bench_exact_kernel.py``); the lower end of the
#: first two is assumed.
KERNEL_EFFICIENCY = 0.15
#: Share of the fp64 GEMM rate of the kernel's contraction of computed factors (``2 n² D``), beside the time of the
#: factors themselves, which ``"auto"`` measures (measured: the whole kernel at 66-75 % of the rate with the factors'
#: time in it; the contraction alone is assumed at 50 %, so that an estimate errs long).
CONTRACTION_EFFICIENCY = 0.5
#: Share of the fp64 GEMM rate the blocked factorisation and inverse reach (benchmarks/bench_exact_solve.py).
SOLVE_EFFICIENCY = 0.5

_RATES: dict[str, float] = {}


def gemm_rate(device: torch.device, shard: Shard = ONE_PROCESS) -> float:
    """
    Floating-point operations per second of one float64 matrix product (``torch.mm``, 1024², best of three) on
    ``device`` with this process's threads, measured once per process and device; in a group the slowest process's
    rate, so that every process takes the same decisions.

    :param device: The compute device.
    :param shard: The process group.
    :return: Operations per second.
    """
    key = str(device)
    if key not in _RATES:
        a = torch.ones((1024, 1024), dtype=torch.float64, device=device)
        out = a @ a
        best = math.inf
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, a, out=out)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        _RATES[key] = 2.0 * 1024**3 / max(best, 1e-9)
    return -float(shard.all_reduce(torch.tensor([-_RATES[key]], dtype=torch.float64), "max")[0])


def factor_passes(n: int, panel: int, block: int | None = None) -> float:
    """
    Examples whose Jacobian factors the exact kernel of ``n`` examples computes. In one matrix: each once when the
    engine keeps them all (``panel ≥ n``), otherwise, over ``t = ⌈n / panel⌉`` panels, the panel's own and the rows
    after it (``t n − panel · t (t − 1) / 2``, about ``n² / (2 panel)``).
    In tiles of ``block`` rows, each of the ``n² / (2 block²)`` tile pairs computes its rows' factors and its columns'
    once per panel (``n² / (2 block) · (1 + ⌈block / panel⌉)``).

    :param n: Training examples.
    :param panel: Examples whose factors the kernel engine keeps at once.
    :param block: The tile size, or ``None`` (one matrix).
    :return: Examples.
    """
    if block is not None and block < n:
        return n * n / (2.0 * block) * (1 + math.ceil(block / panel))
    panels = math.ceil(n / panel)
    return float(panels * n - panel * panels * (panels - 1) / 2)


def example_seconds(engine: JacobianGram, probe: np.ndarray, shard: Shard = ONE_PROCESS) -> float:
    """
    Seconds of one example's Jacobian factors: the kernel of the probe examples, timed the second time it is computed
    (the first one pays the engine's one-time costs), per example; in a group the slowest process's, so that every
    process takes the same decisions. The probe's factors are computed in one sub-batch, so this errs long for models
    whose larger sub-batches run faster per example.

    :param engine: The kernel engine, planned.
    :param probe: A few training inputs.
    :param shard: The process group.
    :return: Seconds per example.
    """
    engine.gram(probe)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    start = time.perf_counter()
    engine.gram(probe)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    seconds = (time.perf_counter() - start) / len(probe)
    return float(shard.all_reduce(torch.tensor([seconds], dtype=torch.float64), "max")[0])


def exact_seconds(
    n: int, factor: int, rate: float, world: int = 1, example_seconds: float | None = None, panel: int | None = None,
    block: int | None = None,
) -> float:
    """
    Estimated seconds of the exact mode's fit and one refit, shared by ``world`` processes: two factorisations with
    their inverses (``4 n³ / 3`` at ``SOLVE_EFFICIENCY``) and the kernel. The kernel is the contraction
    (``2 n² D`` at ``CONTRACTION_EFFICIENCY``) plus the Jacobian factors of :func:`factor_passes` examples and, for
    the refit, of a tenth of them and one more pass over the set, at ``example_seconds`` each (measured on a
    probe); without ``example_seconds``, ``2 n² D`` at ``KERNEL_EFFICIENCY``.

    :param n: Training examples.
    :param factor: ``D``, elements of one example's Jacobian factors.
    :param rate: fp64 GEMM rate of one process (operations per second).
    :param world: Processes.
    :param example_seconds: Seconds of one example's Jacobian factors, or ``None``.
    :param panel: Examples whose factors the kernel engine keeps at once (with ``example_seconds``).
    :param block: The tile size of the tiled solve, or ``None``.
    :return: Seconds.
    """
    solve = 4.0 * n**3 / 3.0 / SOLVE_EFFICIENCY / rate
    if example_seconds is None:
        kernel = 2.0 * n * n * factor / KERNEL_EFFICIENCY / rate
    else:
        m, panel = n // 10 + 1, panel or n
        passes = factor_passes(n, panel, block) + m + n * math.ceil(m / panel)
        kernel = 2.0 * (n + m) * n * factor / CONTRACTION_EFFICIENCY / rate + passes * example_seconds
    return (kernel + solve) / max(world, 1)


def projected_seconds(n: int, factor: int, k: int, rate: float, world: int = 1) -> float:
    """
    Estimated seconds of the projected mode's fit and one refit: projecting every example's Jacobian factors
    (``2 n D k``) at ``KERNEL_EFFICIENCY`` and two primal solves (``2 · 2 n k²`` and ``2 k³ / 3``) at
    ``SOLVE_EFFICIENCY``.
    """
    features = 2.0 * n * factor * k / KERNEL_EFFICIENCY / max(world, 1)
    solve = (4.0 * n * k * k / max(world, 1) + 2.0 * k**3 / 3.0) / SOLVE_EFFICIENCY
    return (features + solve) / rate
