"""
Coverage, bias, power and false-positive rate of every statistic the audit reports, on planted populations with
known truth (the harness of ``tests/statistics_harness.py``, at larger sizes than the test suite). Prints one line
per statistic and scenario; the numbers in docs/metrics.md come from

    python benchmarks/statistics_coverage.py            # about an hour on 2 CPU cores
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

ISSUE = {"n_query": 100, "n_train": 1000, "n_influential": 100, "lo": 1.6, "hi": 3.0, "rho": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every number of repetitions")
    args = parser.parse_args()

    def reps(n: int) -> int:
        return max(2, int(round(n * args.scale)))

    start = time.perf_counter()
    critical = 3.841
    print("## Noise-aware flip rate (100 queries x 1,000 examples, 100 influential at 1.6-3 SE)")
    scenarios = [
        ("planted set, 30 % flips, rho 0.9", dict(flips=0.3), False),
        ("planted set, no flips, rho 0.9", dict(flips=0.0), False),
        ("selected set, 30 % flips, rho 0.9", dict(flips=0.3), True),
        ("selected set, no flips, rho 0.9", dict(flips=0.0), True),
        ("selected set, 30 % flips, rho 0.5", dict(flips=0.3, rho=0.5), True),
        ("selected set, 30 % flips, Student-t(3) noise", dict(flips=0.3, student_df=3.0), True),
        ("selected set, 30 % flips, perturbed aggregates shrunk to 1/4", dict(flips=0.3, shrink=0.25), True),
        ("selected set, no flips, perturbed aggregates shrunk to 1/4", dict(flips=0.0, shrink=0.25), True),
    ]
    for label, design, selected in scenarios:
        runs = H.noise_aware(Planted(**{**ISSUE, **design}), reps(60), selected=selected, seed=11)
        lr = np.asarray(runs["lr"])
        print(f"- {label}: {runs['aware'].line()}; raw flip rate {np.mean(runs['raw']):.3f}, its null expectation "
              f"{np.mean(runs['null']):.3f}; no-flip test rejects in {np.mean(lr > critical):.2f}", flush=True)
    print("\n## Raw flip rate, top-k Jaccard, excess over a 5-draw control (100 queries x 400, top 40; two seeds)")
    designs = ({"flips": 0.0, "shrink": 0.25}, {"flips": 0.3, "rho": 0.5}, {"flips": 0.3}, {"flips": 0.0},
               {"flips": 0.3, "lo": 0.5, "hi": 1.5}, {"flips": 0.3, "n_influential": 20})
    for design in designs:
        for seed in (0, 1):
            planted = Planted(n_train=400, **{"n_influential": 40, **design})
            for coverage in H.resampled_statistics(planted, reps(1000), seed=seed).values():
                print(f"- {design}, seed {seed}: {coverage.line()}", flush=True)
    print("\n## Spearman (BCa), per-query flip rate (Student-t) (60 queries x 300)")
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
