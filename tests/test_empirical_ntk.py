"""Empirical NTK: structured (factorised) path against torch.func Jacobians and brute force."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.ntk.empirical import JacobianGram, empirical_ntk


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class NTKNet(nn.Module):
    """f(x) = m^-1/2 relu(x Wᵀ) A with a fixed ±1 output matrix A (a buffer), only W trained."""

    def __init__(self, d: int, m: int, c: int, seed: int = 0) -> None:
        super().__init__()
        self.fc = nn.Linear(d, m, bias=False)
        signs = torch.randint(0, 2, (m, c), generator=_gen(seed)) * 2.0 - 1.0
        self.register_buffer("out", signs)
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x.flatten(1))) @ self.out / self.m**0.5


class ContextNet(NTKNet):
    """Transductive toy: inputs mapped by a context matrix C = XᵀX held as a buffer."""

    def __init__(self, d: int, m: int, c: int) -> None:
        super().__init__(d, m, c)
        self.register_buffer("context", torch.eye(d))

    def set_context(self, x_train: torch.Tensor) -> None:
        x = torch.as_tensor(x_train, dtype=self.context.dtype).flatten(1)
        self.context = x.T @ x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.flatten(1) @ self.context
        return super().forward(z / z.norm(dim=1, keepdim=True))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Mixed(nn.Module):
    """A shared linear layer called twice, a linear layer on 3-D input, a free parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Linear(3, 5)  # applied to (n, 2, 3): not 2-D, goes to the fallback
        self.twice = nn.Linear(5, 5)  # called twice: fallback
        self.head = nn.Linear(5, 3)  # structured
        self.scale = nn.Parameter(torch.tensor(1.5))  # free-standing parameter: fallback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.token(x.view(-1, 2, 3))).mean(1)
        h = torch.relu(self.twice(torch.relu(self.twice(h))))
        return self.scale * self.head(h)


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    mlp2 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3))
    mlp3 = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))
    ctx = ContextNet(5, 16, 3)
    ctx.set_context(torch.randn(9, 5, generator=_gen(3)))
    return {
        "mlp2": (mlp2, (5,)),
        "mlp3": (mlp3, (5,)),
        "ntk_frozen_out": (NTKNet(5, 16, 3), (5,)),
        "context": (ctx, (5,)),
        "cnn": (SmallCNN(), (1, 6, 6)),
        "mixed": (Mixed(), (6,)),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _brute_force_jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per-example, per-output gradients by a plain loop: (n, C, P)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for a in range(x.shape[0]):
        out = model(x[a : a + 1])[0]
        per_class = []
        for c in range(out.shape[0]):
            grads = torch.autograd.grad(out[c], params, retain_graph=True, allow_unused=True)
            pairs = zip(grads, params, strict=True)
            flat = [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in pairs]
            per_class.append(torch.cat(flat))
        rows.append(torch.stack(per_class))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["mlp2", "mlp3", "ntk_frozen_out", "context", "cnn", "mixed"])
@pytest.mark.parametrize("trace", [True, False])
def test_structured_matches_jacobian(name: str, trace: bool) -> None:
    model, shape = _models()[name]
    model = model.double().eval()
    x1 = torch.randn(11, *shape, generator=_gen(1), dtype=torch.float64)
    x2 = torch.randn(6, *shape, generator=_gen(2), dtype=torch.float64)
    for a, b in [(x1, None), (x1, x2)]:
        k_s = empirical_ntk(model, a, b, method="structured", batch_size=4, trace=trace)
        k_j = empirical_ntk(model, a, b, method="jacobian", batch_size=5, trace=trace)
        k_a = empirical_ntk(model, a, b, batch_size=4, trace=trace)
        n2 = a.shape[0] if b is None else b.shape[0]
        assert k_s.shape[:2] == (11, n2)
        assert k_s.dtype == torch.float64
        assert _rel(k_s, k_j) < 1e-10
        assert torch.equal(k_a, k_s)


def test_matches_brute_force_loop() -> None:
    for name in ["mlp2", "ntk_frozen_out", "mixed"]:
        model, shape = _models()[name]
        model = model.double().eval()
        x1 = torch.randn(5, *shape, generator=_gen(4), dtype=torch.float64)
        x2 = torch.randn(4, *shape, generator=_gen(5), dtype=torch.float64)
        j1, j2 = _brute_force_jacobian(model, x1), _brute_force_jacobian(model, x2)
        expected = torch.einsum("acp,bcp->ab", j1, j2)
        expected_full = torch.einsum("acp,bdp->abcd", j1, j2)
        assert _rel(empirical_ntk(model, x1, x2, batch_size=3), expected) < 1e-10
        assert _rel(empirical_ntk(model, x1, x2, batch_size=3, trace=False), expected_full) < 1e-10


def test_plan_uses_structured_path_where_possible() -> None:
    model, shape = _models()["mixed"]
    engine = JacobianGram(model.double())
    x = torch.randn(3, *shape, dtype=torch.float64, generator=_gen(6))
    engine.gram(x)
    assert [layer.name for layer in engine._layers] == ["head"]
    assert sorted(n for n, _ in engine._fallback) == ["scale", "token.bias", "token.weight", "twice.bias",
                                                        "twice.weight"]
    mlp, _ = _models()["mlp3"]
    engine = JacobianGram(mlp.double())
    engine.gram(torch.randn(3, 5, dtype=torch.float64, generator=_gen(7)))
    assert len(engine._layers) == 3 and engine._fallback == []


def test_frozen_parameters_do_not_count() -> None:
    model, _ = _models()["mlp2"]
    model = model.double()
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    x = torch.randn(6, 5, generator=_gen(8), dtype=torch.float64)
    j = _brute_force_jacobian(model, x)
    assert j.shape[2] == 5 * 7 + 3  # first weight and last bias only
    expected = torch.einsum("acp,bcp->ab", j, j)
    assert _rel(empirical_ntk(model, x), expected) < 1e-10
    assert _rel(empirical_ntk(model, x, method="jacobian"), expected) < 1e-10


def test_symmetric_psd_and_blocking_invariant() -> None:
    model, _ = _models()["mlp3"]
    model = model.double()
    x = torch.randn(23, 5, generator=_gen(9), dtype=torch.float64)
    k = empirical_ntk(model, x, batch_size=5)
    assert torch.equal(k, k.T)
    assert torch.linalg.eigvalsh(k).min() > -1e-10 * k.diagonal().max()
    k_one_block = empirical_ntk(model, x, x, batch_size=100)
    assert _rel(k, k_one_block) < 1e-13


def test_dtype_device_and_numpy_inputs() -> None:
    model, _ = _models()["mlp2"]  # float32 model
    x = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
    k32 = empirical_ntk(model, x)
    assert k32.dtype == torch.float32 and k32.device.type == "cpu"
    k64 = empirical_ntk(model.double(), x)
    assert k64.dtype == torch.float64
    assert _rel(k32.double(), k64) < 1e-5


def test_does_not_mutate_model_inputs_or_rng() -> None:
    model, _ = _models()["mixed"]
    model = model.double().train()
    model.head.eval()  # mixed per-module flags must be restored exactly
    model.twice.weight.grad = None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    x = np.random.default_rng(1).normal(size=(5, 6))
    x_before = x.copy()
    rng_state = torch.get_rng_state()
    for method in ("auto", "jacobian"):
        empirical_ntk(model, x, method=method, batch_size=2)
        empirical_ntk(model, x, x[:3], method=method, batch_size=2)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert np.array_equal(x, x_before)
    assert torch.equal(rng_state, torch.get_rng_state())


def test_bad_parameters() -> None:
    model, _ = _models()["mlp2"]
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="method"):
        empirical_ntk(model, x, method="fast")
    with pytest.raises(ValueError, match="batch_size"):
        empirical_ntk(model, x, batch_size=0)
    with pytest.raises(TypeError, match="trace"):
        empirical_ntk(model, x, trace="yes")
    with pytest.raises(TypeError, match="model"):
        empirical_ntk(lambda t: t, x)
    frozen = nn.Linear(5, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        empirical_ntk(frozen, x)
    with pytest.raises(ValueError, match="empty"):
        empirical_ntk(model, x[:0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    for name in ("mlp3", "cnn"):
        model, shape = _models()[name]
        model = model.double()
        x = torch.randn(9, *shape, generator=_gen(10), dtype=torch.float64)
        k_cpu = empirical_ntk(model, x, batch_size=4)
        k_cuda = empirical_ntk(copy.deepcopy(model).cuda(), x, batch_size=4)
        assert k_cuda.device.type == "cuda"
        assert _rel(k_cuda.cpu(), k_cpu) < 1e-12
    model = nn.Linear(5, 3).cuda().float()
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    empirical_ntk(model, torch.randn(4, 5))
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
