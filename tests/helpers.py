"""Small trained reference models shared by the end-to-end tests (kept tiny for CI speed)."""

from __future__ import annotations

import functools

import numpy as np

from art_malleability.data import Dataset, load_dataset
from art_malleability.models import build_reference_model, make_classifier, train_model


@functools.cache
def digits(n_train: int = 200, n_test: int = 60) -> Dataset:
    return load_dataset("digits", n_train=n_train, n_test=n_test, seed=0)


def trained_classifier(name: str = "2l-relu", width: int = 64, epochs: int = 500, loss: str = "cross_entropy"):
    """Reference model trained full-batch (Adam lr 0.1, no weight decay): test accuracy 0.97 / 0.62."""
    data = digits()
    model = build_reference_model(name, data.input_shape, data.nb_classes, width=width, seed=0)
    model = train_model(
        model, data.x_train, data.y_train, loss=loss, epochs=epochs, batch_size=200, lr=0.1, weight_decay=0.0, seed=0,
        verbose=False, device="cpu",
    )
    return make_classifier(model, data.input_shape, data.nb_classes, loss=loss, device="cpu")


def arrays_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
