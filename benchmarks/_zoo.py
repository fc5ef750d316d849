"""
The architectures the zoo benchmarks try (``bench_zoo.py``): torchvision's, built with random weights for 32 x 32 RGB
inputs and 10 classes (no weights can be downloaded here), a recurrent classifier, and the package's own models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torchvision
from torch import nn

from art_malleability.models import ResNet20, SmallCNN, build_reference_model

#: Input shape of every zoo model.
SHAPE = (3, 32, 32)


class RowLSTM(nn.Module):
    """A convolution feeding a two-layer LSTM over the image's rows, read out from the last step."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lstm = nn.LSTM(8 * 32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))  # (n, 8, 32, 32)
        rows = h.permute(0, 2, 1, 3).flatten(2)  # (n, 32, 256): one step per row
        out, _ = self.lstm(rows)
        return self.head(out[:, -1])


def _vit() -> nn.Module:
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                                mlp_dim=128, num_classes=10)


#: name -> builder of a model with 10 outputs on :data:`SHAPE` inputs, with random weights.
ZOO: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "vit": _vit,
    "shufflenet_v2": lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=10),
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(num_classes=10),
    "regnet_x_400mf": lambda: torchvision.models.regnet_x_400mf(num_classes=10),
    "convnext_tiny": lambda: torchvision.models.convnext_tiny(num_classes=10),
    "densenet121": lambda: torchvision.models.densenet121(num_classes=10),
    "row_lstm": RowLSTM,
    "2l-relu": lambda: build_reference_model("2l-relu", SHAPE, 10, width=1024),
    "mlp-attn": lambda: build_reference_model("mlp-attn", SHAPE, 10, width=1024),
    "cnn": lambda: SmallCNN(SHAPE, 10),
    "resnet20": lambda: ResNet20(SHAPE, 10),
}

#: The architectures of the issue's table and the package's own models (the default set).
DEFAULT = ("resnet18", "mobilenet_v3_small", "vit", "row_lstm", "2l-relu", "mlp-attn", "cnn", "resnet20")


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float64,
          context: torch.Tensor | None = None) -> nn.Module:
    """A zoo model with seeded random weights, in ``dtype`` and evaluation mode (a transductive model gets
    ``context`` as its training set)."""
    torch.manual_seed(seed)
    model = ZOO[name]().to(dtype).eval()
    if hasattr(model, "set_context"):
        model.set_context(context if context is not None else torch.rand(64, *SHAPE))
    return model
