"""
Cost of the spectral tools on real data: ``spectral_analysis_of_dataset`` (load, normalise, Gram spectrum,
rank rule, condition numbers, and the direct check where it applies) on digits, MNIST and CIFAR-10, against the
obvious reference measured in the same run: load the same subset with ``load_dataset`` and take
``numpy.linalg.eigvalsh`` of the float64 Gram matrix of the unit-normalised rows. Target: under 10 s per
dataset at ``n = 1,000``.

    python benchmarks/bench_spectral.py                       # n = 1,000, the three datasets
    python benchmarks/bench_spectral.py --n 300 --datasets digits mnist
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _common import mib, peak_rss_bytes

from art_malleability.data import load_dataset
from art_malleability.ntk.spectral import spectral_analysis_of_dataset

TARGET_S = 10.0
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SOURCES = {"digits": ("digits", None), "mnist": ("mnist", DATA / "mnist"),
           "cifar10": (DATA / "cifar10" / "cifar10_test_jpeg.npz", None)}


def reference(source, root, n: int) -> np.ndarray:
    """Load the same subset and return the Gram spectrum by ``numpy.linalg.eigvalsh``."""
    data = load_dataset(source, root=root, n_train=n, seed=0)
    x = data.x_train.reshape(len(data.x_train), -1).astype(np.float64)
    x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    return np.linalg.eigvalsh(x @ x.T)[::-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--datasets", nargs="+", choices=tuple(SOURCES), default=list(SOURCES))
    args = parser.parse_args()
    print("| dataset | n | d | spectral_analysis s | eigvalsh reference s | × reference | target < 10 s | "
          "max eigenvalue rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.datasets:
        source, root = SOURCES[name]
        start = time.perf_counter()
        report = spectral_analysis_of_dataset(source, root=root, n=args.n)
        ours = time.perf_counter() - start
        start = time.perf_counter()
        eig = reference(source, root, args.n)
        ref = time.perf_counter() - start
        diff = np.max(np.abs(np.asarray(report.eigenvalues) - eig)) / eig[0]
        verdict = "met" if ours < TARGET_S else "MISSED"
        print(f"| {name} | {report.n} | {report.d} | {ours:.2f} | {ref:.2f} | {ours / ref:.2f} | {verdict} | "
              f"{diff:.1e} |")
    print(f"\npeak RSS {mib(peak_rss_bytes()):.0f} MiB")


if __name__ == "__main__":
    main()
