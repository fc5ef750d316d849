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
the queries' kernel rows and solves) stays below ``exact_budget_s`` (30 minutes) or the projected mode's estimate
is no shorter; otherwise the projected mode with ``k = DEFAULT_PROJECTION_DIM``, after a warning that says why and
what the other options would cost. The choice
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
import os

import numpy as np
import torch
from torch import nn

from art_malleability._utils.torch_utils import resolve_device, working_copy
from art_malleability.data.streaming import ExampleSource
from art_malleability.distributed import Shard, current_shard
from art_malleability.influence._ntk_exact import ExactNTK, check_ridge_rule
from art_malleability.influence._ntk_mode import DEFAULT_PROJECTION_DIM, ModeChoice, ModeOptions
from art_malleability.influence._ntk_projected import ProjectedNTKFit
from art_malleability.influence._ntk_rules import NTK_RULES
from art_malleability.influence._ntk_session import NTKSession
from art_malleability.influence.base import InfluenceEstimator
from art_malleability.influence.ntk_memory import MEMORY_SHARE, memory_budget
from art_malleability.influence.ridge import loo_scores
from art_malleability.influence.ridge_choice import DEFAULT_RIDGE
from art_malleability.linalg.ridge import DualRidge, PrimalRidge

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
    :param batch_size: Examples per block in the kernel and feature computations (on a CUDA device the exact
        kernel's blocks take at least 1,024 where the device's memory allows).
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
    _parameter_rules = NTK_RULES

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

    # ------------------------------------------------------------------ mode and memory
    def _choose_mode(self, n: int, session: NTKSession, model: nn.Module, probe: np.ndarray,
                     planning: bool = False) -> ModeChoice:
        """
        The mode (:func:`~art_malleability.influence._ntk_mode.choose_mode`), from the inputs, the options and fixed
        facts of the machine and the model only (its total memory, threads and device kind, and counted operations:
        nothing timed, nothing read of what other processes hold); the reason goes to ``mode_reason_``. The chosen
        mode must then fit the memory available now (checked by :meth:`fit`); ``planning``: estimate both modes.
        """
        options = ModeOptions(self.projection_dim, self.max_exact_n, self.exact_budget_s, self.planned_refits,
                              self.planned_queries)
        device = session.device
        budget_text = (f"memory_limit_gb={self.memory_limit_gb:g}" if self.memory_limit_gb is not None
                       else f"{MEMORY_SHARE:.0%} of the {device.type.upper()} device's total memory")
        choice = session.choose(n, options, budget_text, model, probe, planning)
        self.mode_, self.estimated_seconds_, self.mode_reason_, self.auto_note_ = (
            choice.mode, choice.seconds, choice.reason, choice.note)
        if choice.note is not None and not planning:  # plan() reports it instead
            logger.warning("NTK influence: %s", choice.note)
        return choice

    def _dim(self) -> int:
        """The projection dimension asked for (``"auto"``: :data:`DEFAULT_PROJECTION_DIM`)."""
        return DEFAULT_PROJECTION_DIM if self.projection_dim in ("auto", None) else int(self.projection_dim)

    def _session(self, shard: Shard, n_outputs: int) -> NTKSession:
        return NTKSession(self.device_, shard, memory_budget(self.memory_limit_gb, self.device_, shard), self.ridge,
                          n_outputs, self.method, self.batch_size, self.verbose)

    def plan(self, model: nn.Module, x_probe: np.ndarray, n_train: int) -> dict:
        """
        What :meth:`fit` on ``n_train`` examples like ``x_probe`` would run, decided the same way and without the
        long work (on a copy of this estimator, which is left as it is): the mode and why, the estimated seconds of
        the planned work in both modes, and the bytes per process the chosen mode's large buffers take.

        :param model: The model (its architecture decides the sizes; the weights do not matter).
        :param x_probe: A few training inputs (up to 64 are used).
        :param n_train: Training examples.
        :return: ``{"mode", "reason", "seconds" (by mode), "fit_seconds" (the projected mode's fit alone with the
            queries scored once), "bytes", "cache_bytes" (what is kept of the planned queries between passes),
            "kept_bytes" (the training set's factors, when the exact mode keeps them; else 0), "budget"}``.
        """
        other = type(self)(**self.get_params())
        other._check_params()
        other.device_ = resolve_device(other.device)
        copy = working_copy(model, other.device_, other.dtype)
        session = other._session(current_shard(other.distributed), 0)
        choice = other._choose_mode(int(n_train), session, copy, np.asarray(x_probe[:64]), planning=True)
        return {"mode": choice.mode, "reason": choice.reason, "seconds": dict(choice.seconds),
                "fit_seconds": choice.fit_seconds,
                "bytes": session.need(int(n_train), int(self.planned_queries), other._dim())[0],
                "cache_bytes": choice.query_cache_bytes(int(n_train), int(self.planned_queries), other._dim()),
                "kept_bytes": choice.kept_bytes, "budget": session.budget}

    # ------------------------------------------------------------------ fit and refit
    def _fit(self, model: nn.Module, x_train: np.ndarray, y_train: np.ndarray) -> None:
        self._fit_source(model, ExampleSource(x_train, y_train, name="x_train"))

    def _fit_source(self, model: nn.Module, source: ExampleSource) -> None:
        n = source.n
        shard = current_shard(self.distributed)
        if shard.world_size > n:
            raise ValueError(
                f"x_train must hold at least one example per process, got {n} examples for the "
                f"{shard.world_size} processes of the process group"
            )
        previous = getattr(self, "_backend", None)
        if previous is not None:
            previous.close()  # a previous fit's tiles on disk go now
        warm = previous.projector if self._warm_start and isinstance(previous, ProjectedNTKFit) else None
        self._backend = None
        session = self._session(shard, self.n_outputs_)
        probe, _ = source.take(np.arange(min(n, 64)), self.batch_size)
        choice = self._choose_mode(n, session, model, probe)
        check_ridge_rule(session, n)
        session.check_memory(n, int(self.planned_queries), self._dim())
        backend = (ExactNTK(session, self.tile_folder) if choice.mode == "exact"
                   else ProjectedNTKFit(session, self._dim(), self.projection_seed, like=warm))
        self._backend = backend  # what a failed fit leaves is closed by the next
        backend.fit(model, source, probe, self._check_labels)
        self._session_, self.x_train_, self.y_train_ = session, backend.x_train, backend.y_train

    def _refit(self, changed: np.ndarray, x_changed: np.ndarray) -> None:
        order = np.argsort(changed, kind="stable")
        self._backend.refit(changed[order], x_changed[order])
        self.x_train_ = self._backend.x_train

    # ------------------------------------------------------------------ fitted state
    shard_ = property(lambda self: self._session_.shard, doc="The process group of the fit.")
    seconds_ = property(lambda self: self._session_.seconds, doc="Wall time since :meth:`fit` per phase.")
    ridge_ = property(lambda self: self._session_.ridge_value, doc="The ridge in use.")
    ridge_criteria_ = property(lambda self: self._session_.ridge_criteria, doc="A ridge rule's grid and criteria.")
    solver_ = property(lambda self: self._backend.solver, doc="The ridge solver of the fit.")
    projector_ = property(lambda self: getattr(self._backend, "projector", None), doc="The projection, if any.")

    kernel_method_ = property(
        lambda self: (self._session_._engine.describe_method()
                      if self.mode_ == "exact" and self._session_._engine is not None else None),
        doc="The exact kernel engine's method and why (``None`` when no exact kernel was computed).")
    projection_dim_ = property(lambda self: getattr(self.projector_, "dim", None),
                               doc="The realised projection dimension (``None`` in the exact mode).")

    @property
    def kernel_(self) -> torch.Tensor:
        """The exact mode's ``n × n`` eNTK of the fitted training set (its base fit), when it is held whole."""
        self._check_fitted("kernel_")
        kernel = getattr(self.solver_, "kernel_", None) if self.mode_ == "exact" else None
        if not isinstance(kernel, torch.Tensor):
            raise AttributeError("kernel_ exists in the in-memory exact mode only (projection_dim=None)")
        return kernel

    @property
    def alpha_(self) -> torch.Tensor:
        """Dual coefficients ``A⁻¹Y`` (exact mode, or projected with ``n ≤ k``)."""
        self._check_fitted("alpha_")
        if not isinstance(self.solver_, DualRidge):
            raise AttributeError("alpha_ exists when the solve is in the dual (exact mode, or n <= projection_dim)")
        return self.solver_.alpha_

    # ------------------------------------------------------------------ queries
    def predict(self, x_query: np.ndarray) -> np.ndarray:
        """
        Kernel ridge regression predictions at the queries.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, C)``.
        """
        self._check_fitted("predict")
        f, _, _ = self._backend.query_parts(self._check_inputs(x_query, "x_query"))
        return f.cpu().numpy()

    def loo_predictions(self, x_query: np.ndarray) -> np.ndarray:
        """
        Exact leave-one-out predictions of the kernel predictor, without retraining:
        ``f_q + Δf_{q,i}`` is the prediction at query ``q`` after removing training example ``i``.

        :param x_query: Query inputs, shape ``(n_query, *input_shape)``.
        :return: ``float64`` array ``(n_query, n_train, C)``.
        """
        self._check_fitted("loo_predictions")
        f, b, beta = self._backend.query_parts(self._check_inputs(x_query, "x_query"))
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
        own = self._backend.self_influence(self.loss) if x is None and y is None else None
        return super().self_influence(x, y) if own is None else own

    def _scores(self, x_query: np.ndarray, y_query: np.ndarray) -> np.ndarray:
        with self._session_.clock("scores"):
            f, b, beta = self._backend.query_parts(x_query)
            y = torch.as_tensor(y_query, device=f.device)
            return self._backend.gather(loo_scores(f, b, beta, y, self.loss)).cpu().numpy()
