"""
The NTK influence's estimator is chosen from the inputs, the options and fixed facts of the machine only: not from
what other processes hold at the moment, nor from a timing; a mode that cannot fit the memory available now stops
with an error that says so instead of switching estimators; the reason is recorded.
"""

import numpy as np
import pytest
import torch
from helpers import digits, trained_classifier

import art_malleability.influence.ntk as ntk_module
import art_malleability.influence.ntk_memory as memory
from art_malleability import MalleabilityEstimator
from art_malleability.influence import NTKInfluence

GIB = 2**30


@pytest.fixture(scope="module")
def relu_data():
    data = digits(200, 20)
    return trained_classifier("2l-relu", epochs=5), data


def test_a_small_problem_reserves_for_the_engine_what_it_needs(relu_data):
    """200 examples need a few MiB: a fixed reservation of three 256 MiB chunks made 0.7 GiB projected, 0.76 exact."""
    clf, data = relu_data
    modes = {limit: NTKInfluence(device="cpu", memory_limit_gb=limit).fit(clf.model, data.x_train, data.y_train).mode_
             for limit in (None, 0.76, 0.7, 0.05)}
    assert set(modes.values()) == {"exact"}, modes
    assert memory.engine_reserve(200, 8 * 1296) < 16 * 2**20  # the 2L-ReLU's factors of 200 examples, two batches
    assert memory.engine_reserve(10**6, 8 * 10**6) == 3 * 256 * 2**20  # a large problem takes the whole chunks


def test_the_choice_does_not_depend_on_what_other_processes_hold(relu_data, monkeypatch):
    """With 0.5 GiB left by other processes the same estimator runs (the budget is a share of the total memory);
    with too little for it, the fit stops and says so, instead of running another estimator."""
    clf, data = relu_data
    quiet = NTKInfluence(device="cpu").fit(clf.model, data.x_train, data.y_train)
    monkeypatch.setattr(memory, "available_memory", lambda device: GIB // 2)
    busy = NTKInfluence(device="cpu").fit(clf.model, data.x_train, data.y_train)
    assert (busy.mode_, busy.solver_.block) == (quiet.mode_, quiet.solver_.block) == ("exact", None)
    np.testing.assert_array_equal(busy.scores(data.x_test, data.y_test), quiet.scores(data.x_test, data.y_test))
    monkeypatch.setattr(memory, "available_memory", lambda device: 1024)
    with pytest.raises(MemoryError, match=r"available on cpu now.*memory_limit_gb \(--memory-limit-gb\)"):
        NTKInfluence(device="cpu").fit(clf.model, data.x_train, data.y_train)


def test_the_choice_times_nothing(relu_data, monkeypatch):
    """The decision of projection_dim='auto' counts operations at a nominal rate: it never times the machine."""
    clf, data = relu_data

    def timed(*args, **kwargs):
        raise AssertionError("the mode choice timed the machine")

    import art_malleability.influence._ntk_mode as mode_rule

    monkeypatch.setattr(memory, "gemm_rate", timed)  # the one timing function of the plan's module
    # the rule's module has no clock and no timing function to call
    assert not any(hasattr(mode_rule, name) for name in ("gemm_rate", "time", "perf_counter"))
    assert not hasattr(ntk_module, "gemm_rate")
    first = NTKInfluence(device="cpu").fit(clf.model, data.x_train, data.y_train)
    again = NTKInfluence(device="cpu").fit(clf.model, data.x_train, data.y_train)
    assert first.mode_ == "exact" and first.mode_reason_ == again.mode_reason_
    rate, facts = memory.nominal_gemm_rate(first.device_)
    assert rate > 1e9 and "thread" in facts and f"{rate / 1e9:.0f} GFLOP/s" in first.mode_reason_


def test_the_exact_budget_covers_the_planned_refits_and_queries(relu_data):
    """A budget that holds the fit and one refit but not the audit's work no longer chooses the exact mode."""
    clf, data = relu_data
    light = NTKInfluence(device="cpu", planned_refits=1, planned_queries=0)
    light.fit(clf.model, data.x_train, data.y_train)
    heavy = NTKInfluence(device="cpu", planned_refits=8, planned_queries=10_000)
    heavy.fit(clf.model, data.x_train, data.y_train)
    light_s, heavy_s = light.estimated_seconds_["exact"], heavy.estimated_seconds_["exact"]
    assert heavy_s > 10 * light_s
    budget = (light_s * heavy_s) ** 0.5
    light = NTKInfluence(device="cpu", planned_refits=1, planned_queries=0, exact_budget_s=budget)
    heavy = NTKInfluence(device="cpu", planned_refits=8, planned_queries=10_000, exact_budget_s=budget)
    for est in (light, heavy):
        est.fit(clf.model, data.x_train, data.y_train)
    assert light.mode_ == "exact" and "within exact_budget_s" in light.mode_reason_
    assert "over exact_budget_s" in heavy.mode_reason_  # the planned work is what the budget is held against
    assert "8 refit(s) and the scores of 10000 queries" in heavy.mode_reason_
    seconds = heavy.estimated_seconds_  # projected only where it is estimated shorter than the exact mode
    assert heavy.mode_ == ("projected" if seconds["projected"] < seconds["exact"] else "exact")
    with pytest.raises(ValueError, match="planned_refits must be a non-negative integer"):
        NTKInfluence(planned_refits=-1)


def test_the_audit_plans_its_own_work_records_why_and_leaves_the_estimator_as_given(relu_data):
    clf, data = relu_data
    influence = NTKInfluence(device="cpu")
    audit = MalleabilityEstimator(clf, attacks=["fgsm", "pgd"], influence=influence, control_draws=3, n_queries=15,
                                  n_bootstrap=50, verbose=False, device="cpu")
    report = audit.evaluate(data.x_train, data.y_train, data.x_test, data.y_test)
    reason = report.execution["mode_reason"]
    assert reason.startswith("exact: projection_dim='auto'"), reason
    assert "5 refit(s) and the scores of 15 queries" in reason  # 2 attacks, 3 draws of their shared control
    assert (influence.planned_refits, influence.planned_queries) == (1, 100)


def test_the_mode_rule_is_a_pure_function_of_sizes_options_and_facts():
    """No model, no device query, no clock: the same facts always choose the same mode, for the reasons stated."""
    from art_malleability.influence._ntk_mode import (
        MachineFacts,
        ModelFacts,
        ModeOptions,
        choose_mode,
        needs_model_facts,
    )

    cpu = torch.device("cpu")
    machine = MachineFacts(cpu, world=1, budget=8 * 2**30, budget_text="a test budget", rate=1e10, rate_text="test")
    model = ModelFacts(factor=2000, example_bytes=16_000, batch_size=256, chunk_mb=64.0, panel=1000,
                       example_seconds=1e-4)
    given = choose_mode(1000, ModeOptions(projection_dim=64), machine, None)
    assert (given.mode, given.seconds) == ("projected", None) and "projection_dim=64 was given" in given.reason
    assert not needs_model_facts(ModeOptions(projection_dim=64), False) and needs_model_facts(ModeOptions(), False)
    small = choose_mode(1000, ModeOptions(), machine, model)
    assert small.mode == "exact" and small.plan == (None, False) and small.kept_bytes == 1000 * 16_000
    assert small == choose_mode(1000, ModeOptions(), machine, model)  # the same facts, the same choice
    assert small.seconds["exact"] < 1800 and "within exact_budget_s=1800 s" in small.reason
    # over the budget, the projected mode runs only where it is estimated shorter (a new user's --time-budget 0.01
    # had switched to a projected mode estimated at 16 s where the exact one was estimated at 1 s)
    over = choose_mode(1000, ModeOptions(exact_budget_s=small.seconds["exact"] / 2), machine, model)
    assert over.seconds["projected"] > over.seconds["exact"]
    assert over.mode == "exact" and "over exact_budget_s" in over.reason and "would take longer" in over.reason
    wide = ModelFacts(factor=2_000_000, example_bytes=16_000, batch_size=256, chunk_mb=64.0, panel=1000,
                      example_seconds=1e-4)
    large = choose_mode(20_000, ModeOptions(), machine, wide)
    assert large.seconds["projected"] < large.seconds["exact"]
    slow = choose_mode(20_000, ModeOptions(exact_budget_s=large.seconds["exact"] / 2), machine, wide)
    assert slow.mode == "projected" and "over exact_budget_s" in slow.reason and "projection_dim=None" in slow.note
    capped = choose_mode(1000, ModeOptions(max_exact_n=999), machine, model)
    assert capped.mode == "projected" and "exceed max_exact_n=999" in capped.reason
    # more planned work raises the estimate; a group of four shares it
    busy = choose_mode(1000, ModeOptions(planned_refits=8, planned_queries=4000), machine, model)
    assert busy.seconds["exact"] > small.seconds["exact"]
    four = MachineFacts(cpu, world=4, budget=8 * 2**30, budget_text="a test budget", rate=1e10, rate_text="test")
    assert choose_mode(1000, ModeOptions(), four, model).seconds["exact"] < small.seconds["exact"]
    # a budget too small for the dense solve takes tiles; one too small for anything refuses projection_dim=None
    tight = MachineFacts(cpu, world=1, budget=30 * 2**20, budget_text="30 MiB", rate=1e10, rate_text="test")
    assert choose_mode(1000, ModeOptions(projection_dim=None), tight, model).plan[0] is not None
    # tiles keep the set's factors where they fit half of what the tiles leave (each example's computed once)
    from art_malleability.influence.ntk_memory import plan_bytes

    four_gib = MachineFacts(cpu, world=1, budget=4 * 2**30, budget_text="4 GiB", rate=1e10, rate_text="test")
    tiled = choose_mode(20_000, ModeOptions(projection_dim=None), four_gib, model)
    left = 4 * 2**30 - plan_bytes(tiled.plan, 20_000, cpu, 1, tiled.reserve)
    assert tiled.plan == (tiled.plan[0], False) and tiled.plan[0] is not None and 20_000 * 16_000 <= left // 2
    assert tiled.kept_bytes == 20_000 * 16_000 and tiled.factor_cache >= 2**30
    heavy = ModelFacts(factor=2000, example_bytes=left // 20_000, batch_size=256, chunk_mb=64.0, panel=1000,
                       example_seconds=1e-4)
    assert choose_mode(20_000, ModeOptions(projection_dim=None), four_gib, heavy).kept_bytes == 0
    tiny = MachineFacts(cpu, world=1, budget=2**10, budget_text="1 KiB", rate=1e10, rate_text="test")
    with pytest.raises(ValueError, match="projection_dim must be 'auto' or an integer"):
        choose_mode(1000, ModeOptions(projection_dim=None), tiny, model)
    assert "does not fit" in choose_mode(1000, ModeOptions(), tiny, model).reason
