"""Small trained reference models shared by the end-to-end tests (kept tiny for CI speed), and the metrics' passes."""

from __future__ import annotations

import functools

import numpy as np
import torch

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


#: The smallest audit the command line runs (one attack, no controls, quiet): the output-folder tests' workload.
TINY_AUDIT = [
    "--n-train", "60", "--n-test", "20", "--epochs", "2", "--width", "16", "--n-queries", "5",
    "--n-bootstrap", "10", "--attacks", "fgsm", "--no-controls", "--quiet",
]


def folder_snapshot(folder) -> dict:
    """Every file below a folder (hidden ones too) with its bytes."""
    import os

    return {
        os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(folder) for f in files
    }


def arrays_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def metric_passes(before, after, n_bootstrap=25, seed=0, block=None, top=None, given=False, device=None,
                  **clean_options):
    """
    One clean and one perturbed metrics pass over two influence matrices, in blocks of ``block`` queries (default:
    all at once), as an audit feeds them.

    :param given: Hand the clean matrix over whole (nothing stored) instead of block by block into the store.
    :param device: Give the blocks as float64 tensors on this device, where the resamples and the sums then live
        (default: numpy arrays, on the CPU).
    :param clean_options: ``top_fraction``, ``rank_by``, ``memory_bytes``, ``folder`` of :class:`CleanScores`.
    :return: ``(clean, perturbed)``.
    """
    from art_malleability.metrics import QueryResampling
    from art_malleability.metrics.accumulators import CleanScores, PerturbedScores

    step = block or len(before)
    if device is not None:
        before, after = (torch.as_tensor(m, dtype=torch.float64, device=device) for m in (before, after))
    clean = CleanScores(QueryResampling(len(before), n_bootstrap, seed, device), before.shape[1],
                        given=before if given else None, **clean_options)
    for s in range(0, len(before), step):
        clean.add(before[s : s + step])
    clean.finish(top)
    perturbed = PerturbedScores(clean)
    for s in range(0, len(after), step):
        perturbed.add(after[s : s + step])
    return clean, perturbed
