"""
NTK influence: exact leave-one-out influence of kernel ridge regression on the empirical NTK.

This is the paper's estimator (after Zhang & Zhang, 2022): the trained network is replaced by
kernel ridge regression on its empirical NTK ``K`` (traced over logits), with ``A = K + λI`` and
targets ``Y`` (one-hot training labels). Removing training example ``i`` and solving again
changes the kernel predictor at a query ``q`` by exactly (no retraining)

    Δf_{q,i} = −(K_q A⁻¹)_i · α_i / (A⁻¹)_ii            (``α = A⁻¹Y``; a ``C``-vector)

and the influence of ``i`` on ``q`` is ``loss(f_q + Δf_{q,i}, y_q) − loss(f_q, y_q)``:
**positive = helpful** (removing ``i`` raises the query's loss).

Two modes compute it (see :mod:`art_malleability.influence.ridge` for the solves):

- **exact**: the ``n × n`` empirical NTK (:func:`~art_malleability.ntk.empirical.empirical_ntk`)
  and the dual solve. Memory: two ``n × n`` float64 matrices (``16 n²`` bytes: 3.2 GB at
  ``n = 10,000``), time ``O(n³)``.
- **projected**: features ``Φ`` (``n × k``) from a seeded random projection of each example's
  logit Jacobians with ``E[ΦΦᵀ] = K`` (:class:`~art_malleability.ntk.projection.ProjectedNTK`),
  then the same leave-one-out in the primal (``k × k`` system; the dual on ``ΦΦᵀ`` when
  ``n ≤ k``). Memory ``O(n k + k²)``, never ``n × n``; time ``O(n k²)``. With a projection that
  keeps every dimension the scores equal the exact ones.

``projection_dim="auto"`` (the default) runs the exact mode when ``n ≤ max_exact_n`` (no cap by default), its
solve fits the memory budget in one of its three forms and its estimated time for the planned work (the fit,
``planned_refits`` refits and the scores of ``planned_queries`` queries after each: the kernel, ``2 n² D``
operations with ``D`` the size of an example's Jacobian factors, a few thousand for the reference
models, about 50,000 for a small CNN, millions for a ResNet; the factorisations, ``4 n³ / 3``, and the updates;
the queries' kernel rows and solves) stays below ``exact_budget_s`` (30 minutes); otherwise the projected mode with
``k = DEFAULT_PROJECTION_DIM``, after a warning that says why and what the other options would cost. The choice
depends only on the inputs, the options and fixed facts of the machine (the memory budget is ``memory_limit_gb`` or
a share of the *total* memory; the time comes from counted operations at a nominal rate of the device's kind and
threads, :func:`~art_malleability.influence.ntk_memory.nominal_gemm_rate`): the same command runs the same estimator
whatever else the machine is doing, and ``mode_reason_`` says why. A mode whose memory is not available at the moment
stops with a ``MemoryError`` that says so, rather than switching estimators. The rule is the same in one process and
over a ``torch.distributed`` group, except that the time is shared by the processes: a group never runs the
projected mode where one process would run the exact one. The exact solve's forms, the cheapest that
fits first (:func:`~art_malleability.influence.ntk_memory.exact_plan`): two ``n × n`` matrices in
memory (one process); the lower tiles of the kernel and its factor in memory, dealt out over the
processes of a group (each holds about ``1/w`` of them, and of an update's blocks); the same tiles in
files of a temporary folder (out of core). The exact
mode is preferred because the projected scores are a different estimator: at the paper's ridge they
agree only loosely with the exact ones (see the scale page of the documentation). Both modes check
their memory before they allocate and stop with an error that names the way out.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from functools import partial

import numpy as np
import torch
from torch import nn

from art_malleability._utils import cache as _cache
from art_malleability._utils.cache import BoundedCache
from art_malleability._utils.io import progress_bar
from art_malleability._utils.torch_utils import resolve_device, tensor_digest, working_copy
from art_malleability.data.streaming import ExampleSource
from art_malleability.distributed import Shard, current_shard
from art_malleability.influence._ntk_mode import (
    DEFAULT_PROJECTION_DIM,
    MachineFacts,
    ModelFacts,
    ModeOptions,
    choose_mode,
    estimates,
    needs_model_facts,
)
from art_malleability.influence.base import InfluenceEstimator, regression_targets
from art_malleability.influence.ntk_memory import (  # noqa: F401 - MEMORY_SHARE: its public path
    _GIB,
    FACTOR_EFFICIENCY,
    MEMORY_SHARE,
    check_available,
    engine_chunk_mb,
    factor_flops,
    memory_budget,
    nominal_gemm_rate,
    plan_bytes,
    projected_bytes,
)
from art_malleability.influence.ridge import DualRidge, PrimalRidge, loo_scores
from art_malleability.influence.ridge_choice import DEFAULT_RIDGE, RIDGE_RULES, check_ridge, choose_ridge
from art_malleability.ntk.empirical import NTK_METHODS, JacobianGram
from art_malleability.ntk.kept import KeptFactors
from art_malleability.ntk.projection import ProjectedNTK, check_projection_dim

logger = logging.getLogger(__name__)

#: Largest training set of the exact mode under ``projection_dim="auto"`` (``None``: no cap, the time budget decides).
DEFAULT_MAX_EXACT_N = None
#: Longest estimated time (seconds) of the exact mode's planned work under ``projection_dim="auto"``
#: (:func:`~art_malleability.influence.ntk_memory.exact_seconds`, at the device's nominal rate).
DEFAULT_EXACT_BUDGET_S = 1800.0
class NTKInfluence(InfluenceEstimator):
    """
    Leave-one-out influence of kernel ridge regression on the empirical NTK of the model.

    Scores have shape ``(n_query, n_train)``; **positive = helpful**: removing the training
    example from the kernel ridge regression would raise the query's loss.

    :param ridge: Ridge ``λ > 0`` added to the kernel diagonal (the paper uses ``1e-3``), or a rule that chooses it
        from the clean training set at :meth:`fit` (:mod:`~art_malleability.influence.ridge_choice`): ``"loo"`` (least
        exact leave-one-out error of the regression targets) or ``"gcv"`` (generalised cross-validation), over a grid
        relative to the kernel's scale; the chosen value stays for the refits, so clean and perturbed scores come
        from the same regression. A rule needs the kernel as one matrix: the exact mode's dense solve (one process)
        or the projected mode with ``n <= k``.
    :param loss: Loss applied to the kernel predictor's outputs: ``"mse"`` (the kernel ridge
        regression's own loss, default) or ``"cross_entropy"`` (outputs treated as logits).
    :param device: ``"auto"``, a device string or a :class:`torch.device`.
    :param dtype: Dtype of the kernel and feature computation (default ``torch.float64``); the
        ridge solves are always done in float64.
    :param batch_size: Examples per block in the kernel and feature computations.
    :param method: eNTK method of the exact mode (``"auto"``, ``"structured"``, ``"batched"`` or ``"jacobian"``), see
        :func:`~art_malleability.ntk.empirical.empirical_ntk`.
    :param projection_dim: ``"auto"`` (exact or projected by the rule in the module docstring),
        ``None`` (always exact) or the projection dimension ``k`` (always projected).
    :param projection_seed: Seed of the projection matrices.
    :param max_exact_n: Largest training set of the exact mode under ``projection_dim="auto"``, or ``None`` (no cap:
        ``exact_budget_s`` decides).
    :param memory_limit_gb: Memory (GiB) the large matrices may take; ``None``: 80 % of the device's total memory (a
        fixed fact of the machine; in a sharded run shared by the processes of a machine, the smallest budget of all
        processes applies). The mode and the solve's form are chosen within it; :meth:`fit` then stops with a
        ``MemoryError`` if what they need is not available at the moment.
    :param distributed: ``"auto"`` (shard over an initialised ``torch.distributed`` group of several processes:
        the exact mode deals the tiles of its kernel and factor out over the processes, the projected mode the
        rows of ``Φ``), ``True`` (require one) or ``False``.
    :param tile_folder: Folder for the tiles of the out-of-core exact solve (when neither the dense ``n × n`` solve
        nor its tiles fit the memory budget): a temporary subfolder is created there and removed when the
        estimator is refitted or closed. ``None``: the system's temporary folder.
    :param verbose: Show a progress bar over the feature computation.
    :param exact_budget_s: Longest estimated time (seconds) of the exact mode's planned work (the fit,
        ``planned_refits`` refits and ``planned_queries`` queries' scores after each) for ``projection_dim="auto"`` to
        run it; the estimate counts operations at a nominal rate of the device and the number of processes (nothing
        is timed). When ``"auto"`` runs the projected mode instead, it says why and what the other options would
        cost in a warning (``auto_note_``) before the long work starts.
    :param planned_refits: Refits the estimate of ``exact_budget_s`` covers (an audit sets its attacks and control
        draws).
    :param planned_queries: Queries scored after the fit and each refit that the estimate covers (an audit sets its
        number of queries).

    Fitted attributes: ``mode_`` (``"exact"`` or ``"projected"``), ``mode_reason_`` (why, in words: the option, the
    budget and the estimate it was decided on), ``estimated_seconds_`` (``projection_dim="auto"``: the estimates of
    both modes for the planned work, by mode), ``projection_dim_`` (realised
    ``k``, ``None`` when exact), ``solver_`` (:class:`~art_malleability.influence.ridge.DualRidge`
    or :class:`~art_malleability.influence.ridge.PrimalRidge`), ``projector_`` (projected mode),
    ``ridge_`` (the ridge used), ``ridge_criteria_`` (with a rule: the grid and its criteria),
    ``shard_`` (the process group, a :class:`~art_malleability.distributed.Shard`: ``ONE_PROCESS`` in one process),
    ``kernel_`` (exact mode: the ``n × n`` eNTK of the fitted training set), ``model_`` (working copy), ``seconds_``
    (wall time since :meth:`fit` per phase: ``features`` (the kernel in the exact mode), ``solve``,
    ``communication`` (collectives of a sharded run), ``scores``; :meth:`refit` and :meth:`scores`
    add to it).
    """

    name = "ntk"
    streams = True

    def __init__(
        self,
        ridge: float | str = DEFAULT_RIDGE,
        loss: str = "mse",
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        batch_size: int = 256,
        method: str = "auto",
        projection_dim: int | str | None = "auto",
        projection_seed: int = 0,
        max_exact_n: int | None = DEFAULT_MAX_EXACT_N,
        memory_limit_gb: float | None = None,
        distributed: bool | str = "auto",
        verbose: bool = False,
        tile_folder: str | os.PathLike | None = None,
        exact_budget_s: float = DEFAULT_EXACT_BUDGET_S,
        planned_refits: int = 1,
        planned_queries: int = 100,
    ) -> None:
        self._init_params(locals())

    def _check_params(self) -> None:
        super()._check_params()
        check_ridge(self.ridge)
        if self.method not in NTK_METHODS:
            raise ValueError(f"method must be one of {NTK_METHODS}, got {self.method!r}")
        if self.projection_dim is not None and self.projection_dim != "auto":
            check_projection_dim(self.projection_dim)
        if isinstance(self.projection_seed, bool) or not isinstance(self.projection_seed, (int, np.integer)):
            raise ValueError(f"projection_seed must be an integer, got {self.projection_seed!r}")
        cap = self.max_exact_n
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0):
            raise ValueError(f"max_exact_n must be a non-negative integer or None, got {cap!r}")
        if self.memory_limit_gb is not None:
            ok = not isinstance(self.memory_limit_gb, bool) and isinstance(
                self.memory_limit_gb, (int, float, np.integer, np.floating)
            )
            if not ok or not math.isfinite(float(self.memory_limit_gb)) or self.memory_limit_gb <= 0:
                raise ValueError(
                    f"memory_limit_gb must be a positive number of GiB or None, got {self.memory_limit_gb!r}"
                )
        budget_s = self.exact_budget_s
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float, np.integer, np.floating)) or not (
            math.isfinite(float(budget_s)) and budget_s >= 0
        ):
            raise ValueError(f"exact_budget_s must be a non-negative number of seconds, got {budget_s!r}")
        for name in ("planned_refits", "planned_queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.distributed not in ("auto", True, False):
            raise ValueError(f"distributed must be 'auto', True or False, got {self.distributed!r}")
        if self.tile_folder is not None and not os.path.isdir(self.tile_folder):
            raise ValueError(f"tile_folder must be an existing folder or None, got {str(self.tile_folder)!r}")

    # ------------------------------------------------------------------ mode and memory
    def _choose_mode(self, n: int, shard: Shard, model: nn.Module, probe: np.ndarray) -> str:
        """
        The mode (:func:`~art_malleability.influence._ntk_mode.choose_mode`), from the inputs, the options and fixed
        facts of the machine and the model only (its total memory, threads and device kind, and counted operations:
        nothing timed, nothing read of what other processes hold); the reason goes to ``mode_reason_``. The chosen
        mode must then fit the memory available now (:meth:`_check_available`).
        """
        options = ModeOptions(self.projection_dim, self.max_exact_n, self.exact_budget_s, self.planned_refits,
                              self.planned_queries)
        planning = getattr(self, "_planning", False)  # plan() estimates any mode
        budget_text = (f"memory_limit_gb={self.memory_limit_gb:g}" if self.memory_limit_gb is not None
                       else f"{MEMORY_SHARE:.0%} of the {self.device_.type.upper()} device's total memory")
        machine = MachineFacts(self.device_, shard.world_size, self._budget, budget_text)
        facts = None
        if needs_model_facts(options, planning):
            engine = self._engine(model, n, self._budget)
            seconds = None
            if estimates(options, planning):  # counted operations at the nominal rate
                rate, rate_text = nominal_gemm_rate(self.device_)
                rate = -float(shard.all_reduce(torch.tensor([-rate], dtype=torch.float64), "max")[0])  # the slowest
                machine = replace(machine, rate=rate, rate_text=rate_text)
                seconds = factor_flops(engine, probe) / (rate * FACTOR_EFFICIENCY)
            example_bytes = engine.factor_elements(probe, compressed=False) * torch.finfo(engine.dtype).bits // 8
            facts = ModelFacts(engine.factor_elements(probe), example_bytes, engine.batch_size, engine.chunk_mb,
                               engine.panel_rows(), seconds)
        choice = choose_mode(n, options, machine, facts, estimating=planning)
        self._choice = choice
        self.estimated_seconds_, self.mode_reason_, self.auto_note_ = choice.seconds, choice.reason, choice.note
        if choice.note is not None and not planning:  # plan() reports it instead
            logger.warning("NTK influence: %s", choice.note)
        if choice.mode == "exact":
            self._log_plan(n, shard.world_size)
        return choice.mode

    def _need(self, n: int) -> tuple[int, str]:
        """Bytes per process of the chosen mode's large buffers (with what is kept of the planned queries between
        passes), and what they are for."""
        shard = self.shard_
        if self.mode_ == "exact":  # the solve's form, the engine's chunks, and the set's factors where they are kept
            choice = self._choice
            need = (plan_bytes(choice.plan, n, self.device_, shard.world_size, choice.reserve) + choice.kept_bytes
                    + self._query_cache_bytes(n))
            return need, f"the exact NTK influence of {n} examples ({choice.form()})"
        start, stop = shard.bounds(n)
        dim = DEFAULT_PROJECTION_DIM if self.projection_dim == "auto" else int(self.projection_dim)
        need = projected_bytes(stop - start, n, dim) + self._query_cache_bytes(n)
        return need, f"the projected NTK influence of {n} examples (k = {dim})"

    def _query_cache_bytes(self, n: int) -> int:
        """Bytes of what is kept of ``planned_queries`` queries between the passes of an audit, at most
        ``QUERY_CACHE_BYTES`` each: exact, their solves on the unchanged rows and, with the set's factors kept, their
        kernel rows on the set and their factors; projected, their features."""
        q, bound = int(self.planned_queries), _cache.QUERY_CACHE_BYTES
        if self.mode_ != "exact":
            dim = DEFAULT_PROJECTION_DIM if self.projection_dim == "auto" else int(self.projection_dim)
            return min(bound, 8 * q * dim)
        choice = self._choice
        factors = min(choice.factor_cache, q * choice.example_bytes)
        kept = min(bound, 8 * q * n) + factors if choice.kept_bytes else 0
        return min(bound, 8 * q * n) + kept

    def _check_available(self, n: int) -> None:
        """The chosen mode's memory must be available now (:func:`~.ntk_memory.check_available`)."""
        need, what = self._need(n)
        check_available(need, self.device_, what, self.shard_)

    def plan(self, model: nn.Module, x_probe: np.ndarray, n_train: int) -> dict:
        """
        What :meth:`fit` on ``n_train`` examples like ``x_probe`` would run, decided the same way and without the
        long work (on a copy of this estimator, which is left as it is): the mode and why, the estimated seconds of
        the planned work in both modes, and the bytes per process the chosen mode's large buffers take.

        :param model: The model (its architecture decides the sizes; the weights do not matter).
        :param x_probe: A few training inputs (up to 64 are used).
        :param n_train: Training examples.
        :return: ``{"mode", "reason", "seconds" (by mode), "bytes", "cache_bytes" (what is kept of the planned queries
            between passes), "budget"}``.
        """
        other = type(self)(**self.get_params())
        other._check_params()
        other._planning = True
        other.device_ = resolve_device(other.device)
        shard = current_shard(other.distributed)
        other.shard_ = shard
        copy = working_copy(model, other.device_, other.dtype)
        other._budget = memory_budget(other.memory_limit_gb, other.device_, shard)
        other._jacobian_gram = None
        probe = np.asarray(x_probe[:64])
        mode = other._choose_mode(int(n_train), shard, copy, probe)
        other.mode_ = mode
        return {"mode": mode, "reason": other.mode_reason_, "seconds": dict(other.estimated_seconds_),
                "bytes": other._need(int(n_train))[0], "cache_bytes": other._query_cache_bytes(int(n_train)),
                "budget": other._budget}

    def _check_ridge_rule(self, n: int) -> None:
        """
        A ridge rule needs the kernel as one matrix: refuse it, before the long work, where the exact solve has none
        (the projected mode checks its realised dimension once the projection is planned).
        """
        self.ridge_ = None if self.ridge in RIDGE_RULES else float(self.ridge)
        self.ridge_criteria_ = None
        if self.ridge_ is not None:
            return
        if self.mode_ == "exact" and self._choice.plan[0] is not None:
            where = "tiles on disk" if self._choice.plan[1] else "tiles"
            raise ValueError(
                f"ridge must be a number for the exact solve in {where} ({n} training examples, "
                f"{self.shard_.world_size} process(es)), got {self.ridge!r}: the rule "
                "needs the kernel's eigendecomposition, which only the dense solve in one process holds; choose the "
                "ridge on a subset, or raise memory_limit_gb"
            )

    def _ridge_for(self, kernel: torch.Tensor, y: np.ndarray) -> float:
        """The fixed ridge, or the rule's choice on this kernel (computed once, at the clean fit)."""
        if self.ridge_ is None:
            self.ridge_, self.ridge_criteria_ = choose_ridge(kernel, self._targets(y), str(self.ridge))
        return self.ridge_

    def _log_plan(self, n: int, world: int) -> None:
        block, on_disk = self._choice.plan
        if block is None:
            logger.info("NTK influence: exact solve, %d x %d matrices in memory", n, n)
            return
        where = f"files in {self.tile_folder or tempfile.gettempdir()}" if on_disk else "memory"
        logger.info("NTK influence: exact solve in tiles of %d rows over %d process(es), held in %s", block, world,
                    where)

    def _engine(self, model: nn.Module, n: int, budget: int) -> JacobianGram:
        """
        The exact kernel's engine, with a chunk budget that lets it keep the factors of all ``n``
        training examples between blocks when the memory left beside the two ``n × n`` matrices
        allows (each block would otherwise compute them again).
        """
        engine = getattr(self, "_jacobian_gram", None)
        if engine is not None and engine.model is model:
            return engine
        chunk_mb = engine_chunk_mb(n, budget, self.device_)
        self._jacobian_gram = JacobianGram(model, method=self.method, batch_size=self.batch_size, chunk_mb=chunk_mb)
        return self._jacobian_gram

    # ------------------------------------------------------------------ fit
    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self._fit_source(model, ExampleSource(x_train, y_train, name="x_train"))

    def _targets(self, y: np.ndarray) -> torch.Tensor:
        return regression_targets(torch.as_tensor(y, device=self.device_), self.n_outputs_, torch.float64)

    def _fit_source(self, model: nn.Module, source: ExampleSource) -> None:
        n = source.n
        shard = current_shard(self.distributed)
        if shard.world_size > n:
            raise ValueError(
                f"x_train must hold at least one example per process, got {n} examples for the "
                f"{shard.world_size} processes of the process group"
            )
        self.shard_ = shard
        self.seconds_ = dict.fromkeys(("features", "solve", "communication", "scores"), 0.0)
        self._jacobian_gram = None
        self._kept = None
        self._query_features = None
        self._budget = memory_budget(self.memory_limit_gb, self.device_, shard)
        self._choice = None
        previous = getattr(self, "solver_", None)
        if isinstance(previous, DualRidge):
            previous.close()  # a previous fit's tiles on disk go now
        probe, _ = source.take(np.arange(min(n, 64)), self.batch_size)
        self.mode_ = self._choose_mode(n, shard, model, probe)
        self._check_ridge_rule(n)
        self._check_available(n)
        self._prev_local = np.zeros(0, dtype=np.int64)
        if self.mode_ == "exact":
            self._fit_exact(model, source)
        else:
            self._fit_projected(model, source, probe)

    def _fit_exact(self, model: nn.Module, source: ExampleSource) -> None:
        """The exact mode: the ``n × n`` eNTK of the training set and its dual solve (dense, or in tiles)."""
        self.projector_, self.projection_dim_ = None, None
        x, y = source.arrays(self.batch_size)
        self._check_labels(y, "y_train")
        self.x_train_, self.y_train_ = np.array(x, copy=True), y
        self._x_base = self.x_train_
        block, on_disk = self._choice.plan
        if block is not None:  # tiles, computed from the model tile by tile (over the group: each its own)
            engine = self._engine(model, len(x), self._budget)

            def tile(rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
                with self._clock("features"):
                    return engine.gram(x[rows], x[cols]).to(torch.float64)

            with self._clock("solve"):
                folder = (self.tile_folder or tempfile.gettempdir()) if on_disk else None
                solver = DualRidge(self.ridge_, block=block, folder=folder, group=self.shard_)
                self.solver_ = solver.fit(tile, self._targets(y))
            return
        with self._clock("features"):
            kernel = self._exact_fit_kernel(model, x)
        with self._clock("solve"):
            self.solver_ = DualRidge(self._ridge_for(kernel, y)).fit(kernel, self._targets(y))
        logger.debug("NTK influence (exact): kernel %s, ridge %g", tuple(kernel.shape), self.ridge_)

    def _train_columns(self, x_rows: np.ndarray, x_train: np.ndarray) -> torch.Tensor:
        """
        The kernel between ``x_rows`` and the whole training set ``x_train``, ``(len(x_rows), n)``; over a group each
        process computes the columns of its block and the blocks are gathered.
        """
        start, stop = self.shard_.bounds(self.n_train_)
        local = self.shard_.run_everywhere(
            lambda: self._kernel(self.model_, x_rows, x_train[start:stop]).to(torch.float64))
        return self._comm(self.shard_.all_gather_columns, local)

    def _fit_projected(self, model: nn.Module, source: ExampleSource, probe: np.ndarray) -> None:
        """The projected mode: this process's block of the features ``Φ``, then the primal or dual solve."""
        n, shard = source.n, self.shard_
        start, stop = shard.bounds(n)
        previous = getattr(self, "projector_", None) if self._warm_start else None
        self.projector_, self.projection_dim_, self.x_train_ = None, None, None
        # every process plans, checks its memory and computes its features before any collective
        projector, phi, y = shard.run_everywhere(self._projected_features, model, source, probe, previous, start, stop)
        dim = projector.dim
        self.projector_, self.projection_dim_ = projector, dim
        self.y_train_ = y
        self._bounds = (start, stop)
        if n <= dim:  # dual on ΦΦᵀ: stable when the regression nearly interpolates, and no larger
            phi = self._comm(shard.all_gather_rows, phi)
            y = self._comm(shard.all_gather_rows, torch.as_tensor(y)).numpy()
            self.y_train_ = y
            self._bounds = (0, n)
            self._phi_base, self._phi = phi, phi
            with self._clock("solve"):
                gram = phi @ phi.T
                self.solver_ = DualRidge(self._ridge_for(gram, y)).fit(gram, self._targets(y))
        else:
            reduce = partial(self._comm, shard.all_reduce)
            with self._clock("solve"):
                self.solver_ = PrimalRidge(self.ridge_, reduce=reduce).fit(phi, self._targets(y))
        logger.debug(
            "NTK influence (projected, k=%d of %d, %s): %d examples here of %d",
            dim, projector.full_dim, type(self.solver_).__name__, stop - start, n,
        )

    def _projected_features(
        self, model: nn.Module, source: ExampleSource, probe: np.ndarray, previous: ProjectedNTK | None,
        start: int, stop: int,
    ) -> tuple[ProjectedNTK, torch.Tensor, np.ndarray]:
        """
        Plan the projection (like ``previous`` when warm-started), check the memory, and compute the features of
        the training rows ``start:stop``.

        :return: ``(projector, Φ rows, their labels)``.
        """
        n = source.n
        k = DEFAULT_PROJECTION_DIM if self.projection_dim == "auto" else int(self.projection_dim)
        projector = ProjectedNTK(
            model, k, seed=int(self.projection_seed), batch_size=self.batch_size,
            max_bytes=self._budget // 2, like=previous,
        )
        projector.plan(probe)
        dim = projector.dim
        if self.ridge_ is None and n > dim:
            raise ValueError(
                f"ridge must be a number for the projected mode with more training examples ({n}) than features "
                f"({dim}), got {self.ridge!r}: the rule needs the n x n kernel; use the exact mode "
                "(projection_dim=None)"
            )
        need = projected_bytes(stop - start, n, dim)
        if need > self._budget:
            raise ValueError(
                f"projection_dim must fit {n} training examples in the {self._budget / _GIB:.1f} GiB budget, got "
                f"{dim}, which needs about {need / _GIB:.1f} GiB; lower projection_dim"
                + (" or shard over more processes" if n > dim else "")
            )
        phi = torch.empty((stop - start, dim), dtype=torch.float64, device=self.device_)
        y = np.empty(stop - start, dtype=np.int64)
        with self._clock("features"), progress_bar(
            total=stop - start, desc="NTK features", unit="ex", verbose=self.verbose
        ) as bar:
            for off, xb, yb in source.batches(self.batch_size, start, stop):
                phi[off : off + len(xb)] = projector.features(xb)
                y[off : off + len(yb)] = yb
                bar.update(len(xb))
        self._check_labels(y, "y_train")
        return projector, phi, y

    def _exact_fit_kernel(self, model: nn.Module, x: np.ndarray) -> torch.Tensor:
        """
        The training kernel; the training set's Jacobian factors are kept for the queries and the
        refits when they fit the memory left beside the two ``n × n`` matrices (decided with the mode,
        :meth:`_choose_mode`; otherwise every later call computes them again).
        """
        engine = self._engine(model, len(x), self._budget)
        if self._choice.kept_bytes:
            self._kept = KeptFactors(engine, x, query_bytes=self._choice.factor_cache)
            return self._kept.gram().to(torch.float64)
        logger.info("NTK influence: the training set's Jacobian factors do not fit the memory; not kept")
        return self._kernel(model, x).to(torch.float64)

    def _kernel(self, model: nn.Module, x1: np.ndarray, x2: np.ndarray | None = None) -> torch.Tensor:
        return self._engine(model, self.n_train_, self._budget).gram(x1, x2)

    @property
    def kernel_(self) -> torch.Tensor:
        """The exact mode's ``n × n`` eNTK of the fitted training set (its base fit)."""
        self._check_fitted("kernel_")
        if self.mode_ != "exact" or not isinstance(self.solver_.kernel_, torch.Tensor):
            raise AttributeError(
                "kernel_ exists in the in-memory exact mode only (projection_dim=None, the n x n kernel in memory)"
            )
        return self.solver_.kernel_

    @property
    def alpha_(self) -> torch.Tensor:
        """Dual coefficients ``A⁻¹Y`` (exact mode, or projected with ``n ≤ k``)."""
        self._check_fitted("alpha_")
        if not isinstance(self.solver_, DualRidge):
            raise AttributeError("alpha_ exists when the solve is in the dual (exact mode, or n <= projection_dim)")
        return self.solver_.alpha_

    # ------------------------------------------------------------------ refit
    def _refit(self, changed: np.ndarray, x_changed: np.ndarray) -> None:
        order = np.argsort(changed, kind="stable")
        changed, x_changed = changed[order], x_changed[order]
        if self.mode_ == "exact":
            # every process passed its own rows, or all: gather each block's once
            start, stop = self.shard_.bounds(self.n_train_)
            here = (changed >= start) & (changed < stop)
            changed = self._comm(self.shard_.all_gather_rows, torch.as_tensor(changed[here])).numpy()
            x_changed = self._comm(self.shard_.all_gather_rows, torch.as_tensor(x_changed[here])).numpy()
            x = np.array(self._x_base, copy=True)
            x[changed] = x_changed
            with self._clock("features"):
                if self._kept is not None:
                    previous = (self._kept._changed, self._kept._x_changed)
                    self._kept.set_changed(changed, x_changed)
                    rows = self._kept.changed_rows().to(torch.float64) if len(changed) else None
                else:  # the solver asks for the columns it needs (over a group: each process its own)
                    rows = self._changed_columns(x_changed, x) if len(changed) else None
            try:
                with self._clock("solve"):
                    empty = torch.zeros((0, self.n_train_), dtype=torch.float64, device=self.device_)
                    self.solver_.update(changed, rows if rows is not None else empty)
            except BaseException:
                if self._kept is not None:
                    self._kept.set_changed(*previous)
                raise
            self.x_train_ = x
            return
        # every process may pass the whole change: each takes the rows of its own block
        start, stop = self.shard_.bounds(self.n_train_)
        here = (changed >= start) & (changed < stop)
        mine, x_mine = changed[here], x_changed[here]
        feats = self._features(x_mine)
        if isinstance(self.solver_, DualRidge):  # every process holds all of Φ
            mine = self._comm(self.shard_.all_gather_rows, torch.as_tensor(mine)).numpy()
            feats = self._comm(self.shard_.all_gather_rows, feats)
            phi = self._phi_base.clone()
            phi[torch.as_tensor(mine, device=phi.device)] = feats
            with self._clock("solve"):
                self.solver_.update(mine, feats @ phi.T)
            self._phi = phi
            return
        # primal: rows changed by the previous refit go back to their fitted values in the same update
        local = mine - start
        prev, prev_base = self._prev_local, getattr(self, "_prev_base", None)
        restore = np.setdiff1d(prev, local)
        rows_restore = prev_base[torch.as_tensor(np.searchsorted(prev, restore))] if len(restore) else feats[:0]
        base_new = self.solver_.features_[torch.as_tensor(local)].clone()
        in_prev = np.isin(local, prev)
        if in_prev.any():
            base_new[torch.as_tensor(np.flatnonzero(in_prev))] = prev_base[
                torch.as_tensor(np.searchsorted(prev, local[in_prev]))
            ]
        with self._clock("solve"):
            self.solver_.update(np.concatenate([restore, local]), torch.cat([rows_restore, feats]))
        self._prev_local, self._prev_base = local, base_new

    def _changed_columns(self, x_changed: np.ndarray, x: np.ndarray) -> Callable[[np.ndarray], torch.Tensor]:
        """The kernel rows of the changed examples against the training set ``x``, as a function of its columns."""
        model = self.model_

        def columns(cols: np.ndarray) -> torch.Tensor:
            with self._clock("features"):
                return self._kernel(model, x_changed, x[cols]).to(torch.float64)

        return columns

    @contextmanager
    def _clock(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds_[phase]``; time clocked inside it by another phase (kernel
        columns inside a solve, communication) is counted there and not here."""
        def others() -> float:
            return sum(v for k, v in self.seconds_.items() if k != phase)

        before, start = others(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds_[phase] += time.perf_counter() - start - (others() - before)

    def _comm(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """A collective of the shard, timed as communication."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds_["communication"] += time.perf_counter() - start

    def _features(self, x: np.ndarray) -> torch.Tensor:
        with self._clock("features"):
            return self._project(x)

    def _project(self, x: np.ndarray) -> torch.Tensor:
        if len(x) == 0:
            return torch.zeros((0, self.projection_dim_), dtype=torch.float64, device=self.device_)
        out = torch.empty((len(x), self.projection_dim_), dtype=torch.float64, device=self.device_)
        for s in range(0, len(x), self.batch_size):
            out[s : s + self.batch_size] = self.projector_.features(x[s : s + self.batch_size])
        return out

    # ------------------------------------------------------------------ queries
    def _query_parts(self, x_query: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predictions ``f`` (n_q, C) and the leave-one-out factors ``b`` (n_q, n here) and ``β`` (n here, C)."""
        if self.mode_ == "exact":
            # the queries' rows on the examples a refit leaves alone depend on the queries only: one key for both
            key = tensor_digest(torch.as_tensor(np.ascontiguousarray(x_query)))
            if self._kept is not None:
                k_q = self._kept.rows(x_query, key).to(torch.float64)
            else:
                k_q = self._train_columns(x_query, self.x_train_)
            return self.solver_.loo_parts(k_q, key)
        phi_q = self._cached_query_features(x_query)
        if isinstance(self.solver_, DualRidge):
            return self.solver_.loo_parts(phi_q @ self._phi.T)
        return self.solver_.loo_parts(phi_q)

    def _cached_query_features(self, x_query: np.ndarray) -> torch.Tensor:
        """
        The projected features of queries: an audit asks for the same blocks of queries after every refit (the
        projection does not change), so they are kept by the digest of the block, up to ``QUERY_CACHE_BYTES``.
        """
        if self._query_features is None:
            self._query_features = BoundedCache(_cache.QUERY_CACHE_BYTES, lambda t: t.numel() * t.element_size())
        key = tensor_digest(torch.as_tensor(np.ascontiguousarray(x_query)))
        return self._query_features.get(key, lambda: self._project(x_query))

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Columns of every process side by side (the primal solve holds each process's own), else ``t``."""
        if isinstance(self.solver_, PrimalRidge):
            return self._comm(self.shard_.all_gather_columns, t)
        return t

    def predict(self, x_query: np.ndarray) -> np.ndarray:
        """
        Kernel ridge regression predictions at the queries.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, C)``.
        """
        self._check_fitted("predict")
        f, _, _ = self._query_parts(self._check_inputs(x_query, "x_query"))
        return f.cpu().numpy()

    def loo_predictions(self, x_query: np.ndarray) -> np.ndarray:
        """
        Exact leave-one-out predictions of the kernel predictor, without retraining:
        ``f_q + Δf_{q,i}`` is the prediction at query ``q`` after removing training example ``i``.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, n_train, C)``.
        """
        self._check_fitted("loo_predictions")
        f, b, beta = self._query_parts(self._check_inputs(x_query, "x_query"))
        if isinstance(self.solver_, PrimalRidge):
            b, beta = self.shard_.all_gather_columns(b), self.shard_.all_gather_rows(beta)
        return (f[:, None, :] - b[:, :, None] * beta[None, :, :]).cpu().numpy()

    def self_influence(self, x: np.ndarray | None = None, y: np.ndarray | None = None) -> np.ndarray:
        """
        Self-influence (see :meth:`InfluenceEstimator.self_influence`). The projected mode keeps the training set's
        features, not its inputs, and takes it from them: the leave-one-out of each example on itself.

        :param x: ``None`` (the fitted training set).
        :param y: ``None``.
        :return: ``float64`` array ``(n_train,)``.
        """
        self._check_fitted("self_influence")
        if x is not None or y is not None or self.mode_ != "projected" or self.x_train_ is not None:
            return super().self_influence(x, y)
        dual = isinstance(self.solver_, DualRidge)
        phi = self._phi if dual else self.solver_.features_  # every row (dual) or this process's block (primal)
        labels = torch.as_tensor(self.y_train_, device=phi.device)
        out = torch.empty(len(phi), dtype=torch.float64, device=phi.device)
        with self._clock("scores"):
            for s in range(0, len(phi), self.batch_size):
                rows = torch.arange(s, min(s + self.batch_size, len(phi)), device=phi.device)
                f, b, beta = self.solver_.loo_parts(phi[rows] @ phi.T if dual else phi[rows])
                block = loo_scores(f, b[:, rows], beta[rows], labels[rows], self.loss)  # the rows on each other
                out[rows] = block.diagonal()
        if not dual:
            out = self._comm(self.shard_.all_gather_rows, out)
        return out.cpu().numpy()

    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        with self._clock("scores"):
            f, b, beta = self._query_parts(x_query)
            y = torch.as_tensor(y_query, device=f.device)
            return self._gather(loo_scores(f, b, beta, y, self.loss)).cpu().numpy()
