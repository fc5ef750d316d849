"""
Per-example derivatives of a model's outputs, the building blocks of the NTK strategies: the
whole-model ``torch.func`` Jacobian (exact for any model), the probe pass that finds the layers a
factorised strategy can take, the forward/backward pass that captures those layers' inputs
and output gradients class by class, and the single ``torch.func`` pass that gives the same factors
with the classes batched (:func:`probed_jacobians`).

Hooks live only for the duration of one forward pass (removed in ``finally``) and gradients are
taken with :func:`torch.autograd.grad` or ``torch.func`` transforms, so the model's ``.grad`` fields
are never written.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from art_malleability._utils.torch_utils import model_device_dtype, trainable_parameters

OutputFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# A check of one call of a watched module: (index, module, positional inputs, output) -> usable
CallCheck = Callable[[int, nn.Module, tuple, torch.Tensor], bool]


def check_model(model: object) -> tuple[torch.device, torch.dtype]:
    """
    Check that ``model`` is a module with trainable parameters.

    :param model: The candidate.
    :return: The model's ``(device, dtype)``.
    :raises TypeError: If it is not a :class:`torch.nn.Module`.
    :raises ValueError: If none of its parameters has ``requires_grad=True``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not trainable_parameters(model):
        raise ValueError("model must have trainable parameters, got none with requires_grad=True")
    return model_device_dtype(model)


def plain_layers(model: nn.Module, types: tuple[type, ...]) -> list[tuple[str, nn.Module, bool, bool]]:
    """
    Modules of ``model`` of the given types whose ``weight`` (and ``bias``) are plain parameters used
    nowhere else, with at least one of them trainable: the candidates of a factorised (per-layer)
    treatment. Parametrised or tied weights are left out (they go through a generic fallback).

    :param model: The model.
    :param types: Module classes to look for.
    :return: ``(name, module, weight trainable, bias trainable)`` per candidate, in registration order.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, types):
            continue
        weight = module._parameters.get("weight")
        bias = module._parameters.get("bias")
        if weight is None or (module.bias is not None and bias is None):
            continue  # parametrised weights are not plain parameters
        if uses[id(weight)] != 1 or (bias is not None and uses[id(bias)] != 1):
            continue  # shared (tied) parameters go through the fallback
        w_train = weight.requires_grad
        b_train = bias is not None and bias.requires_grad
        if w_train or b_train:
            found.append((name, module, w_train, b_train))
    return found


def per_example_jacobian(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    output_fn: OutputFn | None = None,
) -> torch.Tensor:
    """
    Per-example Jacobians of the model outputs with respect to some of its parameters, with
    ``torch.func.vmap(torch.func.jacrev(...))`` over ``functional_call`` (exact for any model whose
    forward pass treats examples independently).

    :param model: The model.
    :param params: ``(name, parameter)`` pairs to differentiate (the others are held fixed).
    :param x: Inputs ``(n, ...)``.
    :param y: Labels passed to ``output_fn``, or ``None``.
    :param output_fn: Map ``(outputs, labels) -> (n, C)`` applied after the model; ``None`` keeps the outputs.
    :return: ``(n, C, P)`` with the parameters flattened and concatenated in the order given.
    """
    names = [name for name, _ in params]
    values = {name: p.detach() for name, p in params}

    def head(out: torch.Tensor, yi: torch.Tensor | None) -> torch.Tensor:
        return (out if output_fn is None else output_fn(out, yi)).reshape(-1)

    if y is None:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), None)

        args: tuple = (values, x)
        in_dims: tuple = (None, 0)
    else:

        def single(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return head(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        args = (values, x, y)
        in_dims = (None, 0, 0)

    with torch.no_grad():
        jd = vmap(jacrev(single), in_dims=in_dims)(*args)
    n = x.shape[0]
    return torch.cat([jd[name].reshape(n, jd[name].shape[1], -1) for name in names], dim=2)


@contextlib.contextmanager
def _hooked(modules: list[nn.Module], hook: Callable, prepend: bool = False) -> Iterator[None]:
    """Register ``hook(k, module, inputs, output)`` on every module for the duration of the block."""
    handles = [m.register_forward_hook(partial(hook, k), prepend=prepend) for k, m in enumerate(modules)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def probe_calls(
    model: nn.Module, modules: list[nn.Module], x: torch.Tensor, check: CallCheck
) -> tuple[torch.Tensor, list[list[bool]]]:
    """
    One forward pass without gradients that records, for every watched module, the outcome of
    ``check`` on each of its calls: a module usable by a factorised strategy is called exactly once,
    with a result of ``[True]``.

    :param model: The model.
    :param modules: The watched modules.
    :param x: A probe batch.
    :param check: ``(index, module, inputs, output) -> bool`` for one call.
    :return: The model's outputs and the outcomes per watched module.
    """
    calls: list[list[bool]] = [[] for _ in modules]

    def record(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        calls[k].append(check(k, module, inputs, output))

    with _hooked(modules, record), torch.no_grad():
        out = model(x)
    return out, calls


def forward_capturing(
    modules: list[nn.Module], forward: Callable[[], torch.Tensor], *, clone_inputs: bool, hint: str = ""
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """
    A forward pass with gradients that captures the input and the output of every watched module,
    so that output gradients can be taken (:func:`class_gradients`). Modules downstream receive a
    copy of each output, so in-place operations after a layer cannot alter the captured tensor.

    :param modules: The watched modules, each called once per pass.
    :param forward: The pass itself, returning the outputs to differentiate.
    :param clone_inputs: Store a copy of each input (guards against in-place changes after the layer).
    :param hint: Suffix of the error message (``"; <hint>"``).
    :return: The outputs and ``(input, output)`` per module, inputs detached.
    :raises RuntimeError: If a watched module was not called.
    """
    captured: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(modules)

    def hook(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        inp = inputs[0].detach()
        captured[k] = (inp.clone() if clone_inputs else inp, output)
        return output.clone()

    with _hooked(modules, hook, prepend=True), torch.enable_grad():
        logits = forward()
    if any(c is None for c in captured):
        raise RuntimeError(
            f"model must call every layer seen when planning in each forward pass, got one not called{hint}"
        )
    return logits, captured


def class_gradients(
    logits: torch.Tensor, outs: list[torch.Tensor]
) -> Iterator[tuple[int, tuple[torch.Tensor | None, ...]]]:
    """
    Gradients of each output column ``c`` (summed over examples) with respect to the captured
    layer outputs, one backward pass per column; ``None`` where a layer does not reach it.

    :param logits: ``(n, C)`` outputs of a :func:`forward_capturing` pass.
    :param outs: The captured layer outputs.
    :return: An iterator of ``(c, gradients per layer)``.
    """
    n_out = logits.shape[1]
    for c in range(n_out):
        if logits.requires_grad:
            yield c, torch.autograd.grad(logits[:, c].sum(), outs, retain_graph=c < n_out - 1, allow_unused=True)
        else:
            yield c, (None,) * len(outs)


class InputChanged(Exception):
    """A watched module's input was changed in place after the module used it: keep copies instead."""


def probed_jacobians(
    model: nn.Module,
    modules: list[nn.Module],
    keep_inputs: list[bool],
    shapes: list[tuple[int, ...]],
    params: list[tuple[str, nn.Parameter]],
    x: torch.Tensor,
    y: torch.Tensor | None,
    output_fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    zeros: dict[tuple[int, ...], torch.Tensor] | None = None,
    contiguous: list[bool] | None = None,
    clone_inputs: bool = False,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor], torch.Tensor | None]:
    """
    Per-example factors of one batch in a single ``torch.func`` call: one forward pass and one backward pass
    batched over the ``C`` outputs (``jacrev``, whose reverse pass is ``vmap``-ped over the one-hot cotangents).

    A zero *probe* is added to the output of every watched module (a forward hook), so the derivative of output
    ``c`` with respect to a probe is that module's per-example output gradient ``δ_c``; the module's input is
    returned beside it. Without ``params`` the pass runs on the whole batch (the outputs summed over examples,
    which treat examples independently, so the gradient of a probe's row is its example's gradient); with
    ``params`` the call is ``vmap(jacrev(...))`` over the examples, giving the per-example Jacobians of those
    parameters in the same pass.

    :param model: The model (evaluated as is; call it in evaluation mode).
    :param modules: Watched modules, each called once per forward pass.
    :param keep_inputs: Per watched module, whether its input is returned (a trained weight).
    :param shapes: Per watched module, the shape of one example's output (the probe's shape).
    :param params: ``(name, parameter)`` pairs whose per-example Jacobians are wanted (the others held fixed).
    :param x: Inputs ``(n, ...)``.
    :param y: Labels passed to ``output_fn``, or ``None``.
    :param output_fn: Map ``(model outputs, labels) -> (n, C)``.
    :param zeros: Zero probes by shape, kept between calls (filled here; never written to).
    :param contiguous: Per watched module, whether its output gradients are returned contiguous (default: all);
        otherwise they may be a view with the examples and the outputs in the other order in memory.
    :param clone_inputs: Copy the kept inputs; otherwise they are kept as they are, and the call raises
        :class:`InputChanged` if the forward pass changed one in place after its module used it (then call again
        with copies).
    :return: Per watched module its input ``(n, *in_shape)`` (``None`` where not kept) and its output gradients
        ``(n, C, *shape)``, and the Jacobian ``(n, C, P)`` of ``params`` (``None`` without any).
    :raises RuntimeError: If a watched module is not called in the pass.
    :raises InputChanged: If a kept input was changed in place (without ``clone_inputs``).
    """
    probes: list[torch.Tensor] = []
    inputs: list[torch.Tensor | None] = [None] * len(modules)
    called: set[int] = set()

    versions: list[int] = [0] * len(modules)

    def hook(k: int, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        called.add(k)
        if keep_inputs[k]:
            # a later in-place change of the input must not reach the factor: copied, or checked afterwards
            inputs[k] = args[0].clone() if clone_inputs else args[0]
            versions[k] = args[0]._version
        return output + probes[k]

    def captured() -> tuple[torch.Tensor, ...]:
        if len(called) < len(modules):
            raise RuntimeError(
                "model must call every layer seen when planning in each forward pass, got one not called; "
                "use method='jacobian'"
            )
        if not clone_inputs and any(
            inp is not None and inp._version != v for inp, v in zip(inputs, versions, strict=True)
        ):
            raise InputChanged
        return tuple(inp for inp, keep in zip(inputs, keep_inputs, strict=True) if keep)

    def run(probe_values: list[torch.Tensor], forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        probes[:] = probe_values
        inputs[:] = [None] * len(modules)
        called.clear()
        return forward()

    n = x.shape[0]
    zeros = {} if zeros is None else zeros
    contiguous = [True] * len(modules) if contiguous is None else contiguous

    def zero(shape: tuple[int, ...]) -> torch.Tensor:
        z = zeros.get(shape)
        if z is None or z.dtype != x.dtype or z.device != x.device:
            z = zeros[shape] = x.new_zeros(shape)
        return z

    with _hooked(modules, hook, prepend=True), torch.no_grad():
        if not params:

            def whole(probe_values: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
                g = run(probe_values, lambda: output_fn(model(x), y))
                return g.sum(0), captured()

            d, acts = jacrev(whole, has_aux=True)([zero((n, *shape)) for shape in shapes])
            # (C, n, *shape) -> (n, C, *shape)
            grads = [dk.transpose(0, 1) for dk in d]
            grads = [g.contiguous() if c else g for g, c in zip(grads, contiguous, strict=True)]
            jac = None
        else:
            names = [name for name, _ in params]
            values = {name: p.detach() for name, p in params}

            def single(
                probe_values: list[torch.Tensor], p: dict[str, torch.Tensor], xi: torch.Tensor, *yi: torch.Tensor
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
                labels = yi[0].unsqueeze(0) if yi else None
                g = run(probe_values, lambda: output_fn(functional_call(model, p, (xi.unsqueeze(0),)), labels))
                return g.reshape(-1), tuple(a.squeeze(0) for a in captured())

            probe_values = [zero((1, *shape)) for shape in shapes]
            args: tuple = (probe_values, values, x) if y is None else (probe_values, values, x, y)
            in_dims: tuple = (None, None, 0) if y is None else (None, None, 0, 0)
            (d, jd), acts = vmap(jacrev(single, argnums=(0, 1), has_aux=True), in_dims=in_dims)(*args)
            grads = [dk.squeeze(2) for dk in d]  # (n, C, 1, *shape) -> (n, C, *shape)
            parts = [jd[name].reshape(n, jd[name].shape[1], -1) for name in names]
            jac = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    it = iter(acts)
    return [next(it) if keep else None for keep in keep_inputs], grads, jac

