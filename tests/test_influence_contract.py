"""
The contract every influence estimator keeps, checked over all of them (as scikit-learn's ``parametrize_with_checks``
runs one set of checks over every estimator): the scores' shape and sign convention, Captum's ``influence(k,
proponents)`` and ``self_influence``, nothing of the caller's changed, and bad input named.
"""

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.influence import CaptumInfluence, GradientInfluence, NTKInfluence

ESTIMATORS = {
    "ntk-exact": lambda: NTKInfluence(projection_dim=None, device="cpu"),
    "ntk-projected": lambda: NTKInfluence(projection_dim=16, device="cpu"),  # primal: more examples than features
    "ntk-projected-dual": lambda: NTKInfluence(projection_dim=64, device="cpu"),
    "gradient": lambda: GradientInfluence(device="cpu"),
    "captum": lambda: CaptumInfluence(device="cpu", batch_size=8),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n: int = 30, n_query: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, n)
    return x, y, rng.normal(size=(n_query, 4)).astype(np.float32), rng.integers(0, 3, n_query)


@pytest.fixture(params=sorted(ESTIMATORS))
def fitted(request):
    model = _model()
    x, y, xq, yq = _data()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    copies = [a.copy() for a in (x, y, xq, yq)]
    model.train()
    est = ESTIMATORS[request.param]().fit(model, x, y)
    return request.param, est, model, (x, y, xq, yq), (state, flags, copies)


def test_scores_have_the_shape_and_sign_convention(fitted):
    name, est, _, (x, y, xq, yq), _ = fitted
    scores = est.scores(xq, yq)
    assert scores.shape == (len(xq), len(x)) and scores.dtype == np.float64 and np.isfinite(scores).all()
    # positive = helpful: a training example is helpful to itself as a query (removing it, or its gradient step,
    # raises its own loss), on average over the training set
    own = est.scores(x[:10], y[:10])[np.arange(10), np.arange(10)]
    assert own.mean() > 0, (name, own)


def test_influence_k_and_self_influence_are_captums(fitted):
    name, est, _, (x, y, xq, yq), _ = fitted
    scores = est.scores(xq, yq)
    assert np.array_equal(est.influence(xq, yq), scores)
    for proponents in (True, False):
        top = est.influence(xq, yq, k=3, proponents=proponents)
        order = np.argsort(-scores if proponents else scores, axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(np.take_along_axis(scores, top.indices, 1), top.influence_scores)
        np.testing.assert_allclose(top.influence_scores, np.take_along_axis(scores, order, 1), rtol=0, atol=0)
    own = est.self_influence()
    np.testing.assert_allclose(own, np.diag(est.scores(x, y)), rtol=1e-10, atol=1e-12)
    # after a refit: the self-influence of the training set as it now is
    changed = np.array([2, 7])
    x_new = x.copy()
    x_new[changed] += 0.5
    est.refit(changed, x_new[changed])
    np.testing.assert_allclose(est.self_influence(), np.diag(est.scores(x_new, y)), rtol=1e-10, atol=1e-12)


def test_nothing_of_the_callers_changes(fitted):
    _, est, model, (x, y, xq, yq), (state, flags, copies) = fitted
    est.scores(xq, yq)
    est.influence(xq, yq, k=2)
    assert model.training  # its mode as it was given
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(np.array_equal(a, b) for a, b in zip((x, y, xq, yq), copies, strict=True))


def test_bad_input_is_named_and_changes_nothing(fitted):
    _, est, _, (x, y, xq, yq), _ = fitted
    before = est.scores(xq, yq)
    with pytest.raises(ValueError, match="x_query"):
        est.scores(xq[:, :3], yq)
    with pytest.raises(ValueError, match="y_query"):
        est.scores(xq, yq[:2])
    with pytest.raises(ValueError, match="k"):
        est.influence(xq, yq, k=0)
    bad = xq.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="x_query"):
        est.scores(bad, yq)
    np.testing.assert_array_equal(est.scores(xq, yq), before)
