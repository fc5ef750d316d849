"""
Sharding an audit over processes with :mod:`torch.distributed`.

Launch every process with ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); the CLI and :func:`init_from_env` then join the process group, with backend
``gloo`` on the CPU and ``nccl`` on CUDA. A library user who already called
:func:`torch.distributed.init_process_group` needs nothing more: with ``distributed="auto"`` the
audit shards itself over the initialised group.

Each process owns a contiguous block of the training examples (:meth:`Shard.bounds`) and runs the attack on
them. The projected NTK influence computes the block's features, sums ``ΦᵀΦ`` and ``ΦᵀY`` with ``all_reduce``
and gathers influence columns with ``all_gather``; the exact one deals the tile rows of its kernel and factor out
over the processes (``art_malleability.linalg._tiles``). Every process ends with the same report (rank 0
alone writes it).

One object stands for the group in one process and in many: a run without a process group (or with
``distributed=False``) gets :data:`ONE_PROCESS`, the group of one process, whose collectives are identities, so
the audit, the estimators and the solvers run the same code whatever the number of processes. Collectives carry
the process group's timeout, so a process that dies makes the others fail with an error instead of hanging (and
``torchrun`` stops the remaining workers when one exits with an error).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from art_malleability._utils.params import DISTRIBUTED, POSITIVE_SECONDS, invalid

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Shard:
    """
    This process's place in its process group: an initialised ``torch.distributed`` group, or the group of this
    process alone (:data:`ONE_PROCESS`, whose collectives are identities and need no ``torch.distributed``).

    :param rank: Rank of this process.
    :param world_size: Number of processes.
    :param backend: Backend of the default process group (``"gloo"``, ``"nccl"``), ``None`` without one.
    """

    rank: int
    world_size: int
    backend: str | None

    def bounds(self, n: int) -> tuple[int, int]:
        """
        :param n: Number of training examples.
        :return: ``(start, stop)`` of this rank's contiguous block (sizes differ by at most one).
        """
        return self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size

    def _device(self, t: torch.Tensor) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """
        :param t: A tensor of the same shape on every rank.
        :param op: ``"sum"`` or ``"max"``.
        :return: The reduction over ranks, on ``t``'s device: a new tensor, or ``t`` itself in a group of one process
            (``t`` is never modified).
        """
        if self.world_size == 1:
            return t
        work = t.detach().to(self._device(t), copy=True).contiguous()
        dist.all_reduce(work, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return work.to(t.device)

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """
        :param t: ``(n_rank, ...)`` rows of this rank (row counts may differ between ranks).
        :return: The rows of all ranks stacked in rank order (``t`` itself in a group of one process).
        """
        if self.world_size == 1:
            return t
        device = self._device(t)
        count = torch.tensor([t.shape[0]], dtype=torch.int64, device=device)
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count)
        sizes = [int(c) for c in counts]
        width = max(sizes)
        padded = torch.zeros((width, *t.shape[1:]), dtype=t.dtype, device=device)
        padded[: t.shape[0]] = t.detach().to(device)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)]).to(t.device)

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """
        :param t: ``(rows, n_rank)`` columns of this rank.
        :return: ``(rows, n)``: the columns of all ranks side by side in rank order (``t`` itself in a group of one
            process).
        """
        if self.world_size == 1:
            return t
        return self.all_gather_rows(t.T.contiguous()).T.contiguous()

    def broadcast(self, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
        """
        :param t: The tensor on rank ``src`` (ignored elsewhere).
        :param shape: Its shape, known to every rank.
        :param dtype: Its dtype.
        :param src: The sending rank.
        :param device: Where the result lives.
        :return: Rank ``src``'s tensor on every rank (on ``src`` itself, ``t``).
        """
        if self.rank == src and t is None:
            raise ValueError(f"t must be a tensor on the sending rank {src}, got None")
        if self.world_size == 1:
            return t
        comm = torch.device(self._device(torch.empty(0)))
        work = (t.detach().to(comm, dtype).contiguous() if self.rank == src
                else torch.empty(shape, dtype=dtype, device=comm))
        dist.broadcast(work, src=src)
        return t if self.rank == src else work.to(device)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """:return: ``obj`` of rank ``src`` on every rank (pickled)."""
        if self.world_size == 1:
            return obj
        payload = [obj]
        dist.broadcast_object_list(payload, src=src, device=self._device(torch.empty(0)))
        return payload[0]

    def raise_if_any(self, error: BaseException | None) -> None:
        """
        Collective: fail on every process when any process failed, so that none is left waiting in a
        later collective. The failing process raises its own error; the others a ``RuntimeError``.

        :param error: This process's error, or ``None``.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        failed = int(self.all_reduce(torch.tensor([0 if error is None else 1], dtype=torch.int64), "max")[0])
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("another process of the group failed (its error is in its own output); stopping")

    def run_everywhere(self, fn: Callable[..., Any], *args: Any) -> Any:
        """
        Collective: ``fn(*args)`` on every process, then :meth:`raise_if_any`, so that a failure on one process is
        raised on every process and none is left waiting in a later collective.

        :return: ``fn``'s result on this process.
        """
        error, result = None, None
        try:
            result = fn(*args)
        except Exception as failure:  # noqa: BLE001 - raised on every process below
            error = failure
        self.raise_if_any(error)
        return result

    def agree(self, value: object, what: str) -> None:
        """
        Check that ``value`` is the same on every rank.

        :raises ValueError: If it differs (``what`` names it in the message).
        """
        if self.world_size == 1:
            return
        code = int.from_bytes(hashlib.sha256(pickle.dumps(value)).digest()[:7], "little")
        digest = torch.tensor([code], dtype=torch.int64)
        low, high = self.all_reduce(digest, "max"), -self.all_reduce(-digest, "max")
        if int(low) != int(high):
            raise ValueError(f"{what} must be the same on every process, got different values between the ranks")


#: The group of one process: rank 0 of 1, every collective the identity.
ONE_PROCESS = Shard(rank=0, world_size=1, backend=None)


def current_shard(distributed: bool | str = "auto") -> Shard:
    """
    The process group of this process: the initialised ``torch.distributed`` group, or :data:`ONE_PROCESS`.

    :param distributed: ``"auto"`` (shard when a ``torch.distributed`` default group with more than
        one process is initialised), ``True`` (require one) or ``False`` (never shard).
    :return: A :class:`Shard` (:data:`ONE_PROCESS` for a single-process run).
    :raises InvalidParameterError: For a value other than those (the rule
        :data:`~art_malleability._utils.params.DISTRIBUTED`), or ``True`` with no initialised group (a ``ValueError``,
        naming ``distributed``).
    """
    DISTRIBUTED(distributed, "distributed")
    if distributed is False:
        return ONE_PROCESS
    ready = dist.is_available() and dist.is_initialized()
    if not ready:
        if distributed is True:
            raise invalid(
                "distributed", "be 'auto' or False without an initialised torch.distributed process group", True,
                "; launch with torchrun and call torch.distributed.init_process_group (or "
                "art_malleability.distributed.init_from_env)",
            )
        return ONE_PROCESS
    world = dist.get_world_size()
    if world == 1 and distributed == "auto":
        return ONE_PROCESS
    return Shard(rank=dist.get_rank(), world_size=world, backend=str(dist.get_backend()))


#: What gloo and the c10d store say when a peer stops answering or goes away (gloo raises a plain ``RuntimeError``).
_PEER_FAILURE = re.compile(
    r"Timed out waiting \d+ms|Connection (closed|reset) by peer|Connect timeout|Read error|Write error|gloo/transport|"
    r"Socket Timeout|wait timeout after"
)


def peer_failure(error: BaseException) -> str | None:
    """
    Whether an error says that another process of the group failed or stopped answering: a
    ``torch.distributed`` error (``DistBackendError``, ``DistStoreError``, ``DistNetworkError``) or gloo's
    ``RuntimeError`` for a timed-out or closed connection ("Timed out waiting 30000ms for recv operation to
    complete").

    :param error: Any error.
    :return: Its first line without gloo's source location, or ``None`` for any other error.
    """
    for cause in (error, error.__cause__, error.__context__):  # also when package code re-raised it
        if cause is None:
            continue
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if isinstance(cause, getattr(dist, "DistError", ())) or (
            isinstance(cause, RuntimeError) and _PEER_FAILURE.search(text)
        ):
            return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return None


def launched_by_torchrun() -> bool:
    """Whether the environment describes a multi-process launch (``torchrun`` sets ``WORLD_SIZE`` and ``RANK``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Shard:
    """
    Join the process group described by the ``torchrun`` environment (``env://`` rendezvous),
    unless one is initialised already; do nothing outside a multi-process launch.

    :param backend: ``"gloo"``, ``"nccl"``, or ``None`` for ``nccl`` when CUDA is available and
        ``gloo`` otherwise.
    :param timeout_s: Timeout of every collective, in seconds: a process that stops answering
        makes the others fail after this long.
    :return: This process's :class:`Shard` (:data:`ONE_PROCESS` in a single-process run).
    """
    POSITIVE_SECONDS(timeout_s, "timeout_s")
    if not dist.is_initialized():
        if not launched_by_torchrun():
            return ONE_PROCESS
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=float(timeout_s)))
        logger.info("joined process group: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return current_shard("auto")
