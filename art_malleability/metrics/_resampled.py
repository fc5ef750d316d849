"""
Batched statistics of bootstrap resamples of query rows: the aggregate flip rates and top-set overlap
(:class:`_ResampledAggregates`) and the exact weighted Spearman correlation (:class:`_ResampledSpearman`),
many resamples at once through matrix products.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from scipy.sparse import csr_matrix

from art_malleability.metrics._bootstrap import _batched
from art_malleability.metrics._scores import _mean_and_error, _top_masks, flip_mask


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """
    Matrix product through torch (numpy's BLAS competes with torch's threads for the same cores). A transposed
    operand is passed as it is (BLAS takes it transposed), not copied: half the time of the Spearman forms' products.
    """
    return (_as_tensor(a) @ _as_tensor(b)).numpy()


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    """The array as a tensor sharing its memory where torch can (non-negative strides, writeable), else a copy."""
    if a.flags.writeable and all(stride >= 0 for stride in a.strides):
        return torch.from_numpy(a)
    return torch.from_numpy(np.array(a, order="C"))


def _weights(rows: np.ndarray, n_query: int) -> np.ndarray:
    """Multiplicity of every query in each resample: ``(B, n_query)`` from ``(B, n_query)`` row indices."""
    rows = np.atleast_2d(rows)
    counts = np.zeros((rows.shape[0], n_query))
    np.add.at(counts, (np.arange(rows.shape[0])[:, None], rows), 1.0)
    return counts


class _ResampledAggregates:
    """
    The aggregate flip rate and top-k Jaccard of resamples of query rows, many resamples at once:
    a resample's aggregate scores are ``(W @ S) / (W @ F)`` with ``W`` its query multiplicities, ``S``
    the scores with ``NaN`` set to 0 and ``F`` the finite mask. The flip rate needs the top set's columns
    only; the overlap needs every perturbed column.
    """

    def __init__(self, before: np.ndarray, after: np.ndarray, top: np.ndarray, k: int, rank_by: str) -> None:
        self.n_query = before.shape[0]
        self.top, self.k, self.rank_by = np.asarray(top, dtype=int), k, rank_by
        self.top_sides = [self._side(scores[:, self.top]) for scores in (before, after)]
        self.after = self._side(after)
        self.batch_rows = max(1, 2**24 // max(before.shape[1], 1))

    @staticmethod
    def _side(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        finite = np.isfinite(scores)
        filled = np.where(finite, scores, 0.0)
        return finite.astype(np.float64), filled

    def _top_scores(self, weights: np.ndarray, side: int) -> np.ndarray:
        finite, filled = self.top_sides[side]
        return _mean_and_error(_mm(weights, finite), _mm(weights, filled), np.zeros(1))[0]

    def flip_rate(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        if self.top.size == 0:
            return np.full(len(weights), np.nan)
        return flip_mask(self._top_scores(weights, 0), self._top_scores(weights, 1)).mean(axis=1)

    def top_k_jaccard(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        finite, filled = self.after
        after, _ = _mean_and_error(_mm(weights, finite), _mm(weights, filled), np.zeros(1))
        mask = _top_masks(after, self.k, self.rank_by)
        both = mask[:, self.top].sum(axis=1)
        union = self.top.size + mask.sum(axis=1) - both
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(union > 0, both / np.where(union > 0, union, 1), np.nan)

    def statistic(self, name: str) -> Callable[[np.ndarray], float]:
        """A bootstrap statistic (a function of one resample, with the batched form as ``batch``)."""
        single = _batched(getattr(self, name))
        single.batch_rows = self.batch_rows  # type: ignore[attr-defined]
        return single


class _ResampledSpearman:
    """
    Spearman correlation of resamples of query rows, exact, in ``O(n_q³)`` per resample.

    A resample gives every query row ``q`` a multiplicity ``w_q``; the ranks are the tie-averaged
    ranks of the multiset and the correlation is weighted by the multiplicities. The midrank of
    element ``i`` in a resample is ``C_i · w`` plus ``1/2``, where ``C_i[r] = L_i[r] + E_i[r] / 2``
    with ``L_i[r]`` the elements of row ``r`` below ``i``'s value and ``E_i[r]`` those equal to it
    (``i`` itself included). Every sum the correlation needs is then a quadratic or cubic form in
    ``w``: ``Σ_i w_{q(i)} (C^a_i·w)(C^b_i·w) = Σ_q w_q wᵀ T_q w`` with ``T_q = Σ_{i∈q} C^a_i C^b_iᵀ``.
    The ``n_q × n_q × n_q`` tensors are computed once (``O(N n_q)`` counts from one global sort per
    side, and matrix products; ``N`` = finite score pairs: six million at 100 queries and 60,000
    training examples), after which a resample costs ``O(n_q³)`` instead of a sort of ``N`` values.

    Verified against :func:`spearman` on explicitly repeated rows in the tests, with and without ties.
    """

    def __init__(self, before: np.ndarray, after: np.ndarray) -> None:
        keep = np.isfinite(before) & np.isfinite(after)
        self.n_query = before.shape[0]
        self.row = np.nonzero(keep)[0]
        self.size = int(self.row.size)
        self.batch_rows = 1024
        if self.size:
            self._forms(before[keep], after[keep])

    def _counts(self, values: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``C`` (``(m_q, n_query)``) and the element indices of each row ``q`` in turn, from one sort of ``values``."""
        n, size = self.n_query, values.size
        order = np.argsort(values, kind="stable")
        ordered = values[order]
        new_group = np.concatenate([[True], ordered[1:] != ordered[:-1]])
        group = np.cumsum(new_group) - 1
        start = np.flatnonzero(new_group)[group]  # first sorted position of each element's group
        labels = self.row[order]  # query row of each sorted element
        ties = int(group[-1]) + 1 != size
        if ties:  # E_i: elements of every row in i's group
            equal = csr_matrix((np.ones(size), (group, labels)), shape=(int(group[-1]) + 1, n))
        by_row = np.argsort(labels, kind="stable")  # sorted positions of each row's elements, ascending
        bounds = np.concatenate([[0], np.cumsum(np.bincount(labels, minlength=n))])
        for q in range(n):
            at = by_row[bounds[q] : bounds[q + 1]]
            m = at.size
            if m == 0:
                yield np.zeros((0, n)), np.zeros(0, dtype=np.int64)
                continue
            # L at the group starts of row q's elements (markers): an element at sorted position p lies
            # before marker j iff at most j markers sit at or before p
            before_marker = np.cumsum(np.bincount(start[at], minlength=size))
            before_marker *= n
            before_marker += labels
            counts = np.bincount(before_marker, minlength=(m + 1) * n).reshape(m + 1, n).astype(np.float64)
            np.cumsum(counts, axis=0, out=counts)
            counts = counts[:-1]
            if ties:
                counts += 0.5 * equal[group[at]].toarray()
            else:
                counts[:, q] += 0.5
            yield counts, order[at]

    def _forms(self, before: np.ndarray, after: np.ndarray) -> None:
        n = self.n_query
        self.m = np.bincount(self.row, minlength=n).astype(np.float64)
        self.s = [np.zeros((n, n)), np.zeros((n, n))]
        self.t = {key: np.zeros((n, n, n)) for key in ("ab", "aa", "bb")}
        for q, ((ca, ia), (cb, ib)) in enumerate(zip(self._counts(before), self._counts(after), strict=True)):
            if not len(ia):
                continue
            ca, cb = ca[np.argsort(ia)], cb[np.argsort(ib)]  # the same element on the same line
            self.s[0][q], self.s[1][q] = ca.sum(axis=0), cb.sum(axis=0)
            self.t["ab"][q], self.t["aa"][q], self.t["bb"][q] = _mm(ca.T, cb), _mm(ca.T, ca), _mm(cb.T, cb)

    def __call__(self, rows: np.ndarray) -> float:
        return float(self.batch(np.asarray(rows)[None, :])[0])

    def batch(self, rows: np.ndarray) -> np.ndarray:
        weights = _weights(rows, self.n_query)
        if self.size == 0:
            return np.full(len(weights), np.nan)
        n = self.n_query
        pairs = (weights[:, :, None] * weights[:, None, :]).reshape(len(weights), n * n)

        def cubic(t: np.ndarray) -> np.ndarray:  # Σ_q w_q wᵀ T_q w, for every resample
            return (_mm(pairs, t.reshape(n, n * n).T) * weights).sum(axis=1)

        total = weights @ self.m
        sum_a = ((weights @ self.s[0]) * weights).sum(axis=1)
        sum_b = ((weights @ self.s[1]) * weights).sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cov = cubic(self.t["ab"]) - sum_a * sum_b / total
            var_a = cubic(self.t["aa"]) - sum_a**2 / total
            var_b = cubic(self.t["bb"]) - sum_b**2 / total
            ok = (total >= 2) & (var_a > 0) & (var_b > 0)
            return np.where(ok, cov / np.sqrt(np.where(ok, var_a * var_b, 1.0)), np.nan)
