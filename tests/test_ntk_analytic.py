"""Infinite-width NTK: stable angles, closed forms against Monte Carlo, and the mean of empirical NTKs."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.data import load_dataset
from art_malleability.models import MLPAttn, TwoLayerReLU
from art_malleability.ntk.analytic import analytic_ntk, relu_ntk, unit_angle
from art_malleability.ntk.empirical import empirical_ntk


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", n_train=200, n_test=20, seed=0)


def _unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d))
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _rotated(u: np.ndarray, angle: float, rng: np.random.Generator) -> np.ndarray:
    """A unit vector at exactly `angle` from the unit vector `u` (up to rounding of the result)."""
    w = rng.standard_normal(u.shape)
    w -= (w @ u) * u
    w /= np.linalg.norm(w)
    return math.cos(angle) * u + math.sin(angle) * w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


class TwoLayer(nn.Module):
    """f(z) = m^-1/2 relu(z Wᵀ) A on raw inputs z (any norms); A trainable or a fixed buffer."""

    def __init__(self, d: int, m: int, k: int, seed: int, train_output: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.hidden = nn.Parameter(torch.randn(m, d, generator=g, dtype=torch.float64))
        signs = (torch.randint(0, 2, (m, k), generator=g) * 2 - 1).to(torch.float64)
        if train_output:
            self.out = nn.Parameter(signs)
        else:
            self.register_buffer("out", signs)
        self.m = m

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.relu(z @ self.hidden.T) @ self.out / math.sqrt(self.m)


# ------------------------------------------------------------------------------------------ angles


@pytest.mark.parametrize("angle", [1e-9, 1e-12, 3e-7])
def test_unit_angle_near_zero_is_accurate_where_arccos_fails(angle):
    rng = np.random.default_rng(1)
    u = _unit(rng, 1, 50)[0]
    v = _rotated(u, angle, rng)
    theta = float(unit_angle(u, v)[0, 0])
    assert theta == pytest.approx(angle, rel=1e-6)
    naive = float(np.arccos(np.clip(u @ v, -1.0, 1.0)))
    if angle < 1e-8:
        assert abs(naive - angle) > 0.5 * angle  # arccos returns 0 or ~1e-8 of noise here


@pytest.mark.parametrize("angle", [1e-9, 1e-12])
def test_unit_angle_near_pi_is_accurate(angle):
    rng = np.random.default_rng(2)
    u = _unit(rng, 1, 30)[0]
    v = -_rotated(u, angle, rng)
    theta = unit_angle(u, v)[0, 0]
    assert float(math.pi - theta) == pytest.approx(angle, rel=1e-5, abs=1e-15)
    # the complement used inside the kernel is accurate to full relative precision
    k = relu_ntk(u, v)[0, 0]
    assert float(k) == pytest.approx(float(u @ v) * angle / (2 * math.pi), rel=1e-6)
    naive = float(np.arccos(np.clip(u @ v, -1.0, 1.0)))
    assert abs((math.pi - naive) - angle) > 0.5 * angle


def test_unit_angle_matches_arccos_away_from_the_ends_and_is_pairwise():
    rng = np.random.default_rng(3)
    u, v = _unit(rng, 7, 12), _unit(rng, 5, 12)
    theta = unit_angle(u, v)
    assert theta.shape == (7, 5) and theta.dtype == torch.float64
    np.testing.assert_allclose(theta.numpy(), np.arccos(u @ v.T), rtol=1e-12, atol=1e-13)
    sym = unit_angle(torch.from_numpy(u))
    assert torch.equal(sym, sym.T)
    assert torch.all(sym.diagonal() == 0)
    # near-duplicates inside a batch take the explicit-difference route
    w = np.vstack([u[0], _rotated(u[0], 1e-10, rng), -u[0]])
    t = unit_angle(w)
    assert float(t[0, 1]) == pytest.approx(1e-10, rel=1e-5)
    assert float(t[0, 2]) == pytest.approx(math.pi, abs=1e-15)


def test_unit_angle_validates_inputs():
    with pytest.raises(ValueError, match="unit"):
        unit_angle(np.array([[2.0, 0.0]]))
    with pytest.raises(ValueError, match="columns"):
        unit_angle(np.eye(2), np.eye(3))
    with pytest.raises(TypeError, match="numpy array"):
        unit_angle([[1.0, 0.0]])
    with pytest.raises(ValueError, match="NaN"):
        unit_angle(np.array([[np.nan, 1.0]]))


# ------------------------------------------------------------------------------------------ closed forms


def test_relu_ntk_matches_monte_carlo_integral_for_any_norms():
    rng = np.random.default_rng(4)
    d = 6
    z = rng.standard_normal((5, d)) * rng.uniform(0.3, 3.0, size=(5, 1))
    z[4] = -0.5 * z[0] + 1e-3 * z[1]  # an obtuse pair
    w = rng.standard_normal((400_000, d))
    pre = z @ w.T  # (5, N)
    active = (pre > 0).astype(np.float64)
    first = (z @ z.T) * (active @ active.T) / w.shape[0]
    second = np.maximum(pre, 0) @ np.maximum(pre, 0).T / w.shape[0]
    scale = np.outer(np.linalg.norm(z, axis=1), np.linalg.norm(z, axis=1))
    k1 = relu_ntk(z).numpy()
    k2 = relu_ntk(z, trained="both").numpy()
    np.testing.assert_allclose(k1 / scale, first / scale, atol=4e-3)
    np.testing.assert_allclose(k2 / scale, (first + second) / scale, atol=8e-3)


def test_relu_ntk_properties():
    rng = np.random.default_rng(5)
    z = _unit(rng, 9, 4)
    for trained, diag in (("first", 0.5), ("both", 1.0)):
        k = relu_ntk(z, trained=trained)
        assert k.shape == (9, 9) and k.dtype == torch.float64
        assert torch.equal(k, k.T)
        np.testing.assert_allclose(k.diagonal().numpy(), diag, rtol=1e-14)
        assert float(torch.linalg.eigvalsh(k).min()) > -1e-12
        np.testing.assert_allclose(relu_ntk(z, z, trained=trained).numpy(), k.numpy(), rtol=1e-12, atol=1e-15)
    # any norms: the diagonal of the first-layer kernel is |z|^2 / 2; zero rows give zero rows
    z2 = np.vstack([z * 3.0, np.zeros((1, 4))])
    k = relu_ntk(torch.from_numpy(z2))
    np.testing.assert_allclose(k.diagonal()[:9].numpy(), 4.5, rtol=1e-14)
    assert torch.all(k[9] == 0) and torch.all(k[:, 9] == 0)
    assert torch.all(torch.isfinite(relu_ntk(z2, trained="both")))
    # float32 input is read in float64; numpy and torch agree
    np.testing.assert_allclose(relu_ntk(z.astype(np.float32)).numpy(), relu_ntk(z).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="trained"):
        relu_ntk(z, trained="second")
    with pytest.raises(ValueError, match="columns"):
        relu_ntk(z, z[:, :3])


def test_relu_ntk_does_not_modify_inputs():
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    before = z.clone()
    relu_ntk(z, trained="both")
    assert torch.equal(z, before)


# ------------------------------------------------------------------------------------------ reference models


def test_analytic_ntk_diagonal_symmetry_and_no_mutation(digits):
    model = MLPAttn(digits.input_shape, width=32, nb_classes=10, seed=0)
    model.set_context(digits.x_train)
    model.train()
    state = copy.deepcopy(model.state_dict())
    x = digits.x_test[:12].copy()
    k = analytic_ntk(model, x)
    assert k.shape == (12, 12) and k.dtype == torch.float64
    assert torch.equal(k, k.T)
    np.testing.assert_allclose(k.diagonal().numpy(), 10 / 2, rtol=1e-12)  # nb_classes * |z|^2 / 2
    assert float(torch.linalg.eigvalsh(k).min()) > -1e-10
    cross = analytic_ntk(model, x[:5], x[5:])
    np.testing.assert_allclose(cross.numpy(), k[:5, 5:].numpy(), rtol=1e-12, atol=1e-14)
    assert model.training and model.hidden.weight.dtype == torch.float32
    assert all(torch.equal(v, state[name]) for name, v in model.state_dict().items())
    np.testing.assert_array_equal(x, digits.x_test[:12])


def test_analytic_ntk_errors(digits):
    with pytest.raises(TypeError, match="features"):
        analytic_ntk(nn.Linear(64, 10), digits.x_test[:3])
    with pytest.raises(TypeError, match="nn.Module"):
        analytic_ntk("model", digits.x_test[:3])
    model = MLPAttn(digits.input_shape, width=8, nb_classes=10)
    with pytest.raises(RuntimeError, match="context"):
        analytic_ntk(model, digits.x_test[:3])
    with pytest.raises(ValueError, match="trained"):
        analytic_ntk(TwoLayerReLU(digits.input_shape, 8, 10), digits.x_test[:3], trained="all")


def _models(cls, digits, width, seeds):
    for seed in seeds:
        model = cls(digits.input_shape, width=width, nb_classes=digits.nb_classes, seed=seed).double()
        if cls is MLPAttn:
            model.set_context(digits.x_train)
        yield model


@pytest.mark.parametrize("cls", [TwoLayerReLU, MLPAttn])
def test_mean_of_empirical_ntks_converges_to_analytic(cls, digits):
    x = digits.x_test[:20]
    models = list(_models(cls, digits, 256, range(50)))
    target = analytic_ntk(models[0], x)
    kernels = torch.stack([empirical_ntk(m, x) for m in models])
    mean_error = _rel(kernels.mean(0), target)
    single_error = float(np.mean([_rel(k, target) for k in kernels]))
    assert mean_error < 0.02
    assert mean_error < single_error / 4  # about 1/sqrt(50) ~ 1/7 of a single init's


@pytest.mark.parametrize("cls", [TwoLayerReLU, MLPAttn])
def test_single_init_error_shrinks_like_inverse_sqrt_width(cls, digits):
    x = digits.x_test[:20]
    rms = {}
    for width in (64, 1024):
        models = list(_models(cls, digits, width, range(100, 140)))
        target = analytic_ntk(models[0], x)
        rms[width] = math.sqrt(np.mean([_rel(empirical_ntk(m, x), target) ** 2 for m in models]))
    ratio = rms[64] / rms[1024]
    assert 2.8 < ratio < 5.7, rms  # (1024 / 64)^(1/2) = 4


@pytest.mark.parametrize("trained", ["first", "both"])
def test_relu_ntk_is_the_mean_empirical_ntk_with_any_norms(trained):
    rng = np.random.default_rng(6)
    d, k, width = 5, 3, 512
    z = torch.from_numpy(rng.standard_normal((8, d)) * rng.uniform(0.5, 2.0, size=(8, 1)))
    target = k * relu_ntk(z, trained=trained)
    kernels = [
        empirical_ntk(TwoLayer(d, width, k, seed, train_output=trained == "both"), z) for seed in range(60)
    ]
    mean_error = _rel(torch.stack(kernels).mean(0), target)
    single_error = float(np.mean([_rel(kern, target) for kern in kernels]))
    assert mean_error < 0.02
    assert mean_error < single_error / 4
    if trained == "both":  # the second-layer term matters: the first-layer limit alone is far off
        assert _rel(torch.stack(kernels).mean(0), k * relu_ntk(z)) > 0.3


def test_analytic_limit_refuses_models_with_other_trained_parameters():
    from art_malleability.models import build_reference_model

    model = build_reference_model("mlp-attn-qkv", (1, 8, 8), 10, width=16)
    model.set_context(np.random.default_rng(0).random((20, 1, 8, 8)))
    with pytest.raises(ValueError, match="query.weight"):
        analytic_ntk(model, np.random.default_rng(1).random((3, 1, 8, 8)))
