"""Small PyTorch helpers shared across the package.

Everything here follows the package rule of never mutating what the user passed: models are
deep-copied before any work, inputs are copied when converted to tensors, and helpers that
change a module (:func:`frozen_parameters_to_buffers`) are meant for such working copies only.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import hashlib
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

# resolve_device lives beside the device rule it applies, and is this module's name for it as before
from art_malleability._utils.params import DTYPE
from art_malleability._utils.params import resolve_device as resolve_device

logger = logging.getLogger(__name__)


def check_dtype(dtype: torch.dtype, name: str = "dtype") -> torch.dtype:
    """
    Check that ``dtype`` is a floating-point :class:`torch.dtype`.

    :param dtype: The dtype to check.
    :param name: Name of the argument, used in the error message.
    :return: ``dtype`` unchanged.
    :raises InvalidParameterTypeError: If ``dtype`` is not a floating-point torch dtype (the rule
        :data:`~art_malleability._utils.params.DTYPE`, naming ``name``; a ``TypeError``).
    """
    return DTYPE(dtype, name)


def to_tensor(
    x: np.ndarray | torch.Tensor,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """
    Convert an array to a tensor on ``device``, always as a copy (never a view of ``x``).

    :param x: A numpy array or tensor.
    :param device: Target device.
    :param dtype: Target dtype; ``None`` keeps the dtype of ``x``.
    :return: A new tensor that does not share memory with ``x`` and does not require grad.
    """
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=device, dtype=dtype, copy=True)
    return torch.tensor(np.asarray(x), device=device, dtype=dtype)


def working_copy(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None) -> nn.Module:
    """
    Deep copy of ``model`` on ``device`` and in ``dtype`` (floating-point parameters and buffers
    only), in evaluation mode. The original model is left untouched; ``requires_grad`` flags and
    any context buffers (transductive models) are carried along by the copy.

    :param model: The user's model.
    :param device: Device for the copy.
    :param dtype: Floating-point dtype for the copy; ``None`` keeps the model's dtype.
    :return: The working copy.
    """
    clone = copy.deepcopy(model)
    if dtype is None:
        clone = clone.to(device=device)
    else:
        clone = clone.to(device=device, dtype=dtype)
    return clone.eval()


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """
    Named parameters of ``model`` with ``requires_grad=True`` (shared parameters listed once).

    :param model: A module.
    :return: List of ``(name, parameter)`` pairs in registration order.
    """
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """
    Device and floating-point dtype of a model, read from its first floating-point parameter
    (or buffer when it has no parameters).

    :param model: A module.
    :return: ``(device, dtype)``; ``(cpu, torch.get_default_dtype())`` for a module without
        floating-point tensors.
    """
    tensors: Iterator[torch.Tensor] = iter([*model.parameters(), *model.buffers()])
    for t in tensors:
        if t.is_floating_point():
            return t.device, t.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def numpy_dtype(model: nn.Module) -> np.dtype:
    """
    The numpy dtype of a model's floating-point dtype: what an ART classifier's ``predict`` must be given (it passes
    numpy arrays to the model as they are), float64 for a float64 model.

    :param model: The classifier's model.
    :return: The dtype.
    """
    return torch.empty((), dtype=model_device_dtype(model)[1]).numpy().dtype


def frozen_parameters_to_buffers(module: nn.Module) -> nn.Module:
    """
    Re-register every parameter with ``requires_grad=False`` as a (persistent) buffer of the
    same name, in place. Meant for working copies only: libraries that differentiate with
    respect to ``module.parameters()`` then see only the trainable ones, while
    ``state_dict`` keys stay the same so checkpoints still load.

    :param module: A module, typically a working copy made by :func:`working_copy`.
    :return: ``module`` itself.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not param.requires_grad:
                del sub._parameters[name]
                sub.register_buffer(name, param.detach())
    return module


@contextlib.contextmanager
def no_tf32(device: torch.device) -> Iterator[None]:
    """
    Context manager that turns TF32 off for CUDA matrix products and cuDNN convolutions while
    kernels are computed (TF32 silently rounds float32 GEMMs to 10 mantissa bits), and restores
    the previous settings afterwards. Does nothing on other devices.

    :param device: The compute device.
    """
    if device.type != "cuda":
        yield
        return
    matmul_flag = torch.backends.cuda.matmul.allow_tf32
    cudnn_flag = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_flag
        torch.backends.cudnn.allow_tf32 = cudnn_flag


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """
    Context manager for loops of small matrix products (the deconvolutions' EM steps): one thread for torch and for
    the BLAS behind numpy, restored afterwards. Threads gain nothing on products this small, and on a machine whose
    cores other processes keep busy they lose: an EM of 500 steps on a 400 × 101 likelihood took 18 s with two
    threads against 0.45 s with one.
    """
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """
    Context manager that puts ``model`` (and every submodule) in evaluation mode and restores
    each submodule's own ``training`` flag afterwards.

    :param model: A module.
    """
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield model
    finally:
        for m, flag in flags:
            m.training = flag


def available_memory(device: torch.device) -> int:
    """
    Bytes that can still be allocated on ``device``: free CUDA memory, or on the CPU the kernel's
    ``MemAvailable`` estimate (``/proc/meminfo``; free physical pages elsewhere).

    :param device: The compute device.
    :return: Bytes available.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def total_memory(device: torch.device) -> int:
    """
    Bytes of memory ``device`` has in all, a fixed fact of the machine (unlike :func:`available_memory`, which depends
    on what other processes hold at the moment): the CUDA device's total memory, or the CPU's ``MemTotal``.

    :param device: The compute device.
    :return: Bytes.
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's ``malloc_trim``, or ``None`` where the C library has none (another system, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """
    Hand back to the system the memory that the C allocator holds free (glibc's ``malloc_trim(0)``; elsewhere
    nothing). glibc keeps freed blocks of up to 32 MiB inside its heaps once a block that size has been freed (its
    mmap threshold rises to it), and an audit frees thousands of blocks of scores and their temporaries: without
    this, the resident memory of a 60,000-example audit with 10,000 queries grew to 11.8 GiB, of which 3.6 GiB were
    live arrays. Only free memory is returned; nothing is changed for later allocations. It takes milliseconds.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def tensor_digest(x: torch.Tensor) -> tuple:
    """
    Identity of a batch of inputs, to recognise the same inputs on a later call.

    :param x: A tensor.
    :return: ``(shape, dtype, SHA-1 of the bytes)``.
    """
    data = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # hashed in place, not copied
    return tuple(x.shape), str(x.dtype), hashlib.sha1(data).hexdigest()
