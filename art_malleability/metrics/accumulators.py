"""
The malleability metrics of influence matrices that arrive in blocks of queries: what each statistic needs is
accumulated block by block (torch, float64, on the device that holds the scores), so that time and memory grow
linearly with the number of queries and no ``(n_query, n_train)`` matrix but the clean one need be kept (and that one
on disk when it does not fit the memory given).

- :class:`QueryResampling`: the bootstrap resamples of the queries that every statistic of one audit shares, as
  count weights ``W`` (``(B, n_query)``), applied block by block (``W[:, block] @ scores[block]``).
- :class:`CleanScores`: the clean pass: column sums (the aggregates, hence the influential set), each query's own top
  set, the pairs of Spearman's correlation; at :meth:`CleanScores.finish`, the set's clean scores per query.
- :class:`PerturbedScores`: one perturbed pass against a finished clean one, from which
  :func:`art_malleability.metrics.pass_metrics` gives the statistics of
  :func:`art_malleability.metrics.malleability_metrics`.

Cost per perturbed pass, ``Q`` queries, ``N`` training examples, ``k`` in the set, ``B`` resamples: ``O(B·Q·N)`` time
(one matrix product per block: the resampled aggregates), ``O(Q·N log k)`` for the per-query top sets, ``O(M·G)``
for the correlation's jackknife (``M ≤`` :data:`~._spearman.SPEARMAN_PAIRS` pairs, ``G`` groups), ``O(k)`` for the
noise-aware rate's and the retention's sums; memory ``O(B·N + Q·k + M)`` beside one block.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from art_malleability._utils.params import RANK_BY
from art_malleability.metrics._bootstrap import MIN_INTERVAL_QUERIES, resample_rows
from art_malleability.metrics._flip_posterior import GRID_SIZE, PROFILE_SHARES, PairedSums
from art_malleability.metrics._results import ResamplingIdentity
from art_malleability.metrics._retention import RetentionBasis
from art_malleability.metrics._scores import top_indices, top_k_count
from art_malleability.metrics._spearman import SampledPairs

#: Elements of the temporaries of one step over resampled aggregates (``(b, n_train)`` at a time).
_STEP_ELEMENTS = 2**22


def resampling_identity(seed: int, rows: np.ndarray | None) -> ResamplingIdentity:
    """
    :param seed: Seed of the resampling.
    :param rows: The resampled query rows ``(n_bootstrap, n_query)``, or ``None`` without resamples.
    :return: What identifies the resamples of a result's replicates: the seed, their number and a digest of the rows.
    """
    digest = "" if rows is None else hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()
    return ResamplingIdentity(int(seed), 0 if rows is None else int(len(rows)), digest)


class QueryResampling:
    """
    The bootstrap resamples of the queries shared by every statistic of one audit (an attack and its control are
    paired on them): :func:`~art_malleability.metrics.resample_rows` turned into count weights.

    :param n_query: Queries.
    :param n_bootstrap: Resamples (none with fewer than :data:`~._bootstrap.MIN_INTERVAL_QUERIES` queries: their
        intervals would under-cover).
    :param seed: Seed of the resampling.
    :param device: Device of the weights (that of the scores).
    """

    def __init__(self, n_query: int, n_bootstrap: int, seed: int, device: torch.device | str | None = None) -> None:
        self.n_query, self.seed = int(n_query), int(seed)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        rows = resample_rows(n_query, n_bootstrap, seed) if n_query >= MIN_INTERVAL_QUERIES else None
        self.identity = resampling_identity(seed, rows)
        b = 0 if rows is None else len(rows)
        flat = (rows + n_query * np.arange(b)[:, None]).ravel() if rows is not None else np.zeros(0, dtype=np.int64)
        counts = np.bincount(flat, minlength=b * n_query).reshape(b, n_query).astype(np.float64)
        self.weights = torch.as_tensor(counts, device=self.device)
        self.n_bootstrap = b


class ColumnSums:
    """Finite counts and sums of columns over all queries, and (with weights) over every resample."""

    def __init__(self, n_cols: int, device: torch.device, weights: torch.Tensor | None = None) -> None:
        self.count = torch.zeros(n_cols, dtype=torch.float64, device=device)
        self.total = torch.zeros(n_cols, dtype=torch.float64, device=device)
        self.squares = torch.zeros(n_cols, dtype=torch.float64, device=device)
        self.weights = weights
        if weights is not None:
            self.r_total = torch.zeros((len(weights), n_cols), dtype=torch.float64, device=device)
            self.r_missing: torch.Tensor | None = None  # weight of the non-finite entries of each column

    def add(self, start: int, block: torch.Tensor) -> None:
        # a finite sum means every entry is finite (an overflow past 1e308 only takes the masked path)
        finite = None if bool(torch.isfinite(block.sum())) else torch.isfinite(block)
        filled = block if finite is None else torch.where(finite, block, 0.0)
        self.count += len(block) if finite is None else finite.sum(0, dtype=torch.float64)
        self.total += filled.sum(0)
        self.squares += (filled * filled).sum(0)
        if self.weights is None or not len(self.weights):
            return
        w = self.weights[:, start : start + len(block)]
        self.r_total.addmm_(w, filled)
        if finite is not None and not bool(finite.all()):
            q, j = torch.nonzero(~finite, as_tuple=True)
            if self.r_missing is None:
                self.r_missing = torch.zeros_like(self.r_total)
            self.r_missing.index_add_(1, j, w[:, q])

    def means(self) -> torch.Tensor:
        """:return: Column means over all queries; ``NaN`` for a column without a finite entry."""
        return torch.where(self.count > 0, self.total / self.count.clamp_min(1.0), torch.nan)

    def resampled_means(self, rows: torch.Tensor | slice = slice(None),
                        columns: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """:return: ``(b, n)`` column means of some resamples (``NaN`` without a finite entry of positive weight)."""
        total = self.r_total[rows][:, columns]
        counts = self.weights[rows].sum(1, keepdim=True).expand(-1, total.shape[1])
        if self.r_missing is not None:
            counts = counts - self.r_missing[rows][:, columns]
        return torch.where(counts > 0, total / counts.clamp_min(1.0), torch.nan)


def top_masks(values: torch.Tensor, k: int, rank_by: str) -> torch.Tensor:
    """
    Membership masks ``(B, n)`` of the top sets of every row of ``values``: the ``k`` largest keys (``|value|`` or
    value), ties to the lower index, non-finite values never (:func:`~art_malleability.metrics.top_indices` row by row).
    """
    b, n = values.shape
    finite = torch.isfinite(values)
    key = values.abs() if rank_by == "abs" else values.clone()
    key = torch.where(finite, key, -torch.inf)
    counts = finite.sum(1).clamp(max=k)
    mask = torch.zeros((b, n), dtype=torch.bool, device=values.device)
    if k == 0 or n == 0:
        return mask
    largest = torch.topk(key, min(k, n), dim=1).values
    threshold = largest.gather(1, (counts - 1).clamp_min(0)[:, None])
    above = key > threshold
    equal = key == threshold
    need = counts[:, None] - above.sum(1, keepdim=True)
    mask = above | (equal & (torch.cumsum(equal, 1) <= need))
    mask[counts == 0] = False
    return mask


class _QueryTops:
    """Each query's own top set (its clean row's ``top_k_count`` largest keys) and the clean signs there."""

    def __init__(self, n_query: int, n_train: int, top_fraction: float, rank_by: str, device: torch.device) -> None:
        self.fraction, self.rank_by = top_fraction, rank_by
        self.width = top_k_count(n_train, top_fraction)
        self.index = torch.zeros((n_query, self.width), dtype=torch.int32, device=device)
        self.sign = torch.zeros((n_query, self.width), dtype=torch.int8, device=device)
        self.size = torch.zeros(n_query, dtype=torch.int64, device=device)

    def add(self, start: int, block: torch.Tensor) -> None:
        finite = torch.isfinite(block)
        key = block.abs() if self.rank_by == "abs" else block.clone()
        key = torch.where(finite, key, -torch.inf)
        size = torch.floor(self.fraction * finite.sum(1).to(torch.float64) + 1e-9).to(torch.int64)
        stop = start + len(block)
        self.size[start:stop] = size
        if self.width == 0:  # every set is empty
            return
        values, order = torch.topk(key, self.width, dim=1)
        # the set is the first ``size`` of that order unless keys tie across its boundary; those rows take the
        # stable order (ties to the lower index), as top_indices does
        boundary = values.gather(1, (size - 1).clamp_min(0)[:, None])
        tied = (size > 0) & ((key >= boundary).sum(1) > size)
        if bool(tied.any()):
            order[tied] = torch.sort(-key[tied], dim=1, stable=True).indices[:, : self.width]
        valid = torch.arange(self.width, device=block.device)[None, :] < size[:, None]
        self.index[start:stop] = order.to(torch.int32)
        self.sign[start:stop] = torch.where(valid, torch.sign(block.gather(1, order)), 0.0).to(torch.int8)

    def flip_rates(self, start: int, block: torch.Tensor) -> torch.Tensor:
        """:return: The flip rate of each query of the perturbed block within its own top set (``NaN``: empty set)."""
        stop = start + len(block)
        after = block.gather(1, self.index[start:stop].to(torch.int64))
        flips = (self.sign[start:stop].to(torch.float64) * torch.sign(after)) < 0  # NaN and 0 are no flips
        size = self.size[start:stop]
        return torch.where(size > 0, flips.sum(1, dtype=torch.float64) / size.clamp_min(1), torch.nan)


class _ScoreStore:
    """
    The clean scores, kept until the influential set is known: in memory, or, above ``memory_bytes``, in a file of a
    temporary folder this object creates (and removes, with everything in it, when it is closed or collected). The
    file is written and read with plain file calls, not mapped, so its pages stay out of the process's resident set.
    """

    def __init__(self, n_query: int, n_train: int, device: torch.device, memory_bytes: float | None,
                 folder: str | Path | None = None) -> None:
        self.folder: str | None = None
        self.given: np.ndarray | None = None
        self.shape = (n_query, n_train)
        self.data: torch.Tensor | np.ndarray | None = None
        if memory_bytes is None or 8 * n_query * n_train <= memory_bytes:
            self.data = torch.empty((n_query, n_train), dtype=torch.float64, device=device)
        else:
            self.folder = tempfile.mkdtemp(prefix="art-malleability-scores-", dir=folder)
            self._file = open(Path(self.folder) / "clean_scores.f64", "w+b")  # noqa: SIM115 - closed in _remove
            self._cleanup = weakref.finalize(self, _remove, self._file, self.folder)
        self.device = device

    @classmethod
    def wrap(cls, scores: np.ndarray, device: torch.device) -> _ScoreStore:
        """A store over a matrix the caller holds (nothing copied)."""
        store = cls.__new__(cls)
        store.folder, store.given, store.data, store.device = None, scores, scores, device
        store.shape = scores.shape
        return store

    def put(self, start: int, block: torch.Tensor) -> None:
        if self.given is not None:
            return
        if isinstance(self.data, torch.Tensor):
            self.data[start : start + len(block)] = block
        else:
            self._file.seek(8 * start * self.shape[1])
            self._file.write(np.ascontiguousarray(block.cpu().numpy(), dtype=np.float64).data)
            self._file.flush()

    def _rows(self, start: int, stop: int) -> np.ndarray:
        if self.data is not None:
            return np.asarray(self.data[start:stop])
        self._file.seek(8 * start * self.shape[1])
        rows = np.fromfile(self._file, dtype=np.float64, count=(stop - start) * self.shape[1])
        return rows.reshape(stop - start, self.shape[1])

    def columns(self, columns: np.ndarray) -> torch.Tensor:
        """:return: ``(n_query, len(columns))`` clean scores of some columns, read in row blocks."""
        if isinstance(self.data, torch.Tensor):
            return self.data[:, torch.as_tensor(columns, device=self.device)]
        n_query, n_train = self.shape
        out = torch.empty((n_query, len(columns)), dtype=torch.float64, device=self.device)
        step = max(1, _STEP_ELEMENTS // max(n_train, 1))
        for s in range(0, n_query, step):
            stop = min(s + step, n_query)
            out[s:stop] = torch.as_tensor(self._rows(s, stop)[:, columns], device=self.device)
        return out

    def close(self) -> None:
        """Drop the scores (and the temporary folder, which this object created)."""
        self.data = None
        if self.folder is not None:
            self._cleanup()
            self.folder = None


def _remove(file: io.BufferedRandom, folder: str) -> None:
    """Close the store's file and remove the folder the store created."""
    file.close()
    shutil.rmtree(folder, True)


def _as_block(block: np.ndarray | torch.Tensor, n_train: int, device: torch.device, name: str) -> torch.Tensor:
    block = torch.as_tensor(block, dtype=torch.float64, device=device)
    if block.ndim != 2 or block.shape[1] != n_train:
        raise ValueError(f"{name} must be a block of influence rows of shape (n, {n_train}), got {tuple(block.shape)}")
    return block


class CleanScores:
    """
    The clean pass of an audit's metrics: give the clean influence rows in query order (:meth:`add`, blocks of any
    size), then :meth:`finish` chooses the influential set.

    :param resampling: The shared resamples (their number of queries and device).
    :param n_train: Training examples (columns).
    :param top_fraction: Share of training examples in the influential set.
    :param rank_by: ``"abs"`` or ``"signed"``.
    :param memory_bytes: Largest size of the clean matrix kept in memory until :meth:`finish`; above, it is kept in a
        temporary file (``None``: always in memory).
    :param folder: Where that temporary file's folder is created (``None``: the system's temporary folder).
    :param given: The whole clean matrix, when the caller holds it (then nothing is copied).
    :raises InvalidParameterError: For another ``rank_by`` (the rule ``RANK_BY``, a ``ValueError``).
    """

    def __init__(self, resampling: QueryResampling, n_train: int, top_fraction: float = 0.1, rank_by: str = "abs",
                 memory_bytes: float | None = None, folder: str | Path | None = None,
                 given: np.ndarray | None = None) -> None:
        RANK_BY(rank_by, "rank_by")
        self.resampling, self.n_train, self.rank_by = resampling, int(n_train), rank_by
        self.k = top_k_count(n_train, top_fraction)
        device, n_query = resampling.device, resampling.n_query
        self.device, self.n_query = device, n_query
        self.columns = ColumnSums(n_train, device)
        self.query_tops = _QueryTops(n_query, n_train, top_fraction, rank_by, device)
        self.pairs = SampledPairs(n_query, n_train, resampling.seed, device)
        self.store = (_ScoreStore.wrap(given, device) if given is not None
                      else _ScoreStore(n_query, n_train, device, memory_bytes, folder))
        self.seen = 0
        self.finished = False

    def add(self, block: np.ndarray | torch.Tensor) -> None:
        """Take the clean influence rows of the next queries (positive = helpful, ``NaN`` = excluded pair)."""
        block = _as_block(block, self.n_train, self.device, "the clean scores")
        start = self.seen
        if start + len(block) > self.n_query:
            raise ValueError(f"the clean scores must hold {self.n_query} queries, got at least {start + len(block)}")
        self.store.put(start, block)
        self.columns.add(start, block)
        self.query_tops.add(start, block)
        self.pairs.add_clean(start, block)
        self.seen += len(block)

    def finish(self, top: np.ndarray | None = None) -> None:
        """
        End the clean pass: the aggregates, the influential set (``top`` as given, else the ``k`` largest clean
        aggregates) and the set's clean scores per query; the stored clean matrix is dropped.
        """
        if self.seen != self.n_query:
            raise ValueError(f"the clean scores must hold {self.n_query} queries, got {self.seen}")
        self.aggregates = self.columns.means().cpu().numpy()
        self.top = (top_indices(self.aggregates, self.k, self.rank_by) if top is None
                    else np.asarray(top, dtype=np.int64))
        self.top_t = torch.as_tensor(self.top, device=self.device)
        self.top_scores = self.store.columns(self.top)
        self.store.close()
        self.top_sums = ColumnSums(len(self.top), self.device, self.resampling.weights)
        self.top_sums.add(0, self.top_scores)
        self.pairs.finish()
        self.finished = True
        self._retention: dict[bool, RetentionBasis] = {}

    def retention_basis(self, selected: bool = True) -> RetentionBasis:
        """What the signed retention of every pass shares (:class:`~._retention.RetentionBasis`), computed once."""
        if selected not in self._retention:
            sums = (t.cpu().numpy() for t in (self.columns.count, self.columns.total, self.columns.squares))
            self._retention[selected] = RetentionBasis.of(*sums, self.top, self.rank_by, selected,
                                                          self.resampling.seed)
        return self._retention[selected]

    def threshold(self, selected: bool = True) -> float | None:
        """The clean aggregate the set cleared when it was chosen (``None`` for a set fixed in advance or empty)."""
        if not selected or self.top.size == 0:
            return None
        values = self.aggregates[self.top]
        return float(np.nanmin(np.abs(values) if self.rank_by == "abs" else values))


class PerturbedScores:
    """
    One perturbed pass against a finished :class:`CleanScores`: give the perturbed influence rows in query order
    (:meth:`add`), then :meth:`metrics`.

    :param clean: The finished clean pass (same queries, same weights of the model).
    """

    def __init__(self, clean: CleanScores) -> None:
        if not clean.finished:
            raise ValueError("clean must be finished (CleanScores.finish) before the perturbed scores are taken")
        self.clean = clean
        resampling = clean.resampling
        self.columns = ColumnSums(clean.n_train, clean.device, resampling.weights)
        self.paired = {name: torch.zeros((1, len(clean.top)), dtype=torch.float64, device=clean.device)
                       for name in PairedSums.NAMES}
        self.per_query = torch.full((clean.n_query,), torch.nan, dtype=torch.float64, device=clean.device)
        self.pair_values: list[torch.Tensor] = []
        self.seen = 0

    def add(self, block: np.ndarray | torch.Tensor) -> None:
        """Take the perturbed influence rows of the next queries."""
        clean = self.clean
        block = _as_block(block, clean.n_train, clean.device, "the perturbed scores")
        start, stop = self.seen, self.seen + len(block)
        if stop > clean.n_query:
            raise ValueError(f"the perturbed scores must hold {clean.n_query} queries, got at least {stop}")
        self.columns.add(start, block)
        b, a = clean.top_scores[start:stop], block[:, clean.top_t]
        pair = torch.isfinite(b) & torch.isfinite(a)
        b, a = torch.where(pair, b, 0.0), torch.where(pair, a, 0.0)
        bb, aa = b * b, a * a
        for name, values in (("count", pair.to(torch.float64)), ("b", b), ("a", a), ("bb", bb), ("aa", aa),
                             ("ab", a * b), ("bbb", bb * b), ("aaa", aa * a), ("bbbb", bb * bb), ("aaaa", aa * aa)):
            self.paired[name] += values.sum(0)
        self.per_query[start:stop] = clean.query_tops.flip_rates(start, block)
        self.pair_values.append(clean.pairs.perturbed_values(start, block))
        self.seen = stop

    def aggregates(self) -> np.ndarray:
        """:return: The perturbed aggregate score of every training example."""
        return self.columns.means().cpu().numpy()

    def paired_sums(self) -> PairedSums:
        """:return: The set's paired sums over all queries (the noise-aware rate's data)."""
        return PairedSums({name: value.cpu().numpy() for name, value in self.paired.items()})

    def resampled_top(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:return: ``(B, k)`` clean and perturbed aggregates of the set in every resample."""
        clean = self.clean
        return clean.top_sums.resampled_means(), self.columns.resampled_means(columns=clean.top_t)

    def resampled_jaccard(self) -> torch.Tensor:
        """:return: ``(B,)`` top-set overlap of every resample (the set against the resample's perturbed top set)."""
        clean = self.clean
        b = clean.resampling.n_bootstrap
        out = torch.empty(b, dtype=torch.float64, device=clean.device)
        step = max(1, _STEP_ELEMENTS // max(clean.n_train, 1))
        for s in range(0, b, step):
            rows = torch.arange(s, min(s + step, b), device=clean.device)
            mask = top_masks(self.columns.resampled_means(rows), clean.k, clean.rank_by)
            both = mask[:, clean.top_t].sum(1, dtype=torch.float64)
            union = len(clean.top) + mask.sum(1) - both
            out[s : s + len(rows)] = torch.where(union > 0, both / union.clamp_min(1), torch.nan)
        return out

    def spearman(self) -> tuple[float, np.ndarray]:
        """:return: Spearman's correlation and its leave-one-group-out values (:class:`~._spearman.SampledPairs`)."""
        values = torch.cat(self.pair_values) if self.pair_values else torch.zeros(0, dtype=torch.float64)
        return self.clean.pairs.correlation(values.to(self.clean.device))


def check_complete(passes: PerturbedScores) -> None:
    """Every query of the clean pass must have had its perturbed scores."""
    if passes.seen != passes.clean.n_query:
        raise ValueError(f"the perturbed scores must hold {passes.clean.n_query} queries, got {passes.seen}")


#: Bytes of one block of influence rows (float64) handed to the metrics at once. The exact influence holds about seven
#: blocks' worth while it scores one (the kernel rows, their transposed copy, the solve's parts, the scores and their
#: temporaries): 16 MiB brought the SmallCNN's 4,000-query audit's peak from 3,843 to 3,777 MiB (docs/metrics.md).
BLOCK_BYTES = 2**24
#: Fewest queries in a block (where there are that many): below, each block's fixed costs take over (a 60,000-example
#: audit in blocks of 35 queries spent 1.6 times as long scoring each attack as in blocks of 70).
BLOCK_MIN_ROWS = 64
#: Largest clean matrix kept in memory until the influential set is known (above: in a temporary file).
STORE_MEMORY_BYTES = 2**30


def block_rows(n_train: int, budget_bytes: float = BLOCK_BYTES, min_rows: int = BLOCK_MIN_ROWS) -> int:
    """Queries per block: as many as ``budget_bytes`` of float64 influence rows hold, and at least ``min_rows``."""
    return max(int(min_rows), 1, int(budget_bytes // (8 * max(n_train, 1))))


def metrics_plan(n_query: int, n_train: int, k: int, n_bootstrap: int, excluded_pairs: bool = False) -> dict:
    """
    What an audit's metrics take, from their sizes alone (nothing is measured): the bytes held at once in memory
    beside the influence estimator, the bytes of the clean matrix in a temporary file (0 when it stays in memory),
    and the rows of one block of queries. Every term is linear in the number of queries.

    :param n_query: Queries.
    :param n_train: Training examples.
    :param k: Size of the influential set.
    :param n_bootstrap: Bootstrap resamples.
    :param excluded_pairs: Whether some pairs are excluded (self-pairs of training-set queries): the resampled
        aggregates then also keep the weight of the missing entries.
    :return: ``{"memory_bytes", "disk_bytes", "block_rows", "store"}`` (``store``: ``"memory"`` or ``"disk"``).
    """
    from art_malleability.metrics._spearman import SPEARMAN_PAIRS

    b = n_bootstrap
    clean = 8 * n_query * n_train
    on_disk = clean > STORE_MEMORY_BYTES
    rows = block_rows(n_train)
    pairs = min(SPEARMAN_PAIRS, n_query * n_train)
    memory = (
        8 * b * n_query  # the resamples' count weights
        + (0 if on_disk else clean)  # the clean matrix until the set is known
        + 5 * n_query * k  # each query's own top set (as large as the set) and its clean signs
        + 8 * n_query * k  # the set's clean scores
        + 8 * b * k * (2 if excluded_pairs else 1)  # the set's resampled clean sums
        + 8 * b * n_train * (2 if excluded_pairs else 1)  # the resampled perturbed sums
        + 8 * 6 * k  # the noise-aware rate's paired sums
        + 8 * k * (6 * GRID_SIZE**2 + 2 * PROFILE_SHARES)  # its likelihood, posteriors and the profile's products
        + 8 * 18 * pairs  # the correlation's pairs, the clean side's kept sort and ranks, the perturbed side's
        + 8 * _STEP_ELEMENTS * 4  # a step of the resampled top sets
        + 8 * min(rows, n_query) * n_train * 6  # one block and its temporaries (mask, sort, keys)
    )
    return {"memory_bytes": int(memory), "disk_bytes": int(clean if on_disk else 0), "block_rows": rows,
            "store": "disk" if on_disk else "memory"}


def finite_mean(values: np.ndarray) -> float:
    """The mean of the finite values, ``NaN`` without any."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else float("nan")

