"""Tests of MLP-Attn-QKV, the linearised-attention reference model with trained query, key and value maps."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from art_malleability.data import load_dataset
from art_malleability.models import REFERENCE_MODELS, MLPAttn, MLPAttnQKV, build_reference_model, train_model
from art_malleability.ntk.empirical import JacobianGram, empirical_ntk

INPUT_SHAPE = (1, 8, 8)
D = 64


@pytest.fixture
def x_train(rng) -> np.ndarray:
    return rng.random((40, *INPUT_SHAPE), dtype=np.float32)


@pytest.fixture
def x_query(rng) -> np.ndarray:
    return rng.random((47, *INPUT_SHAPE), dtype=np.float32)[40:]


def _normalise(a: torch.Tensor) -> torch.Tensor:
    a = a.reshape(a.shape[0], -1)
    return a / a.norm(dim=1, keepdim=True)


def _model(x_train: np.ndarray, **kwargs) -> MLPAttnQKV:
    settings = {"width": 32, "nb_classes": 4, "seed": 0, **kwargs}
    model = MLPAttnQKV(INPUT_SHAPE, **settings)
    model.set_context(x_train)
    return model


@pytest.mark.parametrize("context", ["centred", "gram"])
def test_identity_maps_reduce_exactly_to_mlp_attn(x_train, x_query, context):
    reference = MLPAttn(INPUT_SHAPE, width=32, nb_classes=4, seed=3, context=context).double()
    reference.set_context(x_train)
    x = torch.from_numpy(x_query).double()

    exact = MLPAttnQKV(INPUT_SHAPE, width=32, nb_classes=4, seed=3, init_noise=0.0, context=context).double()
    exact.set_context(x_train)
    for weight in (exact.query_weight, exact.key_weight, exact.value_weight):
        assert torch.equal(weight, torch.eye(D, dtype=torch.float64))

    noisy = MLPAttnQKV(INPUT_SHAPE, width=32, nb_classes=4, seed=3, context=context).double()
    noisy.set_context(x_train)
    assert not torch.equal(noisy(x), reference(x))
    with torch.no_grad():
        for layer in (noisy.query, noisy.key, noisy.value):
            layer.weight.copy_(torch.eye(D))

    for model in (exact, noisy):
        assert torch.equal(model.hidden.weight, reference.hidden.weight)
        assert torch.equal(model.output_signs, reference.output_signs)
        assert torch.equal(model.attention.context, reference.attention.context)
        if context == "centred":
            assert torch.equal(model.attention.mean, reference.attention.mean)
        torch.testing.assert_close(model.features(x), reference.features(x), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("context", ["centred", "gram"])
def test_matches_manual_computation(x_train, x_query, context):
    model = _model(x_train, qkv_dim=24, context=context).double()
    model.set_context(x_train)  # recomputed in float64
    w_q, w_k, w_v = (w.detach() for w in (model.query_weight, model.key_weight, model.value_weight))
    assert w_q.shape == w_k.shape == w_v.shape == (24, D)
    assert torch.equal(w_k, model.key.weight.detach().T)
    x_hat = _normalise(torch.from_numpy(x_train).double())
    mu = x_hat.mean(dim=0) if context == "centred" else torch.zeros(D, dtype=torch.float64)
    x_hat = x_hat - mu  # the centred form attends over the centred tokens
    s = x_hat.T @ x_hat
    attention = w_v @ s @ w_k.T @ w_q
    with torch.no_grad():
        torch.testing.assert_close(model.attention_map(), attention, rtol=1e-12, atol=1e-12)
    q = _normalise(torch.from_numpy(x_query).double()) - mu
    # Linearised attention over the training rows, term by term: sum_i (W_v x_i) ((W_k x_i) . (W_q x)).
    summed = ((q @ w_q.T) @ (x_hat @ w_k.T).T) @ (x_hat @ w_v.T)
    features = _normalise(summed)
    torch.testing.assert_close(_normalise(q @ attention.T), features, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.features(torch.from_numpy(x_query)), features, rtol=1e-12, atol=1e-12)
    w = model.hidden.weight.detach()
    expected = torch.relu(features @ w.T) @ model.output_signs / np.sqrt(32)
    torch.testing.assert_close(model(torch.from_numpy(x_query)), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("input_shape", [INPUT_SHAPE, D])
@pytest.mark.parametrize("qkv_dim", [None, 16, 100])
def test_shapes(input_shape, qkv_dim, x_train):
    model = MLPAttnQKV(input_shape, width=32, nb_classes=10, seed=0, qkv_dim=qkv_dim)
    model.set_context(x_train)
    p = D if qkv_dim is None else qkv_dim
    assert model.input_dim == D and model.qkv_dim == p and model.feature_dim == p
    x = torch.from_numpy(x_train)
    out = model(x)
    assert out.shape == (40, 10) and out.dtype == torch.float32
    features = model.features(x)
    assert features.shape == (40, p)
    torch.testing.assert_close(features.norm(dim=1), torch.ones(40))
    assert model.hidden.weight.shape == (32, p)
    assert model.query.weight.shape == (p, D)
    assert model.key.weight.shape == (D, p)
    assert model.value.weight.shape == (p, D)
    assert model.attention.context.shape == (D, D)
    assert f"qkv_dim={p}" in repr(model)


def test_trainable_parameters_and_buffers():
    model = MLPAttnQKV(INPUT_SHAPE, width=48, nb_classes=3, seed=0)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert names == ["hidden.weight", "query.weight", "key.weight", "value.weight"]
    assert [name for name, _ in model.named_parameters()] == names
    assert all(layer.bias is None for layer in (model.hidden, model.query, model.key, model.value))
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"output_signs", "attention.context", "attention.context_size", "attention.mean"}
    assert all(not b.requires_grad for b in buffers.values())
    assert set(model.output_signs.unique().tolist()) == {-1.0, 1.0}


def test_initialisation_near_identity():
    model = MLPAttnQKV(INPUT_SHAPE, width=8, nb_classes=2, seed=0)
    eye = torch.eye(D)
    noises = [(w.detach() - eye) for w in (model.query_weight, model.key_weight, model.value_weight)]
    for noise in noises:
        assert abs(noise.mean().item()) < 0.01 / np.sqrt(D)
        assert noise.std().item() == pytest.approx(0.1 / np.sqrt(D), rel=0.05)
        assert torch.linalg.matrix_norm(noise, 2).item() < 0.25
    assert not torch.equal(noises[0], noises[1]) and not torch.equal(noises[1], noises[2])
    narrow = MLPAttnQKV(INPUT_SHAPE, width=8, nb_classes=2, seed=0, qkv_dim=10, init_noise=0.0)
    assert torch.equal(narrow.query_weight, torch.eye(10, D))
    assert torch.equal(narrow.key.weight, torch.eye(D, 10))


def test_seeded_and_no_global_random_state(x_train):
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()[1].copy()
    a = _model(x_train, seed=5)
    b = build_reference_model("mlp-attn-qkv", INPUT_SHAPE, 4, width=32, seed=5)
    b.set_context(x_train)
    c = _model(x_train, seed=6)
    x = torch.from_numpy(x_train)
    a(x)
    assert torch.equal(torch_state, torch.get_rng_state())
    assert np.array_equal(numpy_state, np.random.get_state()[1])
    states = (a.state_dict().items(), b.state_dict().values(), c.state_dict().values())
    for (name, pa), pb, pc in zip(*states, strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight"):
            assert not torch.equal(pa, pc), name
    # The hidden layer and the output signs are the draws of MLPAttn with the same seed.
    attn = MLPAttn(INPUT_SHAPE, width=32, nb_classes=4, seed=5)
    assert torch.equal(a.hidden.weight, attn.hidden.weight)
    assert torch.equal(a.output_signs, attn.output_signs)


def test_context_in_state_dict_and_copies(x_train, x_query):
    model = _model(x_train, qkv_dim=20)
    assert model.has_context
    state = model.state_dict()
    assert {"attention.context", "attention.context_size", "query.weight", "key.weight", "value.weight"} <= set(
        state
    )
    x = torch.from_numpy(x_query)
    expected = model(x)
    torch.testing.assert_close(copy.deepcopy(model)(x), expected)
    fresh = MLPAttnQKV(INPUT_SHAPE, width=32, nb_classes=4, seed=1, qkv_dim=20)
    assert not fresh.has_context
    fresh.load_state_dict(state)
    assert fresh.has_context
    torch.testing.assert_close(fresh(x), expected)
    # Test points are mapped with the training-set context, which the forward pass leaves alone.
    context = model.attention.context.clone()
    model(x)
    assert torch.equal(model.attention.context, context)
    assert int(model.attention.context_size) == len(x_train)


def test_forward_before_context_raises(x_query):
    model = MLPAttnQKV(INPUT_SHAPE, width=16, nb_classes=3, seed=0)
    with pytest.raises(RuntimeError, match="set_context"):
        model(torch.from_numpy(x_query))
    with pytest.raises(RuntimeError, match="set_context"):
        model.attention_map()


def test_argument_errors(rng):
    with pytest.raises(ValueError, match="qkv_dim"):
        MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2, qkv_dim=0)
    for bad in (2.5, True, "8"):
        with pytest.raises(TypeError, match="qkv_dim"):
            MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2, qkv_dim=bad)
    with pytest.raises(ValueError, match="init_noise"):
        MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2, init_noise=-0.1)
    with pytest.raises(TypeError, match="init_noise"):
        MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2, init_noise="0.1")
    with pytest.raises(TypeError, match="seed"):
        MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2, seed="0")
    with pytest.raises(ValueError, match="width"):
        MLPAttnQKV(INPUT_SHAPE, width=0, nb_classes=2)
    with pytest.raises(ValueError, match="x_train must have 64 features"):
        MLPAttnQKV(INPUT_SHAPE, width=4, nb_classes=2).set_context(rng.random((5, 1, 4, 4), dtype=np.float32))


def test_factory():
    assert REFERENCE_MODELS[-1] == "mlp-attn-qkv"
    model = build_reference_model("MLP_Attn_QKV", INPUT_SHAPE, 10, width=16, seed=2)
    assert type(model) is MLPAttnQKV
    assert model.qkv_dim == D and model.width == 16 and model.nb_classes == 10 and model.seed == 2
    assert callable(model.set_context)


def test_gradients_reach_all_maps(x_train, x_query):
    model = _model(x_train)
    F.cross_entropy(model(torch.from_numpy(x_query)), torch.arange(7) % 4).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and float(param.grad.abs().sum()) > 0, name


@pytest.mark.parametrize("qkv_dim", [None, 24])
def test_structured_entk_matches_jacobian(qkv_dim, x_train, x_query):
    model = _model(x_train, qkv_dim=qkv_dim, nb_classes=5).double()
    x1, x2 = x_train[:12], x_query
    engine = JacobianGram(model, method="structured")
    k_auto = engine.gram(x1)
    # The three maps are plain nn.Linear layers called once per forward pass on per-example rows, so all four
    # trained layers take the structured path; only the hidden layer factorises over the classes.
    assert [b.name for b in engine._structured] == ["hidden", "query", "key", "value"]
    assert engine._layer_plan.fallback == []
    assert engine._rank_one == [True, False, False, False]
    k_jac = empirical_ntk(model, x1, method="jacobian")
    assert (k_auto - k_jac).abs().max().item() < 1e-10
    assert torch.equal(k_auto, k_auto.T)
    cross = empirical_ntk(model, x1, x2, method="auto")
    assert (cross - empirical_ntk(model, x1, x2, method="jacobian")).abs().max().item() < 1e-10
    full = empirical_ntk(model, x1[:4], x2[:3], method="auto", trace=False)
    assert (full - empirical_ntk(model, x1[:4], x2[:3], method="jacobian", trace=False)).abs().max() < 1e-10


def test_trains_on_digits():
    digits = load_dataset("digits", seed=0)
    model = build_reference_model("mlp-attn-qkv", digits.input_shape, 10, width=256, seed=0)
    model.set_context(digits.x_train)
    x_train, y_train = torch.from_numpy(digits.x_train), torch.from_numpy(digits.y_train)
    with torch.no_grad():
        initial = float(F.cross_entropy(model(x_train), y_train))
    # Full-batch Adam for a short CPU budget (about 0.80 test accuracy; about 0.88 with mini-batches of 128 and
    # 300 epochs, where MLP-Attn reaches about 0.72).
    train_model(
        model, digits.x_train, digits.y_train, epochs=200, batch_size=1000, lr=0.03, weight_decay=0.0, seed=0,
        device="cpu", verbose=False,
    )
    with torch.no_grad():
        assert float(F.cross_entropy(model(x_train), y_train)) < 0.5 * initial
        accuracy = float((model(torch.from_numpy(digits.x_test)).argmax(1).numpy() == digits.y_test).mean())
    assert accuracy > 0.6  # chance is 0.1
