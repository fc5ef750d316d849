"""
Empirical NTK, ``method="batched"``: the per-layer closed forms of convolutions (unfold, explicit or structured by
the FLOP rule) and of batch norms in evaluation mode, against ``torch.func`` Jacobians; and the memory sizing of the
batched pass.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from art_malleability.ntk import _autograd, _memory, _passes
from art_malleability.ntk._probed import ProbedLayer, conv_contract, explicit_gradients, prefers_structured
from art_malleability.ntk.empirical import JacobianGram, empirical_ntk


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


class ConvZoo(nn.Module):
    """Convolutions of every handled kind: strided, dilated, without bias, with a frozen weight, on a small map."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, bias=False)
        self.c = nn.Conv2d(6, 8, (2, 3), padding=(0, 1))
        self.c.weight.requires_grad_(False)  # only its bias is trained
        self.d = nn.Conv2d(8, 24, 3, padding=1)  # on a 2 x 2 map: the structured form
        self.out = nn.Linear(24 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.relu(self.b(h))
        h = torch.tanh(self.c(h))
        h = nn.functional.adaptive_avg_pool2d(h, 2)
        return self.out(torch.tanh(self.d(h)).flatten(1))


class NormZoo(nn.Module):
    """Batch norms in 1, 2 and 3 dimensions, one with a frozen scale and one with only its scale trained."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn2 = nn.BatchNorm2d(3)
        self.bn3 = nn.BatchNorm3d(1)
        self.bn1 = nn.BatchNorm1d(12)
        self.bn2.weight.requires_grad_(False)
        self.bn1.bias.requires_grad_(False)
        self.out = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn2(self.conv(x)))  # (n, 3, 4, 4)
        h = self.bn3(h.unsqueeze(1)).squeeze(1)
        h = nn.functional.avg_pool2d(h, 2).flatten(1)  # (n, 12)
        return self.out(torch.tanh(self.bn1(h)))


def _randomised(model: nn.Module) -> nn.Module:
    gen = _gen(8)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
    return model.double().eval()


def _assert_matches_jacobian(model: nn.Module, shape: tuple[int, ...], batch_size: int = 3) -> JacobianGram:
    x1 = torch.randn(7, *shape, generator=_gen(1), dtype=torch.float64)
    x2 = torch.randn(4, *shape, generator=_gen(2), dtype=torch.float64)
    engine = JacobianGram(model, method="batched", batch_size=batch_size)
    for trace in (True, False):
        for b in (None, x2):
            k_b = engine.gram(x1, b, trace=trace)
            k_j = empirical_ntk(model, x1, b, method="jacobian", batch_size=5, trace=trace)
            assert _rel(k_b, k_j) < 1e-10, (trace, b is None)
    return engine


@pytest.mark.parametrize("classes", [1, 3, 10])
def test_convolutions_match_jacobian(classes: int) -> None:
    torch.manual_seed(0)
    engine = _assert_matches_jacobian(ConvZoo(classes).double().eval(), (2, 8, 8))
    forms = {p.name: p.structured for p in engine._probed}
    assert set(forms) == {"a", "b", "c", "d"} and not engine._fallback  # no parameter left to torch.func
    # the rule's choice: the convolution on a 2 x 2 map is structured, those on larger maps explicit (c: bias only)
    assert forms == {"a": False, "b": False, "c": False, "d": True}


@pytest.mark.parametrize("structured", [False, True])
@pytest.mark.parametrize("classes", [1, 3])
def test_both_convolution_forms_match_jacobian(structured: bool, classes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # whatever the rule decides, each form is exact for every convolution it may be given
    monkeypatch.setattr(_passes, "prefers_structured", lambda *args: structured)
    torch.manual_seed(1)
    engine = _assert_matches_jacobian(ConvZoo(classes).double().eval(), (2, 8, 8))
    assert [p.structured for p in engine._probed] == [structured, structured, False, structured]  # c: bias only


def test_structured_convolution_chunks_its_products() -> None:
    torch.manual_seed(2)
    layer = ProbedLayer("d", nn.Conv2d(3, 5, 3, padding=1).double(), "conv", True, True, (5, 3, 3), (3, 3, 3))
    a1, d1 = torch.randn(6, 9, 28, dtype=torch.float64), torch.randn(6, 9, 4, 5, dtype=torch.float64)
    a2, d2 = torch.randn(5, 9, 28, dtype=torch.float64), torch.randn(5, 9, 4, 5, dtype=torch.float64)
    for trace in (True, False):
        whole = conv_contract((a1, d1), (a2, d2), trace, chunk_elements=2**30)
        one_row = conv_contract((a1, d1), (a2, d2), trace, chunk_elements=1)
        # the same sums in another order: equal to rounding, measured against the block's scale (an entry near zero
        # is a cancellation, whose relative error the BLAS's summation order decides)
        assert torch.allclose(whole, one_row, rtol=1e-13, atol=1e-14 * float(whole.abs().max()))
    # against the explicit gradients Δ_cᵀ A of the same factors
    j1 = torch.einsum("nlco,nld->ncod", d1, a1).flatten(2)
    j2 = torch.einsum("nlco,nld->ncod", d2, a2).flatten(2)
    assert _rel(conv_contract((a1, d1), (a2, d2), True, 2**30), j1.flatten(1) @ j2.flatten(1).T) < 1e-13
    assert layer.patch == 28 and layer.positions == 9


@pytest.mark.parametrize(
    ("positions", "patch", "channels", "classes"), [(4, 217, 24, 10), (64, 37, 4, 10), (1, 10, 1, 1)]
)
def test_rule_picks_the_form_with_fewer_counted_flops(positions: int, patch: int, channels: int, classes: int) -> None:
    # the rule against the multiply-adds torch counts in the two contractions of one pair of examples
    a = torch.randn(1, positions, patch, dtype=torch.float64)
    d = torch.randn(1, positions, classes, channels, dtype=torch.float64)
    j = torch.randn(1, classes * channels * patch, dtype=torch.float64)
    with FlopCounterMode(display=False) as structured:
        conv_contract((a, d), (a, d), True, 2**30)
    with FlopCounterMode(display=False) as explicit:
        j @ j.T
    counted = structured.get_total_flops() < explicit.get_total_flops()
    assert prefers_structured(positions, patch, channels, classes) == counted


@pytest.mark.parametrize("classes", [1, 3, 10])
def test_batch_norms_in_closed_form_match_jacobian(classes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    model = _randomised(NormZoo(classes))
    vjps = []
    monkeypatch.setattr(torch.func, "vjp", lambda *a, **k: vjps.append(1))  # the closed form calls none
    engine = _assert_matches_jacobian(model, (1, 6, 6))
    assert {p.name: p.kind for p in engine._probed} == {
        "conv": "conv", "bn2": "batchnorm", "bn3": "batchnorm", "bn1": "batchnorm"
    }
    assert not engine._fallback and not vjps


def test_batch_norm_gradients_by_hand() -> None:
    # Σ_pos δ·x̂ and Σ_pos δ, against autograd of the module itself, example by example
    torch.manual_seed(4)
    bn = _randomised(nn.BatchNorm2d(3))
    layer = ProbedLayer("bn", bn, "batchnorm", True, True, (3, 2, 5), (3, 2, 5))
    x = torch.randn(4, 3, 2, 5, dtype=torch.float64)
    g = torch.randn(4, 2, 3, 2, 5, dtype=torch.float64)
    got = torch.cat(explicit_gradients(layer, x, g), dim=2)
    for i in range(4):
        for c in range(2):
            gw, gb = torch.autograd.grad(bn(x[i : i + 1]), (bn.weight, bn.bias), g[i, c].unsqueeze(0))
            assert torch.allclose(got[i, c], torch.cat([gw, gb]), rtol=1e-13, atol=1e-15)


def test_batch_norm_without_running_statistics_is_left_to_torch_func() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, track_running_stats=False), nn.Flatten(),
                          nn.Linear(8, 3)).double().eval()
    engine = JacobianGram(model, method="batched")
    engine.factor_elements(torch.randn(2, 1, 4, 4, dtype=torch.float64))
    assert [p.kind for p in engine._probed] == ["conv"]
    assert [n for n, _ in engine._fallback] == ["1.weight", "1.bias"]


def _peak_script(chunk_mb: float, method: str = "batched", cpu_pass_mb: float | None = None) -> str:
    return textwrap.dedent(
        f"""
        import torch
        from art_malleability.models import SmallCNN
        from art_malleability.ntk import _memory
        from art_malleability.ntk.empirical import JacobianGram

        _memory.CPU_PASS_MB = {cpu_pass_mb or _memory.CPU_PASS_MB}

        def rss(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

        torch.set_num_threads(1)
        model = SmallCNN((1, 28, 28), 10).double().eval()
        x = torch.rand(96, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        engine = JacobianGram(model, method="{method}", batch_size=1024, chunk_mb={chunk_mb})
        engine.gram(x[:4])  # warm up the allocator and torch's lazy state
        rows = []
        inner = engine._sub_batch_features
        engine._sub_batch_features = lambda xb, yb: rows.append(len(xb)) or inner(xb, yb)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident size
        base = rss("VmRSS:")
        engine.gram(x)
        print(max(rows), rss("VmHWM:") - base)
        """
    )


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
def test_a_small_budget_forces_smaller_sub_batches_and_bounds_the_peak() -> None:
    # the batched pass holds C-fold output gradients of every convolution and batch norm: the sizing counts them,
    # so the peak stays within the engine's chunks (one raw sub-batch, two of kept factors, one block) and the result
    small_rows, small_peak = _rows_and_peak(16.0)
    large_rows, large_peak = _rows_and_peak(2048.0, cpu_pass_mb=2048.0)  # the CPU's pass cap lifted
    assert large_rows == 96 and small_rows < 8  # about 6.5 MB per example in one pass
    result = 96 * 96 * 8
    assert small_peak <= 4 * 16 * 2**20 + result, small_peak / 2**20
    assert large_peak > 4 * 16 * 2**20 + result  # the bound is not met by accident: unbounded, the pass needs more


def _rows_and_peak(chunk_mb: float, method: str = "batched", cpu_pass_mb: float | None = None) -> tuple[int, int]:
    """The largest sub-batch and the peak resident growth of one kernel of 96 SmallCNN examples, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    script = _peak_script(chunk_mb, method, cpu_pass_mb)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    rows, peak = (int(v) for v in out.stdout.split())
    return rows, peak


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
def test_a_cpu_pass_holds_at_most_its_cap_whatever_the_budget() -> None:
    # a larger pass is no faster on the CPU: with a 2 GiB chunk the structured pass still sizes its sub-batches to
    # CPU_PASS_MB, counting the forward's intermediates and the cotangents C times over (about 2.9 MB an example)
    rows, peak = _rows_and_peak(2048.0, "structured")
    assert rows == int(_memory.CPU_PASS_MB * 2**20 / 2.95e6)
    assert peak <= 2 * _memory.CPU_PASS_MB * 2**20 + 96 * 96 * 8, peak / 2**20
    assert _memory.pass_chunk_mb(torch.device("cpu"), 2048.0) == _memory.CPU_PASS_MB
    assert _memory.pass_chunk_mb(torch.device("cpu"), 16.0) == 16.0
    assert _memory.pass_chunk_mb(torch.device("cuda"), 2048.0) == 2048.0


def test_device_budget_from_free_cuda_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    free, reserved, allocated = 40 * 2**30, 6 * 2**30, 2 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    cuda = torch.device("cuda")
    share = _memory.DEVICE_CHUNK_SHARE * (free + reserved - allocated) / 2**20
    assert _memory.device_chunk_mb(cuda, 256.0) == pytest.approx(share)
    assert _memory.device_chunk_mb(cuda, 1e9) == 1e9  # a larger budget of the caller's stands
    assert _memory.device_chunk_mb(torch.device("cpu"), 256.0) == 256.0  # the CPU: the caller's budget


def test_sub_batches_reach_the_batch_size_where_the_budget_allows() -> None:
    model = _randomised(NormZoo(10))
    x = torch.randn(40, 1, 6, 6, generator=_gen(5), dtype=torch.float64)
    engine = JacobianGram(model, method="batched", batch_size=1024, chunk_mb=256.0)
    engine.factor_elements(x)
    per_example = engine._example_size(raw=True) * 8
    assert engine._sub_batch_rows() == 1024  # small factors: the batch size binds
    engine = JacobianGram(model, method="batched", batch_size=1024, chunk_mb=10.5 * per_example / 2**20)
    engine.factor_elements(x)
    assert engine._sub_batch_rows() == 10
    assert _rel(engine.gram(x), empirical_ntk(model, x, method="jacobian")) < 1e-10



class ChangesInputsInPlace(nn.Module):
    """Changes a convolution's input in place after the convolution used it (autograd of its weight would refuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv2d(1, 2, 3), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        a = self.conv(h)
        h.mul_(3.0)
        return self.out(a.flatten(1))


def test_an_input_changed_in_place_is_detected_and_copied() -> None:
    model = ChangesInputsInPlace().double()
    x = torch.randn(3, 1, 4, 4, generator=_gen(6), dtype=torch.float64)
    args = (model, [model.conv], [True], [(2, 2, 2)], [], x, None, lambda out, y: out)
    with pytest.raises(_autograd.InputChanged):
        _autograd.probed_jacobians(*args)
    acts, grads, _ = _autograd.probed_jacobians(*args, clone_inputs=True)
    assert torch.equal(acts[0], x) and grads[0].shape == (3, 3, 2, 2, 2)
    engine = JacobianGram(model, method="batched")
    engine.gram(x)
    assert engine._clone_inputs  # the engine switched to copies
