"""The paper's reported numbers, the targets the reproduction sets its measurements beside, and its binary tasks."""

from __future__ import annotations

from typing import Any

#: The paper's reported numbers (percent for flip rates), keyed by data family and model.
PAPER: dict[str, Any] = {
    "table1": {  # NTK distance at widths 16 / 1024 / 4096
        "mnist": {"2l-relu": [45.1, 39.9, 39.2], "mlp-attn": [10.3, 33.3, 43.4]},
        "cifar10": {"2l-relu": [246.2, 101.7, 56.9], "mlp-attn": [3.7, 10.4, 12.6]},
    },
    "table2": {
        "mnist": {"2l-relu": {"fgsm": 4.1, "pgd": 3.3, "mim": 3.4},
                  "mlp-attn": {"fgsm": 34.6, "pgd": 28.9, "mim": 21.9}},
        "cifar10": {"2l-relu": {"fgsm": 3.3, "pgd": 3.1, "mim": 3.2},
                    "mlp-attn": {"fgsm": 26.4, "pgd": 19.1, "mim": 20.5}},
    },
    "table3": {
        "mnist": {"2l-relu": {"fgsm": 8.4, "pgd": 8.4, "mim": 8.6},
                  "mlp-attn": {"fgsm": 25.9, "pgd": 41.0, "mim": 40.5}},
        "cifar10": {"2l-relu": {"fgsm": 15.2, "pgd": 15.5, "mim": 15.3},
                    "mlp-attn": {"fgsm": 14.3, "pgd": 14.0, "mim": 14.8}},
    },
    "table4": {  # PGD flip rate: standard -> PGD adversarial training
        "mnist": {"2l-relu": [3.3, 43.4], "mlp-attn": [28.9, 42.2]},
        "cifar10": {"2l-relu": [3.1, 36.5], "mlp-attn": [19.1, 38.6]},
    },
    "spectral": {"mnist": {"kappa": 1.2e3, "log10_width": 24.0}, "cifar10": {"kappa": 8.7e3, "log10_width": 29.0}},
}
BINARY_CLASSES = {"mnist": [3, 8], "cifar10": [1, 0]}
BINARY_NAMES = {"mnist": "digits 3 vs 8", "cifar10": "automobile (1) vs airplane (0)"}

__all__ = ["BINARY_CLASSES", "BINARY_NAMES", "PAPER"]
