"""
Training examples given as numpy arrays or as a map-style :class:`torch.utils.data.Dataset`
(or a :class:`~torch.utils.data.DataLoader` over one), read in batches.

A dataset yields ``(x, y)`` pairs: ``x`` an array or tensor of the classifier's input shape, ``y``
a class index (int, 0-d array or tensor) or a one-hot row. Examples are addressed by their index
in the dataset: a ``DataLoader`` contributes its dataset, ``collate_fn`` and ``num_workers``, and is
read in index order whatever its sampler (so that the rows of an influence matrix are the
dataset's examples in order). Iterable-style datasets have no indices and are refused.

Batches are validated as they are read (shape, finite values, labels in range) and converted to
float32 inputs and int64 labels (the ART convention), so a training set never has to sit in
memory whole, and never as float64.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from art_malleability._utils.checks import check_features, check_labels, check_range

logger = logging.getLogger(__name__)


def is_torch_data(x: object) -> bool:
    """Whether ``x`` is a torch ``Dataset`` or ``DataLoader`` (rather than an array)."""
    return isinstance(x, (Dataset, DataLoader))


class ExampleSource:
    """
    Examples and labels from arrays or from a map-style torch dataset, read in validated batches.

    :param x: Inputs ``(n, *input_shape)`` (a numpy array: checked here when ``input_shape`` is given, else used
        as it is, validated by the caller), or a ``Dataset`` / ``DataLoader`` of ``(x, y)`` pairs (validated batch by
        batch).
    :param y: Labels for array inputs (class indices ``(n,)``, or one-hot rows when ``input_shape`` is given); must
        be ``None`` for a dataset.
    :param input_shape: The expected input shape: array inputs are checked against it (finite values in
        ``clip_values``, labels below ``nb_classes``) and converted to float32 inputs and int64 class indices; a
        dataset's batches are checked against it (default: the shape of its first example).
    :param nb_classes: Number of classes, the bound of the labels (default: no bound).
    :param name: Argument name of ``x`` (for error messages); the labels are ``y`` + its suffix.
    :param clip_values: The classifier's valid input range: every batch read from a dataset must lie in it, as
        arrays must (:func:`~art_malleability._utils.checks.check_range`); ``None``: any range.
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        input_shape: tuple[int, ...] | None = None,
        nb_classes: int | None = None,
        name: str = "x",
        clip_values: tuple | None = None,
    ) -> None:
        self.name = name
        self.clip_values = clip_values
        self.label_name = "y" + name[1:]
        self.nb_classes = None if nb_classes is None else int(nb_classes)
        self._labels: np.ndarray | None = None
        self.collate_fn = None
        self.num_workers = 0
        if not is_torch_data(x):
            if input_shape is not None:  # arrays checked as every batch of a dataset is
                x = check_features(x, name, tuple(input_shape))
                check_range(x, name, clip_values)
                y = check_labels(y, self.label_name, len(x), self.nb_classes)
            self.dataset: Dataset | None = None
            self.given = x
            self.x = x
            self._labels = y
            self.n = len(x)
            self.input_shape = tuple(x.shape[1:])
            return
        if y is not None:
            raise ValueError(
                f"{self.label_name} must be None when {name} is a torch Dataset or DataLoader "
                "(the dataset yields the labels)"
            )
        self.given = x  # the object as passed (a DataLoader keeps its collate_fn and workers when passed on)
        if isinstance(x, DataLoader):
            self.collate_fn, self.num_workers = x.collate_fn, x.num_workers
            x = x.dataset
        if isinstance(x, IterableDataset) or not hasattr(x, "__len__"):
            raise TypeError(
                f"{name} must be a map-style torch Dataset (with __len__ and __getitem__); "
                f"an iterable-style dataset has no example indices, got {type(x).__name__}"
            )
        self.dataset = x
        self.x = None
        self.n = len(x)
        if self.n == 0:
            raise ValueError(f"{name} must hold at least one example, got an empty dataset")
        if input_shape is None:
            first = x[0]
            if not isinstance(first, (tuple, list)) or len(first) < 2:
                raise ValueError(f"{name} must yield (x, y) pairs, got {type(first).__name__} for example 0")
            input_shape = tuple(np.shape(first[0]))
        self.input_shape = tuple(input_shape)

    @property
    def is_array(self) -> bool:
        """Whether the examples are held as an array."""
        return self.dataset is None

    def batches(
        self, batch_size: int, start: int = 0, stop: int | None = None, indices: np.ndarray | None = None
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """
        Validated batches of rows ``start:stop`` (or of ``indices``), in order.

        :param batch_size: Rows per batch.
        :param start: First row.
        :param stop: End row (default: all).
        :param indices: Explicit rows instead of a range.
        :return: Iterator of ``(offset, x float32, y int64)``, ``offset`` counting rows yielded before.
        """
        rows = np.arange(start, self.n if stop is None else stop) if indices is None else np.asarray(indices)
        if self.is_array:
            for s in range(0, len(rows), batch_size):
                r = rows[s : s + batch_size]
                yield s, self.x[r], self._labels[r]
            return
        loader = DataLoader(
            Subset(self.dataset, rows.tolist()),
            batch_size=batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )
        offset = 0
        batches = iter(loader)
        while True:
            chunk = rows[offset : offset + batch_size]
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (RuntimeError, TypeError, ValueError) as error:
                raise ValueError(
                    f"{self.name} must yield batches the DataLoader can collate, got an error for examples "
                    f"{int(chunk[0])}..{int(chunk[-1])}: {error}"
                ) from error
            x, y = self._check_batch(batch, chunk)
            yield offset, x, y
            offset += len(x)

    def _check_batch(self, batch: Any, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError(
                f"{self.name} must yield (x, y) pairs, got {type(batch).__name__} for example {int(rows[0])}"
            )
        x, y = batch[0], batch[1]
        x = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        y = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
        where = f"{self.name} (examples {int(rows[0])}..{int(rows[-1])})"
        if x.ndim >= 1 and tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(
                f"{where} must yield inputs of the classifier's input_shape {self.input_shape}, got inputs of shape "
                f"{tuple(x.shape[1:])}"
            )
        x = check_features(np.asarray(x), where, self.input_shape)
        check_range(x, where, self.clip_values)
        nb_classes = self.nb_classes
        if nb_classes is None and y.ndim == 2 and y.shape[1] > 1:  # one-hot rows: their width is the bound
            nb_classes = y.shape[1]
        y = check_labels(y, f"the labels of {where}", len(x), nb_classes)  # None: any non-negative index
        return x, y

    def take(self, indices: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """
        :param indices: Rows to read.
        :param batch_size: Rows per read.
        :return: ``(x float32, y int64)`` of those rows, in the order given.
        """
        indices = np.asarray(indices, dtype=np.int64)
        if self.is_array:
            return self.x[indices], self._labels[indices]
        x = np.empty((len(indices), *self.input_shape), dtype=np.float32)
        y = np.empty(len(indices), dtype=np.int64)
        for s, xb, yb in self.batches(batch_size, indices=indices):
            x[s : s + len(xb)] = xb
            y[s : s + len(yb)] = yb
        return x, y

    def labels(self, batch_size: int = 256) -> np.ndarray:
        """:return: All labels (int64), read once and cached for a dataset."""
        if self._labels is None:
            y = np.empty(self.n, dtype=np.int64)
            for s, _, yb in self.batches(batch_size):
                y[s : s + len(yb)] = yb
            self._labels = y
        return self._labels

    def arrays(self, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """:return: All examples and labels as arrays (read whole for a dataset)."""
        if self.is_array:
            return self.x, self._labels
        x, y = self.take(np.arange(self.n), batch_size)
        self._labels = y
        return x, y
