"""The ridge chosen from the data: leave-one-out error and GCV against explicit re-solves; the NTK estimator's rule."""

import argparse

import numpy as np
import pytest
import torch
from torch import nn

from art_malleability.cli.options import ridge_value
from art_malleability.influence import NTKInfluence
from art_malleability.influence.ridge_choice import check_ridge, choose_ridge, ridge_criteria


def _problem(n: int = 40, d: int = 8, c: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    return torch.tensor(x @ x.T), torch.tensor(rng.standard_normal((n, c)))


def test_criteria_equal_explicit_leave_one_out_and_gcv():
    kernel, targets = _problem()
    original = kernel.clone()
    grid = np.array([1e-3, 1e-1, 1.0, 10.0])
    criteria = ridge_criteria(kernel, targets, grid)
    assert torch.allclose(kernel, original, rtol=0, atol=1e-11 * float(original.abs().max()))  # computed back
    k, y, n = original.numpy(), targets.numpy(), len(original)
    for g, lam in enumerate(grid):
        errors = []
        for i in range(n):  # the regression fitted without i, then asked about i
            keep = np.arange(n) != i
            alpha = np.linalg.solve(k[np.ix_(keep, keep)] + lam * np.eye(n - 1), y[keep])
            errors.append(np.sum((y[i] - k[i, keep] @ alpha) ** 2))
        residual_maker = np.eye(n) - k @ np.linalg.inv(k + lam * np.eye(n))
        gcv = np.mean(np.sum((residual_maker @ y) ** 2, axis=1)) / (np.trace(residual_maker) / n) ** 2
        assert criteria["loo"][g] == pytest.approx(np.mean(errors), rel=1e-9)
        assert criteria["gcv"][g] == pytest.approx(gcv, rel=1e-9)


def test_choose_ridge_takes_the_grid_minimum_relative_to_the_kernel_scale():
    kernel, targets = _problem()
    scale = float(kernel.diagonal().mean())
    relative = (1e-4, 1e-2, 1.0)
    ridge, criteria = choose_ridge(kernel.clone(), targets, "gcv", relative)
    np.testing.assert_allclose(criteria["ridge"], scale * np.asarray(relative))
    assert ridge == criteria["ridge"][int(np.argmin(criteria["gcv"]))]
    # rescaling the kernel and the grid together rescales the choice
    ridge_scaled, _ = choose_ridge(kernel.clone() * 10.0, targets, "gcv", relative)
    assert ridge_scaled == pytest.approx(10.0 * ridge)


def test_a_rank_deficient_kernel_skips_ridges_that_are_not_positive_definite():
    kernel, targets = _problem(n=30, d=3)  # rank 3
    criteria = ridge_criteria(kernel, targets, np.array([1e-30, 1.0]))
    assert np.isfinite(criteria["loo"][1])  # the small ridge may or may not be finite; the usable one is


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda k, y: choose_ridge(k, y, "aic"), "rule must be one of"),
        (lambda k, y: choose_ridge(k, y, "loo", ()), "relative_grid must hold"),
        (lambda k, y: choose_ridge(k, y, "loo", (-1.0,)), "relative_grid must hold"),
        (lambda k, y: choose_ridge(k.float(), y), "kernel must be a C-contiguous float64 CPU matrix"),
        (lambda k, y: choose_ridge(k * 0.0, y), "kernel must have a positive mean diagonal"),
        (lambda k, y: ridge_criteria(k.fill_diagonal_(float("nan")), y, np.ones(1)), "kernel must be finite"),
    ],
)
def test_bad_input_is_named(call, match):
    kernel, targets = _problem()
    with pytest.raises(ValueError, match=match):
        call(kernel, targets)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "aic", None])
def test_check_ridge_names_the_argument(bad):
    with pytest.raises(ValueError, match="ridge must be a positive float or one of"):
        check_ridge(bad)
    with pytest.raises(ValueError, match="ridge must be"):
        NTKInfluence(ridge=bad)


def test_the_cli_parses_numbers_and_rules():
    assert ridge_value("0.01") == 0.01 and ridge_value("LOO") == "loo" and ridge_value("gcv") == "gcv"
    for bad in ("0", "-1", "x", "inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive number, 'loo' or 'gcv'"):
            ridge_value(bad)


def _mlp_and_data(n: int = 60, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 5)).astype(np.float32)
    y = rng.integers(0, 3, n)
    return model, x, y, rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 3, 6)


@pytest.mark.parametrize("rule", ["loo", "gcv"])
@pytest.mark.parametrize("projection_dim", [None, 512])
def test_a_rule_is_the_fixed_ridge_it_chose(rule, projection_dim):
    """Scores and refits with the rule equal those with the number it chose (1e-8); the ridge stays for refits."""
    model, x, y, xq, yq = _mlp_and_data()
    chosen = NTKInfluence(ridge=rule, projection_dim=projection_dim, device="cpu").fit(model, x, y)
    assert chosen.ridge_ > 0 and chosen.ridge_criteria_["ridge"].size > 1
    fixed = NTKInfluence(ridge=chosen.ridge_, projection_dim=projection_dim, device="cpu").fit(model, x, y)
    assert fixed.ridge_criteria_ is None
    before = fixed.scores(xq, yq)
    np.testing.assert_allclose(chosen.scores(xq, yq), before, rtol=1e-8, atol=1e-8 * np.abs(before).max())
    ridge, changed = chosen.ridge_, np.array([2, 9, 30])
    x_new = x[changed] + 0.5
    after = fixed.refit(changed, x_new).scores(xq, yq)
    np.testing.assert_allclose(chosen.refit(changed, x_new).scores(xq, yq), after, rtol=1e-8,
                               atol=1e-8 * np.abs(after).max())
    assert chosen.ridge_ == ridge


def test_a_rule_is_refused_before_the_work_where_no_single_kernel_exists(tmp_path):
    import art_malleability.influence.ntk_memory as memory

    model, x, y, _, _ = _mlp_and_data(n=120)
    weights = [p.detach().clone() for p in model.parameters()]
    x_copy = x.copy()
    from art_malleability.ntk.empirical import JacobianGram

    # room for tiles of 30 rows in memory beside the update's blocks and the engine's chunks (reserved at the size
    # 120 examples' factors need), not for two n x n matrices
    reserve = memory.engine_reserve(120, 8 * JacobianGram(model).factor_elements(x[:2], compressed=False))
    tiny = (memory.update_bytes(120, reserve=reserve) + 8 * (120 * 120 // 2 + 3 * 120 * 30) + 1000) / 2**30
    assert tiny * 2**30 < memory.exact_bytes(120, reserve=reserve)
    with pytest.raises(ValueError, match="ridge must be a number for the exact solve in tiles"):
        NTKInfluence(ridge="loo", projection_dim=None, device="cpu", memory_limit_gb=tiny).fit(model, x, y)
    with pytest.raises(ValueError, match="ridge must be a number for the projected mode"):
        NTKInfluence(ridge="gcv", projection_dim=16, device="cpu").fit(model, x, y)
    np.testing.assert_array_equal(x, x_copy)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    # the realised dimension decides, not the requested one: k = 100 realises 96 features here, fewer than n = 98
    model, x, y, _, _ = _mlp_and_data(n=98)
    refusal = r"ridge must be a number for the projected mode .*\(98\) than features \(96\)"
    with pytest.raises(ValueError, match=refusal):
        NTKInfluence(ridge="loo", projection_dim=100, device="cpu").fit(model, x, y)
