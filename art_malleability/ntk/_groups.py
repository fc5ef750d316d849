"""
Groups of a model's trainable parameters for :class:`art_malleability.ntk.projection.ProjectedNTK`:
Kronecker-factored layers (``nn.Linear``, ``nn.Conv2d``, as in LoGra), other modules' own
parameters, and a whole-model fallback for the rest (see the projection module's docstring).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from art_malleability._utils.torch_utils import trainable_parameters
from art_malleability.ntk._autograd import plain_layers, probe_calls

# (name, module, weight trained, bias trained) of a Kronecker-factored layer
_Layer = tuple[str, nn.Module, bool, bool]


@dataclass
class Group:
    """One block of the feature vector: a Kronecker-factored layer, a module's own parameters, or the fallback."""

    name: str
    kind: str  # "linear" / "conv" (Kronecker), "module" (module-local vjp) or "fallback" (whole model)
    module: nn.Module | None = None
    weight: bool = False
    bias: bool = False
    d_out: int = 0  # C × out (Kronecker groups)
    d_in: int = 0  # layer input (+1 for the bias), or 1 when only the bias is trained
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)  # the trained parameters covered
    k_out: int = 0
    k_in: int = 0
    k: int = 0  # dimension of this group's block of φ
    p_out: torch.Tensor | None = None  # (k_out, d_out) or None for the identity
    p_in: torch.Tensor | None = None  # (k_in, d_in) or None for the identity
    matrix: torch.Tensor | None = None  # (k, dim) Gaussian when stored; None: identity or generated blocks
    seed: int = 0  # seed of the Gaussian matrix's column blocks
    positions: int = 1  # positions summed over (output pixels of a convolution)
    offset: int = 0

    @property
    def kronecker(self) -> bool:
        """Whether the group is a Kronecker-factored layer."""
        return self.kind in ("linear", "conv")

    @property
    def full_dim(self) -> int:
        """Dimension of the group's unprojected Jacobian."""
        return self.d_out * self.d_in

    def input_side(self, inp: torch.Tensor, length: int) -> torch.Tensor:
        """Layer inputs per position ``(n, L, d_in)`` (unfolded patches for a convolution), with a 1 for the bias."""
        n = inp.shape[0]
        if not self.weight:
            return inp.new_ones((n, length, 1))
        if self.kind == "conv":
            m = self.module
            side = F.unfold(inp, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride).transpose(1, 2)
        else:
            side = inp.reshape(n, -1, inp.shape[-1])
        if self.bias:
            side = torch.cat([side, side.new_ones(side.shape[:2] + (1,))], dim=2)
        return side


def module_gradients(g: Group, inp: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """
    Per-example gradients of a module's own parameters for one class: the vector-Jacobian product
    of the module alone with its output gradient ``d``, vmapped over examples.

    :return: ``(n, P)``, parameters flattened in the group's order.
    """
    names = [name.rsplit(".", 1)[-1] if "." in name else name for name, _ in g.params]
    values = {name: p.detach() for name, (_, p) in zip(names, g.params, strict=True)}
    module = g.module

    def single(params: dict[str, torch.Tensor], xi: torch.Tensor, di: torch.Tensor) -> dict[str, torch.Tensor]:
        _, vjp = torch.func.vjp(lambda p: functional_call(module, p, (xi.unsqueeze(0),)), params)
        return vjp(di.unsqueeze(0))[0]

    with torch.no_grad():
        grads = vmap(single, in_dims=(None, 0, 0))(values, inp, d.detach())
    n = inp.shape[0]
    return torch.cat([grads[name].reshape(n, -1) for name in names], dim=1)


def layer_positions(module: nn.Module, output: torch.Tensor) -> int:
    """Positions a layer's Jacobian sums over: output pixels of a convolution, middle dimensions of a linear layer."""
    if isinstance(module, nn.Conv2d):
        return int(output.shape[2] * output.shape[3])
    return int(math.prod(output.shape[1:-1]))


def _factorisable(module: nn.Module) -> bool:
    """Whether a layer's Jacobian has the Kronecker structure handled here."""
    if isinstance(module, nn.Linear):
        return type(module).forward is nn.Linear.forward
    if isinstance(module, nn.Conv2d):
        return (
            type(module).forward is nn.Conv2d.forward
            and module.groups == 1
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
    return False


def find_groups(
    model: nn.Module, x_probe: torch.Tensor, wanted: Callable[[nn.Parameter | None], bool]
) -> tuple[list[Group], int]:
    """
    Group the wanted trainable parameters of ``model``: layers whose Jacobian is Kronecker-factored,
    other modules called once with their own parameters, and the fallback for the rest.

    :param model: The model.
    :param x_probe: A probe batch (a forward pass finds the modules called exactly once).
    :param wanted: Whether a parameter is to be covered.
    :return: The groups (dimensions unset) and the number of model outputs ``C``.
    """
    kron = _kronecker_layers(model, wanted)
    owners = _owners(model, {id(c[1]) for c in kron}, wanted)
    watched = [c[1] for c in kron] + [o[1] for o in owners]
    positions = [1] * len(watched)

    def check(k: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> bool:
        ok = _usable_call(inputs, output, x_probe.shape[0], module if k < len(kron) else None)
        if ok and k < len(kron):
            positions[k] = layer_positions(module, output)
        return ok

    out, calls = probe_calls(model, watched, x_probe, check)
    if out.dim() != 2:
        raise ValueError(f"model must return outputs of shape (n, C), got shape {tuple(out.shape)}")
    c = int(out.shape[1])
    groups = [_kronecker_group(layer, c, positions[k]) for k, layer in enumerate(kron) if calls[k] == [True]]
    for k, (name, module, own) in enumerate(owners, start=len(kron)):
        if calls[k] == [True]:
            groups.append(Group(name, "module", module, params=own, d_out=c * sum(p.numel() for _, p in own), d_in=1))
    covered = {id(p) for g in groups for _, p in g.params}
    rest = [(n, p) for n, p in trainable_parameters(model) if id(p) not in covered and wanted(p)]
    if rest:
        groups.append(Group("fallback", "fallback", params=rest, d_out=c * sum(p.numel() for _, p in rest), d_in=1))
    return groups, c


def _kronecker_layers(model: nn.Module, wanted: Callable[[nn.Parameter | None], bool]) -> list[_Layer]:
    """Plain ``nn.Linear``/``nn.Conv2d`` layers of the handled kind whose trained parameters are all wanted."""
    return [
        c
        for c in plain_layers(model, (nn.Linear, nn.Conv2d))
        if _factorisable(c[1])
        and all(wanted(p) == t for p, t in ((c[1].weight, c[2]), (c[1].bias, c[3])) if p is not None)
    ]


def _owners(
    model: nn.Module, skip: set[int], wanted: Callable[[nn.Parameter | None], bool]
) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """Submodules (not the root, not in ``skip``) owning wanted parameters used nowhere else."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    owners = []
    for name, module in model.named_modules():
        if module is model or id(module) in skip:
            continue
        own = [(f"{name}.{pname}", p) for pname, p in module._parameters.items() if wanted(p) and uses[id(p)] == 1]
        if own:
            owners.append((name, module, own))
    return owners


def _usable_call(inputs: tuple, output: torch.Tensor, n: int, layer: nn.Module | None) -> bool:
    """
    Whether one call of a watched module treats the ``n`` probe examples as a batch, with the input
    and output ranks a Kronecker-factored ``layer`` needs (``None``: a module group).
    """
    ok = (
        len(inputs) == 1
        and isinstance(inputs[0], torch.Tensor)
        and isinstance(output, torch.Tensor)
        and inputs[0].dim() >= 1
        and output.dim() >= 1
        and inputs[0].shape[0] == n == output.shape[0]
    )
    if ok and isinstance(layer, nn.Conv2d):
        return inputs[0].dim() == 4 and output.dim() == 4
    if ok and layer is not None:
        return inputs[0].dim() >= 2 and output.dim() == inputs[0].dim()
    return ok


def _kronecker_group(layer: _Layer, c: int, positions: int) -> Group:
    """The group of a Kronecker-factored layer with ``c`` model outputs."""
    name, module, w, b = layer
    if isinstance(module, nn.Conv2d):
        kind, n_in, out_size = "conv", module.in_channels * math.prod(module.kernel_size), module.out_channels
    else:
        kind, n_in, out_size = "linear", module.in_features, module.out_features
    params = [(f"{name}.{pname}", p) for pname, p, t in (("weight", module.weight, w), ("bias", module.bias, b)) if t]
    d_in = (n_in if w else 0) + (1 if b else 0)
    return Group(name, kind, module, w, b, d_out=c * out_size, d_in=d_in, params=params, positions=positions)
