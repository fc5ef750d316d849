"""A user-side model factory for the CLI's ``module:factory`` option (imported by name in tests)."""

from art_malleability.models import TwoLayerReLU


def make(input_shape, nb_classes):
    return TwoLayerReLU(input_shape, width=16, nb_classes=nb_classes, seed=0)
