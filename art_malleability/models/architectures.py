"""
Standard image classifiers for audits beyond the paper's reference models: a compact CNN and the
CIFAR ResNet-20 of He et al. (2016). Both take images ``(n, c, h, w)`` and return logits
``(n, nb_classes)``; their factories take ``input_shape`` and ``nb_classes`` (so the CLI's
``--model cnn`` / ``--model resnet20`` and ``package.module:factory`` forms build them) and a
``seed`` for a local generator (no global random state is touched).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from art_malleability._utils.checks import check_input_shape

logger = logging.getLogger(__name__)

ARCHITECTURES: tuple[str, ...] = ("cnn", "resnet20")


def _seeded_init(model: nn.Module, seed: int) -> nn.Module:
    """Re-draw every weight from PyTorch's default schemes, from a local generator seeded by ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu", generator=gen)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.fill_(1.0)
                m.bias.zero_()
    return model


class SmallCNN(nn.Module):
    """
    Two convolution blocks (3×3 convolution, batch norm, ReLU, 2×2 max pooling; 16 and 32
    channels) and a two-layer classifier head (64 hidden units).

    :param input_shape: ``(channels, height, width)``, e.g. ``(1, 28, 28)`` or ``(3, 32, 32)``.
    :param nb_classes: Number of classes.
    :param seed: Seed of the initial weights.
    """

    def __init__(self, input_shape: tuple[int, ...], nb_classes: int, seed: int = 0) -> None:
        super().__init__()
        c, h, w = check_input_shape(input_shape, image=True)
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * (h // 4) * (w // 4), 64), nn.ReLU(), nn.Linear(64, int(nb_classes))
        )
        _seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm; identity shortcut, zero-padded and subsampled when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.stride, self.extra = stride, c_out - c_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        short = x
        if self.stride != 1 or self.extra:
            short = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.extra))
        return F.relu(out + short)


class ResNet20(nn.Module):
    """
    ResNet-20 for 32×32 images (He et al., 2016, section 4.2): a 3×3 convolution with 16
    channels, three stages of three basic blocks (16, 32, 64 channels; stride 2 at the start of the
    second and third), global average pooling and a linear classifier; 0.27 M parameters.

    :param input_shape: ``(channels, height, width)``.
    :param nb_classes: Number of classes.
    :param seed: Seed of the initial weights.
    """

    def __init__(self, input_shape: tuple[int, ...], nb_classes: int, seed: int = 0) -> None:
        super().__init__()
        c, _, _ = check_input_shape(input_shape, image=True)
        self.conv = nn.Conv2d(c, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, int(nb_classes))
        _seeded_init(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(F.relu(self.bn(self.conv(x))))
        return self.fc(out.mean(dim=(2, 3)))


def build_architecture(name: str, input_shape: tuple[int, ...], nb_classes: int, seed: int = 0) -> nn.Module:
    """
    :param name: ``"cnn"`` (:class:`SmallCNN`) or ``"resnet20"`` (:class:`ResNet20`).
    :param input_shape: Image shape ``(channels, height, width)``.
    :param nb_classes: Number of classes.
    :param seed: Seed of the initial weights.
    :return: The model, in training mode.
    """
    if name == "cnn":
        return SmallCNN(input_shape, nb_classes, seed=seed)
    if name == "resnet20":
        return ResNet20(input_shape, nb_classes, seed=seed)
    raise ValueError(f"name must be one of {ARCHITECTURES}, got {name!r}")
