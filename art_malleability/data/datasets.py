"""
Datasets for audits and reproductions: scikit-learn's bundled digits (the embedded default, no download),
MNIST, Fashion-MNIST and CIFAR-10 through ``torchvision.datasets`` from a local folder, and any ``.npz`` file
holding arrays ``x`` and ``y``.

Every dataset comes back as a :class:`Dataset` with float32 images in `[0, 1]` in NCHW layout (`(n, c, h, w)`;
flat `(n, d)` data from ``.npz`` files stays flat) and int64 class indices. Nothing is ever downloaded unless
``download=True`` is passed.

Data folders for the torchvision datasets (``root``):

- the torchvision layout, e.g. ``root/MNIST/raw/`` with the uncompressed IDX files, or
  ``root/cifar-10-batches-py/``;
- for MNIST and Fashion-MNIST, also the IDX files (uncompressed or ``.gz``) directly in ``root`` or in
  ``root/mnist`` / ``root/fashion-mnist``.

torchvision's ``MNIST`` accepts a folder only when all four IDX files (train and test) are present, and
``CIFAR10`` only when all batches are. A folder holding a single split (e.g. only the 10,000-image MNIST test
set ``t10k-*``) is read split by split here, with torchvision's own IDX readers (MNIST) or an integrity check
restricted to the split's files (CIFAR-10); the log says which splits were found.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split

from art_malleability._utils.params import (
    SEED,
    SIZE,
    InvalidParameterError,
    InvalidParameterTypeError,
    RuleTable,
    check_values,
    invalid,
    invalid_path,
)
from art_malleability.data._loaders import (
    Source,
    check_folder,
    check_npz,
    load_cifar10_source,
    load_digits_source,
    load_idx_source,
    load_npz_source,
)

logger = logging.getLogger(__name__)

DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "cifar10")
#: The ``.param`` of the error that refuses ``n_train`` and ``n_test`` together (they do not fit a one-split source).
BOTH_SIZES = "n_train and n_test"

#: The rules of :func:`load_dataset`'s sizes and seed (the command line's ``--n-train``, ``--n-test`` and ``--seed``
#: check through the same rules).
DATA_RULES: RuleTable = {"n_train": SIZE, "n_test": SIZE, "seed": SEED}

_DIGITS_DEFAULT_SIZES = (1000, 300)
_SINGLE_SPLIT_TEST_FRACTION = 0.2
_ALIASES = {
    "digits": "digits",
    "mnist": "mnist",
    "fashion-mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "fmnist": "fashion-mnist",
    "cifar10": "cifar10",
    "cifar-10": "cifar10",
}


@dataclass
class Dataset:
    """
    A classification dataset split into training and test parts.

    :param name: Dataset name (``"digits"``, ``"mnist"``, ...) or the ``.npz`` file's stem.
    :param x_train: Training images, float32 in `[0, 1]`, shape `(n_train, c, h, w)` (or `(n_train, d)`).
    :param y_train: Training labels, int64 class indices `0 .. nb_classes - 1`, shape `(n_train,)`.
    :param x_test: Test images, like `x_train`.
    :param y_test: Test labels, like `y_train`.
    :param input_shape: Shape of one input, `x_train.shape[1:]`.
    :param nb_classes: Number of classes.
    :param clip_values: Range of the input features.
    :param class_names: Name of each class index.
    :param source: Short provenance string (loader, file, splits, class filter).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    input_shape: tuple[int, ...]
    nb_classes: int
    clip_values: tuple[float, float] = (0.0, 1.0)
    class_names: tuple[str, ...] = field(default_factory=tuple)
    source: str = ""

    @property
    def n_train(self) -> int:
        """Number of training examples."""
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test examples."""
        return int(self.x_test.shape[0])


# ----------------------------------------------------------------------------------------------------
# Filtering and splitting.
# ----------------------------------------------------------------------------------------------------


def _filter_classes(
    pool: tuple[np.ndarray, np.ndarray] | None, classes: list[int]
) -> tuple[np.ndarray, np.ndarray] | None:
    if pool is None:
        return None
    x, y = pool
    mapping = {c: i for i, c in enumerate(classes)}
    keep = np.isin(y, classes)
    y_new = np.array([mapping[int(v)] for v in y[keep]], dtype=np.int64)
    return x[keep], y_new


def subsample(y: np.ndarray, size: int, seed: int, what: str) -> np.ndarray:
    """Indices of a seeded, stratified (when possible) subset of the given size."""
    n = y.shape[0]
    if size == n:
        return np.arange(n)
    index = np.arange(n)
    try:
        chosen, _ = train_test_split(index, train_size=size, stratify=y, random_state=seed)
    except ValueError:
        logger.info(
            "Stratified sampling of %d %s examples not possible; sampling without stratification.", size, what
        )
        chosen, _ = train_test_split(index, train_size=size, random_state=seed)
    return np.sort(chosen)


def _split_one_pool(y: np.ndarray, n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    index = np.arange(y.shape[0])
    try:
        train_idx, test_idx = train_test_split(
            index, train_size=n_train, test_size=n_test, stratify=y, random_state=seed
        )
    except ValueError:
        logger.info(
            "Stratified split into %d/%d examples not possible; splitting without stratification.",
            n_train,
            n_test,
        )
        train_idx, test_idx = train_test_split(index, train_size=n_train, test_size=n_test, random_state=seed)
    return np.sort(train_idx), np.sort(test_idx)


def _digits_sizes(n_train: int | None, n_test: int | None, total: int) -> tuple[int | None, int | None]:
    """
    Default subset sizes of the digits dataset: 1000 / 300, scaled down proportionally when fewer than 1300
    examples are available (after a class filter); a size left `None` next to a given one takes its default,
    capped by what the given one leaves.
    """
    default_train, default_test = _DIGITS_DEFAULT_SIZES
    if n_train is None and n_test is None:
        scale = min(1.0, total / (default_train + default_test))
        n_test = max(1, int(default_test * scale))
        return min(int(default_train * scale), total - n_test), n_test
    if n_test is None:
        return n_train, min(default_test, total - n_train)
    if n_train is None:
        return min(default_train, total - n_test), n_test
    return n_train, n_test


def resolve_source(
    name_or_path: str | os.PathLike, root: str | os.PathLike | None = None, download: bool = False
) -> tuple[str | None, Path | None]:
    """
    Where :func:`load_dataset` would read a dataset from, checked without reading it.

    :param name_or_path: A name of ``DATASET_NAMES`` or the path of an ``.npz`` file (see :func:`load_dataset`).
    :param root: Local data folder of the torchvision datasets; relative ``.npz`` paths are looked up under it.
    :param download: Whether a missing torchvision folder may be created by a download.
    :return: ``(name, folder)`` of a named dataset (``folder`` ``None`` for digits) or ``(None, file)`` of an
        ``.npz`` file.
    :raises InvalidParameterError: Naming ``name_or_path`` or ``root`` (a ``ValueError``): on an unknown name, a
        torchvision dataset without ``root`` or a file that is no ``.npz`` archive; also a ``FileNotFoundError`` when
        the folder or the file does not exist, or the folder holds no split of the dataset (file names only: the files
        are not read), and a ``TypeError`` for a ``name_or_path`` that is neither a string nor a path.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise InvalidParameterTypeError("name_or_path", "be a dataset name or a path", type(name_or_path).__name__)
    key = _ALIASES.get(str(name_or_path).strip().lower().replace("_", "-"))
    if key is not None and not (isinstance(name_or_path, os.PathLike) or str(name_or_path).endswith(".npz")):
        if key == "digits":
            return key, None
        if root is None:
            raise invalid("root", f"be the local data folder of {key!r} (torchvision layout)", None,
                          "; pass the folder that holds its files")
        root_path = Path(root).expanduser()
        if not download:
            if not root_path.is_dir():
                what = "a file" if root_path.exists() else "no existing folder"
                raise invalid_path("root", "be an existing folder", root, f", which is {what}")
            check_folder(key, root_path)
        return key, root_path
    path = Path(name_or_path).expanduser()
    if root is not None and not path.is_absolute():
        path = Path(root).expanduser() / path
    if path.is_dir():
        raise invalid_path(
            "name_or_path", "be a dataset name or an .npz file with arrays x and y", path,
            f", which is a folder; a torchvision folder is given as root with a dataset name, one of {DATASET_NAMES}",
        )
    if not path.is_file() and (path.suffix == ".npz" or os.sep in str(name_or_path)):
        raise invalid_path("name_or_path", "be an existing .npz file", path, ", which does not exist")
    if not path.is_file():
        raise invalid("name_or_path", f"be one of {DATASET_NAMES} or the path of an .npz file with arrays x and y",
                      str(name_or_path))
    check_npz(path)
    return None, path


def load_dataset(
    name_or_path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    n_train: int | None = None,
    n_test: int | None = None,
    classes: Sequence[int] | None = None,
    seed: int = 0,
    download: bool = False,
) -> Dataset:
    """
    Load a dataset, optionally keep some classes, and draw seeded, stratified training and test subsets.

    Sources with separate training and test splits (torchvision folders holding both) give the training subset
    from the training split and the test subset from the test split. Sources with one split (digits, ``.npz``,
    a folder holding only the MNIST test files) are divided into disjoint training and test subsets. Subsets
    are drawn with scikit-learn's ``train_test_split`` (stratified by class when the class counts allow it)
    with ``random_state=seed``; the same arguments always give the same arrays. Each subset keeps the source's
    order, so a source sorted by class (such as the CIFAR-10 ``.npz`` of the test split) gives arrays sorted by
    class: draw a further subset rather than slicing a prefix.

    :param name_or_path: One of ``DATASET_NAMES`` (``"digits"``, ``"mnist"``, ``"fashion-mnist"``,
                         ``"cifar10"``) or the path of an ``.npz`` file with arrays ``x`` (images: uint8 in
                         0..255, or float in `[0, 1]`; shape `(n, h, w, c)` or `(n, c, h, w)` with c in 1 or
                         3, `(n, h, w)` or `(n, d)`), ``y`` (integer labels, shape `(n,)`) and optionally
                         ``class_names``. A relative path is looked up under `root` when given.
    :param root: Local data folder of the torchvision datasets (required for them; see the module docstring
                 for the accepted layouts); ignored for ``"digits"``.
    :param n_train: Number of training examples; `None` means all available, except for ``"digits"`` (1000,
                    scaled down when a class filter leaves fewer than 1300 examples) and for one-split
                    sources, where it means all examples not used for testing.
    :param n_test: Number of test examples; `None` means all available, except for ``"digits"`` (300, scaled
                   down likewise) and for one-split sources, where it means all examples not used for training
                   (20 % when `n_train` is `None` too).
    :param classes: Original labels to keep, e.g. `[3, 8]`; they are relabelled `0 .. k-1` in the given order.
    :param seed: Seed of the subset selection.
    :param download: Allow torchvision to download missing files into `root`.
    :return: The dataset.
    :raises InvalidParameterError: Naming the argument the data refuses (``name_or_path``, ``root``, ``n_train``,
        ``n_test``, both sizes as ``"n_train and n_test"``, ``classes`` or ``seed``); a ``ValueError``, also a
        ``TypeError`` for a value of the wrong type and a ``FileNotFoundError`` for a missing file or folder
        (:func:`resolve_source`).
    """
    sizes = check_values(DATA_RULES, {"n_train": n_train, "n_test": n_test, "seed": seed})
    n_train, n_test = sizes["n_train"], sizes["n_test"]
    key, location = resolve_source(name_or_path, root, download)
    source = _read_source(key, location, download)
    name = key if key is not None else location.stem
    if classes is not None:
        _keep_classes(source, [int(c) for c in classes], name)
    if source.train is not None and source.test is not None:
        (x_train, y_train), (x_test, y_test) = _draw_from_splits(source, n_train, n_test, seed)
    else:
        (x_train, y_train), (x_test, y_test) = _draw_from_one_pool(source, n_train, n_test, seed, name)
    description = f"{source.description}, seed {seed}: {x_train.shape[0]} train / {x_test.shape[0]} test"
    logger.info("Loaded %s: %s.", name, description)
    return Dataset(
        name=name,
        x_train=np.ascontiguousarray(x_train, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=np.int64),
        x_test=np.ascontiguousarray(x_test, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=np.int64),
        input_shape=tuple(int(s) for s in x_train.shape[1:]),
        nb_classes=int(source.nb_classes),
        clip_values=(0.0, 1.0),
        class_names=tuple(source.class_names),
        source=description,
    )


def _read_source(key: str | None, location: Path | None, download: bool) -> Source:
    if key == "digits":
        return load_digits_source()
    if key == "cifar10":
        return load_cifar10_source(location, download)
    if key is not None:
        return load_idx_source(key, location, download)
    return load_npz_source(location)


def _keep_classes(source: Source, classes: list[int], name: str) -> None:
    """Keep the examples of ``classes`` in the source's pools, relabelled ``0 .. k-1`` in that order."""
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise invalid("classes", "list at least two distinct labels", classes)
    out_of_range = [c for c in classes if not 0 <= c < source.nb_classes]
    if out_of_range:
        raise invalid("classes", f"lie in 0..{source.nb_classes - 1} of {name!r}", out_of_range)
    source.train = _filter_classes(source.train, classes)
    source.test = _filter_classes(source.test, classes)
    for pool in (source.train, source.test):
        if pool is not None and pool[1].size == 0:
            raise InvalidParameterError("classes", f"have examples in {name!r}", f"{classes} with none")
    source.class_names = tuple(source.class_names[c] for c in classes) if source.class_names else ()
    source.nb_classes = len(classes)
    source.description += f", classes {classes}"


def _draw_from_splits(
    source: Source, n_train: int | None, n_test: int | None, seed: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The training subset from the training split, the test subset from the test split."""
    drawn = []
    for arg_name, value, (x, y), what in (
        ("n_train", n_train, source.train, "training"),
        ("n_test", n_test, source.test, "test"),
    ):
        if value is not None and value > y.shape[0]:
            raise invalid(arg_name, f"not exceed the {y.shape[0]} examples of the {what} split", value)
        rows = subsample(y, value or y.shape[0], seed, what)
        drawn.append((x[rows], y[rows]))
    return drawn[0], drawn[1]


def _draw_from_one_pool(
    source: Source, n_train: int | None, n_test: int | None, seed: int, name: str
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Disjoint training and test subsets of a source with one split."""
    x_pool, y_pool = source.test if source.test is not None else source.train
    total = y_pool.shape[0]
    if name == "digits":
        n_train, n_test = _digits_sizes(n_train, n_test, total)
    if n_train is None and n_test is None:
        n_test = max(1, int(round(_SINGLE_SPLIT_TEST_FRACTION * total)))
    if n_train is None:
        n_train = total - n_test
    if n_test is None:
        n_test = total - n_train
    if n_train < 1 or n_test < 1 or n_train + n_test > total:
        raise InvalidParameterError(
            BOTH_SIZES, f"each be >= 1 and together at most the {total} examples of {name!r}", f"{n_train} and {n_test}"
        )
    train_idx, test_idx = _split_one_pool(y_pool, n_train, n_test, seed)
    return (x_pool[train_idx], y_pool[train_idx]), (x_pool[test_idx], y_pool[test_idx])
