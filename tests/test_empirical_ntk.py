"""Empirical NTK: structured (factorised) path against torch.func Jacobians and brute force."""

import copy
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.influence.ntk_memory import factor_passes
from art_malleability.models import MLPAttn, TwoLayerReLU
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


class NormNet(nn.Module):
    """A hidden layer followed by a layer norm: its output gradients are not rank one over classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.fc(x))))


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    mlp2 = nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3))
    mlp3 = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3))
    ctx = ContextNet(5, 16, 3)
    ctx.set_context(torch.randn(9, 5, generator=_gen(3)))
    mlp_tanh = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 4))
    attn = MLPAttn(5, width=32, nb_classes=3, seed=1)
    attn.set_context(torch.randn(9, 5, generator=_gen(11)))
    return {
        "mlp2": (mlp2, (5,)),
        "mlp_tanh": (mlp_tanh, (5,)),
        "norm": (NormNet(), (5,)),
        "2l-relu": (TwoLayerReLU((1, 2, 3), width=32, nb_classes=4, seed=2), (1, 2, 3)),
        "mlp-attn": (attn, (5,)),
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


ALL_MODELS = ["mlp2", "mlp3", "mlp_tanh", "norm", "2l-relu", "mlp-attn", "ntk_frozen_out", "context", "cnn", "mixed"]


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("trace", [True, False])
def test_structured_matches_jacobian(name: str, trace: bool) -> None:
    model, shape = _models()[name]
    model = model.double().eval()
    x1 = torch.randn(11, *shape, generator=_gen(1), dtype=torch.float64)
    x2 = torch.randn(6, *shape, generator=_gen(2), dtype=torch.float64)
    for a, b in [(x1, None), (x1, x2)]:
        k_s = empirical_ntk(model, a, b, method="structured", batch_size=4, trace=trace)
        k_j = empirical_ntk(model, a, b, method="jacobian", batch_size=5, trace=trace)
        auto = JacobianGram(model, batch_size=4)
        k_a = auto.gram(a, b, trace=trace)
        n2 = a.shape[0] if b is None else b.shape[0]
        assert k_s.shape[:2] == (11, n2)
        assert k_s.dtype == torch.float64
        assert _rel(k_s, k_j) < 1e-10
        # "auto" runs one of the methods, chosen by counted work, and gives its numbers exactly
        assert torch.equal(k_a, empirical_ntk(model, a, b, method=auto.path, batch_size=4, trace=trace))


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
    # a linear layer on 3-D inputs (two positions: explicit by the rule) and one called twice (their positions side by
    # side) are Kronecker blocks too; only the free-standing scale is left to the vmapped pass
    model, shape = _models()["mixed"]
    engine = JacobianGram(model.double())
    x = torch.randn(3, *shape, dtype=torch.float64, generator=_gen(6))
    engine.gram(x)
    plan = engine._layer_plan
    assert [(b.name, b.positions, b.structured) for b in plan.blocks] == [("token", 2, False), ("twice", 2, True),
                                                                         ("head", 1, True)]
    assert [n for n, _ in plan.fallback] == ["scale"]
    mlp, _ = _models()["mlp3"]
    engine = JacobianGram(mlp.double())
    engine.gram(torch.randn(3, 5, dtype=torch.float64, generator=_gen(7)))
    assert len(engine._structured) == 3 and engine._layer_plan.fallback == []


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


# A chunk budget of 1 KiB (128 float64 numbers): one or a few examples per forward pass and
# per kernel block, factors mostly not cached, so every chunking code path runs.
TINY_MB = 1 / 1024


def _record_batch_sizes(model: nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, inputs: sizes.append(int(inputs[0].shape[0])))
    return sizes, handle


@pytest.mark.parametrize("name", ALL_MODELS)
@pytest.mark.parametrize("trace", [True, False])
def test_chunked_matches_jacobian(name: str, trace: bool) -> None:
    model, shape = _models()[name]
    model = model.double().eval()
    x1 = torch.randn(13, *shape, generator=_gen(12), dtype=torch.float64)
    x2 = torch.randn(7, *shape, generator=_gen(13), dtype=torch.float64)
    for a, b in [(x1, None), (x1, x2)]:
        sizes, handle = _record_batch_sizes(model)
        try:
            k_s = empirical_ntk(model, a, b, chunk_mb=TINY_MB, trace=trace)
        finally:
            handle.remove()
        assert len(sizes) >= 4 and max(sizes[1:]) < 7  # several sub-batches (the first call is the probe)
        k_j = empirical_ntk(model, a, b, method="jacobian", trace=trace)
        assert _rel(k_s, k_j) < 1e-10
        if b is None:
            assert torch.equal(k_s, k_s.T if trace else k_s.permute(1, 0, 3, 2))


@pytest.mark.parametrize("name", ["mlp3", "mlp_tanh", "norm", "2l-relu", "mlp-attn", "cnn", "mixed"])
def test_result_does_not_depend_on_chunking(name: str) -> None:
    model, shape = _models()[name]
    model = model.double().eval()
    x1 = torch.randn(11, *shape, generator=_gen(14), dtype=torch.float64)
    x2 = torch.randn(6, *shape, generator=_gen(15), dtype=torch.float64)
    ref = empirical_ntk(model, x1)
    ref_x2 = empirical_ntk(model, x1, x2)
    for chunk_mb, batch_size in [(TINY_MB, 256), (4 * TINY_MB, 5), (256.0, 1), (0.05, 7)]:
        k = empirical_ntk(model, x1, batch_size=batch_size, chunk_mb=chunk_mb)
        assert _rel(k, ref) < 1e-13
        assert torch.equal(k, k.T)
        assert _rel(empirical_ntk(model, x1, x2, batch_size=batch_size, chunk_mb=chunk_mb), ref_x2) < 1e-13


def test_rank_one_factorisation_is_detected() -> None:
    # last hidden layers and output layers factor over the classes; a layer followed by another
    # data-dependent mixing (ReLU then a linear layer, a layer norm) does not
    expected = {
        "mlp2": [True, True],
        "mlp3": [False, True, True],
        "mlp_tanh": [True, True],
        "norm": [False, True],
        "2l-relu": [True],
        "mlp-attn": [True],
    }
    for name, flags in expected.items():
        model, shape = _models()[name]
        model = model.double()
        x = torch.randn(9, *shape, generator=_gen(16), dtype=torch.float64)
        engine = JacobianGram(model, method="structured")
        k = engine.gram(x)
        assert engine._rank_one == flags, name
        assert _rel(k, empirical_ntk(model, x, method="jacobian")) < 1e-12
        probed = JacobianGram(model)  # "auto" finds the blocks that are not rank one on its probe, before the kernel
        probed.prepare(x)
        assert probed._rank_one_blocks == flags
        full = JacobianGram(model, method="structured")  # trace=False never uses the factorisation
        full.gram(x, trace=False)
        assert full._rank_one == [True] * len(flags)


def test_rank_one_factorisation_in_float32() -> None:
    model, shape = _models()["mlp_tanh"]
    x = torch.randn(9, *shape, generator=_gen(22))
    engine = JacobianGram(model.float(), method="structured")
    k32 = engine.gram(x)
    assert engine._rank_one == [True, True] and k32.dtype == torch.float32
    k64 = empirical_ntk(copy.deepcopy(model).double(), x, method="jacobian")
    assert _rel(k32.double(), k64) < 1e-5


def test_rank_change_after_first_chunk_recomputes(caplog: pytest.LogCaptureFixture) -> None:
    # with one example per sub-batch every layer looks rank one at first; the first layer of
    # mlp3 fails on a later chunk, and the kernel is recomputed with full factors for it
    model, shape = _models()["mlp3"]
    model = model.double()
    x1 = torch.randn(10, *shape, generator=_gen(17), dtype=torch.float64)
    x2 = torch.randn(4, *shape, generator=_gen(18), dtype=torch.float64)
    engine = JacobianGram(model, method="structured", chunk_mb=TINY_MB / 4)
    with caplog.at_level("DEBUG", logger="art_malleability.ntk.empirical"):
        k = engine.gram(x1, x2)
    assert engine._sub_batch_rows() == 1
    assert "not rank one" in caplog.text
    assert engine._rank_one == [False, True, True]
    assert _rel(k, empirical_ntk(model, x1, x2, method="jacobian")) < 1e-10
    assert _rel(engine.gram(x1, x2), k) < 1e-14  # the decision sticks


def test_class_directions_set_late_for_dead_columns() -> None:
    # zero inputs give zero ReLU gradients (all columns dead): the class directions of the
    # rank-one factorisation are only set by later examples, which must stay consistent
    model, shape = _models()["2l-relu"]
    model = model.double()
    x = torch.randn(12, *shape, generator=_gen(19), dtype=torch.float64)
    x[:3] = 0.0
    x[7] = 0.0
    for chunk_mb in (TINY_MB, 256.0):
        for a, b in [(x, None), (x[:5], x[5:]), (x[5:], x[:5])]:
            k = empirical_ntk(model, a, b, chunk_mb=chunk_mb)
            assert _rel(k, empirical_ntk(model, a, b, method="jacobian")) < 1e-12
    assert torch.all(empirical_ntk(model, x)[:3] == 0)


def test_non_finite_values_propagate() -> None:
    model, shape = _models()["mlp2"]
    model = model.double()
    x = torch.randn(6, *shape, generator=_gen(21), dtype=torch.float64)
    model[2].weight.data[1, 2] = float("nan")  # reaches the hidden layer's gradients where unit 2 is active
    k = empirical_ntk(model, x)
    k_j = empirical_ntk(model, x, method="jacobian")
    assert torch.isnan(k).any()
    assert torch.equal(torch.isnan(k), torch.isnan(k_j))
    finite = ~torch.isnan(k)
    assert _rel(k[finite], k_j[finite]) < 1e-12


def test_chunk_budget_bounds_passes() -> None:
    model = TwoLayerReLU(6, width=512, nb_classes=10, seed=3).double()
    x = torch.randn(40, 6, generator=_gen(20), dtype=torch.float64)
    probe = JacobianGram(model, method="structured")
    probe.factor_elements(x[:2])
    total, largest = probe._forward_size  # the forward's intermediates and its largest tensor, per example
    # raw output gradients, the layer's input, its stored factors, and the pass's intermediates
    raw = 10 * 512 + 6 + (6 + 10 * 512) + total + 2 * 10 * largest
    assert probe._pass_size() + probe._pass_intermediates() == raw
    chunk_mb = 3 * raw * 8 / 2**20  # room for three examples per forward/backward pass
    sizes, handle = _record_batch_sizes(model)
    try:
        engine = JacobianGram(model, method="structured", chunk_mb=chunk_mb)
        k = engine.gram(x)
    finally:
        handle.remove()
    assert sizes[0] == 2  # planning probe
    assert max(sizes[1:]) == 3
    assert sum(sizes[1:]) == 40  # factors of the rank-one layer are small enough to be cached
    assert _rel(k, empirical_ntk(model, x, method="jacobian")) < 1e-12


@pytest.mark.parametrize("name", ["2l-relu", "cnn"])
def test_factors_that_do_not_fit_are_computed_once_per_panel(name: str) -> None:
    """
    With room for the factors of 15 examples, blocks of 5: x2's factors stream past panels of 10 rows of x1 (the full
    kernel, whose factors are never compressed, so that their size is known before the call).
    """
    model, shape = _models()[name]
    model = model.double().eval()
    x = torch.randn(40, *shape, generator=_gen(21), dtype=torch.float64)
    xq = torch.randn(12, *shape, generator=_gen(22), dtype=torch.float64)
    size = JacobianGram(model, method="structured").factor_elements(x, compressed=False)
    engine = JacobianGram(model, method="structured", batch_size=5, chunk_mb=(7.5 * size + 1) * 8 / 2**20)
    x_probe = x[:2].numpy()
    engine.factor_elements(x_probe)
    assert engine.panel_rows() == 10 and factor_passes(40, engine.panel_rows()) == 100  # the estimate's count
    counted = []
    features = engine.features
    engine.features = lambda xb, yb=None: counted.append(len(xb)) or features(xb, yb)
    for a, b, computed in [(x, None, 40 + 30 + 20 + 10), (xq, x, 12 + 2 * 40)]:  # one block at a time: 180, 92
        counted.clear()
        k = engine.gram(a, b, trace=False)
        assert sum(counted) == computed
        assert _rel(k, empirical_ntk(model, a, b, method="jacobian", trace=False)) < 1e-12


def test_the_factors_alive_at_once_fit_twice_the_chunk() -> None:
    """Kept factors or a panel, with the block beside them: never more examples' factors than 2 x chunk holds."""
    import weakref

    model = nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(23, 7, generator=_gen(23), dtype=torch.float64)
    size = JacobianGram(model, method="jacobian").factor_elements(x, compressed=False)
    engine = JacobianGram(model, method="jacobian", batch_size=2, chunk_mb=3 * size * 8 / 2**20)  # 6 fit 2 x chunk
    alive, peak = {}, [0]
    features = engine.features

    def tracked(xb, yb=None):
        f = features(xb, yb)
        alive[id(f)] = f.n
        weakref.finalize(f, alive.pop, id(f), None)
        peak[0] = max(peak[0], sum(alive.values()))
        return f

    engine.features = tracked
    for a, b in [(x[:9], x), (x[:9], x[:4]), (x, None), (x[:3], x[:4])]:
        peak[0] = 0
        k = engine.gram(a, b)
        assert peak[0] <= 6, (len(a), b is None)
        assert _rel(k, empirical_ntk(model, a, b, method="jacobian")) < 1e-12


def test_peak_memory_is_bounded_at_large_width() -> None:
    # n = 100, width 32,768, 10 classes: the output gradients of all examples would take
    # 100·10·32768·8 B = 250 MiB; streamed with a 16 MiB chunk the call adds far less to the peak
    script = textwrap.dedent(
        """
        import resource, torch
        from art_malleability.models import TwoLayerReLU
        from art_malleability.ntk.empirical import empirical_ntk
        torch.set_num_threads(2)
        model = TwoLayerReLU(32, width=32768, nb_classes=10, seed=0).double()
        x = torch.randn(100, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        empirical_ntk(model, x[:2], chunk_mb=16)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        k = empirical_ntk(model, x, chunk_mb=16)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert torch.isfinite(k).all() and k.shape == (100, 100)
        print((after - before) / 1024)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    growth_mib = float(result.stdout.strip().splitlines()[-1])
    assert growth_mib < 125, growth_mib


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
    for bad in (0, -1.0, float("nan"), float("inf"), True, "64"):
        with pytest.raises(ValueError, match="chunk_mb"):
            empirical_ntk(model, x, chunk_mb=bad)
    with pytest.raises(TypeError, match="trace"):
        empirical_ntk(model, x, trace="yes")
    with pytest.raises(TypeError, match="model"):
        empirical_ntk(lambda t: t, x)
    frozen = nn.Linear(5, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        empirical_ntk(frozen, x)
    with pytest.raises(ValueError, match="at least one example"):
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


def test_kept_factors_match_fresh_kernels_through_changes_and_rank_changes() -> None:
    from art_malleability.ntk.kept import KeptFactors

    # mlp3's first layer only shows it is not rank one on later single-example chunks: built first
    # from one example (looks rank one), the kept factors must be rebuilt when a new query shows it
    model, shape = _models()["mlp3"]
    model = model.double()
    x = torch.randn(6, *shape, generator=_gen(31), dtype=torch.float64)
    xq = torch.randn(3, *shape, generator=_gen(32), dtype=torch.float64)
    engine = JacobianGram(model, method="structured", chunk_mb=TINY_MB / 4)
    kept = KeptFactors(engine, x[:1])
    assert _rel(kept.rows(xq), empirical_ntk(model, xq, x[:1], method="jacobian")) < 1e-10
    kept = KeptFactors(engine, x)
    assert _rel(kept.gram(), empirical_ntk(model, x, method="jacobian")) < 1e-10
    # dead columns of the 2L-ReLU: class directions set late stay consistent with the kept factors
    model2, shape2 = _models()["2l-relu"]
    model2 = model2.double()
    z = torch.randn(8, *shape2, generator=_gen(33), dtype=torch.float64)
    z[:4] = 0.0
    kept2 = KeptFactors(JacobianGram(model2, chunk_mb=TINY_MB), z)
    zq = torch.randn(4, *shape2, generator=_gen(34), dtype=torch.float64)
    assert _rel(kept2.rows(zq), empirical_ntk(model2, zq, z, method="jacobian")) < 1e-12
    # swapped rows: rows and gram equal those of the modified set
    changed = np.array([1, 5])
    new = torch.randn(2, *shape, generator=_gen(35), dtype=torch.float64)
    x_mod = x.clone()
    x_mod[changed] = new
    kept.set_changed(changed, new)
    assert _rel(kept.gram(), empirical_ntk(model, x_mod, method="jacobian")) < 1e-10
    assert _rel(kept.rows(xq), empirical_ntk(model, xq, x_mod, method="jacobian")) < 1e-10
    kept.set_changed(np.zeros(0, dtype=int), x[:0])
    assert _rel(kept.rows(xq), empirical_ntk(model, xq, x, method="jacobian")) < 1e-10
