"""
Fixed facts of the machine that decisions are taken on (never timed, so that a decision does not depend on what else
the machine is doing): the nominal float64 GEMM rate of a device.
"""

from __future__ import annotations

import functools
import platform

import torch

#: Nominal clock (Hz) of :func:`nominal_gemm_rate`: below the base clock of current server CPUs and GPUs, so that an
#: estimate errs long.
NOMINAL_CLOCK_HZ = 2.0e9
#: float64 multiply-adds per cycle and streaming multiprocessor of NVIDIA GPUs by compute capability (the data-centre
#: parts; every other part has 2, a sixty-fourth of their rate or less).
_CUDA_FP64_UNITS = {(6, 0): 32, (7, 0): 32, (8, 0): 32, (9, 0): 64, (10, 0): 64}

@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def nominal_gemm_rate(device: torch.device, threads: int | None = None) -> tuple[float, str]:
    """
    A nominal float64 GEMM rate from fixed facts of the machine (never timed, so that a decision taken on it does not
    depend on what else the machine is doing): on the CPU, ``threads`` (default: torch's) × the float64 operations per
    cycle of its widest vector unit (AVX-512: 32, AVX2 with FMA or an ARM64 core: 16, else 8) ×
    :data:`NOMINAL_CLOCK_HZ`; on a CUDA device, its multiprocessors × float64 units per multiprocessor (by compute
    capability) × 2 × the nominal clock. Real rates are usually higher (a 2-thread AVX-512 CPU measured 97 GFLOP/s
    against a nominal 128; an H200 67 TFLOP/s against 34), so estimates are of the right order and err long.

    :param device: The compute device.
    :param threads: CPU threads (``None``: ``torch.get_num_threads()``).
    :return: ``(operations per second, the facts it came from)``.
    """
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        units = _CUDA_FP64_UNITS.get((props.major, props.minor), 2)
        rate = props.multi_processor_count * units * 2.0 * NOMINAL_CLOCK_HZ
        return rate, (f"{props.name}: {props.multi_processor_count} multiprocessors x {units} fp64 units "
                      f"(compute capability {props.major}.{props.minor}) at a nominal {NOMINAL_CLOCK_HZ / 1e9:g} GHz")
    threads = torch.get_num_threads() if threads is None else int(threads)
    flags = _cpu_flags()
    if "avx512f" in flags:
        per_cycle, unit = 32, "AVX-512"
    elif {"avx2", "fma"} <= flags or platform.machine().lower() in ("arm64", "aarch64"):
        per_cycle, unit = 16, "AVX2/FMA" if flags & {"avx2"} else "ARM64"
    else:
        per_cycle, unit = 8, "no wide vector unit known"
    rate = threads * per_cycle * NOMINAL_CLOCK_HZ
    return rate, f"{threads} CPU thread(s), {unit} ({per_cycle} fp64 operations per cycle) at a nominal " \
                 f"{NOMINAL_CLOCK_HZ / 1e9:g} GHz"
