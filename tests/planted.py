"""
Planted influence matrices with known truth, for the simulations that measure the statistics' bias, coverage,
power and false-positive rate (``tests/test_statistics_coverage.py``).

A *population* of paired clean/perturbed scores: every training example ``j`` has population aggregates
``(μ_b[j], μ_a[j])`` (the means over infinitely many queries); ``n_influential`` of them sit ``lo``–``hi`` standard
errors (of a mean over ``n_query`` queries) from zero with random signs, the others at 0. A share ``flips`` of the
influential ones changes sign (``μ_a = -flip_shrink · μ_b``; ``flip_shrink=None``: ``shrink``), the others keep it
(``μ_a = shrink · μ_b``: an attack shrinks the ones it does not flip towards zero, as attacks and random controls do,
while those it flips may keep their size). Per-query
scores are the population aggregates plus noise with unit variance (``student_df``: Student-t noise of that many
degrees of freedom, scaled to unit variance; ``None``: normal), the perturbed noise correlated ``rho`` with the clean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Planted:
    n_query: int = 100
    n_train: int = 1000
    n_influential: int = 100
    lo: float = 1.6
    hi: float = 3.0
    flips: float = 0.3
    shrink: float = 1.0
    rho: float = 0.9
    student_df: float | None = None
    flip_shrink: float | None = None

    def population(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """:return: The population aggregates ``(μ_b, μ_a)``."""
        se = 1.0 / np.sqrt(self.n_query)
        mu_b = np.zeros(self.n_train)
        chosen = rng.choice(self.n_train, self.n_influential, replace=False)
        signs = rng.choice([-1.0, 1.0], self.n_influential)
        mu_b[chosen] = rng.uniform(self.lo, self.hi, self.n_influential) * se * signs
        mu_a = self.shrink * mu_b
        flipped = rng.choice(chosen, int(round(self.flips * self.n_influential)), replace=False)
        scale = self.shrink if self.flip_shrink is None else self.flip_shrink
        mu_a[flipped] = -scale * mu_b[flipped]
        return mu_b, mu_a

    def noise(self, rng: np.random.Generator, n_query: int | None = None) -> np.ndarray:
        n = self.n_query if n_query is None else n_query
        if self.student_df is None:
            return rng.standard_normal((n, self.n_train))
        df = self.student_df
        return rng.standard_t(df, (n, self.n_train)) / np.sqrt(df / (df - 2.0))

    def sample(self, rng: np.random.Generator, mu_b: np.ndarray, mu_a: np.ndarray, n_query: int | None = None):
        """:return: Clean and perturbed influence matrices ``(n_query, n_train)`` of one draw of queries."""
        e_b = self.noise(rng, n_query)
        e_a = self.rho * e_b + np.sqrt(1.0 - self.rho**2) * self.noise(rng, n_query)
        return mu_b + e_b, mu_a + e_a


def true_flip_share(mu_b: np.ndarray, mu_a: np.ndarray, top: np.ndarray) -> float:
    """The estimand: the share of the set whose population aggregates have strictly opposite signs."""
    return float(np.mean(mu_b[top] * mu_a[top] < 0))


class DominantQueries(Planted):
    """Planted scores where 5 % of the queries carry ten times the others' spread (a few queries dominate)."""

    def noise(self, rng: np.random.Generator, n_query: int | None = None) -> np.ndarray:
        n = self.n_query if n_query is None else n_query
        scale = np.where(np.arange(n) < max(1, n // 20), 10.0, 1.0)[:, None]
        return rng.standard_normal((n, self.n_train)) * scale / np.sqrt(np.mean(scale**2))
