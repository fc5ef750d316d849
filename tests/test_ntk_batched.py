"""Empirical NTK, ``method="batched"``: one class-batched ``torch.func`` pass per sub-batch, against ``"jacobian"``."""

import numpy as np
import pytest
import torch
from test_empirical_ntk import ALL_MODELS, _models
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from art_malleability.models import MLPAttn, ResNet20, SmallCNN, TwoLayerReLU
from art_malleability.ntk.empirical import NTK_METHODS, JacobianGram, empirical_ntk
from art_malleability.ntk.layers import passes

CLASSES = [1, 3, 10]
MODELS = ["2l-relu", "cnn-bn", "mlp-attn", "resnet20"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class FirstOutputs(nn.Module):
    """The first ``c`` outputs of a model (the reference models have at least two)."""

    def __init__(self, model: nn.Module, c: int) -> None:
        super().__init__()
        self.model, self.c = model, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, : self.c]


def _model(name: str, c: int) -> tuple[nn.Module, tuple[int, ...]]:
    """A float64 model in evaluation mode with ``c`` outputs, and its input shape."""
    if name == "2l-relu":
        model, shape = TwoLayerReLU((1, 8, 8), 16, max(c, 2), seed=3), (1, 8, 8)
    elif name == "mlp-attn":
        model, shape = MLPAttn((1, 8, 8), 16, max(c, 2), seed=4), (1, 8, 8)
        model.set_context(torch.randn(9, 1, 8, 8, generator=_gen(5)))
    elif name == "cnn-bn":
        model, shape = SmallCNN((1, 8, 8), c, seed=6), (1, 8, 8)
    else:
        model, shape = ResNet20((3, 8, 8), c, seed=7), (3, 8, 8)
    _randomise_batch_norm(model)
    if c == 1 and name in ("2l-relu", "mlp-attn"):
        model = FirstOutputs(model, 1)
    return model.double().eval(), shape


def _randomise_batch_norm(model: nn.Module) -> None:
    """Running statistics and affine parameters away from their initial values, so that batch norm matters."""
    gen = _gen(8)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                m.weight.copy_(1.0 + 0.2 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _assert_batched_is_jacobian(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, batch_size: int) -> None:
    """Traced and not, symmetric and not: the batched kernel equals torch.func's (other sub-batches on each side)."""
    with torch.no_grad():
        n1, c = len(x1), model(x1[:1]).shape[1]
    for trace in (True, False):
        for b in (None, x2):
            k_b = empirical_ntk(model, x1, b, method="batched", batch_size=batch_size, trace=trace)
            k_j = empirical_ntk(model, x1, b, method="jacobian", batch_size=batch_size + 1, trace=trace)
            n2 = n1 if b is None else len(x2)
            assert k_b.shape == ((n1, n2) if trace else (n1, n2, c, c))
            assert k_b.dtype == torch.float64
            assert _rel(k_b, k_j) < 1e-10, (trace, b is None)


@pytest.mark.parametrize("c", CLASSES)
@pytest.mark.parametrize("name", MODELS)
def test_batched_matches_jacobian(name: str, c: int) -> None:
    model, shape = _model(name, c)
    x1 = torch.randn(7, *shape, generator=_gen(1), dtype=torch.float64)
    x2 = torch.randn(4, *shape, generator=_gen(2), dtype=torch.float64)
    with torch.no_grad():
        assert model(x1[:1]).shape[1] == c
    _assert_batched_is_jacobian(model, x1, x2, batch_size=3)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_batched_matches_jacobian_on_the_structured_zoo(name: str) -> None:
    # shared and reused layers, 3-D inputs, free parameters, frozen readouts, in-place ReLU, layer norm
    model, shape = _models()[name]
    model = model.double().eval()
    x1 = torch.randn(9, *shape, generator=_gen(3), dtype=torch.float64)
    x2 = torch.randn(5, *shape, generator=_gen(4), dtype=torch.float64)
    _assert_batched_is_jacobian(model, x1, x2, batch_size=4)


def test_batched_with_output_fn_and_labels() -> None:
    # per-example loss gradients (the gradient-similarity influence's Gram matrix)
    model, shape = _model("cnn-bn", 3)
    x = torch.randn(6, *shape, generator=_gen(9), dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 1, 0, 2])

    def loss(out: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        return nn.functional.cross_entropy(out, labels, reduction="none")

    k_b = JacobianGram(model, method="batched", batch_size=4, output_fn=loss).gram(x, x[:4], y, y[:4])
    k_j = JacobianGram(model, method="jacobian", batch_size=4, output_fn=loss).gram(x, x[:4], y, y[:4])
    assert _rel(k_b, k_j) < 1e-10


def test_batched_does_not_depend_on_chunking() -> None:
    model, shape = _model("2l-relu", 10)
    x = torch.randn(10, *shape, generator=_gen(10), dtype=torch.float64)
    reference = empirical_ntk(model, x, method="jacobian")
    for batch_size, chunk_mb in ((10, 256.0), (3, 256.0), (10, 0.002)):
        engine = JacobianGram(model, method="batched", batch_size=batch_size, chunk_mb=chunk_mb)
        assert _rel(engine.gram(x), reference) < 1e-10
        assert _rel(engine.gram(x[:4], x[4:]), reference[:4, 4:]) < 1e-10


def test_model_mode_flags_and_weights_are_left_unchanged() -> None:
    model, shape = _model("cnn-bn", 3)
    model.train()
    model.head[1].eval()  # mixed per-module flags must be restored exactly
    model.features[1].weight.requires_grad_(False)  # a frozen batch-norm scale does not count
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    x = np.random.default_rng(1).normal(size=(5, *shape))
    k_b = empirical_ntk(model, x, method="batched", batch_size=2)
    k_j = empirical_ntk(model, x, method="jacobian", batch_size=2)
    assert _rel(k_b, k_j) < 1e-10
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class _Counter(TorchDispatchMode):
    """Host syncs among the dispatched operators."""

    SYNCS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.is_nonzero}

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.syncs += func.overloadpacket in self.SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["2l-relu", "cnn-bn"])
def test_one_func_call_per_sub_batch_no_autograd_no_host_sync(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, shape = _model(name, 10)
    x = torch.randn(10, *shape, generator=_gen(11), dtype=torch.float64)
    calls = {"jacrev": 0, "grad": 0}
    inside = [False]
    jacrev, grad = passes.jacrev, torch.autograd.grad

    def counting_jacrev(*args, **kwargs):  # noqa: ANN002, ANN003
        transform = jacrev(*args, **kwargs)

        def call(*a, **k):  # noqa: ANN002, ANN003
            calls["jacrev"] += 1
            inside[0] = True
            try:
                return transform(*a, **k)
            finally:
                inside[0] = False

        return call

    def counting_grad(*args, **kwargs):  # noqa: ANN002, ANN003
        calls["grad"] += not inside[0]  # torch.func's own reverse pass runs through it
        return grad(*args, **kwargs)

    monkeypatch.setattr(passes, "jacrev", counting_jacrev)
    monkeypatch.setattr(torch.autograd, "grad", counting_grad)
    engine = JacobianGram(model, method="batched", batch_size=4)
    with _Counter() as counter:
        engine.gram(x)
    assert calls == {"jacrev": 3, "grad": 0}  # ⌈10 / 4⌉ sub-batches, one class-batched pass each
    assert counter.syncs == 0


def test_method_names() -> None:
    assert NTK_METHODS == ("auto", "structured", "batched", "jacobian")
    with pytest.raises(ValueError, match="method"):
        JacobianGram(nn.Linear(2, 2), method="fast")


@pytest.mark.parametrize(("name", "chosen"), [("2l-relu", "structured"), ("resnet20", "batched")])
def test_auto_takes_the_method_with_the_least_counted_work(name: str, chosen: str) -> None:
    # a wide 2L-ReLU's hidden layer is rank one over the classes (ten times fewer contraction operations), ResNet-20
    # has no such block: the counts decide, the same way every time, and the choice and its reason are recorded
    if name == "2l-relu":
        model, shape = TwoLayerReLU((1, 8, 8), 2048, 10, seed=3).double().eval(), (1, 8, 8)
    else:
        model, shape = _model(name, 10)
    x = torch.randn(512 if name == "2l-relu" else 48, *shape, generator=_gen(12), dtype=torch.float64)
    engine = JacobianGram(model, batch_size=32)
    k = engine.gram(x)
    choice = engine.choice
    assert engine.path == choice.method == chosen
    assert set(choice.seconds) == {"structured", "batched", "jacobian"}
    assert min(choice.seconds, key=choice.seconds.get) == chosen and chosen in choice.reason
    assert all(c.example_flops > 0 and c.calls > 0 for c in choice.costs.values())
    again = JacobianGram(model, batch_size=32)
    assert torch.equal(again.gram(x), k) and again.choice.seconds == choice.seconds  # counted, not timed
    assert _rel(k[:24, :24], empirical_ntk(model, x[:24], method="jacobian")) < 1e-10


def test_a_block_that_is_not_rank_one_on_the_probe_never_tries(caplog: pytest.LogCaptureFixture) -> None:
    # a layer followed by a data-dependent mixing is not rank one over the classes: the probe of "auto" finds it, so
    # the kernel is computed once, without the recomputation that a failed check on the kernel's own sub-batches costs
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10)).double()
    x = torch.randn(512, 5, generator=_gen(13), dtype=torch.float64)
    engine = JacobianGram(model, batch_size=32)
    with caplog.at_level("DEBUG", logger="art_malleability.ntk.empirical"):
        k = engine.gram(x)
    assert engine.path == "structured" and engine._rank_one == [False, True, True]
    assert "not rank one" not in caplog.text
    assert _rel(k, empirical_ntk(model, x, method="batched")) < 1e-10  # itself checked against torch.func above


def test_a_layer_skipped_after_planning_is_an_error() -> None:
    class Skipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.a(x) if self.calls > 1 else self.a(x) + self.b(x)

    model = Skipping().double()
    with pytest.raises(RuntimeError, match="every layer"):
        empirical_ntk(model, torch.randn(3, 4, dtype=torch.float64), method="batched")


@pytest.mark.parametrize("width", [16, 4096])
def test_auto_counts_its_work_on_the_kernels_own_first_sub_batch(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the counted pass is the kernel's first sub-batch, whose factors the kernel then uses (batched, or compressed with
    # the class directions the structured kernel goes on with): no pass is run twice, and the kernel is the chosen
    # method's own
    from art_malleability.ntk import _passes

    model = TwoLayerReLU((1, 8, 8), width, 10, seed=3).double().eval()
    x = torch.randn(256, 1, 8, 8, generator=_gen(15), dtype=torch.float64)
    rows: list[int] = []
    real = _passes.probed_pass
    monkeypatch.setattr(_passes, "probed_pass", lambda *a, **k: rows.append(len(a[2])) or real(*a, **k))
    engine = JacobianGram(model, batch_size=64)
    k = engine.gram(x)
    assert sum(rows) == len(x), rows  # every example's factors once: the counted sub-batch's are kept
    assert engine.path == ("structured" if width == 4096 else "batched")
    monkeypatch.setattr(_passes, "probed_pass", real)
    assert torch.equal(k, empirical_ntk(model, x, method=engine.path, batch_size=64))


@pytest.mark.parametrize(("n", "classes", "width"), [(64, 10, 512), (3, 2, 7)])
def test_the_rank_one_checks_counted_work_is_what_the_counter_counts(n: int, classes: int, width: int) -> None:
    # "auto" prices the check by its formula (run under the counter it would cost more than the check itself): the
    # formula is the counter's own count of a check whose directions are set
    from art_malleability.ntk._rank_one import ClassDirections
    from art_malleability.ntk.cost import count

    gen = _gen(16)
    d = torch.randn(n, 1, 1, generator=gen, dtype=torch.float64) * torch.randn(1, classes, width, generator=gen,
                                                                                dtype=torch.float64)
    directions = ClassDirections.fresh(1)
    assert directions.factor(0, d) is not None  # sets the directions
    _, flops, writes, calls = count(directions.factor, 0, d)
    assert (flops, writes, calls) == (0.0, *ClassDirections.check_work(n, classes, width))

