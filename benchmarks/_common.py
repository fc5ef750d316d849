"""
What every benchmark shares: the GEMM reference rate, peak memory, thread limits, Markdown tables, the state of the
library a run measured, and JSON-ready values. Imported by the scripts beside it (``from _common import ...``; a
script run as ``python benchmarks/<name>.py`` has this folder on its path).
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import resource
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
_MIB = 2**20


# ------------------------------------------------------------------------------------------------ time and memory
def gemm_rate(dtype: torch.dtype, size: int = 4096, repeats: int = 3) -> float:
    """Best GFLOP/s of ``torch.mm`` on two square ``size × size`` matrices (the reference of every GEMM share)."""
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


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ``ru_maxrss`` in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rss_bytes() -> int:
    """Current resident set size of this process."""
    import psutil

    return int(psutil.Process().memory_info().rss)


class PeakMemory:
    """
    Peak memory of a block of code: CUDA allocator peak on a CUDA device, otherwise the
    resident set size sampled every millisecond (Linux ``/proc``), relative to the start.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0
        self._max = 0
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int | None:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def _poll(self) -> None:
        while not self._stop.is_set():
            rss = self._rss()
            if rss is not None:
                self._max = max(self._max, rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            rss = self._rss()
            if rss is not None:
                self._start = self._max = rss
                self._thread = threading.Thread(target=self._poll, daemon=True)
                self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mib = (torch.cuda.max_memory_allocated(self.device) - self._start) / _MIB
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            rss = self._rss()
            if rss is not None:
                self._max = max(self._max, rss)
            self.peak_mib = (self._max - self._start) / _MIB


def set_threads(threads: int) -> None:
    torch.set_num_threads(int(threads))


def thread_env(threads: int) -> dict[str, str]:
    """Environment of a subprocess limited to ``threads`` threads in every BLAS / OpenMP pool."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def accuracy(model: Any, x: np.ndarray | None, y: np.ndarray | None) -> float | None:
    """Share of ``x`` (in batches of 1,024) that ``model`` classifies as ``y``; ``None`` without data."""
    if x is None or y is None:
        return None
    with torch.no_grad():
        pred = torch.cat([model(torch.as_tensor(x[s : s + 1024])).argmax(1) for s in range(0, len(x), 1024)])
    return float((pred.numpy() == y).mean())


# ------------------------------------------------------------------------------------------------ reporting
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


def percent_ci(value: float | None, ci: Sequence[float | None] | None = None) -> str:
    """A share in percent with its interval when both ends are known (the report's own formatting, without the %)."""
    from art_malleability._utils.report_base import value_ci

    return value_ci(value, ci or (None, None), 100.0, ".1f", "")


def number_ci(value: float | None, ci: Sequence[float | None] | None = None, spec: str = ".3f") -> str:
    """A number with its interval when both ends are known."""
    from art_malleability._utils.report_base import value_ci

    return value_ci(value, ci or (None, None), 1.0, spec, "")


def mib(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else n_bytes / _MIB


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("PASS" if ok else "MISS")


def library_state() -> dict[str, Any]:
    """
    The commit, the locally modified files and a digest of the package's source as it is now (the library may be
    edited while a long benchmark runs: each run records the source it measured). Read-only git calls.
    """

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "art_malleability").rglob("*.py")):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    modified = git("status", "--short", "--untracked-files=no").splitlines()
    return {"commit": git("rev-parse", "HEAD"), "modified": modified, "sources_sha256": digest.hexdigest()}


def to_json(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python numbers and lists, NaN as ``None``."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_json(value.tolist())
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return None if math.isnan(v) else v
    if isinstance(value, np.integer):
        return int(value)
    return value
