"""
Every statistic the audit reports, checked like code: simulations with known truth measure each interval's
coverage and each estimator's bias, power and false-positive rate (``statistics_harness.py``; larger runs and the
numbers of docs/metrics.md: ``python benchmarks/statistics_coverage.py``). Nominal coverage is 95 %; the target
band is 90-98 % where the estimand is identifiable.
"""

import numpy as np
import pytest
import statistics_harness as H
from planted import Planted

from art_malleability import metrics as M

pytestmark = pytest.mark.slow

#: The issue's planted design: 100 queries x 1,000 examples, 100 influential at 1.6-3 standard errors, the perturbed
#: noise correlated 0.9 with the clean one.
ISSUE = {"n_query": 100, "n_train": 1000, "n_influential": 100, "lo": 1.6, "hi": 3.0, "rho": 0.9}


@pytest.fixture(scope="module")
def planted_sets():
    """The noise-aware rate on the planted influential set itself (the estimand's set is known exactly)."""
    return {flips: H.noise_aware(Planted(**ISSUE, flips=flips), reps=20, selected=False, seed=1)
            for flips in (0.3, 0.0)}


@pytest.fixture(scope="module")
def selected_sets():
    """The same, with the set chosen from the noisy clean aggregates, as the audit chooses it."""
    return {flips: H.noise_aware(Planted(**ISSUE, flips=flips), reps=20, selected=True, seed=2)
            for flips in (0.3, 0.0)}


def test_the_noise_aware_rate_finds_planted_flips(planted_sets):
    flips = planted_sets[0.3]["aware"]
    print(flips.line())
    assert np.mean(flips.truth) == pytest.approx(0.3)
    assert flips.max_error <= 0.08 and abs(flips.bias) <= 0.03
    assert flips.coverage >= 0.9


def test_the_noise_aware_rate_stays_near_zero_without_flips(planted_sets):
    none = planted_sets[0.0]["aware"]
    print(none.line())
    assert np.mean(none.estimate) <= 0.05 and np.quantile(none.estimate, 0.9) <= 0.05
    assert none.coverage >= 0.9


def test_the_noise_aware_rate_on_a_selected_set(selected_sets):
    """Selection by noisy aggregates brings members near zero into the set: the truth is below 0.3."""
    flips, none = selected_sets[0.3]["aware"], selected_sets[0.0]["aware"]
    print(flips.line())
    print(none.line())
    assert flips.max_error <= 0.08 and abs(flips.bias) <= 0.03 and flips.coverage >= 0.9
    assert np.mean(none.estimate) <= 0.05 and none.coverage >= 0.9


@pytest.mark.parametrize("design", [{"flips": 0.5, "lo": 0.5, "hi": 2.0}, {"flips": 0.3, "shrink": 0.25}])
def test_the_noise_aware_interval_holds_where_signs_are_hard_to_decide(design):
    """Weak influence (0.5-2 standard errors) with half the set flipped, and perturbed aggregates shrunk to a quarter:
    the regimes where the bootstrap interval this replaced covered 0.53-0.65. The profile likelihood's interval is
    wide there (the flip share is only partly identified) and covers."""
    runs = H.noise_aware(Planted(**{**ISSUE, **design}), reps=20, selected=True, seed=4)
    print(design, runs["aware"].line())
    assert runs["aware"].coverage >= 0.9


@pytest.mark.parametrize("noise", ["student-t(3)", "dominant queries"])
def test_the_noise_aware_interval_holds_with_heavy_tailed_query_noise(noise, monkeypatch):
    """Query noise that is not normal (Student-t with 3 degrees of freedom; 5 of 100 queries with ten times the spread)
    makes each member's estimated standard error noisy, and its standardised aggregate heavier-tailed than a normal:
    the likelihood takes it as Student-t with the degrees of freedom the scores' kurtosis gives. Unflipped members
    shrunk to a half, 30 % flipped at full size: on the same draws, the normal likelihood's interval covers 0.77 and
    0.73 (the grid of docs/metrics.md: 0.78-0.81 over 200 draws)."""
    import math

    from planted import DominantQueries

    from art_malleability.metrics._flip_posterior import PairedSums

    design = {**ISSUE, "lo": 2.5, "hi": 3.2, "flips": 0.3, "shrink": 0.5, "flip_shrink": 1.0}
    planted = Planted(**design, student_df=3.0) if noise == "student-t(3)" else DominantQueries(**design)
    runs = H.noise_aware(planted, reps=30, selected=True, seed=7)["aware"]
    monkeypatch.setattr(PairedSums, "noise_dof", lambda self: math.inf)  # the normal likelihood, for comparison
    normal = H.noise_aware(planted, reps=30, selected=True, seed=7)["aware"]
    print(noise, runs.line(), "| normal likelihood:", normal.line())
    assert runs.coverage >= 0.9 and runs.coverage >= normal.coverage + 0.1 and abs(runs.bias) <= 0.03


@pytest.mark.xfail(strict=True, reason="the noise-aware interval covers the weakly identified range of flip shares, "
                   "so it overshoots 0.98 where the truth lies inside it (docs/metrics.md, measured coverage)")
def test_the_noise_aware_interval_stays_below_the_bands_upper_end_where_signs_are_hard_to_decide():
    """The target band's upper end (0.98), on a design where the truth lies inside the range the data cannot narrow
    (weak influence, the set selected): not met. Strict: should a change bring it into the band, this reports it."""
    runs = H.noise_aware(Planted(**{**ISSUE, "lo": 0.5, "hi": 2.0, "flips": 0.3}), reps=20, selected=True, seed=5)
    print(runs["aware"].line(), "misses (above, below):", runs["aware"].misses)
    assert 0.90 <= runs["aware"].coverage <= 0.98


def test_the_noise_aware_intervals_ends_are_where_the_data_put_them():
    """
    Weak influence, 30 % flips, the planted set: redrawn from the constrained fit at each end of the interval, the
    likelihood-ratio test at that end's flip mass is not far from its level (neither grossly conservative, which would
    let the end move in, nor liberal), and the upper end is forced by the data: its fit, with a larger flip share than
    the truth, gives an estimate at most the observed one in a good share of the draws (the flip share is only partly
    identified, so an interval that holds under every fit the data allow covers more than 95 % of the truths inside).
    """
    ends = H.interval_ends(Planted(**{**ISSUE, "lo": 0.5, "hi": 2.0, "flips": 0.3}), draws=20, seed=3)
    print(ends)
    assert ends["interval"]["low"] <= ends["interval"]["truth"] <= ends["interval"]["high"]
    for end in ("low", "high"):
        assert 0.4 <= ends[end]["deviance"] <= 2.5 and ends[end]["beyond_critical"] <= 0.25
    assert ends["high"]["s"] >= ends["interval"]["truth"] + 0.05 and ends["high"]["far_side"] >= 0.2


def test_the_no_flip_test_has_power_and_holds_its_level(planted_sets, selected_sets):
    critical = 3.841  # chi-square, one degree of freedom, 95 %
    for runs in (planted_sets, selected_sets):
        false_positive = np.mean(np.asarray(runs[0.0]["lr"]) > critical)
        power = np.mean(np.asarray(runs[0.3]["lr"]) > critical)
        print(f"no-flip test: false-positive rate {false_positive:.2f}, power {power:.2f}")
        assert false_positive <= 0.05 and power >= 0.9


def test_the_raw_rate_reads_against_its_null_expectation():
    """Perturbed aggregates shrunk to a quarter, no flip: the raw rate is noise, and its null expectation says so."""
    runs = H.noise_aware(Planted(**ISSUE, flips=0.0, shrink=0.25), reps=12, selected=True, seed=3)
    raw, null = np.mean(runs["raw"]), np.mean(runs["null"])
    print(f"shrink 0.25, no flip: raw {raw:.3f}, null expectation {null:.3f}, noise-aware {runs['aware'].line()}")
    assert null == pytest.approx(raw, abs=0.05)
    assert runs["aware"].coverage >= 0.8


@pytest.mark.parametrize("design", [{"flips": 0.0, "shrink": 0.25}, {"flips": 0.3}])
def test_the_retention_its_control_and_excess_hold_their_coverage(design):
    """Selection-corrected retention (truth 0.25 shrunk, about 0.4 with 30 % flips), the five-draw control at a
    quarter (truth 0.25) and the excess (0 when shrunk: its false-positive rate; with flips: its power)."""
    runs = H.retention(Planted(**{**ISSUE, **design}), reps=60, seed=6)
    for name, coverage in runs.items():
        print(design, coverage.line())
        if name.startswith("plug-in"):  # what it replaced: far below (docs/metrics.md)
            assert coverage.coverage <= 0.5
            continue
        assert coverage.coverage >= 0.88 and abs(coverage.bias) <= 0.05  # 60 repetitions: 0.96 reads 0.88-1.00
    excess = runs["excess retention"]
    rejects = np.mean((np.asarray(excess.low) > 0) | (np.asarray(excess.high) < 0))
    print(f"excess retention: interval excludes 0 in {rejects:.2f}")
    assert rejects <= 0.1 if design["flips"] == 0.0 else rejects >= 0.8


@pytest.mark.parametrize(
    "design",
    [
        {"flips": 0.0, "shrink": 0.25},  # the audit's regime: aggregates shrunk to a quarter
        {"flips": 0.3, "rho": 0.5},
        {"flips": 0.3},
    ],
)
def test_raw_rate_overlap_and_excess_intervals_hold_their_coverage(design):
    runs = H.resampled_statistics(Planted(n_train=400, n_influential=40, **design), reps=300, seed=4)
    for coverage in runs.values():
        print(design, coverage.line())
    assert 0.90 <= runs["flip rate"].coverage <= 0.985
    assert 0.90 <= runs["excess flip rate"].coverage <= 0.99  # the spread between control draws is counted in full
    # the top-k overlap's bootstrap variance is scaled by the tie ratio (docs/metrics.md)
    assert 0.90 <= runs["top-k Jaccard"].coverage <= 0.98


def test_the_tie_variance_ratio_is_what_the_bootstrap_misses_at_a_tie():
    """
    The indicator that one mean exceeds another with equal population means: its variance over query samples is
    1/4, its bootstrap variance averages 1/6 (the ratio the Jaccard's interval scales by); a standard error and a
    half from the tie the bootstrap overstates instead.
    """
    rng = np.random.default_rng(8)
    reps, n_query, n_bootstrap = 4000, 40, 200
    ratios = {}
    for gap in (0.0, 1.5):  # in standard errors of the difference of the two means
        scores = rng.standard_normal((reps, n_query, 2)) + np.array([gap * np.sqrt(2.0 / n_query), 0.0])
        real = (scores[..., 0].mean(1) > scores[..., 1].mean(1)).var()
        boot = np.empty(reps)
        for rep in range(reps):
            resampled = scores[rep][rng.integers(0, n_query, (n_bootstrap, n_query))].mean(1)
            boot[rep] = (resampled[:, 0] > resampled[:, 1]).var(ddof=1)
        ratios[gap] = real / boot.mean()
        print(f"gap {gap} SE: variance over samples {real:.4f}, mean bootstrap variance {boot.mean():.4f}")
    assert ratios[0.0] == pytest.approx(M.TIE_VARIANCE_RATIO, rel=0.05)
    assert ratios[1.5] < 0.85  # analytically 0.70: away from the tie the bootstrap overstates


@pytest.mark.parametrize("design", [{"flips": 0.3, "rho": 0.5}, {"flips": 0.0, "shrink": 0.25, "rho": 0.3}])
def test_spearman_and_per_query_intervals_hold_their_coverage(design):
    runs = H.spearman_and_per_query(Planted(n_query=60, n_train=300, n_influential=30, **design), reps=150, seed=5)
    for coverage in runs.values():
        print(design, coverage.line())
        assert 0.90 <= coverage.coverage <= 0.985


def test_pooling_over_seeds_holds_its_coverage():
    pooled = H.seed_pooling(reps=2000, seed=6)
    print(pooled.line())
    assert 0.93 <= pooled.coverage <= 0.97


def test_the_lds_interval_resamples_models_and_queries():
    lds = H.lds(reps=120, seed=7)
    print(lds.line())
    assert 0.90 <= lds.coverage <= 0.99  # the two-way bootstrap counts the interaction twice: it leans wide
