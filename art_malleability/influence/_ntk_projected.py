"""
The projected mode of the NTK influence (:class:`ProjectedNTKFit`): features ``Φ`` (``n × k``) from a seeded random
projection of each example's logit Jacobians (:class:`~art_malleability.ntk.projection.ProjectedNTK`), then the
primal solve (each process its own rows of ``Φ``), or the dual on ``ΦΦᵀ`` when ``n ≤ k``. See
:mod:`~art_malleability.influence.ntk` for the mode rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from art_malleability._utils import cache as _cache
from art_malleability._utils.cache import BoundedCache
from art_malleability._utils.io import progress_bar
from art_malleability._utils.torch_utils import tensor_digest
from art_malleability.data.streaming import ExampleSource
from art_malleability.influence._ntk_session import NTKSession
from art_malleability.influence.ntk_memory import _GIB, projected_bytes
from art_malleability.influence.ridge import loo_scores
from art_malleability.linalg.ridge import DualRidge, PrimalRidge
from art_malleability.ntk.projection import ProjectedNTK

logger = logging.getLogger(__name__)


class ProjectedNTKFit:
    """
    One projected fit: the projector, this process's rows of ``Φ`` (every row in the dual) and the solver.

    :param session: The fit's shared state.
    :param dim: The projection dimension asked for.
    :param seed: The projection's seed.
    :param like: A previous fit's projector to plan like (a warm start), or ``None``.
    """

    def __init__(self, session: NTKSession, dim: int, seed: int, like: ProjectedNTK | None = None) -> None:
        self.session, self.like = session, like
        self.dim_asked = int(dim)
        self.seed = int(seed)
        self.projector: ProjectedNTK | None = None
        self.solver: DualRidge | PrimalRidge | None = None
        self.y_train: np.ndarray | None = None
        self._query_features: BoundedCache | None = None

    @property
    def x_train(self) -> None:
        """The projected mode keeps features, not inputs."""
        return None

    @property
    def dual(self) -> bool:
        return isinstance(self.solver, DualRidge)

    # ------------------------------------------------------------------ fit
    def fit(self, model: nn.Module, source: ExampleSource, probe: np.ndarray,
            check_labels: Callable[[np.ndarray, str], None]) -> None:
        """This process's block of the features ``Φ``, then the primal or dual solve."""
        s, n = self.session, source.n
        self.n_train = n
        start, stop = s.shard.bounds(n)
        # every process plans, checks its memory and computes its features before any collective
        projector, phi, y = s.shard.run_everywhere(self._features_of, model, source, probe, self.like, start, stop,
                                                   check_labels)
        self.projector, self.y_train = projector, y
        if n <= projector.dim:  # dual on ΦΦᵀ: stable when the regression nearly interpolates, and no larger
            phi = s.comm(s.shard.all_gather_rows, phi)
            self.y_train = s.comm(s.shard.all_gather_rows, torch.as_tensor(y)).numpy()
            self._phi_base, self._phi = phi, phi
            with s.clock("solve"):
                gram = phi @ phi.T
                self.solver = DualRidge(s.ridge_for(gram, self.y_train)).fit(gram, s.targets(self.y_train))
        else:
            with s.clock("solve"):
                reduce = partial(s.comm, s.shard.all_reduce)
                self.solver = PrimalRidge(s.ridge_value, reduce=reduce).fit(phi, s.targets(y))
        logger.debug("NTK influence (projected, k=%d of %d, %s): %d examples here of %d", projector.dim,
                     projector.full_dim, type(self.solver).__name__, stop - start, n)

    def _features_of(
        self, model: nn.Module, source: ExampleSource, probe: np.ndarray, previous: ProjectedNTK | None,
        start: int, stop: int, check_labels: Callable[[np.ndarray, str], None],
    ) -> tuple[ProjectedNTK, torch.Tensor, np.ndarray]:
        """
        Plan the projection (like ``previous`` when warm-started), check the memory, and compute the features of
        the training rows ``start:stop``.

        :return: ``(projector, Φ rows, their labels)``.
        """
        s, n = self.session, source.n
        projector = ProjectedNTK(model, self.dim_asked, seed=self.seed, batch_size=s.batch_size,
                                 max_bytes=s.budget // 2, like=previous)
        projector.plan(probe)
        dim = projector.dim
        if s.ridge_value is None and n > dim:
            raise ValueError(
                f"ridge must be a number for the projected mode with more training examples ({n}) than features "
                f"({dim}), got {s.ridge!r}: the rule needs the n x n kernel; use the exact mode (projection_dim=None)"
            )
        need = projected_bytes(stop - start, n, dim)
        if need > s.budget:
            raise ValueError(
                f"projection_dim must fit {n} training examples in the {s.budget / _GIB:.1f} GiB budget, got "
                f"{dim}, which needs about {need / _GIB:.1f} GiB; lower projection_dim"
                + (" or shard over more processes" if n > dim else "")
            )
        phi = torch.empty((stop - start, dim), dtype=torch.float64, device=s.device)
        y = np.empty(stop - start, dtype=np.int64)
        with s.clock("features"), progress_bar(total=stop - start, desc="NTK features", unit="ex",
                                               verbose=s.verbose) as bar:
            for off, xb, yb in source.batches(s.batch_size, start, stop):
                phi[off : off + len(xb)] = projector.features(xb)
                y[off : off + len(yb)] = yb
                bar.update(len(xb))
        check_labels(y, "y_train")
        return projector, phi, y

    def features(self, x: np.ndarray) -> torch.Tensor:
        """The projected features of ``x``, ``(len(x), k)``, clocked as features."""
        s, dim = self.session, self.projector.dim
        with s.clock("features"):
            out = torch.empty((len(x), dim), dtype=torch.float64, device=s.device)
            for i in range(0, len(x), s.batch_size):
                out[i : i + s.batch_size] = self.projector.features(x[i : i + s.batch_size])
            return out

    # ------------------------------------------------------------------ refit
    def refit(self, changed: np.ndarray, x_changed: np.ndarray) -> None:
        """Swap the rows ``changed`` (sorted): every process may pass the whole change, each takes its own rows."""
        s = self.session
        start, stop = s.shard.bounds(self.n_train)
        here = (changed >= start) & (changed < stop)
        mine, feats = changed[here], self.features(x_changed[here])
        if self.dual:  # every process holds all of Φ
            mine = s.comm(s.shard.all_gather_rows, torch.as_tensor(mine)).numpy()
            feats = s.comm(s.shard.all_gather_rows, feats)
            phi = self._phi_base.clone()
            phi[torch.as_tensor(mine, device=phi.device)] = feats
            with s.clock("solve"):
                self.solver.update(mine, feats @ phi.T)
            self._phi = phi
            return
        with s.clock("solve"):  # primal: the solver puts the rows of the previous refit back itself
            self.solver.update(mine - start, feats)

    # ------------------------------------------------------------------ queries
    def query_parts(self, x_query: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predictions ``f`` (n_q, C) and the leave-one-out factors ``b`` (n_q, n here) and ``β`` (n here, C)."""
        phi_q = self._cached_query_features(x_query)
        if self.dual:
            return self.solver.loo_parts(phi_q @ self._phi.T)
        return self.solver.loo_parts(phi_q)

    def _cached_query_features(self, x_query: np.ndarray) -> torch.Tensor:
        """
        The projected features of queries: an audit asks for the same blocks of queries after every refit (the
        projection does not change), so they are kept by the digest of the block, up to ``QUERY_CACHE_BYTES``.
        """
        if self._query_features is None:
            self._query_features = BoundedCache(_cache.QUERY_CACHE_BYTES, lambda t: t.numel() * t.element_size())
        key = tensor_digest(torch.as_tensor(np.ascontiguousarray(x_query)))
        return self._query_features.get(key, lambda: self.features(x_query))

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Columns of every process side by side (the primal solve holds each process's own), else ``t``."""
        s = self.session
        return t if self.dual else s.comm(s.shard.all_gather_columns, t)

    def self_influence(self, loss: str) -> np.ndarray:
        """The leave-one-out of every training example on itself, from the kept features, ``(n,)``."""
        s = self.session
        phi = self._phi if self.dual else self.solver.features_  # every row (dual) or this process's block (primal)
        labels = torch.as_tensor(self.y_train, device=phi.device)
        out = torch.empty(len(phi), dtype=torch.float64, device=phi.device)
        with s.clock("scores"):
            for i in range(0, len(phi), s.batch_size):
                rows = torch.arange(i, min(i + s.batch_size, len(phi)), device=phi.device)
                f, b, beta = self.solver.loo_parts(phi[rows] @ phi.T if self.dual else phi[rows])
                block = loo_scores(f, b[:, rows], beta[rows], labels[rows], loss)  # the rows on each other
                out[rows] = block.diagonal()
        if not self.dual:
            out = s.comm(s.shard.all_gather_rows, out)
        return out.cpu().numpy()

    def close(self) -> None:
        """Nothing is held outside memory."""
