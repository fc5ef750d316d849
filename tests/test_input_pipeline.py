"""The influence sees what the classifier's model sees: ART's preprocessing in front of the model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from art.defences.preprocessor import JpegCompression
from art.estimators.classification import PyTorchClassifier
from helpers import digits, trained_classifier
from torch import nn

from art_malleability import MalleabilityEstimator
from art_malleability.data.input_pipeline import PreprocessedModel, pipeline_operations, with_input_pipeline

MEAN, STD = 0.3, 0.4


class Standardised(nn.Module):
    """The same standardisation written inside the module."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model((x - MEAN) / STD)


class TransductiveStandardised(Standardised):
    """... of a transductive model: its context from standardised inputs too."""

    def set_context(self, x):
        self.model.set_context((torch.as_tensor(x) - MEAN) / STD)


def both_forms(name: str) -> tuple[PyTorchClassifier, PyTorchClassifier]:
    trained = trained_classifier(name)
    data = digits()
    loss = nn.CrossEntropyLoss()
    outside = PyTorchClassifier(copy.deepcopy(trained.model), loss, data.input_shape, data.nb_classes,
                                clip_values=(0.0, 1.0), preprocessing=(MEAN, STD), device_type="cpu")
    wrapper = TransductiveStandardised if name == "mlp-attn" else Standardised
    inside = PyTorchClassifier(wrapper(copy.deepcopy(trained.model)), loss, data.input_shape, data.nb_classes,
                               clip_values=(0.0, 1.0), device_type="cpu")
    return outside, inside


ESTIMATORS = [
    ("ntk", {"projection_dim": None}),
    ("ntk", {"projection_dim": 32}),
    ("gradient", {}),
    ("captum", {}),
]


@pytest.mark.parametrize("name", ["2l-relu", "mlp-attn"])
@pytest.mark.parametrize(("influence", "extra"), ESTIMATORS, ids=["ntk-exact", "ntk-projected", "gradient", "captum"])
def test_preprocessing_outside_or_inside_the_module_gives_the_same_audit(name, influence, extra):
    outside, inside = both_forms(name)
    data = digits(100, 20)
    np.testing.assert_allclose(outside.predict(data.x_test), inside.predict(data.x_test), rtol=1e-5, atol=1e-5)
    settings = {"attacks": ["fgsm"], "influence": influence, "n_bootstrap": 20, "verbose": False, "device": "cpu",
                **extra}
    a = MalleabilityEstimator(outside, **settings).evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    b = MalleabilityEstimator(inside, **settings).evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    scale = np.abs(b.scores_before).max()
    np.testing.assert_allclose(a.scores_before, b.scores_before, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(a.result("fgsm").scores_after, b.result("fgsm").scores_after, rtol=1e-4,
                               atol=1e-5 * scale)
    assert a.top_indices == b.top_indices and a.result("fgsm").flip_rate == b.result("fgsm").flip_rate


def test_no_preprocessing_leaves_the_model_as_it_is():
    clf = trained_classifier("2l-relu")
    assert pipeline_operations(clf) == [] and with_input_pipeline(clf.model, clf) is clf.model


def test_the_pipeline_module_standardises_in_the_inputs_dtype_and_keeps_the_context():
    outside, _ = both_forms("mlp-attn")
    model = with_input_pipeline(copy.deepcopy(outside.model).double(), outside)
    assert isinstance(model, PreprocessedModel) and callable(model.set_context)
    x = torch.as_tensor(digits().x_train[:5], dtype=torch.float64)
    expected = (x - np.float32(MEAN)) / np.float32(STD)
    assert model.preprocess(x).dtype == torch.float64
    torch.testing.assert_close(model.preprocess(x), expected, rtol=0, atol=0)


def test_a_preprocessor_the_influence_cannot_follow_is_refused_before_any_work():
    trained = trained_classifier("2l-relu")
    data = digits()
    jpeg = JpegCompression(clip_values=(0.0, 1.0), channels_first=True, apply_predict=True)
    clf = PyTorchClassifier(copy.deepcopy(trained.model), nn.CrossEntropyLoss(), data.input_shape, data.nb_classes,
                            clip_values=(0.0, 1.0), preprocessing_defences=[jpeg], device_type="cpu")
    x = data.x_train.copy()
    with pytest.raises(ValueError, match="classifier.preprocessing must hold PyTorch .*, got JpegCompression"):
        MalleabilityEstimator(clf, verbose=False).evaluate(x, data.y_train)
    np.testing.assert_array_equal(x, data.x_train)
