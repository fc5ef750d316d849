"""What a report records about where it came from: the digest of the weights it describes and the library versions."""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version

import torch


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (to check that every process audits the same model)."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    names = ["art-malleability", "adversarial-robustness-toolbox", "torch", "captum", "numpy", "scipy"]
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found
