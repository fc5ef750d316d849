"""
Cost of the audit's bootstrap: ``metrics.malleability_metrics`` (every statistic on the same 1,000 resamples
of the queries, batched) against the obvious reference, a Python loop over resamples that calls the
single-sample functions (``flip_rate``, ``spearman``, ``top_k_jaccard``) on each resampled matrix.

The reference loop runs ``--reference-resamples`` resamples and is extrapolated linearly to ``--resamples``
(its cost per resample is constant); the replicates of both are compared on those resamples, so the
benchmark also checks that the batched path computes the reference's numbers.

    python benchmarks/bench_metrics.py                         # n_train 4,000 and 60,000, 100 queries
    python benchmarks/bench_metrics.py --n-train 4000 --reference-resamples 100
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import mib, peak_rss_bytes

from art_malleability import metrics


def reference_replicates(before, after, rows, top, k):
    """Per-resample loop over the single-sample metric functions."""
    out = {"flip_rate": [], "spearman": [], "top_k_jaccard": []}
    for r in rows:
        b, a = before[r], after[r]
        out["flip_rate"].append(metrics.flip_rate(b, a, top=top))
        out["spearman"].append(metrics.spearman(b, a))
        out["top_k_jaccard"].append(metrics.top_k_jaccard(b, a, top=top))
    return {name: np.array(values) for name, values in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-train", type=int, nargs="+", default=[4000, 60000])
    parser.add_argument("--n-queries", type=int, default=100)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--reference-resamples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print("| n_train | batched, all statistics (s) | reference loop (s, extrap.) | speed-up | max |diff| |")
    print("|---|---|---|---|---|")
    for n in args.n_train:
        rng = np.random.default_rng(args.seed)
        before = rng.normal(size=(args.n_queries, n)) + 0.05
        after = before + rng.normal(scale=2.0, size=before.shape)
        k = metrics.top_k_count(n, 0.1)
        top = metrics.top_indices(metrics.aggregate_scores(before), k, "abs")

        start = time.perf_counter()
        result = metrics.malleability_metrics(
            before, after, n_bootstrap=args.resamples, seed=args.seed, top=top, keep_draws=True
        )
        batched = time.perf_counter() - start

        rows = metrics.resample_rows(args.n_queries, args.resamples, args.seed)[: args.reference_resamples]
        start = time.perf_counter()
        reference = reference_replicates(before, after, rows, top, k)
        loop = (time.perf_counter() - start) * args.resamples / len(rows)

        diff = max(
            float(np.nanmax(np.abs(result["draws"][name][: len(rows)] - reference[name]))) for name in reference
        )
        print(f"| {n:,} | {batched:.1f} | {loop:.1f} | {loop / batched:.1f}x | {diff:.1e} |")
    peak = mib(peak_rss_bytes())
    print(f"\npeak resident memory {peak:.0f} MiB; {args.n_queries} queries, {args.resamples} resamples")


if __name__ == "__main__":
    main()
