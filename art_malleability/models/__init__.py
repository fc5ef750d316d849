"""
Models: the paper's reference models, two standard image classifiers, and the reference training loop.

- :mod:`~art_malleability.models.reference`: linearised attention, MLP-Attn, 2L-ReLU and MLP-Attn-QKV (the
  attention itself in the private ``_attention``);
- :mod:`~art_malleability.models.architectures`: a compact CNN and the CIFAR ResNet-20;
- :mod:`~art_malleability.models.training`: the study's training loop and wrapping as ART classifiers.
- :mod:`~art_malleability.models.landscape`: the loss landscape of a trained model (top Hessian eigenvalues,
  filter-normalised loss profiles).
"""

from art_malleability.models.architectures import ARCHITECTURES, ResNet20, SmallCNN, build_architecture
from art_malleability.models.landscape import HessianSpectrum, LossProfile, hessian_top_eigenvalues, loss_profile
from art_malleability.models.reference import (
    REFERENCE_MODELS,
    LinearizedAttention,
    MLPAttn,
    MLPAttnQKV,
    Transductive,
    TwoLayerReLU,
    build_reference_model,
    is_transductive,
)
from art_malleability.models.training import make_classifier, train_classifier, train_model

__all__ = [
    "ARCHITECTURES",
    "REFERENCE_MODELS",
    "HessianSpectrum",
    "LinearizedAttention",
    "LossProfile",
    "MLPAttn",
    "MLPAttnQKV",
    "ResNet20",
    "SmallCNN",
    "Transductive",
    "TwoLayerReLU",
    "build_architecture",
    "build_reference_model",
    "hessian_top_eigenvalues",
    "is_transductive",
    "loss_profile",
    "make_classifier",
    "train_classifier",
    "train_model",
]
