"""A user-side model factory for the CLI's ``module:factory`` option (imported by name in tests)."""

from art_malleability.models import TwoLayerReLU


def make(input_shape, nb_classes):
    return TwoLayerReLU(input_shape, width=16, nb_classes=nb_classes, seed=0)


def broken(input_shape, nb_classes):
    raise RuntimeError("this factory always fails")


def hangs_on_rank_1(input_shape, nb_classes):
    """A factory that never returns on the second process of a torchrun launch: a rank that stops answering."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        time.sleep(600)
    return make(input_shape, nb_classes)
