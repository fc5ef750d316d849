"""
The NTK influence's mode rule (:class:`~art_malleability.influence.ntk.NTKInfluence`), as a pure function of the
training set's size, the options and fixed facts: of the machine (memory budget, nominal rate, processes) and of the
model (its Jacobian factors' size and operations, counted on a few examples). Nothing is timed and nothing is read of
what other processes hold, so the same inputs always choose the same mode; the rule needs no model to be tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from art_malleability._utils import cache as _cache
from art_malleability._utils.io import duration_text
from art_malleability.influence.ntk_memory import (
    _GIB,
    engine_reserve,
    exact_plan,
    exact_seconds,
    plan_bytes,
    projected_bytes,
    projected_seconds,
)

#: Projection dimension of ``projection_dim="auto"`` when the projected mode runs.
DEFAULT_PROJECTION_DIM = 4096


@dataclass(frozen=True)
class MachineFacts:
    """
    Fixed facts of the machine and the process group.

    :param device: The compute device.
    :param world: Processes of the group.
    :param budget: Bytes the large matrices may take per process (``memory_budget``).
    :param budget_text: Where the budget comes from, in words.
    :param rate: Nominal fp64 GEMM rate of the slowest process (operations per second), or ``None`` (not estimated).
    :param rate_text: What the rate is made of, in words.
    """

    device: torch.device
    world: int
    budget: int
    budget_text: str
    rate: float | None = None
    rate_text: str = ""


@dataclass(frozen=True)
class ModelFacts:
    """
    Facts of the model, counted on a few examples by the kernel engine.

    :param factor: ``D``, elements of one example's Jacobian factors (as stored).
    :param example_bytes: Bytes of one example's largest (uncompressed) factors.
    :param batch_size: The engine's sub-batch.
    :param chunk_mb: The engine's chunk budget (MiB).
    :param panel: Examples whose factors the engine keeps at once.
    :param example_seconds: Seconds of one example's factors at the nominal rate, or ``None``.
    :param pair_flops: Operations of the contraction per pair of examples (the engine's counted method), or ``None``
        (``2 D``).
    :param projected_seconds: Seconds of one example's projected features at the nominal rate, or ``None``.
    :param pass_seconds: Fixed seconds of one of the engine's passes (its operator calls) at the nominal rate.
    :param pass_rows: Examples of one of the engine's passes at most (``None``: ``batch_size``).
    :param projection_plan_seconds: Seconds of planning the projection (drawing its matrices) at the nominal rate.
    """

    factor: int
    example_bytes: int
    batch_size: int
    chunk_mb: float
    panel: int
    example_seconds: float | None = None
    pair_flops: float | None = None
    projected_seconds: float | None = None
    projection_plan_seconds: float = 0.0
    pass_seconds: float = 0.0
    pass_rows: int | None = None


@dataclass(frozen=True)
class ModeOptions:
    """The options that decide the mode (the estimator's parameters of the same names)."""

    projection_dim: int | str | None = "auto"
    max_exact_n: int | None = None
    exact_budget_s: float = 1800.0
    planned_refits: int = 1
    planned_queries: int = 100


@dataclass
class ModeChoice:
    """
    The mode and what it was decided on.

    :param mode: ``"exact"`` or ``"projected"``.
    :param reason: Why, in words (``mode_reason_``).
    :param plan: The exact solve's form ``(block, on_disk)`` (:func:`exact_plan`), or ``None`` (none fits, or not
        planned).
    :param reserve: Bytes of the engine's chunks, or ``None`` (not planned).
    :param kept_bytes: Bytes of the training set's factors, when the dense exact mode keeps them (else 0).
    :param example_bytes: Bytes of one example's factors (0 when not planned).
    :param factor_cache: Bytes of the queries' factors kept between passes (with the set's factors kept; else 0).
    :param seconds: The estimates of both modes by mode, or ``None`` (not estimated).
    :param note: Under ``"auto"`` when the projected mode runs: why, and what the other options would cost.
    :param fit_seconds: The projected mode's fit alone with the queries scored once (what a twin estimator of another
        projection seed costs an audit), or ``None`` (not estimated).
    """

    mode: str
    reason: str
    plan: tuple[int | None, bool] | None = None
    reserve: int | None = None
    kept_bytes: int = 0
    example_bytes: int = 0
    factor_cache: int = 0
    seconds: dict[str, float] | None = field(default=None)
    note: str | None = None
    fit_seconds: float | None = None

    def query_cache_bytes(self, n: int, queries: int, dim: int) -> int:
        """
        Bytes of what is kept of ``queries`` queries between the passes of an audit, at most ``QUERY_CACHE_BYTES``
        each: exact, their solves on the unchanged rows and, with the set's factors kept, their kernel rows on the set
        and their factors; projected (``dim`` features), their features.
        """
        bound = _cache.QUERY_CACHE_BYTES
        if self.mode != "exact":
            return min(bound, 8 * queries * dim)
        rows = min(bound, 8 * queries * n)
        kept = rows + min(self.factor_cache, queries * self.example_bytes) if self.kept_bytes else 0
        return rows + kept

    def need(self, n: int, queries: int, dim: int, device: torch.device, world: int, n_local: int) -> tuple[int, str]:
        """
        Bytes per process of the mode's large buffers with what is kept of ``queries`` queries between passes, and
        what they are for (``n_local``: this process's training rows, for the projected mode).
        """
        cache = self.query_cache_bytes(n, queries, dim)
        if self.mode == "exact":  # the solve's form, the engine's chunks, and the set's factors where they are kept
            need = plan_bytes(self.plan, n, device, world, self.reserve) + self.kept_bytes + cache
            return need, f"the exact NTK influence of {n} examples ({self.form()})"
        return projected_bytes(n_local, n, dim) + cache, f"the projected NTK influence of {n} examples (k = {dim})"

    def form(self) -> str:
        """The exact solve's form, in words."""
        block, on_disk = self.plan
        if block is None:
            return "two n x n matrices in memory"
        return f"tiles of {block} rows {'on disk' if on_disk else 'in memory'}"


def estimates(options: ModeOptions, estimating: bool) -> bool:
    """Whether :func:`choose_mode` estimates both modes' time (at the nominal rate): under ``"auto"``, or when asked
    (for a plan)."""
    return estimating or options.projection_dim == "auto"


def needs_model_facts(options: ModeOptions, estimating: bool) -> bool:
    """Whether :func:`choose_mode` needs the model's facts: not for a given ``projection_dim`` unless estimating."""
    return options.projection_dim is None or estimates(options, estimating)


def keeps_factors(n: int, example_bytes: int, budget: int, held: int) -> bool:
    """Whether the exact mode keeps the training set's factors (each example's computed once per kernel, tiles
    included): they fit half the memory that its solve's form (``held`` bytes, :func:`plan_bytes`) leaves."""
    return example_bytes * n <= (budget - held) // 2


def query_factor_bound(budget: int, held: int, kept_bytes: int) -> int:
    """Bytes of the queries' Jacobian factors the exact mode keeps between passes (with the set's factors kept): a
    quarter of what the budget leaves beside the solve (``held`` bytes) and the set's factors, at least
    ``QUERY_CACHE_BYTES`` (from the budget, a fixed fact; only the time depends on it, never a number)."""
    return max(_cache.QUERY_CACHE_BYTES, (budget - held - kept_bytes) // 4)


def choose_mode(n: int, options: ModeOptions, machine: MachineFacts, model: ModelFacts | None,
                estimating: bool = False) -> ModeChoice:
    """
    The NTK influence's mode.

    - ``projection_dim`` an integer: projected;
    - ``None``: exact, in the cheapest form of its solve that fits the budget (a ``ValueError`` if none does);
    - ``"auto"``: exact when ``n ≤ max_exact_n``, its solve fits the budget and its estimated time for the planned
      work (the fit, ``planned_refits`` refits and ``planned_queries`` queries' scores after each, at the nominal
      rate) is within ``exact_budget_s`` or the projected mode's estimate is no shorter; else projected, with a note
      that says why and what the others would cost.

    :param n: Training examples.
    :param options: The options.
    :param machine: The machine's facts (with a ``rate`` when estimating or under ``"auto"``).
    :param model: The model's facts (``None`` only when :func:`needs_model_facts` says they are not needed).
    :param estimating: Estimate both modes' time whatever the options (for a plan).
    :return: The choice.
    """
    k = options.projection_dim
    given_k = k not in (None, "auto")
    estimating = estimates(options, estimating)
    if given_k and not estimating:
        return ModeChoice("projected", f"projected: projection_dim={k} was given")
    if model is None:
        raise ValueError("model facts are needed to choose between the modes or to estimate them")
    budget, world, device = machine.budget, machine.world, machine.device
    reserve = engine_reserve(n, model.example_bytes, model.batch_size, model.chunk_mb)
    plan = exact_plan(n, budget, device, world, reserve)
    held = plan_bytes(plan, n, device, world, reserve) if plan is not None else 0
    kept = plan is not None and keeps_factors(n, model.example_bytes, budget, held)
    kept_bytes = n * model.example_bytes if kept else 0
    factor_cache = query_factor_bound(budget, held, kept_bytes) if kept else 0
    choice = ModeChoice("projected", "", plan, reserve, kept_bytes, model.example_bytes, factor_cache)
    work = dict(refits=int(options.planned_refits), queries=int(options.planned_queries))
    if estimating:  # counted operations at the nominal rate: the fit of a given mode needs none of it
        rate = machine.rate
        estimate = exact_seconds(n, model.factor, rate, world, model.example_seconds, model.panel, plan and plan[0],
                                 kept=kept, query_bytes=model.example_bytes, factor_cache=factor_cache,
                                 pair_flops=model.pair_flops, pass_seconds=model.pass_seconds,
                                 rows=model.pass_rows or model.batch_size, **work)
        projected_time = partial(projected_seconds, n, model.factor, int(k) if given_k else DEFAULT_PROJECTION_DIM,
                                 rate, world, example_seconds=model.projected_seconds,
                                 plan_seconds=model.projection_plan_seconds)
        projected = projected_time(**work)
        choice.seconds = {"exact": estimate, "projected": projected}
        choice.fit_seconds = projected_time(refits=0, queries=work["queries"])
    if given_k:
        choice.reason = f"projected: projection_dim={k} was given"
        return choice
    budget_text = f"{_gib(budget)} budget per process ({machine.budget_text})"
    if k is None:
        if plan is None:
            raise ValueError(
                f"projection_dim must be 'auto' or an integer on {n} training examples within the "
                f"{budget / _GIB:.1f} GiB budget per process, got None: even the exact NTK influence's "
                "out-of-core solve (tiles on disk) needs more for its blocks of the changed rows; raise "
                "memory_limit_gb or shard over more processes"
            )
        choice.mode = "exact"
        choice.reason = f"exact: projection_dim=None was given; the solve ({choice.form()}) fits the {budget_text}"
        return choice
    # "auto": the same rule in one process and in a group, so that a group never runs the projected mode where one
    # process would run the exact one
    what = (f"the fit, {work['refits']} refit(s) and the scores of {work['queries']} queries after each "
            f"(nominal {machine.rate / 1e9:.0f} GFLOP/s: {machine.rate_text})")
    if options.max_exact_n is not None and n > options.max_exact_n:
        reason = f"{n} training examples exceed max_exact_n={options.max_exact_n}"
    elif plan is None:
        reason = f"its solve does not fit the {budget_text}, even with tiles on disk"
    elif estimate > options.exact_budget_s and projected >= estimate:
        # over the budget, but the projected mode would take longer still: the budget cannot be met either way
        choice.mode = "exact"
        choice.reason = (f"exact: projection_dim='auto'; the estimated {duration_text(estimate)} for {what} is over "
                         f"exact_budget_s={options.exact_budget_s:g} s, but the projected mode would take longer "
                         f"(about {duration_text(projected)}), so the exact one runs")
        return choice
    elif estimate > options.exact_budget_s:
        reason = (f"it would take about {duration_text(estimate)} for {what}, over exact_budget_s="
                  f"{options.exact_budget_s:g} s ({n} examples, {model.factor} Jacobian factor elements each)")
    else:
        choice.mode = "exact"
        choice.reason = (f"exact: projection_dim='auto', the solve ({choice.form()}) fits the {budget_text} and the "
                         f"estimated {duration_text(estimate)} for {what} is within exact_budget_s="
                         f"{options.exact_budget_s:g} s")
        return choice
    choice.note = (
        f"the exact NTK influence is not affordable here: {reason}. Running the projected mode "
        f"(k = {DEFAULT_PROJECTION_DIM}, about {duration_text(projected)}), whose scores two "
        "projection seeds reproduce only loosely at small ridges (the report states this run's seed agreement). "
        f"Other options: the exact mode (projection_dim=None: about {duration_text(estimate)} with "
        f"{world} process{'es' if world > 1 else ''}, about {duration_text(estimate / 4)} with "
        f"{4 * world} under torchrun), a GPU (device='cuda'), or the gradient estimator (influence='gradient', "
        "TracIn at the final weights: a different estimator, minutes)"
    )
    choice.reason = f"projected: projection_dim='auto' and {reason}"
    return choice


def _gib(nbytes: float) -> str:
    """``nbytes`` in GiB for a message, with the digits a small budget needs."""
    return f"{nbytes / _GIB:.2f} GiB" if nbytes < 10 * _GIB else f"{nbytes / _GIB:.1f} GiB"
