"""
The exact mode of the NTK influence (:class:`ExactNTK`): the ``n × n`` empirical NTK of the training set and its
dual solve (:class:`~art_malleability.linalg.ridge.DualRidge`), dense in one process or in tiles (dealt out over a
process group, in memory or on disk), with row updates after a refit. See
:mod:`~art_malleability.influence.ntk` for the mode rule.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from art_malleability._utils.torch_utils import tensor_digest
from art_malleability.data.streaming import ExampleSource
from art_malleability.influence._ntk_mode import ModeChoice
from art_malleability.influence._ntk_session import NTKSession
from art_malleability.linalg.ridge import DualRidge
from art_malleability.ntk.kept import KeptFactors

logger = logging.getLogger(__name__)


class ExactNTK:
    """
    One exact fit: the solver, the training inputs (the base fit's and the current ones) and, where they fit the
    memory, the training set's Jacobian factors kept between kernels (:class:`~art_malleability.ntk.kept.KeptFactors`).

    :param session: The fit's shared state (its ``choice`` is an exact one).
    :param tile_folder: Folder of the out-of-core tiles' temporary subfolder (``None``: the system's).
    """

    def __init__(self, session: NTKSession, tile_folder: str | None) -> None:
        self.session = session
        self.tile_folder = tile_folder
        self.solver: DualRidge | None = None
        self.kept: KeptFactors | None = None
        self.x_train: np.ndarray | None = None
        self.y_train: np.ndarray | None = None

    # ------------------------------------------------------------------ fit
    def fit(self, model: nn.Module, source: ExampleSource, probe: np.ndarray,
            check_labels: Callable[[np.ndarray, str], None]) -> None:
        """The ``n × n`` eNTK of the training set and its dual solve (dense, or in tiles); ``probe`` is unused (the
        mode was planned on it)."""
        s = self.session
        log_plan(s.choice, source.n, s.shard.world_size, self.tile_folder)
        self.model = model
        x, y = source.arrays(s.batch_size)
        check_labels(y, "y_train")
        self.x_train, self.y_train = np.array(x, copy=True), y
        self._x_base = self.x_train
        engine = s.engine(model, len(x))
        with s.clock("features"):
            # the training set's Jacobian factors, kept for the kernel (its tiles included), the queries and the
            # refits where they fit half of what the solve's form leaves (decided with the mode); otherwise every
            # block or tile computes them again
            if s.choice.kept_bytes:
                self.kept = KeptFactors(engine, x, query_bytes=s.choice.factor_cache)
            else:
                logger.info("NTK influence: the training set's Jacobian factors do not fit the memory; not kept")
        block, on_disk = s.choice.plan
        if block is not None:  # tiles (over the group: each process its own)

            def tile(rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
                with s.clock("features"):
                    if self.kept is not None:  # each example's factors computed once per kernel
                        return self.kept.block(rows, cols).to(torch.float64)
                    return engine.gram(x[rows], x[cols]).to(torch.float64)

            with s.clock("solve"):
                folder = (self.tile_folder or tempfile.gettempdir()) if on_disk else None
                solver = DualRidge(s.ridge_value, block=block, folder=folder, group=s.shard)
                self.solver = solver.fit(tile, s.targets(y))
            return
        with s.clock("features"):
            kernel = (self.kept.gram() if self.kept is not None else engine.gram(x)).to(torch.float64)
        with s.clock("solve"):
            self.solver = DualRidge(s.ridge_for(kernel, y)).fit(kernel, s.targets(y))
        logger.debug("NTK influence (exact): kernel %s, ridge %g", tuple(kernel.shape), s.ridge_value)

    def _kernel(self, x1: np.ndarray, x2: np.ndarray) -> torch.Tensor:
        return self.session.engine(self.model, len(self._x_base)).gram(x1, x2).to(torch.float64)

    # ------------------------------------------------------------------ refit
    def refit(self, changed: np.ndarray, x_changed: np.ndarray) -> None:
        """
        Swap the rows ``changed`` (sorted) of the base fit for ``x_changed`` by a row update of the solve; every
        process passed its own rows, or all: each block's are gathered once. A failed update leaves the fit as it was.
        """
        s, n = self.session, len(self._x_base)
        start, stop = s.shard.bounds(n)
        here = (changed >= start) & (changed < stop)
        changed = s.comm(s.shard.all_gather_rows, torch.as_tensor(changed[here])).numpy()
        x_changed = s.comm(s.shard.all_gather_rows, torch.as_tensor(x_changed[here])).numpy()
        x = np.array(self._x_base, copy=True)
        x[changed] = x_changed
        snapshot = self.kept.snapshot() if self.kept is not None else None
        with s.clock("features"):
            if self.kept is not None:
                self.kept.set_changed(changed, x_changed)
                rows = self.kept.changed_rows().to(torch.float64) if len(changed) else None
            else:  # the solver asks for the columns it needs (over a group: each process its own)
                rows = self._changed_columns(x_changed, x) if len(changed) else None
        try:
            with s.clock("solve"):
                empty = torch.zeros((0, n), dtype=torch.float64, device=s.device)
                self.solver.update(changed, rows if rows is not None else empty)
        except BaseException:
            if snapshot is not None:
                self.kept.restore(snapshot)
            raise
        self.x_train = x

    def _changed_columns(self, x_changed: np.ndarray, x: np.ndarray) -> Callable[[np.ndarray], torch.Tensor]:
        """The kernel rows of the changed examples against the training set ``x``, as a function of its columns."""
        def columns(cols: np.ndarray) -> torch.Tensor:
            with self.session.clock("features"):
                return self._kernel(x_changed, x[cols])

        return columns

    # ------------------------------------------------------------------ queries
    def query_parts(self, x_query: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predictions ``f`` (n_q, C) and the leave-one-out factors ``b`` (n_q, n) and ``β`` (n, C)."""
        # the queries' rows on the examples a refit leaves alone depend on the queries only: one key for both
        key = tensor_digest(torch.as_tensor(np.ascontiguousarray(x_query)))
        if self.kept is not None:
            k_q = self.kept.rows(x_query, key).to(torch.float64)
        else:
            k_q = self._train_columns(x_query)
        return self.solver.loo_parts(k_q, key)

    def _train_columns(self, x_rows: np.ndarray) -> torch.Tensor:
        """
        The kernel between ``x_rows`` and the whole training set, ``(len(x_rows), n)``; over a group each process
        computes the columns of its block and the blocks are gathered.
        """
        s = self.session
        start, stop = s.shard.bounds(len(self._x_base))
        local = s.shard.run_everywhere(lambda: self._kernel(x_rows, self.x_train[start:stop]))
        return s.comm(s.shard.all_gather_columns, local)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every process holds every column."""
        return t

    def self_influence(self, loss: str) -> None:
        """The inputs are kept: the estimator's generic self-influence applies (``None``)."""
        return None

    def close(self) -> None:
        """Remove the tiles on disk of the solve, if any."""
        if self.solver is not None:
            self.solver.close()


def log_plan(choice: ModeChoice, n: int, world: int, tile_folder: str | None) -> None:
    """Log the exact solve's form."""
    block, on_disk = choice.plan
    if block is None:
        logger.info("NTK influence: exact solve, %d x %d matrices in memory", n, n)
        return
    where = f"files in {tile_folder or tempfile.gettempdir()}" if on_disk else "memory"
    logger.info("NTK influence: exact solve in tiles of %d rows over %d process(es), held in %s", block, world, where)


def check_ridge_rule(session: NTKSession, n: int) -> None:
    """
    A ridge rule needs the kernel as one matrix: refuse it, before the long work, where the exact solve has none (the
    projected mode checks its realised dimension once the projection is planned).
    """
    choice = session.choice
    if session.ridge_value is None and choice.mode == "exact" and choice.plan[0] is not None:
        where = "tiles on disk" if choice.plan[1] else "tiles"
        raise ValueError(
            f"ridge must be a number for the exact solve in {where} ({n} training examples, "
            f"{session.shard.world_size} process(es)), got {session.ridge!r}: the rule needs the kernel's "
            "eigendecomposition, which only the dense solve in one process holds; choose the ridge on a subset, or "
            "raise memory_limit_gb"
        )
