"""Spectral tools: Gram spectrum, numerical rank, condition numbers, required widths, reports, real data."""

import json
import math

import numpy as np
import pytest
import torch

from art_malleability.data import load_dataset
from art_malleability.models import MLPAttn
from art_malleability.ntk.spectral import (
    SpectralReport,
    gram_spectrum,
    numerical_rank,
    required_width_log10,
    spectral_analysis,
    spectral_analysis_of_dataset,
)

EPS = np.finfo(np.float64).eps


def _unit_rows(x: np.ndarray) -> np.ndarray:
    x = x.reshape(x.shape[0], -1).astype(np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ------------------------------------------------------------------------------------------ spectrum and rank


def test_gram_spectrum_of_hand_made_matrices():
    # orthogonal rows of any lengths: G = I after normalisation
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((5, 5)))
    np.testing.assert_allclose(gram_spectrum(q.T * np.arange(1, 6)[:, None]), np.ones(5), rtol=1e-14)
    # two unit vectors at angle phi: eigenvalues 1 + cos(phi), 1 - cos(phi)
    phi = 0.3
    x = np.array([[2.0, 0.0, 0.0], [math.cos(phi), math.sin(phi), 0.0]])
    np.testing.assert_allclose(gram_spectrum(x), [1 + math.cos(phi), 1 - math.cos(phi)], rtol=1e-14)
    # d < n: X^T X route, padded with exact zeros
    x = np.array([[1.0, 0.0], [0.0, 5.0], [1.0, 1.0]])
    eig = gram_spectrum(x)
    np.testing.assert_allclose(eig, [2.0, 1.0, 0.0], atol=1e-15)
    assert eig[-1] == 0.0 and eig.dtype == np.float64
    # images are flattened, tensors accepted, descending order
    img = torch.from_numpy(np.random.default_rng(1).random((4, 1, 3, 3)))
    eig = gram_spectrum(img)
    assert eig.shape == (4,) and np.all(np.diff(eig) <= 0) and np.all(eig >= 0)


@pytest.mark.parametrize("shape", [(30, 50), (50, 30)])
def test_gram_spectrum_routes_agree(shape):
    x = np.random.default_rng(2).standard_normal(shape)
    before = x.copy()
    u = _unit_rows(x)
    eig = gram_spectrum(x)
    np.testing.assert_array_equal(x, before)
    small = np.sort(np.linalg.eigvalsh(u.T @ u))[::-1]
    full = np.sort(np.linalg.eigvalsh(u @ u.T))[::-1]
    r = min(shape)
    np.testing.assert_allclose(eig[:r], small[:r], rtol=1e-12)
    np.testing.assert_allclose(eig, np.clip(full, 0, None), rtol=1e-11, atol=1e-12)
    assert eig.shape == (shape[0],)


def test_numerical_rank_rule():
    eig = np.array([10.0, 1.0, 1e-10, 1e-14, 0.0])
    rank, tol = numerical_rank(eig)
    assert tol == pytest.approx(5 * EPS * 10.0)
    assert rank == 3
    rank, tol = numerical_rank(eig, n_features=100_000)  # tol = max(n, d) eps lambda_max
    assert tol == pytest.approx(1e5 * EPS * 10.0) and rank == 2
    assert numerical_rank(eig, rtol=1e-9) == (2, pytest.approx(1e-8))
    assert numerical_rank(eig, rtol=0.0) == (4, 0.0)
    with pytest.raises(ValueError, match="empty"):
        numerical_rank(np.array([]))
    with pytest.raises(ValueError, match="rtol"):
        numerical_rank(eig, rtol=-1.0)
    with pytest.raises(ValueError, match="n_features"):
        numerical_rank(eig, n_features=0)


# ------------------------------------------------------------------------------------------ analysis


def test_well_conditioned_subset_direct_g3_check():
    x = np.random.default_rng(3).standard_normal((40, 200))
    report = spectral_analysis(x, name="gaussian")
    u = _unit_rows(x)
    g = u @ u.T
    direct = np.linalg.eigvalsh(g @ g @ g)
    kappa = report.kappa
    assert report.rank == 40 and not report.rank_deficient and report.kappa_d_rule == "min(n, d)"
    assert 1.5 < kappa < 50
    assert report.kappa_d == report.kappa == report.kappa_d_min_nd == report.kappa_d_rank
    assert direct[-1] / direct[0] == pytest.approx(kappa**3, rel=1e-6)
    assert report.g3_check == "passed"
    assert report.g3_check_kappa_direct == pytest.approx(kappa**3, rel=1e-6)
    assert report.g3_check_rel_error < 1e-6
    assert report.kappa_g3 == pytest.approx(kappa**3, rel=1e-12)
    assert report.log10_kappa_g3 == pytest.approx(3 * math.log10(kappa), rel=1e-12)
    assert report.flags == []
    # the check is skipped beyond the threshold
    skipped = spectral_analysis(x, direct_check_max_kappa=1.0)
    assert skipped.g3_check.startswith("skipped: kappa(G)^3 beyond float64 resolution")
    assert skipped.g3_check_kappa_direct is None


def test_rank_deficient_data_is_flagged():
    rng = np.random.default_rng(4)
    x = rng.random((8, 12))
    x[:, 6:] = 0.0  # six always-zero features: rank <= 6 < min(n, d) = 8
    report = spectral_analysis(x)
    assert report.rank == 6 and report.rank_deficient
    assert math.isinf(report.kappa) and math.isinf(report.kappa_g3) and math.isinf(report.log10_kappa_g3)
    assert math.isinf(report.kappa_d_min_nd)
    assert report.kappa_d_rule == "numerical rank"
    assert report.kappa_d == report.kappa_d_rank == pytest.approx(report.eigenvalues[0] / report.eigenvalues[5])
    assert report.g3_check.startswith("skipped: G is numerically singular")
    assert any("rank-deficient" in flag for flag in report.flags)
    assert any("singular" in flag for flag in report.flags)


def test_log10_fields_survive_overflow():
    # X^T X = diag(3, 2e-120) exactly: kappa_d = 1.5e120, kappa_d^3 and kappa_d^6 overflow float64
    x = np.array([[1.0, 1e-60], [1.0, -1e-60], [1.0, 0.0]])
    report = spectral_analysis(x, rtol=0.0)
    assert report.rank == 2 and report.kappa_d_rule == "min(n, d)"
    assert report.kappa_d == pytest.approx(1.5e120, rel=1e-12)
    assert report.log10_kappa_d == pytest.approx(math.log10(1.5e120), rel=1e-12)
    assert report.log10_kappa_d_g3 == pytest.approx(3 * math.log10(1.5e120), rel=1e-12)
    assert report.log10_width_v1 == pytest.approx(6 * math.log10(1.5e120), rel=1e-12)
    assert math.isfinite(report.log10_width_v2) and report.log10_width_v2 > report.log10_width_v1
    assert not any("lower bound" in flag for flag in report.flags)
    # with the default rule the tiny eigenvalue is rounding-level and the rank drops to 1
    default = spectral_analysis(x)
    assert default.rank == 1 and default.kappa_d == 1.0


def test_required_width_formulas():
    assert required_width_log10(3.0, version="v1") == 18.0
    assert required_width_log10(3.0, 1000) == pytest.approx(18.0 + math.log10(1000 * math.log(1000)))
    # the paper's widths: v2 with kappa = 1.2e3 (MNIST, n = 60,000) and 8.7e3 (CIFAR-10, n = 50,000)
    assert required_width_log10(math.log10(1.2e3), 60_000) == pytest.approx(24.3, abs=0.05)
    assert required_width_log10(math.log10(8.7e3), 50_000) == pytest.approx(29.4, abs=0.05)
    assert math.isinf(required_width_log10(math.inf, 10))
    with pytest.raises(ValueError, match="n must be"):
        required_width_log10(3.0)
    with pytest.raises(ValueError, match="n must be"):
        required_width_log10(3.0, 1)
    with pytest.raises(ValueError, match="version"):
        required_width_log10(3.0, 10, version="v3")
    report = spectral_analysis(np.random.default_rng(5).standard_normal((20, 30)))
    assert report.log10_width_v1 == pytest.approx(6 * report.log10_kappa_d)
    assert report.log10_width_v2 == pytest.approx(6 * report.log10_kappa_d + math.log10(20 * math.log(20)))


def test_input_validation_and_no_mutation():
    x = np.random.default_rng(6).random((5, 4)).astype(np.float32)
    before = x.copy()
    state = np.random.get_state()
    spectral_analysis(x)
    np.testing.assert_array_equal(x, before)
    assert np.array_equal(np.random.get_state()[1], state[1])
    with pytest.raises(ValueError, match="at least 2"):
        spectral_analysis(x[:1])
    with pytest.raises(ValueError, match="all-zero"):
        spectral_analysis(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="NaN"):
        spectral_analysis(np.full((3, 4), np.nan))
    with pytest.raises(TypeError, match="numpy array"):
        spectral_analysis([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match="rtol"):
        spectral_analysis(x, rtol=1.0)
    with pytest.raises(ValueError, match="model"):
        spectral_analysis_of_dataset("digits", n=50, model="transformer")
    zero_row = np.vstack([x, np.zeros((1, 4))])
    assert any("all-zero" in flag for flag in spectral_analysis(zero_row).flags)


def test_save_load_roundtrip(tmp_path):
    x = np.random.default_rng(7).random((12, 5))  # d < n: infinite kappa(G) must survive JSON
    report = spectral_analysis(x, name="toy")
    out = report.save(tmp_path / "spec")
    for name in ("spectrum.json", "spectrum.md", "spectrum.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    text = (out / "spectrum.json").read_text()

    def no_constants(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    data = json.loads(text, parse_constant=no_constants)
    assert data["kappa"] == "inf" and len(data["eigenvalues"]) == 12 and len(data["top_eigenvalues"]) == 10
    loaded = SpectralReport.load(out)
    assert loaded == report
    assert SpectralReport.load(out / "spectrum.json") == report
    np.testing.assert_array_equal(loaded.eigenvalues, report.eigenvalues)
    assert math.isinf(loaded.kappa)
    assert "| numerical rank |" in (out / "spectrum.md").read_text()
    assert "kappa_d (headline)" in report.summary()
    assert not list(out.glob("*.tmp"))
    with pytest.raises(FileNotFoundError):
        SpectralReport.load(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ real data


def test_digits_spectrum():
    report = spectral_analysis_of_dataset("digits", n=1000)
    assert report.n == 1000 and report.d == 64
    assert 55 <= report.rank < 64  # a few pixels are (almost) always blank
    assert report.kappa_d_rule == "numerical rank" and math.isinf(report.kappa)
    assert 1e5 < report.kappa_d < 1e9  # the 1e7 territory of the paper's discussion
    assert report.log10_width_v2 > 24


def test_digits_attention_features_are_the_models_features():
    data = load_dataset("digits", n_train=300, seed=0)  # the subset spectral_analysis_of_dataset draws
    report = spectral_analysis_of_dataset("digits", n=300, model="mlp-attn")
    model = MLPAttn(data.input_shape, width=4, nb_classes=10, context="gram").double()  # the paper's kappa(G)^3
    model.set_context(data.x_train)
    with torch.no_grad():
        z = model.features(torch.from_numpy(data.x_train).double()).numpy()
    np.testing.assert_allclose(report.eigenvalues, gram_spectrum(z), rtol=1e-9, atol=1e-9)
    raw = spectral_analysis_of_dataset("digits", n=300)
    assert report.kappa_d_rank > raw.kappa_d_rank  # attention amplifies the conditioning
    assert "attention" in report.features


def test_mnist_spectrum(shared_data):
    full = spectral_analysis_of_dataset("mnist", root=shared_data / "mnist", n=1000)
    assert (full.n, full.d) == (1000, 784)
    assert 500 < full.rank < 700 and full.rank_deficient  # always-zero pixels
    assert full.kappa_d_rule == "numerical rank" and math.isinf(full.kappa_d_min_nd)
    assert full.kappa_d > 1e8
    assert full.log10_width_v2 > 24
    small = spectral_analysis_of_dataset("mnist", root=shared_data / "mnist", n=300)
    assert small.rank == 300 and math.isfinite(small.kappa)
    assert 1e4 < small.kappa < 1e7
    assert small.g3_check.startswith("skipped")


def test_cifar10_spectrum(shared_data):
    path = shared_data / "cifar10" / "cifar10_test_jpeg.npz"
    report = spectral_analysis_of_dataset(path, n=1000)
    assert (report.n, report.d) == (1000, 3072)
    assert report.rank == 1000 and report.kappa_d_rule == "min(n, d)"
    assert report.kappa == report.kappa_d
    assert 1e6 < report.kappa < 1e9
    assert report.log10_kappa_g3 == pytest.approx(3 * math.log10(report.kappa))
    assert report.log10_width_v2 > 29


def test_direct_check_on_a_real_well_conditioned_subset(shared_data):
    data = load_dataset(shared_data / "cifar10" / "cifar10_test_jpeg.npz", n_train=20, n_test=10, seed=1)
    report = spectral_analysis(data.x_train)
    assert report.kappa < 1e4
    assert report.g3_check == "passed"
    assert report.g3_check_kappa_direct == pytest.approx(report.kappa**3, rel=1e-6)
