"""
The memory and time of the NTK influence: what its large buffers take in each mode, the budget they may take, and
what its modes are estimated to cost on this machine.

Every decision these feed (the mode of ``projection_dim="auto"``, the exact solve's form, the chunk sizes) depends
only on the inputs, the options and fixed facts of the machine: its total memory (not what other processes leave
free), the number of threads and the device's kind (a nominal GEMM rate, :func:`nominal_gemm_rate`, not one timed at
that moment), and operation counts (the kernel engine's and the projection's, :mod:`art_malleability.ntk.cost`, not a
timed probe). The same command and seed thus run the same estimator whatever else the machine is doing; a run that
cannot fit its chosen estimator in the memory available now stops with an error (:func:`check_available`) instead of
switching estimators.
"""

from __future__ import annotations

import math
import os
import time

import torch

from art_malleability._utils import cache as _cache
from art_malleability._utils.machine import nominal_gemm_rate as nominal_gemm_rate
from art_malleability._utils.torch_utils import available_memory, total_memory
from art_malleability.distributed import ONE_PROCESS, Shard
from art_malleability.ntk.empirical import DEFAULT_CHUNK_MB

#: Share of the available memory the large matrices may take when no ``memory_limit_gb`` is set.
MEMORY_SHARE = 0.8
_GIB = 2**30


def engine_reserve(n: int, example_bytes: int | None = None, batch_size: int = 256,
                   chunk_mb: float = DEFAULT_CHUNK_MB) -> int:
    """
    Bytes the exact kernel engine's chunks take: raw output gradients of one sub-batch (at most one chunk) and kept
    factors or a panel with one more block (at most two chunks), each no larger than what ``n`` examples need, so
    that a small problem reserves little.

    :param n: Training examples.
    :param example_bytes: Bytes of one example's largest (uncompressed) Jacobian factors, or ``None`` (unknown: three
        whole chunks).
    :param batch_size: Examples per sub-batch.
    :param chunk_mb: The engine's chunk budget (MiB).
    :return: Bytes.
    """
    chunk = int(chunk_mb * 2**20)
    if example_bytes is None:
        return 3 * chunk
    return min(chunk, batch_size * example_bytes) + min(2 * chunk, (n + batch_size) * example_bytes)


def matrices_bytes(n: int, device: torch.device | None = None) -> int:
    """Bytes of the exact mode's ``n × n`` float64 matrices: two on the CPU, five elsewhere (the factorisation's
    temporaries)."""
    return 8 * (2 if device is None or device.type == "cpu" else 5) * n * n


def exact_bytes(n: int, device: torch.device | None = None, reserve: int | None = None) -> int:
    """
    Bytes of the exact mode's large buffers: the ``n × n`` matrices (:func:`matrices_bytes`) and the kernel engine's
    chunks (``reserve``, :func:`engine_reserve`; ``None``: three whole chunks of the default size).
    """
    return matrices_bytes(n, device) + (engine_reserve(n) if reserve is None else reserve)


def engine_chunk_mb(n: int, budget: int, device: torch.device | None = None) -> float:
    """
    The exact kernel engine's chunk budget (MiB): a third of what the ``n × n`` matrices leave of ``budget``
    (raw gradients, and kept factors or a panel with one more block, take three chunks), at most 8 GiB, at least
    the default.
    """
    spare = max(budget - matrices_bytes(n, device), 0)
    return max(DEFAULT_CHUNK_MB, min(spare / 3, 8 * _GIB) / 2**20)


def tiled_block(
    n: int, budget: int, changed_share: float = 0.1, world: int = 1, device: torch.device | None = None,
    reserve: int | None = None,
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
    :param reserve: The kernel engine's chunks (:func:`engine_reserve`; ``None``: three whole default chunks).
    :return: The tile size (rows), between 32 and 4,096.
    """
    spare = budget - update_bytes(n, changed_share, world, device, reserve)
    if spare <= 0:
        return None
    block = min(4096, n, spare // (2 * 8 * max(n, 1)))
    return int(block) if block >= min(32, n) else None


def update_bytes(n: int, changed_share: float = 0.1, world: int = 1, device: torch.device | None = None,
                 reserve: int | None = None) -> int:
    """
    Bytes per process beside the tiles during an update of ``m = changed_share · n`` rows: two sets of
    ``(n − m) × m`` blocks dealt out over the ``world`` processes by tile row (the kernel columns ``A_QP`` or
    ``M A_QP``, then ``X``), five ``m × m`` matrices on the CPU (``A_PP``, the Gram matrix and its sum over the
    processes, the Schur complement, its factor; three more elsewhere, where the factorisation needs temporaries) and
    the kernel engine's chunks (``reserve``, :func:`engine_reserve`).
    """
    m = int(changed_share * n + 1)
    squares = 5 if device is None or device.type == "cpu" else 8
    return 8 * (2 * m * max(n - m, 0) // world + squares * m * m) + (engine_reserve(n) if reserve is None else reserve)


def exact_plan(
    n: int, budget: int, device: torch.device | None = None, world: int = 1, reserve: int | None = None
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
    :param reserve: The kernel engine's chunks (:func:`engine_reserve`; ``None``: three whole default chunks).
    :return: ``(block, on_disk)`` or ``None``.
    """
    if world == 1 and exact_bytes(n, device, reserve) <= budget:
        return None, False
    block = int(min(2048, max(1, -(-n // (4 * world)))))
    if tiles_bytes(n, block, world, device, reserve) <= budget:
        return block, False
    block = tiled_block(n, budget, world=world, device=device, reserve=reserve)
    return None if block is None else (block, True)


def tiles_bytes(n: int, block: int, world: int = 1, device: torch.device | None = None,
                reserve: int | None = None) -> int:
    """Bytes per process of the exact solve in tiles of ``block`` rows held in memory (:func:`exact_plan`)."""
    return 8 * (n * n // (2 * world) + 3 * n * block) + update_bytes(n, world=world, device=device, reserve=reserve)


def plan_bytes(plan: tuple[int | None, bool], n: int, device: torch.device | None = None, world: int = 1,
               reserve: int | None = None) -> int:
    """Bytes per process that an exact plan (:func:`exact_plan`) holds at once."""
    block, on_disk = plan
    if block is None:
        return exact_bytes(n, device, reserve)
    if on_disk:
        return update_bytes(n, world=world, device=device, reserve=reserve) + 2 * 8 * n * block
    return tiles_bytes(n, block, world, device, reserve)


def projected_bytes(n_local: int, n_total: int, k: int) -> int:
    """
    Bytes of the projected mode's large buffers (primal: ``Φ`` and five ``k × k``: the fit's and the last refit's
    ``ΦᵀΦ``, the factor, and a refit's new ``ΦᵀΦ`` and its working copy; dual: two ``Φ``, two ``n × n``).
    """
    if n_total <= k:
        return 16 * n_total * k + 16 * n_total * n_total + int(DEFAULT_CHUNK_MB * 2**20)
    return 8 * n_local * k + 40 * k * k + 8 * 8192 * k + int(DEFAULT_CHUNK_MB * 2**20)


def memory_budget(memory_limit_gb: float | None, device: torch.device, shard: Shard = ONE_PROCESS) -> int:
    """
    Bytes the large matrices may take: ``memory_limit_gb``, or :data:`MEMORY_SHARE` of the device's total memory (a
    fixed fact of the machine, not what other processes leave free at the moment: the same inputs and options choose
    the same estimator; :func:`check_available` then says whether it fits now). In a sharded run the processes of
    one machine share it (``LOCAL_WORLD_SIZE``, set by ``torchrun``), and every process uses the smallest budget of
    all.

    :param memory_limit_gb: The estimator's ``memory_limit_gb`` (GiB), or ``None``.
    :param device: The compute device.
    :param shard: The process group.
    :return: The budget in bytes.
    """
    if memory_limit_gb is not None:
        budget = int(float(memory_limit_gb) * _GIB)
    else:
        budget = int(MEMORY_SHARE * total_memory(device))
    if shard.world_size > 1:  # the processes of a machine share its memory
        budget //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return -int(shard.all_reduce(torch.tensor([-budget], dtype=torch.int64), "max")[0])


def check_available(need: int, device: torch.device, what: str, shard: Shard = ONE_PROCESS) -> None:
    """
    The estimator chosen from fixed facts must fit in the memory available now; otherwise stop, saying so (it is
    not switched for another, which would make the result depend on what else the machine is doing). In a group,
    every process checks its own need against its machine's share and all stop together.

    :param need: Bytes this process will hold.
    :param device: The compute device.
    :param what: What needs it, for the message.
    :param shard: The process group.
    :raises MemoryError: Naming the need, what is available and the way out.
    """
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if shard.world_size > 1 else 1
    free = available_memory(device) // local
    short = torch.tensor([1 if need > free else 0], dtype=torch.int64)
    if int(shard.all_reduce(short, "max")[0]):
        raise MemoryError(
            f"{what} needs about {need / _GIB:.2f} GiB per process, but only {free / _GIB:.2f} GiB "
            f"{'is' if local == 1 else 'per process are'} available on {device.type} now (other processes hold the "
            "rest); free memory and run again, or set memory_limit_gb (--memory-limit-gb) to what can be spared: "
            "the mode and the solve's form are chosen from the budget, so a smaller one may choose another"
        )


#: Share of the fp64 GEMM rate the exact kernel reaches as a whole, where the time of the Jacobian factors is not
#: measured (``benchmarks/plan_exact_gpu.py`` without a device). Measured on the CPU: 66-75 % for the SmallCNN and the
#: 2L-ReLU at 10,000 examples, 9 % for ResNet-20 at 400 (``benchmarks/bench_exact_kernel.py``); the lower end of the
#: first two is assumed.
KERNEL_EFFICIENCY = 0.15
#: Share of the fp64 GEMM rate of the kernel's contraction of computed factors (``2 n² D``), beside the time of the
#: factors themselves (measured: the whole kernel at 66-75 % of the rate with the factors' time in it; the
#: contraction alone is assumed at 50 %, so that an estimate errs long).
CONTRACTION_EFFICIENCY = 0.5
#: Examples of the projection's pilot (its ``probe_size``: the first ones of the training set).
PILOT_EXAMPLES = 64
#: Share of the fp64 GEMM rate the blocked factorisation and inverse reach (benchmarks/bench_exact_solve.py).
SOLVE_EFFICIENCY = 0.5
#: Share of the fp64 GEMM rate at which a model's counted forward and backward operations run (the attacks' steps):
#: measured on one CPU core 14 % for the 2L-ReLU and 7.5 % for the SmallCNN (whose many small launches dominate); 5 %
#: is assumed, so that an estimate errs long.
FACTOR_EFFICIENCY = 0.05
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


def exact_seconds(
    n: int, factor: int, rate: float, world: int = 1, example_seconds: float | None = None, panel: int | None = None,
    block: int | None = None, refits: int = 1, queries: int = 0, kept: bool = False, query_bytes: int = 0,
    factor_cache: int | None = None, pair_flops: float | None = None, pass_seconds: float = 0.0,
    rows: int | None = None,
) -> float:
    """
    Estimated seconds of the exact mode's fit, ``refits`` refits of a tenth of the rows (``m = n / 10 + 1``, the
    same rows each time, as an audit's attacks and controls change its influential set) and the scores of ``queries``
    queries after the fit and after each refit, shared by ``world`` processes:

    - solve: the base factorisation with its inverse and that of the unchanged rows (``4 n³ / 3``), and per refit the
      Schur complement of the changed rows (``2 (n − m)² m``), at ``SOLVE_EFFICIENCY``;
    - kernel: the contraction (``2 n² D`` for the fit, ``2 m n D`` per refit) at ``CONTRACTION_EFFICIENCY`` plus the
      Jacobian factors of :func:`factor_passes` examples for the fit (``n`` when the set's factors are ``kept``, tiles
      included) and, per refit, of the ``m`` changed ones and one more pass over the set (none when the set's factors
      are ``kept``), at ``example_seconds`` each, and ``pass_seconds`` (the fixed overhead of a pass: its operator
      calls) for every pass of at most ``rows`` examples they take; without ``example_seconds``, ``2 n² D`` at
      ``KERNEL_EFFICIENCY``;
    - queries: ``A⁻¹`` applied to their kernel rows (``4 n² q``: the factor and its transpose) after the fit and the
      first refit; after the later refits of the same rows only the changed rows' part (``4 m n q``) for the share of
      the queries whose solve on the unchanged rows is kept (``QUERY_CACHE_BYTES`` of ``8 q (n − m)``); their kernel
      rows (``2 q n D``, their own factors and, unless ``kept``, the set's once per panel of queries) after every
      pass, or, with the set's factors ``kept``, once, and then against the ``m`` changed rows, with the factors
      (``query_bytes`` each) of the queries beyond the kept share computed again.

    :param n: Training examples.
    :param factor: ``D``, elements of one example's Jacobian factors.
    :param rate: fp64 GEMM rate of one process (operations per second).
    :param world: Processes.
    :param example_seconds: Seconds of one example's Jacobian factors, or ``None``.
    :param panel: Examples whose factors the kernel engine keeps at once (with ``example_seconds``).
    :param block: The tile size of the tiled solve, or ``None``.
    :param refits: Refits after the fit.
    :param queries: Queries scored after the fit and each refit.
    :param kept: Whether the training set's factors are kept between the kernel's computations.
    :param query_bytes: Bytes of one query's Jacobian factors (kept between passes with ``kept``).
    :param factor_cache: Bytes of the queries' factors kept (``None``: ``QUERY_CACHE_BYTES``).
    :param pair_flops: Operations of the contraction per pair of examples, counted by the engine for its method
        (``None``: ``2 D``).
    :param pass_seconds: Fixed seconds of one pass of the engine, whatever its examples (with ``example_seconds``).
    :param rows: Examples of a pass at most (``None``: ``panel``).
    :return: Seconds.
    """
    m, passes, later = n // 10 + 1, refits + 1, max(refits - 1, 0)
    pair = 2.0 * factor if pair_flops is None else float(pair_flops)
    q = queries
    solved = _kept_share(8 * q * (n - m))  # share of the queries whose unchanged part is kept
    solve = (4.0 * n**3 / 3.0 + refits * 2.0 * max(n - m, 0) ** 2 * m
             + (passes - later) * 4.0 * n * n * q + later * 4.0 * n * q * (m + (1.0 - solved) * n))
    solve /= SOLVE_EFFICIENCY * rate
    if kept:  # the queries' rows on the set as given are kept (a share), the changed columns contracted per refit
        rows_kept = _kept_share(8 * q * n)
        row_products = q * n * (1.0 + refits * (1.0 - rows_kept)) + refits * q * m
        query_factors = q * (1.0 + refits * (1.0 - _kept_share(q * query_bytes, factor_cache)))
    else:
        row_products, query_factors = passes * q * n, passes * q
    if example_seconds is None:
        kernel = (n * n + row_products) * pair / KERNEL_EFFICIENCY / rate
    else:
        panel = panel or n
        again = 0 if kept else n  # the set's factors, computed again per panel of new rows unless kept
        fit = n if kept else factor_passes(n, panel, block)  # kept: each example's factors once, tiles included
        examples = (fit + refits * (m + again * math.ceil(m / panel))
                    + query_factors + passes * again * math.ceil(q / panel))
        r = max(int(rows or panel), 1)

        def runs(count: float) -> float:  # passes of at most r examples for ``count`` examples computed together
            return math.ceil(count / r) if count > 0 else 0

        sub_batches = (runs(fit) + refits * (runs(m) + runs(again) * math.ceil(m / panel))
                       + runs(q) * query_factors / max(q, 1) + passes * runs(again) * math.ceil(q / panel))
        contraction = ((n + refits * m) * n + row_products) * pair / CONTRACTION_EFFICIENCY / rate
        kernel = contraction + examples * example_seconds + sub_batches * pass_seconds
    return (kernel + solve) / max(world, 1)


def _kept_share(nbytes: float, bound: int | None = None) -> float:
    """Share of something of ``nbytes`` that an audit's cache of queries keeps (``bound``; ``None``:
    ``QUERY_CACHE_BYTES``)."""
    bound = _cache.QUERY_CACHE_BYTES if bound is None else bound
    return 1.0 if nbytes <= bound else bound / nbytes


def projected_seconds(n: int, factor: int, k: int, rate: float, world: int = 1, refits: int = 1,
                      queries: int = 0, example_seconds: float | None = None, plan_seconds: float = 0.0) -> float:
    """
    Estimated seconds of the projected mode's fit, ``refits`` refits of a tenth of the rows and the scores of
    ``queries`` queries after each: the projected features of the training set, of the changed rows per refit, of
    the queries once and of the projection's pilot (:data:`PILOT_EXAMPLES`), at ``example_seconds`` each, and the
    projection's plan, ``plan_seconds`` (both counted on the projection itself,
    :func:`~art_malleability.ntk.projection.projected_costs`; without them, projecting
    the Jacobian factors, ``2 D k`` each, at ``KERNEL_EFFICIENCY``); per pass the primal solve with the hat diagonal
    (``2 · 2 n k²`` and ``2 k³ / 3``) and the queries' leave-one-out factors (``2 q k (k + n)``) at
    ``SOLVE_EFFICIENCY``; with no more examples than features (``n ≤ k``) the dual solve the fit runs instead: the Gram
    ``2 n² k``, its factorisation ``4 n³ / 3``, per refit the changed rows' Schur complement and Gram rows, and per pass
    the queries' kernel rows and solves (``2 q n k + 4 n² q``).
    """
    m, passes, w = n // 10 + 1, refits + 1, max(world, 1)
    examples = n / w + refits * m / w + queries
    if example_seconds is None:
        features = 2.0 * examples * factor * k / KERNEL_EFFICIENCY / rate
    else:
        features = (examples + min(n, PILOT_EXAMPLES)) * example_seconds + plan_seconds
    if n <= k:  # the dual solve on ΦΦᵀ (as the fit runs it): the Gram, its factorisation and the changed rows' updates
        solve = (2.0 * n * n * k + 4.0 * n**3 / 3.0 + refits * (2.0 * max(n - m, 0) ** 2 * m + 2.0 * m * n * k)
                 + passes * (2.0 * queries * n * k + 4.0 * n * n * queries)) / SOLVE_EFFICIENCY
    else:
        solve = passes * (4.0 * n * k * k / w + 2.0 * k**3 / 3.0 + 2.0 * queries * k * (k + n / w)) / SOLVE_EFFICIENCY
    return features + solve / rate
