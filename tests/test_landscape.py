"""Tests of the loss-landscape measures: top Hessian eigenvalues and filter-normalised loss profiles."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from art_malleability.models import (
    HessianSpectrum,
    LossProfile,
    MLPAttn,
    TwoLayerReLU,
    hessian_top_eigenvalues,
    landscape,
    loss_profile,
)
from art_malleability.models.landscape import _filter_normalised_direction, _hvp_function

N, K = 12, 3
LOSSES = ("cross_entropy", "mse")


@pytest.fixture(autouse=True)
def _one_thread(_torch_threads):
    """The models are tiny: one thread avoids OpenMP's synchronisation cost (tens of ms per call on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(N, *shape)).astype(np.float32), rng.integers(0, K, size=N)


def _conv_model() -> nn.Module:
    """Several parameter tensors: a conv weight and bias, a linear weight, and a frozen linear bias."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8, K))
    model[3].bias.requires_grad_(False)
    return model


def _case(name: str) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    if name == "relu":
        return TwoLayerReLU(6, width=5, nb_classes=K, seed=0), *_data((6,))
    if name == "conv":
        return _conv_model(), *_data((1, 4, 4))
    model = MLPAttn(6, width=5, nb_classes=K, seed=0)
    x, y = _data((6,))
    model.set_context(x)
    return model, x, y


def _dense(model: nn.Module, x: np.ndarray, y: np.ndarray, loss: str):
    """:return: The dense float64 Hessian of the mean loss over the flat trainable parameters, the loss, the point."""
    work = copy.deepcopy(model).double().eval()
    named = [(n, p.detach()) for n, p in work.named_parameters() if p.requires_grad]
    x_t, y_t = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y)
    targets = y_t if loss == "cross_entropy" else F.one_hot(y_t, K).double()

    def f(flat: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for n, p in named:
            params[n] = flat[start : start + p.numel()].reshape(p.shape)
            start += p.numel()
        out = functional_call(work, params, (x_t,))
        return F.cross_entropy(out, targets) if loss == "cross_entropy" else F.mse_loss(out, targets)

    flat = torch.cat([p.reshape(-1) for _, p in named])
    return torch.func.hessian(f)(flat).numpy(), f, flat


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("name", ["relu", "conv"])
def test_top_eigenvalues_match_the_dense_hessian(name, loss):
    model, x, y = _case(name)
    hessian, f, flat = _dense(model, x, y, loss)
    expected = np.linalg.eigvalsh(hessian)[::-1]
    for k in (1, 3):
        spectrum = hessian_top_eigenvalues(model, x, y, loss=loss, k=k, batch_size=5, verbose=False)
        assert isinstance(spectrum, HessianSpectrum)
        np.testing.assert_allclose(spectrum.eigenvalues, expected[:k], rtol=1e-6, atol=1e-9 * abs(expected[0]))
    assert spectrum.n_parameters == hessian.shape[0] and spectrum.n_examples == N and spectrum.loss == loss
    assert spectrum.loss_value == pytest.approx(float(f(flat)), rel=1e-12)
    assert spectrum.n_hvp > 0
    json.dumps(spectrum.to_dict())


def test_hessian_vector_product_matches_the_dense_hessian():
    model, x, y = _case("conv")
    hessian, _, flat = _dense(model, x, y, "cross_entropy")
    work = copy.deepcopy(model).double().eval()
    params = {n: p.detach() for n, p in work.named_parameters() if p.requires_grad}
    hvp = _hvp_function(work, params, torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y), "cross_entropy", 5)
    v = torch.as_tensor(np.random.default_rng(1).normal(size=flat.numel()))
    np.testing.assert_allclose(hvp(v).numpy(), hessian @ v.numpy(), rtol=1e-10, atol=1e-13)


def test_transductive_mlp_attn():
    model, x, y = _case("attn")
    expected = np.linalg.eigvalsh(_dense(model, x, y, "mse")[0])[::-1]
    spectrum = hessian_top_eigenvalues(model, x, y, loss="mse", k=2, verbose=False)
    np.testing.assert_allclose(spectrum.eigenvalues, expected[:2], rtol=1e-6)
    profile = loss_profile(model, x, y, alphas=[-0.1, 0.0, 0.1], n_directions=2, verbose=False)
    assert np.all(np.isfinite(profile.losses))


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": [
            (n, p.detach().clone().view(torch.uint8), p.dtype, p.requires_grad) for n, p in model.named_parameters()
        ],
        "modes": [m.training for m in model.modules()],
        "rng": (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()),
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert len(after["params"]) == len(before["params"]) and after["modes"] == before["modes"]
    for (n, bits, dtype, flag), (n2, bits2, dtype2, flag2) in zip(before["params"], after["params"], strict=True):
        assert (n, dtype, flag) == (n2, dtype2, flag2) and torch.equal(bits, bits2)
    assert before["rng"][0] == after["rng"][0] and np.array_equal(before["rng"][1], after["rng"][1])
    assert torch.equal(before["rng"][2], after["rng"][2])


@pytest.mark.parametrize("as_tensor", [False, True])
def test_nothing_passed_is_changed(as_tensor):
    model, x, y = _case("conv")
    model.train()
    x_in, y_in = (torch.from_numpy(x), torch.from_numpy(y)) if as_tensor else (x, y)
    x_copy, y_copy = x.copy(), y.copy()
    before = _snapshot(model)
    hessian_top_eigenvalues(model, x_in, y_in, k=2, verbose=False)
    loss_profile(model, x_in, y_in, alphas=[-0.5, 0.0, 0.5], n_directions=2, verbose=False)
    _assert_unchanged(model, before)
    assert model.training and next(model.parameters()).dtype == torch.float32
    np.testing.assert_array_equal(x, x_copy)
    np.testing.assert_array_equal(y, y_copy)


def test_nothing_is_changed_by_a_failing_call():
    model, x, y = _case("relu")
    attn = MLPAttn(6, width=5, nb_classes=K, seed=0)  # no context: its forward pass fails on the copy
    for module, labels in ((attn, y), (model, y + K)):  # labels beyond the outputs: found on the copy
        module.train()
        before = _snapshot(module)
        with pytest.raises((RuntimeError, ValueError)):
            hessian_top_eigenvalues(module, x, labels, verbose=False)
        with pytest.raises((RuntimeError, ValueError)):
            loss_profile(module, x, labels, verbose=False)
        _assert_unchanged(module, before)
        assert module.training


def test_directions_are_filter_normalised():
    model = _conv_model()
    params = [p.detach() for p in model.parameters()]
    direction = _filter_normalised_direction(params, torch.Generator().manual_seed(0))
    for p, d in zip(params, direction, strict=True):
        assert d.shape == p.shape and d.dtype == p.dtype
        if p.ndim <= 1:
            assert torch.count_nonzero(d) == 0
        else:
            norms = d.reshape(p.shape[0], -1).norm(dim=1)
            torch.testing.assert_close(norms, p.reshape(p.shape[0], -1).norm(dim=1), rtol=1e-6, atol=0)
            assert not torch.allclose(d, p)


def test_profile_at_zero_is_the_loss_and_the_seed_decides_the_directions():
    model, x, y = _case("conv")
    kwargs = {"alphas": [-0.5, 0.0, 0.5], "n_directions": 3, "batch_size": 5, "verbose": False}
    profile = loss_profile(model, x, y, **kwargs)
    assert isinstance(profile, LossProfile) and profile.losses.shape == (3, 3)
    with torch.no_grad():
        direct = float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))
    assert profile.loss_at_minimum == pytest.approx(direct, rel=1e-6)
    np.testing.assert_array_equal(profile.losses[:, 1], profile.loss_at_minimum)
    np.testing.assert_array_equal(loss_profile(model, x, y, seed=0, **kwargs).losses, profile.losses)
    assert not np.allclose(loss_profile(model, x, y, seed=1, **kwargs).losses, profile.losses)
    json.dumps(profile.to_dict())


def _directional_curvatures(model: nn.Module, x, y, loss: str, n_directions: int, seed: int) -> np.ndarray:
    """:return: d^T H d for the profile's directions, from the dense Hessian."""
    hessian = _dense(model, x, y, loss)[0]
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_directions):
        d = torch.cat([t.reshape(-1) for t in _filter_normalised_direction(params, generator)]).double().numpy()
        out.append(d @ hessian @ d)
    return np.array(out)


def test_curvature_and_rise_of_an_exactly_quadratic_loss():
    model = nn.utils.skip_init(nn.Linear, 6, K, bias=False)  # MSE of a linear map: quadratic in the weights
    with torch.no_grad():
        model.weight.copy_(torch.randn((K, 6), generator=torch.Generator().manual_seed(0)))
    x, y = _data((6,))
    profile = loss_profile(model, x, y, loss="mse", alphas=np.linspace(-1, 1, 9), fit_radius=1.0, seed=3, verbose=False)
    dhd = _directional_curvatures(model, x, y, "mse", 5, seed=3)
    np.testing.assert_allclose(2 * profile.curvature, dhd, rtol=1e-4)
    assert profile.rise(0.5) == pytest.approx(np.mean(dhd) * 0.5**2 / 2, rel=1e-4)
    assert profile.rise(-0.5) == profile.rise(0.5)


def test_curvature_is_the_directional_second_derivative_at_small_radius():
    model, x, y = _case("conv")
    model = model.double()
    profile = loss_profile(
        model, x, y, alphas=np.linspace(-0.01, 0.01, 11), n_directions=3, fit_radius=0.01, verbose=False
    )
    assert profile.losses.dtype == np.float64
    np.testing.assert_allclose(
        2 * profile.curvature, _directional_curvatures(model, x, y, "cross_entropy", 3, 0), rtol=1e-3
    )


def test_plot():
    model, x, y = _case("relu")
    profile = loss_profile(model, x, y, alphas=[-0.2, -0.1, 0.0, 0.1, 0.2], n_directions=2, verbose=False)
    figure = profile.plot()
    ax = figure.axes[0]
    assert len(ax.lines) == 3 and ax.get_xlabel() == "α (filter-normalised)" and ax.get_ylabel() == "training loss"
    assert np.isnan(loss_profile(model, x, y, alphas=[0.0, 1.0], n_directions=1, verbose=False).curvature).all()


def _frozen() -> nn.Module:
    model = _conv_model()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize(
    ("function", "kwargs", "name"),
    [
        ("both", {"y": np.zeros(N - 1, dtype=int)}, "y"),
        ("both", {"loss": "hinge"}, "loss"),
        ("both", {"x": np.full((N, 1, 4, 4), np.nan, dtype=np.float32)}, "x"),
        ("both", {"x": [[0.0]]}, "x"),
        ("both", {"model": _frozen()}, "model"),
        ("both", {"batch_size": 0}, "batch_size"),
        ("both", {"seed": -1}, "seed"),
        ("hessian", {"k": 0}, "k"),
        ("hessian", {"k": 44}, "k"),
        ("hessian", {"tol": -1.0}, "tol"),
        ("hessian", {"max_iter": 0}, "max_iter"),
        ("hessian", {"dtype": torch.int64}, "dtype"),
        ("profile", {"alphas": []}, "alphas"),
        ("profile", {"alphas": [[0.0]]}, "alphas"),
        ("profile", {"alphas": [0.0, np.inf]}, "alphas"),
        ("profile", {"n_directions": 0}, "n_directions"),
        ("profile", {"fit_radius": 0.0}, "fit_radius"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(function, kwargs, name, monkeypatch):
    def no_work(*args, **kw):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(landscape, "working_copy", no_work)
    model, x, y = _case("conv")  # 44 trainable parameters
    call = {"model": model, "x": x, "y": y, "verbose": False, **kwargs}
    functions = {"hessian": [hessian_top_eigenvalues], "profile": [loss_profile]}
    for f in functions.get(function, [hessian_top_eigenvalues, loss_profile]):
        with pytest.raises((TypeError, ValueError), match=rf"^{name} must"):
            f(**call)


def test_rise_needs_both_signs_in_the_grid():
    model, x, y = _case("relu")
    profile = loss_profile(model, x, y, alphas=[0.0, 0.1, 0.2, -0.1], n_directions=1, verbose=False)
    with pytest.raises(ValueError, match="^at must"):
        profile.rise(0.2)
    assert profile.rise(0.0) == 0.0


def test_the_seed_goes_through_the_shared_seed_rule():
    """The seed's words are the package's seed rule's (before: "seed must be an int >= 0")."""
    from art_malleability._utils.params import InvalidParameterError, InvalidParameterTypeError

    model, x, y = _case("conv")
    with pytest.raises(InvalidParameterError) as refused:
        loss_profile(model, x, y, seed=-1, verbose=False)
    assert refused.value.param == "seed"
    assert str(refused.value) == "seed must be a non-negative integer (numpy's seeds are), got -1"
    with pytest.raises(InvalidParameterTypeError):  # a ValueError as before, and a TypeError
        hessian_top_eigenvalues(model, x, y, seed="0", verbose=False)
