"""
Snapshots of everything an audit must leave as it found it.

ART's ``loss_gradient`` switches the model to evaluation mode and accumulates parameter gradients,
and its attacks draw from numpy's global generator; :func:`preserved` undoes all of that on exit,
on success and on failure.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

logger = logging.getLogger(__name__)


@contextmanager
def preserved(module: torch.nn.Module, loss: torch.nn.Module | None = None) -> Iterator[None]:
    """
    Restore a module's parameters, buffers, training modes, ``requires_grad`` flags and ``.grad``
    fields, a loss module's ``reduction``, and the global random states of ``random``, numpy and
    torch (CUDA included), when the block exits.

    Tensors are restored in place, so references held elsewhere (an optimizer, say) stay valid.

    :param module: The model to protect.
    :param loss: Optional loss module whose ``reduction`` attribute is protected.
    """
    tensors = [(t, t.detach().clone()) for t in module.state_dict(keep_vars=True).values()]
    modes = [(m, m.training) for m in module.modules()]
    params = list(module.parameters())
    flags = [p.requires_grad for p in params]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    reduction = getattr(loss, "reduction", None)
    try:
        with preserved_rng():
            yield
    finally:
        with torch.no_grad():
            for tensor, saved in tensors:
                if tensor.shape != saved.shape or tensor.dtype != saved.dtype:
                    tensor.data = saved
                else:
                    tensor.copy_(saved)
        for m, mode in modes:
            m.training = mode
        for p, flag, grad in zip(params, flags, grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad
        if loss is not None and reduction is not None:
            loss.reduction = reduction


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the global random states of ``random``, numpy and torch (CUDA included) when the block exits."""
    rng_states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(rng_states[0])
        np.random.set_state(rng_states[1])
        torch.set_rng_state(rng_states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
