"""
Reproduce the paper's comparisons (Tables 1–4, the ε ablation, spectral numbers) side by side with its numbers.

    python examples/reproduce_paper.py                                  # digits, the paper's protocol, 3 seeds
    python examples/reproduce_paper.py --dataset mnist --data-root PATH  # MNIST from a local folder
    python examples/reproduce_paper.py --tables table2 --seeds 0 1 2 --epochs 100

Same code as ``art-malleability reproduce``; ``--help`` lists every option. Writes reproduction.md,
reproduction.json and figures into ``--output``.
"""

import sys

from art_malleability.cli import main

if __name__ == "__main__":
    sys.exit(main(["reproduce", *sys.argv[1:]]))
