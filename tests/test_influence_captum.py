"""Captum TracInCP adapter: agreement with the factorised gradient estimator."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.influence import CaptumInfluence, GradientInfluence, get_influence


class NTKNet(nn.Module):
    """f(x) = m^-1/2 relu(x Wᵀ) A with a fixed ±1 output matrix A (a frozen parameter)."""

    def __init__(self, d: int, m: int, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, m, bias=False)
        signs = torch.randint(0, 2, (m, c), generator=torch.Generator().manual_seed(1)) * 2.0 - 1.0
        self.out = nn.Parameter(signs, requires_grad=False)
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x.flatten(1))) @ self.out / self.m**0.5


class Scaled(nn.Module):
    """A trainable parameter outside any nn.Linear / nn.Conv2d layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.fc(x)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(n: int = 24, n_query: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, 4)).astype(np.float32),
        rng.integers(0, 3, n),
        rng.normal(size=(n_query, 4)).astype(np.float32),
        rng.integers(0, 3, n_query),
    )


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_agrees_with_gradient_influence(loss: str) -> None:
    model = _mlp()
    x, y, xq, yq = _data()
    reference = GradientInfluence(loss=loss, device="cpu").fit(model, x, y).scores(xq, yq)
    captum = CaptumInfluence(loss=loss, device="cpu", batch_size=10).fit(model, x, y)
    scores = captum.scores(xq, yq)
    assert scores.shape == (4, 24) and scores.dtype == np.float64
    assert _rel(scores, reference) < 1e-6
    for proponents in (True, False):
        indices, top = captum.influence(xq, yq, k=5, proponents=proponents)
        order = np.argsort(-reference if proponents else reference, axis=1, kind="stable")[:, :5]
        assert np.array_equal(indices, order)
        assert np.allclose(top, np.take_along_axis(reference, order, axis=1), rtol=1e-6, atol=0)


def test_frozen_output_net_and_checkpoints() -> None:
    torch.manual_seed(0)
    model = NTKNet(4, 16, 3)
    x, y, xq, yq = _data()
    early = copy.deepcopy(model)
    with torch.no_grad():
        early.fc.weight.mul_(0.5)
    checkpoints, lrs = [early.state_dict(), model.state_dict()], [0.2, 0.7]
    for kwargs in ({}, {"checkpoints": checkpoints, "learning_rates": lrs}):
        reference = GradientInfluence(device="cpu", **kwargs).fit(model, x, y).scores(xq, yq)
        scores = CaptumInfluence(device="cpu", **kwargs).fit(model, x, y).scores(xq, yq)
        assert _rel(scores, reference) < 1e-6
    # the original model still has its frozen parameter as a parameter
    assert "out" in dict(model.named_parameters()) and not model.out.requires_grad


def test_sample_wise_grads_per_batch() -> None:
    model = _mlp()
    x, y, xq, yq = _data()
    reference = GradientInfluence(device="cpu").fit(model, x, y).scores(xq, yq)
    scores = CaptumInfluence(device="cpu", sample_wise_grads_per_batch=True).fit(model, x, y).scores(xq, yq)
    assert _rel(scores, reference) < 1e-6
    with pytest.raises(ValueError, match="sample_wise_grads_per_batch"):
        CaptumInfluence(device="cpu", sample_wise_grads_per_batch=True).fit(Scaled(), x, y)
    with pytest.raises(ValueError, match="sample_wise_grads_per_batch"):
        CaptumInfluence(sample_wise_grads_per_batch="yes")


def test_leaves_model_rng_and_files_alone(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = NTKNet(4, 8, 3).train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    x, y, xq, yq = _data(n=10, n_query=2)
    copies = [a.copy() for a in (x, y, xq, yq)]
    rng_state = torch.get_rng_state()
    est = CaptumInfluence(device="cpu").fit(model, x, y)
    est.scores(xq, yq)
    est.influence(xq, yq, k=3)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(np.array_equal(a, b) for a, b in zip((x, y, xq, yq), copies, strict=True))
    assert torch.equal(rng_state, torch.get_rng_state())
    assert list(tmp_path.iterdir()) == []


def test_bad_parameters() -> None:
    model = _mlp()
    sd = model.state_dict()
    with pytest.raises(ValueError, match="learning_rates"):
        CaptumInfluence(checkpoints=[sd], learning_rates=[0.1, 0.2])
    with pytest.raises(ValueError, match="loss"):
        CaptumInfluence(loss="nll")
    x, y, xq, yq = _data()
    with pytest.raises(ValueError, match="y_train"):
        CaptumInfluence().fit(model, x[:5], y)
    with pytest.raises(RuntimeError, match="fit"):
        CaptumInfluence().scores(xq, yq)
    est = CaptumInfluence(device="cpu").fit(model, x, y)
    with pytest.raises(ValueError, match="k must"):
        est.influence(xq, yq, k=0)
    assert isinstance(get_influence("captum"), CaptumInfluence)


# ------------------------------------------------------------------- Captum's influence API on every estimator


def _captum_tracin(model, x, y):
    """Captum's TracInCP used by hand on a float64 copy (the reference of the Captum-style API)."""
    from captum.influence import TracInCP
    from torch.utils.data import DataLoader, TensorDataset

    from art_malleability.influence.captum_tracin import CaptumLoss

    net = copy.deepcopy(model).double()
    data = DataLoader(TensorDataset(torch.tensor(x, dtype=torch.float64), torch.tensor(y)), batch_size=8)
    tracin = TracInCP(net, data, checkpoints=[0], checkpoints_load_func=lambda m, i: 1.0,
                      loss_fn=CaptumLoss("cross_entropy"))
    return tracin


@pytest.mark.parametrize("estimator", [GradientInfluence, CaptumInfluence])
def test_influence_k_and_self_influence_equal_captum_used_by_hand(estimator) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model = _mlp()
    x, y, xq, yq = _data()
    est = estimator(device="cpu").fit(model, x, y)
    tracin = _captum_tracin(model, x, y)
    queries = DataLoader(TensorDataset(torch.tensor(xq, dtype=torch.float64), torch.tensor(yq)), batch_size=8)
    np.testing.assert_allclose(est.influence(xq, yq), tracin.influence(queries).numpy(), rtol=1e-7, atol=1e-12)
    for proponents in (True, False):
        result = est.influence(xq, yq, k=5, proponents=proponents)
        indices, scores = tracin.influence(queries, k=5, proponents=proponents)
        assert result.indices.shape == (4, 5) and np.array_equal(result.indices, indices.numpy())
        np.testing.assert_allclose(result.influence_scores, scores.numpy(), rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(est.self_influence(), tracin.self_influence().numpy(), rtol=1e-7)
    np.testing.assert_allclose(est.self_influence(xq, yq), tracin.self_influence(queries).numpy(), rtol=1e-7)


def test_ntk_influence_k_and_self_influence_against_its_scores() -> None:
    from art_malleability.influence import NTKInfluence, k_most_influential

    model = _mlp()
    x, y, xq, yq = _data()
    est = NTKInfluence(device="cpu").fit(model, x, y)
    full = est.scores(xq, yq)
    for proponents in (True, False):
        result = est.influence(xq, yq, k=3, proponents=proponents)
        order = np.argsort(-full if proponents else full, axis=1, kind="stable")[:, :3]
        assert np.array_equal(result.indices, order)
        assert np.array_equal(result.influence_scores, np.take_along_axis(full, order, axis=1))
    # self-influence: removing a training example raises its own loss (leave-one-out), one score per example
    diagonal = np.array([est.scores(x[i : i + 1], y[i : i + 1])[0, i] for i in range(len(x))])
    np.testing.assert_allclose(est.self_influence(), diagonal, rtol=1e-10)
    assert np.all(est.self_influence() > 0)
    with pytest.raises(ValueError, match="x must be None for NTKInfluence.self_influence"):
        est.self_influence(xq, yq)
    nan_first = k_most_influential(np.array([[np.nan, 1.0, -2.0]]), 2)
    assert nan_first.indices.tolist() == [[1, 2]]


class Twice(nn.Module):
    """One linear layer called twice: Captum's sample-wise gradients would be wrong for it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


@pytest.mark.parametrize(("make", "sample_wise"), [(_mlp, True), (Scaled, False), (Twice, False)])
def test_auto_uses_sample_wise_gradients_only_where_they_are_exact(make, sample_wise) -> None:
    torch.manual_seed(0)
    model = make()
    x, y, xq, yq = _data()
    est = CaptumInfluence(device="cpu").fit(model, x, y)
    assert est.sample_wise_ is sample_wise
    reference = GradientInfluence(device="cpu", method="jacobian").fit(model, x, y).scores(xq, yq)
    assert _rel(est.scores(xq, yq), reference) < 1e-6
    if not sample_wise:
        with pytest.raises(ValueError, match="sample_wise_grads_per_batch must be False or 'auto' for this model"):
            CaptumInfluence(device="cpu", sample_wise_grads_per_batch=True).fit(model, x, y)
