"""
Spearman's rank correlation of two influence matrices, streamed in query blocks, with a delete-a-group jackknife over
the queries for its interval: cost linear in the number of queries.

The pairs. Every finite ``(query, example)`` pair enters when the matrices hold at most :data:`SPEARMAN_PAIRS` entries
(then the value is exactly :func:`art_malleability.metrics.spearman`); above, each query keeps each of its pairs
independently with probability ``p = SPEARMAN_PAIRS / (n_query · n_train)``, drawn from a generator seeded with the
audit's seed and the query's index (the same pairs however the queries are blocked and whatever else ran). The
estimand is unchanged (the correlation over the population of queries, as for the full matrix); the sampling adds
about ``1 / sqrt(SPEARMAN_PAIRS)`` (2e-3) of noise, which the jackknife sees, because each query's pairs are drawn
independently of the other queries'. That is small beside the queries' own noise in real audits, and it keeps the
correlation's cost flat beyond ``SPEARMAN_PAIRS / n_train`` queries (at 2**20 pairs it took 2.3 s per pass on one core
against 0.4 s at 2**18: the sorts leave the cache).

The interval. The queries are dealt into ``G = min(JACKKNIFE_GROUPS, n_query)`` groups by a seeded permutation; the
correlation is recomputed with each group left out (every rank recomputed exactly: after one sort per side, the
midranks without a group are a cumulative count, ``O(M)`` per group for ``M`` pairs; the clean side's sort and ranks
are kept between the passes of an audit while every pair is finite); the variance is the jackknife's,
``(G − 1)/G · Σ_g (ρ_(g) − ρ̄)²``, and the interval ``ρ ± t_{G−1} · sd`` (:func:`jackknife_interval`). Its coverage is
measured in ``tests/test_statistics.py`` (docs/metrics.md). The exact bootstrap it replaces cost ``O(n_query³)`` per
resample.
"""

from __future__ import annotations

import numpy as np
import torch

#: Largest number of (query, example) pairs the correlation is computed on exactly; above, pairs are sampled.
SPEARMAN_PAIRS = 2**18
#: Groups of queries of the delete-a-group jackknife.
JACKKNIFE_GROUPS = 20
#: Stream of the seed that draws the pairs (kept apart from the bootstrap's and the groups').
_PAIR_STREAM, _GROUP_STREAM = 0x5EA, 0x1AC


def jackknife_groups(n_query: int, seed: int) -> np.ndarray:
    """:return: The jackknife group of every query, ``(n_query,)``: a seeded permutation dealt into equal groups."""
    groups = min(JACKKNIFE_GROUPS, max(n_query, 1))
    order = np.random.default_rng([int(seed), _GROUP_STREAM]).permutation(n_query)
    out = np.empty(n_query, dtype=np.int64)
    out[order] = np.arange(n_query) % groups
    return out


class SampledPairs:
    """
    The pairs of one audit's clean scores that its correlations use: their query, training column and clean value,
    collected block by block from the clean scores; :meth:`correlation` takes the perturbed values at the same pairs.

    :param n_query: Queries.
    :param n_train: Training examples (columns).
    :param seed: The audit's seed.
    :param device: Device of the accumulated tensors.
    """

    def __init__(self, n_query: int, n_train: int, seed: int, device: torch.device) -> None:
        self.n_query, self.n_train, self.seed, self.device = n_query, n_train, int(seed), device
        self.share = min(1.0, SPEARMAN_PAIRS / max(n_query * n_train, 1))
        self.groups = torch.as_tensor(jackknife_groups(n_query, seed), device=device)
        self._rows: list[torch.Tensor] = []
        self._cols: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def _chosen(self, start: int, stop: int) -> torch.Tensor:
        """``(stop − start, n_train)`` mask of the pairs kept of these queries."""
        if self.share >= 1.0:
            return torch.ones((stop - start, self.n_train), dtype=torch.bool, device=self.device)
        mask = np.stack([
            np.random.default_rng([self.seed, _PAIR_STREAM, q]).random(self.n_train) < self.share
            for q in range(start, stop)
        ])
        return torch.as_tensor(mask, device=self.device)

    def add_clean(self, start: int, block: torch.Tensor) -> None:
        """Keep the chosen pairs of the clean scores of queries ``start, start + 1, …`` (in order)."""
        rows, cols = torch.nonzero(self._chosen(start, start + len(block)), as_tuple=True)
        self._rows.append(rows + start)
        self._cols.append(cols)
        self._values.append(block[rows, cols])

    def finish(self) -> None:
        """End the clean pass: the pairs are fixed."""
        self.rows, self.cols = _cat(self._rows, torch.int64, self.device), _cat(self._cols, torch.int64, self.device)
        self.before = _cat(self._values, torch.float64, self.device)
        self._rows, self._cols, self._values = [], [], []
        # the pairs of a block of queries are one contiguous run (they were kept in query order)
        self.bounds = torch.searchsorted(self.rows, torch.arange(self.n_query + 1, device=self.device))
        self._clean: tuple[torch.Tensor, torch.Tensor, _Ranks] | None = None

    def perturbed_values(self, start: int, block: torch.Tensor) -> torch.Tensor:
        """The perturbed values at the pairs of queries ``start, …, start + len(block) − 1``."""
        lo, hi = int(self.bounds[start]), int(self.bounds[start + len(block)])
        return block[self.rows[lo:hi] - start, self.cols[lo:hi]]

    def correlation(self, after: torch.Tensor) -> tuple[float, np.ndarray]:
        """
        :param after: The perturbed values at every pair (concatenated :meth:`perturbed_values`).
        :return: Spearman's correlation of the pairs finite on both sides, and its ``G`` leave-one-group-out values
            (``NaN`` where undefined: fewer than two pairs, or a constant side).
        """
        keep = torch.isfinite(self.before) & torch.isfinite(after)
        n_groups = int(self.groups.max()) + 1 if self.n_query else 0
        replicates = np.full(n_groups, np.nan)
        if int(keep.sum()) < 2:
            return float("nan"), replicates
        # in the clean side's sorted order its counts are read in sequence; each side keeps the groups in its order
        if bool(keep.all()):
            order, groups, clean = self._clean_side()
            a = after[order]
        else:
            order, groups, clean = self._sorted_clean(keep)
            a = after[keep][order]
        perturbed = _Ranks(a, groups)
        point = _pearson(clean.ranks, perturbed.ranks)
        if self.n_query >= 2:
            for g in range(n_groups):
                kept = (groups != g).to(torch.float64)
                if float(kept.sum()) >= 2:
                    replicates[g] = _pearson(clean.without(g), perturbed.without(g), kept)
        return point, replicates

    def _sorted_clean(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, _Ranks]:
        """The clean side of the pairs ``keep`` selects: its stable sorting order, the groups in it, its ranks."""
        b, groups = self.before[keep], self.groups[self.rows[keep]]
        order = torch.argsort(b, stable=True)
        groups = groups[order]
        return order, groups, _Ranks(b[order], groups, ordered=True)

    def _clean_side(self) -> tuple[torch.Tensor, torch.Tensor, _Ranks]:
        """The clean side of every pair (:meth:`_sorted_clean`), computed once: every pass of an audit shares it."""
        if self._clean is None:
            self._clean = self._sorted_clean(torch.ones_like(self.before, dtype=torch.bool))
        return self._clean


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


class _Ranks:
    """
    One side's midranks (ties averaged, 1-based) and, in ``O(M)``, its midranks once a subset is left out: an element
    whose tie group spans sorted positions ``[lo, hi)`` has midrank ``(lo + hi + 1) / 2``; leaving out a set whose
    members before those positions number ``C(lo)`` (and ``C(hi)``) lowers it by ``(C(lo) + C(hi)) / 2``.
    """

    def __init__(self, values: torch.Tensor, groups: torch.Tensor, ordered: bool = False) -> None:
        n = values.numel()
        order = torch.arange(n, device=values.device) if ordered else torch.argsort(values, stable=True)
        ordered = values[order]
        new = torch.ones(n, dtype=torch.bool, device=values.device)
        new[1:] = ordered[1:] != ordered[:-1]
        starts = torch.nonzero(new).squeeze(1)
        stops = torch.cat([starts[1:], torch.tensor([n], device=values.device)])
        tie = torch.empty_like(order)
        tie[order] = torch.cumsum(new, 0) - 1  # each element's tie group
        self.lo, self.hi = starts[tie], stops[tie]
        self.ties = bool((stops - starts > 1).any())
        self.ranks = (self.lo + self.hi + 1).to(torch.float64) / 2.0
        self.sorted_groups = groups[order]  # the query group at each sorted position
        self.counted = torch.zeros(n + 1, dtype=torch.float64, device=values.device)

    def without(self, group: int) -> torch.Tensor:
        """
        :param group: The jackknife group left out.
        :return: ``(M,)`` midranks among the other elements (meaningful for those only).
        """
        torch.cumsum((self.sorted_groups == group).to(torch.float64), 0, out=self.counted[1:])
        below = self.counted.index_select(0, self.lo)
        if not self.ties:  # a kept element is alone in its tie group: nothing left out ties with it
            return self.ranks - below
        return self.ranks - (below + self.counted.index_select(0, self.hi)) / 2.0


def _pearson(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Pearson's correlation (of the entries of weight 1 where ``weights`` is a 0/1 mask); ``NaN``: a constant side."""
    if weights is not None:
        n = float(weights.sum())
        sx, sy = float(torch.dot(weights, x)), float(torch.dot(weights, y))
        wx = weights * x
        sxx = float(torch.dot(wx, x)) - sx * sx / n
        syy = float(torch.dot(weights * y, y)) - sy * sy / n
        sxy = float(torch.dot(wx, y)) - sx * sy / n
    else:
        x, y = x - x.mean(), y - y.mean()
        sxx, syy, sxy = float(torch.dot(x, x)), float(torch.dot(y, y)), float(torch.dot(x, y))
    if sxx <= 0.0 or syy <= 0.0:
        return float("nan")
    return sxy / float(np.sqrt(sxx * syy))
