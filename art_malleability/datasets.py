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

import gzip
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split

logger = logging.getLogger(__name__)

DATASET_NAMES: tuple[str, ...] = ("digits", "mnist", "fashion-mnist", "cifar10")

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
_IDX_FOLDERS = {"mnist": ("MNIST", "mnist"), "fashion-mnist": ("FashionMNIST", "fashion-mnist")}


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
# Sources: the available splits (train and/or test) as (x, y) pools, plus metadata.
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Source:
    train: tuple[np.ndarray, np.ndarray] | None
    test: tuple[np.ndarray, np.ndarray] | None
    nb_classes: int
    class_names: tuple[str, ...]
    description: str


def _load_digits_source() -> _Source:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    names = tuple(str(c) for c in bunch.target_names)
    return _Source(None, (x, y), 10, names, "sklearn.datasets.load_digits")


def _find_idx_file(folders: Sequence[Path], stem: str) -> Path | None:
    for folder in folders:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_idx(path: Path, reader) -> np.ndarray:
    """
    Read an IDX file with one of torchvision's readers, decompressing ``.gz`` files into a temporary folder.

    :param path: The IDX file (uncompressed or ``.gz``).
    :param reader: ``torchvision.datasets.mnist.read_image_file`` or ``read_label_file``.
    :return: The array.
    """
    if path.suffix != ".gz":
        return reader(str(path)).numpy()
    with tempfile.TemporaryDirectory(prefix="art-malleability-idx-") as tmp:
        target = Path(tmp) / path.stem
        with gzip.open(path, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        return reader(str(target)).numpy()


def _load_idx_source(name: str, root: Path, download: bool) -> _Source:
    from torchvision.datasets import MNIST, FashionMNIST
    from torchvision.datasets.mnist import read_image_file, read_label_file

    dataset_class = MNIST if name == "mnist" else FashionMNIST
    class_names = tuple(dataset_class.classes)
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    description = f"torchvision.datasets.{dataset_class.__name__}"
    try:
        # The torchvision route: needs both splits (or torchvision's legacy processed files).
        for split in ("train", "test"):
            ds = dataset_class(str(root), train=split == "train", download=download)
            splits[split] = (ds.data.numpy(), ds.targets.numpy())
    except RuntimeError:
        if download:
            raise
        splits = {}
    if not splits:
        folders = [root / dataset_class.__name__ / "raw", root] + [root / sub for sub in _IDX_FOLDERS[name]]
        for split, prefix in (("train", "train"), ("test", "t10k")):
            images = _find_idx_file(folders, f"{prefix}-images-idx3-ubyte")
            labels = _find_idx_file(folders, f"{prefix}-labels-idx1-ubyte")
            if images is not None and labels is not None:
                splits[split] = (_read_idx(images, read_image_file), _read_idx(labels, read_label_file))
                logger.info("Read the %s %s split from %s.", name, split, images.parent)
        if not splits:
            raise FileNotFoundError(
                f"No {name} IDX files found under root={str(root)!r}: looked for "
                "'{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]' in "
                f"{[str(f) for f in folders]}. Pass download=True to let torchvision download them."
            )
        description = f"{description} IDX files ({'+'.join(splits)})"
        if "train" not in splits:
            logger.info(
                "Only the %s test split is present under %s; train and test are drawn from it.", name, root
            )
    pools = {
        k: ((v[0].astype(np.float32) / 255.0)[:, None, :, :], v[1].astype(np.int64))
        for k, v in splits.items()
    }
    return _Source(pools.get("train"), pools.get("test"), 10, class_names, description)


def _load_cifar10_source(root: Path, download: bool) -> _Source:
    from torchvision.datasets import CIFAR10

    class _SplitCIFAR10(CIFAR10):
        """CIFAR10 that checks only the files of the requested split (and the metadata)."""

        def _check_integrity(self) -> bool:
            from torchvision.datasets.utils import check_integrity

            files = self.train_list if self.train else self.test_list
            files = [*files, [self.meta["filename"], self.meta["md5"]]]
            return all(check_integrity(os.path.join(self.root, self.base_folder, f), md5) for f, md5 in files)

    if download:
        CIFAR10(str(root), train=True, download=True)
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    class_names: tuple[str, ...] = ()
    for split in ("train", "test"):
        try:
            ds = _SplitCIFAR10(str(root), train=split == "train", download=False)
        except RuntimeError:
            continue
        x = (ds.data.astype(np.float32) / 255.0).transpose(0, 3, 1, 2)
        splits[split] = (np.ascontiguousarray(x), np.asarray(ds.targets, dtype=np.int64))
        class_names = tuple(ds.classes)
    if not splits:
        raise FileNotFoundError(
            f"No CIFAR-10 batches found under root={str(root)!r} (expected {CIFAR10.base_folder}/ with "
            "data_batch_* and/or test_batch and batches.meta). Pass download=True to let torchvision "
            "download them, or load an .npz file with arrays x and y."
        )
    if "train" not in splits:
        logger.info(
            "Only the CIFAR-10 test split is present under %s; train and test are drawn from it.", root
        )
    return _Source(
        splits.get("train"),
        splits.get("test"),
        10,
        class_names,
        f"torchvision.datasets.CIFAR10 ({'+'.join(splits)})",
    )


def _images_to_nchw(x: np.ndarray, path: Path) -> np.ndarray:
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x[:, None, :, :]
    if x.ndim == 4:
        last, first = x.shape[-1] in (1, 3), x.shape[1] in (1, 3)
        if last:
            if first:
                logger.warning("x in %s has shape %s; reading it as NHWC (channels last).", path, x.shape)
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        if first:
            return x
    raise ValueError(
        f"Array x in {path} must have shape (n, d), (n, h, w), (n, h, w, c) or (n, c, h, w) with c in "
        f"(1, 3), got {x.shape}."
    )


def _labels_from_array(y: np.ndarray, n: int, path: Path) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim == 2 and y.shape[1] > 1 and np.all((y == 0) | (y == 1)) and np.all(y.sum(axis=1) == 1):
        y = np.argmax(y, axis=1)
    if y.ndim != 1:
        raise ValueError(
            f"Array y in {path} must hold class indices of shape (n,) or one-hot labels, got {y.shape}."
        )
    if y.shape[0] != n:
        raise ValueError(f"Arrays x and y in {path} have different lengths: {n} and {y.shape[0]}.")
    if np.issubdtype(y.dtype, np.integer):
        pass
    elif np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0):
        pass
    else:
        raise ValueError(
            f"Array y in {path} must hold integer class labels, got dtype {y.dtype} with non-integers."
        )
    if y.size and y.min() < 0:
        raise ValueError(f"Array y in {path} must hold non-negative class labels, got minimum {y.min()}.")
    y = y.astype(np.int64)
    present = np.unique(y)
    if len(present) < 2:
        logger.warning("Array y in %s holds a single class (%d): a classifier of it learns nothing.", path,
                       int(present[0]) if present.size else -1)
    elif len(present) < int(present.max()) + 1:
        empty = sorted(set(range(int(present.max()) + 1)) - set(present.tolist()))
        logger.warning("Array y in %s has no example of class(es) %s of 0..%d (labels 1..C instead of 0..C-1?).",
                       path, empty[:10], int(present.max()))
    return y


def _load_npz_source(path: Path) -> _Source:
    import zipfile

    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"{path} is not a readable .npz archive; expected the output of numpy.savez with arrays x and y"
        ) from err
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} holds a single array (an .npy file); save x and y together with numpy.savez")
    with archive:
        missing = [key for key in ("x", "y") if key not in archive.files]
        if missing:
            raise ValueError(
                f"{path} must hold arrays 'x' and 'y'; missing {missing} (found {archive.files})."
            )
        x = archive["x"]
        y = archive["y"]
        names = tuple(str(c) for c in archive["class_names"]) if "class_names" in archive.files else ()
    if x.ndim < 2 or x.shape[0] < 1:
        raise ValueError(f"Array x in {path} must have shape (n, ...) with n >= 1, got {x.shape}.")
    y = _labels_from_array(y, x.shape[0], path)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise ValueError(f"Float array x in {path} holds {int((~np.isfinite(x)).sum())} NaN or infinite values.")
        if x.min() < 0.0 or x.max() > 1.0:
            raise ValueError(
                f"Float array x in {path} must lie in [0, 1], got range [{x.min()}, {x.max()}]; "
                "rescale it or store uint8 pixels (0..255)."
            )
    elif x.dtype == np.bool_:
        x = x.astype(np.float32)
    else:
        raise ValueError(f"Array x in {path} must be uint8 (0..255) or float in [0, 1], got dtype {x.dtype}.")
    x = _images_to_nchw(x, path)
    nb_classes = max(int(y.max()) + 1, 2)
    if len(names) != nb_classes:
        names = tuple(str(c) for c in range(nb_classes))
    return _Source(None, (x, y), nb_classes, names, f"npz file {path.name}")


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


def _check_size(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (or None), got {value}.")
    return int(value)


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
    :raises ValueError: On an unknown name or a torchvision dataset without ``root``.
    :raises FileNotFoundError: When the folder or the file does not exist.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a dataset name or a path, got {type(name_or_path).__name__}.")
    key = _ALIASES.get(str(name_or_path).strip().lower().replace("_", "-"))
    if key is not None and not (isinstance(name_or_path, os.PathLike) or str(name_or_path).endswith(".npz")):
        if key == "digits":
            return key, None
        if root is None:
            raise ValueError(
                f"root is required for {key!r}: pass the local data folder (torchvision layout), e.g. "
                f"load_dataset({key!r}, root='data')."
            )
        root_path = Path(root).expanduser()
        if not root_path.is_dir() and not download:
            raise FileNotFoundError(f"root={str(root)!r} is not an existing folder.")
        return key, root_path
    path = Path(name_or_path).expanduser()
    if root is not None and not path.is_absolute():
        path = Path(root).expanduser() / path
    if not path.is_file():
        if path.is_dir():
            raise FileNotFoundError(
                f"Dataset {str(path)!r} is a folder; a dataset path must be an .npz file with arrays x and y (a "
                f"torchvision folder is given as root with a dataset name, one of {DATASET_NAMES})."
            )
        if path.suffix == ".npz" or os.sep in str(name_or_path):
            raise FileNotFoundError(f"Dataset file {str(path)!r} does not exist.")
        raise ValueError(
            f"Unknown dataset name {str(name_or_path)!r}; expected one of {DATASET_NAMES} or the path of "
            "an .npz file with arrays x and y."
        )
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
    """
    n_train = _check_size(n_train, "n_train")
    n_test = _check_size(n_test, "n_test")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
    key, location = resolve_source(name_or_path, root, download)
    if key == "digits":
        source = _load_digits_source()
    elif key == "cifar10":
        source = _load_cifar10_source(location, download)
    elif key is not None:
        source = _load_idx_source(key, location, download)
    else:
        source = _load_npz_source(location)
    name = key if key is not None else location.stem

    nb_classes = source.nb_classes
    class_names = source.class_names
    description = source.description
    if classes is not None:
        classes = [int(c) for c in classes]
        if len(classes) < 2 or len(set(classes)) != len(classes):
            raise ValueError(f"classes must list at least two distinct labels, got {classes}.")
        out_of_range = [c for c in classes if not 0 <= c < nb_classes]
        if out_of_range:
            raise ValueError(f"classes holds labels {out_of_range} outside 0..{nb_classes - 1} of {name!r}.")
        source.train = _filter_classes(source.train, classes)
        source.test = _filter_classes(source.test, classes)
        for pool in (source.train, source.test):
            if pool is not None and pool[1].size == 0:
                raise ValueError(f"No examples of classes {classes} found in {name!r}.")
        class_names = tuple(class_names[c] for c in classes) if class_names else ()
        nb_classes = len(classes)
        description += f", classes {classes}"

    if source.train is not None and source.test is not None:
        (x_tr_pool, y_tr_pool), (x_te_pool, y_te_pool) = source.train, source.test
        for arg_name, value, pool_size in (
            ("n_train", n_train, y_tr_pool.shape[0]),
            ("n_test", n_test, y_te_pool.shape[0]),
        ):
            if value is not None and value > pool_size:
                raise ValueError(
                    f"{arg_name}={value} exceeds the {pool_size} examples available in that split."
                )
        train_idx = subsample(y_tr_pool, n_train or y_tr_pool.shape[0], seed, "training")
        test_idx = subsample(y_te_pool, n_test or y_te_pool.shape[0], seed, "test")
        x_train, y_train = x_tr_pool[train_idx], y_tr_pool[train_idx]
        x_test, y_test = x_te_pool[test_idx], y_te_pool[test_idx]
    else:
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
            raise ValueError(
                f"n_train={n_train} and n_test={n_test} do not fit the {total} examples of {name!r} "
                "(n_train + n_test must not exceed them and each must be >= 1)."
            )
        train_idx, test_idx = _split_one_pool(y_pool, n_train, n_test, seed)
        x_train, y_train = x_pool[train_idx], y_pool[train_idx]
        x_test, y_test = x_pool[test_idx], y_pool[test_idx]

    description += f", seed {seed}: {x_train.shape[0]} train / {x_test.shape[0]} test"
    logger.info("Loaded %s: %s.", name, description)
    return Dataset(
        name=name,
        x_train=np.ascontiguousarray(x_train, dtype=np.float32),
        y_train=np.ascontiguousarray(y_train, dtype=np.int64),
        x_test=np.ascontiguousarray(x_test, dtype=np.float32),
        y_test=np.ascontiguousarray(y_test, dtype=np.int64),
        input_shape=tuple(int(s) for s in x_train.shape[1:]),
        nb_classes=int(nb_classes),
        clip_values=(0.0, 1.0),
        class_names=tuple(class_names),
        source=description,
    )
