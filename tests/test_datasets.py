"""Tests of the dataset loaders: digits, .npz files, torchvision folders and the real data folder."""

from __future__ import annotations

import gzip
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from art_malleability.data import DATASET_NAMES, Dataset, load_dataset


def _row_keys(x: np.ndarray) -> list[bytes]:
    rows = np.ascontiguousarray(np.asarray(x).reshape(len(x), -1), dtype=np.float32)
    return sorted(row.tobytes() for row in rows)


def _write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array in the IDX format of the MNIST files."""
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def test_dataset_names():
    assert DATASET_NAMES == ("digits", "mnist", "fashion-mnist", "cifar10")


def test_digits_defaults():
    data = load_dataset("digits")
    assert isinstance(data, Dataset)
    assert data.name == "digits"
    assert data.x_train.shape == (1000, 1, 8, 8) and data.x_test.shape == (300, 1, 8, 8)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    assert data.input_shape == (1, 8, 8) and data.nb_classes == 10 and data.clip_values == (0.0, 1.0)
    assert data.class_names == tuple(str(i) for i in range(10))
    assert set(np.unique(data.y_train)) == set(range(10)) and set(np.unique(data.y_test)) == set(range(10))
    assert data.n_train == 1000 and data.n_test == 300
    assert "load_digits" in data.source


def test_digits_split_is_stratified_and_disjoint():
    full = load_digits()
    data = load_dataset("digits", n_train=1500, n_test=None, seed=3)
    assert data.n_train == 1500 and data.n_test == len(full.target) - 1500
    # Train and test together are exactly the dataset (as a multiset of images).
    assert _row_keys(np.concatenate([data.x_train, data.x_test])) == _row_keys(full.images / 16.0)
    full_share = np.bincount(full.target, minlength=10) / len(full.target)
    for y in (data.y_train, data.y_test):
        share = np.bincount(y, minlength=10) / len(y)
        assert np.abs(share - full_share).max() < 0.01


def test_digits_determinism():
    a = load_dataset("digits", n_train=100, n_test=50, seed=1)
    b = load_dataset("digits", n_train=100, n_test=50, seed=1)
    c = load_dataset("digits", n_train=100, n_test=50, seed=2)
    assert np.array_equal(a.x_train, b.x_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.shape == (100, 1, 8, 8) and a.x_test.shape == (50, 1, 8, 8)


def test_classes_filter_relabels_in_given_order():
    full = load_digits()
    data = load_dataset("digits", classes=[8, 3], n_train=200, n_test=100)
    assert data.nb_classes == 2 and data.class_names == ("8", "3")
    assert set(np.unique(data.y_train)) == {0, 1}
    eights = set(_row_keys(full.images[full.target == 8] / 16.0))
    threes = set(_row_keys(full.images[full.target == 3] / 16.0))
    assert set(_row_keys(data.x_train[data.y_train == 0])) <= eights
    assert set(_row_keys(data.x_test[data.y_test == 1])) <= threes
    # The default sizes shrink to what the two classes hold.
    small = load_dataset("digits", classes=[3, 8])
    assert small.n_train + small.n_test <= int(np.isin(full.target, [3, 8]).sum())


def test_npz_uint8_channels_last(tmp_path, rng):
    x = rng.integers(0, 256, size=(60, 6, 5, 3), dtype=np.uint8)
    y = np.repeat(np.arange(3), 20)
    path = tmp_path / "tiny.npz"
    np.savez(path, x=x, y=y)
    x_before = x.copy()
    data = load_dataset(path, n_train=40, n_test=20)
    assert data.name == "tiny"
    assert data.input_shape == (3, 6, 5) and data.nb_classes == 3
    assert data.x_train.dtype == np.float32
    expected = x.transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    assert _row_keys(np.concatenate([data.x_train, data.x_test])) == _row_keys(expected)
    assert np.array_equal(x, x_before)
    # A relative path is looked up under root.
    assert load_dataset("tiny.npz", root=tmp_path, n_train=40, n_test=20).input_shape == (3, 6, 5)


def test_npz_float_channels_first_and_3d_and_flat(tmp_path, rng):
    y = np.tile(np.arange(2), 15)
    cases = {
        "nchw": (rng.random((30, 1, 4, 4)), (1, 4, 4)),
        "three_d": (rng.random((30, 4, 5)).astype(np.float32), (1, 4, 5)),
        "flat": (rng.random((30, 12)).astype(np.float32), (12,)),
    }
    for stem, (x, shape) in cases.items():
        np.savez(tmp_path / f"{stem}.npz", x=x, y=y)
        data = load_dataset(tmp_path / f"{stem}.npz", n_train=20, n_test=10)
        assert data.input_shape == shape
        assert data.x_train.dtype == np.float32
        flat = x.reshape(30, -1).astype(np.float32)
        assert _row_keys(np.concatenate([data.x_train, data.x_test])) == _row_keys(flat)


def test_npz_defaults_split_everything(tmp_path, rng):
    np.savez(tmp_path / "d.npz", x=rng.random((50, 8)).astype(np.float32), y=np.tile(np.arange(5), 10))
    data = load_dataset(tmp_path / "d.npz")
    assert data.n_train == 40 and data.n_test == 10
    data = load_dataset(tmp_path / "d.npz", n_test=15)
    assert data.n_train == 35 and data.n_test == 15


def test_npz_errors(tmp_path, rng):
    x = rng.random((10, 4, 4)).astype(np.float32)
    y = np.tile(np.arange(2), 5)
    bad = {
        "no_y.npz": ({"x": x}, "'y'"),
        "range.npz": ({"x": x * 3.0, "y": y}, r"\[0, 1\]"),
        "lengths.npz": ({"x": x, "y": y[:8]}, "different lengths"),
        "float_labels.npz": ({"x": x, "y": y + 0.5}, "integer"),
        "int_pixels.npz": ({"x": (x * 255).astype(np.int32), "y": y}, "uint8"),
        "five_d.npz": ({"x": x[:, None, None], "y": y}, "shape"),
    }
    for name, (arrays, message) in bad.items():
        np.savez(tmp_path / name, **arrays)
        with pytest.raises(ValueError, match=message):
            load_dataset(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_dataset(tmp_path / "missing.npz")


def test_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="digits"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="n_train"):
        load_dataset("digits", n_train=0)
    with pytest.raises(ValueError, match="n_test"):
        load_dataset("digits", n_test=-1)
    with pytest.raises(ValueError, match="n_train and n_test must .* got 1500 and 500"):
        load_dataset("digits", n_train=1500, n_test=500)
    with pytest.raises(ValueError, match="classes"):
        load_dataset("digits", classes=[3])
    with pytest.raises(ValueError, match="classes"):
        load_dataset("digits", classes=[3, 12])
    with pytest.raises(ValueError, match="root"):
        load_dataset("mnist")
    with pytest.raises(FileNotFoundError, match="root"):
        load_dataset("fashion-mnist", root=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="IDX"):
        load_dataset("mnist", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="CIFAR-10"):
        load_dataset("cifar10", root=tmp_path)


def test_torchvision_layout_with_both_splits(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    labels = np.tile(np.arange(10), 4).astype(np.uint8)
    _write_idx(raw / "train-images-idx3-ubyte", np.full((40, 28, 28), 10, dtype=np.uint8))
    _write_idx(raw / "train-labels-idx1-ubyte", labels)
    _write_idx(raw / "t10k-images-idx3-ubyte", np.full((40, 28, 28), 200, dtype=np.uint8))
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels)
    data = load_dataset("mnist", root=tmp_path, n_train=20, n_test=30)
    assert data.x_train.shape == (20, 1, 28, 28) and data.x_test.shape == (30, 1, 28, 28)
    # Training examples come from the training split, test examples from the test split.
    assert np.all(data.x_train == np.float32(10 / 255)) and np.all(data.x_test == np.float32(200 / 255))
    assert "torchvision.datasets.MNIST" in data.source
    everything = load_dataset("mnist", root=tmp_path)
    assert everything.n_train == 40 and everything.n_test == 40


def test_gz_idx_files_in_plain_folder(tmp_path, rng):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    images = rng.integers(0, 256, size=(30, 28, 28), dtype=np.uint8)
    for stem, array in (
        ("t10k-images-idx3-ubyte", images),
        ("t10k-labels-idx1-ubyte", np.tile(np.arange(3), 10)),
    ):
        _write_idx(tmp_path / stem, array)
        with open(tmp_path / stem, "rb") as src, gzip.open(folder / f"{stem}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        (tmp_path / stem).unlink()
    data = load_dataset("fashion-mnist", root=tmp_path, n_train=21, n_test=9)
    assert data.input_shape == (1, 28, 28) and data.nb_classes == 10
    assert data.class_names[0] == "T-shirt/top"
    assert _row_keys(np.concatenate([data.x_train, data.x_test])) == _row_keys(images / 255.0)
    assert "test" in data.source


def test_real_mnist_test_split(shared_data, tmp_path):
    from torchvision.datasets import MNIST

    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with gzip.open(shared_data / "mnist" / f"{stem}.gz", "rb") as src, open(raw / stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    # torchvision itself refuses a folder that lacks the training files, even for train=False.
    with pytest.raises(RuntimeError, match="Dataset not found"):
        MNIST(str(tmp_path), train=False, download=False)
    data = load_dataset("mnist", root=tmp_path, n_train=1000, n_test=200, seed=0)
    assert data.x_train.shape == (1000, 1, 28, 28) and data.x_test.shape == (200, 1, 28, 28)
    assert data.input_shape == (1, 28, 28) and data.nb_classes == 10
    assert set(np.unique(data.y_train)) == set(range(10))
    assert 0.0 <= data.x_train.min() and data.x_train.max() == 1.0
    binary = load_dataset("mnist", root=tmp_path, classes=[3, 8], n_train=300, n_test=100)
    assert binary.nb_classes == 2 and binary.class_names == ("3 - three", "8 - eight")


def test_real_cifar10_npz(shared_data):
    data = load_dataset(shared_data / "cifar10" / "cifar10_test_jpeg.npz", n_train=200, n_test=100, seed=0)
    assert data.input_shape == (3, 32, 32) and data.nb_classes == 10
    assert data.x_train.shape == (200, 3, 32, 32) and data.x_train.dtype == np.float32
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert set(np.unique(data.y_train)) == set(range(10))


def test_npz_labels_that_look_wrong_are_warnings(tmp_path, caplog):
    caplog.set_level("WARNING", logger="art_malleability")
    x = np.random.default_rng(0).random((20, 4)).astype(np.float32)
    np.savez(tmp_path / "shifted.npz", x=x, y=np.arange(20) % 10 + 1)
    np.savez(tmp_path / "single.npz", x=x, y=np.zeros(20, dtype=int))
    load_dataset(tmp_path / "shifted.npz", n_train=10, n_test=10)
    assert "no example of class(es) [0] of 0..10" in caplog.text
    with pytest.raises(ValueError, match=r"at least two classes in y, got a single class \(0\)"):  # issue 35
        load_dataset(tmp_path / "single.npz", n_train=10, n_test=10)
