"""
What the two modes of the NTK influence share during one fit: the device, the process group, the memory budget and
the mode's choice, the kernel engine, the ridge (fixed, or chosen once by a rule at the clean fit) and the clock of
the phases (:class:`NTKSession`). Each mode's backend (:mod:`~art_malleability.influence._ntk_exact`,
:mod:`~art_malleability.influence._ntk_projected`) reads them from here; the estimator
(:class:`~art_malleability.influence.ntk.NTKInfluence`) creates one per fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from art_malleability.distributed import Shard
from art_malleability.influence._ntk_mode import (
    DEFAULT_PROJECTION_DIM,
    MachineFacts,
    ModeChoice,
    ModelFacts,
    ModeOptions,
    choose_mode,
    estimates,
    needs_model_facts,
)
from art_malleability.influence.base import regression_targets
from art_malleability.influence.ntk_memory import check_available, engine_chunk_mb, nominal_gemm_rate
from art_malleability.influence.ridge_choice import RIDGE_RULES, choose_ridge
from art_malleability.ntk.empirical import JacobianGram
from art_malleability.ntk.projection import projected_costs

#: Fewest rows per sub-batch and kernel block the engine may take on a CUDA device (the device's memory budget caps
#: them): large products, few launches.
CUDA_BLOCK_ROWS = 1024
#: The phases of :attr:`NTKSession.seconds`.
PHASES = ("features", "solve", "communication", "scores")


@dataclass
class NTKSession:
    """
    One fit's shared state.

    :param device: The compute device.
    :param shard: The process group (``ONE_PROCESS`` in one process).
    :param budget: Bytes the large matrices may take per process.
    :param ridge: The ridge option: a number or one of :data:`~art_malleability.influence.ridge_choice.RIDGE_RULES`.
    :param n_outputs: Outputs ``C`` of the model.
    :param method: The kernel engine's method.
    :param batch_size: Examples per block of the kernel and feature computations.
    :param verbose: Show progress bars.
    :param choice: The mode's choice (:func:`~art_malleability.influence._ntk_mode.choose_mode`), once made.
    """

    device: torch.device
    shard: Shard
    budget: int
    ridge: float | str
    n_outputs: int
    method: str
    batch_size: int
    verbose: bool
    choice: ModeChoice | None = None
    #: Wall time per phase (:data:`PHASES`).
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    #: The ridge in use (``None`` until a rule has chosen it) and, with a rule, its grid and criteria.
    ridge_value: float | None = None
    ridge_criteria: dict | None = None
    _engine: JacobianGram | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.ridge_value = None if self.ridge in RIDGE_RULES else float(self.ridge)

    def ridge_for(self, kernel: torch.Tensor, y: np.ndarray) -> float:
        """The fixed ridge, or the rule's choice on this kernel (made once, at the clean fit)."""
        if self.ridge_value is None:
            self.ridge_value, self.ridge_criteria = choose_ridge(kernel, self.targets(y), str(self.ridge))
        return self.ridge_value

    def targets(self, y: np.ndarray) -> torch.Tensor:
        """The regression targets of class indices ``y`` (float64, on the device)."""
        return regression_targets(torch.as_tensor(y, device=self.device), self.n_outputs, torch.float64)

    def engine(self, model: nn.Module, n: int) -> JacobianGram:
        """
        The exact kernel's engine, with a chunk budget that lets it keep the factors of all ``n`` training examples
        between blocks when the memory left beside the two ``n × n`` matrices allows (each block would otherwise
        compute them again); one per model. On a CUDA device its blocks take at least :data:`CUDA_BLOCK_ROWS` rows
        where the device's memory allows.
        """
        if self._engine is None or self._engine.model is not model:
            chunk_mb = engine_chunk_mb(n, self.budget, self.device)
            rows = max(self.batch_size, CUDA_BLOCK_ROWS) if self.device.type == "cuda" else self.batch_size
            self._engine = JacobianGram(model, method=self.method, batch_size=rows, chunk_mb=chunk_mb)
        return self._engine

    def choose(self, n: int, options: ModeOptions, budget_text: str, model: nn.Module, probe: np.ndarray,
               planning: bool) -> ModeChoice:
        """
        Choose the mode (:func:`~art_malleability.influence._ntk_mode.choose_mode`) from the options, fixed facts of
        the machine (``budget_text``: where the budget comes from) and the model's facts counted on ``probe`` (the
        size and operations of its Jacobian factors; the slowest process's nominal rate), and keep it.

        :param planning: Estimate both modes' time whatever the options.
        """
        machine = MachineFacts(self.device, self.shard.world_size, self.budget, budget_text)
        facts = None
        if needs_model_facts(options, planning):
            engine = self.engine(model, n)
            seconds = pair_flops = projected = None
            plan_seconds, pass_seconds, rows = 0.0, 0.0, None
            if estimates(options, planning):  # counted operations at the nominal rate
                rate, rate_text = nominal_gemm_rate(self.device)
                rate = -float(self.shard.all_reduce(torch.tensor([-rate], dtype=torch.float64), "max")[0])  # slowest
                machine = replace(machine, rate=rate, rate_text=rate_text)
                cost, rows = engine.method_cost(probe, n)  # the exact engine's method for this kernel, counted
                # an example's own work, and a pass's fixed calls paid per pass of at most ``rows`` examples
                seconds, pair_flops = cost.seconds(1.0, 0.0, 0.0, self.device), cost.pair_flops
                pass_seconds = cost.seconds(0.0, 0.0, 1.0, self.device)
                k = options.projection_dim if isinstance(options.projection_dim, int) else DEFAULT_PROJECTION_DIM
                plan_seconds, projected = projected_costs(model, probe, k, self.batch_size, self.device)
            example_bytes = engine.factor_elements(probe, compressed=False, n=n) * torch.finfo(engine.dtype).bits // 8
            facts = ModelFacts(engine.factor_elements(probe, n=n), example_bytes, engine.batch_size, engine.chunk_mb,
                               engine.panel_rows(), seconds, pair_flops, projected, plan_seconds, pass_seconds,
                               rows)
        self.choice = choose_mode(n, options, machine, facts, estimating=planning)
        return self.choice

    def need(self, n: int, queries: int, dim: int) -> tuple[int, str]:
        """
        Bytes per process of the chosen mode's large buffers with what is kept of ``queries`` queries between passes
        (``dim``: the projection dimension asked for), and what they are for.
        """
        start, stop = self.shard.bounds(n)
        return self.choice.need(n, queries, dim, self.device, self.shard.world_size, stop - start)

    def check_memory(self, n: int, queries: int, dim: int) -> None:
        """The chosen mode's memory (:meth:`need`) must be available now
        (:func:`~art_malleability.influence.ntk_memory.check_available`)."""
        need, what = self.need(n, queries, dim)
        check_available(need, self.device, what, self.shard)

    @contextmanager
    def clock(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to ``seconds[phase]``; time clocked inside it by another phase (kernel
        columns inside a solve, communication) is counted there and not here."""
        def others() -> float:
            return sum(v for k, v in self.seconds.items() if k != phase)

        before, start = others(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start - (others() - before)

    def comm(self, fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """A collective of the group, timed as communication."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds["communication"] += time.perf_counter() - start
