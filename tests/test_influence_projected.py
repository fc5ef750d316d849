"""Projected NTK influence: exact with a full projection, unbiased features, primal leave-one-out, updates, data."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from art_malleability.influence import NTKInfluence
from art_malleability.linalg.ridge import DualRidge, PrimalRidge
from art_malleability.ntk.empirical import empirical_ntk
from art_malleability.ntk.projection import ProjectedNTK, allocate, kronecker_split


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


class _Scaled(nn.Module):
    """A free-standing trainable parameter used in the parent's forward (fallback group)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = nn.Parameter(torch.tensor([1.3, 0.7, 1.1]))

    def forward(self, x):
        return self.inner(x) * self.scale


def _cnn(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 4, 2, stride=2, dilation=1, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
    )
    with torch.no_grad():
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 2.0)
        net[1].weight.uniform_(0.5, 1.5)
    return _Scaled(net).eval()


class _Tokens(nn.Module):
    """A linear layer on 3-D inputs (positions summed) and a frozen weight with a trainable bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Linear(3, 4)
        self.mix = nn.Linear(4, 4)
        self.mix.weight.requires_grad_(False)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.mix(torch.tanh(self.embed(x.reshape(x.shape[0], 2, 3)))))
        return self.head(h.mean(dim=1))


def _mlp(d=4, m=6, c=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, m), nn.ReLU(), nn.Linear(m, c))


def _images(n, seed=0, c=3):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2, 6, 6)).astype(np.float32), rng.integers(0, c, n)


@pytest.mark.parametrize("model_fn,shape", [(_cnn, (2, 6, 6)), (_Tokens, (6,)), (_mlp, (4,))])
def test_full_projection_reproduces_the_kernel(model_fn, shape):
    model = model_fn().double()
    x = torch.tensor(np.random.default_rng(2).normal(size=(9, *shape)))
    projector = ProjectedNTK(model, 10**8).plan(x)
    assert projector.is_exact
    assert projector.full_dim == 3 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    kinds = {g["kind"] for g in projector.describe()}
    if model_fn is _cnn:
        assert kinds == {"conv", "linear", "batchnorm", "fallback"}  # the free scale: fallback
    phi = projector.features(x)
    kernel = empirical_ntk(model, x, method="jacobian")
    assert _rel((phi @ phi.T).numpy(), kernel.numpy()) < 1e-12


def test_projected_inner_products_are_unbiased():
    """Monte Carlo over projection seeds: the mean of ΦΦᵀ is K within 5 standard errors, entry by entry."""
    model = _cnn().double()
    x = torch.tensor(_images(6)[0], dtype=torch.float64)
    kernel = empirical_ntk(model, x, method="jacobian").numpy()
    draws = []
    for seed in range(300):
        phi = ProjectedNTK(model, 48, seed=seed).plan(x).features(x)
        draws.append((phi @ phi.T).numpy())
    draws = np.array(draws)
    mean, se = draws.mean(0), draws.std(0, ddof=1) / np.sqrt(len(draws))
    z = np.abs(mean - kernel) / se
    assert z.max() < 5.0, z.max()
    # and the projection is not trivially exact: single draws do differ from K
    assert np.abs(draws[0] - kernel).max() > 1e-3 * np.abs(kernel).max()


def test_projection_is_seeded():
    model = _cnn().double()
    x = _images(5)[0]
    a = ProjectedNTK(model, 40, seed=3).plan(x).features(x)
    b = ProjectedNTK(model, 40, seed=3).plan(x).features(x)
    c = ProjectedNTK(model, 40, seed=4).plan(x).features(x)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_allocation_and_split():
    assert allocate([1.0, 1.0], [10, 10], 8) == [4, 4]
    assert allocate([9.0, 1.0], [5, 100], 20) == [5, 15]  # capped group gives its excess to the others
    assert allocate([0.0, 1.0], [10, 10], 6) == [1, 5]  # never below one
    assert sum(allocate([3.0, 2.0, 1.0], [1000] * 3, 100)) == 100
    k_out, k_in = kronecker_split(100, 50, 40)
    assert k_out * k_in <= 100 and k_in == 10
    assert kronecker_split(10**6, 50, 40) == (50, 40)
    assert kronecker_split(30, 1000, 3) == (10, 3)


@pytest.mark.parametrize("n", [12, 80])  # dual (n <= full dim) and primal (n > full dim)
def test_full_projection_scores_equal_exact_scores(n):
    model = _mlp(d=4, m=3, c=2)  # 23 parameters, 2 outputs: full dimension 46
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 2, n)
    xq, yq = rng.normal(size=(7, 4)).astype(np.float32), rng.integers(0, 2, 7)
    exact = NTKInfluence(projection_dim=None, ridge=1e-2, device="cpu").fit(model, x, y)
    full = NTKInfluence(projection_dim=10**6, ridge=1e-2, device="cpu").fit(model, x, y)
    assert exact.mode_ == "exact" and full.mode_ == "projected" and full.projection_dim_ == 46
    assert isinstance(full.solver_, DualRidge if n <= 46 else PrimalRidge)
    assert _rel(full.scores(xq, yq), exact.scores(xq, yq)) < 1e-8


def test_primal_scores_equal_an_explicit_leave_one_out_resolve():
    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.integers(0, 3, 60)
    xq, yq = rng.normal(size=(4, 4)).astype(np.float32), rng.integers(0, 3, 4)
    est = NTKInfluence(projection_dim=20, ridge=0.05, device="cpu").fit(model, x, y)
    assert isinstance(est.solver_, PrimalRidge)
    phi = est.solver_.features_.numpy()
    phi_q = est._backend.features(xq).numpy()
    targets = np.eye(3)[y]
    k = phi.shape[1]
    w = np.linalg.solve(phi.T @ phi + 0.05 * np.eye(k), phi.T @ targets)
    base = 0.5 * ((phi_q @ w - np.eye(3)[yq]) ** 2).sum(1)
    expected = np.empty((4, 60))
    for i in range(60):
        keep = np.arange(60) != i
        wi = np.linalg.solve(phi[keep].T @ phi[keep] + 0.05 * np.eye(k), phi[keep].T @ targets[keep])
        expected[:, i] = 0.5 * ((phi_q @ wi - np.eye(3)[yq]) ** 2).sum(1) - base
    assert _rel(est.scores(xq, yq), expected) < 1e-9


@pytest.mark.parametrize("projection_dim", [None, 20, 500])  # exact, primal, dual
def test_refit_equals_a_fit_from_scratch(projection_dim):
    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(50, 4)).astype(np.float32), rng.integers(0, 3, 50)
    xq, yq = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, 5)
    est = NTKInfluence(projection_dim=projection_dim, ridge=0.05, device="cpu").fit(model, x, y)
    est.scores(xq, yq)
    # the same rows changed again with new values (what is kept of the queries between updates is reused), others
    for changed in ([3, 7, 40], [3, 7, 40], [7, 11], [7, 11], [], [7, 11]):
        changed = np.array(changed, dtype=int)
        x_new = x.copy()
        x_new[changed] = rng.normal(size=(len(changed), 4)).astype(np.float32)
        est.refit(changed[::-1], x_new[changed][::-1])  # any order
        fresh = NTKInfluence(projection_dim=projection_dim, ridge=0.05, device="cpu").fit(model, x_new, y)
        assert _rel(est.scores(xq, yq), fresh.scores(xq, yq)) < 1e-8


def test_refit_checks_its_arguments():
    model = _mlp()
    x, y = np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32), np.arange(10) % 3
    est = NTKInfluence(device="cpu")
    with pytest.raises(RuntimeError, match="before fit"):
        est.refit([1], x[:1])
    est.fit(model, x, y)
    with pytest.raises(ValueError, match="distinct indices"):
        est.refit([1, 1], x[:2])
    with pytest.raises(ValueError, match="distinct indices"):
        est.refit([10], x[:1])
    with pytest.raises(ValueError, match="x_changed must have shape"):
        est.refit([1, 2], x[:1])


@pytest.mark.parametrize("bad", [0, -3, 2**40, 1.5, "big", True])
def test_bad_projection_dim_is_refused(bad):
    with pytest.raises(ValueError, match="projection_dim"):
        NTKInfluence(projection_dim=bad)


def test_allocations_that_cannot_fit_stop_before_the_work():
    model = _mlp()
    x, y = np.random.default_rng(0).normal(size=(200, 4)).astype(np.float32), np.arange(200) % 3
    with pytest.raises(ValueError, match="projection_dim must be 'auto' or an integer on 200 training examples"):
        NTKInfluence(projection_dim=None, memory_limit_gb=1e-6, device="cpu").fit(model, x, y)
    with pytest.raises(ValueError, match="lower projection_dim"):
        NTKInfluence(projection_dim=40, memory_limit_gb=1e-6, device="cpu").fit(model, x, y)


def test_auto_mode_rule(monkeypatch):
    import art_malleability.influence._ntk_mode as mode_rule

    model = _mlp()
    x, y = np.random.default_rng(0).normal(size=(30, 4)).astype(np.float32), np.arange(30) % 3
    assert NTKInfluence(device="cpu").fit(model, x, y).mode_ == "exact"
    est = NTKInfluence(max_exact_n=20, device="cpu").fit(model, x, y)
    assert est.mode_ == "projected" and est.projection_dim_ == 3 * 51  # capped at the full dimension
    # the budget decides too: no room for the exact mode's solve in any form -> projected
    monkeypatch.setattr(mode_rule, "exact_plan", lambda *args, **kwargs: None)
    est = NTKInfluence(device="cpu").fit(model, x, y)
    assert est.mode_ == "projected" and "does not fit" in est.mode_reason_


def test_dataset_and_dataloader_give_the_array_scores():
    model = _cnn()
    x, y = _images(40, seed=5)
    xq, yq = _images(4, seed=6)
    ref = NTKInfluence(projection_dim=64, device="cpu").fit(model, x, y).scores(xq, yq)
    ds = TensorDataset(torch.tensor(x), torch.tensor(y))
    for data in (ds, DataLoader(ds, batch_size=7, shuffle=True)):
        est = NTKInfluence(projection_dim=64, device="cpu", batch_size=16).fit(model, data)
        assert _rel(est.scores(xq, yq), ref) < 1e-12
    one_hot = TensorDataset(torch.tensor(x), torch.eye(3)[torch.tensor(y)])
    assert _rel(NTKInfluence(projection_dim=64, device="cpu").fit(model, one_hot).scores(xq, yq), ref) < 1e-12
    exact = NTKInfluence(projection_dim=None, device="cpu").fit(model, ds).scores(xq, yq)
    assert _rel(exact, NTKInfluence(projection_dim=None, device="cpu").fit(model, x, y).scores(xq, yq)) < 1e-12


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2, 6, 6), 0


class _Ragged(torch.utils.data.Dataset):
    """Example 7 has another shape."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.zeros(2, 5, 5) if i == 7 else torch.zeros(2, 6, 6), i % 3


def test_bad_datasets_are_refused_with_clear_errors():
    model = _cnn()
    x, y = _images(10)
    est = NTKInfluence(projection_dim=32, device="cpu", batch_size=4)
    with pytest.raises(ValueError, match=r"x_train must yield batches .*examples 4\.\.7"):
        est.fit(model, _Ragged())
    with pytest.raises(ValueError, match="class indices in"):
        est.fit(model, TensorDataset(torch.tensor(x), torch.full((10,), 7)))
    with pytest.raises(ValueError, match="y_train must be None"):
        est.fit(model, TensorDataset(torch.tensor(x), torch.tensor(y)), y)
    with pytest.raises(TypeError, match="map-style"):
        est.fit(model, _Stream())
    with pytest.raises(ValueError, match="NaN"):
        bad = torch.tensor(x)
        bad[3, 0, 0, 0] = float("nan")
        est.fit(model, TensorDataset(bad, torch.tensor(y)))


def test_exact_engine_takes_convolutions_and_batch_norm_from_their_factors():
    from art_malleability.ntk.empirical import JacobianGram

    model = _cnn().double()
    x = torch.tensor(_images(8)[0], dtype=torch.float64)
    engine = JacobianGram(model)
    kernel = engine.gram(x)
    plan = engine._layer_plan
    assert {s.kind for s in plan.sites} == {"conv", "batchnorm", "linear"} and plan.fallback
    assert _rel(kernel.numpy(), empirical_ntk(model, x, method="jacobian").numpy()) < 1e-12
    # the full output block still comes from torch.func for those parameters
    full = empirical_ntk(model, x, trace=False)
    assert _rel(full.numpy(), empirical_ntk(model, x, method="jacobian", trace=False).numpy()) < 1e-12


def test_auto_mode_weighs_the_exact_cost_and_says_why_it_projects(caplog):
    model = _cnn()
    x, y = _images(30)
    exact = NTKInfluence(device="cpu").fit(model, x, y)
    assert exact.mode_ == "exact" and exact.auto_note_ is None
    with caplog.at_level("WARNING", logger="art_malleability.influence.ntk"):
        projected = NTKInfluence(device="cpu", exact_budget_s=0).fit(model, x, y)
    # over the budget, and the projected mode estimated shorter (counted facts: the same every run)
    assert projected.estimated_seconds_["projected"] < projected.estimated_seconds_["exact"]
    assert projected.mode_ == "projected"
    assert "over exact_budget_s=0 s" in projected.auto_note_ and "projection_dim=None: about" in projected.auto_note_
    assert "influence='gradient'" in projected.auto_note_ and projected.auto_note_ in caplog.text
    assert "max_exact_n=20" in NTKInfluence(device="cpu", max_exact_n=20).fit(model, x, y).auto_note_
    assert NTKInfluence(projection_dim=None, device="cpu", exact_budget_s=0).fit(model, x, y).mode_ == "exact"
    with pytest.raises(ValueError, match="exact_budget_s must be a non-negative number"):
        NTKInfluence(exact_budget_s=-1.0)


def test_the_time_estimates_grow_as_their_operation_counts():
    from art_malleability.influence.ntk_memory import exact_seconds, gemm_rate, projected_seconds

    rate = gemm_rate(torch.device("cpu"))
    assert rate > 1e8  # at least 0.1 GFLOP/s on any machine
    assert exact_seconds(2000, 100, rate) == pytest.approx(8 * exact_seconds(1000, 100, rate), rel=0.5)
    assert exact_seconds(1000, 100, rate, world=4) == pytest.approx(exact_seconds(1000, 100, rate) / 4)
    assert projected_seconds(10_000, 100, 512, rate) < exact_seconds(10_000, 100, rate)


def test_the_exact_estimate_counts_the_factors_the_kernel_computes(monkeypatch):
    from art_malleability._utils import cache
    from art_malleability.influence.ntk_memory import (
        CONTRACTION_EFFICIENCY,
        SOLVE_EFFICIENCY,
        exact_seconds,
        factor_passes,
    )

    assert factor_passes(100, 100) == factor_passes(100, 500) == 100  # all kept: each example once
    assert factor_passes(100, 10) == sum(100 - 10 * k for k in range(10))  # a panel, then the rows after it
    assert factor_passes(100, 50, block=25) == 8 * (25 + 25)  # half of the 4 x 4 tile pairs: rows, then columns
    assert factor_passes(100, 10, block=25) == 8 * (25 + 25 * 3)  # columns once per panel of 10 rows
    rate, n, d = 1e10, 1000, 100
    m = n // 10 + 1
    # the contraction and the solve alone: the fit's two factorisations and one refit's Schur complement
    free = exact_seconds(n, d, rate, example_seconds=0.0, panel=n)
    assert free == pytest.approx(2.0 * (n + m) * n * d / CONTRACTION_EFFICIENCY / rate
                                 + (4.0 * n**3 / 3.0 + 2.0 * (n - m) ** 2 * m) / SOLVE_EFFICIENCY / rate)
    # the fit's n, the refit's m and one more pass over the set, at one millisecond each
    assert exact_seconds(n, d, rate, example_seconds=1e-3, panel=n) == pytest.approx(free + (n + m + n) * 1e-3)
    assert exact_seconds(n, d, rate, example_seconds=1e-3, panel=100) > exact_seconds(
        n, d, rate, example_seconds=1e-3, panel=n)
    assert exact_seconds(n, d, rate, world=2, example_seconds=1e-3, panel=n) == pytest.approx(
        exact_seconds(n, d, rate, example_seconds=1e-3, panel=n) / 2)
    # an audit's work: 8 refits, and 50 queries after the fit and each refit (their kernel rows, factors and solves)
    audit = exact_seconds(n, d, rate, example_seconds=1e-3, panel=n, refits=8, queries=50)
    expected = (2.0 * (n + 8 * m + 9 * 50) * n * d / CONTRACTION_EFFICIENCY / rate
                + (4.0 * n**3 / 3.0 + 8 * 2.0 * (n - m) ** 2 * m + 2 * 4.0 * n * n * 50 + 7 * 4.0 * n * 50 * m)
                / SOLVE_EFFICIENCY / rate
                + (n + 8 * (m + n) + 9 * (50 + n)) * 1e-3)
    assert audit == pytest.approx(expected)
    # with the set's factors kept, only the changed rows' factors are computed again, and the queries' rows on the
    # set as given and their factors are kept: the refits contract them with the changed rows only
    kept = exact_seconds(n, d, rate, example_seconds=1e-3, panel=n, refits=8, queries=50, kept=True,
                         query_bytes=8 * d)
    assert kept == pytest.approx(expected - (8 * n + 9 * n + 8 * 50) * 1e-3
                                 - 2.0 * 8 * 50 * (n - m) * d / CONTRACTION_EFFICIENCY / rate)
    # queries whose solves, rows and factors do not all fit the caches: the share beyond them is computed again
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 8 * 50 * n // 4)
    partly = exact_seconds(n, d, rate, example_seconds=1e-3, panel=n, refits=8, queries=50, kept=True,
                           query_bytes=8 * n)
    assert partly > kept
    solved, rows = 0.25 * n / (n - m), 0.25
    assert partly - kept == pytest.approx(
        7 * 4.0 * n * 50 * (1 - solved) * n / SOLVE_EFFICIENCY / rate
        + 2.0 * 8 * 50 * n * (1 - rows) * d / CONTRACTION_EFFICIENCY / rate + 8 * 50 * (1 - 0.25) * 1e-3)


def test_projection_matrices_that_cannot_fit_are_refused_before_they_are_drawn():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(300, 400), nn.ReLU(), nn.Linear(400, 10))
    x = np.random.default_rng(0).normal(size=(20, 300)).astype(np.float32)
    with pytest.raises(ValueError, match="GiB of projection matrices"):
        ProjectedNTK(wide.double(), 10**6, max_bytes=2**20).plan(x)  # 4000 x 3322 output side
    with pytest.raises(ValueError, match="lower projection_dim"):
        NTKInfluence(projection_dim=10**6, memory_limit_gb=0.002, device="cpu").fit(wide, x, np.arange(20) % 10)


def test_refit_refuses_bad_inputs_and_transductive_models_and_keeps_its_state():
    from art_malleability.models import MLPAttn

    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(50, 4)).astype(np.float32), rng.integers(0, 3, 50)
    xq, yq = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, 5)
    for projection_dim in (None, 20, 500):
        est = NTKInfluence(projection_dim=projection_dim, ridge=0.05, device="cpu").fit(model, x, y)
        reference = est.scores(xq, yq)
        bad = x[:2].copy()
        bad[0, 1] = np.nan
        with pytest.raises(ValueError, match="x_changed must hold finite"):
            est.refit([0, 1], bad)
        assert np.array_equal(est.scores(xq, yq), reference)
    attn = MLPAttn(4, width=8, nb_classes=3, seed=0)
    attn.set_context(x)
    est = NTKInfluence(projection_dim=20, device="cpu").fit(attn, x, y)
    with pytest.raises(ValueError, match="transductive"):
        est.refit([0], x[:1])


def test_exact_refit_without_kept_factors_equals_a_fresh_fit():
    model = _cnn()
    x, y = _images(30, seed=9)
    xq, yq = _images(4, seed=10)
    est = NTKInfluence(projection_dim=None, device="cpu").fit(model, x, y)
    assert est._backend.kept is not None
    est._backend.kept = None  # as when the training set's factors do not fit the memory
    changed = np.array([4, 17])
    x_new = x.copy()
    x_new[changed] += 0.3
    est.refit(changed, x_new[changed])
    fresh = NTKInfluence(projection_dim=None, device="cpu").fit(model, x_new, y)
    assert _rel(est.scores(xq, yq), fresh.scores(xq, yq)) < 1e-8


def test_warm_start_keeps_the_projection_of_a_refitted_transductive_model():
    from art_malleability.models import MLPAttnQKV

    rng = np.random.default_rng(4)
    x, y = rng.random((40, 6)).astype(np.float32), rng.integers(0, 3, 40)
    model = MLPAttnQKV(6, width=16, nb_classes=3, seed=0)
    model.set_context(x)
    est = NTKInfluence(projection_dim=64, device="cpu").fit(model, x, y)
    dims = [(g["dim_out"], g["dim_in"]) for g in est.projector_.describe()]
    x_adv = np.clip(x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), 0, 1)
    model.set_context(x_adv)
    refitted = est.fit(model, x_adv, y, warm_start=True)
    assert [(g["dim_out"], g["dim_in"]) for g in refitted.projector_.describe()] == dims
    fresh = NTKInfluence(projection_dim=64, device="cpu").fit(model, x_adv, y)
    assert fresh.projector_.signature == est.projector_.signature  # same layers, seed and budget


def test_the_projected_features_of_blocks_of_queries_are_kept_between_refits(monkeypatch):
    """An audit scores the same blocks of queries after every refit: each block is projected once."""
    from art_malleability._utils import cache

    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.integers(0, 3, 60)
    xq, yq = rng.normal(size=(9, 4)).astype(np.float32), rng.integers(0, 3, 9)
    est = NTKInfluence(projection_dim=20, ridge=0.05, device="cpu").fit(model, x, y)
    calls = []
    project = est._backend.features
    monkeypatch.setattr(est._backend, "features", lambda rows: calls.append(len(rows)) or project(rows))
    whole = est.scores(xq, yq)
    blocks = [est.scores(xq[s : s + 4], yq[s : s + 4]) for s in range(0, 9, 4)]
    np.testing.assert_allclose(np.concatenate(blocks), whole, rtol=1e-9, atol=1e-15)
    est.refit(np.array([3, 5]), rng.normal(size=(2, 4)).astype(np.float32))
    for s in range(0, 9, 4):
        est.scores(xq[s : s + 4], yq[s : s + 4])
    assert calls == [9, 4, 4, 1, 2]  # the whole set, each block once; after the refit only its own 2 rows
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 1)  # nothing fits: every call projects again
    est._backend._query_features = None
    est.scores(xq[:4], yq[:4])
    est.scores(xq[:4], yq[:4])
    assert calls[-2:] == [4, 4]


def test_the_exact_modes_query_factors_of_blocks_are_kept_between_refits():
    """After a refit the exact mode contracts kept factors: each block of queries has its factors computed once."""
    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)
    xq, yq = rng.normal(size=(9, 4)).astype(np.float32), rng.integers(0, 3, 9)
    est = NTKInfluence(projection_dim=None, ridge=0.05, device="cpu").fit(model, x, y)
    est.refit(np.array([1, 2]), rng.normal(size=(2, 4)).astype(np.float32))
    kept = est._backend.kept
    calls = []
    features = kept.engine.features
    kept.engine.features = lambda rows: calls.append(len(rows)) or features(rows)
    first = [est.scores(xq[s : s + 4], yq[s : s + 4]) for s in range(0, 9, 4)]
    after_first = est.x_train_.copy()
    est.refit(np.array([5]), rng.normal(size=(1, 4)).astype(np.float32))
    second = [est.scores(xq[s : s + 4], yq[s : s + 4]) for s in range(0, 9, 4)]
    fresh = NTKInfluence(projection_dim=None, ridge=0.05, device="cpu").fit(model, est.x_train_, y)
    assert calls == [4, 4, 1, 1]  # each block of queries once; then the second refit's own changed row
    assert _rel(np.concatenate(second), fresh.scores(xq, yq)) < 1e-8
    # the first refit's scores too (the blocks' lengths had been checked here: those of a literal range)
    fresh_first = NTKInfluence(projection_dim=None, ridge=0.05, device="cpu").fit(model, after_first, y)
    assert _rel(np.concatenate(first), fresh_first.scores(xq, yq)) < 1e-8


def test_the_first_query_factors_stay_when_not_all_fit(monkeypatch):
    """Blocks asked for in the same order after every refit: the first ones that fit are hits in every later pass
    (evicting the oldest would miss on every block), and the answers equal a fresh fit's."""
    from art_malleability._utils import cache

    model = _mlp(d=4, m=8, c=3)
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)
    xq, yq = rng.normal(size=(12, 4)).astype(np.float32), rng.integers(0, 3, 12)
    est = NTKInfluence(projection_dim=None, ridge=0.05, device="cpu").fit(model, x, y)
    kept = est._backend.kept
    monkeypatch.setattr(kept.engine, "_block_rows", lambda: 4)
    est.refit(np.array([0]), x[:1] + 1)
    est.scores(xq, yq)
    assert len(kept._last._items) == 3
    monkeypatch.setattr(cache, "QUERY_CACHE_BYTES", 2 * kept._last.nbytes // 3)  # two of the three blocks fit
    kept.query_bytes = cache.QUERY_CACHE_BYTES
    kept._build()
    calls = []
    features = kept.engine.features
    monkeypatch.setattr(kept.engine, "features", lambda rows: calls.append(len(rows)) or features(rows))
    for i, changed in enumerate(([1, 2], [1, 2], [7])):
        changed = np.array(changed)
        x_new = x.copy()
        x_new[changed] = rng.normal(size=(len(changed), 4)).astype(np.float32)
        est.refit(changed, x_new[changed])
        del calls[:]
        scores = est.scores(xq, yq)
        assert calls == ([4, 4, 4] if i == 0 else [4])  # every block in the first pass, then the third only
        fresh = NTKInfluence(projection_dim=None, ridge=0.05, device="cpu").fit(model, x_new, y)
        assert _rel(scores, fresh.scores(xq, yq)) < 1e-8
    cache_unit = cache.BoundedCache(10, len)
    for _ in range(2):
        assert [cache_unit.get(k, lambda k=k: "x" * k) for k in (6, 3, 5)] == ["x" * 6, "x" * 3, "x" * 5]
    assert cache_unit.nbytes == 9 and set(cache_unit._items) == {6, 3}


def test_the_projections_cost_is_counted_without_drawing_its_matrices(monkeypatch):
    import art_malleability.ntk.projection as projection
    from art_malleability.ntk._sketch import FALLBACK_BLOCK

    model, (x, _) = _cnn(), _images(8)
    drawn = []

    def gaussian(k, start, stop, *args):
        drawn.append(k * FALLBACK_BLOCK * ((stop - 1) // FALLBACK_BLOCK - start // FALLBACK_BLOCK + 1))
        return gaussian_block(k, start, stop, *args)

    def orthogonal(dim, k, *args):
        drawn.append(dim * k if k < dim else 0)
        return orthogonal_projection(dim, k, *args)

    gaussian_block, orthogonal_projection = projection.gaussian_block, projection.orthogonal_projection
    monkeypatch.setattr(projection, "gaussian_block", gaussian)
    monkeypatch.setattr(projection, "orthogonal_projection", orthogonal)
    counted = ProjectedNTK(model, 40, chunk_mb=1e-4, probe_size=8)  # tiny chunks: the dense groups drawn in passes
    counted._counting = True
    counted.plan(x)
    assert not drawn and counted._drawn > 0  # shapes only, and the numbers counted
    # the same shapes drawn for real (its budgets taken from the counted one) cost what the counted plan said,
    # pilot aside; a pass draws what the counted pass counted
    real = ProjectedNTK(model, 40, chunk_mb=1e-4, probe_size=8, like=counted).plan(x)
    assert [(g.k_out, g.k_in) for g in real.groups] == [(g.k_out, g.k_in) for g in counted.groups]
    planned = sum(drawn)
    pilot = ProjectedNTK(model, 40, chunk_mb=1e-4, probe_size=8)
    pilot._counting = True
    for i, g in enumerate(pilot._find_groups(torch.as_tensor(x[:2]))):
        pilot._draw(g, i, projection._PILOT_SIDE**2, pilot=True)
    assert counted._drawn == pytest.approx(planned + pilot._drawn)
    drawn.clear()
    counted._drawn = 0.0
    counted.features(x[:3])
    real.features(x[:3])
    assert sum(drawn) == counted._drawn > 0
    plan_s, example_s = projection.projected_costs(model, x, 40)
    assert 0 < plan_s < 10 and 0 < example_s < 1
