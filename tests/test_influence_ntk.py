"""NTK influence: closed-form leave-one-out against explicit re-solves; sign convention; API."""

import copy

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from torch import nn

from art_malleability.influence import (
    INFLUENCE_NAMES,
    CaptumInfluence,
    GradientInfluence,
    InfluenceEstimator,
    NTKInfluence,
    get_influence,
)
from art_malleability.ntk.empirical import empirical_ntk


def _mlp(d: int = 4, m: int = 16, c: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, m), nn.ReLU(), nn.Linear(m, c))


def _data(n: int = 30, n_query: int = 7, d: int = 4, c: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, c, n)
    xq = rng.normal(size=(n_query, d)).astype(np.float32)
    yq = rng.integers(0, c, n_query)
    return x, y, xq, yq


def _loss_np(f: np.ndarray, y: np.ndarray, loss: str) -> np.ndarray:
    """Per-example loss written independently in numpy; f (..., C), y broadcast to f[..., 0]."""
    y = np.broadcast_to(y, f.shape[:-1])
    if loss == "cross_entropy":
        return logsumexp(f, axis=-1) - np.take_along_axis(f, y[..., None], axis=-1)[..., 0]
    onehot = np.eye(f.shape[-1])[y]
    return 0.5 * ((f - onehot) ** 2).sum(-1)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_matches_explicit_leave_one_out(loss: str) -> None:
    model = _mlp()
    x, y, xq, yq = _data()
    ridge = 1e-2
    est = NTKInfluence(ridge=ridge, loss=loss, device="cpu").fit(model, x, y)
    scores = est.scores(xq, yq)
    assert scores.shape == (7, 30) and scores.dtype == np.float64

    # independent oracle: torch.func kernel, explicit re-solve without each training example
    ref = copy.deepcopy(model).double()
    k = empirical_ntk(ref, x, method="jacobian").numpy()
    k_q = empirical_ntk(ref, xq, x, method="jacobian").numpy()
    assert _rel(est.kernel_.numpy(), k) < 1e-10
    targets = np.eye(3)[y]
    alpha = np.linalg.solve(k + ridge * np.eye(30), targets)
    assert _rel(est.alpha_.numpy(), alpha) < 1e-8
    f = k_q @ alpha
    assert _rel(est.predict(xq), f) < 1e-8

    loo = np.empty((7, 30, 3))
    for i in range(30):
        keep = np.arange(30) != i
        alpha_i = np.linalg.solve(k[np.ix_(keep, keep)] + ridge * np.eye(29), targets[keep])
        loo[:, i] = k_q[:, keep] @ alpha_i
    assert _rel(est.loo_predictions(xq), loo) < 1e-8
    expected = _loss_np(loo, yq[:, None], loss) - _loss_np(f, yq, loss)[:, None]
    assert _rel(scores, expected) < 1e-8
    # chunking over queries gives the same numbers (cross-entropy's path chunks; the mse one is a closed form with no
    # (queries x n x C) block, so there is nothing to chunk: the check had returned the same numbers without a loop)
    import art_malleability.influence.ridge as ntk_module

    calls = []
    losses = ntk_module.per_example_loss
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ntk_module, "_CHUNK_ELEMENTS", 30 * 3 * 2)  # two queries per chunk
        patch.setattr(ntk_module, "per_example_loss", lambda *a: calls.append(1) or losses(*a))
        assert np.allclose(est.scores(xq, yq), scores, rtol=1e-12, atol=0)
    assert len(calls) == (0 if loss == "mse" else 1 + 4)  # the base losses, then 7 queries in chunks of 2


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_sign_convention_on_duplicates(loss: str) -> None:
    """A training copy of the query with its label helps (positive, the most helpful); a copy with
    a wrong label hurts (negative, the most harmful)."""
    model = _mlp(m=32)
    x, y, _, _ = _data(n=20)
    xq, yq = x[5:6].copy(), y[5:6]
    x2 = np.concatenate([x, xq])
    y2 = np.concatenate([y, (yq + 1) % 3])
    scores = NTKInfluence(loss=loss, device="cpu").fit(model, x2, y2).scores(xq, yq)[0]
    assert scores[5] > 0 and scores.argmax() == 5
    assert scores[20] < 0 and scores.argmin() == 20


def test_one_hot_labels_and_float32_model() -> None:
    model = _mlp()
    x, y, xq, yq = _data(n=12, n_query=3)
    a = NTKInfluence(device="cpu").fit(model, x, y).scores(xq, yq)
    b = NTKInfluence(device="cpu").fit(model, x, np.eye(3)[y]).scores(xq, np.eye(3)[yq])
    assert np.array_equal(a, b)
    c = NTKInfluence(device="cpu", dtype=torch.float32).fit(model, x, y).scores(xq, yq)
    assert c.dtype == np.float64
    assert _rel(c, a) < 1e-2


def test_does_not_mutate_model_or_inputs() -> None:
    model = _mlp().train()
    model[0].weight.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    x, y, xq, yq = _data(n=10, n_query=3)
    copies = [a.copy() for a in (x, y, xq, yq)]
    rng_state = torch.get_rng_state()
    est = NTKInfluence(device="cpu").fit(model, x, y)
    est.scores(xq, yq)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.training and all(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(np.array_equal(a, b) for a, b in zip((x, y, xq, yq), copies, strict=True))
    assert torch.equal(rng_state, torch.get_rng_state())
    assert next(model.parameters()).dtype == torch.float32
    assert est.model_ is not model


def test_bad_parameters() -> None:
    for ridge in (0.0, -1e-3, float("nan"), "1e-3"):
        with pytest.raises(ValueError, match="ridge"):
            NTKInfluence(ridge=ridge)
    with pytest.raises(ValueError, match="loss"):
        NTKInfluence(loss="hinge")
    with pytest.raises(ValueError, match="batch_size"):
        NTKInfluence(batch_size=0)
    with pytest.raises(ValueError, match="method"):
        NTKInfluence(method="exact")
    with pytest.raises(TypeError, match="dtype"):
        NTKInfluence(dtype=np.float64)
    with pytest.raises(ValueError, match="device"):
        NTKInfluence(device="not-a-device")
    model = _mlp()
    x, y, xq, yq = _data(n=10, n_query=3)
    est = NTKInfluence(device="cpu")
    with pytest.raises(RuntimeError, match="fit"):
        est.scores(xq, yq)
    with pytest.raises(ValueError, match="y_train"):
        est.fit(model, x, y[:-1])
    with pytest.raises(ValueError, match="y_train"):
        est.fit(model, x, y + 3)  # class index beyond the model's outputs
    with pytest.raises(TypeError, match="model"):
        est.fit("model", x, y)
    est.fit(model, x, y)
    with pytest.raises(ValueError, match="y_query"):
        est.scores(xq, yq[:-1])
    with pytest.raises(ValueError, match="x_query"):
        est.scores(xq[:, :2], yq)


def test_get_influence() -> None:
    assert INFLUENCE_NAMES == ("ntk", "gradient", "captum")
    assert isinstance(get_influence("ntk", ridge=0.1), NTKInfluence)
    assert get_influence("ntk", ridge=0.1).ridge == 0.1
    assert isinstance(get_influence("gradient"), GradientInfluence)
    assert isinstance(get_influence("captum", loss="mse"), CaptumInfluence)
    est = NTKInfluence()
    assert get_influence(est) is est
    assert get_influence(est, ridge=5.0) is est
    assert all(isinstance(get_influence(n), InfluenceEstimator) for n in INFLUENCE_NAMES)
    for bad in ("tracin", None, 3, NTKInfluence):
        with pytest.raises(ValueError, match="influence must be one of 'ntk', 'gradient', 'captum'"):
            get_influence(bad)
    assert get_influence("ntk").name == "ntk" and "ridge" in repr(get_influence("ntk"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    model = _mlp()
    x, y, xq, yq = _data(n=40, n_query=5)
    for est_class in (NTKInfluence, GradientInfluence, CaptumInfluence):
        cpu = est_class(device="cpu").fit(model, x, y).scores(xq, yq)
        cuda = est_class(device="cuda").fit(model, x, y).scores(xq, yq)
        assert _rel(cuda, cpu) < 1e-9
    assert next(model.parameters()).device.type == "cpu"


def test_custom_estimators() -> None:
    """Subclasses implement _fit/_scores and get the checks; the base class and incomplete ones are abstract."""

    class Dot(InfluenceEstimator):
        name = "dot"

        def _fit(self, model, x_train, y_train):
            self._x = x_train.reshape(len(x_train), -1)

        def _scores(self, x_query, y_query):
            return x_query.reshape(len(x_query), -1) @ self._x.T

    model = _mlp()
    x, y, xq, yq = _data(n=6, n_query=2)
    dot = Dot(device="cpu")
    assert get_influence(dot) is dot
    assert np.allclose(dot.fit(model, x, y).scores(xq, yq), xq @ x.T)
    with pytest.raises(ValueError, match="y_query"):
        dot.scores(xq, yq[:1])
    with pytest.raises(TypeError, match="abstract"):
        InfluenceEstimator()

    class Missing(InfluenceEstimator):
        def _fit(self, model, x_train, y_train):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Missing(device="cpu")


def _engine_reserve(model, x):
    """The kernel engine's chunks as the estimator reserves them for ``len(x)`` examples (float64 factors, batches of
    256, the default chunk of a small budget)."""
    import art_malleability.influence.ntk_memory as memory
    from art_malleability.ntk.empirical import JacobianGram

    example_bytes = 8 * JacobianGram(model).factor_elements(np.asarray(x[:2]), compressed=False)
    return memory.engine_reserve(len(x), example_bytes)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_tiled_exact_solve_equals_the_dense_one(tmp_path, where):
    """A memory budget too small for two n x n matrices: tiles in memory, or (smaller) on disk; the same scores and
    refits (1e-8)."""
    from helpers import digits, trained_classifier

    import art_malleability.influence.ntk_memory as memory
    from art_malleability.influence import NTKInfluence

    data = digits(120, 20)
    model = trained_classifier("2l-relu", epochs=30).model
    x, y, xq, yq = data.x_train, data.y_train, data.x_test[:8], data.y_test[:8]
    dense = NTKInfluence(projection_dim=None, device="cpu").fit(model, x, y)
    reserve = _engine_reserve(model, x)
    fixed = memory.update_bytes(120, reserve=reserve)
    # disk: room for the changed rows' blocks and two block columns of 32 rows, not for the tiles in memory;
    # memory: room for half the matrix in tiles of 30 rows (n / 4), not for two n x n matrices
    extra = 2 * 8 * 120 * 32 if where == "disk" else 8 * (120 * 120 // 2 + 3 * 120 * 30) + 1000
    assert fixed + extra < memory.exact_bytes(120, reserve=reserve)
    tiled = NTKInfluence(projection_dim=None, device="cpu", memory_limit_gb=(fixed + extra) / 2**30,
                         tile_folder=tmp_path)
    tiled.fit(model, x, y)
    assert tiled.solver_.block == (32 if where == "disk" else 30)
    assert len(list(tmp_path.iterdir())) == (1 if where == "disk" else 0)  # its tiles' folder
    before = dense.scores(xq, yq)
    np.testing.assert_allclose(tiled.scores(xq, yq), before, rtol=1e-8, atol=1e-8 * np.abs(before).max())
    changed = np.array([1, 7, 50])
    x_new = np.clip(x[changed] + 0.2, 0.0, 1.0)
    after = dense.refit(changed, x_new).scores(xq, yq)
    np.testing.assert_allclose(tiled.refit(changed, x_new).scores(xq, yq), after, rtol=1e-8,
                               atol=1e-8 * np.abs(after).max())
    with pytest.raises(AttributeError, match="in-memory exact mode only"):
        tiled.kernel_  # noqa: B018
    tiled.fit(model, x, y)  # a new fit releases the previous tiles
    assert len(list(tmp_path.iterdir())) == (1 if where == "disk" else 0)
    tiled.solver_.close()
    assert list(tmp_path.iterdir()) == []


def test_tiles_from_kept_factors_compute_each_examples_factors_once(tmp_path):
    """Tiles whose budget also holds the training set's factors take them from the kept factors: each example's
    factors are computed once for the whole kernel (not per tile), and the scores and refits equal the dense solve's
    (1e-8). Tiles in memory only: tiles on disk take their tiles the same way, but at a test's sizes their blocks fill
    the budget, so no plan keeps factors beside them (the branches for them here had never run)."""
    import art_malleability.influence.ntk_memory as memory
    from art_malleability.influence import NTKInfluence
    from art_malleability.ntk.empirical import JacobianGram

    model = _mlp(d=6, m=8, c=3)
    n = 480
    x, y, xq, yq = _data(n=n, d=6)
    dense = NTKInfluence(projection_dim=None, ridge=1e-2, device="cpu").fit(model, x, y)
    exact = memory.exact_bytes(n, reserve=_engine_reserve(model, x))
    for share in np.linspace(0.99, 0.01, 99):  # the largest budget under the dense solve's whose plan is as asked
        budget = share * exact
        try:
            plan = NTKInfluence(projection_dim=None, ridge=1e-2, device="cpu", memory_limit_gb=budget / 2**30,
                                tile_folder=tmp_path).plan(model, x, n)
        except ValueError:  # nothing fits any more
            break
        if "tiles of" in plan["reason"] and "on disk" not in plan["reason"] and plan["kept_bytes"]:
            break
    assert plan["mode"] == "exact" and plan["kept_bytes"] > 0, plan
    rows = []
    features = JacobianGram.features

    def counted(engine, xb, yb=None):
        rows.append(len(xb))
        return features(engine, xb, yb)

    tiled = NTKInfluence(projection_dim=None, ridge=1e-2, device="cpu", memory_limit_gb=budget / 2**30,
                         tile_folder=tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JacobianGram, "features", counted)
        tiled.fit(model, x, y)
    assert tiled.solver_.block is not None and tiled.solver_.folder is None  # tiles in memory
    assert tiled._backend.kept is not None
    assert sum(rows) == n  # once per example, for every tile
    before = dense.scores(xq, yq)
    np.testing.assert_allclose(tiled.scores(xq, yq), before, rtol=1e-8, atol=1e-8 * np.abs(before).max())
    changed = np.array([1, 7, 50])
    x_new = x[changed] + 0.2
    after = dense.refit(changed, x_new).scores(xq, yq)
    np.testing.assert_allclose(tiled.refit(changed, x_new).scores(xq, yq), after, rtol=1e-8,
                               atol=1e-8 * np.abs(after).max())
    tiled.solver_.close()


def test_the_exact_plan_takes_the_cheapest_form_that_fits():
    """Dense in one process when two n x n matrices fit; else tiles in memory, dealt out over the processes; else on
    disk; else nothing."""
    from art_malleability.influence.ntk_memory import exact_bytes, exact_plan

    n, gib = 40_000, 2**30
    assert exact_plan(n, exact_bytes(n)) == (None, False)
    assert exact_plan(n, exact_bytes(n), world=2)[0] is not None  # a group always works in tiles
    assert exact_plan(n, 10 * gib) == (4096, True)  # 6.4 GB of tiles and the update's 3.7 GB exceed 10 GiB
    assert exact_plan(n, 10 * gib, world=2) == (2048, False)  # each of two processes holds half of both
    assert exact_plan(n, 3 * gib) is None  # not even the update's (n - m) x m blocks fit


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_tiled_exact_solve_on_cuda_matches_the_cpu(tmp_path, where):
    """The exact mode's tiles on the GPU (in its memory, or on disk and moved there tile by tile), float64."""
    import art_malleability.influence.ntk_memory as memory

    model = _mlp()
    x, y, xq, yq = _data(n=60, n_query=5)
    cpu = NTKInfluence(projection_dim=None, device="cpu").fit(model, x, y)
    fixed = memory.update_bytes(60, device=torch.device("cuda"), reserve=_engine_reserve(model, x))
    extra = 2 * 8 * 60 * 32 if where == "disk" else 8 * (60 * 60 // 2 + 3 * 60 * 15) + 1000
    gpu = NTKInfluence(projection_dim=None, device="cuda", memory_limit_gb=(fixed + extra) / 2**30,
                       tile_folder=tmp_path).fit(model, x, y)
    assert gpu.solver_.block is not None and gpu.solver_.alpha_.device.type == "cuda"
    assert _rel(gpu.scores(xq, yq), cpu.scores(xq, yq)) < 1e-9
    changed = np.array([0, 9, 33])
    x_new = x[changed] + 0.1
    assert _rel(gpu.refit(changed, x_new).scores(xq, yq), cpu.refit(changed, x_new).scores(xq, yq)) < 1e-9
