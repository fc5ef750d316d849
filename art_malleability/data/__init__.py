"""
Data for audits: the datasets (scikit-learn's bundled digits, MNIST, Fashion-MNIST, CIFAR-10), training
examples streamed from a :class:`torch.utils.data.Dataset`, and the classifier's input pipeline in front of its
model.

- :mod:`~art_malleability.data.datasets`: :func:`load_dataset` (its file readers in the private ``_loaders``);
- :mod:`~art_malleability.data.streaming`: numpy arrays or a map-style dataset behind one interface;
- :mod:`~art_malleability.data.input_pipeline`: ART's preprocessing put in front of the model, for the
  influence estimators.
"""

from art_malleability.data.datasets import DATASET_NAMES, Dataset, load_dataset

__all__ = ["DATASET_NAMES", "Dataset", "load_dataset"]
