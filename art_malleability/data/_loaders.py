"""
The sources behind :func:`art_malleability.data.datasets.load_dataset`: scikit-learn's digits, the MNIST and
Fashion-MNIST IDX files, the CIFAR-10 batches of a torchvision folder and ``.npz`` files, each read into its
available splits (train and/or test) as ``(x, y)`` pools of float32 images in `[0, 1]` and int64 labels.
:func:`check_folder` says, without reading any file, whether a folder holds one split of a dataset.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from art_malleability._utils.params import (
    DataContentError,
    InvalidParameterPathError,
    invalid,
    invalid_path,
)

logger = logging.getLogger(__name__)

#: Folders below ``root`` searched for the IDX files; the first is also torchvision's class name.
_IDX_FOLDERS = {"mnist": ("MNIST", "mnist"), "fashion-mnist": ("FashionMNIST", "fashion-mnist")}
_IDX_PATTERN = "'{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]'"
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_SPLITS = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
#: What an ``.npz`` file must be (the rule's words in ``name_or_path must ...``).
_NPZ_ARCHIVE = "be an .npz archive written by numpy.savez with arrays x and y"


@dataclass
class Source:
    """The available splits of a dataset as ``(x, y)`` pools, with its metadata."""

    train: tuple[np.ndarray, np.ndarray] | None
    test: tuple[np.ndarray, np.ndarray] | None
    nb_classes: int
    class_names: tuple[str, ...]
    description: str


def load_digits_source() -> Source:
    """scikit-learn's bundled 8x8 digits, one split."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    names = tuple(str(c) for c in bunch.target_names)
    return Source(None, (x, y), 10, names, "sklearn.datasets.load_digits")


# ----------------------------------------------------------------------------------------------------
# Torchvision folders: which files hold a split, checked without reading them.
# ----------------------------------------------------------------------------------------------------


def check_folder(name: str, root: Path) -> None:
    """
    Check that ``root`` holds at least one split of the torchvision dataset ``name``, by file names only.

    :param name: ``"mnist"``, ``"fashion-mnist"`` or ``"cifar10"``.
    :param root: An existing folder.
    :raises InvalidParameterPathError: Naming ``root``, when no split's files are there (a ``FileNotFoundError``); the
        message lists near misses.
    """
    if name == "cifar10":
        if not _cifar_splits(root):
            raise invalid_path(
                "root", f"hold CIFAR-10's {_CIFAR_FOLDER}/ with data_batch_1..5 and/or test_batch and batches.meta",
                root, f"{_cifar_misses(root)}; pass download=True to let torchvision download them, or load an .npz "
                "file with arrays x and y",
            )
        return
    processed = root / _IDX_FOLDERS[name][0] / "processed"
    if not _idx_splits(name, root) and not all((processed / f).is_file() for f in ("training.pt", "test.pt")):
        raise _no_idx_files(name, root)


def _no_idx_files(name: str, root: Path) -> InvalidParameterPathError:
    folders = _idx_folders(name, root)
    return invalid_path(
        "root", f"hold the {name} IDX files {_IDX_PATTERN} in one of {[str(f) for f in folders]}", root,
        f"{_near_misses(folders, ('ubyte', 'idx'))}; pass download=True to let torchvision download them",
    )


def _near_misses(folders: list[Path], words: tuple[str, ...]) -> str:
    """`` (found 'a', 'b' there)`` for files whose names hold one of ``words``, or nothing."""
    found = sorted({p.name for f in folders if f.is_dir() for p in f.iterdir() if any(w in p.name for w in words)})
    return f" (found {', '.join(repr(n) for n in found[:4])}{', ...' if len(found) > 4 else ''} there)" if found else ""


def _cifar_misses(root: Path) -> str:
    """`` (cifar-10-batches-py/ there lacks ...)`` when the folder is there, or nothing."""
    folder = root / _CIFAR_FOLDER
    if not folder.is_dir():
        return ""
    files = ["batches.meta", *_CIFAR_SPLITS["test"], *_CIFAR_SPLITS["train"]]
    return f" ({_CIFAR_FOLDER}/ there lacks {', '.join(f for f in files if not (folder / f).is_file())})"


def _idx_folders(name: str, root: Path) -> list[Path]:
    return [root / _IDX_FOLDERS[name][0] / "raw", root] + [root / sub for sub in _IDX_FOLDERS[name]]


def _idx_splits(name: str, root: Path) -> dict[str, tuple[Path, Path]]:
    """The ``(images, labels)`` IDX files of each split found below ``root``."""
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = _find_idx_file(_idx_folders(name, root), f"{prefix}-images-idx3-ubyte")
        labels = _find_idx_file(_idx_folders(name, root), f"{prefix}-labels-idx1-ubyte")
        if images is not None and labels is not None:
            splits[split] = (images, labels)
    return splits


def _find_idx_file(folders: list[Path], stem: str) -> Path | None:
    for folder in folders:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _cifar_splits(root: Path) -> list[str]:
    """The CIFAR-10 splits whose batches (and the metadata) are present, unchecked."""
    folder = root / _CIFAR_FOLDER
    if not (folder / "batches.meta").is_file():
        return []
    return [split for split, files in _CIFAR_SPLITS.items() if all((folder / f).is_file() for f in files)]


# ----------------------------------------------------------------------------------------------------
# Torchvision folders: reading them.
# ----------------------------------------------------------------------------------------------------


def _read_idx(path: Path, reader) -> np.ndarray:
    """
    Read an IDX file with one of torchvision's readers, decompressing ``.gz`` files into a temporary folder.

    :param path: The IDX file (uncompressed or ``.gz``).
    :param reader: ``torchvision.datasets.mnist.read_image_file`` or ``read_label_file``.
    :return: The array.
    :raises InvalidParameterError: Naming ``root``, when the file is not an IDX file of the expected kind.
    """
    try:
        if path.suffix != ".gz":
            return reader(str(path)).numpy()
        with tempfile.TemporaryDirectory(prefix="art-malleability-idx-") as tmp:
            target = Path(tmp) / path.stem
            with gzip.open(path, "rb") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            return reader(str(target)).numpy()
    except (AssertionError, ValueError, RuntimeError, OSError, EOFError) as err:
        why = f", which cannot be read as one ({type(err).__name__}); replace it with the original file"
        raise invalid("root", "hold readable IDX files", str(path), why) from err


def load_idx_source(name: str, root: Path, download: bool) -> Source:
    """MNIST or Fashion-MNIST from ``root``: torchvision's route when it accepts the folder, else split by split."""
    from torchvision.datasets import MNIST, FashionMNIST
    from torchvision.datasets.mnist import read_image_file, read_label_file

    dataset_class = MNIST if name == "mnist" else FashionMNIST
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    description = f"torchvision.datasets.{dataset_class.__name__}"
    try:
        # The torchvision route: needs both splits (or torchvision's legacy processed files).
        for split in ("train", "test"):
            ds = dataset_class(str(root), train=split == "train", download=download)
            splits[split] = (ds.data.numpy(), ds.targets.numpy())
    except (RuntimeError, AssertionError, ValueError):
        if download:
            raise
        splits = {}
    if not splits:
        found = _idx_splits(name, root)
        if not found:
            raise _no_idx_files(name, root)
        for split, (images, labels) in found.items():
            splits[split] = (_read_idx(images, read_image_file), _read_idx(labels, read_label_file))
            logger.info("Read the %s %s split from %s.", name, split, images.parent)
        description = f"{description} IDX files ({'+'.join(splits)})"
        if "train" not in splits:
            logger.info("Only the %s test split is present under %s; train and test are drawn from it.", name, root)
    pools = {
        k: ((v[0].astype(np.float32) / 255.0)[:, None, :, :], v[1].astype(np.int64)) for k, v in splits.items()
    }
    return Source(pools.get("train"), pools.get("test"), 10, tuple(dataset_class.classes), description)


def load_cifar10_source(root: Path, download: bool) -> Source:
    """CIFAR-10 from ``root``, split by split (torchvision's class checks only the requested split's files)."""
    from torchvision.datasets import CIFAR10

    class _SplitCIFAR10(CIFAR10):
        """CIFAR10 that checks only the files of the requested split (and the metadata)."""

        def _check_integrity(self) -> bool:
            from torchvision.datasets.utils import check_integrity

            files = self.train_list if self.train else self.test_list
            files = [*files, [self.meta["filename"], self.meta["md5"]]]
            return all(check_integrity(os.path.join(self.root, self.base_folder, f), md5) for f, md5 in files)

    if download:  # without a download, resolve_source has checked the folder
        CIFAR10(str(root), train=True, download=True)
        check_folder("cifar10", root)
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
        raise invalid("root", "hold intact CIFAR-10 batches", str(root / _CIFAR_FOLDER),
                      ", whose batches fail torchvision's checksum (damaged or partial files); download them again")
    if "train" not in splits:
        logger.info("Only the CIFAR-10 test split is present under %s; train and test are drawn from it.", root)
    return Source(
        splits.get("train"), splits.get("test"), 10, class_names, f"torchvision.datasets.CIFAR10 ({'+'.join(splits)})"
    )


# ----------------------------------------------------------------------------------------------------
# .npz files.
# ----------------------------------------------------------------------------------------------------


def check_npz(path: Path) -> None:
    """
    Check, without reading its arrays, that ``path`` is an ``.npz`` archive (a zip file).

    :raises InvalidParameterError: Naming ``name_or_path``, when it is not.
    """
    import zipfile

    if not zipfile.is_zipfile(path):
        what = "holds a single array (an .npy file)" if _is_npy(path) else "is not a readable .npz archive"
        raise invalid("name_or_path", _NPZ_ARCHIVE, str(path), f", which {what}")


def _bad_npz(must: str, got: str, path: Path, note: str = "") -> DataContentError:
    """:return: The error of an ``.npz`` file's arrays: ``name_or_path must <must>, got <got> in '<path>'<note>``."""
    return DataContentError("name_or_path", must, got, f" in {str(path)!r}{note}")


def _is_npy(path: Path) -> bool:
    with open(path, "rb") as file:
        return file.read(6) == b"\x93NUMPY"


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
    raise _bad_npz("hold an array x of shape (n, d), (n, h, w), (n, h, w, c) or (n, c, h, w) with c in (1, 3)",
                   str(x.shape), path)


def _labels_from_array(y: np.ndarray, n: int, path: Path) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim == 2 and y.shape[1] > 1 and np.all((y == 0) | (y == 1)) and np.all(y.sum(axis=1) == 1):
        y = np.argmax(y, axis=1)
    if y.ndim != 1:
        raise _bad_npz("hold an array y of class indices (n,) or one-hot labels", f"shape {y.shape}", path)
    if y.shape[0] != n:
        raise _bad_npz("hold arrays x and y of one length", f"different lengths {n} and {y.shape[0]}", path)
    integral = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and np.all(np.isfinite(y)) and np.all(np.mod(y, 1) == 0)
    )
    if not integral:
        raise _bad_npz("hold integer class labels in y", f"dtype {y.dtype} with non-integers", path)
    if y.size and y.min() < 0:
        raise _bad_npz("hold non-negative labels in y", f"minimum {y.min()}", path)
    y = y.astype(np.int64)
    present = np.unique(y)
    if len(present) < 2:
        raise _bad_npz("hold labels of at least two classes in y", f"a single class ({int(present[0])})", path,
                       ": a classifier of it learns nothing and its accuracy and flip rates would mean nothing")
    if len(present) < int(present.max()) + 1:
        empty = sorted(set(range(int(present.max()) + 1)) - set(present.tolist()))
        logger.warning("Array y in %s has no example of class(es) %s of 0..%d (labels 1..C instead of 0..C-1?).",
                       path, empty[:10], int(present.max()))
    return y


def _pixels(x: np.ndarray, path: Path) -> np.ndarray:
    """``x`` as float32 in `[0, 1]`: uint8 scaled, float and bool checked and cast."""
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    if np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        if not np.all(np.isfinite(x)):
            raise _bad_npz("hold finite values in x", f"{int((~np.isfinite(x)).sum())} NaN or infinite", path)
        if x.min() < 0.0 or x.max() > 1.0:
            raise _bad_npz("hold a float x in [0, 1]", f"range [{x.min()}, {x.max()}]", path,
                           "; rescale it or store uint8 pixels (0..255)")
        return x
    if x.dtype == np.bool_:
        return x.astype(np.float32)
    raise _bad_npz("hold x as uint8 (0..255) or float in [0, 1]", f"dtype {x.dtype}", path)


def load_npz_source(path: Path) -> Source:
    """An ``.npz`` file with arrays ``x``, ``y`` and optionally ``class_names`` (checked by ``resolve_source``)."""
    import zipfile

    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise invalid("name_or_path", _NPZ_ARCHIVE, str(path), ", which is not a readable .npz archive") from err
    with archive:
        missing = [key for key in ("x", "y") if key not in archive.files]
        if missing:
            raise _bad_npz("hold arrays 'x' and 'y'", str(archive.files), path)
        x = archive["x"]
        y = archive["y"]
        names = tuple(str(c) for c in archive["class_names"]) if "class_names" in archive.files else ()
    if x.ndim < 2 or x.shape[0] < 1:
        raise _bad_npz("hold an array x of shape (n, ...) with n >= 1", str(x.shape), path)
    y = _labels_from_array(y, x.shape[0], path)
    x = _images_to_nchw(_pixels(x, path), path)
    nb_classes = max(int(y.max()) + 1, 2)
    if len(names) != nb_classes:
        names = tuple(str(c) for c in range(nb_classes))
    return Source(None, (x, y), nb_classes, names, f"npz file {path.name}")
