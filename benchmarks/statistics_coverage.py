"""
Coverage, bias, power and false-positive rate of every statistic the audit reports, on planted populations with
known truth (the harness of ``tests/statistics_harness.py``, at larger sizes than the test suite). Prints one line
per statistic and scenario; the numbers in docs/metrics.md come from

    python benchmarks/statistics_coverage.py            # about two hours on 2 CPU cores
    python benchmarks/statistics_coverage.py --only noise-aware --queries 10000 --scale 0.5 --designs strong,weak
    python benchmarks/statistics_coverage.py --only interval-ends --scale 0.5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import statistics_harness as H  # noqa: E402
from planted import Planted  # noqa: E402

#: Designs of the noise-aware rate: influential aggregates 1.6-3 or 0.5-2 standard errors from zero, the perturbed
#: ones kept or shrunk to a quarter, the noise correlation 0.9 or 0.5.
AWARE_DESIGNS = {
    "strong": dict(lo=1.6, hi=3.0),
    "weak": dict(lo=0.5, hi=2.0),
    "strong, shrunk to 1/4": dict(lo=1.6, hi=3.0, shrink=0.25),
    "weak, correlation 0.5": dict(lo=0.5, hi=2.0, rho=0.5),
}
#: Designs of the retention (truth: 0.4 with 30 % flips, 0.25 shrunk, 1 kept).
RETENTION_DESIGNS = {
    "strong, shrunk to 1/4": dict(lo=1.6, hi=3.0, flips=0.0, shrink=0.25),
    "strong, 30 % flips": dict(lo=1.6, hi=3.0, flips=0.3),
    "weak, shrunk to 1/4": dict(lo=0.5, hi=2.0, flips=0.0, shrink=0.25),
    "strong, shrunk, correlation 0.5": dict(lo=1.6, hi=3.0, flips=0.0, shrink=0.25, rho=0.5),
    "strong, kept": dict(lo=1.6, hi=3.0, flips=0.0, shrink=1.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every number of repetitions")
    parser.add_argument("--queries", type=int, nargs="+", default=[100, 1000], help="numbers of queries")
    parser.add_argument("--only", default="",
                        help="comma-separated sections: noise-aware, interval-ends, retention, others")
    parser.add_argument("--designs", default="", help="comma-separated designs of those sections (default: all)")
    args = parser.parse_args()

    def reps(n: int) -> int:
        return max(2, int(round(n * args.scale)))

    start = time.perf_counter()
    critical = 3.841
    sections = set(args.only.split(",")) if args.only else None

    def wanted(name: str) -> bool:
        return sections is None or name in sections

    def chosen(designs: dict) -> dict:
        names = [n.strip() for n in args.designs.split(",") if n.strip()]
        return {label: d for label, d in designs.items() if not names or label in names}

    if wanted("noise-aware"):
        print("## Noise-aware flip rate (1,000 examples, 100 influential; the set planted or selected)")
        for label, design in chosen(AWARE_DESIGNS).items():
            for n_query in args.queries:
                for flips in (0.0, 0.1, 0.3, 0.5):
                    for selected in (True, False):
                        planted = Planted(n_query=n_query, n_train=1000, n_influential=100, flips=flips, **design)
                        runs = H.noise_aware(planted, reps(40), selected=selected, seed=11)
                        lr, (above, below) = np.asarray(runs["lr"]), runs["aware"].misses
                        print(f"- {label}, {n_query} queries, {flips:.0%} flips, "
                              f"{'selected' if selected else 'planted'} set: {runs['aware'].line()}, intervals "
                              f"above the truth {above:.2f}, below it {below:.2f}; raw "
                              f"{np.mean(runs['raw']):.3f}, by noise {np.mean(runs['null']):.3f}; no-flip test "
                              f"rejects in {np.mean(lr > critical):.2f}", flush=True)
    if wanted("interval-ends"):
        print("\n## The noise-aware interval's ends (planted set, 30 % flips; draws from the fit at each end)")
        for label, design in chosen(AWARE_DESIGNS).items():
            for seed in (3, 4):
                ends = H.interval_ends(Planted(n_query=100, flips=0.3, **design), reps(40), seed=seed)
                print(f"- {label}, seed {seed}: {ends}", flush=True)
    if wanted("retention"):
        print("\n## Signed retention, its control (5 draws at 1/4 of the clean aggregates) and the excess")
        for label, design in chosen(RETENTION_DESIGNS).items():
            for n_query in args.queries:
                for selected in (True, False):
                    planted = Planted(n_query=n_query, n_train=1000, n_influential=100, **design)
                    for coverage in H.retention(planted, reps(100), seed=5, selected=selected).values():
                        print(f"- {label}, {n_query} queries, {'selected' if selected else 'planted'} set: "
                              f"{coverage.line()}", flush=True)
    if not wanted("others"):
        print(f"\n{time.perf_counter() - start:.0f} s")
        return
    print("\n## Raw flip rate, top-k Jaccard, excess over a 5-draw control (100 queries x 400, top 40; two seeds)")
    designs = ({"flips": 0.0, "shrink": 0.25}, {"flips": 0.3, "rho": 0.5}, {"flips": 0.3}, {"flips": 0.0},
               {"flips": 0.3, "lo": 0.5, "hi": 1.5}, {"flips": 0.3, "n_influential": 20})
    for design in designs:
        for seed in (0, 1):
            planted = Planted(n_train=400, **{"n_influential": 40, **design})
            for coverage in H.resampled_statistics(planted, reps(1000), seed=seed).values():
                print(f"- {design}, seed {seed}: {coverage.line()}", flush=True)
    print("\n## Spearman (jackknife), per-query flip rate (Student-t) (60 queries x 300)")
    for design in ({"flips": 0.3, "rho": 0.5}, {"flips": 0.0, "shrink": 0.25, "rho": 0.3}):
        runs = H.spearman_and_per_query(Planted(n_query=60, n_train=300, n_influential=30, **design), reps(400))
        for coverage in runs.values():
            print(f"- {design}: {coverage.line()}", flush=True)
    print("\n## Pooling over 5 training seeds (Student-t)")
    print(f"- {H.seed_pooling(reps(10000)).line()}")
    print("\n## LDS (two-way bootstrap over 30 subset models x 40 queries)")
    print(f"- {H.lds(reps(400)).line()}")
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
