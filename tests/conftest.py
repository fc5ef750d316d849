"""Shared test configuration.

``import art`` creates ``~/.art``; point ``HOME`` (and ART's data path) at a temporary folder
before anything imports ART, so tests never write to the user's home.
"""

import os
import tempfile

_HOME = tempfile.mkdtemp(prefix="art-malleability-home-")
os.environ["HOME"] = _HOME
os.environ.setdefault("ART_DATA_PATH", os.path.join(_HOME, ".art", "data"))

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture
def shared_data() -> Path:
    """Path of the real data folder beside the checkout; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder not found at {SHARED_DATA} (expected beside the project checkout)")
    return SHARED_DATA


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)
