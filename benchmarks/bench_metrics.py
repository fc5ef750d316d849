"""
Cost of the audit's metrics against the number of queries: the streamed passes of
``art_malleability.metrics.accumulators`` (clean pass once, then one perturbed pass and its statistics, as for each
attack and control draw of an audit), fed in query blocks of the audit's size, with their time and peak memory. Every
step is linear in the number of queries; the table prints the time and memory per query relative to the smallest
size (1.0 = linear).

The competitor measured in the same run is the obvious reference, a Python loop over resamples that calls the
single-sample functions (``flip_rate``, ``spearman``, ``top_k_jaccard``) on each resampled matrix, run on
``--reference-resamples`` resamples and extrapolated linearly to ``--resamples``; the replicates of both are compared
on those resamples (Spearman's against its jackknife is not: the reference's is a bootstrap). The bootstrap this
release replaced built three ``n_q × n_q × n_q`` tensors for Spearman's replicates (``24 n_q³`` bytes: 1.5 GiB at
400 queries, 60 GiB at 2,000); the table prints that figure beside the measured peak.

    python benchmarks/bench_metrics.py                                   # 2,000 examples, 100 to 4,000 queries
    python benchmarks/bench_metrics.py --n-train 60000 --n-queries 100 1000 10000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _common import PeakMemory, peak_rss_bytes

from art_malleability import metrics
from art_malleability.metrics import pass_metrics, replicated
from art_malleability.metrics.accumulators import (
    STORE_MEMORY_BYTES,
    CleanScores,
    PerturbedScores,
    QueryResampling,
    metrics_plan,
)


def reference_replicates(before, after, rows, top):
    """Per-resample loop over the single-sample metric functions."""
    out = {"flip_rate": [], "top_k_jaccard": []}
    for r in rows:
        b, a = before[r], after[r]
        out["flip_rate"].append(metrics.flip_rate(b, a, top=top))
        out["top_k_jaccard"].append(metrics.top_k_jaccard(b, a, top=top))
    return {name: np.array(values) for name, values in out.items()}


def blocks(rng: np.random.Generator, n_query: int, n_train: int, rows: int, shift: np.ndarray, noise: float):
    """Synthetic influence rows ``shift + noise``, block by block (the full matrix is never built)."""
    for s in range(0, n_query, rows):
        yield shift + noise * rng.standard_normal((min(rows, n_query - s), n_train))


def run(n_query: int, n_train: int, resamples: int, seed: int) -> dict:
    """One clean pass and one perturbed pass, timed and with their peak memory."""
    plan = metrics_plan(n_query, n_train, n_train // 10, resamples)
    columns = np.random.default_rng(seed).standard_normal(n_train) * 0.1
    out: dict = {"plan_gib": plan["memory_bytes"] / 2**30, "store": plan["store"]}
    with PeakMemory(torch.device("cpu")) as peak:
        start = time.perf_counter()
        clean = CleanScores(QueryResampling(n_query, resamples, seed), n_train, memory_bytes=STORE_MEMORY_BYTES)
        for block in blocks(np.random.default_rng(seed + 1), n_query, n_train, plan["block_rows"], columns, 1.0):
            clean.add(block)
        clean.finish()
        out["clean_s"] = time.perf_counter() - start
        start = time.perf_counter()
        perturbed = PerturbedScores(clean)
        for block in blocks(np.random.default_rng(seed + 2), n_query, n_train, plan["block_rows"], 0.3 * columns,
                            1.0):
            perturbed.add(block)
        out["pass_s"] = time.perf_counter() - start
        start = time.perf_counter()
        result = pass_metrics(perturbed, keep_draws=True)
        out["statistics_s"] = time.perf_counter() - start
    out["peak_mib"] = peak.peak_mib
    out["result"] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-queries", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--reference-resamples", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_train = args.n_train

    print(f"## Metrics of {n_train:,} training examples against the number of queries ({args.resamples} resamples, "
          f"{torch.get_num_threads()} threads)\n")
    print("| queries | clean pass (s) | perturbed pass (s) | statistics (s) | per query vs smallest | peak (MiB) | "
          "planned (MiB) | old Spearman tensors (MiB) | store |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for n_query in args.n_queries:
        out = run(n_query, n_train, args.resamples, args.seed)
        total = out["pass_s"] + out["statistics_s"]
        base = base or total / n_query
        old = 24 * n_query**3 / 2**20
        print(f"| {n_query:,} | {out['clean_s']:.2f} | {out['pass_s']:.2f} | {out['statistics_s']:.2f} | "
              f"{total / n_query / base:.2f} | {out['peak_mib']:.0f} | {out['plan_gib'] * 1024:.0f} | {old:,.0f} | "
              f"{out['store']} |")

    # the competitor: a loop over resamples of the single-sample functions, on whole matrices (the smallest size)
    n_query = args.n_queries[0]
    rng = np.random.default_rng(args.seed)
    before = rng.standard_normal((n_query, n_train)) + 0.1 * rng.standard_normal(n_train)
    after = 0.3 * before + rng.standard_normal(before.shape)
    top = metrics.top_indices(metrics.aggregate_scores(before), n_train // 10)
    start = time.perf_counter()
    clean = CleanScores(QueryResampling(n_query, args.resamples, args.seed), n_train, given=before)
    clean.add(before)
    clean.finish(top)
    perturbed = PerturbedScores(clean)
    perturbed.add(after)
    _, streamed = replicated(perturbed, spearman=False)
    ours = time.perf_counter() - start
    rows = metrics.resample_rows(n_query, args.resamples, args.seed)[: args.reference_resamples]
    start = time.perf_counter()
    reference = reference_replicates(before, after, rows, top)
    loop = (time.perf_counter() - start) * args.resamples / len(rows)
    diff = max(float(np.nanmax(np.abs(streamed[name][: len(rows)] - reference[name]))) for name in reference)
    print(f"\nAt {n_query} queries, the flip rate's and the Jaccard's {args.resamples} replicates: {ours:.2f} s "
          f"streamed (both passes included) against {loop:.1f} s for the reference loop over resamples (extrapolated): "
          f"{loop / ours:.1f}x; largest difference of their replicates {diff:.1e}. Peak resident memory of the run "
          f"{peak_rss_bytes() / 2**20:.0f} MiB.")


if __name__ == "__main__":
    main()
