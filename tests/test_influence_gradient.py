"""Gradient (TracIn-CP) influence against brute-force per-example gradients."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from art_malleability.influence import GradientInfluence, get_influence


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


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)), (4,)
    if name == "ntk_frozen_out":
        return NTKNet(4, 16, 3), (4,)
    return SmallCNN(), (1, 5, 5)


def _data(shape: tuple[int, ...], n: int = 13, n_query: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(n, *shape)).astype(np.float32),
        rng.integers(0, 3, n),
        rng.normal(size=(n_query, *shape)).astype(np.float32),
        rng.integers(0, 3, n_query),
    )


def _brute_grads(model: nn.Module, x: np.ndarray, y: np.ndarray, loss: str) -> torch.Tensor:
    """Per-example loss gradients by a loop over examples (torch's own losses): (n, P)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for xi, yi in zip(x, y, strict=True):
        out = model(torch.tensor(xi[None], dtype=torch.float64))
        target = torch.tensor([yi])
        if loss == "cross_entropy":
            value = F.cross_entropy(out, target)
        else:
            value = 0.5 * F.mse_loss(out, F.one_hot(target, out.shape[1]).double(), reduction="sum")
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params)]))
    return torch.stack(rows)


def _brute_scores(model, x, y, xq, yq, loss, checkpoints=None, lrs=None) -> np.ndarray:
    ref = copy.deepcopy(model).double()
    total = 0.0
    for sd, lr in zip(checkpoints or [None], lrs or [1.0], strict=True):
        if sd is not None:
            ref.load_state_dict(sd)
        total = total + lr * (_brute_grads(ref, xq, yq, loss) @ _brute_grads(ref, x, y, loss).T).numpy()
    return total


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", ["mlp", "ntk_frozen_out", "cnn"])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_matches_brute_force(name: str, loss: str) -> None:
    model, shape = _model(name)
    x, y, xq, yq = _data(shape)
    expected = _brute_scores(model, x, y, xq, yq, loss)
    for method in ("auto", "jacobian"):
        est = GradientInfluence(loss=loss, device="cpu", batch_size=4, method=method)
        scores = est.fit(model, x, y).scores(xq, yq)
        assert scores.shape == (5, 13) and scores.dtype == np.float64
        assert _rel(scores, expected) < 1e-10


def test_checkpoints_and_learning_rates() -> None:
    model, shape = _model("mlp")
    x, y, xq, yq = _data(shape)
    early = copy.deepcopy(model)
    with torch.no_grad():
        for p in early.parameters():
            p.mul_(0.5).add_(0.1)
    checkpoints = [early.state_dict(), model.state_dict()]
    lrs = [0.3, 0.05]
    expected = _brute_scores(model, x, y, xq, yq, "cross_entropy", checkpoints, lrs)
    est = GradientInfluence(checkpoints=checkpoints, learning_rates=lrs, device="cpu", batch_size=5)
    scores = est.fit(model, x, y).scores(xq, yq)
    assert _rel(scores, expected) < 1e-10
    # the working copy is back at the final weights afterwards, and a second call agrees
    assert np.array_equal(est.scores(xq, yq), scores)
    single = GradientInfluence(device="cpu").fit(model, x, y).scores(xq, yq)
    only_early = GradientInfluence(checkpoints=checkpoints[:1], device="cpu").fit(model, x, y).scores(xq, yq)
    assert _rel(scores, 0.3 * only_early + 0.05 * single) < 1e-12


def test_sign_convention() -> None:
    """Training on a copy of the query (same label) lowers the query's loss: positive; a copy
    with another label: negative."""
    model, shape = _model("mlp")
    x, y, _, _ = _data(shape)
    xq, yq = x[2:3], y[2:3]
    x2, y2 = np.concatenate([x, xq]), np.concatenate([y, (yq + 1) % 3])
    scores = GradientInfluence(device="cpu").fit(model, x2, y2).scores(xq, yq)[0]
    assert scores[2] > 0 and scores[-1] < 0


def test_does_not_mutate_model_or_inputs() -> None:
    model, shape = _model("ntk_frozen_out")
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    x, y, xq, yq = _data(shape)
    copies = [a.copy() for a in (x, y, xq, yq)]
    rng_state = torch.get_rng_state()
    checkpoints = [model.state_dict(), model.state_dict()]
    for est in (GradientInfluence(device="cpu"), GradientInfluence(checkpoints=checkpoints, device="cpu")):
        est.fit(model, x, y).scores(xq, yq)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(np.array_equal(a, b) for a, b in zip((x, y, xq, yq), copies, strict=True))
    assert torch.equal(rng_state, torch.get_rng_state())


def test_bad_parameters() -> None:
    model, shape = _model("mlp")
    sd = model.state_dict()
    with pytest.raises(ValueError, match="learning_rates"):
        GradientInfluence(checkpoints=[sd, sd], learning_rates=[0.1])
    with pytest.raises(ValueError, match="learning_rates"):
        GradientInfluence(learning_rates=[0.1, 0.2])
    with pytest.raises(ValueError, match="learning_rates"):
        GradientInfluence(checkpoints=[sd], learning_rates=[float("inf")])
    with pytest.raises(ValueError, match="checkpoints"):
        GradientInfluence(checkpoints=[])
    with pytest.raises(ValueError, match="checkpoints"):
        GradientInfluence(checkpoints=sd)
    with pytest.raises(ValueError, match="loss"):
        GradientInfluence(loss="l1")
    with pytest.raises(ValueError, match="method"):
        GradientInfluence(method="svd")
    x, y, xq, yq = _data(shape)
    with pytest.raises(ValueError, match="y_train"):
        GradientInfluence().fit(model, x, y[:3])
    other = nn.Linear(4, 3).state_dict()
    with pytest.raises(ValueError, match=r"checkpoints\[0\]"):
        GradientInfluence(checkpoints=[other]).fit(model, x, y)
    with pytest.raises(RuntimeError, match="fit"):
        GradientInfluence().scores(xq, yq)
    with pytest.raises(ValueError, match="y_query"):
        GradientInfluence(device="cpu").fit(model, x, y).scores(xq, yq[:2])
    assert isinstance(get_influence("gradient", loss="mse"), GradientInfluence)
    assert "[2 state dict(s)]" in repr(GradientInfluence(checkpoints=[sd, sd]))


# ---------------------------------------------------------------------- a loss_fn callable (Captum's loss_fn)


def _loop_tracin(model, loss_fn, x, y, xq, yq):
    """Brute force: one autograd gradient per example, dot products."""
    params = [p for p in model.parameters() if p.requires_grad]

    def grad(xi, yi):
        out = model(torch.as_tensor(xi[None], dtype=torch.float64))
        g = torch.autograd.grad(loss_fn(out, torch.as_tensor([yi])).sum(), params)
        return torch.cat([t.flatten() for t in g])

    gq = torch.stack([grad(a, b) for a, b in zip(xq, yq, strict=True)])
    gt = torch.stack([grad(a, b) for a, b in zip(x, y, strict=True)])
    return (gq @ gt.T).numpy()


def test_a_loss_fn_callable_is_the_loss_differentiated():
    import torch.nn.functional as F

    from art_malleability.influence import GradientInfluence, NTKInfluence

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 4)).astype(np.float32), rng.integers(0, 3, 20)
    xq, yq = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, 5)
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    scores = GradientInfluence(loss=smoothed, device="cpu").fit(model, x, y).scores(xq, yq)
    np.testing.assert_allclose(scores, _loop_tracin(model, smoothed, x, y, xq, yq), rtol=1e-9, atol=1e-12)
    plain = GradientInfluence(loss=lambda f, t: F.cross_entropy(f, t, reduction="none"), device="cpu")
    named = GradientInfluence(loss="cross_entropy", device="cpu")
    np.testing.assert_allclose(plain.fit(model, x, y).scores(xq, yq), named.fit(model, x, y).scores(xq, yq),
                               rtol=1e-10)
    half_sq = lambda f, t: 0.5 * (f - F.one_hot(t, f.shape[-1]).to(f.dtype)).pow(2)  # noqa: E731 - summed per row
    np.testing.assert_allclose(NTKInfluence(loss=half_sq, device="cpu").fit(model, x, y).scores(xq, yq),
                               NTKInfluence(loss="mse", device="cpu").fit(model, x, y).scores(xq, yq), rtol=1e-10)
    with pytest.raises(ValueError, match="one loss per example"):
        GradientInfluence(loss=lambda f, t: f.sum(), device="cpu").fit(model, x, y).scores(xq, yq)


def test_the_audit_differentiates_the_classifiers_own_loss(caplog):
    caplog.set_level("WARNING", logger="art_malleability")
    from art.estimators.classification import PyTorchClassifier

    from art_malleability import MalleabilityEstimator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    smoothed = torch.nn.CrossEntropyLoss(label_smoothing=0.2)
    clf = PyTorchClassifier(model, smoothed, (1, 4, 4), 3, clip_values=(0.0, 1.0))
    rng = np.random.default_rng(0)
    x, y = rng.random((30, 1, 4, 4)).astype(np.float32), np.arange(30) % 3
    audit = MalleabilityEstimator(clf, influence="gradient", attacks=["fgsm"], n_queries=6, n_bootstrap=10,
                                  verbose=False, device="cpu")
    report = audit.evaluate(x, y)
    assert "influence uses cross-entropy" not in caplog.text and smoothed.reduction == "mean"
    used = audit._influence.loss
    assert used is not smoothed and used.label_smoothing == 0.2 and used.reduction == "none"
    assert report.execution["params"]["loss"] == "CrossEntropyLoss()"


def test_a_dataset_with_column_labels_fits_like_arrays() -> None:
    """Labels of shape (n, 1) from a dataset are class indices, as they are in an array."""
    from torch.utils.data import TensorDataset

    model, shape = _model("mlp")
    x, y, xq, yq = _data(shape)
    expected = GradientInfluence(device="cpu", batch_size=4).fit(model, x, y).scores(xq, yq)
    data = TensorDataset(torch.tensor(x), torch.tensor(y[:, None]))
    scores = GradientInfluence(device="cpu", batch_size=4).fit(model, data).scores(xq, yq)
    np.testing.assert_array_equal(scores, expected)


def test_self_influence_of_examples_without_labels_is_named():
    from helpers import digits, trained_classifier

    from art_malleability.influence import GradientInfluence

    data = digits(100, 20)
    estimator = GradientInfluence().fit(trained_classifier("2l-relu", epochs=5).model, data.x_train, data.y_train)
    with pytest.raises(ValueError, match=r"y must be given with x to self_influence .*got None"):
        estimator.self_influence(data.x_test[:8])
    with pytest.raises(ValueError, match=r"x must be given with y to self_influence"):
        estimator.self_influence(None, data.y_test[:8])
