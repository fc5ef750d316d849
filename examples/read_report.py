"""
Read a saved audit back: the headline numbers, the flips that are likely real, and the training examples behind them.

    art-malleability audit --model 2l-relu --output audit     # writes audit/2l-relu/report.json
    python examples/read_report.py audit/2l-relu               # or the report.json itself

The same report as a page, with the examples' images (clean and attacked side by side): audit/2l-relu/report.html.
"""

from __future__ import annotations

import argparse

import numpy as np

from art_malleability import MalleabilityReport
from art_malleability.metrics import flip_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", help="a report folder or its report.json")
    parser.add_argument("--show", type=int, default=5, help="influential examples to list per attack")
    args = parser.parse_args()

    report = MalleabilityReport.load(args.report)
    print(report.summary())
    for warning in report.warnings:
        print(f"warning: {warning}")
    before = np.asarray(report.scores_before, dtype=float)  # a score saved as null (not finite) reads as NaN
    top = np.asarray(report.top_indices)
    for result in report.results:
        after = np.asarray(result.scores_after, dtype=float)
        flipped = top[flip_mask(before[top], after[top])]  # NaN never counts as a flip
        likely = set(result.counted_flips or [])
        print(f"\n{result.attack}: {len(flipped)} of {len(top)} influential examples flipped as measured "
              f"({len(likely)} likely in the population, posterior >= 1/2); the most influential of them:")
        for i in flipped[: args.show]:
            mark = "likely a population flip" if int(i) in likely else "query noise explains it better"
            print(f"  training example {int(i):>5}: influence {before[i]:+.3e} -> {after[i]:+.3e} ({mark})")


if __name__ == "__main__":
    main()
