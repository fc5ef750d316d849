"""
Jacobian factors of a fixed set of examples kept between traced-kernel computations
(:class:`KeptFactors`), for the exact NTK influence: kernel rows of new examples against the set
cost the new examples' factors and the contractions only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from art_malleability._utils import cache as _cache
from art_malleability._utils.cache import BoundedCache
from art_malleability._utils.torch_utils import eval_mode, no_tf32, tensor_digest, to_tensor
from art_malleability.ntk._memory import Features, place_block
from art_malleability.ntk._rank_one import ClassDirections, RankChange
from art_malleability.ntk.empirical import JacobianGram

logger = logging.getLogger(__name__)


class KeptFactors:
    """
    The Jacobian factors of a fixed set of examples (a training set), kept between traced-kernel
    computations, so that kernel rows of new examples against the set cost the new examples'
    factors and the contractions only. Some rows of the set can be swapped for new inputs
    (:meth:`set_changed`) without recomputing the others.

    The rank-one class directions (see :mod:`art_malleability.ntk.empirical`) of the kept factors
    are carried from call to call; if a later example shows that a layer is not rank one after all,
    every kept factor is computed again in the full representation.

    :param engine: The engine (traced kernel, no ``output_fn``).
    :param x: The examples to keep, ``(n, *input_shape)``.
    :param query_bytes: Bytes of new examples' factors kept between calls (by sub-batch, the first ones that fit;
        ``None``: ``QUERY_CACHE_BYTES``); their rows against the set as given are kept up to ``QUERY_CACHE_BYTES``.
    """

    def __init__(self, engine: JacobianGram, x: np.ndarray | torch.Tensor, query_bytes: int | None = None) -> None:
        self.engine = engine
        self.query_bytes = _cache.QUERY_CACHE_BYTES if query_bytes is None else int(query_bytes)
        self.x = to_tensor(x, engine.device, engine.dtype)
        self._changed = np.zeros(0, dtype=np.int64)
        self._x_changed = self.x[:0]
        self._build()

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    def nbytes(self) -> int:
        """Memory of the kept factors."""
        return sum(b.nbytes() for b in self._blocks + self._changed_blocks)

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        engine = self.engine
        with eval_mode(engine.model), no_tf32(engine.device):
            engine._start(True, self._state)
            try:
                yield
            finally:
                self._state.scratch = [None] * len(engine._structured)
                engine._finish()

    def _blocks_of(self, x: torch.Tensor) -> list[Features]:
        bs = self.engine._block_rows()
        return [self.engine.features(x[i : i + bs]) for i in range(0, x.shape[0], bs)]

    def _build(self) -> None:
        engine = self.engine
        self._last = BoundedCache(self.query_bytes, lambda block: block.nbytes())
        self._base_rows = BoundedCache(_cache.QUERY_CACHE_BYTES, lambda t: t.numel() * t.element_size())
        engine.prepare(self.x, self.n)
        while True:
            self._state = ClassDirections.fresh(len(engine._structured))
            try:
                with self._session():
                    self._blocks = self._blocks_of(self.x)
                    self._changed_blocks = self._blocks_of(self._x_changed) if len(self._changed) else []
                return
            except RankChange as change:
                logger.debug("eNTK: layer %s is not rank one over the classes; recomputing", change)

    def _retrying(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        while True:
            try:
                with self._session():
                    return compute()
            except RankChange as change:
                logger.debug("eNTK: layer %s is not rank one over the classes; recomputing kept factors", change)
                self._build()

    def _contract_all(self, f: list[Features], blocks: list[Features], n: int) -> torch.Tensor:
        rows = sum(b.n for b in f)
        out = torch.empty((rows, n), dtype=self.engine.dtype, device=self.engine.device)
        i = 0
        for a in f:
            j = 0
            for b in blocks:
                out[i : i + a.n, j : j + b.n] = self.engine.contract(a, b)
                j += b.n
            i += a.n
        return out

    def gram(self) -> torch.Tensor:
        """:return: The ``n × n`` traced kernel of the kept examples (with the changed rows swapped in)."""

        def compute() -> torch.Tensor:
            kernel = torch.empty((self.n, self.n), dtype=self.engine.dtype, device=self.engine.device)
            starts = np.cumsum([0] + [b.n for b in self._blocks])
            for bi, a in enumerate(self._blocks):
                for bj in range(bi, len(self._blocks)):
                    place_block(kernel, self.engine.contract(a, self._blocks[bj]), starts[bi], starts[bj], True)
            if len(self._changed):
                rows = self._swap_columns(self._contract_all(self._changed_blocks, self._blocks, self.n))
                idx = torch.as_tensor(self._changed, device=kernel.device)
                kernel[idx] = rows
                kernel[:, idx] = rows.T
            return kernel

        return self._retrying(compute)

    def block(self, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
        """
        A block of the traced kernel of the kept examples as given at construction (a tile of the exact solve), from
        the kept factors: contractions only.

        :param rows: Indices into the kept examples.
        :param cols: Indices into the kept examples.
        :return: ``(len(rows), len(cols))`` kernel block.
        """
        def compute() -> torch.Tensor:
            return self._contract_all(self._take(rows), self._take(cols), len(cols))

        return self._retrying(compute)

    def _take(self, idx: np.ndarray) -> list[Features]:
        """The kept factors of the examples ``idx`` in their order, as views of the kept blocks (one per run of
        consecutive indices within a block)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        starts = np.cumsum([0] + [b.n for b in self._blocks])
        breaks = np.flatnonzero((np.diff(idx) != 1) | np.isin(idx[1:], starts[1:-1])) + 1
        out = []
        for run in np.split(idx, breaks):
            if len(run):
                k = int(np.searchsorted(starts, run[0], side="right")) - 1
                out.append(self._blocks[k].take(int(run[0] - starts[k]), int(run[-1] - starts[k] + 1)))
        return out

    def _swap_columns(self, rows: torch.Tensor, f: list[Features] | None = None) -> torch.Tensor:
        if len(self._changed):
            f = self._changed_blocks if f is None else f
            rows[:, torch.as_tensor(self._changed, device=rows.device)] = self._contract_all(
                f, self._changed_blocks, len(self._changed)
            )
        return rows

    def rows(self, x_new: np.ndarray | torch.Tensor, key: object = None) -> torch.Tensor:
        """
        :param x_new: Inputs ``(m, *input_shape)``.
        :param key: What identifies ``x_new`` (equal keys promise equal inputs); ``None``: their digest.
        :return: ``(m, n)`` traced kernel between ``x_new`` and the kept examples (changed rows swapped in).
        """
        x_new = to_tensor(x_new, self.engine.device, self.engine.dtype)
        key = tensor_digest(x_new) if key is None else key
        engine = self.engine

        def factors(i: int, bs: int) -> Features:
            # kept by sub-batch, so that the first ones stay when the whole block does not fit
            return self._last.get((key, i), lambda: engine.features(x_new[i : i + bs]))

        def compute() -> torch.Tensor:
            # an audit asks for the same blocks of queries after every swap: their rows against the examples given
            # at construction, and their factors, are kept, and only the swapped columns are contracted again; one
            # sub-batch's factors are held at a time beyond what is kept
            base = self._base_rows.lookup(key)
            known = base is not None
            if not known:
                base = torch.empty((x_new.shape[0], self.n), dtype=engine.dtype, device=engine.device)
            rows = torch.empty_like(base)
            bs = engine._block_rows()
            for i in range(0, x_new.shape[0], bs):
                f = None
                if not known:
                    f = factors(i, bs)
                    base[i : i + bs] = self._contract_all([f], self._blocks, self.n)
                rows[i : i + bs] = base[i : i + bs]
                if len(self._changed):
                    self._swap_columns(rows[i : i + bs], [f if f is not None else factors(i, bs)])
            if not known:
                self._base_rows.put(key, base)
            return rows

        return self._retrying(compute)

    def changed_rows(self) -> torch.Tensor:
        """:return: ``(m, n)`` kernel rows of the swapped-in examples against the kept set (their factors reused)."""
        return self._retrying(
            lambda: self._swap_columns(self._contract_all(self._changed_blocks, self._blocks, self.n))
        )

    def set_changed(self, changed: np.ndarray, x_changed: np.ndarray | torch.Tensor) -> None:
        """
        Swap the kept examples ``changed`` for ``x_changed`` in later results (rows not listed are
        back to the examples given at construction).

        :param changed: Indices into the kept examples (distinct).
        :param x_changed: Their new inputs.
        """
        self._changed = np.asarray(changed, dtype=np.int64)
        self._x_changed = to_tensor(x_changed, self.engine.device, self.engine.dtype)

        def compute() -> torch.Tensor:
            self._changed_blocks = self._blocks_of(self._x_changed) if len(self._changed) else []
            return self._x_changed

        self._retrying(compute)

    def snapshot(self) -> tuple:
        """:return: The swapped rows, their inputs and their factors now, for :meth:`restore` (nothing is copied:
            :meth:`set_changed` replaces them rather than writing into them)."""
        return self._changed, self._x_changed, self._changed_blocks, self._blocks

    def restore(self, snapshot: tuple) -> None:
        """Go back to a :meth:`snapshot`'s swapped rows: with its factors where the kept ones are those it was taken
        with, computed again where a change of representation has rebuilt them since."""
        changed, x_changed, changed_blocks, blocks = snapshot
        if blocks is self._blocks:
            self._changed, self._x_changed, self._changed_blocks = changed, x_changed, changed_blocks
        else:
            self.set_changed(changed, x_changed)
