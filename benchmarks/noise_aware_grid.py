"""
The noise-aware flip rate on a grid of planted designs that real audits produce (issue 48, item 1): coverage of its
95 % interval, its bias, its width, and the same among the draws the report shows as decided (interval at most
``UNDECIDED_WIDTH`` wide) and not marked undecided by the undecided-share rule
(:data:`~art_malleability.audit.report.UNDECIDED_SHARE_LIMIT`), with at least 200 draws per design.

Designs (1,000 training examples, 100 influential ones whose clean aggregates sit ``lo``-``hi`` standard errors from
zero, the set selected from the noisy clean aggregates as the audit selects it): the members the attack does not flip
shrunk to ``shrink`` of their clean aggregate (1: kept, 0.1: nearly wiped out, as real attacks do), the flipped ones
reversed at full size; flips of 0-50 %; before/after noise correlated 0.5 or 0.9; Gaussian query
noise, Student-t noise with 3 degrees of freedom (heavy tails), or a few dominant queries (5 % of the queries carry
the spread of the rest ten times over). The table in docs/metrics.md comes from

    python benchmarks/noise_aware_grid.py --draws 200 --workers 2 --save grid.npz   # about 70 minutes, 2 cores
    python benchmarks/noise_aware_grid.py --load grid.npz                             # the table again, at once
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from planted import DominantQueries, Planted  # noqa: E402
from statistics_harness import noise_aware_draw  # noqa: E402

from art_malleability.audit.report import UNDECIDED_SHARE_LIMIT, UNDECIDED_WIDTH  # noqa: E402

SHRINKS = (1.0, 0.5, 0.2, 0.1)
FLIPS = (0.0, 0.1, 0.3, 0.5)
NOISES = ("gaussian", "t3", "dominant")
#: Before/after noise correlation and query noise of each condition of the grid.
CONDITIONS = ("0.9:gaussian", "0.5:gaussian", "0.9:t3", "0.9:dominant")


def design(shrink: float, flips: float, rho: float, noise: str) -> Planted:
    kind = DominantQueries if noise == "dominant" else Planted
    return kind(n_query=100, n_train=1000, n_influential=100, lo=2.5, hi=3.2, flips=flips, shrink=shrink, rho=rho,
                student_df=3.0 if noise == "t3" else None, flip_shrink=1.0)


def run(args: tuple) -> dict:
    (shrink, flips, rho, noise), draws, seed = args
    planted = design(shrink, flips, rho, noise)
    rng = np.random.default_rng([seed, int(1000 * shrink), int(100 * flips), int(100 * rho), NOISES.index(noise)])
    rows = [noise_aware_draw(planted, rng) for _ in range(draws)]
    return {"design": (shrink, flips, rho, noise), "rows": np.array(rows)}


def summary(result: dict, share_limit: float) -> str:
    truth, estimate, low, high, undecided = result["rows"].T
    covered = (low - 1e-9 <= truth) & (truth <= high + 1e-9)
    decided = (high - low <= UNDECIDED_WIDTH + 1e-12) & (undecided <= share_limit)
    shrink, flips, rho, noise = result["design"]
    shown = f"{covered[decided].mean():.2f} ({decided.sum()})" if decided.any() else "– (0)"
    bias_shown = f"{(estimate - truth)[decided].mean():+.3f}" if decided.any() else "–"
    return (f"| {float(shrink):g} | {float(flips):.0%} | {float(rho):g} | {noise} | "
            f"{truth.mean():.3f} | {estimate.mean():.3f} | {(estimate - truth).mean():+.3f} | {covered.mean():.2f} | "
            f"{(high - low).mean():.3f} | {undecided.mean():.2f} | {shown} | {bias_shown} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=48)
    parser.add_argument("--shrinks", type=float, nargs="+", default=list(SHRINKS))
    parser.add_argument("--flips", type=float, nargs="+", default=list(FLIPS))
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS),
                        help="correlation:noise pairs, noise one of " + ", ".join(NOISES))
    parser.add_argument("--save", help="write every draw's numbers here (.npz)")
    parser.add_argument("--load", help="print the table of draws saved by --save, computing nothing")
    parser.add_argument("--share-limit", type=float, default=UNDECIDED_SHARE_LIMIT,
                        help="the undecided-share rule's limit the last columns apply")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    conditions = [(float(c.split(":")[0]), c.split(":")[1]) for c in args.conditions]
    grid = [(shrink, flips, rho, noise) for (rho, noise), shrink, flips
            in itertools.product(conditions, args.shrinks, args.flips)]
    start = time.perf_counter()
    print(f"undecided: interval wider than {UNDECIDED_WIDTH:g} or undecided share over {args.share_limit:g}\n")
    print("| unflipped kept | flips | correlation | noise | truth | estimate | bias | coverage | width | "
          "undecided share | coverage when decided (draws) | bias when decided |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    if args.load:
        saved = np.load(args.load, allow_pickle=True)
        for d, rows in zip(saved["designs"], saved["rows"], strict=True):
            print(summary({"design": tuple(d), "rows": rows}, args.share_limit))
        return
    results = []
    with ProcessPoolExecutor(args.workers) as pool:
        for result in pool.map(run, [(d, args.draws, args.seed) for d in grid]):
            results.append(result)
            print(summary(result, args.share_limit), flush=True)
            if args.save:  # after every design: a stopped run keeps what it finished
                np.savez(args.save, designs=np.array([r["design"] for r in results], dtype=object),
                         rows=np.stack([r["rows"] for r in results]))
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
