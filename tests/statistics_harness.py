"""
Simulations with known truth for every statistic the audit reports: each function plants a population, draws
repeated samples from it, and returns what the statistic and its interval did (estimates, truths, coverage). The
tests (``test_statistics.py``) run them at CI sizes and check the targets; ``benchmarks/statistics_coverage.py``
runs them larger for the numbers in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from planted import Planted, true_flip_share
from scipy.stats import chi2

from art_malleability import metrics as M
from art_malleability.metrics._flip_posterior import FlipPosterior
from art_malleability.metrics._summary import EB_LOADINGS, _eb_variance, _interval, replicated
from art_malleability.metrics.accumulators import CleanScores, PerturbedScores
from art_malleability.validation.lds import linear_datamodeling_score


@dataclass
class Coverage:
    """What one simulated statistic did over the repetitions."""

    name: str
    truth: list[float] = field(default_factory=list)
    estimate: list[float] = field(default_factory=list)
    low: list[float] = field(default_factory=list)
    high: list[float] = field(default_factory=list)

    def add(self, truth: float, estimate: float, interval: tuple[float, float]) -> None:
        self.truth.append(float(truth))
        self.estimate.append(float(estimate))
        self.low.append(float(interval[0]))
        self.high.append(float(interval[1]))

    @property
    def coverage(self) -> float:
        t, lo, hi = (np.asarray(v) for v in (self.truth, self.low, self.high))
        return float(np.mean((lo <= t) & (t <= hi)))

    @property
    def misses(self) -> tuple[float, float]:
        """The shares of intervals wholly above the truth and wholly below it."""
        t, lo, hi = (np.asarray(v) for v in (self.truth, self.low, self.high))
        return float(np.mean(lo > t)), float(np.mean(hi < t))

    @property
    def bias(self) -> float:
        return float(np.mean(np.asarray(self.estimate) - np.asarray(self.truth)))

    @property
    def max_error(self) -> float:
        return float(np.max(np.abs(np.asarray(self.estimate) - np.asarray(self.truth))))

    @property
    def width(self) -> float:
        return float(np.mean(np.asarray(self.high) - np.asarray(self.low)))

    def line(self) -> str:
        return (f"{self.name}: truth {np.mean(self.truth):.3f}, estimate {np.mean(self.estimate):.3f} (bias "
                f"{self.bias:+.3f}, max error {self.max_error:.3f}), coverage {self.coverage:.2f}, width "
                f"{self.width:.3f} ({len(self.truth)} repetitions)")


def replicates(before: np.ndarray, afters: list[np.ndarray], top: np.ndarray | None, n_bootstrap: int,
               seed: int, spearman: bool = False) -> list[tuple[dict, dict]]:
    """The statistics with replicates of a clean matrix against each perturbed one, as the audit computes them."""
    clean = CleanScores(M.QueryResampling(len(before), n_bootstrap, seed), before.shape[1], given=before)
    clean.add(before)
    clean.finish(top)
    out = []
    for after in afters:
        perturbed = PerturbedScores(clean)
        perturbed.add(after)
        out.append(replicated(perturbed, spearman))
    return out


def _posterior_draw(design: Planted, rng: np.random.Generator, selected: bool = True) -> tuple:
    """One draw of a planted design and the noise-aware posterior of its set, chosen from the noisy clean aggregates
    as the audit chooses it (``selected``) or the planted influential examples themselves.

    :return: ``(mu_b, mu_a, before, after, top, posterior)``.
    """
    mu_b, mu_a = design.population(rng)
    before, after = design.sample(rng, mu_b, mu_a)
    if selected:
        top = M.top_indices(M.aggregate_scores(before), design.n_influential)
        threshold = M.selection_threshold(before, top)
    else:
        top, threshold = np.flatnonzero(mu_b), None
    return mu_b, mu_a, before, after, top, FlipPosterior.from_scores(before, after, top, threshold)


def noise_aware_draw(design: Planted, rng: np.random.Generator) -> tuple[float, float, float, float, float]:
    """
    One draw of a planted design, the set selected from the noisy clean aggregates as the audit selects it.

    :return: The true flip share of the set, the noise-aware estimate, its 95 % interval's ends and the set's
        undecided share.
    """
    mu_b, mu_a, _, _, top, posterior = _posterior_draw(design, rng)
    low, high = posterior.interval(0.95)
    return true_flip_share(mu_b, mu_a, top), posterior.estimate(), low, high, posterior.undecided_share()


def noise_aware(design: Planted, reps: int, selected: bool, seed: int = 0) -> dict:
    """
    The noise-aware flip rate on planted populations: its estimate and interval against the true share of the set
    whose population aggregates change sign, the raw flip rate against its null expectation, and the no-flip test.

    :param selected: The set chosen from the noisy clean aggregates (as the audit does) or the planted influential
        examples themselves.
    """
    rng = np.random.default_rng(seed)
    out = {"aware": Coverage("noise-aware flip rate"), "raw": [], "null": [], "lr": []}
    for _ in range(reps):
        mu_b, mu_a, before, after, top, posterior = _posterior_draw(design, rng, selected)
        interval = posterior.interval(0.95)
        out["aware"].add(true_flip_share(mu_b, mu_a, top), posterior.estimate(), interval)
        out["raw"].append(M.flip_rate(before, after, top=top))
        out["null"].append(posterior.null_raw_flip_rate())
        out["lr"].append(posterior.no_flip_statistic())
    return out


def interval_ends(design: Planted, draws: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """
    Why the noise-aware interval covers more than 95 %: one population and sample (the planted set, no selection),
    its interval, and for each end the constrained fit ``Ĝ_s`` there. From each end's fit, ``draws`` new sets are
    drawn (each member's population aggregates from ``Ĝ_s``, its queries as in ``design``) and refitted; returned per
    end: the generating flip mass ``s``, the deviance at ``s`` (mean, 95 % quantile, share beyond ``χ²₁(0.95)``:
    how the likelihood-ratio test behaves at that end), and the share of draws whose estimate lies on the far side of
    the observed one (at least it for the lower end, at most it for the upper). An end whose draws give the observed
    estimate often is forced by the data (the flip share is only partly identified there); an end where they never
    do, with deviances below the critical value, could move in without losing coverage.
    """
    rng = np.random.default_rng(seed)
    mu_b, mu_a = design.population(rng)
    before, after = design.sample(rng, mu_b, mu_a)
    top = np.flatnonzero(mu_b)
    posterior = FlipPosterior.from_scores(before, after, top, None)
    low, high = posterior.interval(0.95)
    shares, weights, total = posterior.profile()
    accepted = np.flatnonzero(2.0 * (posterior._best_loglik() - total) <= chi2.ppf(0.95, 1))
    members = replace(design, n_train=top.size)
    out = {"interval": {"low": low, "high": high, "estimate": posterior.estimate(),
                        "truth": true_flip_share(mu_b, mu_a, top)}}
    for name, end in (("low", accepted[0]), ("high", accepted[-1])):
        deviances, estimates = [], []
        for _ in range(draws):
            atoms = rng.choice(weights[end].size, top.size, p=weights[end] / weights[end].sum())
            se = 1.0 / np.sqrt(design.n_query)  # the planted noise has unit variance per query
            redrawn = FlipPosterior.from_scores(*members.sample(rng, posterior.u[atoms] * se, posterior.v[atoms] * se),
                                                np.arange(top.size), None)
            _, at_s = redrawn.constrained_fits(shares[end:end + 1])
            deviances.append(max(0.0, 2.0 * (redrawn._best_loglik() - float(at_s[0]))))
            estimates.append(redrawn.estimate())
        deviances, estimates = np.asarray(deviances), np.asarray(estimates)
        far = estimates >= out["interval"]["estimate"] if name == "low" else estimates <= out["interval"]["estimate"]
        out[name] = {"s": float(shares[end]), "deviance": float(deviances.mean()),
                     "deviance_95": float(np.quantile(deviances, 0.95)),
                     "beyond_critical": float(np.mean(deviances > chi2.ppf(0.95, 1))), "far_side": float(far.mean())}
    return out


def resampled_statistics(design: Planted, reps: int, seed: int = 0, n_bootstrap: int = 300, truth_draws: int = 300,
                         control_draws: int = 5, control_spread: float = 0.5) -> dict[str, Coverage]:
    """
    The raw flip rate and the top-k Jaccard (normal intervals; estimand: their expected value at this number of
    queries, the influential set fixed), and the excess over a random-sign control of ``control_draws`` draws (each
    draw moves every population aggregate by its own ``N(0, control_spread²)`` standard errors; estimand: the
    attack's expected flip rate minus the control's, over queries and draws).
    """
    rng = np.random.default_rng(seed)
    mu_b, mu_a = design.population(rng)
    pilot, _ = design.sample(rng, mu_b, mu_a)
    top = M.top_indices(M.aggregate_scores(pilot), design.n_influential)
    se = 1.0 / np.sqrt(design.n_query)
    control_mu = 0.25 * mu_b

    def control_draw() -> np.ndarray:
        return control_mu + control_spread * se * rng.standard_normal(design.n_train)

    def raw_and_jaccard(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
        return M.flip_rate(before, after, top=top), M.top_k_jaccard(before, after, top=top)

    truths = np.array([raw_and_jaccard(*design.sample(rng, mu_b, mu_a)) for _ in range(truth_draws)])
    control_truth = np.mean([M.flip_rate(*design.sample(rng, mu_b, control_draw()), top=top)
                             for _ in range(truth_draws)])
    out = {name: Coverage(name) for name in ("flip rate", "top-k Jaccard", "excess flip rate")}
    for rep in range(reps):
        e_b = design.noise(rng)
        before = mu_b + e_b

        def paired(mu: np.ndarray, e_b: np.ndarray = e_b) -> np.ndarray:
            return mu + design.rho * e_b + np.sqrt(1 - design.rho**2) * design.noise(rng)

        after = paired(mu_a)
        (points, draws), *controls = replicates(
            before, [after, *(paired(control_draw()) for _ in range(control_draws))], top, n_bootstrap, rep
        )
        for name, key, truth in (("flip rate", "flip_rate", truths[:, 0].mean()),
                                 ("top-k Jaccard", "top_k_jaccard", truths[:, 1].mean())):
            out[name].add(truth, points[key], _interval(key, points[key], draws[key], 0.95))
        rates = np.array([c[0]["flip_rate"] for c in controls])
        mean_draws = np.mean([c[1]["flip_rate"] for c in controls], axis=0)
        excess = points["flip_rate"] - rates.mean()
        interval = M.normal_interval(excess, draws["flip_rate"] - mean_draws, 0.95, (-1.0, 1.0),
                                     extra_variance=float(np.var(rates, ddof=1)) / control_draws)
        out["excess flip rate"].add(truths[:, 0].mean() - control_truth, excess, interval)
    return out


def retention(design: Planted, reps: int, seed: int = 0, n_bootstrap: int = 200, control_draws: int = 5,
              control_spread: float = 0.5, control_share: float = 0.25, selected: bool = True) -> dict[str, Coverage]:
    """
    The signed retention, its random-sign control and the excess, as the audit combines them (the control: the mean
    of ``control_draws`` draws, each moving the population aggregates to ``control_share · μ_b`` plus its own
    ``N(0, control_spread²)`` standard errors). A new population and sample in every repetition; the set is chosen
    from the sample's clean aggregates (``selected``) or is the planted influential examples. Estimands, with the
    set ``T`` and the measured clean signs ``s``: ``R = Σ_T s μ_a / Σ_T s μ_b``; the control's, its expectation over
    draws, ``Σ_T s control_share μ_b / Σ_T s μ_b``; the excess, their difference.
    """
    rng = np.random.default_rng(seed)
    se = 1.0 / np.sqrt(design.n_query)
    out = {name: Coverage(name) for name in ("retention", "control retention", "excess retention",
                                             "plug-in retention (not used)")}
    name = "signed_retention"
    for rep in range(reps):
        mu_b, mu_a = design.population(rng)
        e_b = design.noise(rng)
        before = mu_b + e_b

        def paired(mu: np.ndarray, e_b: np.ndarray = e_b) -> np.ndarray:
            return mu + design.rho * e_b + np.sqrt(1 - design.rho**2) * design.noise(rng)

        controls_mu = [control_share * mu_b + control_spread * se * rng.standard_normal(design.n_train)
                       for _ in range(control_draws)]
        clean = CleanScores(M.QueryResampling(design.n_query, n_bootstrap, rep), design.n_train, given=before)
        clean.add(before)
        clean.finish(None if selected else np.flatnonzero(mu_b))
        passes, passes_top, after = [], [], paired(mu_a)
        for perturbed_scores in (after, *(paired(mu) for mu in controls_mu)):
            perturbed = PerturbedScores(clean)
            perturbed.add(perturbed_scores)
            passes.append(replicated(perturbed, spearman=False, selected=selected))
            passes_top.append(perturbed.resampled_top())
        (point, draws), controls = passes[0], passes[1:]
        signs = np.sign(clean.aggregates[clean.top])
        denominator = np.sum(signs * mu_b[clean.top])
        truth = np.sum(signs * mu_a[clean.top]) / denominator
        control_truth = np.sum(signs * control_share * mu_b[clean.top]) / denominator
        out["retention"].add(truth, point[name], _interval(name, point[name], draws[name], 0.95,
                                                           _eb_variance(name, draws)))
        # what the corrected estimator replaced: the measured aggregates' ratio, bootstrap normal interval
        boot_b, boot_a = (t.numpy() for t in passes_top[0])
        plug_in = np.sum(signs * np.nanmean(after, 0)[clean.top]) / np.sum(signs * clean.aggregates[clean.top])
        replicates = (boot_a @ signs) / (boot_b @ signs)
        out["plug-in retention (not used)"].add(truth, plug_in, M.normal_interval(plug_in, replicates, 0.95,
                                                                                   (-np.inf, np.inf)))
        # the control and the excess as combine_controls and pass_metrics combine them
        values = np.array([c[0][name] for c in controls])
        mean = {key: np.mean([c[1][key] for c in controls], axis=0) for key in (name, EB_LOADINGS)}
        between = float(np.var(values, ddof=1)) / control_draws
        out["control retention"].add(control_truth, values.mean(), _interval(
            name, values.mean(), mean[name], 0.95, between + _eb_variance(name, mean)))
        difference = {key: draws[key] - mean[key] for key in (name, EB_LOADINGS)}
        excess = point[name] - values.mean()
        out["excess retention"].add(truth - control_truth, excess, M.normal_interval(
            excess, difference[name], 0.95, (-np.inf, np.inf), extra_variance=between + _eb_variance(name, difference)))
    return out


def spearman_and_per_query(design: Planted, reps: int, seed: int = 0, n_bootstrap: int = 500,
                           pool: int = 20000) -> dict[str, Coverage]:
    """
    Spearman's correlation (delete-a-group jackknife over the queries) and the per-query flip rate (Student-t):
    estimands are their population values, computed on a pool of ``pool`` queries.
    """
    rng = np.random.default_rng(seed)
    mu_b, mu_a = design.population(rng)
    big_b, big_a = design.sample(rng, mu_b, mu_a, n_query=pool)
    truth_rho = M.spearman(big_b, big_a)
    truth_per_query = float(np.nanmean(M.per_query_flip_rates(big_b, big_a)))
    out = {name: Coverage(name) for name in ("Spearman", "per-query flip rate")}
    for rep in range(reps):
        before, after = design.sample(rng, mu_b, mu_a)
        [(points, draws)] = replicates(before, [after], None, 2, rep, spearman=True)
        out["Spearman"].add(truth_rho, points["spearman"],
                            _interval("spearman", points["spearman"], draws["spearman"], 0.95))
        per_query = M.per_query_flip_rates(before, after)
        out["per-query flip rate"].add(truth_per_query, np.nanmean(per_query), M.t_interval(per_query))
    return out


def seed_pooling(reps: int, n_seeds: int = 5, seed_sd: float = 0.04, query_sd: float = 0.03,
                 seed: int = 0) -> Coverage:
    """
    Pooling over training seeds: each seed's statistic is its own expected value (spread ``seed_sd`` around the
    overall one) plus query noise (``query_sd``); estimand: the overall expected value.
    """
    rng = np.random.default_rng(seed)
    out = Coverage("pooled over seeds")
    for _ in range(reps):
        points = 0.3 + seed_sd * rng.standard_normal(n_seeds) + query_sd * rng.standard_normal(n_seeds)
        mean, interval = M.seed_interval(points)
        out.add(0.3, mean, interval)
    return out


def lds(reps: int, n_models: int = 30, n_query: int = 40, n_train: int = 200, seed: int = 0,
        n_bootstrap: int = 300, truth_reps: int = 400) -> Coverage:
    """
    The LDS interval (two-way bootstrap over models and queries) on a linear datamodel: each query's outcome of a
    subset model is ``-(Σ_{i∈S} τ_q,i) + noise``, the estimator's scores are ``τ`` plus estimation error;
    estimand: the expected LDS of ``n_models`` models over the query population.
    """
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(n_train)

    def one(resamples: int = n_bootstrap) -> tuple[float, tuple[float, float]]:
        true = base + 0.8 * rng.standard_normal((n_query, n_train))  # each query's own influence
        scores = true + 1.5 * rng.standard_normal(true.shape)
        masks = rng.random((n_models, n_train)) < 0.5
        outcomes = -(masks @ true.T) + 6.0 * rng.standard_normal((n_models, n_query))
        result = linear_datamodeling_score(scores, masks, outcomes, n_bootstrap=resamples, seed=int(rng.integers(1e9)))
        return result.mean, result.ci

    truth = float(np.mean([one(1)[0] for _ in range(truth_reps)]))
    out = Coverage("LDS")
    for _ in range(reps):
        mean, interval = one()
        out.add(truth, mean, interval)
    return out
