"""Tests of the reference training loop and the ART classifier wrapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from art.attacks.evasion import FastGradientMethod
from art.estimators.classification import PyTorchClassifier
from art.utils import to_categorical

from art_malleability._utils.torch_utils import resolve_device
from art_malleability.data import load_dataset
from art_malleability.models import MLPAttn, build_reference_model, make_classifier, train_classifier, train_model

# Settings that reach > 85 % digits test accuracy in about a second (2L-ReLU) or a few seconds (MLP-Attn). The
# linearised attention collapses all digits features onto nearly one direction (pairwise cosines > 0.99), so
# MLP-Attn needs large full-batch Adam steps without weight decay to fit within a CPU test budget.
RELU_SETTINGS = {"epochs": 30, "lr": 1e-2}
ATTN_SETTINGS = {"epochs": 2000, "batch_size": 1000, "lr": 0.1, "weight_decay": 0.0}


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", seed=0)


def _accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def _ce(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)))


def test_train_2l_relu_reaches_accuracy(digits):
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=512, seed=0)
    initial = _ce(model, digits.x_train, digits.y_train)
    trained = train_model(
        model, digits.x_train, digits.y_train, seed=0, device="cpu", verbose=False, **RELU_SETTINGS
    )
    assert trained is model
    assert not model.training
    assert _ce(model, digits.x_train, digits.y_train) < 0.5 * initial
    assert _accuracy(model, digits.x_test, digits.y_test) > 0.85


def test_train_mlp_attn_reaches_accuracy(digits):
    model = build_reference_model("mlp-attn", digits.input_shape, 10, width=256, seed=0)
    model.set_context(digits.x_train)
    initial = _ce(model, digits.x_train, digits.y_train)
    train_model(model, digits.x_train, digits.y_train, seed=0, device="cpu", verbose=False, **ATTN_SETTINGS)
    assert _ce(model, digits.x_train, digits.y_train) < 0.5 * initial
    assert _accuracy(model, digits.x_test, digits.y_test) > 0.85


def test_train_sets_context_from_training_data(digits):
    model = MLPAttn(digits.input_shape, width=16, nb_classes=10, seed=0)
    train_model(model, digits.x_train, digits.y_train, epochs=1, device="cpu", verbose=False)
    reference = MLPAttn(digits.input_shape, width=16, nb_classes=10, seed=0)
    reference.set_context(digits.x_train)
    torch.testing.assert_close(model.attention.context, reference.attention.context)
    assert int(model.attention.context_size) == len(digits.x_train)


def test_mse_training(digits):
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=512, seed=0)
    targets = torch.from_numpy(to_categorical(digits.y_train, 10))
    with torch.no_grad():
        initial = float(F.mse_loss(model(torch.from_numpy(digits.x_train)), targets))
    train_model(
        model, digits.x_train, digits.y_train, loss="mse", device="cpu", verbose=False, **RELU_SETTINGS
    )
    with torch.no_grad():
        final = float(F.mse_loss(model(torch.from_numpy(digits.x_train)), targets))
    assert final < 0.5 * initial
    assert _accuracy(model, digits.x_test, digits.y_test) > 0.8


def test_one_hot_labels_match_index_labels(digits):
    x, y = digits.x_train[:200], digits.y_train[:200]
    a = build_reference_model("2l-relu", digits.input_shape, 10, width=32, seed=0)
    b = build_reference_model("2l-relu", digits.input_shape, 10, width=32, seed=0)
    train_model(a, x, y, epochs=3, device="cpu", verbose=False)
    train_model(b, x, to_categorical(y, 10), epochs=3, device="cpu", verbose=False)
    assert torch.equal(a.hidden.weight, b.hidden.weight)


def test_seeded_and_leaves_inputs_and_global_state_unchanged(digits):
    x, y = digits.x_train[:200].copy(), digits.y_train[:200].copy()
    x_before, y_before = x.copy(), y.copy()
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()[1].copy()
    weights = []
    for seed in (0, 0, 1):
        model = build_reference_model("mlp-attn", digits.input_shape, 10, width=32, seed=0)
        train_model(model, x, y, epochs=3, batch_size=32, seed=seed, device="cpu", verbose=False)
        weights.append(model.hidden.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], weights[2])
    assert np.array_equal(x, x_before) and np.array_equal(y, y_before)
    assert torch.equal(torch_state, torch.get_rng_state())
    assert np.array_equal(numpy_state, np.random.get_state()[1])


def test_verbose_controls_progress_bar(digits, capsys):
    x, y = digits.x_train[:100], digits.y_train[:100]
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=8)
    train_model(model, x, y, epochs=2, device="cpu", verbose=False)
    assert "Training" not in capsys.readouterr().err
    train_model(model, x, y, epochs=2, device="cpu", verbose=True)
    assert "Training TwoLayerReLU" in capsys.readouterr().err
    # in a log (stderr not a terminal) the loss shown beside the bar does not redraw it on every step
    train_model(model, x, y, epochs=60, batch_size=10, device="cpu", verbose=True)
    assert capsys.readouterr().err.count("Training TwoLayerReLU") <= 3


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_classifier_predict_and_loss_gradient(digits, loss):
    model = build_reference_model("mlp-attn", digits.input_shape, 10, width=64, seed=0)
    x_train, y_train = digits.x_train[:300], digits.y_train[:300]
    train_model(model, x_train, y_train, loss=loss, epochs=5, device="cpu", verbose=False)
    classifier = make_classifier(model, digits.input_shape, 10, loss=loss, device="cpu")
    assert isinstance(classifier, PyTorchClassifier)
    assert isinstance(
        classifier.loss, torch.nn.CrossEntropyLoss if loss == "cross_entropy" else torch.nn.MSELoss
    )
    assert classifier.clip_values is not None and tuple(classifier.clip_values) == (0.0, 1.0)

    x, y = digits.x_test[:20].copy(), to_categorical(digits.y_test[:20], 10)
    x_before, y_before = x.copy(), y.copy()
    predictions = classifier.predict(x)
    assert predictions.shape == (20, 10) and predictions.dtype == np.float32
    gradient = classifier.loss_gradient(x, y)
    assert gradient.shape == x.shape
    assert np.isfinite(gradient).all() and np.abs(gradient).sum() > 0
    # Integer one-hot labels work as well.
    np.testing.assert_allclose(classifier.loss_gradient(x, y.astype(np.int64)), gradient, rtol=1e-6)
    x_adv = FastGradientMethod(classifier, eps=0.1).generate(x, y=y)
    assert x_adv.shape == x.shape
    assert np.abs(x_adv - x).max() <= 0.1 + 1e-6
    assert x_adv.min() >= 0.0 and x_adv.max() <= 1.0
    assert np.array_equal(x, x_before) and np.array_equal(y, y_before)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_binary_classifier_loss_gradient(loss):
    data = load_dataset("digits", classes=[3, 8], n_train=200, n_test=40, seed=0)
    model = build_reference_model("2l-relu", data.input_shape, 2, width=32, seed=0)
    classifier = train_classifier(
        model, data.x_train, data.y_train, loss=loss, epochs=3, device="cpu", verbose=False
    )
    y = to_categorical(data.y_test, 2)
    gradient = classifier.loss_gradient(data.x_test, y)
    assert gradient.shape == data.x_test.shape and np.abs(gradient).sum() > 0
    x_adv = FastGradientMethod(classifier, eps=0.2).generate(data.x_test, y=data.y_test)
    assert np.abs(x_adv - data.x_test).max() <= 0.2 + 1e-6


def test_train_classifier_infers_shape_and_classes(digits):
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=32, seed=0)
    classifier = train_classifier(
        model, digits.x_train[:200], digits.y_train[:200], epochs=2, device="cpu", verbose=False
    )
    assert classifier.input_shape == digits.input_shape
    assert classifier.nb_classes == 10
    assert classifier.model is model
    assert not model.training
    assert classifier.predict(digits.x_test[:5]).shape == (5, 10)


def test_training_argument_errors(digits):
    x, y = digits.x_train[:50], digits.y_train[:50]
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=8)
    with pytest.raises(ValueError, match="loss"):
        train_model(model, x, y, loss="hinge", verbose=False)
    with pytest.raises(ValueError, match="epochs"):
        train_model(model, x, y, epochs=0, verbose=False)
    with pytest.raises(ValueError, match="batch_size"):
        train_model(model, x, y, batch_size=0, verbose=False)
    with pytest.raises(ValueError, match="lr"):
        train_model(model, x, y, lr=0.0, verbose=False)
    with pytest.raises(TypeError, match="x must be a numpy array"):
        train_model(model, x.tolist(), y, verbose=False)
    with pytest.raises(ValueError, match="same number of examples"):
        train_model(model, x, y[:10], verbose=False)
    with pytest.raises(ValueError, match="outputs"):
        train_model(build_reference_model("2l-relu", digits.input_shape, 3, width=8), x, y, verbose=False)
    with pytest.raises(ValueError, match="device"):
        train_model(model, x, y, device="tpu", verbose=False)
    with pytest.raises(ValueError, match="nb_classes"):
        make_classifier(model, digits.input_shape, 1)
    with pytest.raises(ValueError, match="input_shape"):
        make_classifier(model, (1, -8, 8), 10)
    with pytest.raises(TypeError, match="optimizer"):
        make_classifier(model, digits.input_shape, 10, optimizer="adam")


def test_make_classifier_passes_the_optimizer_to_art(digits):
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=8)
    plain = make_classifier(model, digits.input_shape, 10, device="cpu")
    assert plain.optimizer is None
    adam = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    clf = make_classifier(model, digits.input_shape, 10, device="cpu", optimizer=adam)
    assert clf.optimizer is adam
    before = model.hidden.weight.detach().clone()
    clf.fit(digits.x_train[:32], digits.y_train[:32], batch_size=16, nb_epochs=1, verbose=False)
    assert not torch.equal(model.hidden.weight.detach(), before)  # ART trains through it


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


def test_training_settings_are_refused_by_the_shared_rules_naming_the_parameter(digits):
    """``epochs``, ``batch_size``, ``lr`` and ``weight_decay`` go through the package's shared rules, in their words
    (before: "must be an int >= 1", "must be > 0", "must be >= 0")."""
    from art_malleability._utils.params import InvalidParameterError

    x, y = digits.x_train[:20], digits.y_train[:20]
    model = build_reference_model("2l-relu", digits.input_shape, 10, width=8)
    for kwargs, message in (({"epochs": 0}, "epochs must be a positive integer, got 0"),
                            ({"batch_size": True}, "batch_size must be a positive integer, got True"),
                            ({"lr": float("nan")}, "lr must be a positive finite number, got nan"),
                            ({"weight_decay": -0.1}, "weight_decay must be a non-negative finite number, got -0.1")):
        with pytest.raises(InvalidParameterError) as refused:
            train_model(model, x, y, verbose=False, **kwargs)
        assert refused.value.param == next(iter(kwargs)) and str(refused.value) == message
